"""The dashboard's per-round refresh does not make again what did not change (issue 35 item 8:
memtop's CPU beside nvitop's).  Each test counts the work a second round does; what it shows is
pinned elsewhere (test_ui_frozen, the suggestion and observation tests, `--once --json`)."""

from __future__ import annotations

import dataclasses

import pytest

from memtop.diagnosis.suggestions import Suggestion
from memtop.model import Severity
from memtop.ui import view

GIB = 1 << 30


def _suggestions() -> list[Suggestion]:
    return [
        Suggestion("usage", Severity.WARNING, 7, 0, "GPU 0 at 86 %", "d", "70.0 GiB of 80.0 GiB"),
        Suggestion("leak", Severity.CRITICAL, 8, 1, "Leak", "culprits", "confidence 99.1 %"),
        Suggestion("8bit_optimizer", Severity.INFO, 9, 0, "t", "d", "e", "fix", 6 * GIB),
        Suggestion("bf16_parameters", Severity.INFO, 9, 0, "t", "d", "e", "fix", 2 * GIB),
        Suggestion("cleanup", Severity.WARNING, 10, 0, "pid 10 caches", "d", "e", "c", GIB),
    ]


def test_a_suggestion_worded_as_the_round_before_is_not_made_into_an_item_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The rules reword a few suggestions each round (a usage's bytes, a leak's confidence);
    # in the `mixed` demo 82 % are the round before's word for word and the whole list never
    # is, so a memo of the whole list made every item again every round.
    made: list[Suggestion] = []
    item = view._item

    def counted(s: Suggestion) -> view.SuggestionItem:
        made.append(s)
        return item(s)

    monkeypatch.setattr(view, "_item", counted)
    numbers = {(8, 1): 3}  # pid 8's cuda:1 is the driver's GPU 3
    first = _suggestions()
    before = view.suggestion_items(first, True, numbers)
    assert len(made) == 3  # three unfolded (the two tips fold into one roll-up)
    made.clear()
    second = list(first)
    second[0] = dataclasses.replace(first[0], evidence="70.1 GiB of 80.0 GiB")
    after = view.suggestion_items(second, True, numbers)
    assert [s.evidence for s in made] == ["70.1 GiB of 80.0 GiB"]  # only the reworded one
    # ... and the items are what a first round makes of the same suggestions.
    monkeypatch.setattr(view, "_items_made", {})
    monkeypatch.setattr(view, "_last_items", [])
    assert after == view.suggestion_items(second, True, numbers)
    assert [i.key for i in after if i not in before] == ["usage:7:0"]
    assert {i.pid: i.device for i in after}[8] == 3  # named by the driver's number


def test_host_memory_windows_are_made_when_a_screen_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each agent's host memory windows (RSS per sample and per step) are drawn only by a CPU
    # trainer's detail screen; every round made one record per agent that nothing read.
    from memtop.engine import observation
    from memtop.engine.store import Store
    from memtop.model import AgentSample, AgentStatus, AgentView, HostMemory

    store = Store()
    for second in range(5):
        polls = [
            AgentView(
                pid,
                AgentStatus.CONNECTED,
                sample=AgentSample(
                    time=100.0 + second,
                    step=None,
                    devices=(),
                    host_memory=HostMemory((pid + second) * GIB, 9 * GIB, 64 * GIB),
                ),
            )
            for pid in (11, 12)
        ]
        store.update_agents(polls, when=100.0 + second)
    made: list[object] = []
    host_history = observation._host_history

    def counted(windows: object) -> object:
        made.append(windows)
        return host_history(windows)  # type: ignore[arg-type]

    monkeypatch.setattr(observation, "_host_history", counted)
    obs = observation.Observer(store, clock=lambda: 105.0).latest()
    assert made == []
    history = obs.host_history(12)
    assert list(history.allocated) == [float((12 + s) * GIB) for s in range(5)]
    assert obs.host_history(12) is history and len(made) == 1  # made once
    assert set(obs.host_histories) == {11, 12} and len(made) == 1
    # ... the same records a whole round's making gave.
    assert dict(obs.host_histories) == {
        pid: host_history(windows) for pid, windows in store.view().host_windows.items()
    }


def test_a_row_that_holds_its_slow_figures_and_its_step_is_copied_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Within one slow period and one step period a row shows its allocated bytes (a
    # sawtooth's) and its step as shown: they were held in two passes, two copies of a
    # 35-field record per row (~10 us each), every row most rounds.
    import asyncio
    import sys

    from ui_frozen import MY_UID, NOW, SECONDS, TRAINERS, frozen_store, nvml_at, poll_at

    from memtop.ui.app import MemtopApp
    from memtop.ui.widgets import process_table
    from memtop.ui.widgets.process_table import ProcessTable

    # Every round of the test in one slow period and one step period (as test_renewal's).
    widgets = (
        f"memtop.ui.widgets.{name}" for name in ("gpu_panel", "process_table", "suggestions")
    )
    for name in ("memtop.ui.render", "memtop.ui.renewal", "memtop.ui.app", *widgets):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "slow_tick"):
            monkeypatch.setattr(module, "slow_tick", lambda period=0: 7)
    copies: list[str] = []
    hold = process_table._hold

    def counted(row, shown, fields=process_table.SLOW_FIELDS):  # type: ignore[no-untyped-def]
        held = hold(row, shown, fields)
        if held is not row:  # (a copy: the row with what it showed last)
            copies.append(row.key)
        return held

    monkeypatch.setattr(process_table, "_hold", counted)
    store = frozen_store()
    clock = [NOW + 0.5]
    app = MemtopApp(store, None, clock=lambda: clock[0], host="gpu-box", my_uid=MY_UID)
    fragment = TRAINERS[2]
    later = SECONDS + 1  # the sawtooth's allocated bytes and every step moved; no news

    async def run() -> tuple[object, object]:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            table = app.query_one(ProcessTable)
            before = {row.pid: row for row in table.rows}[fragment.pid]
            reading = nvml_at(later)
            store.update_driver(reading, NOW - SECONDS + later)
            polls = [poll_at(tr, later, reading.devices[tr.gpu].free_bytes or 0) for tr in TRAINERS]
            store.update_agents(polls, NOW - SECONDS + later + 0.01)
            clock[0] += later - SECONDS
            copies.clear()
            app.refresh_view()
            await pilot.pause()
            return before, {row.pid: row for row in table.rows}[fragment.pid]

    before, after = asyncio.run(run())
    assert fragment.at(later)[0] != fragment.at(SECONDS)[0]  # its allocated bytes moved
    assert (after.allocated, after.step) == (before.allocated, before.step)  # ... held, both
    assert copies.count(after.key) == 1, copies


def test_a_gpus_accounting_is_worked_out_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Who holds each GPU's used bytes is read by the GPU screen, the JSON and the exporter
    # only; a dashboard built it for every GPU every second (~7 % of the observation's build).
    from memtop.engine import observation
    from memtop.engine.store import Store
    from memtop.model import DeviceReading, DriverReading, GpuProcess, ProcessInfo
    from memtop.present import report
    from memtop.sources.owners import GONE, HERE, PidFacts

    store = Store()
    processes = (GpuProcess(4101, 3 * GIB), GpuProcess(4102, 6 * GIB))
    readings = tuple(
        DeviceReading(i, f"GPU-{i}", "H100", 80 * GIB, 12 * GIB, processes=processes)
        for i in range(2)
    )
    store.update_driver(DriverReading(True, readings, driver_version="580"), 100.0)
    store.update_processes({4101: ProcessInfo(4101, 0, "root", ("python", "serve.py"), "python")})
    store.update_owners(
        {
            4101: PidFacts(4101, HERE, attachable=True, why="memtop attach 4101"),
            4102: PidFacts(4102, GONE, why="exited"),
        }
    )
    calls: list[int] = []
    made = observation._accounting

    def counted(gpu, *args):  # type: ignore[no-untyped-def]
        calls.append(gpu.index)
        return made(gpu, *args)

    monkeypatch.setattr(observation, "_accounting", counted)
    obs = observation.Observer(store, clock=lambda: 101.0, uid=0).latest()
    view.build(obs, sampled=True, my_uid=0, host="h", users={})  # the dashboard's round
    assert calls == []
    first = obs.gpus[1].accounting
    assert calls == [1]
    assert obs.gpus[1].accounting is first  # worked out once
    assert calls == [1]
    # ... and it is what the round's own join says: 3 GiB no agent, 6 GiB gone, 3 unattributed.
    assert first is not None and first.used_bytes == 12 * GIB
    parts = {p.name: (p.bytes, p.pids) for p in first.parts}
    assert parts["no_agent"] == (3 * GIB, (4101,))
    assert parts["gone"] == (6 * GIB, (4102,))
    assert parts["unattributed"] == (3 * GIB, ())
    data = report.build(obs)  # the JSON reads every GPU's
    assert calls == [1, 0]
    assert [g["accounting"]["used_bytes"] for g in data["devices"]] == [12 * GIB, 12 * GIB]


def test_a_devices_drawn_windows_are_cut_when_a_screen_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each agent device's history (the newest rows and step marks the screens draw) was cut
    # from the round's windows for every device every round: eight slices per device, while
    # the main screen reads one device's per GPU (its card's trend), once a slow period.
    from memtop.diagnosis import facts
    from memtop.engine import observation
    from memtop.engine.store import Store
    from memtop.model import AgentDeviceSample, AgentSample, AgentStatus, AgentView

    store = Store()
    for second in range(5):
        stats = {"allocated_bytes.all.current": (10 + second) * GIB}
        sample = AgentDeviceSample(0, stats, 40 * GIB, 80 * GIB)
        poll = AgentView(
            21, AgentStatus.CONNECTED, sample=AgentSample(100.0 + second, second, (sample,))
        )
        store.update_agents([poll], when=100.0 + second)
    made: list[object] = []
    device_history = facts.DeviceHistory

    def made_one(*args: object, **kwargs: object) -> object:
        made.append(kwargs)
        return device_history(*args, **kwargs)  # type: ignore[arg-type]

    from memtop import diagnosis

    for module in (facts, diagnosis):  # wherever one is made
        if hasattr(module, "DeviceHistory"):
            monkeypatch.setattr(module, "DeviceHistory", made_one)
    obs = observation.Observer(store, clock=lambda: 105.0).latest()
    dash = view.build(obs, sampled=True, my_uid=0, host="h", users={})  # the dashboard's round
    assert made == []  # the round built and shown, nothing cut (the card's trend: one column)
    (dev,) = obs.devices_of(obs.agents[0])
    drawn = dev.history
    (card,) = dash.gpus
    baselines = drawn.mark_allocated if len(drawn.mark_allocated) >= 2 else drawn.allocated
    assert card.trend.values == tuple(baselines) and len(baselines) >= 2
    assert len(made) == 1
    assert list(drawn.allocated) == [float((10 + s) * GIB) for s in range(5)]
    assert dev.history is drawn and len(made) == 1  # cut once
    # ... what a whole round's cutting gave: the newest rows of the round's own windows.
    rows, marks = store.view().windows(21, 0)
    assert list(drawn.time) == list(rows["time"]) and list(drawn.mark_step) == list(marks["step"])


def test_a_gpu_card_lays_its_line_out_without_copying_it_piece_by_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The cards are laid out again together each slow period; `head + bar + tail` copied the
    # line so far (its text cleaned of control codes again, its spans copied) for each piece.
    from rich.text import Text
    from ui_helpers import a_gpu_row

    from memtop.ui.view import TrendLine
    from memtop.ui.widgets.gpu_panel import GpuCard

    row = a_gpu_row(TrendLine(tuple(40.0 * GIB + i for i in range(200)), 80 * GIB))
    card = GpuCard(row)
    card.set_class(True, "-dense")
    copies: list[str] = []
    copy = Text.copy

    def counted(text: Text) -> Text:
        copies.append(text.plain)
        return copy(text)

    monkeypatch.setattr(Text, "copy", counted)
    line = card._first_line(120, compact=False)
    assert copies == []
    assert line.plain.startswith("GPU 0  H100 ▕") and line.plain.endswith(" steady")
    # The spans a sum made: the bold head is the line's own style, every piece after it a span.
    assert line.style == "bold"
    assert [(s.start, s.end) for s in line.spans][:2] == [(12, 13), (13, 28)]  # "▕", allocated
