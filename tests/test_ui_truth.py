"""Issue 21: what the dashboard says is true at every moment (frozen data, the real app under
Textual's pilot): sort arrows, the suggestions' focus, read-only mode, filters, wording."""

from __future__ import annotations

from dataclasses import replace

from test_ui_frozen import frozen_app
from test_ui_nvitop import drive, pids
from ui_frozen import MY_UID, NOW, T0, TOTAL, TRAINERS, frozen_store, nvml_at, poll_at
from ui_helpers import screen_text, wait_for

from memtop.model import AgentHello, AgentSample, NvmlReading
from memtop.observation import Observer
from memtop.sources.agents import CONNECTED, AgentPoll
from memtop.sources.processes import ProcessInfo
from memtop.store import Store
from memtop.ui import view
from memtop.ui.app import MemtopApp
from memtop.ui.widgets.process_table import ProcessTable
from memtop.ui.widgets.suggestions import SuggestionsPane


def test_sort_arrow_says_the_order_not_the_inversion() -> None:
    # PID sorts ascending by nature: it showed "PID▼" beside "USED▼" meaning descending.
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        table = app.query_one(ProcessTable)
        await pilot.press("greater_than_sign")
        assert table.sort_key == "pid" and pids(app) == sorted(pids(app))
        await pilot.pause()
        screen = screen_text(app.export_screenshot())
        assert "PID▲" in screen and "sort pid ▲" in screen
        await pilot.press("I")
        await pilot.pause()
        screen = screen_text(app.export_screenshot())
        assert pids(app) == sorted(pids(app), reverse=True)
        assert "PID▼" in screen and "sort pid ▼" in screen

    drive(frozen_app(), body)


def test_tab_to_suggestions_highlights_the_first_and_enter_opens_it() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        pane = app.query_one(SuggestionsPane)
        await pilot.press("tab")
        assert app.focused is pane
        assert pane.highlighted == 0 and pane.selected() is pane.items[0]
        first = pane.items[0]
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert getattr(app.screen, "shows_process", False)
        assert app.screen.row.pid == first.pid  # type: ignore[attr-defined]

    drive(frozen_app(), body)


NO_DRIVER = "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)"


def cpu_only_store(steps: int = 689) -> Store:
    """A machine without an NVIDIA driver and one CPU-only trainer under `memtop run`."""
    store = Store()
    hello = AgentHello(1, 5150, ("train_cpu.py",), "3.12.3", "2.13.0", "", ())
    for t in range(5):
        store.update_nvml(NvmlReading(available=False, error=NO_DRIVER), T0 + t)
        sample = AgentSample(time=T0 + t, step=steps - 4 + t, devices=())
        store.update_agents([AgentPoll(5150, CONNECTED, hello, sample)], T0 + t + 0.01)
    store.update_processes(
        {5150: ProcessInfo(5150, MY_UID, "ada", ("python", "train_cpu.py"), "python")}
    )
    return store


def test_gpu_pane_says_once_why_there_is_no_gpu() -> None:
    # Without NVML the GPU pane said "Reading devices and agents…" forever, and the status line
    # "NVML: NVML not available…".
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        screen = screen_text(app.export_screenshot())
        assert "Reading devices" not in screen
        assert "No GPU visible. NVML not available" in screen
        assert screen.count("NVML not available") == 1 and "NVML: NVML" not in screen
        assert "5150" in screen  # the agent still shows

    drive(frozen_app(cpu_only_store()), body)


def test_cpu_only_trainer_is_not_called_healthy() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        screen = screen_text(app.export_screenshot())
        assert "looks healthy" not in screen and "use no GPU (CPU only)" in screen

    drive(frozen_app(cpu_only_store()), body)


def test_detail_of_a_cpu_only_trainer_says_its_agent_is_there() -> None:
    # The breakdown box said "No agent in this process" under a title "agent · step 689".
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("enter")
        await wait_for(pilot, lambda: getattr(app.screen, "shows_process", False))
        await pilot.pause(0.2)
        screen = screen_text(app.export_screenshot())
        assert "agent · step 689" in screen
        assert "No agent" not in screen and "No memtop agent" not in screen
        assert "The agent is running" in screen and "CPU only" in screen

    drive(frozen_app(cpu_only_store()), body)


def test_detail_says_whether_the_breakdown_was_measured() -> None:
    from memtop.ui.screens.detail import _breakdown

    obs = Observer(frozen_store(), clock=lambda: NOW, uid=MY_UID).latest()
    dash = view.build(obs)
    row = next(r for r in dash.processes if r.pid == TRAINERS[0].pid)
    detail = view.build_detail(obs, row, None)
    assert detail.device is not None and "parameters" in _breakdown(detail).plain
    unmeasured = replace(
        detail, device=replace(detail.device, breakdown=None, breakdown_measured=False)
    )
    assert _breakdown(unmeasured).plain.startswith("Not measured yet")
    no_optimizer = replace(unmeasured, device=replace(unmeasured.device, breakdown_measured=True))
    assert _breakdown(no_optimizer).plain.startswith("No optimizer seen yet")


def test_suggestions_say_collecting_until_there_is_evidence() -> None:
    # The demo's first seconds said "memory looks healthy" before anything was judged.
    store = Store()
    trainer = TRAINERS[0]
    for t in range(3):
        store.update_nvml(nvml_at(t), T0 + t)
        store.update_agents([poll_at(trainer, t, TOTAL // 2)], T0 + t + 0.01)
    dash = view.build(Observer(store, clock=lambda: T0 + 3, uid=MY_UID).latest())
    assert not dash.suggestions or all(s.pid != trainer.pid for s in dash.suggestions)
    assert dash.quiet.startswith("Collecting")
    healthy = view.build(Observer(frozen_store(), clock=lambda: NOW, uid=MY_UID).latest())
    assert healthy.quiet == "Nothing to suggest: memory looks healthy."
