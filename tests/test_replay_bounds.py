"""Replay reads a file someone hands you: bounded in bytes, lines, file type and number range
(issue 27, finding 6)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import threading
import tracemalloc
from pathlib import Path

import pytest
from test_viewer_inputs import hello_result, sample_result

from memtop.cli import main
from memtop.model import DeviceReading, DriverReading
from memtop.sources import recording as recording_module
from memtop.sources.processes import ProcessInfo
from memtop.sources.recording import RecordError, RecordWriter
from memtop.sources.replay import load

T0 = 1_700_000_000.0
HEADER = b'{"memtop_record": 1, "version": "x", "host": "h", "started": 1700000000}\n'


@pytest.mark.slow
def test_a_gzip_of_empty_lines_is_counted_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 49 KB of gzip held 16 M skipped lines, each a formatted string: 58 s and 2.7 GB.  The
    # skipped lines are tallied when the recording is first read to its end (skipped_count,
    # skipped), so that reading is measured too: with load() alone a tally that kept every
    # line (LineTally.KEEP planted at 10**9) peaked at 15.7 MiB as the fixed one did, under a
    # 16 MiB bound.  50,000 lines: the fixed reader peaks at 3.9 MiB (the file's lines split
    # out of one decompressed chunk), one that keeps every line at 10.4 MiB; 200,000 lines
    # (15.7 and 41 MiB) cost four times the CPU to tell the same two apart.
    lines = 50_000
    monkeypatch.setattr(recording_module, "MAX_RECORDING_LINES", lines)
    path = tmp_path / "empty.memtop"
    path.write_bytes(gzip.compress(HEADER + b"{}\n" * (lines * 3 // 2), 9))
    assert path.stat().st_size < 4000
    tracemalloc.start()
    try:
        recording = load(path)
        skipped_count, skipped = recording.skipped_count, recording.skipped
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert recording.events == []
    assert skipped_count == lines - 1  # the header is line 1
    assert len(skipped) == recording_module.LineTally.KEEP
    assert skipped[0] == f"{path}:2: no time"
    assert recording.notes == (
        f"{path}: read up to line {lines}: a replay reads {lines:,} lines at most",
    )
    assert peak < 7 << 20, peak


def test_decompressed_bytes_are_capped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(recording_module, "MAX_RECORDING_BYTES", 1 << 20)
    line = json.dumps({"t": T0, "src": "agent", "pid": 7, "state": "exited", "error": "x" * 900})
    path = tmp_path / "big.memtop"
    path.write_bytes(gzip.compress(HEADER + (line.encode() + b"\n") * 4000))  # 3.7 MB
    recording = load(path)
    assert 0 < len(recording.events) < 1200
    (note,) = recording.notes
    assert note.startswith(f"{path}: read up to line ") and note.endswith("reads 1 MiB at most")
    assert main(["replay", str(path), "--once", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["replay"]["notes"] == list(recording.notes)
    assert out.err == f"memtop: {recording.notes[0]}\n"


def test_the_caps_hold_for_a_folder_of_files_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recording_module, "MAX_RECORDING_LINES", 1000)
    line = json.dumps({"t": T0, "src": "agent", "pid": 7, "state": "exited", "error": None})
    for number in range(50):  # 50 files of 300 lines: 15 000 lines in all
        body = HEADER + (line.encode() + b"\n") * 299
        (tmp_path / f"run-{number:02d}.memtop").write_bytes(gzip.compress(body))
    recording = load(tmp_path)
    assert len(recording.events) < 1000
    assert recording.notes[-1] == (
        "46 of the 50 files not read (run-04.memtop, …): the ones before hold all one replay reads"
    )


def test_a_gzip_bomb_inflates_a_bounded_chunk_at_a_time(tmp_path: Path) -> None:
    # One line of 64 MiB of spaces, 64 KB compressed: refused as a line too long, having held
    # at most a line and a chunk, never the 64 MiB.
    path = tmp_path / "bomb.memtop"
    path.write_bytes(gzip.compress(HEADER + b" " * (64 << 20), 9))
    tracemalloc.start()
    try:
        with pytest.raises(RecordError, match="a line longer than"):
            load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, peak


def test_a_fifo_is_refused_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "run.memtop"
    os.mkfifo(fifo)
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(main(["replay", str(fifo), "--once"])), daemon=True
    )
    thread.start()
    thread.join(10)
    if thread.is_alive():  # the old reader: open() waits for a writer forever; let it go
        with open(fifo, "wb"):
            pass
        thread.join(10)
        pytest.fail("replay of a FIFO hung")
    assert codes == [1]
    err = capsys.readouterr().err
    assert err == f"memtop: {fifo} is not a regular file (a FIFO)\n"


def _record(path: Path) -> None:
    """One good round, then one line each with a number no clock or counter reaches."""
    writer = RecordWriter(path)
    device = DeviceReading(0, "GPU-a", "H100", 80 << 30, 2 << 30, power_watts=300.0)
    writer.driver(T0, DriverReading(True, (device,)))
    writer.processes(T0, {4242: ProcessInfo(4242, 1000, "me", ("train.py",), "python", T0)})
    writer.write({"t": T0, "src": "agent", "pid": 4242, "cmd": "hello",
                  "reply": {"result": hello_result(4242)}})  # fmt: skip
    writer.write({"t": T0 + 1, "src": "agent", "pid": 4242, "cmd": "sample",
                  "reply": {"result": sample_result(T0 + 1)}})  # fmt: skip
    huge = 10**400
    odd_sample = sample_result(T0 + 2)
    odd_sample["devices"][0]["stats"]["allocated_bytes.all.current"] = huge  # type: ignore[index]
    writer.write({"t": T0 + 2, "src": "agent", "pid": 4242, "cmd": "sample",
                  "reply": {"result": odd_sample}})  # fmt: skip
    hot = dataclasses.asdict(DriverReading(True, (device,)))
    hot["devices"][0]["power_watts"] = huge
    writer.write({"t": T0 + 2, "src": "nvml", "reading": hot})
    old = dataclasses.asdict(ProcessInfo(4242, 1000, "me", ("train.py",), "python", T0))
    writer.write({"t": T0 + 2, "src": "processes", "processes": [{**old, "create_time": huge}]})
    writer.write({"t": 1e308, "src": "agent", "pid": 4242, "state": "exited", "error": None})
    # Within 2^64, but past the year 9999: time.localtime raises on it.
    writer.write({"t": 1e15, "src": "agent", "pid": 4242, "state": "exited", "error": None})
    writer.write({"t": T0 + 3, "src": "agent", "pid": 4242, "cmd": "sample",
                  "reply": {"result": sample_result(T0 + 3)}})  # fmt: skip
    writer.close()


def test_numbers_out_of_range_are_bad_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "odd.memtop"
    _record(path)
    recording = load(path)
    assert recording.skipped_count == 5, recording.skipped
    assert sum("number out of range" in why for why in recording.skipped) == 4
    assert any(why.endswith(": no time") for why in recording.skipped)
    assert [e.kind for e in recording.events].count("sample") == 2
    for mode in ([], ["--json"]):
        assert main(["replay", str(path), "--once", *mode]) == 0
        out = capsys.readouterr()
        assert "train.py" in out.out and out.err == ""
    assert main(["replay", str(path), "--once", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replay"]["skipped_lines"] == 5
    (agent,) = data["agents"]
    assert agent["devices"][0]["allocated_bytes"] == 1 << 30  # the good sample, not 10^400


@pytest.mark.slow
def test_a_long_recording_is_replayed_in_bounded_memory(tmp_path: Path) -> None:
    # A 9 MB gzip of 400,000 valid lines took replay 850 MB (every event parsed and held): the
    # recording is a stream now, and memory does not grow with its length (past its reorder
    # window, memtop.sources.replay.REORDER_WINDOW: 1,024 events a file).
    path = tmp_path / "long.memtop"
    lines = [json.dumps({"t": T0, "src": "agent", "pid": 4242, "cmd": "hello",
                         "reply": {"result": hello_result(4242)}})]  # fmt: skip
    # 10,000 samples: the reader that held every event peaked at 14.0 MiB here, the stream at
    # 5.9 MiB (at 15,000: 19.9 and 6.0, for half as much CPU again under tracemalloc).
    for n in range(10_000):
        t = T0 + 1 + n * 0.01
        mark = {"step": n, "time": t, "allocated_bytes": {"0": 1 << 30}}
        result = {**sample_result(t), "step": n, "step_marks": [mark]}
        lines.append(json.dumps({"t": t, "src": "agent", "pid": 4242, "cmd": "sample",
                                 "reply": {"result": result}}))  # fmt: skip
    path.write_bytes(gzip.compress(HEADER + "\n".join(lines).encode() + b"\n", 6))
    from memtop.engine.playback import Player
    from memtop.engine.store import Store

    tracemalloc.start()
    try:
        recording = load(path)
        player = Player(Store(), recording)
        player.seek(recording.end)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert player.at_end and recording.duration == pytest.approx(1 + 9_999 * 0.01)
    assert recording.skipped_count == 0
    agent = player.store.agent(4242)
    assert agent is not None and agent.step == 9_999  # every sample was applied
    assert peak < 10 << 20, peak  # 5.9 MiB now; 14.0 MiB when the events were held
