"""What the dashboard shows, as plain frozen data built from the store and the diagnosis.

Widgets only render these objects, and only when one of them changed (they compare equal when
nothing visible moved), which is what keeps the bytes written to the terminal low.  Building
them needs no Textual, so tests can check the joins and the wording without a terminal.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace

from memtop.diagnosis import DeviceDiagnosis, Diagnosis, Suggestion
from memtop.diagnosis.suggestions import INFO, SEVERITIES
from memtop.model import SOURCE_AGENT, SOURCE_SIM, NvmlReading
from memtop.sources.agents import CONNECTED, EXITED
from memtop.sources.processes import ProcessInfo
from memtop.store import AgentView, Store
from memtop.ui.render import bin_reduce, short_bytes
from memtop.units import format_bytes, format_duration

TREND_POINTS = 120  # the sparkline's resolution before a widget fits it to its width
TREND_MARKS = 1024  # per-step baselines the sparkline summarises
TREND_SAMPLES = 900  # sampled rows it falls back to without step marks (15 min at 1 s)

# Overall states of the main screen.
WAITING = "waiting"  # before the first sampling round
EMPTY = "empty"  # no devices and no agents
READY = "ready"


@dataclass(frozen=True, slots=True)
class Trend:
    """The leak-trend sparkline of one GPU and what it says."""

    values: tuple[float, ...]  # oldest first, already reduced to at most TREND_POINTS
    floor: float  # the sparkline's scale: values are drawn between floor and floor + span
    span: float
    status: str  # "leak", "steady", "collecting", "no PyTorch agent"
    pid: int | None
    bytes_per_step: float | None = None  # of a leak
    bytes_per_second: float | None = None
    seconds_to_full: float | None = None

    @property
    def leak(self) -> bool:
        return self.status == "leak"

    def label(self, short: bool = False) -> str:
        """ "+8.0 MiB/step · full in 7 min", or "+8.0M/step 7 min" where room is short."""
        if not self.leak:
            return self.status
        return leak_label(self.bytes_per_step, self.bytes_per_second, self.seconds_to_full, short)


@dataclass(frozen=True, slots=True)
class GpuRow:
    index: int
    uuid: str
    name: str
    total: int | None
    used: int | None
    allocated: int  # summed over the PyTorch processes (agents) on it
    reserved: int
    peak: int
    other: int | None  # used − reserved of the agents: memory outside PyTorch's caches
    agents: int
    processes: int
    fragmentation: float | None  # the worst smoothed gauge of its agents
    trend: Trend
    error: str | None

    @property
    def used_share(self) -> float | None:
        if self.used is None or not self.total:
            return None
        return self.used / self.total


@dataclass(frozen=True, slots=True)
class ProcessRow:
    key: str  # stable across refreshes: the table's row key
    pid: int
    user: str
    command: str
    gpu: int | None  # the GPU as the driver numbers it
    device: int | None  # the agent's own device index (for actions and the detail screen)
    used: int | None  # what the driver charges to the process
    allocated: int | None
    reserved: int | None
    peak: int | None
    step: int | None
    state: str  # "agent", "exited", "unreachable", "no agent"
    trend: str  # "+8.0 MiB/step" for a leak, "" otherwise
    own: bool

    @property
    def has_agent(self) -> bool:
        return self.state == "agent"


@dataclass(frozen=True, slots=True)
class SuggestionItem:
    key: str
    severity: str
    pid: int | None
    device: int | None
    title: str
    evidence: str
    fix: str | None
    effect: str | None


@dataclass(frozen=True, slots=True)
class Dashboard:
    state: str
    host: str
    source: str  # "NVML 550.54", "simulated GPUs", "agents only"
    nvml_error: str | None
    gpus: tuple[GpuRow, ...]
    processes: tuple[ProcessRow, ...]
    suggestions: tuple[SuggestionItem, ...]
    problems: tuple[str, ...]
    last_event: str | None
    agents: int


def build(
    store: Store,
    diagnosis: Diagnosis,
    sampled: bool = True,
    my_uid: int | None = None,
    host: str | None = None,
) -> Dashboard:
    """The whole dashboard from one consistent read of the store."""
    my_uid = os.getuid() if my_uid is None else my_uid
    reading = store.nvml() or NvmlReading(available=False, error=None)
    agents = store.agents()
    infos = store.processes()
    live_agents = [a for a in agents if a.state == CONNECTED]
    gpus = _gpus(store, reading, live_agents, diagnosis)
    processes = _processes(reading, agents, infos, diagnosis, my_uid)
    events = list(store.events)
    if not sampled:
        state = WAITING
    elif not gpus and not agents:
        state = EMPTY
    else:
        state = READY
    return Dashboard(
        state=state,
        host=host if host is not None else socket.gethostname(),
        source=_source(reading, agents),
        nvml_error=None if reading.available else reading.error,
        gpus=gpus,
        processes=processes,
        suggestions=suggestion_items(diagnosis.suggestions, bool(agents), _gpu_numbers(processes)),
        problems=tuple(store.problems()),
        last_event=events[-1][1] if events else None,
        agents=len(live_agents),
    )


def _source(reading: NvmlReading, agents: Sequence[AgentView]) -> str:
    if reading.available:
        if reading.source == SOURCE_SIM:
            return "simulated GPUs"
        return f"NVML {reading.driver_version}" if reading.driver_version else "NVML"
    return "agents only" if agents else "no devices"


# ----------------------------------------------------------------------------------- GPUs


def _gpus(
    store: Store, reading: NvmlReading, agents: Sequence[AgentView], diagnosis: Diagnosis
) -> tuple[GpuRow, ...]:
    """One row per GPU; agent devices join the driver's GPUs by UUID (CUDA_VISIBLE_DEVICES
    renumbers, so indices cannot be trusted)."""
    on_gpu: dict[str, list[DeviceDiagnosis]] = {}
    for agent in agents:
        for dev in agent.devices:
            found = diagnosis.device(agent.pid, dev.index)
            if found is not None:
                on_gpu.setdefault(dev.uuid or f"{agent.pid}:{dev.index}", []).append(found)
    rows = []
    if reading.available:
        for d in reading.devices:
            rows.append(
                _gpu_row(
                    store,
                    index=d.index,
                    uuid=d.uuid,
                    name=d.name,
                    total=d.total_bytes,
                    used=d.used_bytes,
                    processes=len(d.processes),
                    on_it=on_gpu.pop(d.uuid, []),
                    error=d.error,
                )
            )
    for uuid, on_it in on_gpu.items():  # GPUs only agents know about
        first = on_it[0]
        names = [dev.name for a in agents for dev in a.devices if dev.uuid == first.uuid]
        rows.append(
            _gpu_row(
                store,
                index=first.index,
                uuid=uuid,
                name=names[0] if names else f"cuda:{first.index}",
                total=first.total_bytes,
                used=first.total_bytes - first.free_bytes,
                processes=len(on_it),
                on_it=on_it,
                error=None,
            )
        )
    return tuple(rows)


def _gpu_row(
    store: Store,
    *,
    index: int,
    uuid: str,
    name: str,
    total: int | None,
    used: int | None,
    processes: int,
    on_it: list[DeviceDiagnosis],
    error: str | None,
) -> GpuRow:
    allocated = sum(d.allocated_bytes for d in on_it)
    reserved = sum(d.reserved_bytes for d in on_it)
    return GpuRow(
        index=index,
        uuid=uuid,
        name=name,
        total=total,
        used=used,
        allocated=allocated,
        reserved=reserved,
        peak=sum(d.peak_bytes for d in on_it),
        other=None if used is None or not on_it else max(0, used - reserved),
        agents=len(on_it),
        processes=max(processes, len({d.pid for d in on_it})),
        fragmentation=max((d.fragmentation.gauge_smoothed for d in on_it), default=None),
        trend=_trend(store, uuid, on_it),
        error=error,
    )


def _trend(store: Store, uuid: str, on_it: list[DeviceDiagnosis]) -> Trend:
    """The sparkline follows the device most worth watching: the fastest leak on the GPU, else
    the largest PyTorch process, else the driver's used memory.  It draws the per-step
    baseline (allocated right after each step), where a leak is a staircase and the
    activations' sawtooth is gone; without step marks, the minimum of sampled allocated."""
    leaking = [d for d in on_it if d.leak.detected]
    focus: DeviceDiagnosis | None
    if leaking:
        focus = max(leaking, key=lambda d: d.leak.bytes_per_second or 0.0)
    else:
        focus = max(on_it, key=lambda d: d.reserved_bytes, default=None)
    if focus is None:
        used = [v for _, v in store.device_used_history(uuid, last=TREND_SAMPLES)]
        values = bin_reduce(used, TREND_POINTS, min)
        return _scaled(values, None, Trend((), 0, 1, "no PyTorch agent", None))
    marks = store.step_marks(focus.pid, focus.index, last=TREND_MARKS, columns=("allocated",)).get(
        "allocated", []
    )
    if len(marks) < 2:
        sampled = store.history(
            focus.pid, focus.index, last=TREND_SAMPLES, columns=("allocated",)
        ).get("allocated", [])
        values = bin_reduce(sampled, TREND_POINTS, min)
    else:
        values = bin_reduce(marks, TREND_POINTS, min)
    leak = focus.leak
    if leak.detected:
        status = "leak"
    elif leak.basis == "none":
        status = "collecting"
    else:
        status = "steady"
    trend = Trend(
        (),
        0.0,
        1.0,
        status,
        focus.pid,
        leak.bytes_per_step if leak.detected else None,
        leak.bytes_per_second if leak.detected else None,
        leak.seconds_to_full if leak.detected else None,
    )
    return _scaled(values, focus.total_bytes, trend)


def leak_label(
    per_step: float | None, per_second: float | None, to_full: float | None, short: bool = False
) -> str:
    size = short_bytes if short else format_bytes
    if per_step is not None:
        rate = f"+{size(int(per_step))}/step"
    elif per_second is not None:
        rate = f"+{size(int(per_second))}/s"
    else:
        rate = "growing"
    if to_full is None:
        return rate
    if short:
        return f"{rate} {format_duration(to_full)}"
    return f"{rate} · full in {format_duration(to_full)}"


def _scaled(values: list[float], total: int | None, trend: Trend) -> Trend:
    """Noise of a few MB must not look like a cliff: the vertical scale spans at least 2 % of
    the device."""
    if not values:
        return trend
    low, high = min(values), max(values)
    least = (total or 0) / 50 or 1.0
    return replace(trend, values=tuple(values), floor=low, span=max(high - low, least))


# ------------------------------------------------------------------------------ processes


def _processes(
    reading: NvmlReading,
    agents: Sequence[AgentView],
    infos: dict[int, ProcessInfo],
    diagnosis: Diagnosis,
    my_uid: int,
) -> tuple[ProcessRow, ...]:
    """NVML's processes joined with the agents' devices on (pid, GPU UUID)."""
    gpu_index = {d.uuid: d.index for d in reading.devices} if reading.available else {}
    used: dict[tuple[int, str], int | None] = {}
    if reading.available and reading.source != SOURCE_AGENT:
        for d in reading.devices:
            for p in d.processes:
                used[(p.pid, d.uuid)] = p.used_bytes
    rows: list[ProcessRow] = []
    seen: set[tuple[int, str]] = set()
    for agent in agents:
        info = infos.get(agent.pid)
        argv = agent.hello.argv if agent.hello is not None else ()
        command = " ".join(argv) if argv else (info.command if info else "?")
        state = {CONNECTED: "agent", EXITED: "exited"}.get(agent.state, agent.state)
        devices = agent.devices or ()
        for dev in devices:
            key = (agent.pid, dev.uuid)
            seen.add(key)
            found = diagnosis.device(agent.pid, dev.index)
            trend = ""
            if found is not None and found.leak.detected and state == "agent":
                leak = found.leak
                trend = leak_label(leak.bytes_per_step, leak.bytes_per_second, None, short=True)
            latest = dev.latest
            rows.append(
                ProcessRow(
                    key=f"{agent.pid}:{dev.uuid or dev.index}",
                    pid=agent.pid,
                    user=_user(info),
                    command=command,
                    gpu=gpu_index.get(dev.uuid, dev.index),
                    device=dev.index,
                    used=used.get(key),
                    allocated=latest.allocated,
                    reserved=latest.reserved,
                    peak=max(dev.peak_bytes, latest.torch_peak),
                    step=agent.step,
                    state=state,
                    trend=trend,
                    own=info is not None and info.uid == my_uid,
                )
            )
        if not devices:  # an agent that has not sampled yet, or cannot be reached
            rows.append(
                ProcessRow(
                    key=f"{agent.pid}:-",
                    pid=agent.pid,
                    user=_user(info),
                    command=command,
                    gpu=None,
                    device=None,
                    used=None,
                    allocated=None,
                    reserved=None,
                    peak=None,
                    step=agent.step,
                    state=state,
                    trend="",
                    own=info is not None and info.uid == my_uid,
                )
            )
    if reading.available:
        for d in reading.devices:
            for p in d.processes:
                if (p.pid, d.uuid) in seen:
                    continue
                info = infos.get(p.pid)
                rows.append(
                    ProcessRow(
                        key=f"{p.pid}:{d.uuid}",
                        pid=p.pid,
                        user=_user(info),
                        command=info.command if info and info.visible else "?",
                        gpu=d.index,
                        device=None,
                        used=p.used_bytes,
                        allocated=None,
                        reserved=None,
                        peak=None,
                        step=None,
                        state="no agent",
                        trend="",
                        own=info is not None and info.uid == my_uid,
                    )
                )
    rows.sort(key=lambda r: (r.gpu if r.gpu is not None else 1 << 30, r.pid))
    return tuple(rows)


def _user(info: ProcessInfo | None) -> str:
    return info.user or "?" if info is not None else "?"


# ---------------------------------------------------------------------------- suggestions


def _gpu_numbers(processes: Sequence[ProcessRow]) -> dict[tuple[int, int], int]:
    """(pid, the agent's device index) → the GPU as the driver numbers it."""
    return {
        (r.pid, r.device): r.gpu for r in processes if r.device is not None and r.gpu is not None
    }


def suggestion_items(
    suggestions: Sequence[Suggestion],
    have_agents: bool,
    gpu_numbers: dict[tuple[int, int], int] | None = None,
) -> tuple[SuggestionItem, ...]:
    """Warnings and worse one by one; the info-level tips of one process folded into one item
    (a healthy 8-rank job would otherwise fill the pane with the same two tips).  A process's
    suggestion names its GPU as the driver numbers it, not by the trainer's own cuda index."""
    numbers = gpu_numbers or {}
    suggestions = [
        replace(s, device=numbers.get((s.pid, s.device), s.device))
        if s.pid is not None and s.device is not None
        else s
        for s in suggestions
    ]
    items: list[SuggestionItem] = []
    tips: dict[int | None, list[Suggestion]] = {}
    for s in suggestions:
        if s.severity == INFO:
            tips.setdefault(s.pid, []).append(s)
            continue
        items.append(_item(s))
    for pid, group in tips.items():
        if len(group) == 1:
            items.append(_item(group[0]))
            continue
        saving = sum(s.effect_bytes or 0 for s in group)
        names = ", ".join(_short_title(s) for s in group)
        items.append(
            SuggestionItem(
                key=f"tips:{pid}",
                severity=INFO,
                pid=pid,
                device=None,
                title=f"{len(group)} tips: {names}",
                evidence="; ".join(s.evidence for s in group if s.evidence),
                fix=None,
                effect=f"up to {format_bytes(saving)}" if saving else None,
            )
        )
    if not have_agents:
        items.append(
            SuggestionItem(
                key="no-agents",
                severity=INFO,
                pid=None,
                device=None,
                title="No PyTorch process is attached: the allocator view needs the agent",
                evidence="start the trainer under memtop to see allocated, reserved, "
                "fragmentation and leaks",
                fix="memtop run train.py",
                effect=None,
            )
        )
    order = {name: i for i, name in enumerate(SEVERITIES)}
    items.sort(key=lambda i: -order.get(i.severity, 0))
    return tuple(items)


# What `effect_bytes` means differs by rule; the pane says it in words.
EFFECT_WORDING = {
    "leak": "+{}/hour",
    "usage": "{} over 85 %",
    "cleanup": "frees {}",
    "bigger_batch": "{} unused",
    "expandable_segments": "{} stuck in splits",
}
SHORT_TITLES = {
    "8bit_optimizer": "8-bit optimizer",
    "bf16_parameters": "bf16 weights",
    "bigger_batch": "bigger batch",
    "gradient_checkpointing": "checkpointing",
}


def _item(s: Suggestion) -> SuggestionItem:
    effect = None
    if s.effect_bytes:
        effect = EFFECT_WORDING.get(s.rule, "saves {}").format(format_bytes(s.effect_bytes))
    return SuggestionItem(
        key=f"{s.rule}:{s.pid}:{s.device}",
        severity=s.severity,
        pid=s.pid,
        device=s.device,
        title=s.title,
        evidence=s.evidence,
        fix=s.fix,
        effect=effect,
    )


def _short_title(s: Suggestion) -> str:
    return SHORT_TITLES.get(s.rule, s.title.split(":")[0])


# --------------------------------------------------------------------------------- detail

DETAIL_SAMPLES = 900  # the chart's window: 15 minutes at the default interval
CHART_POINTS = 240


@dataclass(frozen=True)
class Series:
    name: str
    xs: tuple[float, ...]  # seconds relative to the newest sample (≤ 0)
    ys: tuple[float, ...]  # bytes


@dataclass(frozen=True)
class Detail:
    """The detail screen of one process on one GPU."""

    row: ProcessRow
    series: tuple[Series, ...]
    trend_line: Series | None
    device: DeviceDiagnosis | None
    suggestions: tuple[SuggestionItem, ...]
    allocator_conf: str


def build_detail(
    store: Store, diagnosis: Diagnosis, row: ProcessRow, gpu_uuid: str | None
) -> Detail:
    series: list[Series] = []
    device = diagnosis.device(row.pid, row.device) if row.device is not None else None
    trend_line = None
    conf = ""
    if row.device is not None:
        history = store.history(
            row.pid,
            row.device,
            last=DETAIL_SAMPLES,
            columns=("time", "allocated", "reserved", "torch_peak"),
        )
        times = history.get("time", [])
        if times:
            newest = times[-1]
            for column, name in (
                ("reserved", "reserved"),
                ("torch_peak", "peak"),
                ("allocated", "allocated"),
            ):
                series.append(_series(name, times, history[column], newest))
            marks = store.step_marks(row.pid, row.device, last=TREND_MARKS)
            mark_times = [t for t in marks.get("time", []) if t >= times[0]]
            if mark_times:
                skip = len(marks["time"]) - len(mark_times)
                series.append(
                    _series("baseline", mark_times, marks["allocated"][skip:], newest, min)
                )
            if device is not None and device.leak.detected:
                trend_line = _trend_line(marks, device, newest, times[0])
        agent = store.agent(row.pid)
        conf = agent.hello.allocator_conf if agent and agent.hello else ""
    elif gpu_uuid is not None:
        used = store.device_used_history(gpu_uuid, last=DETAIL_SAMPLES)
        if used:
            times = [t for t, _ in used]
            series.append(_series("GPU used", times, [v for _, v in used], times[-1]))
    # Every suggestion in full here: the info tips are not folded as in the main pane.
    items = tuple(
        _item(s if row.gpu is None else replace(s, device=row.gpu))
        for s in diagnosis.suggestions_for(row.pid)
        if s.device in (None, row.device)
    )
    return Detail(row, tuple(series), trend_line, device, items, conf)


def _series(name, times, values, newest, reduce=max) -> Series:  # type: ignore[no-untyped-def]
    xs = bin_reduce([t - newest for t in times], CHART_POINTS, max)
    ys = bin_reduce(values, CHART_POINTS, reduce)
    return Series(name, tuple(xs), tuple(ys))


def _trend_line(
    marks: dict[str, list[float]], device: DeviceDiagnosis, newest: float, oldest: float
) -> Series | None:
    """The leak's fitted line over the analysed regime: its slope is the reported rate, its
    level the median offset of the baselines from that slope."""
    leak = device.leak
    steps, times, allocated = (
        marks.get("step", []),
        marks.get("time", []),
        marks.get("allocated", []),
    )
    if leak.basis != "steps" or leak.bytes_per_step is None or not steps:
        return None
    since = leak.since if leak.since is not None else steps[0]
    chosen = [i for i, s in enumerate(steps) if s >= since and times[i] >= oldest]
    if len(chosen) < 2:
        return None
    slope = leak.bytes_per_step
    offsets = sorted(allocated[i] - slope * steps[i] for i in chosen)
    level = offsets[len(offsets) // 2]
    first, last = chosen[0], chosen[-1]
    return Series(
        "leak trend",
        (times[first] - newest, times[last] - newest),
        (level + slope * steps[first], level + slope * steps[last]),
    )
