"""`memtop record` of a running demo, replayed: the same agents and the same leak verdict as the
live `memtop --once` at the same moment; a recorder killed mid-run leaves a playable file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop import protocol
from memtop.base import children
from memtop.sources.recording import RecordWriter, read_lines

MEMTOP = [sys.executable, "-m", "memtop"]


def memtop(*args: str, socket_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    return subprocess.run(
        [*MEMTOP, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def stop_demo(demo: subprocess.Popen[str]) -> None:
    if demo.poll() is not None:
        return
    demo.send_signal(signal.SIGTERM)
    try:
        demo.wait(timeout=15)
    except subprocess.TimeoutExpired:
        demo.kill()
        demo.wait()


@pytest.fixture(scope="module")
def recorded() -> Iterator[dict]:
    """The issue's run: `memtop record` for 20 s of `memtop demo --no-ui --scenario mixed`, a live
    `memtop --once --json` 15 s in, and beside them a second recorder killed (SIGKILL) 4 s in."""
    work = Path(tempfile.mkdtemp(prefix="mt-rec-", dir="/tmp"))
    socket_dir = work / "s"
    socket_dir.mkdir(mode=0o700)
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    demo, line = children.start_until_first_line(
        [*MEMTOP, "demo", "--no-ui", "--scenario", "mixed"], env, stderr=subprocess.PIPE
    )
    try:
        assert "simulated trainer" in line, demo.stderr.read() if demo.stderr else line
        pids = protocol.list_agent_sockets(socket_dir)
        assert len(pids) == 4
        out, crashed = work / "run.memtop", work / "crash.memtop"
        recorder = subprocess.Popen(
            [*MEMTOP, "record", "-o", str(out), "--seconds", "20"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The live report comes 15 s into the recording, counted from the recorder's "writing"
        # line: a loaded box may take seconds to start Python (13.0 s in one CI run, counted
        # from the spawn).
        assert recorder.stderr is not None
        said = recorder.stderr.readline()
        assert "writing" in said, said
        started, writing_at = time.monotonic(), time.time()
        doomed = subprocess.Popen(
            [*MEMTOP, "record", "-o", str(crashed)], env=env, stderr=subprocess.PIPE, text=True
        )
        # 4 s of recording, counted from its "writing" line: a loaded box may take seconds to
        # start Python, and the killed file's length is judged against the 4 s.
        assert doomed.stderr is not None and "writing" in doomed.stderr.readline()
        time.sleep(4)
        doomed.kill()  # SIGKILL: no gzip trailer, maybe half a deflate block
        doomed.wait()
        doomed.stderr.close()
        time.sleep(max(0.0, 15 - (time.monotonic() - started)))
        asked_at = time.time()
        live = json.loads(memtop("--once", "--json", socket_dir=socket_dir).stdout)
        # Seconds into the recording the live report was asked for, and had answered by; and
        # the same two moments on the wall clock, to compare with the recording's own times.
        answered_at = time.time()
        live_window = (asked_at - writing_at, answered_at - writing_at)
        _, rest = recorder.communicate(timeout=30)
        err = said + rest
        assert recorder.returncode == 0, err
        # The tests read the recordings and the live report only: the demo's four trainers
        # need not step through them (a module's fixture lives until the module ends).
        stop_demo(demo)
        yield {
            "socket_dir": socket_dir,
            "pids": sorted(pids),
            "out": out,
            "crashed": crashed,
            "live": live,
            "live_window": live_window,
            "live_wall": (asked_at, answered_at),
            "stderr": err,
        }
    finally:
        stop_demo(demo)
        shutil.rmtree(work, ignore_errors=True)


def verdicts(data: dict) -> dict[int, tuple[bool, int]]:
    out = {}
    for agent in data["agents"]:
        leak = agent["devices"][0].get("leak") or {}
        out[agent["pid"]] = (bool(leak.get("detected")), leak.get("bytes_per_step") or 0)
    return out


@pytest.mark.slow
def test_record_20_s_then_replay_at_15_s_matches_the_live_report(recorded):
    socket_dir, out, live = recorded["socket_dir"], recorded["out"], recorded["live"]
    assert "4 agent(s)" in recorded["stderr"]
    end = json.loads(memtop("replay", str(out), "--once", "--json", socket_dir=socket_dir).stdout)
    assert 18 < end["replay"]["duration_s"] <= 20.5
    # --at 15, measured from the recording's first reading to the live report's own time.
    at = live["time"] - end["replay"]["started"]
    # The live report was asked for 15 s after this process read the recorder's "writing" line
    # (up to a few seconds later on a loaded box, which starts Python slowly: 17.1 s with two
    # suites at once), and its own time lies between when it was asked for and when it
    # answered, on the same wall clock as the recording's times.  (Counted from the "writing"
    # line instead, the bounds moved by how late this process read that line: 1.4 s once, with
    # two suites at once.)
    asked, _ = recorded["live_window"]
    asked_wall, answered_wall = recorded["live_wall"]
    started = end["replay"]["started"]
    window = (asked_wall - started, answered_wall - started)
    assert asked > 14.9 and window[0] - 0.05 < at < window[1] + 0.05, (at, window)
    assert at < end["replay"]["duration_s"]
    replayed = json.loads(
        memtop(
            "replay", str(out), "--once", "--json", "--at", f"{at:.3f}", socket_dir=socket_dir
        ).stdout
    )
    assert sorted(a["pid"] for a in replayed["agents"]) == recorded["pids"]
    assert sorted(a["pid"] for a in live["agents"]) == recorded["pids"]
    assert replayed["nvml"]["source"] == live["nvml"]["source"] == "sim"
    assert len(replayed["devices"]) == len(live["devices"]) == 2
    live_verdicts, replay_verdicts = verdicts(live), verdicts(replayed)
    leaking = [pid for pid, (detected, _) in live_verdicts.items() if detected]
    assert len(leaking) == 1, live_verdicts
    for pid, (detected, rate) in live_verdicts.items():
        assert replay_verdicts[pid][0] == detected, (pid, live_verdicts, replay_verdicts)
        if detected:
            assert abs(replay_verdicts[pid][1] - rate) <= 0.10 * rate
    # Steps within a sampling round of the live report's.
    for agent in replayed["agents"]:
        (twin,) = [a for a in live["agents"] if a["pid"] == agent["pid"]]
        assert abs(agent["devices"][0]["step"] - twin["devices"][0]["step"]) <= 15


@pytest.mark.slow
def test_a_killed_recorder_leaves_a_playable_file(recorded):
    data = json.loads(
        memtop(
            "replay",
            str(recorded["crashed"]),
            "--once",
            "--json",
            socket_dir=recorded["socket_dir"],
        ).stdout
    )
    assert data["replay"]["duration_s"] > 1.5  # at most ~1 s lost of ~3.5 s recorded
    assert sorted(a["pid"] for a in data["agents"]) == recorded["pids"]
    assert all(a["devices"][0]["step"] > 0 for a in data["agents"])


def test_refuses_to_overwrite_and_says_so_in_one_line(socket_dir: Path, tmp_path: Path):
    out = tmp_path / "x.memtop"
    out.write_text("precious")
    result = memtop("record", "-o", str(out), "--seconds", "1", socket_dir=socket_dir)
    assert result.returncode == 1
    assert result.stderr.strip() == f"memtop: {out} exists; add --force to overwrite it"
    assert out.read_text() == "precious"


@pytest.mark.parametrize("force", [(), ("--force",)])
def test_a_directory_is_said_to_be_one_in_one_line(socket_dir: Path, tmp_path: Path, force):
    # `-o DIR` said "exists; add --force", and with --force "Is a directory".
    out = tmp_path / "runs"
    out.mkdir()
    result = memtop("record", "-o", str(out), "--seconds", "1", *force, socket_dir=socket_dir)
    assert result.returncode == 1
    assert result.stderr == (
        f"memtop: {out} is a directory: name a file to record to, e.g. {out / 'run.memtop'}\n"
    )
    assert list(out.iterdir()) == []


def test_reader_takes_a_stream_cut_anywhere(tmp_path: Path):
    path = tmp_path / "cut.memtop"
    writer = RecordWriter(path, flush_s=3600)  # flushes only when told
    flushed_sizes = [(path.stat().st_size, 1)]  # (bytes on disk, lines readable from them)
    for i in range(40):
        writer.write({"t": float(i), "src": "processes", "processes": [], "pad": "x" * (i * 37)})
        if i % 5 == 4:
            writer.flush()
            flushed_sizes.append((path.stat().st_size, i + 2))
    writer.close()
    data = path.read_bytes()
    whole = list(read_lines(path))
    assert len(whole) == 41 and whole[0]["memtop_record"] == 1
    for cut in range(0, len(data), 97):
        (tmp_path / "part").write_bytes(data[:cut])
        lines = list(read_lines(tmp_path / "part"))
        assert lines == whole[: len(lines)]  # a prefix, never garbage
        safe = max((n for size, n in flushed_sizes if size <= cut), default=0)
        assert len(lines) >= safe  # everything flushed before the cut is there
