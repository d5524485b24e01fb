"""`memtop report`: one self-contained HTML page from a recording (issue 33.3), to attach to a
bug report or a chat thread.

Nothing in the page is fetched: inline CSS and SVG, no script.  Everything it shows comes from
the same replay a person would run: the recording is played into a store as `memtop replay`
does; the charts read the store's history at the end, and the figures at the marked moments are
`memtop replay FILE --once --json --at T`'s, built the same way (a fresh store and observer for
each moment), so the page and the command line never disagree.

Every string from a recording (argv, file names, site text, an agent's error) is untrusted: it
reaches the page only through `_e` (html.escape), never as markup.
"""

from __future__ import annotations

import html
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from memtop.base.records import record
from memtop.engine.observation import Observer
from memtop.engine.playback import Player
from memtop.engine.store import Store
from memtop.figures.units import format_bytes as fmt_bytes
from memtop.model import Windows
from memtop.present import report
from memtop.sources.replay import Recording

CHART_W, CHART_H = 880, 190
PLOT_L, PLOT_R, PLOT_T, PLOT_B = 64, 12, 10, 24
COLUMNS = 300  # pixel columns a series is reduced to (min and max of each): pages stay small
MOMENTS = 5  # marked moments, evenly spaced, the last at the end
COLOURS = {
    "allocated": "#2e9e44",
    "reserved": "#c9a000",
    "peak": "#555",
    "baseline": "#1f5fbf",
    "trend": "#d0342c",
    "used": "#8e44ad",
    "oom": "#d0342c",
}


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


@record(frozen=True)
class Moment:
    at_s: float
    data: dict[str, Any]  # report.build() of that moment: `replay --once --json --at`


def observe_at(recording: Recording, when: float) -> dict[str, Any]:
    """What `memtop replay FILE --once --json --at T` reports (less its `replay` block)."""
    store = Store()
    player = Player(store, recording)
    player.seek(when)
    observer = Observer(store, clock=player.clock, host=_host(recording))
    return report.build(observer.latest())


def _host(recording: Recording) -> str:
    host = recording.header.get("host")
    return str(host) if isinstance(host, str) and host else "replay"


def build(recording: Recording, title: str) -> str:
    """The page, as one string."""
    store = Store()
    player = Player(store, recording)
    player.seek(recording.end)
    observer = Observer(store, clock=player.clock, host=_host(recording))
    final = report.build(observer.latest())
    view = store.view()
    start = recording.start
    moments = [
        Moment(at, observe_at(recording, start + at)) for at in _moment_offsets(recording.duration)
    ]
    parts = [_head(title), _header(recording, final, title)]
    parts.append(_suggestions(final))
    parts.append(_actions(final, start))
    for uuid, (times, used) in sorted(view.device_used.items()):
        gpu = next((d for d in final["devices"] if d["uuid"] == uuid), None)
        if gpu is not None and len(times) > 1:
            parts.append(_gpu_section(gpu, times, used, start, recording.duration, moments))
    for agent in view.agents:
        reported = next((a for a in final["agents"] if a["pid"] == agent.pid), None)
        if reported is None:
            continue
        for device in agent.devices:
            figures = next((d for d in reported["devices"] if d["index"] == device.index), None)
            if figures is not None:
                windows = view.windows(agent.pid, device.index)
                parts.append(
                    _process_section(reported, figures, windows, start, recording.duration, moments)
                )
    parts.append(_moments(moments))
    parts.append(
        f"<footer>memtop {_e(final['version'])} · made {_e(time.strftime('%Y-%m-%d %H:%M'))}"
        " · self-contained: this page fetches nothing</footer></body></html>\n"
    )
    return "".join(parts)


def _moment_offsets(duration: float) -> list[float]:
    if duration <= 0:
        return [0.0]
    return [round(duration * (i + 1) / MOMENTS, 3) for i in range(MOMENTS)]


# ------------------------------------------------------------------------------ the page


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:940px;color:#222}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 6px}
.meta{color:#666;margin:0 0 16px}code{font:12px ui-monospace,monospace;background:#f4f4f4;
padding:1px 4px}table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
td,th{padding:2px 10px 2px 0;text-align:right;vertical-align:top}th{color:#666;font-weight:600}
td:first-child,th:first-child{text-align:left}.sev{font-weight:700;text-transform:uppercase;
font-size:11px;padding:1px 5px;border-radius:3px;color:#fff}.emergency,.critical{background:
#d0342c}.warning{background:#c98a00}.info{background:#4a7ab0}.s{margin:6px 0 10px}
.detail{color:#444}.legend span{margin-right:14px;font-size:12px}.legend i{display:inline-block;
width:14px;height:3px;vertical-align:middle;margin-right:4px}svg text{font:11px sans-serif;
fill:#666}footer{color:#888;font-size:12px;margin-top:30px}
"""


def _head(title: str) -> str:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>"
    )


def _header(recording: Recording, final: dict[str, Any], title: str) -> str:
    began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(recording.start))
    files = ", ".join(_e(f.name) for f in recording.files)
    agents = len(final["agents"])
    gpus = len(final["devices"])
    host = recording.header.get("host")
    of = f" of {_e(host)}" if isinstance(host, str) and host else ""
    return (
        f"<h1>{_e(title)}</h1><p class=meta>{files} · {_e(recording.kind)} recording{of} "
        f"from {began}, {recording.duration:.0f} s · {gpus} GPU(s), "
        f"{agents} process(es) with an agent</p>"
    )


def _suggestions(final: dict[str, Any]) -> str:
    items = final["suggestions"]
    if not items:
        return "<h2>Suggestions</h2><p>None at the end of the recording.</p>"
    out = ["<h2>Suggestions at the end</h2>"]
    for s in items:
        where = "" if s["pid"] is None else f"pid {s['pid']}"
        where += "" if s["device"] is None else f" · GPU {s['device']}"
        out.append(
            f'<div class=s><span class="sev {_e(s["severity"])}">{_e(s["severity"])}</span> '
            f"<b>{_e(where)}</b> {_e(s['title'])}"
        )
        if s.get("fix"):
            out.append(f"<br>fix: <code>{_e(s['fix'])}</code>")
        if s.get("detail"):
            out.append(f"<br><span class=detail>{_e(s['detail'])}</span>")
        if s.get("evidence"):
            out.append(f"<br><span class=detail>evidence: {_e(s['evidence'])}</span>")
        out.append("</div>")
    return "".join(out)


def _actions(final: dict[str, Any], start: float) -> str:
    """Every action performed in a trainer during the recording (by memtop or anyone: the
    agent's log), with the minute before and after it: one row per action and device."""
    items = final.get("actions") or []
    if not items:
        return ""

    def pair(action: dict[str, Any], key: str, shown: Any) -> str:
        before, after = action.get("before") or {}, action.get("after") or {}
        if before.get(key) is None or after.get(key) is None:
            return ""
        return f"{shown(before[key])} → {shown(after[key])}"

    rows = []
    for a in items:
        by = a.get("by") or {}
        who = (
            "this memtop"
            if a.get("by_this_memtop")
            else ("the agent itself" if by.get("uid") is None else f"uid {by['uid']}")
        )
        result = a.get("result") or "ok"
        if result != "ok" and a.get("why"):
            result = f"{result}: {a['why']}"
        rows.append(
            (
                f"{a['time'] - start:.1f} s",
                a["pid"],
                "" if a.get("device") is None else a["device"],
                a["kind"],
                who,
                result,
                pair(a, "reserved_bytes", fmt_bytes),
                pair(a, "split_bytes", fmt_bytes),
                pair(a, "retries_per_min", lambda v: f"{v:.1f}/min"),
                pair(a, "step_time_s", lambda v: f"{v * 1000:.1f} ms"),
            )
        )
    head = ("at", "pid", "GPU", "action", "by", "result", "reserved", "stranded", "retries", "step")
    return (
        "<h2>Actions</h2><p>Each action performed in a trainer, the minute before it against "
        "the minute after (medians).</p>" + _table(head, rows)
    )


def _gpu_section(
    gpu: dict[str, Any],
    times: Sequence[float],
    used: Sequence[float],
    start: float,
    duration: float,
    moments: Sequence[Moment],
) -> str:
    series = [Series("used", list(times), list(used), band=False)]
    chart = _chart(series, start, duration, gpu.get("total_bytes"), moments, [])
    return (
        f"<h2>GPU {_e(gpu['index'])} · {_e(gpu['name'])}</h2>"
        f"<p class=meta>{_e(gpu['uuid'])} · used {_e(fmt_bytes(gpu['used_bytes']))} of "
        f"{_e(fmt_bytes(gpu['total_bytes']))} at the end</p>{_legend(series)}{chart}"
    )


def _process_section(
    agent: dict[str, Any],
    figures: dict[str, Any],
    windows: Windows,
    start: float,
    duration: float,
    moments: Sequence[Moment],
) -> str:
    h, marks = windows
    times = list(h.get("time", array("d")))
    series = [
        Series("allocated", times, list(h.get("allocated", array("d"))), band=True),
        Series("reserved", times, list(h.get("reserved", array("d"))), band=False),
        Series("peak", times, list(h.get("torch_peak", array("d"))), band=False, dashed=True),
    ]
    marks_t = list(marks.get("time", array("d")))
    marks_a = list(marks.get("allocated", array("d")))
    if marks_t:
        series.append(Series("baseline", marks_t, marks_a, band=False, dots=True))
    leak = figures.get("leak") or {}
    trend = _trend(leak, list(marks.get("step", array("d"))), marks_t, marks_a)
    if trend is not None:
        series.append(trend)
    ooms = _oom_times(times, list(h.get("num_ooms", array("d"))))
    chart = _chart(series, start, duration, figures.get("total_bytes"), moments, ooms)
    command = " ".join(agent["argv"]) or "?"
    title = f"pid {agent['pid']} · GPU {figures['index']} · {command[:120]}"
    rows = [
        ("allocated", fmt_bytes(figures.get("allocated_bytes"))),
        ("reserved", fmt_bytes(figures.get("reserved_bytes"))),
        ("peak", fmt_bytes(figures.get("peak_bytes"))),
        ("fragmentation", _ratio(figures.get("fragmentation_smoothed"))),
        ("retries", figures.get("num_alloc_retries")),
        ("OOMs", figures.get("num_ooms")),
        ("step", figures.get("step")),
        ("leak", _leak_words(leak)),
    ]
    out = [
        f"<h2>{_e(title)}</h2>",
        f"<p class=meta>{_e(agent['state'])} · torch {_e(agent.get('torch') or '?')} · "
        f"allocator {_e(agent.get('allocator_conf') or 'default')}</p>",
        _legend(series),
        chart,
        _table(["at the end", ""], rows),
    ]
    breakdown = figures.get("breakdown")
    if breakdown:
        out.append(
            _table(
                ["breakdown at a step boundary", ""],
                [(k.replace("_", " "), fmt_bytes(v)) for k, v in breakdown.items()],
            )
        )
    sites = [s for s in agent.get("sites", []) if s.get("device") == figures["index"]]
    if sites:
        out.append(
            _table(
                ["line", "bytes", "trend"],
                [
                    (
                        _site_words(s.get("site") or {}),
                        fmt_bytes(s.get("bytes")),
                        _trend_words(s),
                    )
                    for s in sites[:8]
                ],
            )
        )
    return "".join(out)


def _trend(
    leak: dict[str, Any], steps: list[float], times: list[float], allocated: list[float]
) -> Series | None:
    """The leak's fitted line over the regime it judged, as the detail screen draws it: its
    slope the reported bytes per step, its level the median offset of the baselines from that
    slope (a rate per second would drift off the dots wherever the step rate changed)."""
    slope = leak.get("bytes_per_step")
    if not leak.get("detected") or not isinstance(slope, (int, float)) or not steps:
        return None
    since = leak.get("since")
    since = since if isinstance(since, (int, float)) and since < 1e9 else steps[0]
    chosen = [i for i, s in enumerate(steps) if s >= since]
    if len(chosen) < 2:
        return None
    offsets = sorted(allocated[i] - slope * steps[i] for i in chosen)
    level = offsets[len(offsets) // 2]
    first, last = chosen[0], chosen[-1]
    return Series(
        "trend",
        [times[first], times[last]],
        [level + slope * steps[first], level + slope * steps[last]],
    )


def _moments(moments: Sequence[Moment]) -> str:
    """The figures at the marked moments, as `memtop replay FILE --once --json --at T` gives
    them (the data-* attributes hold the exact bytes, for a reader and for the tests)."""
    rows = []
    for i, moment in enumerate(moments, 1):
        for agent in moment.data["agents"]:
            for d in agent["devices"]:
                rows.append(
                    f'<tr data-at="{moment.at_s}" data-pid="{_e(agent["pid"])}" '
                    f'data-device="{_e(d["index"])}" '
                    f'data-allocated="{_e(d["allocated_bytes"])}" '
                    f'data-reserved="{_e(d["reserved_bytes"])}" '
                    f'data-peak="{_e(d["peak_bytes"])}">'
                    f"<td>T{i} · {moment.at_s:.1f} s</td><td>{_e(agent['pid'])}</td>"
                    f"<td>{_e(d['index'])}</td><td>{_e(fmt_bytes(d['allocated_bytes']))}</td>"
                    f"<td>{_e(fmt_bytes(d['reserved_bytes']))}</td>"
                    f"<td>{_e(fmt_bytes(d['peak_bytes']))}</td>"
                    f"<td>{_e(_leak_words(d.get('leak') or {}))}</td></tr>"
                )
    head = "".join(
        f"<th>{h}</th>" for h in ("moment", "pid", "GPU", "allocated", "reserved", "peak", "leak")
    )
    return (
        "<h2>At the marked moments</h2><p class=meta>As <code>memtop replay FILE --once --json "
        "--at T</code> reports them (T1…T5 on the charts).</p>"
        f"<table id=moments><tr>{head}</tr>{''.join(rows)}</table>"
    )


# ------------------------------------------------------------------------------ charts


@dataclass
class Series:
    name: str
    times: list[float]
    values: list[float]
    band: bool = False  # min-max per pixel column, drawn as an area (a sawtooth, not aliasing)
    dashed: bool = False
    dots: bool = False


def _chart(
    series: Sequence[Series],
    start: float,
    duration: float,
    total: float | None,
    moments: Sequence[Moment],
    ooms: Iterable[float],
) -> str:
    w, h = CHART_W, CHART_H
    pw, ph = w - PLOT_L - PLOT_R, h - PLOT_T - PLOT_B
    values = [v for s in series for v in s.values if v == v]
    top = max(values, default=1.0) * 1.08 or 1.0
    span = max(duration, 1e-9)

    def x(t: float) -> float:
        return PLOT_L + (t - start) / span * pw

    def y(v: float) -> float:
        return PLOT_T + ph - v / top * ph

    out = [f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img">']
    out.append(f'<rect x="{PLOT_L}" y="{PLOT_T}" width="{pw}" height="{ph}" fill="#fafafa"/>')
    for i in range(5):  # y grid and labels
        v = top * i / 4
        yy = y(v)
        out.append(
            f'<line x1="{PLOT_L}" x2="{w - PLOT_R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e6e6e6"/>'
            f'<text x="{PLOT_L - 6}" y="{yy + 4:.1f}" text-anchor="end">{_e(fmt_bytes(v))}</text>'
        )
    for i in range(6):  # x labels: seconds from the start
        t = start + span * i / 5
        out.append(
            f'<text x="{x(t):.1f}" y="{h - 6}" text-anchor="middle">{span * i / 5:.0f} s</text>'
        )
    if total and total <= top:
        out.append(
            f'<line x1="{PLOT_L}" x2="{w - PLOT_R}" y1="{y(total):.1f}" y2="{y(total):.1f}" '
            'stroke="#999" stroke-dasharray="2 3"/>'
        )
    for i, moment in enumerate(moments, 1):
        xx = x(start + moment.at_s)
        out.append(
            f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{PLOT_T}" y2="{PLOT_T + ph}" stroke="#bbb" '
            f'stroke-dasharray="3 3"/><text x="{xx - 3:.1f}" y="{PLOT_T + 10}" '
            f'text-anchor="end">T{i}</text>'
        )
    ooms = list(ooms)
    few = len(ooms) <= 12  # a line each; many (a batch that halves on OOM) are a rug of ticks
    for t in ooms:
        xx = x(t)
        bottom = PLOT_T + ph if few else PLOT_T + 7
        out.append(
            f'<line class=oom x1="{xx:.1f}" x2="{xx:.1f}" y1="{PLOT_T}" y2="{bottom}" '
            f'stroke="{COLOURS["oom"]}" stroke-width="{1.5 if few else 1}"/>'
        )
        if few:
            out.append(
                f'<text x="{xx + 3:.1f}" y="{PLOT_T + 22}" fill="{COLOURS["oom"]}">OOM</text>'
            )
    if ooms and not few:
        out.append(
            f'<text x="{PLOT_L + 4}" y="{PLOT_T + 19}" fill="{COLOURS["oom"]}">'
            f"OOMs in {len(ooms)} sampling intervals (ticks)</text>"
        )
    for s in series:
        colour = COLOURS.get(s.name, "#333")
        columns = _columns(s.times, s.values, start, span)
        if not columns:
            continue
        if s.dots:
            out.append(f'<g fill="{colour}">')
            out.extend(
                f'<circle cx="{PLOT_L + c / COLUMNS * pw:.1f}" cy="{y(hi):.1f}" r="1.4"/>'
                for c, _, hi in columns
            )
            out.append("</g>")
            continue
        if s.band:
            upper = " ".join(f"{PLOT_L + c / COLUMNS * pw:.1f},{y(hi):.1f}" for c, _, hi in columns)
            lower = " ".join(
                f"{PLOT_L + c / COLUMNS * pw:.1f},{y(lo):.1f}" for c, lo, _ in reversed(columns)
            )
            out.append(
                f'<polygon points="{upper} {lower}" fill="{colour}" fill-opacity="0.35" '
                f'stroke="{colour}" stroke-width="0.8"/>'
            )
            continue
        points = " ".join(f"{PLOT_L + c / COLUMNS * pw:.1f},{y(hi):.1f}" for c, _, hi in columns)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        width = 2 if s.name == "trend" else 1.4
        out.append(
            f'<polyline points="{points}" fill="none" stroke="{colour}" '
            f'stroke-width="{width}"{dash}/>'
        )
    out.append("</svg>")
    return "".join(out)


def _columns(
    times: Sequence[float], values: Sequence[float], start: float, span: float
) -> list[tuple[float, float, float]]:
    """(column, min, max) of the samples in each of COLUMNS pixel columns, in order; a series
    of two points (a fitted line) keeps its ends exactly."""
    if len(times) == 2:
        return [((t - start) / span * COLUMNS, v, v) for t, v in zip(times, values, strict=False)]
    cells: dict[int, list[float]] = {}
    for t, v in zip(times, values, strict=False):
        if v != v:  # NaN: no reading
            continue
        c = min(COLUMNS, max(0, round((t - start) / span * COLUMNS)))
        cell = cells.get(c)
        if cell is None:
            cells[c] = [v, v]
        else:
            cell[0] = min(cell[0], v)
            cell[1] = max(cell[1], v)
    return [(float(c), lo, hi) for c, (lo, hi) in sorted(cells.items())]


def _legend(series: Sequence[Series]) -> str:
    spans = "".join(
        f'<span><i style="background:{COLOURS.get(s.name, "#333")}"></i>{_e(s.name)}</span>'
        for s in series
    )
    return f"<div class=legend>{spans}</div>"


def _oom_times(times: Sequence[float], ooms: Sequence[float]) -> list[float]:
    out, last = [], None
    for t, n in zip(times, ooms, strict=False):
        if n != n:
            continue
        if last is not None and n > last:
            out.append(t)
        last = n
    return out


def _table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _ratio(value: object) -> str:
    return f"{float(value):.2f}" if isinstance(value, (int, float)) else "–"


def _leak_words(leak: dict[str, Any]) -> str:
    if not leak:
        return "–"
    if leak.get("detected"):
        per_step = leak.get("bytes_per_step")
        rate = (
            f"+{fmt_bytes(per_step)}/step"
            if per_step
            else f"+{fmt_bytes(leak.get('bytes_per_second'))}/s"
        )
        full = leak.get("seconds_to_full")
        return rate + (f", full in {float(full) / 60:.0f} min" if full else "")
    return str(leak.get("reason") or "no leak")


def _site_words(site: dict[str, Any]) -> str:
    place = f"{site.get('file', '?')}:{site.get('line', '?')}"
    text = str(site.get("text") or "").strip()
    return f"{place}  {text}"[:160] if text else place


def _trend_words(site: dict[str, Any]) -> str:
    for key in ("bytes_per_step", "bytes_per_second"):
        value = site.get(key)
        if isinstance(value, (int, float)) and value:
            return f"+{fmt_bytes(value)}/{'step' if key.endswith('step') else 's'}"
    return ""
