"""The held figures are renewed where news moved (memtop.ui.renewal; issue 35, item 8): a round
in which only GPU 0's figures moved shows GPU 0's card, rows and suggestions anew where the
card prints sums of its rows, only the leaking row, its card and the suggestions that quote
them where it prints none, and leaves GPU 1's held figures (a sawtooth's allocated bytes) and
their cells on the terminal alone."""

from __future__ import annotations

import asyncio

import pytest
from ui_frozen import MY_UID, NOW, SECONDS, TRAINERS, frozen_store, nvml_at, poll_at
from ui_helpers import play_into_terminal

from memtop.figures.units import format_bytes
from memtop.ui.app import MemtopApp
from memtop.ui.renewal import RenewalClock
from memtop.ui.widgets.process_table import ProcessTable

LATER = SECONDS + 10  # (the leak reserves 16 MiB a second: 0.16 GiB by then)
WIDGETS = tuple(
    f"memtop.ui.widgets.{name}" for name in ("gpu_panel", "process_table", "suggestions")
)


@pytest.fixture
def one_slow_period(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every round of the test falls in one slow period: only news renews a held figure."""
    import sys

    for name in ("memtop.ui.render", "memtop.ui.renewal", "memtop.ui.app", *WIDGETS):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "slow_tick"):
            monkeypatch.setattr(module, "slow_tick", lambda period=0: 7)


def _round(store, t: int) -> None:  # type: ignore[no-untyped-def]
    reading = nvml_at(t)
    store.update_driver(reading, NOW - SECONDS + t)
    polls = [poll_at(tr, t, (reading.devices[tr.gpu].free_bytes or 0)) for tr in TRAINERS]
    store.update_agents(polls, NOW - SECONDS + t + 0.01)


def test_a_round_that_moves_only_gpu_0_leaves_gpu_1s_held_figures_and_cells(one_slow_period):
    # Ten seconds on, the leaking trainer on GPU 0 reserves more (news: GPU 0's figures renew,
    # the healthy trainer beside it shows its new allocated bytes, 12.0G → 14.0G), while on
    # GPU 1 only the fragmenting trainer's sawtooth moved (allocated 2.0G → 2.3G: a slow
    # figure, held until its period ends or GPU 1 has news of its own).
    store = frozen_store()
    clock = [NOW + 0.5]
    app = MemtopApp(store, None, clock=lambda: clock[0], host="gpu-box", my_uid=MY_UID)
    healthy, leak, fragment = TRAINERS
    assert fragment.at(SECONDS)[1] == fragment.at(LATER)[1]  # its reserved: no news
    assert format_bytes(leak.at(SECONDS)[1]) != format_bytes(leak.at(LATER)[1])  # GPU 0's news

    async def run() -> tuple[dict[int, int | None], dict[int, int | None], str]:
        terminal = play_into_terminal(app)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            table = app.query_one(ProcessTable)
            before = {row.pid: row.allocated for row in table.rows}
            _round(store, LATER)
            clock[0] += LATER - SECONDS
            app.refresh_view()
            await pilot.pause()
            after = {row.pid: row.allocated for row in table.rows}
            # CellDiff.cells builds its dict anew at each read: once here, not once a cell
            # (36 x 120 copies of the screen were 10 of this module's 11 CPU-s).
            cells = terminal.cells
            rows = {row for (row, _) in cells}
            screen = [
                "".join(cells.get((row, col), (" ", ""))[0] for col in range(1, 121))
                for row in sorted(rows)
            ]
            return before, after, next(line for line in screen if f" {fragment.pid} " in line)

    before, after, line = asyncio.run(run())
    assert before[healthy.pid] == healthy.at(SECONDS)[0]
    assert after[healthy.pid] == healthy.at(LATER)[0]  # renewed with its GPU's news
    assert before[fragment.pid] == fragment.at(SECONDS)[0]
    assert after[fragment.pid] == fragment.at(SECONDS)[0], "GPU 1's held figure was renewed"
    # On the terminal: its ALLOC still reads 2.0G (the step beside it moved: a fast figure).
    assert " 2.0G " in line and "2.3G" not in line, line


def test_a_figure_that_moved_below_what_is_printed_is_no_news(one_slow_period, monkeypatch):
    # GPU 1's trainer reserves 1 MiB more at second 301: "5.0 GiB" still, on its row, its card
    # and in any suggestion's words.  Nothing on screen reads differently, so GPU 1's held
    # figures (its sawtooth's allocated bytes, 2.0G) stay held: renewing them for a change
    # nobody can see rewrote a row a second in the `mixed` demo, where a leak's reserved bytes
    # move every round and its printed figure every second or two.
    store = frozen_store()
    clock = [NOW + 0.5]
    app = MemtopApp(store, None, clock=lambda: clock[0], host="gpu-box", my_uid=MY_UID)
    fragment = TRAINERS[2]
    at = fragment.at

    def one_mib_more(t: int) -> tuple[int, int, int, int]:
        allocated, reserved, peak, split = at(t)
        return allocated, reserved + (1 << 20) * (t > SECONDS), peak, split

    async def run() -> tuple[int | None, int | None]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            table = app.query_one(ProcessTable)
            before = {row.pid: row for row in table.rows}[fragment.pid]
            monkeypatch.setattr(fragment, "at", one_mib_more)
            _round(store, SECONDS + 1)
            clock[0] += 1
            app.refresh_view()
            await pilot.pause()
            after = {row.pid: row for row in table.rows}[fragment.pid]
            return before.allocated, after.allocated

    before, after = asyncio.run(run())
    assert before == fragment.at(SECONDS)[0]
    assert after == before, "a change below the printed figure renewed GPU 1's held figures"


def test_where_cards_print_no_sums_a_leak_renews_its_own_row_not_its_neighbours(one_slow_period):
    # The `mixed` demo's screen: eight GPUs, each card one line (a bar, no "alloc 22.7G").
    # The leak on GPU 0 moves its own figures and GPU 0's card every second or two; the
    # healthy trainer beside it has no news of its own, and no suggestion naming it words
    # anything anew, so its sawtooth's allocated bytes stay held (renewing every row of a GPU
    # with news rewrote a rank's ALLOC and its job's "alloc spread" every second: a fifth of
    # the bytes the dashboard sent).  With two-line cards the card prints the sum of its rows'
    # allocated bytes: there the card and all its rows still renew together.
    store = frozen_store()
    clock = [NOW + 0.5]
    app = MemtopApp(store, None, clock=lambda: clock[0], host="gpu-box", my_uid=MY_UID)
    healthy, leak, fragment = TRAINERS

    async def run():  # type: ignore[no-untyped-def]
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            before = app.dashboard
            _round(store, LATER)
            clock[0] += LATER - SECONDS
            app.refresh_view()
            await pilot.pause()
            return before, app.dashboard

    before, after = asyncio.run(run())
    assert before is not None and after is not None and before is not after
    rows = {row.pid: row for row in after.processes}
    card = {row.index: row for row in after.gpus}
    for sums in (False, True):
        clock_ = RenewalClock()
        assert clock_.due(before, False, sums=sums).everything  # the first round: all of it
        renew = clock_.due(after, False, sums=sums)
        assert not renew.everything
        assert renew.process(rows[leak.pid]) and renew.gpu(card[0])  # its own news
        assert not renew.process(rows[fragment.pid]) and not renew.gpu(card[1])  # GPU 1: none
        leak_words = next(s for s in after.suggestions if s.pid == leak.pid and s.device == 0)
        assert renew.suggestion(leak_words)
        # The healthy trainer: held where nothing sums it, renewed with its card's sum.
        assert renew.process(rows[healthy.pid]) == sums, sums
