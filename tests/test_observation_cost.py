"""What one round's observation does again that it need not (issue 35 item 8, the `mixed` CPU):
each cut measured as a count of work that a round with nothing new to judge no longer does,
with the outputs the same."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.observations import HOST
from ui_frozen import MY_UID, NOW, TRAINERS, frozen_store, poll_at

import memtop.diagnosis as diagnosis
from memtop.diagnosis import Diagnoser
from memtop.engine.observation import Observer
from memtop.sources.agents import EXITED, AgentView

LEAKER = 4102  # the frozen store's leaking trainer


@pytest.fixture
def analyses(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each leak analysis the diagnoser runs (its call of `detect`)."""
    calls: list[Any] = []
    real = diagnosis.detect

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(diagnosis, "detect", counted)
    return calls


def test_a_leak_verdict_due_again_on_the_same_marks_is_not_analysed_again(
    analyses: list[Any],
) -> None:
    """A verdict is due again every `leak_refresh_s` (here every round); a device whose marks
    and headroom did not change since (an exited trainer, whose row stays; a stalled one) keeps
    it without the analysis, and a device with a new mark is analysed again."""
    store = frozen_store()
    clock = [NOW]
    observer = Observer(
        store, Diagnoser(leak_refresh_s=0.0), clock=lambda: clock[0], host=HOST, uid=MY_UID
    )
    first = observer.latest()
    devices = len(first.diagnosis.devices)
    assert len(analyses) == devices == 3
    leak = first.device(LEAKER, 0).leak  # type: ignore[union-attr]
    assert leak.detected

    # The leaker exits: its row and its marks stay; the others sent nothing new either.
    hello = store.agent(LEAKER).hello  # type: ignore[union-attr]
    store.update_agents([AgentView(LEAKER, EXITED, hello, error="gone")], NOW + 1)
    clock[0] = NOW + 1
    gone = observer.latest()
    assert len(analyses) == devices, "the same marks were analysed again"
    assert gone.device(LEAKER, 0).leak is leak  # type: ignore[union-attr]

    # One trainer steps on: its marks change, and only it is judged again.
    (healthy, *_) = [t for t in TRAINERS if t.pid != LEAKER]
    store.update_agents([poll_at(healthy, 301, 40 << 30)], NOW + 2)
    clock[0] = NOW + 2
    stepped = observer.latest()
    assert len(analyses) == devices + 1
    again = stepped.device(healthy.pid, 0).leak  # type: ignore[union-attr]
    fresh = Observer(store, Diagnoser(), clock=lambda: clock[0], host=HOST, uid=MY_UID).latest()
    assert again == fresh.device(healthy.pid, 0).leak  # type: ignore[union-attr]


@pytest.mark.parametrize("exited", [None, LEAKER])
def test_suggest_judges_per_agent_rules_as_the_rules_themselves_do(exited: int | None) -> None:
    """`suggest` calls a per-agent rule's judge on each device straight (no generator per GPU
    and rule): its suggestions are those of every rule called on every GPU, in the same order,
    held or not (the exit limits of hysteresis)."""
    from memtop.diagnosis.suggestions import RULES, PerAgent, most_severe_first, suggest

    assert sum(isinstance(rule.judge, PerAgent) for rule in RULES) >= 8
    gpus = Observer(frozen_store(exited=exited), host=HOST, uid=MY_UID).latest().gpus
    for held in (set(), {s.key for s in suggest(gpus)}):
        one_by_one = most_severe_first(
            s for gpu in gpus for rule in RULES for s in rule(gpu, held=held)
        )
        assert suggest(gpus, RULES, held=held) == one_by_one
        assert one_by_one


def test_a_rows_words_from_its_hello_are_made_once_not_every_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a row says from its agent's hello (command and its label, ranks, job, ROCm) is made
    when the hello, the command line or the workload is another, not every round: the rows of
    a second round with the same agents are those a new observer makes, and their command lines
    are not cut again."""
    import memtop.engine.observation as observation

    cut: list[tuple[str, ...]] = []
    real = observation.short_command

    def counted(argv: Any) -> str:
        cut.append(tuple(argv))
        return real(argv)

    monkeypatch.setattr(observation, "short_command", counted)
    store = frozen_store()
    clock = [NOW]
    observer = Observer(store, clock=lambda: clock[0], host=HOST, uid=MY_UID)
    first = observer.latest()
    agents_argv = {tuple(a.argv) for a in first.agents}
    assert agents_argv and sum(argv in agents_argv for argv in cut) == len(first.agents)
    cut.clear()
    clock[0] = NOW + 1
    second = observer.publish()
    assert not [argv for argv in cut if argv in agents_argv], "the same command lines cut again"
    assert [r.command for r in second.entries] == [r.command for r in first.entries]
    fresh = Observer(store, clock=lambda: clock[0], host=HOST, uid=MY_UID).latest()
    assert [repr(r) for r in second.entries] == [repr(r) for r in fresh.entries]
