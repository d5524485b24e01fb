"""A trainer whose command line is not UTF-8 (issue 27, finding 3).

`memtop run train.py $'--data=/srv/caf\\xe9.bin'`: Python turns the byte 0xE9 into the lone
surrogate U+DCE9, which no UTF-8 encoder takes.  It reached every output: `memtop export` died at
start (UnicodeEncodeError) or answered HTTP 500 to every scrape, and `memtop --once`,
`replay --once` and `memtop oom` crashed.  Every such string is escaped once where it enters
(protocol.clean_text), so each output shows `caf\\xe9.bin`.

The outputs run with PYTHONIOENCODING=utf-8: stdout is strict, as in a UTF-8 locale such as
en_US.UTF-8 (this box's C.UTF-8 locale would hide the bug behind surrogateescape).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop import protocol
from memtop.agent.oom import encode_report, report_name

pytestmark = pytest.mark.slow

ODD_ARG = b"--data=/srv/caf\xe9.bin"  # Latin-1, not UTF-8
SHOWN = "--data=/srv/caf\\xe9.bin"  # how memtop prints it
TRAINER = "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.05)\n"


def _env(socket_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), PYTHONIOENCODING="utf-8", **extra)
    env.pop("MEMTOP_AGENT", None)
    return env


def memtop(
    *args: str, socket_dir: Path, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memtop.cli", *args],
        capture_output=True,
        text=True,
        errors="replace",
        env=_env(socket_dir, **env),
        timeout=timeout,
    )


@pytest.fixture
def odd_trainer(socket_dir: Path, tmp_path: Path) -> Iterator[int]:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen(
        [sys.executable.encode(), b"-m", b"memtop.cli", b"run", bytes(script), ODD_ARG],
        env=_env(socket_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        while not protocol.list_agent_sockets(socket_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert protocol.list_agent_sockets(socket_dir) == [proc.pid]
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _command_of(report: dict, pid: int) -> str:
    (agent,) = [a for a in report["agents"] if a["pid"] == pid]
    return " ".join(agent["argv"])


def test_once_text_and_json_show_the_odd_argument_escaped(odd_trainer: int, socket_dir: Path):
    text = memtop("--once", socket_dir=socket_dir)
    assert text.returncode == 0, text.stderr
    assert SHOWN in text.stdout and "Traceback" not in text.stderr
    as_json = memtop("--once", "--json", socket_dir=socket_dir)
    assert as_json.returncode == 0, as_json.stderr
    assert SHOWN in _command_of(json.loads(as_json.stdout), odd_trainer)
    assert "\\udc" not in as_json.stdout  # no lone surrogate escape for a strict reader to refuse


def test_export_serves_every_scrape(odd_trainer: int, socket_dir: Path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "export", "--listen", "127.0.0.1:0"],
        env=_env(socket_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert "serving" in line, line + proc.stderr.read()
        url = line.split()[-1]
        for _ in range(2):  # the first round's body and a later one
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.status == 200
                body = reply.read().decode("utf-8")
            assert f'pid="{odd_trainer}"' in body
            assert SHOWN.replace("\\", "\\\\") in body  # a label value: \\ escaped
            time.sleep(1.1)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)


def test_record_then_replay_once(odd_trainer: int, socket_dir: Path, tmp_path: Path):
    path = tmp_path / "run.memtop"
    recorded = memtop("record", "-o", str(path), "--seconds", "2.5", socket_dir=socket_dir)
    assert recorded.returncode == 0, recorded.stderr
    text = memtop("replay", str(path), "--once", socket_dir=socket_dir)
    assert text.returncode == 0, text.stderr
    assert SHOWN in text.stdout
    as_json = memtop("replay", str(path), "--once", "--json", socket_dir=socket_dir)
    assert as_json.returncode == 0, as_json.stderr
    assert SHOWN in _command_of(json.loads(as_json.stdout), odd_trainer)
    # A folder of recordings whose file name is not UTF-8 either: the name is shown escaped.
    folder = tmp_path / "recordings"
    folder.mkdir()
    path.rename(folder / os.fsdecode(b"caf\xe9.memtop"))
    for mode in ([], ["--json"]):
        named = memtop("replay", str(folder), "--once", *mode, socket_dir=socket_dir)
        assert named.returncode == 0, named.stderr
        assert "caf\\xe9.memtop" in named.stdout.replace("\\\\", "\\")


def test_oom_lists_a_report_of_that_trainer(socket_dir: Path, tmp_path: Path):
    directory = tmp_path / "oom"
    directory.mkdir(mode=0o700)
    # What the agent of that trainer writes: its sys.argv, as Python decoded it.
    argv = ["train.py", os.fsdecode(ODD_ARG)]
    report = {
        "memtop_oom_report": 1,
        "time": 1_700_000_000.0,
        "pid": 4242,
        "step": 7,
        "phase": "forward",
        "device": 0,
        "argv": argv,
        "requested_bytes": 1 << 30,
        "free_bytes": 0,
        "recent": [],
        "allocator_conf": "",
    }
    (directory / report_name(report["time"], 4242)).write_bytes(encode_report(report))
    env = {"MEMTOP_OOM_DIR": str(directory)}
    listed = memtop("oom", socket_dir=socket_dir, **env)
    assert listed.returncode == 0, listed.stderr
    assert SHOWN in listed.stdout and "unreadable" not in listed.stdout
    as_json = memtop("oom", "--json", socket_dir=socket_dir, **env)
    assert as_json.returncode == 0, as_json.stderr
    (summary,) = json.loads(as_json.stdout)["reports"]
    assert SHOWN in summary["command"]
    one = memtop("oom", summary["path"], socket_dir=socket_dir, **env)
    assert one.returncode == 0 and SHOWN in one.stdout, one.stderr
