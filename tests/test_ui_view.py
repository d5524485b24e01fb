"""The dashboard's view-model over a frozen observation: what each panel will show, checked
without a terminal (the SVG snapshots check how it looks)."""

from __future__ import annotations

from array import array

from helpers.observations import frozen_observation
from ui_frozen import UUIDS

from memtop.model import Severity
from memtop.ui import render, view


def test_gpu_rows_sum_their_agents_and_follow_the_leak():
    obs = frozen_observation()
    dash = view.build(obs)
    assert dash.state == view.READY and dash.source.startswith("NVML")
    assert [g.uuid for g in dash.gpus] == list(UUIDS)
    first = dash.gpus[0]
    agents = obs.gpus[0].agents
    assert first.agents == len(agents) == 2
    assert first.allocated == sum(a.allocated_bytes for a in agents)
    assert first.reserved == sum(a.reserved_bytes for a in agents)
    assert first.other == max(0, (first.used or 0) - first.reserved)
    assert first.trend.leak and first.trend.pid == 4102 and first.trend.values
    assert first.trend.label(short=True).startswith("pid 4102 +8.0M/step")
    assert dash.gpus[1].trend.status in ("steady", "collecting")


def test_process_rows_and_states():
    dash = view.build(frozen_observation(exited=4101))
    rows = {r.pid: r for r in dash.processes}
    assert rows[4102].state == "agent" and rows[4102].trend.startswith("+8.0M/step")
    assert rows[4101].state == "exited" and rows[4101].trend == ""
    assert rows[7001].state == "no agent" and not rows[7001].own and rows[7001].user == "grace"
    assert rows[7002].own and rows[7002].allocated is None
    # Ordered by GPU, then pid; keys stable across refreshes.
    assert [r.gpu for r in dash.processes] == sorted(r.gpu for r in dash.processes)
    assert len({r.key for r in dash.processes}) == len(dash.processes)
    assert dash.agents == 2  # live ones


def test_suggestions_most_severe_first_and_named_by_driver_gpu():
    obs = frozen_observation()
    items = view.build(obs).suggestions
    ranks = [Severity(i.severity).rank for i in items]
    assert ranks == sorted(ranks, reverse=True)
    leak = [i for i in items if i.key.startswith("leak:")]
    assert leak and leak[0].pid == 4102 and leak[0].device == 0


def test_detail_of_a_leaking_process_has_its_history_and_trend_line():
    obs = frozen_observation()
    dash = view.build(obs)
    (row,) = [r for r in dash.processes if r.pid == 4102]
    detail = view.build_detail(obs, row, UUIDS[0])
    names = [s.name for s in detail.series]
    assert names == ["reserved", "peak", "allocated", "baseline"]
    assert all(len(s.xs) == len(s.ys) <= view.CHART_POINTS for s in detail.series)
    # Seconds before the newest sample (a step mark may land a moment after it).
    assert all(x <= 1.0 for s in detail.series for x in s.xs)
    assert min(detail.series[0].xs) < -60
    assert detail.trend_line is not None and detail.device is not None
    assert detail.device.leak.detected
    assert all(i.pid == 4102 for i in detail.suggestions)
    # A process without an agent: the GPU's used memory instead.
    (stranger,) = [r for r in dash.processes if r.pid == 7001]
    other = view.build_detail(obs, stranger, UUIDS[stranger.gpu or 0])
    assert [s.name for s in other.series] == ["GPU used"] and other.device is None


def test_rendering_is_deterministic_over_one_observation():
    obs = frozen_observation()
    assert view.build(obs) == view.build(obs)


def test_a_trend_line_is_reduced_only_when_drawn_or_compared():
    raw = array("d", [float(i % 7) for i in range(1000)])
    line = view.TrendLine(raw, total=50_000)
    assert line._points is None  # built every second, drawn once per slow period
    values, floor, span = line.points()
    assert len(values) == view.TREND_POINTS and values == tuple(render.bin_reduce(raw, 120, min))
    assert floor == min(values) and span == 1000  # at least 2 % of the device
    assert view.TrendLine(list(raw), total=50_000) == line  # equal by points
    assert view.TrendLine(raw[:-300], total=50_000) != line
    assert view.TrendLine().points() == ((), 0.0, 1.0)
