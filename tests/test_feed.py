"""One seam per feed (memtop.engine.feed): the live sampler, the replay player and the fleet sampler
pause, stop and act the same way, and an action comes back as a typed reply, never raised."""

from __future__ import annotations

import signal
import time

from memtop.engine.feed import ActionReply, FeedLoop, StillFeed
from memtop.engine.fleet import FleetSampler
from memtop.engine.playback import Player
from memtop.engine.sampler import Sampler
from memtop.engine.store import Store


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
