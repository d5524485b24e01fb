"""The dashboard on frozen data: SVG snapshots at 80×24 and 120×36, the state screens, and the
keys whose effect needs no live trainer (help, copy fix, refusals)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import textual
from ui_frozen import MY_UID, NOW, frozen_store
from ui_helpers import notifications, screen_text, wait_for

from memtop.engine.store import Store
from memtop.model import DriverReading
from memtop.ui.app import MemtopApp
from memtop.ui.screens.detail import DetailScreen
from memtop.ui.screens.help import HelpScreen
from memtop.ui.widgets.process_table import ProcessTable
from memtop.ui.widgets.suggestions import SuggestionsPane

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("MEMTOP_UPDATE_SNAPSHOTS") == "1"


def frozen_app(store: Store | None = None) -> MemtopApp:
    return MemtopApp(
        store if store is not None else frozen_store(),
        None,
        clock=lambda: NOW,
        host="gpu-box",
        my_uid=MY_UID,
    )


def shoot(app: MemtopApp, size: tuple[int, int], keys: tuple[str, ...] = ()) -> str:
    async def run() -> str:
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            # The footer fills in its keys a moment after the first frame; on a loaded machine
            # 0.2 s is not always enough.
            await wait_for(pilot, lambda: len(app.query("FooterKey")) > 0)
            await pilot.pause(0.1)
            for key in keys:
                await pilot.press(key)
                await pilot.pause(0.2)
            return app.export_screenshot(title="memtop")

    return asyncio.run(run())


def check_snapshot(svg: str, name: str) -> None:
    """The SVG must match the stored one exactly under the Textual version that wrote it; under
    another version (whose SVG markup may differ) the screen's text must still match."""
    svg_path = SNAPSHOTS / f"{name}.svg"
    text_path = SNAPSHOTS / f"{name}.txt"
    version_path = SNAPSHOTS / "TEXTUAL_VERSION"
    text = screen_text(svg)
    if UPDATE or not svg_path.exists():
        SNAPSHOTS.mkdir(exist_ok=True)
        svg_path.write_text(svg)
        text_path.write_text(text + "\n")
        version_path.write_text(textual.__version__ + "\n")
        if not UPDATE:
            pytest.fail(f"snapshot {name} was missing and has been written; run again")
        return
    assert text == text_path.read_text().rstrip("\n"), f"screen text of {name} changed"
    if version_path.read_text().strip() == textual.__version__:
        assert svg == svg_path.read_text(), f"SVG of {name} changed (text is the same)"


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_dashboard_snapshot(size: tuple[int, int]) -> None:
    svg = shoot(frozen_app(), size)
    check_snapshot(svg, f"dashboard-{size[0]}x{size[1]}")
    text = screen_text(svg)
    # Every panel is there, with the numbers of the frozen data.
    assert "GPU" in text and "Processes" in text and "Suggestions" in text
    assert "+8.0M/step" in text  # the leaking trainer's trend in the table
    assert "4102" in text
    if size[0] >= 100:
        assert "grace" in text  # the USER column is in the wide layout only


@pytest.mark.slow
@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_detail_snapshot(size: tuple[int, int]) -> None:
    # Row 2 of the table is the leaking trainer (rows sort by GPU, then pid).
    svg = shoot(frozen_app(), size, keys=("down", "enter"))
    check_snapshot(svg, f"detail-{size[0]}x{size[1]}")
    text = screen_text(svg)
    assert "pid 4102" in text
    assert "optimizer" in text
    assert "trend +8.0 MiB/step · full in 49 min" in text  # the figures, not a cut sentence


@pytest.mark.slow
def test_help_screen_lists_every_key() -> None:
    app = frozen_app()

    async def run() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            svg = app.export_screenshot()
            for key in ("enter", "cleanup", "reset the peak", "snapshot", "terminate", "pause"):
                assert key in screen_text(svg)
            await pilot.press("c")  # the dashboard's keys sleep behind the help screen
            assert not any("Cleaning" in n for n in notifications(app))
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)

    asyncio.run(run())


def test_empty_state_suggests_run_and_demo() -> None:
    store = Store()
    store.update_driver(DriverReading(available=False, error="NVML Shared Library Not Found"))
    store.update_agents([])
    svg = shoot(frozen_app(store), (80, 24))
    text = screen_text(svg)
    assert "No GPUs and no PyTorch processes found" in text
    assert "NVML Shared Library Not Found" in text
    assert "memtop run train.py" in text
    assert "memtop demo" in text
    check_snapshot(svg, "empty-80x24")


def test_exited_agent_is_marked_and_actions_say_why() -> None:
    app = frozen_app(frozen_store(exited=4102))

    async def run() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.1)
            table = app.query_one(ProcessTable)
            row = table.rows_by_key["4102:GPU-0a1b2c3d"]
            assert row.state == "exited"
            text = screen_text(app.export_screenshot())
            assert "exited" in text.split("4102", 1)[1].splitlines()[0]
            table.move_cursor(row=table.get_row_index("4102:GPU-0a1b2c3d"))
            for key in ("c", "k"):
                await pilot.press(key)
            said = " ".join(notifications(app))
            assert "pid 4102 has exited" in said
            assert "already exited" in said

    asyncio.run(run())


def test_gpu_error_is_shown_on_its_card() -> None:
    text = screen_text(shoot(frozen_app(frozen_store(gpu_error="GPU is lost")), (120, 36)))
    gpu1 = next(line for line in text.splitlines() if "GPU 1" in line)
    assert "GPU is lost" in gpu1
    assert "GPU 0" in text and "38.7 GiB" in text  # the other GPU is unaffected


def test_permission_problem_in_status_line() -> None:
    problem = "/tmp/memtop-0 is owned by uid 0, not you: agents there are not read"
    text = screen_text(shoot(frozen_app(frozen_store(problem=problem)), (120, 36)))
    status = text.splitlines()[-2]  # above the footer
    assert problem in status


@pytest.mark.slow
def test_refusals_for_processes_without_agent_or_of_another_user() -> None:
    app = frozen_app()

    async def run() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.1)
            table = app.query_one(ProcessTable)
            table.move_cursor(row=table.get_row_index("7001:GPU-0a1b2c3d"))
            await pilot.press("k")
            assert "belongs to grace" in " ".join(notifications(app))
            await pilot.press("c")
            assert "pid 7001 has no memtop agent" in " ".join(notifications(app))
            # A live sampler is needed to act; the frozen view says so rather than failing.
            table.move_cursor(row=table.get_row_index("4101:GPU-0a1b2c3d"))
            await pilot.press("s")
            assert "not live" in " ".join(notifications(app))

    asyncio.run(run())


@pytest.mark.slow
def test_copy_fix_and_tab_focus() -> None:
    app = frozen_app()

    async def run() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.1)
            assert isinstance(app.focused, ProcessTable)
            await pilot.press("tab")
            pane = app.query_one(SuggestionsPane)
            assert app.focused is pane
            assert pane.highlighted == 0  # tab lands on the first: the leak, no one-line fix
            await pilot.press("y")
            assert "has no one-line fix" in " ".join(notifications(app))
            await pilot.press("down")  # the fragmentation warning, which has a fix
            await pilot.press("y")
            assert app.clipboard == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            assert "Copied" in " ".join(notifications(app))
            await pilot.press("enter")  # opens the suggestion's process
            await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
            assert app.screen.row.pid == 4201
            assert app.screen.row.gpu == 1
            await pilot.press("escape")
            assert not isinstance(app.screen, DetailScreen)
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(run())


@pytest.mark.slow
def test_refresh_tick_after_the_app_closed_is_harmless() -> None:
    # CI once failed here: the refresh timer fired after the last screen had left the stack, and
    # reading app.screen raised ScreenStackError out of the timer into the test.
    store = frozen_store()
    app = frozen_app(store)

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.1)

    asyncio.run(run())
    assert not app.screen_stack
    store.generation += 1  # new data arrived: refresh_view would render it
    app.refresh_view()
    assert app._detail_screen() is None


def test_settle_gc_freezes_start_up_and_widens_gen0() -> None:
    import gc

    from memtop.ui import app as app_module

    before = gc.get_threshold()
    try:
        app_module._settle_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (app_module.GC_GEN0_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
