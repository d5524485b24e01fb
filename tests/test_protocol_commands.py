"""Issue 35: the protocol's command set is one table (memtop.protocol.commands); the agent's
handlers, the viewer's parsers, the pool's polling, the replay and the conformance check all
hold exactly its names."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from memtop.protocol import commands

TRACES = Path(__file__).parent / "data" / "traces"


def test_every_side_serves_and_reads_exactly_the_table() -> None:
    from memtop.agent.handlers import HANDLERS
    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.protocol.schema import REPLY_PARSERS
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource

    assert set(HANDLERS) == commands.NAMES
    assert set(REPLY_PARSERS) == commands.NAMES
    pool = AgentPool(Path("/nonexistent"))
    Sampler(Store(), DefaultDeviceSource(Path("/nonexistent"), simulated_only=True), pool)
    assert set(pool.low_rate) == set(commands.LOW_RATE_NAMES)
    assert pool.low_rate["sites"] == commands.BY_NAME["sites"].viewer_every_s
    # What changes a trainer, by its arguments: never sent by --readonly or the check.
    assert commands.acts("cleanup") and commands.acts("reset_peak")
    assert not commands.acts("snapshot") and commands.acts("snapshot", {"path": "/x"})
    assert not commands.acts("sites") and commands.acts("sites", {"stacks": False})
    assert commands.acts("no_such_command")


def test_the_agents_cooldowns_are_the_tables() -> None:
    from memtop.agent import handlers

    assert commands.BY_NAME["cleanup"].cooldown_s == handlers.CLEANUP_MIN_INTERVAL_S
    assert commands.BY_NAME["snapshot"].cooldown_s == handlers.SNAPSHOT_MIN_INTERVAL_S


def test_a_records_sites_replies_are_replayed(tmp_path: Path) -> None:
    # `memtop record` kept every reply it read, `sites` too, but the replay's own list of
    # commands (hello, sample, breakdown, snapshot) dropped them: a recorded leak's line was gone.
    from memtop.sources.recording import RecordWriter
    from memtop.sources.replay import load

    with gzip.open(TRACES / "leak.jsonl.gz", "rt") as lines:
        wire = [json.loads(line) for line in lines]
    hello = next(w for w in wire if w["cmd"] == "hello")
    samples = [w for w in wire if w["cmd"] == "sample"][:3]
    site = {"file": "/u/train.py", "line": 45, "function": "train", "text": "kept.append(x)"}
    sites = {
        "enabled": True,
        "time": samples[1]["t"],
        "step": 3,
        "sites": [{"device": 0, "site": site, "bytes": 1 << 20, "blocks": 2, "old_blocks": 1}],
    }
    path = tmp_path / "run.memtop"
    writer = RecordWriter(path)
    for t, cmd, result in (
        (hello["t"], "hello", hello["reply"]["result"]),
        *((s["t"], "sample", s["reply"]["result"]) for s in samples),
        (samples[1]["t"], "sites", sites),
    ):
        writer.write({"t": t, "src": "agent", "pid": 427, "cmd": cmd, "reply": {"result": result}})
    writer.close()
    recording = load(path)
    kinds = [event.kind for event in recording.events]
    assert "sites" in kinds, kinds
    (event,) = [e for e in recording.events if e.kind == "sites"]
    assert event.value.sites[0].site.line == 45
