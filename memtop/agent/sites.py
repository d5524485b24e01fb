"""Sites: live memory grouped by the user's line that allocated it (DESIGN §12, issue 23).

With stack recording on (torch's `_record_memory_history(enabled="state", context="alloc",
stacks="python")`, or the simulator's), every live block of the allocator's snapshot carries its
allocating frames.  `SiteTracker.on_boundary` runs on the *trainer's* thread at step boundaries
(DESIGN §6: history is switched and snapshots are taken there, never from the agent thread, and
never while a CUDA graph is being captured); it
- switches history on or off when asked (MEMTOP_STACKS=1, `memtop run --stacks`, a viewer's
  `sites` request with `enable`),
- at a bounded rate groups the live blocks by site - the innermost frame of user code - into
  bytes, blocks, and old blocks (alive at the previous reading, by address), per device, and
  publishes the top ones for the agent thread to serve.

Its cost is bounded twice: a round that walks for longer than ROUND_CAP_S is abandoned (nothing
published, the next round comes later), and the next round is due no sooner than COST_FACTOR
times the last round's cost (a snapshot with history on can take hundreds of ms on a big cache:
then rounds come minutes apart, and the trainer loses at most 1/COST_FACTOR of its time).

Past rounds are kept too (DESIGN §13, "sites from one connection"): one round every
HISTORY_EVERY_S at most, the newest HISTORY_ROUNDS of them and never more than HISTORY_MAX_BYTES
as JSON, so that a viewer's first `sites` request (`{"history": true}`) gets the rounds a trend
needs - as a first `sample` gets every step mark still buffered - and `memtop --once`, the
exporter's first scrape or an OOM report judge a site's trend from one connection.  The rounds
are the very dicts published as `latest` (built on the trainer's thread, never changed after),
held in a tuple replaced whole, so the agent thread only reads what is already built.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import TYPE_CHECKING, Any

from memtop.agent import limits_for_tests, stacks
from memtop.protocol import replies

if TYPE_CHECKING:
    from memtop.agent.probe import Probe

MIN_INTERVAL_S = 2.0  # rounds at most this often
COST_FACTOR = 100  # ... and at most 1 % of the trainer thread's CPU time, amortised
ROUND_CAP_S = 0.25  # a walk of the blocks longer than this is abandoned
CHECK_EVERY = 256  # blocks between two looks at the clock
TOP_SITES = 20  # per device
# The history of rounds: spaced as the viewer asks (sampler.SITES_INTERVAL_S), so its trend
# spans minutes; bounded in rounds and in bytes whatever the number of devices, sites or the
# length of their file names and lines (a reply must stay far inside a 1 MiB frame).
HISTORY_EVERY_S = 5.0
HISTORY_ROUNDS = 24
HISTORY_MAX_BYTES = 256 * 1024


def stacks_wanted(env: dict[str, str] | Any) -> bool:
    """MEMTOP_STACKS=1 (what `memtop run --stacks` sets): stack recording from the start."""
    return str(env.get("MEMTOP_STACKS", "")).strip().lower() in ("1", "true", "yes", "on")


def site_of(frames: Any) -> tuple[str, int, str] | None:
    """The innermost user frame of a block's torch-format frames (innermost first)."""
    if not isinstance(frames, list):
        return None
    for frame in frames:
        if not isinstance(frame, dict):
            continue
        filename = frame.get("filename")
        if isinstance(filename, str) and stacks.is_user_file(filename):
            return filename, int(frame.get("line") or 0), str(frame.get("name") or "")
    return None


def _site_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    """One site of one device, whichever round's entry names it."""
    site = entry["site"]
    return (entry["device"], site["file"], site["line"], site["function"])


class SiteTracker:
    def __init__(self, probe: Probe, wanted: bool = False) -> None:
        self.probe = probe
        self.wanted = wanted  # set from any thread; acted on at the next boundary
        self.enabled = False  # what the trainer's thread last switched history to
        self.latest: dict[str, Any] | None = None  # replaced whole: the agent thread serves it
        # Past rounds, oldest first, with their sizes as JSON: replaced whole, as `latest` is.
        self.history: tuple[tuple[dict[str, Any], int], ...] = ()
        self._kept_at = 0.0  # when the newest round of the history was kept
        # MIN_INTERVAL_S and HISTORY_EVERY_S, unless a test lowered them (limits_for_tests).
        self._test_limits = limits_for_tests.read(os.environ)
        self.error: str | None = None
        self._due = 0.0  # the next grouping round
        self._switch_due = 0.0  # the next try at a switch (a failed one waits)
        self._previous: dict[int, set[int]] = {}  # device -> live block addresses last round
        self.rounds = 0
        self.rounds_abandoned = 0
        self.last_round_s = 0.0
        self.total_s = 0.0

    def _min_interval_s(self) -> float:
        return self._test_limits.get("sites_min_interval_s", MIN_INTERVAL_S)

    def supported(self) -> bool:
        return callable(getattr(self.probe, "record_history", None))

    # ------------------------------------------------------------ trainer's thread

    def on_boundary(self, now: float, step: int | None) -> None:
        """At a step boundary, on the trainer's thread.  O(1) unless a switch or a round is due;
        never raises (the boundary's caller catches, but a failed round must not repeat)."""
        switching = self.wanted != self.enabled
        if switching:
            if now < self._switch_due:
                return  # a switch that could not be made: tried again every few seconds
        elif not self.enabled or now < self._due:
            return
        started = time.perf_counter()
        cpu_started = time.thread_time()
        try:
            if self.probe.is_capturing():
                return  # a CUDA graph capture: touch nothing, try at a later step
            if switching:
                wanted = self.wanted
                self._switch_due = now + self._min_interval_s()
                self._due = (
                    now + self._min_interval_s()
                )  # blocks allocated before it carry no frames
                record = getattr(self.probe, "record_history", None)  # optional in a Probe
                if record is None or not record(wanted):
                    return  # no device in use yet: try again later
                self.enabled = wanted
                self._previous = {}
                # Rounds from before the switch are another recording's: a trend restarts.
                self.history = ()
                if not self.enabled:
                    self.latest = None
                return
            self._round(now, step, started)
        except Exception as exc:
            self.error = f"sites: {exc!r}"[:300]
            self._due = self._switch_due = now + 60.0
        finally:
            self.total_s += time.perf_counter() - started
            # The back-off counts the CPU this thread spent, not the wall time: on a loaded box
            # a round descheduled for 100 ms cost the trainer nothing then.
            spent = time.thread_time() - cpu_started
            self._due = max(self._due, now + spent * COST_FACTOR)

    def _round(self, now: float, step: int | None, started: float) -> None:
        self._due = now + self._min_interval_s()
        snapshot = self.probe.snapshot()
        groups: dict[tuple[int, tuple[str, int, str] | None], list[int]] = {}
        live: dict[int, set[int]] = {}
        seen = 0
        for segment in snapshot.get("segments", []):
            device = int(segment.get("device", 0))
            previous = self._previous.get(device, set())
            addresses = live.setdefault(device, set())
            for block in segment.get("blocks", []):
                if block.get("state") != "active_allocated":
                    continue
                seen += 1
                if seen % CHECK_EVERY == 0 and time.perf_counter() - started > ROUND_CAP_S:
                    self.rounds_abandoned += 1
                    return  # too many blocks for this round: skip it, the trainer goes on
                address = int(block.get("address", 0))
                addresses.add(address)
                entry = groups.get((device, key := site_of(block.get("frames"))))
                if entry is None:
                    entry = groups[(device, key)] = [0, 0, 0]
                entry[0] += int(block.get("size", 0))
                entry[1] += 1
                entry[2] += address in previous
        self._previous = live
        sites = []
        for device in sorted(live):
            ranked = sorted(
                ((key, value) for (d, key), value in groups.items() if d == device),
                key=lambda item: -item[1][0],
            )
            for key, (nbytes, blocks, old) in ranked[:TOP_SITES]:
                site = replies.UNKNOWN_SITE  # blocks without user frames
                if key is not None:
                    filename, line, function = key
                    text = stacks.source_text(filename, line)
                    site = replies.site_place(
                        file=filename, line=line, function=function, text=text
                    )
                sites.append(
                    replies.site_entry(
                        device=device, site=site, nbytes=nbytes, blocks=blocks, old_blocks=old
                    )
                )
        self.rounds += 1
        self.last_round_s = time.perf_counter() - started
        latest = replies.sites_round(
            time=time.time(),
            step=step,
            sites=sites,
            blocks=seen,
            took_s=round(self.last_round_s, 6),
        )
        self.latest = latest
        self._keep(latest, now)

    def _keep(self, latest: dict[str, Any], now: float) -> None:
        """Add a round to the history when the newest kept one is HISTORY_EVERY_S old, dropping
        the oldest beyond HISTORY_ROUNDS or HISTORY_MAX_BYTES (a round bigger than that alone is
        not kept: a trend from a cut round would be wrong)."""
        every = self._test_limits.get("sites_history_every_s", HISTORY_EVERY_S)
        if self.history and now < self._kept_at + every:
            return
        self._kept_at = now
        size = len(json.dumps(latest, separators=(",", ":")).encode("utf-8"))
        kept = [*self.history, (latest, size)][-HISTORY_ROUNDS:]
        total = sum(n for _, n in kept)
        while kept and total > HISTORY_MAX_BYTES:
            total -= kept.pop(0)[1]
        self.history = tuple(kept)

    # ------------------------------------------------------------ agent's thread

    def top_sites(self, limit: int = 10) -> list[dict[str, Any]]:
        """The newest round's largest sites over all devices (an OOM report carries them), each
        with its growth over the kept rounds, so that `memtop oom` names a leak's line
        (DESIGN §13): `bytes_per_step` (None: fewer than two readings, or no steps between),
        `since_step`, `readings` and `falls` (readings at which its bytes went down).  Reads
        the built rounds only; new dicts, the rounds' own are never changed."""
        latest = self.latest
        if latest is None or not self.enabled:
            return []
        top = sorted(latest["sites"], key=lambda s: -s["bytes"])[:limit]
        rounds = [r for r in self.past_rounds(latest["time"]) if r["step"] is not None]
        rounds = [*rounds, latest] if latest["step"] is not None else []
        series: dict[tuple[Any, ...], list[tuple[int, int]]] = {_site_key(s): [] for s in top}
        for past in rounds:
            for entry in past["sites"]:
                points = series.get(_site_key(entry))
                if points is not None:
                    points.append((past["step"], entry["bytes"]))
        grown = []
        for entry in top:
            points = series[_site_key(entry)]
            per_step = None
            if len(points) >= 2 and points[-1][0] > points[0][0]:
                per_step = (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
            grown.append(
                {
                    **entry,
                    "bytes_per_step": per_step,
                    "since_step": points[0][0] if points else None,
                    "readings": len(points),
                    "falls": sum(1 for a, b in itertools.pairwise(points) if b[1] < a[1]),
                }
            )
        return grown

    def past_rounds(self, before: float) -> list[dict[str, Any]]:
        """The kept rounds older than `before` (the served round's time), oldest first."""
        return [r for r, _ in self.history if r["time"] < before]

    def result(self, history: bool = False) -> dict[str, Any]:
        """What the `sites` command answers: the newest round (empty before the first), and with
        `history` the kept rounds before it (a first request: the trend from one connection)."""
        latest = self.latest  # read once: the trainer's thread may publish a newer one meanwhile
        past: list[dict[str, Any]] | None = None
        if history:
            past = self.past_rounds(latest["time"]) if latest is not None and self.enabled else []
        return replies.sites_result(
            enabled=self.enabled,
            wanted=self.wanted,
            supported=self.supported(),
            latest=latest,
            history=past,
            rounds=self.rounds,
            rounds_abandoned=self.rounds_abandoned,
            error=self.error or None,
        )
