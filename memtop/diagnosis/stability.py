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

A suggestion of a process that is gone goes at once: there is nothing left to act on. So does
one whose rule's veto now holds (`suggestions.VETOES`): an event contradicts it (an OOM ends
"room for a bigger batch"), where the dwell is for a measure hovering at a line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from memtop.diagnosis.facts import DeviceDiagnosis, GpuFacts
from memtop.diagnosis.suggestions import RULES, VETOES, Key, Rule, Suggestion, suggest
from memtop.model import Severity

MIN_DWELL_S = 60.0
GRACE_S = 30.0
# The rules run at most this often while nothing urgent changed (see `_news`): the figures in
# their wording are shown anew only every few seconds anyway (the pane rewords every 8 s), and
# judging every GPU's facts against every rule was a third of building a round's observation.
RULES_EVERY_S = 2.0


@dataclass
class _Shown:
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
        rules_every_s: float = RULES_EVERY_S,
    ) -> None:
        self.rules = tuple(rules)
        self.min_dwell_s = min_dwell_s
        self.grace_s = grace_s
        self.rules_every_s = rules_every_s
        self._shown: dict[Key, _Shown] = {}
        self._last: tuple[tuple[object, ...], float, tuple[Suggestion, ...]] | None = None

    def forget(self) -> None:
        """Nothing is on screen any more: the next round is judged as a first one."""
        self._shown.clear()
        self._last = None

    def suggest(self, gpus: Iterable[GpuFacts], now: float) -> tuple[Suggestion, ...]:
        """What to show now, most severe first.  The same tuple as last time while the rules
        are not due and nothing urgent changed."""
        gpus = tuple(gpus)
        news = _news(gpus)
        last = self._last
        if last is not None and last[0] == news and 0 <= now - last[1] < self.rules_every_s:
            return last[2]
        judged = self._judge(gpus, now)
        self._last = (news, now, judged)
        return judged

    def _judge(self, gpus: tuple[GpuFacts, ...], now: float) -> tuple[Suggestion, ...]:
        live: dict[tuple[int, int], DeviceDiagnosis] = {
            (a.pid, a.index): a for g in gpus for a in g.agents
        }
        gpu_indexes = {g.index for g in gpus}
        fired = {s.key: s for s in suggest(gpus, self.rules, held=self._shown.keys())}
        shown: dict[Key, _Shown] = {}
        for key, new in fired.items():
            old = self._shown.get(key)
            if old is None:
                shown[key] = _Shown(new, now, now, now)
                continue
            rank_new, rank_old = Severity(new.severity).rank, Severity(old.suggestion.severity).rank
            if rank_new >= rank_old:
                raised = now if rank_new > rank_old else old.severity_since
                shown[key] = _Shown(new, old.since, now, raised)
            elif now - old.severity_since < self.min_dwell_s:
                # Lower now, but the higher level has not held its dwell: keep it.
                kept = replace(new, severity=old.suggestion.severity)
                shown[key] = _Shown(kept, old.since, now, old.severity_since)
            else:
                shown[key] = _Shown(new, old.since, now, now)
        for key, old in self._shown.items():
            if key in shown:
                continue
            s = old.suggestion
            gone = (s.pid is not None and (s.pid, s.device) not in live) or (
                s.pid is None and s.device is not None and s.device not in gpu_indexes
            )
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
        ordered = [entry.suggestion for entry in shown.values()]
        # The same order as `suggest`, with first appearance breaking ties: a list that only
        # grows at the end of its severity never moves the row under the cursor.
        since = {key: entry.since for key, entry in shown.items()}
        return tuple(
            sorted(
                ordered,
                key=lambda s: (-Severity(s.severity).rank, s.pid or 0, s.device or 0, since[s.key]),
            )
        )


def _news(gpus: tuple[GpuFacts, ...]) -> tuple[object, ...]:
    """What must be judged at once, not at the rules' next turn: a process come or gone, an
    OOM or an allocator retry, a leak verdict, an OOM report, a breakdown or allocator settings
    first known."""
    return tuple(
        (
            g.uuid,
            tuple(pid for pid, _ in g.processes),
            tuple(
                (
                    a.pid,
                    a.index,
                    a.pressure.retries,
                    a.pressure.ooms,
                    a.leak.detected,
                    a.last_oom is not None,
                    a.breakdown is not None,
                    a.allocator_conf,
                )
                for a in g.agents
            ),
        )
        for g in gpus
    )
