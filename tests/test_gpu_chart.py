"""A GPU's own chart (issue 33 item 2): its processes' reserved stacked under its used bytes on
the chart's own column grid (each process resampled there, absent where it was absent), the
rest of used above them, and its events (OOMs, memtop's actions, agents arriving and leaving)
marked each in the column whose time span holds it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
from rich.style import Style
from rich.text import Text
from ui_helpers import screen_text, wait_for

from memtop.engine.observation import Observer
from memtop.engine.store import Store
from memtop.model import (
    ActionRecord,
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentSample,
    DeviceReading,
    DriverReading,
    GpuProcess,
    ProcessInfo,
)
from memtop.sources.agents import CONNECTED, EXITED, AgentView
from memtop.ui import view
from memtop.ui.stacked import Band, ChartEvent, Timeline, grid
from memtop.ui.widgets.gpu_chart import REST_COLOUR, Y_LABEL_W, event_legend, gpu_chart, legend

GiB = 1 << 30
T0 = 1_790_000_000.0
UUID = "GPU-5c6d7e8f"


def _detail(used: Timeline, bands: tuple[Band, ...], events: tuple[ChartEvent, ...] = ()):  # type: ignore[no-untyped-def]
    return view.GpuDetail(
        "GPU 0  test", None, 80 * GiB, (), "", used, bands, events, used.times[0], used.times[-1]
    )


def _in_force(times: list[float], values: list[float], at: float, hold: float, end: float) -> float:
    """What the test expects of one process at one column's time, worked out on its own."""
    before = [i for i, t in enumerate(times) if t <= at]
    if not before or at - times[before[-1]] > hold or at > end:
        return 0.0
    return values[before[-1]]


def _colours_by_column(lines: list[Text], rows: int) -> list[set[str]]:
    """The colours (foreground and background) painted in each plot column."""
    cols = len(lines[0].plain) - Y_LABEL_W
    seen: list[set[str]] = [set() for _ in range(cols)]
    for line in lines[:rows]:
        for span in line.spans:
            style = span.style if isinstance(span.style, Style) else Style.parse(span.style)
            painted = {c.name for c in (style.color, style.bgcolor) if c is not None}
            for at in range(max(span.start, Y_LABEL_W), span.end):
                seen[at - Y_LABEL_W] |= painted
    return seen


def test_the_processes_reserved_is_stacked_on_the_charts_own_columns() -> None:
    # The GPU's used bytes, read every second; three processes sampled at their own times:
    # one all along, one that arrived at 40 s and left at 70 s, one with no sample from 30 s
    # to 60 s (its agent hung); at 80-85 s the processes hold more than the driver counts.
    used_t = [T0 + s for s in range(101)]
    used_v = [(5.0 if 80 <= s <= 85 else 12.0) * GiB for s in range(101)]
    a_t = [T0 + s + 0.3 for s in range(100)]
    a_v = [(4 + (s % 7) / 7) * GiB for s in range(100)]
    b_t = [T0 + s + 0.6 for s in range(40, 70)]
    b_v = [3.0 * GiB] * len(b_t)
    c_t = [T0 + s + 0.1 for s in range(100) if not 30 <= s < 60]
    c_v = [2.0 * GiB] * len(c_t)
    used = Timeline("GPU used", used_t, used_v)
    bands = (
        Band("pid 1", "#e6be00", (Timeline("pid 1", a_t, a_v),)),
        Band("pid 2", "#5fa02a", (Timeline("pid 2", b_t, b_v, ended=True),)),
        Band("pid 3", "#50c8e6", (Timeline("pid 3", c_t, c_v),)),
    )
    drawn = gpu_chart(_detail(used, bands), 7 + 50, 12)
    stack = drawn.stack
    assert stack is not None
    columns = grid(used_t[0], used_t[-1], 50)
    assert stack.grid == columns
    inf = float("inf")  # (the live processes' newest samples are all within their hold)
    for c, at in enumerate(columns):
        want = [
            _in_force(a_t, a_v, at, 3.0, inf),
            _in_force(b_t, b_v, at, 3.0, b_t[-1]),  # left: nothing after its last sample
            _in_force(c_t, c_v, at, 3.0, inf),  # absent in its gap: nothing there
        ]
        room = stack.used[c]
        assert room == _in_force(used_t, used_v, at, 3.0, inf)
        got = [band[c] for band in stack.heights]
        if sum(want) <= room:
            assert got == pytest.approx(want), (c, at - T0)
        else:  # clipped at used, from the top of the stack down
            assert sum(got) == pytest.approx(room) and got[0] == pytest.approx(want[0])
        assert stack.top(c) <= room
    # The picture: each band's colour only in the columns where its process was there.
    painted = _colours_by_column(drawn.lines, drawn.plot_rows)
    for c, at in enumerate(columns):
        absent_b = not (b_t[0] <= at <= b_t[-1])
        absent_c = 29.1 + 3.0 < at - T0 < 60.1  # its last sample, held 3 s
        if absent_b:
            assert "#5fa02a" not in painted[c], c
        if absent_c:
            assert "#50c8e6" not in painted[c], c
        assert "#e6be00" in painted[c]  # always there, at the bottom
    lived = [c for c, at in enumerate(columns) if b_t[0] + 1 < at < b_t[-1] - 1]
    assert lived and all("#5fa02a" in painted[c] for c in lived)
    # The rest of used shows above the stack where the driver counts more than it.
    assert all(REST_COLOUR in painted[c] for c in range(0, 10))
    title = legend(_detail(used, bands)).plain
    assert title == "Memory  ■ pid 1  ■ pid 2  ■ pid 3  ■ rest of used"
    assert legend(_detail(used, ())).plain == "Memory  ■ used (no agent on it)"


def test_a_process_is_absent_in_a_gap_of_its_samples_and_after_it_left_not_after_a_late_round() -> (
    None
):
    times = [T0 + s for s in (0, 1, 2, 3, 20, 21, 22)]
    values = [float(s) for s in range(7)]
    at = [T0 + s for s in (0.5, 3.5, 5.9, 6.1, 19.9, 20.0, 22.0, 40.0)]
    live = Timeline("pid 1", times, values).resample(at)
    # Held 3 s (three of its 1 s intervals) in the gap, then absent until its next sample;
    # its newest value held to the end: a late round is not a process gone.
    assert live == [0.0, 3.0, 3.0, None, None, 4.0, 6.0, 6.0]
    gone = Timeline("pid 1", times, values, ended=True).resample(at)
    assert gone == [0.0, 3.0, 3.0, None, None, 4.0, 6.0, None]
    assert Timeline("pid 1", [], []).resample(at) == [None] * len(at)
    assert Timeline("pid 1", times, values).resample([T0 - 1]) == [None]  # before it arrived


def test_each_event_lands_in_the_column_whose_span_holds_it_and_labels_never_overlap() -> None:
    used = Timeline("GPU used", [T0 + s for s in range(101)], [10.0 * GiB] * 101)
    band = Band("pid 1", "#e6be00", (Timeline("pid 1", used.times, [4.0 * GiB] * 101),))
    # 50 columns of 2 s each: column c spans (T0 + 2c, T0 + 2c + 2].
    events = (
        ChartEvent(T0 + 10.0, "oom", 4242),  # the end of column 4's span
        ChartEvent(T0 + 10.1, "cleanup", 4242),  # column 5
        ChartEvent(T0 + 55.0, "arrived", 4243),  # column 27
        ChartEvent(T0 + 99.5, "left", 4243),  # column 49
        ChartEvent(T0 - 5.0, "oom", 4242),  # before the window: not marked
    )
    for width in (7 + 50, 7 + 110):
        cols = width - Y_LABEL_W
        drawn = gpu_chart(_detail(used, (band,), events), width, 8)
        step = 100 / cols
        expected = {e: int((e.time - T0 - 1e-9) // step) for e in events[:4]}
        assert drawn.landed == expected
        marks = drawn.lines[drawn.plot_rows].plain[Y_LABEL_W:]
        for event, column in expected.items():
            assert marks[column] == event.glyph[0], (width, event)
        labelled = _labels(marks, expected)
        # The action is labelled (the OOM beside it has no room); at 110 columns all but the
        # OOM are, the departure before the arrival.
        assert labelled[events[1]] in ("full", "short")
        if cols >= 100:
            assert labelled[events[3]] == "full" and labelled[events[2]] == "short"
            assert labelled[events[0]] == ""  # the action's glyph is beside it, no room left


def _labels(marks: str, landed: dict[ChartEvent, int]) -> dict[ChartEvent, str]:
    """Each event's label as found beside its glyph ("full", "short" or ""); and that nothing
    else is on the row: no label ran over another or over a glyph."""
    rest = list(marks)
    found: dict[ChartEvent, str] = {}
    for event, column in landed.items():
        rest[column] = " "
        found[event] = ""
        for kind, text in (("full", event.label()), ("short", event.label(short=True))):
            words = text[2:]
            right, left = column + 2, column - 1 - len(words)
            if marks[right : right + len(words)] == words:
                rest[right : right + len(words)] = " " * len(words)
            elif left >= 0 and marks[left:column] == words + " ":
                rest[left:column] = " " * len(words)
            else:
                continue
            found[event] = kind
            break
    assert "".join(rest).strip() == "", marks
    return found


def _hello(pid: int) -> AgentHello:
    devices = (AgentDevice(0, UUID, "NVIDIA H100 80GB HBM3", 80 * GiB),)
    return AgentHello(1, pid, ("train.py",), "3.12", "2.13.0", "", devices)


def _sample(t: float, reserved: int, ooms: int) -> AgentSample:
    stats = {
        "allocated_bytes.all.current": reserved // 2,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": reserved // 2,
        "num_ooms": ooms,
    }
    return AgentSample(t, 1, (AgentDeviceSample(0, stats, 40 * GiB, 80 * GiB),))


def test_a_gpus_events_are_read_from_its_agents_ooms_actions_arrivals_and_departures() -> None:
    """One trainer all along, whose OOM counter rises at 50 s (its report says 49.6 s) and in
    which memtop ran a cleanup at 60.2 s; a second that started at 39 s and exited at 90 s;
    a third that was running before the window (no arrival to mark)."""
    store = Store()
    store.update_processes(
        {
            4242: ProcessInfo(4242, 0, "root", ("train.py",), "python", create_time=T0 - 500),
            4243: ProcessInfo(4243, 0, "root", ("train.py",), "python", create_time=T0 + 39),
        }
    )
    for s in range(121):
        t = T0 + s
        processes = (GpuProcess(4242, 9 * GiB), GpuProcess(4243, 4 * GiB))
        reading = DeviceReading(
            0, UUID, "NVIDIA H100 80GB HBM3", 80 * GiB, 14 * GiB, processes=processes
        )
        store.update_driver(DriverReading(True, (reading,)), t)
        sample = _sample(t + 0.4, 8 * GiB, 1 if s >= 50 else 0)
        if s == 50:
            sample = AgentSample(
                sample.time, 1, sample.devices, oom={"last": {"time": T0 + 49.6, "device": 0}}
            )
        polls = [AgentView(4242, CONNECTED, _hello(4242), sample)]
        if 40 <= s < 90:
            polls.append(AgentView(4243, CONNECTED, _hello(4243), _sample(t + 0.7, 3 * GiB, 0)))
        elif s == 90:
            polls.append(AgentView(4243, EXITED, _hello(4243), error="socket gone"))
        store.update_agents(polls, t + 0.8)
        if s == 60:
            store.record_action(ActionRecord("cleanup", T0 + 60.2, 4242))
        if s == 61:  # refused (the agent's log keeps refusals): it changed nothing, no mark
            store.record_action(
                ActionRecord("cleanup", T0 + 61.0, 4242, result="refused", seq=2, source="agent")
            )
    obs = Observer(store, clock=lambda: T0 + 120.9).latest()
    detail = view.build_gpu_detail(obs, UUID)
    assert detail is not None
    assert [(e.kind, e.pid, round(e.time - T0, 1)) for e in detail.events] == [
        ("arrived", 4243, 40.7),
        ("oom", 4242, 49.6),
        ("cleanup", 4242, 60.2),
        ("left", 4243, 89.7),
    ]
    # Both processes have a band, the one that left too, in the order they arrived.
    assert [b.name for b in detail.bands] == ["pid 4242", "pid 4243"]
    drawn = gpu_chart(detail, 7 + 60, 10)
    assert drawn.stack is not None
    for c, at in enumerate(drawn.stack.grid):
        left_height = drawn.stack.heights[1][c]
        if at < T0 + 40.7 or at > T0 + 89.7:
            assert left_height == 0.0, c
        else:
            assert left_height == 3 * GiB, c
    marks = drawn.lines[drawn.plot_rows].plain
    assert "▼" in marks and "◆" in marks and "▲" in marks and "△" in marks
    said = event_legend(detail).plain
    assert said == " ▲ arrived  ▼ OOM  ◆ cleanup  △ left "
    storm = replace(detail, events=(*detail.events, ChartEvent(T0 + 70, "oom", 4242)))
    assert "▼ OOM ×2" in event_legend(storm).plain


@pytest.mark.slow
def test_the_gpu_screen_of_the_demo_shows_its_bands_and_an_action_memtop_took(
    socket_dir: Path,
) -> None:
    """The real app, the demo's trainers and sampler: a cleanup in one trainer, then enter on
    the GPU's card: the legend names each trainer's band and the rest of used, and the chart
    marks the cleanup with its time and pid."""
    from memtop.engine.sampler import Sampler
    from memtop.sim.demo import Demo
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource
    from memtop.ui.app import MemtopApp
    from memtop.ui.screens.gpu import GpuScreen
    from memtop.ui.widgets.gpu_panel import GpuCard

    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    app = MemtopApp(store, sampler, host="gpu-box")

    async def run() -> tuple[str, list[int]]:
        async with app.run_test(size=(120, 36)) as pilot:
            with Demo(1, "mixed", 0.1, socket_dir=socket_dir) as demo:
                assert demo.wait_ready(30)
                pids = sorted(p.pid for p in demo.processes)
                await wait_for(pilot, lambda: len(app.query(GpuCard)) == 1, timeout=30)
                # A cleanup runs between two steps: once the trainer has stepped.
                await wait_for(
                    pilot,
                    lambda: any(a.pid == pids[0] and a.step for a in store.view().agents),
                    timeout=30,
                )
                await pilot.pause(2)
                reply = sampler.act(pids[0], "cleanup", {}).result(timeout=20)
                assert reply.ok, reply.error
                await pilot.pause(2)
                app.query(GpuCard).first().focus()
                await pilot.press("enter")
                await wait_for(pilot, lambda: isinstance(app.screen, GpuScreen))
                screen = app.screen
                assert isinstance(screen, GpuScreen)
                await wait_for(
                    pilot, lambda: screen.detail is not None and bool(screen.detail.events)
                )
                await pilot.pause(1.5)
                return screen_text(app.export_screenshot()), pids

    sampler.start()
    try:
        text, pids = asyncio.run(run())
    finally:
        sampler.stop()
    for pid in pids:
        assert f"■ pid {pid}" in text
    assert "■ rest of used" in text
    (action,) = store.view().actions
    # Marked with the action's own time, on the wall clock, and its pid.
    clock = time.strftime("%H:%M:%S", time.localtime(action.time))
    assert f"◆ cleanup {clock} pid {pids[0]}" in text
