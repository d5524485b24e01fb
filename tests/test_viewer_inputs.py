"""Every string that reaches the viewer from outside memtop is made inert at the parse boundary:
recordings (`memtop replay`), a remote Prometheus (`--prometheus`), and replies to dashboard
actions.  Each test feeds hostile input through the real reader and looks at what comes out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from memtop.cli import main
from memtop.model import DeviceReading, GpuProcess, NvmlReading
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
    writer.nvml(t, NvmlReading(True, (device,), driver_version="550" + ESC))
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
