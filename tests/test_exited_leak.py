"""A leaking trainer that exits keeps its leak verdict while its row stays (issue 36, item 17):
the row stayed a minute as `exited`, but its trend and its leak suggestion vanished at once.
Now both stay, marked as the last seen."""

from __future__ import annotations

from helpers.observations import HOST
from ui_frozen import MY_UID, NOW, frozen_store

from memtop.engine.observation import Observer
from memtop.model import Severity
from memtop.sources.agents import EXITED, AgentView
from memtop.ui import view

LEAKER = 4102  # the frozen store's leaking trainer


def test_an_exited_leakers_verdict_stays_marked_as_last_seen() -> None:
    store = frozen_store()
    clock = [NOW]
    observer = Observer(store, clock=lambda: clock[0], host=HOST, uid=MY_UID)
    live = observer.latest()
    (leak,) = [s for s in live.suggestions if s.pid == LEAKER and s.rule == "leak"]
    assert "last seen" not in leak.title

    hello = store.agent(LEAKER).hello  # type: ignore[union-attr]
    store.update_agents([AgentView(LEAKER, EXITED, hello, error="gone")], NOW + 1)
    clock[0] = NOW + 1
    gone = observer.latest()
    (agent,) = [a for a in gone.agents if a.pid == LEAKER]
    assert agent.status == EXITED and agent.devices  # its row stays
    kept = [s for s in gone.suggestions if s.pid == LEAKER and s.rule == "leak"]
    assert len(kept) == 1, [s.title for s in gone.suggestions]
    (last,) = kept
    assert last.title.startswith(f"Leak, last seen before pid {LEAKER} exited: +8.0 MiB per step")
    assert "full in" not in last.title and last.effect_bytes is None  # it grows no more
    assert last.severity == Severity.WARNING

    dash = view.build(gone, sampled=True, my_uid=MY_UID, host=HOST)
    (row,) = [r for r in dash.processes if r.pid == LEAKER]
    assert row.state == "exited" and row.trend.startswith("was +8")
    assert any(item.pid == LEAKER and "last seen" in item.title for item in dash.suggestions)
