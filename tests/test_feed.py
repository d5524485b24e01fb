"""One seam per feed (memtop.feed): the live sampler, the replay player and the fleet sampler
pause, stop and act the same way, and an action comes back as a typed reply, never raised."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop.feed import ActionReply, FeedLoop, StillFeed
from memtop.fleet import FleetSampler
from memtop.model import AgentCleanup, AgentResetPeak
from memtop.playback import Player
from memtop.sampler import Sampler
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentClient, AgentPool
from memtop.sources.devices import DefaultDeviceSource
from memtop.store import Store


def test_the_three_feeds_share_one_thread_control():
    for feed in (Sampler, Player, FleetSampler, StillFeed):
        assert issubclass(feed, FeedLoop)
        # pause / paused / stop live in one place, not one copy per feed
        for name in ("pause", "paused", "_run", "_stop_thread"):
            if feed is not Player or name != "pause":  # the player's holds its tick lock
                assert getattr(feed, name) is getattr(FeedLoop, name), (feed, name)


def test_a_still_feed_acts_on_nothing_and_says_so():
    feed = StillFeed(Store())
    reply = feed.act(4101, "cleanup").result(timeout=1)
    assert isinstance(reply, ActionReply) and not reply.ok
    assert "not live" in (reply.error or "")
    assert "not live" in (feed.signal(4101, signal.SIGTERM, None).error or "")
    assert feed.rounds == 1 and not feed.still


class _BrokenFleet:
    """A Prometheus source whose reading breaks the fleet's round (not its read)."""

    url = "http://prometheus.invalid"

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> object:
        self.reads += 1
        return object()  # no hosts, no problems: applying it raises AttributeError

    def history(self, *args: object) -> dict[str, object]:
        return {}

    def close(self) -> None:
        pass


def test_a_fleet_round_that_raises_is_said_and_the_fleet_reads_on():
    source = _BrokenFleet()
    fleet = FleetSampler(source, interval=0.01)  # type: ignore[arg-type]
    fleet.start()
    try:
        deadline = time.monotonic() + 10
        while source.reads < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        fleet.stop()
    assert source.reads >= 3  # the thread outlived the first broken round
    assert any(note.startswith("fleet: AttributeError") for _, note in fleet.store.events)


@pytest.fixture
def demo() -> Iterator[Demo]:
    directory = Path(tempfile.mkdtemp(prefix="mtf-"))
    directory.chmod(0o700)
    running = Demo(gpus=1, scenario="healthy", step_time=0.05, socket_dir=directory)
    running.start()
    assert running.wait_ready(30)
    deadline = time.monotonic() + 30
    for process in running.processes:  # actions run at step boundaries: wait for the first
        with AgentClient(process.pid, directory, timeout=5) as client:
            client.connect()
            while not client.sample().step and time.monotonic() < deadline:
                time.sleep(0.05)
    yield running
    running.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_an_action_comes_back_as_a_typed_reply_and_its_consequence_is_the_feeds(demo: Demo):
    directory = demo.socket_dir
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(directory, simulated_only=True), AgentPool(directory)
    )
    try:
        sampler.sample_once()
        pid = demo.processes[0].pid
        cleanup = sampler.act(pid, "cleanup").result(timeout=15)
        assert cleanup.ok and cleanup.wire["at_step_boundary"] is True
        parsed = cleanup.parsed_as(AgentCleanup)
        assert parsed is not None and set(parsed.released_bytes) == {0}
        assert cleanup.parsed_as(AgentResetPeak) is None

        written = store.generation  # nothing samples meanwhile: only the action writes
        reset = sampler.act(pid, "reset_peak").result(timeout=15)
        assert reset.ok and reset.parsed_as(AgentResetPeak) is not None
        assert store.generation > written  # the feed restarted its sampled peak itself

        # A pid with no agent: the reply says why, the future does not raise.
        missing = sampler.act(999_999_999, "cleanup", timeout=1.0).result(timeout=5)
        assert not missing.ok and missing.error
        # A pid neither the driver lists nor an authenticated agent serves is never signalled.
        refused = sampler.signal(999_999_999, signal.SIGTERM, None)
        assert refused.error and "never verified" in refused.error
    finally:
        sampler.stop()
