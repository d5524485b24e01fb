"""Files someone else wrote (issue 27, findings 8 and 9, and the loader they share).

memtop.base.untrusted reads them: regular files only, a size cap, a depth limit found by scanning
before the parser recurses, numbers within +-2^64; one UntrustedInput with a one-line message.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from memtop.agent.oom import encode_report, report_name
from memtop.base.untrusted import (
    MAX_DEPTH,
    UntrustedInput,
    check_depth,
    load_json_file,
    loads,
    loads_toml,
    read_regular,
)
from memtop.cli import main
from memtop.ui import config


def _finishes(call, seconds: float = 10.0):  # type: ignore[no-untyped-def]
    """call() on a thread; its result, or an AssertionError if it is still running after
    `seconds` (a hang must fail the test, not the suite)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


# ------------------------------------------------------------------------- the loader


@pytest.mark.parametrize(
    "text",
    [
        b"[" * 200_000,
        b'{"a":' * 100_000,
        b'["x", ' + b"[" * 65 + b"]" * 66,
        b'["]", "\\\\", ' + b"[" * 65 + b"]" * 66,  # a bracket and a backslash in strings
        b'["' + b"]" * 1000 + b'", ' + b"[" * 65 + b"]" * 66,  # closers in a string hide none
    ],
)
def test_deep_nesting_is_refused_before_parsing(text: bytes):
    with pytest.raises(UntrustedInput, match=f"deeper than {MAX_DEPTH} levels"):
        check_depth(text)


@pytest.mark.parametrize(
    "text",
    [
        b"[" * 64 + b"]" * 64,
        b'["' + b"[" * 1000 + b'"]',  # brackets in a string are text
        b'["\\"' + b"{" * 1000 + b'"]',  # after an escaped quote, still in the string
        b'["a", "' + b"]" * 1000 + b'", ' + b"[" * 63 + b"]" * 64,  # closers in a string
        b"[]" * 500_000,
    ],
)
def test_brackets_that_do_not_nest_pass(text: bytes):
    check_depth(text)


def test_the_depth_scan_is_linear_on_hostile_strings():
    # Each an unterminated string a naive regex would retry from every later quote.
    for text in (b'["' + b'\\"' * 500_000, b'"' * 1_000_000, b'"\\' * 500_000):
        started = time.monotonic()
        with pytest.raises(UntrustedInput):
            check_depth(b"[" * 100 + text)
        assert time.monotonic() - started < 2.0
    for toml in (b"x = '''" * 9_000, b'x = """' * 9_000, b'x = "\\"' * 8_000):
        started = time.monotonic()
        with pytest.raises(UntrustedInput):
            loads_toml(b"x = " + b"[" * 100 + toml)
        assert time.monotonic() - started < 2.0


def test_a_string_heavy_reply_is_scanned_fast():
    # 1.6 M strings in 15 MB (a fleet reply): a regex match per string took 8 s and 230 MB.
    series = b'{"metric":{"__name__":"memtop_allocated_bytes","hostname":"gpu-node-001",'
    series += b'"pid":"1234","UUID":"GPU-0"},"value":[1700000000.5,"1073741824"]},'
    text = b'{"data":{"result":[' + series * 100_000 + b"{}]}}"
    started = time.monotonic()
    check_depth(text)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    "text",
    [
        b"x = " + b"[" * 65 + b"]" * 65,
        b"x = ['''a'''', " + b"[" * 65 + b"]" * 66,  # a literal string ending in a quote
        b"x = " + b"{a = " * 65,
    ],
)
def test_deep_toml_is_refused(text: bytes):
    with pytest.raises(UntrustedInput, match=f"deeper than {MAX_DEPTH} levels"):
        loads_toml(text)


@pytest.mark.parametrize(
    "text",
    [
        b'x = """a"b' + b"[" * 1000 + b'"""',  # in a multi-line string
        b"x = '''" + b"{" * 1000 + b"'''",
        b"# " + b"[" * 1000 + b"\nx = 1",  # in a comment
        b"x = '" + b"[" * 1000 + b"'",
    ],
)
def test_toml_strings_and_comments_are_not_nesting(text: bytes):
    assert loads_toml(text)["x"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b'{"t": 1e400}', "out of range"),
        (b'{"t": Infinity}', "out of range"),
        (b'{"t": NaN}', "out of range"),
        (b'{"t": ' + b"9" * 400 + b"}", "out of range"),
        (b'{"t": 18446744073709551617}', "out of range"),  # 2^64 + 1
        (b'{"t": -2e19}', "out of range"),
        (b"{not json", "is not JSON"),
        (b'{"a": "\xff"}', "is not JSON"),
    ],
)
def test_json_out_of_range_or_broken_is_one_line(text: bytes, why: str):
    with pytest.raises(UntrustedInput, match=why) as caught:
        loads(text)
    assert "\n" not in str(caught.value)


def test_json_in_range_is_read_as_json_reads_it():
    text = b'{"a": [1.5e-05, 18446744073709551616, -3, 1795564729.46], "b": "x"}'
    assert loads(text) == json.loads(text)


def test_only_regular_files_of_bounded_size(tmp_path: Path, fifo: Path):
    with pytest.raises(UntrustedInput, match=r"not a regular file \(a FIFO\)"):
        _finishes(lambda: read_regular(fifo, 1024))
    with pytest.raises(UntrustedInput, match=r"not a regular file \(a character device\)"):
        _finishes(lambda: read_regular("/dev/zero", 1024))
    with pytest.raises(UntrustedInput, match=r"not a regular file \(a directory\)"):
        read_regular(tmp_path, 1024)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    with pytest.raises(UntrustedInput, match="larger than 1 KiB"):
        load_json_file(big, 1024)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 1024)
    link = tmp_path / "link"
    link.symlink_to(big)
    with pytest.raises(UntrustedInput, match=r"not a regular file \(a symbolic link\)"):
        read_regular(link, 4096, follow_symlinks=False)
    assert read_regular(link, 4096) == b" " * 2048


def test_what_is_not_a_regular_file_is_never_opened(fifo: Path):
    # A writer's open() of a FIFO returns once a reader opens it: it still waits after the
    # check, so the check opened nothing (as root, opening a device runs its driver's open()).
    opened = threading.Event()

    def writer() -> None:
        os.close(os.open(fifo, os.O_WRONLY))
        opened.set()

    threading.Thread(target=writer, daemon=True).start()
    time.sleep(0.2)
    with pytest.raises(UntrustedInput, match="a FIFO"):
        read_regular(fifo, 1024)
    assert not opened.wait(0.5)
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
    assert opened.wait(5)


def test_toml_dotted_keys_are_nesting_too():
    started = time.monotonic()
    with pytest.raises(UntrustedInput, match="more than 64 parts"):
        loads_toml(b"a" + b".a" * 30_000 + b" = 1\n")  # tomllib: 31 s
    with pytest.raises(UntrustedInput, match="more than 64 parts"):
        loads_toml(b"[" + b"a." * 30_000 + b"a]\n")
    assert time.monotonic() - started < 2.0
    floats = b"x = [" + b", ".join([b"1.5"] * 1000) + b"]\n"
    assert len(loads_toml(floats)["x"]) == 1000


# ------------------------------------------------------------------------- the config (9)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"theme = " + b"[" * 60_000, "deeper than 64 levels"),  # all within the size cap
        (b"keys = " + b"{a = " * 12_000, "deeper than 64 levels"),
        (b"keys" + b".a" * 30_000 + b' = "x"\n', "more than 64 parts"),
        (b'theme = "x"\n#' + b" " * (70 << 10), "larger than 64 KiB"),
    ],
)
def test_a_hostile_config_is_one_warning_and_the_defaults(tmp_path: Path, content: bytes, why: str):
    path = tmp_path / "config.toml"
    path.write_bytes(content)
    settings = _finishes(lambda: config.load(path), 5.0)
    assert settings.theme == "memtop" and settings.keys == {}
    (problem,) = settings.problems
    assert why in problem and str(path) in problem and "\n" not in problem


def test_config_that_is_not_a_regular_file(fifo: Path, monkeypatch: pytest.MonkeyPatch):
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        monkeypatch.setenv("MEMTOP_CONFIG", str(path))
        settings = _finishes(config.load, 5.0)
        assert settings.theme == "memtop"
        assert settings.problems == (f"{path} is not a regular file ({kind}): the defaults apply",)


@pytest.mark.slow
def test_a_fifo_config_does_not_hang_the_dashboard(
    fifo: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    from test_ui_cli import drain, read_until, spawn_in_pty

    monkeypatch.setenv("MEMTOP_CONFIG", str(fifo))
    process, master = spawn_in_pty([], socket_dir, size=(100, 30))
    try:
        out = read_until(master, b"FIFO", timeout=30)  # the warning, on the dashboard
        assert b"memtop" in out
        os.write(master, b"q")
        assert drain(master, process) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


# ------------------------------------------------------------------------- OOM reports (8)


def _report(pid: int, when: float, **fields: object) -> dict:
    return {
        "memtop_oom_report": 1,
        "time": when,
        "pid": pid,
        "step": 3,
        "phase": "forward",
        "device": 0,
        "argv": ["train.py"],
        "requested_bytes": 1 << 30,
        "free_bytes": 0,
        "recent": [],
        "allocator_conf": "",
        **fields,
    }


def test_one_odd_report_is_skipped_with_a_line_and_the_rest_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    directory = tmp_path / "oom"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("MEMTOP_OOM_DIR", str(directory))
    good = _report(10, 1_700_000_000.0)
    (directory / report_name(good["time"], 10)).write_bytes(encode_report(good))
    odd = {
        11: json.dumps(_report(11, 1.0)).replace('"time": 1.0', '"time": 1' + "0" * 400),
        12: json.dumps(_report(12, 2.0)).replace('"time": 2.0', '"time": Infinity'),
        13: json.dumps(_report(13, 3.0, requested_bytes=10**30)),
        14: json.dumps(_report(14, 4.0, time=1e18)),  # in range, but a time no clock reaches
    }
    for pid, text in odd.items():
        (directory / report_name(1000.0 + pid, pid)).write_text(text)
    # A lone surrogate is no reason to skip: it is shown escaped.
    surrogate = _report(15, 1_700_000_100.0, argv=["train.py", "caf\udce9.bin"])
    (directory / report_name(surrogate["time"], 15)).write_bytes(encode_report(surrogate))

    assert main(["oom"]) == 0
    text = capsys.readouterr().out
    text.encode("utf-8")  # strict: what a UTF-8 terminal takes
    # pid 10's and pid 15's reports are one OOM that came back (memtop oom groups them): the
    # newest is shown, the other counted; --json lists each.
    assert "3 OOM report(s)" in text and "caf\\xe9.bin" in text and "and 1 more" in text
    unreadable = [line for line in text.splitlines() if line.startswith("unreadable: ")]
    assert len(unreadable) == 3
    for pid in (11, 12, 13):
        (line,) = [u for u in unreadable if report_name(1000.0 + pid, pid) in u]
        assert "number out of range" in line
    assert "pid 14" in text  # listed; its time shown as unknown
    assert main(["oom", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(r["pid"] for r in listed["reports"]) == [10, 14, 15]

    assert main(["oom", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(r["pid"] for r in listed["reports"]) == [10, 14, 15]
    assert len(listed["unreadable"]) == 3
    assert main(["oom", str(directory / report_name(1011.0, 11))]) == 1
    assert "number out of range" in capsys.readouterr().err


# ------------------------------------------------------------------ a model's config.json


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),  # was a RecursionError traceback
        (b'{"hidden_size": 1' + b"0" * 400 + b"}", "out of range"),
        (b"{", "not JSON"),
    ],
)
def test_a_hostile_model_config_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, why: str
):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    assert main(["estimate", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memtop: ") and err.count("\n") == 1 and why in err


def test_a_fifo_for_a_model_config_does_not_hang(fifo: Path, capsys: pytest.CaptureFixture[str]):
    assert _finishes(lambda: main(["estimate", "--config", str(fifo)])) == 1
    assert "not a regular file" in capsys.readouterr().err
