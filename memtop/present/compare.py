"""Two runs compared (issue 34.3): peak, reserved, the breakdown, the top sites, fragmentation,
retries and step time, side by side, each difference judged against the runs' own noise.

A run is one process on one GPU, read into a store the way memtop reads anything: a recording
replayed to its end, or a live trainer sampled for a few seconds (its agent hands over every
step mark it still buffers).  Pure over stores: no I/O here.

Noise, per figure:
- step time: the difference of the medians against the standard error of that difference
  (each run's robust spread, 1.4826 × MAD, over √n), beyond it at 3 standard errors and 2 %;
  each step time is the mean over the steps between two step marks (the agent marks at most a
  few times a second), so p90 is of those means;
- memory: beyond the larger of 16 MiB, 1 % and three times the runs' own jitter (the MAD of
  each run's per-step baseline about its median, after removing a linear trend);
- counts (retries, OOMs): any difference, with the rate per minute of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any

from memtop.base.records import record
from memtop.engine.store import Store
from memtop.figures.median import median
from memtop.figures.units import MiB, format_bytes
from memtop.model import AgentDeviceSample, AgentView, Windows

MEMORY_FLOOR = 16 * MiB
RELATIVE_FLOOR = 0.01  # of a memory figure
STEP_TIME_FLOOR = 0.02  # of the median step: a shared box's pace moves by about this much
SIGMAS = 3.0
# The breakdown's parts in the order the detail screen gives them.
PARTS = ("parameters", "gradients", "optimizer_state", "other", "fp32_parameter_bytes")


@record(frozen=True)
class Run:
    label: str
    pid: int
    device: int
    argv: tuple[str, ...]
    duration_s: float
    peak_bytes: float | None
    reserved_bytes: float | None  # at the end
    reserved_max_bytes: float | None
    breakdown: dict[str, int]
    sites: tuple[tuple[str, int], ...]  # ("file:line", bytes), largest first
    fragmentation: float | None  # median over the run
    retries: float | None
    ooms: float | None
    step_times: tuple[float, ...]  # seconds, one per pair of step marks
    baseline_jitter: float  # bytes: MAD of the detrended per-step baseline

    def step_time(self, q: float) -> float | None:
        if not self.step_times:
            return None
        ordered = sorted(self.step_times)
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    def per_minute(self, count: float | None) -> float | None:
        if count is None or self.duration_s <= 0:
            return None
        return count / self.duration_s * 60


@record(frozen=True)
class Difference:
    figure: str
    a: float | None
    b: float | None
    unit: str  # "bytes", "s", "ratio", "count"
    noise: float | None = None
    beyond_noise: bool | None = None  # None: not judged (a figure missing on one side)

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def relative(self) -> float | None:
        d = self.delta
        return None if d is None or not self.a else d / abs(self.a)

    def as_dict(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "a": self.a,
            "b": self.b,
            "unit": self.unit,
            "difference": self.delta,
            "relative": None if self.relative is None else round(self.relative, 4),
            "noise": self.noise,
            "beyond_noise": self.beyond_noise,
        }


@record(frozen=True)
class Comparison:
    a: Run
    b: Run
    differences: tuple[Difference, ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> str:
        beyond = [d for d in self.differences if d.beyond_noise]
        if not beyond:
            return "no difference beyond noise"
        words = [_said(d) for d in beyond if d.figure in SAID]
        return "B against A: " + ("; ".join(words) if words else f"{len(beyond)} figures differ")


class CompareError(ValueError):
    """A run that cannot be compared (no agent, or several and none chosen): one line."""


def run_of(store: Store, label: str, pid: int | None = None, device: int | None = None) -> Run:
    view = store.view()
    agents = [a for a in view.agents if a.devices and (pid is None or a.pid == pid)]
    if not agents:
        raise CompareError(
            f"{label}: no process with an agent" + (f" with pid {pid}" if pid is not None else "")
        )
    if len(agents) > 1:
        pids = ", ".join(str(a.pid) for a in agents)
        raise CompareError(f"{label}: {len(agents)} processes ({pids}); choose one with its pid")
    agent = agents[0]
    devices = [d for d in agent.devices if device is None or d.index == device]
    if not devices:
        raise CompareError(f"{label}: pid {agent.pid} has no GPU {device}")
    # The device the process used most, unless one was named.
    chosen = max(
        devices, key=lambda d: _max(view.windows(agent.pid, d.index)[0].get("reserved")) or 0.0
    )
    return _run(label, agent, chosen, view.windows(agent.pid, chosen.index))


def _run(label: str, agent: AgentView, device: AgentDeviceSample, windows: Windows) -> Run:
    h, marks = windows
    times = list(h.get("time", ()))
    duration = times[-1] - times[0] if len(times) > 1 else 0.0
    marks_s = list(marks.get("step", ()))
    marks_t = list(marks.get("time", ()))
    marks_a = list(marks.get("allocated", ()))
    step_times = tuple(
        (t1 - t0) / (s1 - s0)
        for s0, s1, t0, t1 in zip(marks_s, marks_s[1:], marks_t, marks_t[1:], strict=False)
        if s1 > s0 and t1 > t0
    )
    fragmentation = [v for v in h.get("fragmentation", ()) if v == v]
    breakdown = (agent.breakdown or {}).get(device.index, {})
    sites: list[tuple[str, int]] = []
    for reply in agent.sites:
        for usage in reply.sites:
            if usage.device == device.index:
                sites.append((f"{usage.site.file}:{usage.site.line}", usage.bytes))
    argv = tuple(agent.hello.argv) if agent.hello is not None else ()
    return Run(
        label=label,
        pid=agent.pid,
        device=device.index,
        argv=argv,
        duration_s=duration,
        peak_bytes=_max(h.get("torch_peak")),
        reserved_bytes=_last(h.get("reserved")),
        reserved_max_bytes=_max(h.get("reserved")),
        breakdown={k: int(v) for k, v in breakdown.items()},
        sites=tuple(sorted(sites, key=lambda s: -s[1])[:5]),
        fragmentation=median(fragmentation) if fragmentation else None,
        retries=_last(h.get("num_alloc_retries")),
        ooms=_last(h.get("num_ooms")),
        step_times=step_times,
        baseline_jitter=_detrended_mad(marks_s, marks_a),
    )


def compare(a: Run, b: Run) -> Comparison:
    memory_noise = SIGMAS * max(a.baseline_jitter, b.baseline_jitter)
    diffs = [
        _memory("peak", a.peak_bytes, b.peak_bytes, memory_noise),
        _memory("reserved at the end", a.reserved_bytes, b.reserved_bytes, memory_noise),
        _memory("reserved at most", a.reserved_max_bytes, b.reserved_max_bytes, memory_noise),
    ]
    parts = set(a.breakdown) | set(b.breakdown)
    for part in sorted(parts, key=lambda p: (PARTS.index(p) if p in PARTS else len(PARTS), p)):
        diffs.append(
            _memory(
                part.replace("_", " "), a.breakdown.get(part), b.breakdown.get(part), memory_noise
            )
        )
    diffs.append(_step_time(a, b))
    diffs.append(Difference("step time p90", a.step_time(0.9), b.step_time(0.9), "s", None, None))
    frag = Difference("fragmentation", a.fragmentation, b.fragmentation, "ratio", 0.05)
    diffs.append(_judged(frag, 0.05))
    for name, va, vb in (("retries", a.retries, b.retries), ("OOMs", a.ooms, b.ooms)):
        judged = None if va is None or vb is None else va != vb
        diffs.append(Difference(name, va, vb, "count", 0.0, judged))
    return Comparison(a, b, tuple(diffs))


def _memory(name: str, a: float | None, b: float | None, jitter: float) -> Difference:
    if a is None or b is None:
        return Difference(name, a, b, "bytes")
    noise = max(MEMORY_FLOOR, RELATIVE_FLOOR * max(abs(a), abs(b)), jitter)
    return Difference(name, a, b, "bytes", noise, abs(b - a) > noise)


def _step_time(a: Run, b: Run) -> Difference:
    ma, mb = a.step_time(0.5), b.step_time(0.5)
    if ma is None or mb is None or len(a.step_times) < 5 or len(b.step_times) < 5:
        return Difference("step time median", ma, mb, "s")
    se = (_spread(a.step_times) ** 2 / len(a.step_times)) ** 0.5
    se = (se**2 + _spread(b.step_times) ** 2 / len(b.step_times)) ** 0.5
    noise = max(SIGMAS * se, STEP_TIME_FLOOR * ma)
    return Difference("step time median", ma, mb, "s", noise, abs(mb - ma) > noise)


def _judged(d: Difference, noise: float) -> Difference:
    if d.a is None or d.b is None:
        return d
    return Difference(d.figure, d.a, d.b, d.unit, noise, abs(d.b - d.a) > noise)


def _spread(values: Sequence[float]) -> float:
    middle = median(values)
    return 1.4826 * median(abs(v - middle) for v in values)


def _detrended_mad(steps: Sequence[float], values: Sequence[float]) -> float:
    if len(values) < 5:
        return 0.0
    n = len(values)
    mx, my = sum(steps) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    slope = (
        sum((x - mx) * (y - my) for x, y in zip(steps, values, strict=False)) / sxx if sxx else 0
    )
    residuals = [y - my - slope * (x - mx) for x, y in zip(steps, values, strict=False)]
    return _spread(residuals)


def _max(values: Sequence[float] | None) -> float | None:
    kept = [v for v in values or () if v == v]
    return max(kept) if kept else None


def _last(values: Sequence[float] | None) -> float | None:
    kept = [v for v in values or () if v == v]
    return kept[-1] if kept else None


# ---------------------------------------------------------------------------- words

SAID = {"peak", "reserved at most", "step time median", "retries", "OOMs", "fragmentation"}


def _said(d: Difference) -> str:
    delta = d.delta or 0.0
    rel = d.relative
    pct = f" ({rel * 100:+.0f} %)" if rel is not None else ""
    if d.unit == "bytes":
        way = "more" if delta > 0 else "less"
        return f"{d.figure} {format_bytes(abs(delta))} {way}{pct}"
    if d.unit == "s":
        way = "slower" if delta > 0 else "faster"
        return f"steps {abs(rel or 0) * 100:.1f} % {way}"
    return f"{d.figure} {format_value(d.a, d.unit)} → {format_value(d.b, d.unit)}"


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "bytes":
        return format_bytes(value)
    if unit == "s":
        return f"{value * 1000:.1f} ms"
    if unit == "ratio":
        return f"{value:.2f}"
    return f"{value:.0f}"


def render_text(c: Comparison) -> str:
    def who(run: Run) -> str:
        command = " ".join(run.argv)[:48] or "?"
        return f"pid {run.pid} GPU {run.device}, {run.duration_s:.0f} s: {command}"

    lines = [f"A  {who(c.a)}", f"B  {who(c.b)}", ""]
    lines.append(f"{'':<22}{'A':>12}{'B':>12}{'B − A':>14}  beyond noise?")
    for d in c.differences:
        delta = d.delta
        if delta is None:
            change = "–"
        elif d.unit == "bytes":
            change = ("+" if delta >= 0 else "−") + format_bytes(abs(delta))
        elif d.unit == "s":
            change = f"{delta * 1000:+.1f} ms"
        elif d.unit == "ratio":
            change = f"{delta:+.2f}"
        else:
            change = f"{delta:+.0f}"
        if d.beyond_noise is None:
            judged = "not judged" if delta is not None else "not known"
        elif d.beyond_noise:
            judged = "yes"
        else:
            judged = "no" + (f" (± {format_value(d.noise, d.unit)})" if d.noise else "")
        lines.append(
            f"{d.figure:<22}{format_value(d.a, d.unit):>12}{format_value(d.b, d.unit):>12}"
            f"{change:>14}  {judged}"
        )
    for run in (c.a, c.b):
        if run.sites:
            top = ", ".join(f"{place} {format_bytes(n)}" for place, n in run.sites[:3])
            lines.append(f"top lines in {run.label}: {top}")
    lines.append("")
    lines.append(c.verdict)
    return "\n".join(lines) + "\n"


def as_json(c: Comparison) -> dict[str, Any]:
    def run(r: Run) -> dict[str, Any]:
        return {
            "label": r.label,
            "pid": r.pid,
            "device": r.device,
            "argv": list(r.argv),
            "duration_s": round(r.duration_s, 3),
            "step_time_median_s": r.step_time(0.5),
            "step_time_p90_s": r.step_time(0.9),
            "step_times": len(r.step_times),
            "sites": [{"site": place, "bytes": n} for place, n in r.sites],
            "retries_per_minute": r.per_minute(r.retries),
            "ooms_per_minute": r.per_minute(r.ooms),
        }

    return {
        "a": run(c.a),
        "b": run(c.b),
        "differences": [d.as_dict() for d in c.differences],
        "verdict": c.verdict,
    }
