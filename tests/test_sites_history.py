"""Sites from one connection (issue 31, item 4; DESIGN §13): the agent keeps a bounded history of
its grouping rounds and a viewer's first `sites` request gets it, so `memtop --once`, the
exporter's first scrape and a fresh dashboard name a leak's line as a long-running dashboard does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_diagnosis_scenarios import Watch
from test_sampler_store import poll
from test_sites import HERE, MiB, client_for, line_of, scenario_line, three_line_step

from memtop import protocol
from memtop.agent import sites as site_tracking
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.base import children
from memtop.diagnosis.leak import LeakEstimate
from memtop.diagnosis.sites import leaking_site, site_trends
from memtop.engine.store import Store
from memtop.model import AgentSites
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.demo import Demo
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
from memtop.sources.agents import AgentError

THIS = Path(__file__).resolve()


def line_here(marker: str) -> int:
    """The line of this file that holds `marker` in a comment."""
    lines = THIS.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.endswith(f"# {marker}"))


LEAK_LINE = "kept = self._m(self.leak_bytes_per_step)"
DETECTED = LeakEstimate(True, 2 * MiB, None, None, None, 0.99, "steps", 60, 1, "grows")


@pytest.fixture
def allocator() -> SimulatedCachingAllocator:
    return SimulatedCachingAllocator(LocalDeviceMemory(2 << 30), 0)


@pytest.fixture
def agent(
    socket_dir: Path, allocator: SimulatedCachingAllocator, tmp_path: Path, monkeypatch
) -> Iterator[Agent]:
    """A real agent (its socket, its thread) over a simulated trainer's allocator."""
    monkeypatch.setenv("MEMTOP_OOM_DIR", str(tmp_path / "oom"))
    info = ProbeDevice(0, "GPU-00000000-0000-0000-0000-000000000001", "Sim GPU", 2 << 30)
    server = Agent(SimulatedProbe([SimulatedGpu(info, allocator)]), socket_dir, argv=["train.py"])
    server.start()
    server.boundary.mark_interval_s = 0.0  # a step mark every step (an OOM report's `recent`)
    yield server
    server.stop()


@pytest.fixture
def fast_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(site_tracking, "MIN_INTERVAL_S", 0.0)
    monkeypatch.setattr(site_tracking, "COST_FACTOR", 0)


@pytest.fixture
def every_round_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(site_tracking, "HISTORY_EVERY_S", 0.0)


# ------------------------------------------------------------------ the agent serves its history


def test_a_first_sites_request_carries_the_rounds_a_trend_needs(
    agent, allocator, fast_rounds, every_round_kept
):
    agent.sites.wanted = True
    agent.on_step(explicit=True)  # stacks switched on, on the trainer's thread
    kept: list[int] = []
    for _ in range(6):
        three_line_step(allocator, kept, leaking=1)
        agent.on_step(explicit=True)
    client = client_for(agent)
    try:
        raw = client.sites()  # the viewer's call: its first on this connection asks history
        again = client.sites()  # ... and no more
    finally:
        client.close()
    steps = [r["step"] for r in raw["history"]]
    assert steps == sorted(steps) and len(steps) == 5 and steps[-1] < raw["step"] == 7
    assert "history" not in again
    # A fresh viewer (the pool, the sampler, the store: what --once runs) reads it once.
    watch = Watch(agent.directory)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            watch.sampler.sample_once()
            view = watch.store.agent(agent.pid)
            if view is not None and view.sites:
                break
            time.sleep(0.05)
    finally:
        watch.sampler.stop()
    readings = watch.store.agent(agent.pid).sites
    assert [r.step for r in readings] == [*steps, 7]
    assert all(r.history == () for r in readings)  # a kept reading is one round
    culprit = leaking_site(site_trends(readings, 0, DETECTED))
    assert culprit is not None and culprit.site.file == str(HERE)
    assert culprit.site.line == line_of("activations site")
    assert culprit.bytes_per_step == 2 * MiB
    for block in kept:
        allocator.free(block)


def test_the_history_is_spaced_and_forgotten_when_stacks_are_switched(
    agent, allocator, fast_rounds, monkeypatch
):
    monkeypatch.setattr(site_tracking, "HISTORY_EVERY_S", 3600.0)  # however slow the box
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    kept: list[int] = []
    for _ in range(5):  # one round kept per HISTORY_EVERY_S
        three_line_step(allocator, kept, leaking=0)
        agent.on_step(explicit=True)
    assert agent.sites.rounds == 5 and len(agent.sites.history) == 1
    reply = agent.sites.result(history=True)
    assert [r["step"] for r in reply["history"]] == [2] and reply["step"] == 6  # the first kept
    agent.sites.wanted = False
    agent.on_step(explicit=True)
    assert agent.sites.history == () and agent.sites.result(history=True)["history"] == []
    for block in kept:
        allocator.free(block)


def test_the_history_argument_must_be_a_boolean(agent):
    client = client_for(agent)
    try:
        with pytest.raises(AgentError, match="'history' must be a boolean"):
            client.request("sites", {"history": 1})
        assert "history" not in client.request("sites")  # an older viewer asks nothing new
        assert client.request("sites", {"history": True})["history"] == []  # stacks off
    finally:
        client.close()


def _allocate_from_many_files(allocator, count: int, name_chars: int) -> list[int]:
    """A block from each of `count` distinct user files with long names (hostile sites)."""
    blocks: list[int] = []
    for i in range(count):
        filename = f"/hostile/{'x' * name_chars}{i}.py"
        code = compile("blocks.append(allocator.malloc(MiB))", filename, "exec")
        exec(code, {"allocator": allocator, "blocks": blocks, "MiB": MiB})
    return blocks


def test_a_hostile_number_of_sites_cannot_grow_the_history(
    agent, allocator, fast_rounds, every_round_kept
):
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    held: list[int] = []
    for _ in range(30):
        held += _allocate_from_many_files(allocator, 40, name_chars=900)
        agent.on_step(explicit=True)
    client = client_for(agent)
    try:
        raw = client.request("sites", {"history": True})
    finally:
        client.close()
    # Each round holds its top sites only, and the rounds together stay under the byte bound.
    assert len(raw["sites"]) == site_tracking.TOP_SITES
    history_bytes = len(json.dumps(raw["history"], separators=(",", ":")))
    assert 0 < len(raw["history"]) < site_tracking.HISTORY_ROUNDS
    assert history_bytes <= site_tracking.HISTORY_MAX_BYTES
    assert sum(n for _, n in agent.sites.history) <= site_tracking.HISTORY_MAX_BYTES
    assert len(protocol.encode_frame({"result": raw})) < protocol.MAX_FRAME_BYTES // 2
    parsed = protocol.parse_sites(raw)
    assert len(parsed.history) == len(raw["history"])
    for block in held:
        allocator.free(block)


def test_the_history_is_bounded_in_rounds(agent, allocator, fast_rounds, every_round_kept):
    agent.sites.wanted = True
    agent.on_step(explicit=True)
    kept: list[int] = []
    for _ in range(3 * site_tracking.HISTORY_ROUNDS):
        three_line_step(allocator, kept, leaking=2)
        agent.on_step(explicit=True)
    rounds = agent.sites.result(history=True)["history"]
    assert len(agent.sites.history) == site_tracking.HISTORY_ROUNDS
    assert len(rounds) == site_tracking.HISTORY_ROUNDS - 1  # the newest is the reply itself
    for block in kept:
        allocator.free(block)


# ------------------------------------------------------------------ an OOM report


def keep_activations(allocator, size):
    return allocator.malloc(size)  # the leaking line


def load_batch(allocator, size):
    return allocator.malloc(size)  # a batch, freed every step


def test_memtop_oom_names_the_leaking_line_from_the_kept_rounds(
    agent, allocator, fast_rounds, every_round_kept, tmp_path, capsys
):
    from memtop.cli import main
    from memtop.sim.allocator import SimulatedOutOfMemoryError

    agent.sites.wanted = True
    agent.on_step(explicit=True)
    kept: list[int] = []
    with pytest.raises(SimulatedOutOfMemoryError):
        for _ in range(100):  # 64 MiB a step into 2 GiB: out of memory within ~32 steps
            allocator.free(load_batch(allocator, 16 * MiB))
            kept.append(keep_activations(allocator, 64 * MiB))
            agent.on_step(explicit=True)
    assert agent.oom.flush(5.0)
    (path,) = (tmp_path / "oom").glob("oom-*.json")
    report = json.loads(path.read_text())
    top = report["sites"][0]
    assert top["site"]["line"] == line_here("the leaking line")
    assert top["bytes_per_step"] == 64 * MiB and top["falls"] == 0 and top["readings"] >= 20
    assert main(["oom", str(path)]) == 0
    out = capsys.readouterr().out
    name = f"test_sites_history.py:{line_here('the leaking line')} return allocator.malloc(size)"
    assert "leak: needed 16.0 MiB" in out and f"/step since step 1, from `{name}" in out, out
    assert (
        f"see what keeps the blocks from test_sites_history.py:{line_here('the leaking line')}"
        in out
    )
    for block in kept:
        allocator.free(block)


def test_an_oom_report_without_site_growth_names_no_line():
    from memtop.oom.diagnose import leak_site

    site = {"file": "/u/train.py", "line": 9, "function": "step", "text": "x"}
    entry = {"device": 0, "site": site, "bytes": 9, "blocks": 3, "old_blocks": 2}
    assert leak_site([entry], MiB) is None  # an agent before DESIGN §13: no growth in it
    grown = {**entry, "bytes_per_step": MiB, "since_step": 1, "readings": 5, "falls": 0}
    assert leak_site([grown], MiB) == grown
    assert leak_site([{**grown, "falls": 1}], MiB) is None  # it fell back: not a leak's
    assert leak_site([{**grown, "readings": 2}], MiB) is None  # too few readings
    assert leak_site([{**grown, "bytes_per_step": MiB / 8}], MiB) is None  # too small a share
    assert leak_site([{**grown, "readings": "5"}, "junk"], MiB) is None  # a report's junk


# ------------------------------------------------------------------ the viewer reads it


def _round(time_: float, step: int, nbytes: int) -> dict:
    site = {"file": "/u/train.py", "line": 9, "function": "step", "text": "kept.append(x)"}
    entry = {"device": 0, "site": site, "bytes": nbytes, "blocks": 1, "old_blocks": 1}
    return {"time": time_, "step": step, "sites": [entry], "blocks": 1, "took_s": 0.001}


def _reply(latest: dict, history: list[dict] | None) -> dict:
    reply = {"enabled": True, "wanted": True, "supported": True, **latest, "rounds": 9}
    if history is not None:
        reply["history"] = history
    return reply


def test_an_old_agents_reply_without_history_reads_as_before():
    parsed = protocol.parse_sites(_reply(_round(100.0, 10, MiB), None))
    assert parsed.history == () and parsed.step == 10 and parsed.sites[0].bytes == MiB
    store = Store()
    store.update_agents([poll(7, 1, MiB)])
    store.update_sites(7, parsed)
    store.update_sites(7, protocol.parse_sites(_reply(_round(105.0, 20, 2 * MiB), None)))
    assert [r.step for r in store.agent(7).sites] == [10, 20]


def test_the_store_keeps_only_history_newer_than_its_newest_reading():
    store = Store()
    store.update_agents([poll(7, 1, MiB)])
    store.update_sites(7, protocol.parse_sites(_reply(_round(100.0, 10, MiB), None)))
    # A reconnection's first reply: rounds the store has, one it has not, then the newest.
    history = [_round(95.0, 5, MiB), _round(100.0, 10, MiB), _round(103.0, 13, 2 * MiB)]
    store.update_sites(7, protocol.parse_sites(_reply(_round(106.0, 16, 3 * MiB), history)))
    readings: tuple[AgentSites, ...] = tuple(store.agent(7).sites)
    assert [r.step for r in readings] == [10, 13, 16]
    store.update_sites(7, protocol.parse_sites({"enabled": False, "sites": []}))  # stacks off
    assert not store.agent(7).sites


@pytest.mark.parametrize(
    "history, message",
    [
        ("all", "'history' must be a list"),
        ([1], "not an object"),
        ([{"sites": []}], "without its time"),
        ([_round(1.0, 1, -1)], "negative"),
        ([_round(float(i), i, 1) for i in range(65)], "more than 64"),
    ],
)
def test_a_bad_history_is_a_bad_reply(history, message):
    with pytest.raises(protocol.ProtocolError, match=message):
        protocol.parse_sites(_reply(_round(100.0, 10, MiB), history))


# ------------------------------------------------------------------ one connection, end to end


def _once(socket_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "memtop", "--once", "--json", "--socket-dir", str(socket_dir)],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


LEAK_SITE_FAMILY = "memtop_leak_site_bytes_per_step{"
# An exporter's agent pool reads `sites` every 5 s (SITES_INTERVAL_S): a trend from its own
# readings needs three of them, 10 s; from the agent's kept rounds, the first one that arrives.
SCRAPE_WITHIN_S = 8.0


def _early_scrape(socket_dir: Path) -> str:
    """/metrics of a fresh exporter, scraped (every 0.5 s) until it names the leak's line or
    SCRAPE_WITHIN_S has passed: the first sampling rounds, before a trend of its own."""
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtop", "export", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
    )  # fmt: skip
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline()
        port = re.search(r"serving http://127\.0\.0\.1:(\d+)/metrics", line)
        assert port is not None, (line, exporter.stderr.read() if exporter.stderr else "")
        url = f"http://127.0.0.1:{port.group(1)}/metrics"
        deadline = time.monotonic() + SCRAPE_WITHIN_S
        while True:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = str(reply.read().decode())
            if LEAK_SITE_FAMILY in body or time.monotonic() > deadline:
                return body
            time.sleep(0.5)
    finally:
        children.stop(exporter, timeout=15.0)  # SIGTERM, then SIGKILL: never left running


def test_once_and_the_exporters_first_scrape_name_the_leaking_line(socket_dir: Path):
    """The issue's check: a leaking trainer with stacks on, then one connection."""
    demo = Demo(
        gpus=1,
        scenario="leak",
        step_time=0.02,
        socket_dir=socket_dir,
        extra_env={
            "MEMTOP_STACKS": "1",
            # Rounds 0.3 s apart, kept 0.5 s apart: a trend within seconds, not a minute.
            "MEMTOP_AGENT_TEST_LIMITS": "sites_min_interval_s=0.3,sites_history_every_s=0.5",
        },
    )
    demo.start()
    try:
        assert demo.wait_ready(30)
        pid = demo.processes[0].pid
        # Wait (on a connection of our own, which --once does not share) until the trainer
        # has stepped enough for a leak verdict and grouped its blocks a few times.
        from memtop.sources.agents import AgentClient

        watcher = AgentClient(pid, socket_dir, timeout=5.0)
        watcher.connect()
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                reply = watcher.request("sites")
                if reply.get("rounds", 0) >= 12 and (reply.get("step") or 0) >= 200:
                    break
                time.sleep(0.5)
        finally:
            watcher.close()
        data = _once(socket_dir)
        scrape = _early_scrape(socket_dir)
    finally:
        demo.stop()
    _, line = scenario_line(LEAK_LINE)
    (leak,) = [s for s in data["suggestions"] if s["rule"] == "leak"]
    assert f"`scenarios.py:{line} {LEAK_LINE}`" in leak["title"], (leak, data["agents"])
    (agent_data,) = data["agents"]
    top = agent_data["sites"][0]
    assert top["leaking"] and top["site"]["line"] == line
    assert 7 * MiB < top["bytes_per_step"] < 9 * MiB
    # The exporter's first scrapes: the leak's line and its rate.
    rows = [r for r in scrape.splitlines() if r.startswith(LEAK_SITE_FAMILY)]
    assert len(rows) == 1 and f'site="scenarios.py:{line}"' in rows[0], scrape[-2000:]
    assert 7 * MiB < float(rows[0].rsplit(" ", 1)[1]) < 9 * MiB
