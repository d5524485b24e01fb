"""The dashboard against real simulated trainers: every key pressed, its effect checked in the
trainer (through the agent) or on the screen."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_helpers import live_app, notifications, screen_text, wait_for

from memtop.figures.units import format_bytes
from memtop.sim.demo import Demo
from memtop.ui.app import MemtopApp
from memtop.ui.screens.confirm import ConfirmScreen
from memtop.ui.screens.detail import DetailScreen
from memtop.ui.view import ProcessRow
from memtop.ui.widgets.process_table import ProcessTable

pytestmark = pytest.mark.slow

INTERVAL = 0.25


@pytest.fixture(scope="module")
def module_socket_dir() -> Iterator[Path]:
    # Short (AF_UNIX paths are limited to 108 bytes) and unique to this run.
    directory = Path(tempfile.mkdtemp(prefix="mtui-", dir="/tmp"))
    directory.chmod(0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def mixed_demo(module_socket_dir: Path) -> Iterator[Demo]:
    # 0.1 s a step (the demo's own pace): the tests ask what the trainers hold and what the keys
    # do to them, and the leak's trend needs steps, not a rate; four trainers stepping at 0.05 s
    # were most of this module's CPU (~23 of ~31 CPU-s).
    demo = Demo(gpus=2, scenario="mixed", step_time=0.1, socket_dir=module_socket_dir)
    demo.start()
    try:
        assert demo.wait_ready(), f"trainers failed: {demo.failed()}"
        yield demo
    finally:
        demo.stop()


def agent_rows(app: MemtopApp) -> list[ProcessRow]:
    return [r for r in app.query_one(ProcessTable).rows_by_key.values() if r.state == "agent"]


async def select(app: MemtopApp, pid: int) -> None:
    table = app.query_one(ProcessTable)
    key = next(k for k, r in table.rows_by_key.items() if r.pid == pid)
    table.move_cursor(row=table.get_row_index(key))


def run(coro_factory, socket_dir: Path, snapshot_dir: Path | None = None) -> MemtopApp:  # type: ignore[no-untyped-def]
    app, sampler = live_app(socket_dir, snapshot_dir=snapshot_dir)

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: len(agent_rows(app)) >= 1)
            await coro_factory(app, pilot)

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    return app


# (Before the tests of the shared mixed demo: a module's fixture lives until the module ends,
# and its four trainers would step through this test's own demo.)
def test_terminate_asks_then_signals_and_marks_exited(socket_dir: Path, tmp_path: Path) -> None:
    # It is asked for nothing but to be there and to be signalled: a step every 0.5 s.
    demo = Demo(gpus=1, scenario="healthy", step_time=0.5, socket_dir=socket_dir)
    demo.start()
    try:
        assert demo.wait_ready()
        victim = demo.processes[0]

        async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
            await select(app, victim.pid)
            await pilot.press("k")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("q")  # q cancels the dialog (it does not quit, nor do nothing)
            await pilot.pause(0.3)
            assert not isinstance(app.screen, ConfirmScreen)
            assert victim.poll() is None and app.is_running
            await pilot.press("k")
            await pilot.press("n")  # so does n
            await pilot.pause(0.3)
            assert victim.poll() is None
            await pilot.press("k")
            await pilot.press("9")  # the dialog offers TERM (t), INT (i) and KILL (9)
            await wait_for(pilot, lambda: any("SIGKILL" in n for n in notifications(app)))
            await wait_for(pilot, lambda: victim.poll() is not None)
            table = app.query_one(ProcessTable)
            await wait_for(
                pilot,
                lambda: any(
                    r.pid == victim.pid and r.state == "exited" for r in table.rows_by_key.values()
                ),
            )
            await pilot.press("c")
            assert f"pid {victim.pid} has exited" in " ".join(notifications(app))

        run(body, socket_dir, tmp_path)
    finally:
        demo.stop()


def test_cleanup_releases_cache_and_says_how_much(
    mixed_demo: Demo, module_socket_dir: Path
) -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await wait_for(pilot, lambda: len(agent_rows(app)) == 4)
        # The healthy trainer on GPU 0 keeps its activations' blocks cached between steps.
        healthy = mixed_demo.processes[0].pid
        await select(app, healthy)
        await wait_for(pilot, lambda: app.store.agent(healthy).devices[0].cached > 0)
        # Cleanup runs at a step boundary: the agent refuses it before its first step is seen
        # (the first of the demo's users: its trainers may not have stepped yet).
        await wait_for(pilot, lambda: app.store.agent(healthy).step)
        await pilot.press("c")
        await wait_for(pilot, lambda: any("Cleanup in pid" in n for n in notifications(app)))
        said = next(n for n in notifications(app) if "Cleanup in pid" in n)
        assert f"Cleanup in pid {healthy}" in said and "GPU 0: released" in said
        released = said.split("released ", 1)[1].split(" (", 1)[0]
        before, after = said.split("(reserved ", 1)[1].split(")", 1)[0].split(" → ")
        assert released != "0 B"
        # What the notification says is what the trainer's allocator reports afterwards.
        await wait_for(
            pilot,
            lambda: format_bytes(app.store.agent(healthy).devices[0].reserved) != before,
        )
        assert after != before

    run(body, module_socket_dir)


def test_reset_peak_and_snapshot(mixed_demo: Demo, module_socket_dir: Path, tmp_path: Path) -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        leak = mixed_demo.processes[2].pid  # sharing GPU 0
        await wait_for(pilot, lambda: any(r.pid == leak for r in agent_rows(app)))
        await select(app, leak)
        await pilot.press("r")
        await wait_for(pilot, lambda: any("Peak reset in pid" in n for n in notifications(app)))
        assert f"Peak reset in pid {leak} (GPU 0)" in " ".join(notifications(app))
        await pilot.press("s")
        await wait_for(pilot, lambda: any("written" in n for n in notifications(app)))
        said = next(n for n in notifications(app) if "written" in n)
        path = Path(said.split(": ", 1)[1].splitlines()[0])
        assert path.parent == tmp_path.resolve() and path.name.startswith(f"memtop-snapshot-{leak}")
        assert "memory_viz" in said
        with path.open("rb") as fh:
            snapshot = pickle.load(fh)
        assert snapshot["segments"], "the snapshot has the allocator's segments"

    run(body, module_socket_dir, tmp_path)


def test_pause_detail_help_and_quit(mixed_demo: Demo, module_socket_dir: Path) -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        sampler = app.sampler
        assert sampler is not None
        await pilot.press("p")
        assert sampler.paused
        rounds = sampler.rounds
        await pilot.pause(3 * INTERVAL)
        assert sampler.rounds <= rounds + 1  # at most the round in flight
        assert "PAUSED" in screen_text(app.export_screenshot()).splitlines()[0]
        await pilot.press("p")
        assert not sampler.paused
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
        await wait_for(pilot, lambda: app.screen.detail is not None and app.screen.detail.series)
        await pilot.press("escape")
        await pilot.press("question_mark")
        assert "Keys" in screen_text(app.export_screenshot())
        await pilot.press("escape")
        await pilot.press("q")

    app = run(body, module_socket_dir)
    assert app.return_code == 0


def test_each_round_is_drawn_when_it_lands(mixed_demo: Demo, module_socket_dir: Path) -> None:
    """The sampler tells the dashboard when a round is in; the dashboard's own timer (a minute
    here) is not what draws it."""
    app, sampler = live_app(module_socket_dir, app_interval=60.0)

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: len(agent_rows(app)) == 4)
            drawn, rounds = app.refreshes, sampler.rounds
            await pilot.pause(8 * INTERVAL)
            assert sampler.rounds - rounds >= 4
            # One frame per round (two rounds may land between two looks of the app).
            assert app.refreshes - drawn >= (sampler.rounds - rounds) // 2

    try:
        asyncio.run(main())
    finally:
        sampler.stop()


# The last of the shared demo's users: an app judges a leak when it starts and then every
# LEAK_REFRESH_S (10 s), so one started on trainers a few seconds old (fewer than MIN_MARKS
# marks) waited out those 10 s, the four trainers stepping on (~3 CPU-s).  After the others,
# its first judgement has the leak's marks (its agent's backlog in the first round).
def test_every_panel_shows_live_numbers(mixed_demo: Demo, module_socket_dir: Path) -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await wait_for(pilot, lambda: len(agent_rows(app)) == 4)
        await wait_for(pilot, lambda: any(g.trend.leak for g in app.dashboard.gpus), 30)

        # Where the trend was there at once (its trainer's backlog in the first round), the
        # frames of the app's first second may not have drawn it: a frame ~0.3 s in, under load,
        # had the suggestions but no GPU card and no table row yet.  The screen is read once it
        # shows the cards' trend and every trainer (15 s at most), and then checked.
        def cards_and_rows_drawn() -> bool:
            text = screen_text(app.export_screenshot())
            return bool(re.search(r"/step (· full in )?\d+ (s|min|h)", text)) and all(
                str(p.pid) in text for p in mixed_demo.processes
            )

        with contextlib.suppress(AssertionError):  # the checks below say what is missing
            await wait_for(pilot, cards_and_rows_drawn)
        text = screen_text(app.export_screenshot())
        assert "simulated GPUs" in text and "4 agents" in text
        assert "GPU 0" in text and "GPU 1" in text
        # The leak trend with its ETA ("· full in 9 min", or "9 min" where room is short: the
        # card's second line also carries utilisation, temperature and power).
        assert re.search(r"/step (· full in )?\d+ (s|min|h)", text), text
        assert "Leak:" in text  # the suggestion
        for pid in mixed_demo.processes:
            assert str(pid.pid) in text

    run(body, module_socket_dir)
