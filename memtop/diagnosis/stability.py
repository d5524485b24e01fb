"""Suggestions that neither flicker nor reflow the list (issue 12).

The rules judge one round at a time; a measure hovering at a threshold (a fragmentation gauge
around 0.20, usage around 85 %) would switch its suggestion on and off every few seconds, and
a severity that changes re-sorts the pane under the user's cursor.  `Stabilizer` sits between
the rules and every consumer:

- hysteresis: a suggestion on screen is judged against its rule's exit limit (the rules take
  `held`, see `suggestions._at_least`), not the entry limit;
- minimum dwell: once shown, a suggestion stays at least MIN_DWELL_S, and GRACE_S after its
  rule last fired (with the figures of that last firing);
- severity falls only after it has held MIN_DWELL_S at the higher level (it rises at once).

The rules run every round: a suggestion's figures are those of the round the rest of the screen
shows (issue 21: "Fragmentation 0.23" in a suggestion beside "frag 0.19" on the same screen,
from a judgment kept for two seconds).  A suggestion kept only by its dwell or grace (its rule
no longer fires) keeps the figures of its last firing and says so: "as of HH:MM:SS, no longer
so" (a tip's "peak 48.3 GiB" stood beside the table's 76.1 GiB with nothing to tell them apart).

A suggestion of a process that is gone goes at once: there is nothing left to act on. So does
one whose rule's veto now holds (`suggestions.VETOES`): an event contradicts it (an OOM ends
"room for a bigger batch"), where the dwell is for a measure hovering at a line.  A process
whose agent did not answer this round (hung, unreachable: `silent`) is not gone: a step holding
the GIL, or a loaded box, made it miss one deadline, and its suggestions went and came back the
next round; they are kept as those of a rule that stopped firing are (dwell, grace, "no longer
so").
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace

from memtop.diagnosis.facts import DeviceDiagnosis, GpuObservation
from memtop.diagnosis.suggestions import (
    RULES,
    SEVERITY_RANK,
    VETOES,
    Finding,
    Key,
    Rule,
    Suggestion,
    suggest,
)

MIN_DWELL_S = 60.0
GRACE_S = 30.0


@dataclass
class _Shown:
    """A suggestion on screen and when it appeared, last fired and was last raised."""

    suggestion: Suggestion
    since: float  # when it appeared
    fired: float  # when its rule last fired
    severity_since: float  # when its shown severity was last raised (or set)


class Stabilizer:
    """Keeps what is on screen from one round to the next; one per running viewer."""

    def __init__(
        self,
        rules: Iterable[Rule] = RULES,
        min_dwell_s: float = MIN_DWELL_S,
        grace_s: float = GRACE_S,
    ) -> None:
        self.rules = tuple(rules)
        self.min_dwell_s = min_dwell_s
        self.grace_s = grace_s
        self._shown: dict[Key, _Shown] = {}
        # Last round's suggestions as the rules made them, by key, with the finding each was
        # made of: one made of the same finding again (a rule's judgement kept, see
        # `suggestions._judged_once`) is that suggestion, not a new record (`suggest`'s `made`).
        self._made: dict[Key, tuple[Finding, Suggestion]] = {}

    def forget(self) -> None:
        """Nothing is on screen any more: the next round is judged as a first one."""
        self._shown.clear()
        self._made.clear()

    def suggest(
        self, gpus: Iterable[GpuObservation], now: float, silent: Collection[int] = ()
    ) -> tuple[Suggestion, ...]:
        """What to show now, most severe first, judged on this round's facts.  `silent`: the
        pids whose agents are still there but did not answer this round (not gone)."""
        return self._judge(tuple(gpus), now, silent)

    def _judge(
        self, gpus: tuple[GpuObservation, ...], now: float, silent: Collection[int] = ()
    ) -> tuple[Suggestion, ...]:
        live: dict[tuple[int, int], DeviceDiagnosis] = {
            (a.pid, a.index): a for g in gpus for a in g.agents
        }
        gpu_indexes = {g.index for g in gpus}
        fired = {
            s.key: s for s in suggest(gpus, self.rules, held=self._shown.keys(), made=self._made)
        }
        shown: dict[Key, _Shown] = {}
        for key, new in fired.items():
            old = self._shown.get(key)
            if old is None:
                shown[key] = _Shown(new, now, now, now)
                continue
            # A suggestion shown last round and fired again: its record is brought up to date
            # where it is (this round's figures, fired now), not made again.
            shown[key] = old
            rank_new, rank_old = SEVERITY_RANK[new.severity], SEVERITY_RANK[old.suggestion.severity]
            if rank_new >= rank_old:
                if rank_new > rank_old:
                    old.severity_since = now
                old.suggestion = new
            elif now - old.severity_since < self.min_dwell_s:
                # Lower now, but the higher level has not held its dwell: keep it.
                old.suggestion = replace(new, severity=old.suggestion.severity)
            else:
                old.suggestion = new
                old.severity_since = now
            old.fired = now
        for key, old in self._shown.items():
            if key in shown:
                continue
            s = old.suggestion
            gone = (
                s.pid is not None and (s.pid, s.device) not in live and s.pid not in silent
            ) or (s.pid is None and s.device is not None and s.device not in gpu_indexes)
            if gone:
                continue
            veto = VETOES.get(s.rule)
            facts = (
                live.get((s.pid, s.device)) if s.pid is not None and s.device is not None else None
            )
            if veto is not None and facts is not None and veto(facts):
                continue
            if now - old.since < self.min_dwell_s or now - old.fired < self.grace_s:
                shown[key] = old
        self._shown = shown
        ordered = [
            entry.suggestion if entry.fired == now else _as_of(entry.suggestion, entry.fired)
            for entry in shown.values()
        ]
        # The same order as `suggest`, with first appearance breaking ties: a list that only
        # grows at the end of its severity never moves the row under the cursor.
        since = {key: entry.since for key, entry in shown.items()}
        return tuple(
            sorted(
                ordered,
                key=lambda s: (-SEVERITY_RANK[s.severity], s.pid or 0, s.device or 0, since[s.key]),
            )
        )


def _as_of(suggestion: Suggestion, fired: float) -> Suggestion:
    """A suggestion whose rule no longer fires, shown a while longer (no flicker): its figures
    are those of its last firing, and it says so beside the live ones on the same screen."""
    when = time.strftime("%H:%M:%S", time.localtime(fired))
    evidence = f"{suggestion.evidence}; " if suggestion.evidence else ""
    return replace(suggestion, evidence=f"{evidence}as of {when}, no longer so")
