"""Every string that reaches the viewer from outside memtop is made inert at the parse boundary:
recordings (`memtop replay`), a remote Prometheus (`--prometheus`), and replies to dashboard
actions.  Each test feeds hostile input through the real reader and looks at what comes out."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

from memtop.cli import main
from memtop.model import DeviceReading, DriverReading, GpuProcess
from memtop.sources.processes import ProcessInfo
from memtop.sources.recording import RecordWriter
from memtop.sources.replay import load

# Anything a terminal would act on: C0/C1 controls, DEL, bidi overrides.
TERMINAL_ACTS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
ESC = "\x1b]0;pwned\x07\x1b[2J\u202e\x9b31m"


def hello_result(pid: int) -> dict[str, object]:
    return {
        "protocol": 1,
        "pid": pid,
        "argv": ["train.py"],
        "python": "3.13",
        "torch": "2.13.0",
        "allocator_conf": "",
        "devices": [{"index": 0, "uuid": "GPU-a", "name": "H100", "total_bytes": 80 << 30}],
    }


def sample_result(t: float) -> dict[str, object]:
    stats = {"allocated_bytes.all.current": 1 << 30, "reserved_bytes.all.current": 2 << 30}
    return {
        "time": t,
        "step": 1,
        "devices": [{"index": 0, "stats": stats, "free_bytes": 70 << 30, "total_bytes": 80 << 30}],
    }


def hostile_record(path: Path) -> None:
    writer = RecordWriter(path)
    t = 1_700_000_000.0
    device = DeviceReading(
        0, "GPU-a" + ESC, "H100" + ESC, 80 << 30, 2 << 30, processes=(GpuProcess(4242, 2 << 30),)
    )
    writer.driver(t, DriverReading(True, (device,), driver_version="550" + ESC))
    writer.processes(
        t, {4242: ProcessInfo(4242, 1000, "me" + ESC, ("python", "train.py" + ESC), "py" + ESC)}
    )
    writer.agent_reply(4242, "hello", hello_result(4242))
    writer.write({"t": t + 1, "src": "agent", "pid": 4242, "cmd": "sample",
                  "reply": {"result": sample_result(t + 1)}})  # fmt: skip
    # A breakdown that breaks the schema (a device key "²" passes str.isdigit, not int()).
    writer.write({"t": t + 1.5, "src": "agent", "pid": 4242, "cmd": "breakdown",
                  "reply": {"result": {"devices": {"²": {"params": 1}}}}})  # fmt: skip
    writer.write({"t": t + 1.6, "src": ESC, "pid": 4242})
    writer.agent_state(t + 2, 4343, "exited", "gone" + ESC)
    writer.close()


def test_a_record_file_is_made_inert_at_load(tmp_path: Path) -> None:
    path = tmp_path / "hostile.memtop"
    hostile_record(path)
    recording = load(path)
    seen = [repr(e.value) for e in recording.events] + recording.skipped
    # repr() escapes controls; look at the raw strings instead.
    for event in recording.events:
        if event.kind == "nvml":
            reading = event.value
            assert not TERMINAL_ACTS.search(reading.devices[0].name)
            assert not TERMINAL_ACTS.search(reading.devices[0].uuid)
            assert not TERMINAL_ACTS.search(reading.driver_version)
        elif event.kind == "processes":
            info = event.value[4242]
            for text in (info.user, info.name, *info.cmdline):
                assert not TERMINAL_ACTS.search(text)
        elif event.kind == "state":
            assert not TERMINAL_ACTS.search(event.value[1])
    for why in recording.skipped:
        assert not TERMINAL_ACTS.search(why)
    assert any("breakdown" in why for why in recording.skipped), seen
    assert not any(e.kind == "breakdown" for e in recording.events)


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_replay_of_a_hostile_record_prints_nothing_a_terminal_acts_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: list[str]
) -> None:
    path = tmp_path / "hostile.memtop"
    hostile_record(path)
    code = main(["replay", str(path), "--once", *fmt])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "train.py" in out.out
    assert not TERMINAL_ACTS.search(out.out), out.out
    assert not TERMINAL_ACTS.search(out.err), out.err
    if fmt:
        text = json.dumps(json.loads(out.out), ensure_ascii=False)
        assert "\x1b" not in text and "\u202e" not in text


# ------------------------------------------------------------------ a remote Prometheus


def _series(name: str, value: float, **labels: str) -> dict[str, object]:
    return {"metric": {"__name__": name, **labels}, "value": [1_700_000_000.0, str(value)]}


def hostile_series() -> list[dict[str, object]]:
    host = {"hostname": "node" + ESC, "instance": "10.0.0.1:9" + ESC, "job": "memtop" + ESC}
    device = {**host, "pid": "4242", "UUID": "GPU-a" + ESC, "gpu": "0", "modelName": "H100" + ESC}
    return [
        _series("memtop_observation_time_seconds", 1_700_000_000.0, **host),
        _series("memtop_gpu_info", 1, **{k: v for k, v in device.items() if k != "pid"}),
        _series("memtop_gpu_memory_total_bytes", 80 << 30, **device),
        _series("memtop_gpu_memory_used_bytes", 2 << 30, **device),
        _series(
            "memtop_agent_info",
            1,
            **host,
            pid="4242",
            command="train.py " + ESC,
            python="3.13" + ESC,
            torch="2.13" + ESC,
            allocator_conf=ESC,
            rank="²",
        ),
        _series("memtop_cuda_device_index", 0, **device),
        _series("memtop_allocated_bytes", 1 << 30, **device),
        _series("memtop_reserved_bytes", 2 << 30, **device),
        _series("memtop_cuda_total_bytes", 80 << 30, **device),
        _series("memtop_breakdown_bytes", 1 << 20, **device, part="params" + ESC),
        {"metric": "not an object", "value": "not a pair"},  # skipped, not a crash
    ]


@pytest.fixture
def prometheus() -> object:
    import http.server
    import threading
    import urllib.parse

    replies: dict[str, object] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            promql = query.get("query", [""])[0]
            reply = replies.get(promql, replies.get("*"))
            body = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.replies = replies  # type: ignore[attr-defined]
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_prometheus_labels_are_made_inert_for_every_output(
    prometheus: object, capsys: pytest.CaptureFixture[str], fmt: list[str]
) -> None:
    from memtop.sources.prometheus import ALL_SERIES

    vector = {"resultType": "vector", "result": hostile_series()}
    prometheus.replies.update(  # type: ignore[attr-defined]
        {
            ALL_SERIES: {"status": "success", "data": vector},
            "*": {"status": "success", "data": {"resultType": "vector", "result": []}},
        }
    )
    url = f"http://127.0.0.1:{prometheus.server_port}"  # type: ignore[attr-defined]
    code = main(["--prometheus", url, "--once", *fmt])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "train.py" in out.out and "node" in out.out
    assert not TERMINAL_ACTS.search(out.out), out.out
    if fmt:
        text = json.dumps(json.loads(out.out), ensure_ascii=False)
        assert "\x1b" not in text and "\u202e" not in text


def test_a_prometheus_error_is_one_inert_line(
    prometheus: object, capsys: pytest.CaptureFixture[str]
) -> None:
    prometheus.replies["*"] = {"status": "error", "error": "bad\n" + ESC}  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{prometheus.server_port}"  # type: ignore[attr-defined]
    code = main(["--prometheus", url, "--once"])
    out = capsys.readouterr()
    assert code != 0
    assert "query failed" in out.err
    assert len(out.err.strip().splitlines()) == 1, out.err
    assert not TERMINAL_ACTS.search(out.err), out.err


# ------------------------------------------------------------------ the parse boundary


@pytest.mark.parametrize("key", ["²", "٣x", "1\u2070", ""])
def test_device_keys_that_are_not_ascii_digits_are_protocol_errors(key: str) -> None:
    from memtop import protocol

    with pytest.raises(protocol.ProtocolError):
        protocol.parse_breakdown({"devices": {key: {"params": 1}}})
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_cleanup({"released_bytes": {key: 1}})
    mark = {"step": 1, "time": 1.0, "allocated_bytes": {key: 1}}
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_sample({**sample_result(1.0), "step_marks": [mark]})


# ------------------------------------------------------------------ dashboard actions


def _agent_server(directory: Path, replies: dict[str, object], delay: float = 0.0):  # type: ignore[no-untyped-def]
    """An agent in this process (SO_PEERCRED shows our pid, as its socket name says) that
    answers each command with `replies[cmd]`, `delay` seconds late."""
    import os
    import socket
    import threading
    import time

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / f"{os.getpid()}.sock"))
    listener.listen(4)

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                while True:
                    header = conn.recv(4, socket.MSG_WAITALL)
                    if len(header) < 4:
                        return
                    body = conn.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)
                    request = json.loads(body)
                    time.sleep(delay)
                    reply = json.dumps({"id": request["id"], "result": replies[request["cmd"]]})
                    conn.sendall(len(reply).to_bytes(4, "big") + reply.encode())

    threading.Thread(target=serve, daemon=True).start()
    return listener


class _NoDevices:
    def read(self) -> DriverReading:
        return DriverReading(False, error="none")

    def close(self) -> None:
        pass


def _sampler(directory: Path):  # type: ignore[no-untyped-def]
    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool

    return Sampler(Store(), _NoDevices(), AgentPool(directory))


def test_a_malformed_action_reply_fails_the_action_in_one_line(socket_dir: Path) -> None:
    import os

    from memtop.sources.agents import AgentError

    bad = {"released_bytes": {"0": "lots" + ESC}, "reserved_before": {}, "reserved_after": {}}
    listener = _agent_server(socket_dir, {"hello": hello_result(os.getpid()), "cleanup": bad})
    sampler = _sampler(socket_dir)
    try:
        with pytest.raises(AgentError, match="malformed reply") as caught:
            sampler.run_action(os.getpid(), "cleanup", {}, timeout=3).result(timeout=5)
        assert not TERMINAL_ACTS.search(str(caught.value))
    finally:
        listener.close()
        sampler.stop()


def test_an_action_has_one_deadline_for_connect_and_reply(socket_dir: Path) -> None:
    import os
    import time

    from memtop.sources.agents import AgentTimeout

    good = {"released_bytes": {"0": 1}, "reserved_before": {"0": 2}, "reserved_after": {"0": 1}}
    replies = {"hello": hello_result(os.getpid()), "cleanup": good}
    # Each answer 0.4 s late: either alone fits a 0.6 s deadline, both together do not.
    listener = _agent_server(socket_dir, replies, delay=0.4)
    sampler = _sampler(socket_dir)
    try:
        started = time.monotonic()
        with pytest.raises(AgentTimeout):
            sampler.run_action(os.getpid(), "cleanup", {}, timeout=0.6).result(timeout=5)
        assert time.monotonic() - started < 0.75
    finally:
        listener.close()
        sampler.stop()


# ------------------------------------------------------------------ one agent's slowness


SILENT = """
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(os.path.join(sys.argv[1], f"{os.getpid()}.sock"))
s.listen(64)  # connections wait in the backlog: accepted by the kernel, never answered
print("ready", flush=True)
time.sleep(60)
"""


def test_more_stopped_agents_than_workers_do_not_delay_a_healthy_one(socket_dir: Path) -> None:
    import os
    import subprocess
    import sys
    import time

    from memtop.sources.agents import CONNECTED, AgentPool

    pool = AgentPool(socket_dir, timeout=1.0)
    silent = [
        subprocess.Popen([sys.executable, "-c", SILENT, str(socket_dir)], stdout=subprocess.PIPE)
        for _ in range(12)  # more than the 8 threads the pool once had for all agents
    ]
    for process in silent:
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
    replies = {"hello": hello_result(os.getpid()), "sample": sample_result(1.0)}
    listener = _agent_server(socket_dir, replies)
    try:
        pool.poll(budget=0.5)  # everyone new: the healthy agent answers within the round
        missed = []
        for round_number in range(10):  # 2.5 s: the silent ones time out and are retried
            started = time.monotonic()
            mine = {p.pid: p for p in pool.poll(budget=0.25)}.get(os.getpid())
            if mine is None or mine.state != CONNECTED or mine.sample is None:
                missed.append(round_number)
            time.sleep(max(0.0, 0.25 - (time.monotonic() - started)))
        assert missed == [], f"the healthy agent missed rounds {missed}"
    finally:
        listener.close()
        pool.close()
        for process in silent:
            process.kill()
            process.wait()


# ------------------------------------------------------------------ nesting in files


def test_a_deeply_nested_oom_report_is_one_line_not_a_recursion_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "oom"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("MEMTOP_OOM_DIR", str(directory))
    deep = "[" * 600 + "]" * 600
    path = directory / "oom-1700000000-4242.json"
    path.write_text('{"memtop_oom_report": 1, "argv": ' + deep + "}")
    assert main(["oom", str(path)]) == 1
    assert "nests deeper" in capsys.readouterr().err
    assert main(["oom", "--json"]) == 0
    assert "nests deeper" in json.loads(capsys.readouterr().out)["unreadable"][0]


def test_a_deeply_nested_recording_line_is_one_line_not_a_recursion_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hello = {"t": 1.0, "cmd": "hello", "reply": {"id": 1, "result": hello_result(4242)}}
    deep = '{"t": 2.0, "cmd": "sample", "reply": {"result": ' + "[" * 600 + "]" * 600 + "}}"
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(hello) + "\n" + deep + "\n" + json.dumps(hello) + "\n")
    assert main(["replay", str(path), "--once"]) != 0
    err = capsys.readouterr().err
    assert "nests deeper" in err and len(err.strip().splitlines()) == 1, err


def test_a_process_owner_name_is_made_inert(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    import psutil

    from memtop.sources.processes import read_process

    monkeypatch.setattr(psutil.Process, "username", lambda self: "me" + ESC)
    info = read_process(os.getpid())
    assert info.user is not None and info.user.startswith("me")
    assert not TERMINAL_ACTS.search(info.user)


def test_a_timeout_names_the_deadline_it_missed(socket_dir: Path) -> None:
    import os

    from memtop.sources.agents import AgentClient, AgentTimeout

    replies = {"hello": hello_result(os.getpid()), "sample": sample_result(1.0)}
    listener = _agent_server(socket_dir, replies, delay=0.5)
    try:
        client = AgentClient(os.getpid(), socket_dir, timeout=5.0)
        with pytest.raises(AgentTimeout, match=r"within 0\.[12]\d* s"):
            client.connect(timeout=0.2)
    finally:
        listener.close()


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\u061c", "\u180e"])
def test_clean_text_keeps_one_line_one_line(char: str) -> None:
    from memtop import protocol

    cleaned = protocol.clean_text(f"train.py{char}--evil")
    assert len(cleaned.splitlines()) == 1 and char not in cleaned


def test_no_character_clean_text_replaces_passes_the_printable_fast_path() -> None:
    # clean_value skips the regex for strings str.isprintable() accepts; that is safe only if
    # every character the control class matches is one isprintable() refuses.
    from memtop import protocol

    printable = "".join(c for c in map(chr, range(0x110000)) if c.isprintable())
    assert protocol.text._CONTROL.search(printable) is None


def test_clean_value_cleans_nested_strings_and_keeps_clean_replies_as_they_are() -> None:
    from memtop import protocol

    clean = {"devices": [{"name": "H100 80GB", "stats": {"a": 1}}], "step_mark_columns": {}}
    assert protocol.clean_value(clean) is clean  # nothing copied
    hostile = {"argv\x1b": ["ok", "\x1b]0;pwned\x07", {"x": "\u202egnp.exe"}], "n": 2.5}
    cleaned = protocol.clean_value(hostile)
    assert cleaned == {"argv?": ["ok", "?]0;pwned?", {"x": "?gnp.exe"}], "n": 2.5}
    assert hostile["argv\x1b"][1] == "\x1b]0;pwned\x07"  # the input is not changed in place
    long = "a" * (protocol.MAX_TEXT + 10)
    assert len(protocol.clean_value([long])[0]) == protocol.MAX_TEXT


@pytest.mark.parametrize(
    "line",
    [
        {"t": 1.0, "src": "agent", "pid": 1, "cmd": "sample", "reply": [1]},
        {"t": 1.0, "src": "nvml", "reading": [1]},
        {"t": 1.0, "src": "processes", "processes": [[1]]},
        {"t": float("nan"), "src": "agent", "pid": 1, "state": "exited"},
    ],
)
def test_a_recording_line_of_the_wrong_shape_is_skipped(tmp_path: Path, line: dict) -> None:  # type: ignore[type-arg]
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"memtop_record": 1}) + "\n" + json.dumps(line) + "\n")
    recording = load(path)
    assert recording.events == [] and len(recording.skipped) == 1


def test_a_wire_recording_whose_hello_is_not_an_object_is_one_line(tmp_path: Path) -> None:
    from memtop.sources.recording import RecordError

    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"t": 1.0, "cmd": "hello", "reply": [1]}) + "\n")
    with pytest.raises(RecordError, match="names no pid"):
        load(path)


def test_recorded_fields_of_the_wrong_type_are_skipped_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    device = {"index": 0, "uuid": 7, "name": 5, "total_bytes": "x", "used_bytes": None}
    process = {"pid": 4242, "uid": "u", "user": 7, "cmdline": ["python", 5], "name": 9}
    lines = [
        {"memtop_record": 1},
        {"t": 1.0, "src": "nvml", "reading": {"available": True, "devices": [device]}},
        {"t": 1.0, "src": "processes", "processes": [process]},
        {
            "t": 1.5,
            "src": "agent",
            "pid": 4242,
            "cmd": "hello",
            "reply": {"result": hello_result(4242)},
        },
    ]
    path = tmp_path / "types.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    recording = load(path)
    assert [e.kind for e in recording.events] == ["hello"]
    assert len(recording.skipped) == 2, recording.skipped
    for fmt in ([], ["--json"]):
        assert main(["replay", str(path), "--once", *fmt]) == 0
        assert "train.py" in capsys.readouterr().out


def test_driver_strings_are_made_inert() -> None:
    from fake_nvml import FakeDevice, FakeNvml, GiB

    from memtop.sources.nvml import NvmlSource

    fake = FakeNvml([FakeDevice(name="A100" + ESC, total=80 * GiB, used=GiB)])
    reading = NvmlSource(fake).read()  # type: ignore[arg-type]
    assert reading.devices[0].name.startswith("A100")
    assert not TERMINAL_ACTS.search(reading.devices[0].name)
