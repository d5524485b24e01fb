"""A GPU's own detail (issue 31, item 5): tab to a GPU's card, enter, and its used bytes are
shown by who holds them, each part with its pids and what memtop can say of each process."""

from __future__ import annotations

import asyncio

from ui_helpers import screen_text, wait_for

from memtop.engine.store import Store
from memtop.model import DeviceReading, DriverReading, GpuProcess
from memtop.sources.owners import GONE, HERE, OTHER_NAMESPACE, Holder, PidFacts
from memtop.sources.processes import ProcessInfo
from memtop.ui.app import MemtopApp
from memtop.ui.widgets.gpu_panel import GpuCard

GiB = 1 << 30
NOW = 1_790_000_000.0


def _store() -> Store:
    store = Store()
    processes = (GpuProcess(4101, 3 * GiB), GpuProcess(4102, 6 * GiB), GpuProcess(4103, 2 * GiB))
    reading = DeviceReading(
        0, "GPU-0a1b", "NVIDIA H100 80GB HBM3", 80 * GiB, 12 * GiB, processes=processes
    )
    store.update_driver(DriverReading(True, (reading,), driver_version="580"), NOW)
    store.update_processes({4101: ProcessInfo(4101, 0, "root", ("python", "serve.py"), "python")})
    store.update_owners(
        {
            4101: PidFacts(4101, HERE, attachable=True, why="memtop attach 4101"),
            4102: PidFacts(
                4102,
                GONE,
                why="exited; its memory is held by 5150 (its process group), which still holds "
                "the GPU device files: stop it to free the memory",
                holders=(Holder(5150, "python train.py [/bold]", ("/dev/nvidia0",), True),),
            ),
            4103: PidFacts(
                4103,
                OTHER_NAMESPACE,
                container="container 3f2a9c1b7d4e",
                why="another pid namespace (container 3f2a9c1b7d4e, pid 7 there)",
            ),
        }
    )
    return store


def test_enter_on_a_gpu_card_shows_who_holds_its_memory() -> None:
    from memtop.ui.screens.gpu import GpuScreen

    app = MemtopApp(_store(), None, clock=lambda: NOW + 1, host="box", my_uid=0)

    async def run() -> str:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: len(app.query(GpuCard)) == 1)
            await pilot.pause(0.1)
            for _ in range(4):  # tab round the panels to the GPU's card
                if isinstance(app.focused, GpuCard):
                    break
                await pilot.press("tab")
            assert isinstance(app.focused, GpuCard)
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, GpuScreen))
            await wait_for(pilot, lambda: app.screen.detail is not None)  # type: ignore[attr-defined]
            await pilot.pause(0.1)
            return screen_text(app.export_screenshot())

    text = asyncio.run(run())
    assert "GPU 0  NVIDIA H100 80GB HBM3" in text
    assert "used 12.0 GiB of 80.0 GiB" in text
    assert "3.0 GiB  processes without an agent  pid 4101" in text
    assert "memtop attach 4101" in text
    assert "6.0 GiB  exited pids still charged  pid 4102" in text
    assert "holder 5150 (its process group): python train.py [/bold]" in text  # no markup
    assert "2.0 GiB  processes in other pid namespaces  pid 4103" in text
    assert "container 3f2a9c1b7d4e" in text
    assert "1.0 GiB  charged to no listed process" in text


def test_a_gpus_screen_stacks_its_processes_reserved_under_its_used_memory() -> None:
    """Issue 33 item 2: the GPU's own screen stacks each agent's reserved on it (in the order
    they arrived) under its used bytes over the window held, with a legend in their colours;
    the frozen GPU 0's used bytes are more than its two trainers reserve (their CUDA context,
    a process without an agent): the rest of used shows above the stack."""
    from helpers.observations import frozen_observation

    from memtop.ui import view
    from memtop.ui.widgets.gpu_chart import REST_COLOUR, gpu_chart, legend

    observation = frozen_observation()
    gpu = observation.gpus[0]
    detail = view.build_gpu_detail(observation, gpu.uuid)
    assert detail is not None and detail.newest is not None and detail.used_timeline
    assert [b.name for b in detail.bands] == sorted(f"pid {d.pid}" for d in gpu.agents)
    assert len(detail.used_timeline.times) > 100  # the window held, not the newest reading
    drawn = gpu_chart(detail, 100, 10)
    assert drawn.stack is not None and len(drawn.lines) == 10
    newest = len(drawn.stack.grid) - 1
    reserved = sum(d.reserved_bytes or 0 for d in gpu.agents)
    assert drawn.stack.top(newest) == reserved < (drawn.stack.used[newest] or 0)
    plot = "".join(str(span.style) for line in drawn.lines for span in line.spans)
    assert all(b.colour in plot for b in detail.bands) and REST_COLOUR in plot
    title = legend(detail)
    assert title.plain == "Memory  ■ pid 4101  ■ pid 4102  ■ rest of used"
    colours = {b.colour for b in detail.bands}
    assert len(colours) == len(detail.bands)
