"""What one round's observation does again that it need not (issue 35 item 8, the `mixed` CPU):
each cut measured as a count of work that a round with nothing new to judge no longer does,
with the outputs the same."""

from __future__ import annotations

import importlib
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


def _made(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[Any]:
    """Each record of `cls` made from now on (its `__init__` called)."""
    made: list[Any] = []
    real = cls.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counted)
    return made


def test_a_rounds_observation_is_freed_by_reference_counting_alone() -> None:
    """Each round's observation (its GPUs, their diagnoses and samples, rows, suggestions) is
    freed when the next one replaces it, without the cyclic collector: the dashboard runs that
    rarely (a raised threshold, memtop.ui.app), so a cycle among a round's records keeps every
    round's until it does.  A GPU's accounting joined when read, by a record holding the round's
    GPUs that hold it, made one (~330 objects a round; the dashboard ~0.6-1 MB larger in
    bench/tui_cost.py's `mixed`)."""
    import gc

    from test_churn_bounds import _round
    from ui_frozen import T0, Trainer

    from memtop.engine.store import Store

    kinds = ("healthy",) * 8 + ("leak", "fragment", "leak")
    trainers = [Trainer(5000 + i, i % 2, kind) for i, kind in enumerate(kinds)]
    store = Store(history=40, step_marks=80)
    clock = [T0]
    observer = Observer(store, clock=lambda: clock[0], host=HOST, uid=MY_UID)

    def rounds(first: int, last: int) -> None:
        for t in range(first, last):
            clock[0] = T0 + t + 0.5
            _round(store, t, trainers, [])
            for gpu in observer.latest().gpus:
                assert gpu.accounting is not None  # every lazy part read, as screens do

    rounds(1, 60)  # the rings full, every rule and verdict made once
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        rounds(60, 80)
        assert gc.collect() == 0, "a round's records were freed only by the cyclic collector"
    finally:
        if was_on:
            gc.enable()


def test_a_suggestion_that_reads_the_same_is_not_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round whose rules find what they found last round (the judgement kept: the same
    finding) keeps last round's suggestions, and the records of those on screen (`_Shown`) are
    brought up to date where they are: neither is made again, and the suggestions are those a
    new observer makes of the same round."""
    from memtop.diagnosis.stability import _Shown
    from memtop.diagnosis.suggestions import Suggestion

    store = frozen_store()
    clock = [NOW]
    observer = Observer(store, clock=lambda: clock[0], host=HOST, uid=MY_UID)
    observer.latest()
    clock[0] = NOW + 1
    first = observer.publish()  # the suggestions now on screen are judged as held
    assert len(first.suggestions) >= 3
    suggestions = _made(monkeypatch, Suggestion)
    shown = _made(monkeypatch, _Shown)
    clock[0] = NOW + 2
    second = observer.publish()
    assert not shown, "records of suggestions on screen made again"
    # The rules that keep their judgement on the same figures (`_judged_once`) find the same
    # finding again; the others (here the leak and expandable segments) word theirs anew.
    kept = {"8bit_optimizer", "bf16_parameters", "bigger_batch"}
    assert {s.rule for s in first.suggestions} & kept
    assert not [s for s in suggestions if s.rule in kept], "suggestions made again"
    assert len(suggestions) == sum(s.rule not in kept for s in first.suggestions)
    assert second.suggestions == first.suggestions
    assert all(
        a is b for a, b in zip(second.suggestions, first.suggestions, strict=True) if a.rule in kept
    )
    fresh = Observer(store, clock=lambda: clock[0], host=HOST, uid=MY_UID).latest()
    assert second.suggestions == fresh.suggestions


def test_a_snapshot_summary_is_read_once_not_every_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device's snapshot summary (read from its agent once a snapshot interval) is worked
    into its fragmentation figures once, not every round; the figures are the same."""
    fragmentation = importlib.import_module("memtop.diagnosis.fragmentation")

    snapshot_figures = fragmentation.snapshot_figures
    reads: list[Any] = []

    def counted(summary: Any) -> Any:
        reads.append(summary)
        return snapshot_figures(summary)

    monkeypatch.setattr(fragmentation, "snapshot_figures", counted)
    monkeypatch.setattr(diagnosis, "snapshot_figures", counted, raising=False)

    from memtop.model import AgentSnapshot

    store = frozen_store()
    summary = {"stranded_bytes": 3 << 30, "reserved_large_bytes": 12 << 30}
    summary["largest_request_bytes"] = 1 << 30
    with store.round():
        for trainer in TRAINERS:
            store.update_snapshot_summary(trainer.pid, AgentSnapshot(NOW, False, {0: summary}), NOW)
    clock = [NOW]
    observer = Observer(store, clock=lambda: clock[0], host=HOST, uid=MY_UID)
    first = observer.latest()
    with_summary = [
        d
        for a in first.agents
        for d in first.devices_of(a)
        if (a.snapshot_summary or {}).get(d.index) is not None
    ]
    assert with_summary
    assert len(reads) == len(with_summary)
    for t in (301, 302, 303):  # the trainers step on: new samples, the same summary
        store.update_agents([poll_at(trainer, t, 40 << 30) for trainer in TRAINERS], NOW + t)
        clock[0] = NOW + t
        later = observer.latest()
    assert len(reads) == len(with_summary), "the same summaries read again"
    for dev in with_summary:
        again = later.device(dev.pid, dev.index)
        assert again is not None
        summary = (again.process.snapshot_summary or {})[dev.index]  # type: ignore[union-attr]
        external, largest, stranded = snapshot_figures(summary)
        frag = again.fragmentation
        assert (frag.external, frag.largest_free_block_bytes, frag.stranded_bytes) == (
            external,
            largest,
            stranded,
        )
