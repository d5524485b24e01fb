"""Actions taken anywhere are known (issue 34, item 2): the agent logs every action it performed
in its trainer, whoever asked (`memtop cleanup PID` in another shell, another viewer, the agent
itself), and serves the log the way it serves step marks, so a separate `memtop --once --json`
shows the action with who asked and its before/after; a recording replays it; the exporter
counts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memtop import protocol
from memtop.engine.store import Store
from memtop.model import ActionRecord, AgentSample, AgentStatus, AgentView

MiB = 1 << 20


def memtop(*args: str, socket_dir: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    return subprocess.run(
        [sys.executable, "-m", "memtop.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


# ---------------------------------------------------------------- the log itself


def test_the_log_serves_everything_first_then_only_what_is_new() -> None:
    from memtop.agent.action_log import ActionLog

    log = ActionLog(done_kept=4, refused_kept=2)
    first = log.append("cleanup", {"x": 1}, uid=1000, pid=42, step=7)
    entries, cursor = log.since(0)
    assert [e["seq"] for e in entries] == [first] and cursor == first
    assert entries[0]["by"] == {"uid": 1000, "pid": 42} and entries[0]["result"] == "ok"
    assert log.since(cursor) == ([], cursor)  # nothing new: nothing served
    # A flood of refusals evicts only refusals; a flood of reset_peak only its own kind.
    for _ in range(50):
        log.append("cleanup", {}, uid=1000, pid=43, step=8, refused=("rate_limited", "moments"))
        log.append("reset_peak", {}, uid=1000, pid=43, step=8)
    entries, _ = log.since(0)
    kinds = [(e["cmd"], e["result"]) for e in entries]
    assert kinds.count(("cleanup", "ok")) == 1  # the first cleanup is still there
    assert kinds.count(("cleanup", "refused")) == 2 and kinds.count(("reset_peak", "ok")) == 4
    assert [e["seq"] for e in entries] == sorted(e["seq"] for e in entries)
    # Arguments are bounded: a long path is cut, a deep object flattened.
    log.append(
        "snapshot",
        {"path": "/" + "a" * 5000, "deep": {"a": {"b": {"c": 1}}}},
        uid=0,
        pid=1,
        step=None,
    )
    entry = log.since(cursor)[0][-1]
    assert len(entry["args"]["path"]) <= 200 and isinstance(entry["args"]["deep"]["a"], str)


def test_a_hostile_log_is_cleaned_and_bounded_by_the_viewer() -> None:
    good = {
        "seq": 3,
        "cmd": "cleanup\x1b[31m",
        "time": 100.0,
        "step": 5,
        "by": {"uid": 1000, "pid": 77},
        "result": "refused",
        "why": "no\u202e" + "x" * 900,
        "args": {"k" * 500: "v\x07", "n": float("nan"), "deep": {"a": {"b": 1}}},
        "devices": {"0": {"reserved_bytes": 5, "split_bytes": -1}, "x": {}},
    }
    bad = [
        {"seq": -1},
        {"cmd": 1},
        "text",
        {**good, "time": float("inf")},
        {**good, "result": "maybe"},
        {**good, "by": {"uid": True, "pid": 1}},
    ]
    sample = protocol.parse_sample(
        {"time": 1.0, "step": None, "devices": [], "step_marks": [], "actions": [good, *bad]}
    )
    (action,) = sample.actions
    assert action.kind == "cleanup?[31m" and action.by_uid == 1000 and action.by_pid == 77
    assert action.why is not None and len(action.why) <= 300 and "\u202e" not in action.why
    assert all(len(k) <= 64 for k in action.args) and "n" not in action.args
    assert action.before == {0: {"reserved_bytes": 5}} and not action.ok
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_sample(
            {"time": 1.0, "step": None, "devices": [], "step_marks": [], "actions": [good] * 300}
        )


def test_an_action_this_viewer_did_and_then_read_back_is_kept_once() -> None:
    from memtop.model import ACTION_BY_VIEWER

    store = Store()
    ours = ActionRecord("cleanup", 100.0, 42, {}, by_uid=os.getuid(), by_pid=os.getpid(), seq=5)
    theirs = ActionRecord(
        "cleanup",
        99.9,
        0,
        {},
        by_uid=os.getuid(),
        by_pid=os.getpid(),
        seq=5,
        step=812,
        source="agent",
    )
    other = ActionRecord("tune", 101.0, 0, {}, by_uid=1001, by_pid=9, seq=6, source="agent")
    store.record_action(ours)
    for _ in range(2):  # a reconnecting viewer is served the whole log again
        with store.round():
            _sample(store, 42, AgentSample(101.0, 3, (), actions=(theirs, other)))
    actions = store.view().actions
    assert [(a.kind, a.pid, a.seq) for a in actions] == [("cleanup", 42, 5), ("tune", 42, 6)]
    mine = actions[0]
    assert mine.source == ACTION_BY_VIEWER and mine.step == 812 and mine.time == 99.9
    assert actions[1].by_words() == "by uid 1001"


def _exporter_scrape(socket_dir: Path) -> str:
    """What `memtop export` would serve now: a viewer of its own, a few rounds, one render."""
    from memtop.diagnosis import Diagnoser
    from memtop.engine.observation import Observer
    from memtop.engine.sampler import Sampler
    from memtop.export.metrics import render
    from memtop.export.text import exposition
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource

    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    try:
        for _ in range(5):
            sampler.sample_once()
            time.sleep(0.2)
        obs = Observer(store, Diagnoser(leak_refresh_s=0.0)).latest()
    finally:
        sampler.stop()
    return exposition(render(obs)).decode()


def _value(scrape: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def test_made_up_action_kinds_stay_bounded_labels() -> None:
    from memtop.export.metrics import action_label
    from memtop.protocol import commands

    # The exporter's kinds are the command table's acting commands, nothing else.
    acting = {c.name for c in commands.COMMANDS if c.changes_trainer or c.acting_args}
    from memtop.model import ACTION_KINDS

    assert set(ACTION_KINDS) == acting
    assert action_label("cleanup") == "cleanup" and action_label('evil"}') == "other"
    store = Store()
    made_up = tuple(
        ActionRecord(f"kind{i}", 1.0 + i, 0, seq=i + 1, source="agent") for i in range(100)
    )
    with store.round():
        _sample(store, 42, AgentSample(2.0, 1, (), actions=made_up))
    counts = store.agent(42).action_counts  # type: ignore[union-attr]
    assert len(counts) <= 17 and sum(counts.values()) == 100


def test_a_replay_that_seeks_back_before_an_action_forgets_it() -> None:
    store = Store()
    store.record_action(ActionRecord("cleanup", 100.0, 42, seq=1, source="agent"))
    assert store.view().actions
    store.reset()  # what the player does on a seek back
    assert store.view().actions == ()


def _sample(store: Store, pid: int, sample: AgentSample) -> None:
    """A connected agent's sample, kept as the sampler keeps one (its first makes the agent)."""
    store.update_agents([AgentView(pid, AgentStatus.CONNECTED, sample=sample)], when=sample.time)


# ---------------------------------------------------------------- a real trainer


@pytest.mark.slow
def test_a_cleanup_from_another_shell_shows_in_a_separate_viewer_and_its_recording(
    socket_dir: Path, tmp_path: Path
) -> None:
    from memtop.sim.demo import Demo

    # At the demo's 0.1 s a step: the cleanup is asked for, not a pace (at 0.02 s its ~10 s of
    # steps were most of the test's CPU).
    demo = Demo(gpus=1, scenario="fragment", step_time=0.1, socket_dir=socket_dir)
    demo.start()
    recording = tmp_path / "run.rec.gz"
    recorder = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "record", "-o", str(recording), "--interval", "0.5"],
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.wait_ready(30)
        (pid,) = [p.pid for p in demo.processes]
        time.sleep(3)  # the recorder has a few rounds before it
        # Another shell: `memtop cleanup PID`, its pid known to the test.
        shell = subprocess.Popen(
            [sys.executable, "-m", "memtop.cli", "cleanup", str(pid), "--json"],
            env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = shell.communicate(timeout=60)
        assert shell.returncode == 0, err
        assert isinstance(json.loads(out)["action_seq"], int)
        # At once again: refused (the cooldown), and said so by the log too.
        again = memtop("cleanup", str(pid), socket_dir=socket_dir)
        assert again.returncode != 0 and "moments ago" in again.stderr
        time.sleep(2)
        seen = json.loads(memtop("--once", "--json", socket_dir=socket_dir).stdout)
        scrape = _exporter_scrape(socket_dir)
        time.sleep(1)
    finally:
        recorder.terminate()
        recorder.communicate(timeout=30)
        demo.stop()
    mine = [a for a in seen["actions"] if a["pid"] == pid]
    done = [a for a in mine if a["kind"] == "cleanup" and a["result"] == "ok"]
    assert len(done) == 1, mine
    (action,) = done
    assert action["by"] == {"uid": os.getuid(), "pid": shell.pid}
    assert action["by_this_memtop"] is False and action["step"] is not None
    # Before: the agent's reading right before it (this viewer came after); after: its samples.
    assert action["before"]["basis"] == "agent" and action["before"]["reserved_bytes"] > 0
    assert action["after"]["basis"] == "samples" and action["after"]["samples"] >= 1
    assert action["after"]["reserved_bytes"] is not None
    assert action["before"]["step_time_s"] is not None  # the step marks reach back
    refused = [a for a in mine if a["result"] == "refused"]
    assert refused and "moments ago" in refused[0]["why"] and refused[0]["before"] is None

    # The exporter counts both, once each, and says the cleanup's before and after.
    where = {"pid": str(pid), "action": "cleanup"}
    assert _value(scrape, "memtop_process_actions_total", **where, result="ok") == 1
    assert _value(scrape, "memtop_process_actions_total", **where, result="refused") == 1
    assert _value(scrape, "memtop_process_last_action_time_seconds", **where) == pytest.approx(
        action["time"], abs=1e-3
    )
    for window in ("before", "after"):
        reserved = _value(
            scrape, "memtop_process_last_action_reserved_bytes", **where, window=window
        )
        assert reserved is not None and reserved > 0

    # The recording replays it, at the moment after it, with the recorder's own history before.
    replayed = json.loads(
        memtop("replay", str(recording), "--once", "--json", socket_dir=socket_dir).stdout
    )
    (again_done,) = [
        a for a in replayed["actions"] if a["kind"] == "cleanup" and a["result"] == "ok"
    ]
    assert again_done["by"] == {"uid": os.getuid(), "pid": shell.pid}
    assert again_done["before"]["basis"] == "samples" and again_done["before"]["samples"] >= 2
    assert again_done["after"]["samples"] >= 1
    # The HTML report lists it, with who asked and what it did.
    page = tmp_path / "page.html"
    assert memtop("report", str(recording), "-o", str(page), socket_dir=socket_dir).returncode == 0
    html = page.read_text()
    actions_section = html[html.index("<h2>Actions</h2>") :]
    assert "<td>cleanup</td>" in actions_section and f"<td>uid {os.getuid()}</td>" in html
    # Before it happened, a replay does not know it.
    early = json.loads(
        memtop(
            "replay", str(recording), "--once", "--json", "--at", "0.5", socket_dir=socket_dir
        ).stdout
    )
    assert not [a for a in early["actions"] if a["kind"] == "cleanup" and a["result"] == "ok"]


def test_the_detail_says_who_asked_and_a_refusal_in_short_lines() -> None:
    from memtop.diagnosis.effects import effect
    from memtop.ui.view import effect_lines

    times = [float(t) for t in range(100, 221)]
    reserved = [4096.0 * MiB if t <= 160 else 3072.0 * MiB for t in range(100, 221)]
    marks = [float(s) for s in range(0, 6001, 50)]
    stamps = [100 + s * 0.02 for s in marks]
    theirs = ActionRecord(
        "cleanup", 160.0, 42, by_uid=1000, by_pid=4321, step=3000, seq=7, source="agent"
    )
    lines = effect_lines(
        effect(theirs, 0, times, reserved, reserved, [0.0] * 121, marks, stamps), 220.0
    )
    # 48 characters with "ago": the line drops that word rather than overflow the box.
    assert lines[0] == "cleanup 60 s: rsvd 4.0G→3.0G split 4.0G→3.0G"
    assert lines[-1] == "by uid 1000 · after step 3000"
    assert all(len(line) <= 46 for line in lines)
    # Known only from the agent's reading (this viewer came after it): said so.
    late = ActionRecord(
        "tune",
        219.5,
        42,
        by_uid=1000,
        seq=8,
        source="agent",
        before={0: {"reserved_bytes": 5 << 30, "split_bytes": 1 << 30}},
    )
    found = effect(late, 0, times[-1:], reserved[-1:], reserved[-1:], [0.0], [], [])
    assert found.before is not None and found.before.basis == "agent"
    assert found.before.reserved_bytes == 5 << 30
    assert effect_lines(found, 221.0)[-1] == "by uid 1000 · before: agent's reading"
    refused = ActionRecord(
        "tune", 219.0, 42, by_uid=0, result="refused", why="x" * 300, seq=9, source="agent"
    )
    said = effect_lines(effect(refused, 0, times, reserved, reserved, [0.0] * 121, [], []), 220.0)
    assert said[0] == "tune 1 s ago: refused" and said[-1] == "by uid 0"
    assert all(len(line) <= 46 for line in (lines[-1], *said))
    # The agent's own (--auto-cleanup): no uid.
    own = ActionRecord("cleanup", 160.0, 42, seq=10, source="agent")
    assert own.by_words() == "by the agent itself"


def test_the_agent_logs_on_the_trainers_thread_and_a_broken_log_never_reaches_it(
    socket_dir: Path,
) -> None:
    import threading

    from memtop.agent.probe import ProbeDevice
    from memtop.agent.server import Agent
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.probe import SimulatedGpu, SimulatedProbe
    from memtop.sources.agent_client import AgentClient

    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 << 30), 0)
    device = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000001", "Sim GPU", 8 << 30)
    agent = Agent(SimulatedProbe([SimulatedGpu(device, allocator)]), socket_dir)
    agent.start()
    appended_on: list[str] = []
    real_append = agent.actions.append

    def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
        appended_on.append(threading.current_thread().name)
        return real_append(*args, **kwargs)

    agent.actions.append = watched  # type: ignore[method-assign]
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            agent.on_step(explicit=True)
            time.sleep(0.01)

    stepping = threading.Thread(target=trainer, name="the-trainer")
    stepping.start()
    try:
        allocator.free(allocator.malloc(40 * MiB))
        with AgentClient(agent.pid, agent.directory, timeout=5.0) as client:
            client.connect()
            done = client.request("cleanup", timeout=10)
            assert done["released_bytes"] == {"0": 40 * MiB}
            assert appended_on == ["the-trainer"]  # at the step boundary, where it ran
            (entry,) = client.request("sample")["actions"]
            assert entry["seq"] == done["action_seq"] and entry["by"]["pid"] == os.getpid()
            assert entry["devices"]["0"]["reserved_bytes"] == 40 * MiB  # read right before
            assert client.request("sample").get("actions") is None  # nothing new
            # A log that fails: the action still runs and answers, the trainer steps on.
            agent.actions.append = None  # type: ignore[assignment,method-assign]
            agent.commands.cleanup_cooldown.refund()
            again = client.request("cleanup", timeout=10)
            assert "released_bytes" in again and "action_seq" not in again
            assert any("action log" in e for e in agent.errors)
        before = agent.step or 0
        time.sleep(0.2)
        assert (agent.step or 0) > before
    finally:
        stop.set()
        stepping.join()
        agent.stop()
