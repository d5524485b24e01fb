"""What the dashboard shows, as plain frozen data rendered from one `Observation`.

Widgets only render these objects, and only when one of them changed (they compare equal when
nothing visible moved), which is what keeps the bytes written to the terminal low.  Building
them needs no Textual, so tests can check the joins and the wording without a terminal.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from memtop.base.records import record
from memtop.diagnosis import DeviceDiagnosis, Suggestion
from memtop.diagnosis.effects import BASIS_AGENT, EFFECT_WINDOW_S, ActionEffect
from memtop.diagnosis.facts import HISTORY_ROWS, MARK_ROWS, DeviceHistory
from memtop.diagnosis.leak import LeakBasis, leak_label
from memtop.diagnosis.suggestions import SEVERITY_RANK, EffectKind, RuleId
from memtop.engine.job_groups import JobGroup, job_groups

# A process's row is the observation's (one record from the join to the table); its words and
# the row's names are named here too, where the screens have always imported them.
from memtop.engine.observation import (
    GpuObservation,
    Observation,
    ProcessRow,
    process_key,
)
from memtop.engine.observation import ProcessState as ProcessState
from memtop.figures.units import format_bytes, format_duration, short_host
from memtop.model import (
    SOURCE_AGENT,
    SOURCE_SIM,
    AgentStatus,
    Choice,
    Severity,
    host_of,
)
from memtop.ui.render import bin_reduce, short_bytes

if TYPE_CHECKING:  # imported when a GPU's screen opens (not on the dashboard's start path)
    from memtop.ui.stacked import Band, ChartEvent, Timeline

TREND_POINTS = 120  # the sparkline's resolution before a widget fits it to its width
TREND_MARKS = 1024  # per-step baselines the sparkline summarises
TREND_SAMPLES = 900  # sampled rows it falls back to without step marks (15 min at 1 s)

# Overall states of the main screen.
WAITING = "waiting"  # before the first sampling round
EMPTY = "empty"  # no devices and no agents
READY = "ready"


class TrendLine:
    """The points of a trend sparkline, reduced from the raw baselines on first use.

    A GPU card draws a new trend once per slow period (render.slow_tick) and keeps the one it
    shows in between, so most trends built each second are never drawn: reducing ~1000
    baselines to TREND_POINTS bins was half the cost of building the view.  Two lines are
    equal when their points are (a card repaints only then)."""

    __slots__ = ("_points", "_raw", "_total")

    def __init__(self, raw: Sequence[float] = (), total: int | None = None) -> None:
        self._raw = raw  # oldest first; a copy nobody changes (the observation's)
        self._total = total  # the device's size: the vertical scale spans at least 2 % of it
        self._points: tuple[tuple[float, ...], float, float] | None = None

    def points(self) -> tuple[tuple[float, ...], float, float]:
        """(values oldest first, floor, span): values are drawn between floor and floor+span."""
        if self._points is None:
            values = tuple(bin_reduce(self._raw, TREND_POINTS, min))
            if values:
                # Noise of a few MB must not look like a cliff.
                low, high = min(values), max(values)
                least = (self._total or 0) / 50 or 1.0
                self._points = (values, low, max(high - low, least))
            else:
                self._points = ((), 0.0, 1.0)
            self._raw = ()
        return self._points

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrendLine):
            return NotImplemented
        return self is other or self.points() == other.points()

    def __hash__(self) -> int:
        return hash(self.points())

    def __repr__(self) -> str:
        return f"TrendLine({self.points()!r})"


class TrendStatus(Choice):
    """What a GPU's leak-trend sparkline says, in the words its label shows."""

    LEAK = "leak"
    STEADY = "steady"
    COLLECTING = "collecting"  # too little data for a verdict yet
    NO_AGENT = "no PyTorch agent"


@record(frozen=True, slots=True)
class Trend:
    """The leak-trend sparkline of one GPU and what it says."""

    line: TrendLine
    status: TrendStatus
    pid: int | None
    bytes_per_step: float | None = None  # of a leak
    bytes_per_second: float | None = None
    seconds_to_full: float | None = None

    @property
    def values(self) -> tuple[float, ...]:
        """Oldest first, reduced to at most TREND_POINTS."""
        return self.line.points()[0]

    @property
    def floor(self) -> float:
        return self.line.points()[1]

    @property
    def span(self) -> float:
        return self.line.points()[2]

    @property
    def leak(self) -> bool:
        return self.status == TrendStatus.LEAK

    def label(self, short: bool = False) -> str:
        """ "pid 4102 +8.0 MiB/step · full in 7 min", or "pid 4102 +8.0M/step 7 min" where room
        is short: which process leaks is half the news (8 GPUs at 80×24 said only the rate)."""
        if not self.leak:
            return self.status
        label = leak_label(self.bytes_per_step, self.bytes_per_second, self.seconds_to_full, short)
        return label if self.pid is None else f"pid {self.pid} {label}"


@record(frozen=True, slots=True)
class GpuRow:
    """One GPU's card on the dashboard: the driver's figures and its agents' summed."""

    index: int
    uuid: str
    name: str
    total: int | None
    used: int | None
    allocated: int  # summed over the PyTorch processes (agents) on it
    reserved: int
    peak: int  # the sum of the true peaks of the PyTorch processes on it
    other: int | None  # used − reserved of the agents: memory outside PyTorch's caches
    agents: int
    processes: int
    fragmentation: float | None  # the worst smoothed gauge of its agents
    trend: Trend
    error: str | None
    # Red only when the gauge is judged worth fixing (a suggestion says so), not at a bare 0.20.
    fragmentation_flagged: bool = False
    utilization: int | None = None  # percent, NVML
    temperature: int | None = None  # °C
    power_watts: float | None = None
    host: str = ""  # the machine it is in, short, when not this one (the fleet view)
    mig: str = ""  # a MIG instance's "MIG 3g.40gb #1" (its index is its GPU's)
    gpu_instance: int | None = None  # a MIG instance's GPU instance id

    @property
    def used_share(self) -> float | None:
        if self.used is None or not self.total:
            return None
        return self.used / self.total


@record(frozen=True, slots=True)
class JobHeader:
    """One job's ranks across hosts in the fleet view (issue 25.3): the header line the process
    table draws above them, with memtop.engine.job_groups' own figures (never recomputed here)."""

    key: str  # stable: the job's group key
    label: str  # "slurm 4242 (pretrain)", "torchrun node-a:29500 x8"
    members: tuple[str, ...]  # process_key of each rank, in rank order
    hosts: tuple[str, ...]  # short, sorted
    spread: int | None  # between the ranks' true peaks
    world_size: int | None = None  # as its ranks' hellos say (WORLD_SIZE), when they do
    drifting: str = ""  # "r0 on node-a peaks +30 %"
    leaking: str = ""  # "r1 on node-b leaks +8.0M/step"


@record(frozen=True, slots=True)
class SuggestionItem:
    """One suggestion as the dashboard's pane words it."""

    key: str
    severity: Severity
    pid: int | None
    device: int | None
    title: str
    evidence: str
    fix: str | None
    effect: str | None
    detail: str = ""  # what to do / why, in prose (a leak's usual culprits)
    effect_kind: EffectKind = EffectKind.SAVING  # its colour on screen: widgets.suggestions
    rule: str = ""
    room: str | None = None  # a roll-up's headroom ("53.8 GiB unused"), drawn apart from savings
    fix_by_agent: bool = False  # the fix is an agent's words (an OOM report's): marked so
    fix_is_prose: bool = False  # the fix is advice in words, not a line to paste


@record(frozen=True, slots=True)
class Dashboard:
    """The dashboard's view of one observation: its GPUs, processes, suggestions and status."""

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
    # What the suggestions pane says when it has nothing to suggest (healthy, or not yet known).
    quiet: str = "Nothing to suggest: memory looks healthy."
    # Why the GPU pane has no card, once sampled ("no NVIDIA driver", "no GPU 5 here").
    no_gpus: str | None = None
    # The fleet view: each job's ranks across hosts, drawn grouped under one header line.
    jobs: tuple[JobHeader, ...] = ()


def build(
    obs: Observation,
    sampled: bool = True,
    my_uid: int | None = None,
    host: str | None = None,
    users: MutableMapping[int, str] | None = None,
) -> Dashboard:
    """The whole dashboard from one observation.  `users`, kept by the caller between builds,
    remembers each pid's owner so that an exited process still names its user."""
    my_uid = obs.uid if my_uid is None else my_uid
    flagged = {(s.pid, s.device) for s in obs.suggestions if s.rule == RuleId.EXPANDABLE_SEGMENTS}
    gpus = tuple(_gpu_row(gpu, flagged) for gpu in obs.gpus)
    users = users if users is not None else {}
    processes = tuple(_viewer_row(row, my_uid, users) for row in obs.entries)
    # Only the pids on screen: a viewer that watches trainers come and go for days would keep
    # every owner it ever saw (the store drops an exited row after its grace; so does this).
    shown = {row.pid for row in obs.entries}
    for pid in [pid for pid in users if pid not in shown]:
        del users[pid]
    if not sampled:
        state = WAITING
    elif not gpus and not obs.agents:
        state = EMPTY
    else:
        state = READY
    nvml_error = None if obs.nvml_available else nvml_line(obs.nvml_error)
    return Dashboard(
        state=state,
        host=host if host is not None else obs.host,
        source=_source(obs),
        nvml_error=nvml_error,
        gpus=gpus,
        processes=processes,
        suggestions=suggestion_items(obs.suggestions, bool(obs.agents), _gpu_numbers(obs)),
        problems=obs.problems,
        last_event=obs.events[-1] if obs.events else None,
        agents=len(obs.live_agents),
        quiet=nothing_to_suggest(obs),
        no_gpus=None if gpus or not sampled else _no_gpus(obs, nvml_error),
        jobs=job_headers(obs),
    )


def job_headers(obs: Observation) -> tuple[JobHeader, ...]:
    """The jobs of the fleet view (its pids carry their hosts), from memtop.engine.job_groups.  On
    one host the table groups a torchrun job under its launcher instead."""
    if not any(host_of(agent.pid) for agent in obs.agents):
        return ()
    headers = []
    agents = {agent.pid: agent for agent in obs.agents}
    for group in job_groups([obs]):
        jobs = [agents[r.pid].job for r in group.ranks]
        world = max((job.world_size for job in jobs if job and job.world_size), default=None)
        headers.append(_job_header(group, world))
    return tuple(headers)


def _job_header(group: JobGroup, world_size: int | None = None) -> JobHeader:
    def who(rank: int | None, pid: int, host: str) -> str:
        return f"{'pid ' + str(pid) if rank is None else f'r{rank}'} on {short_host(host)}"

    drifting = group.drifting
    leaking = group.leaking
    return JobHeader(
        key="/".join(group.key),
        label=group.label,
        members=tuple(process_key(r.pid) for r in group.ranks),
        hosts=tuple(short_host(h) for h in group.hosts),
        spread=group.spread_bytes,
        world_size=world_size,
        drifting=""
        if drifting is None
        else f"{who(drifting[0].rank, drifting[0].pid, drifting[0].host)} peaks "
        f"+{100 * drifting[1]:.0f} %",
        leaking=""
        if leaking is None
        else f"{who(leaking.rank, leaking.pid, leaking.host)} leaks "
        f"{leak_label(leaking.leak_bytes_per_step, None, None, short=True)}",
    )


def nvml_line(error: str | None) -> str | None:
    """The driver's failure as one line that names NVML once ("NVML: NVML not available…")."""
    if not error:
        return error
    return error if error.startswith("NVML") else f"NVML: {error}"


def _no_gpus(obs: Observation, nvml_error: str | None) -> str:
    """Why no GPU card is drawn: said once, in the GPU pane, while the agents still show."""
    if nvml_error:
        return f"No GPU visible. {nvml_error}"
    return "No GPU visible: the NVIDIA driver lists none on this machine."


def nothing_to_suggest(obs: Observation) -> str:
    """What an empty suggestions pane means: healthy only once there is evidence to judge."""
    live = obs.live_agents
    devices = [d for a in live for d in obs.devices_of(a)]
    if live and not devices:
        # CPU only when the agents say they see no CUDA device; else their first samples are
        # still on the way.
        if all(a.hello is not None and not a.hello.devices for a in live):
            # Judged by their host memory (RSS after each step) once there are steps enough.
            hosts = [obs.diagnosis.hosts.get(a.pid) for a in live]
            if hosts and all(h is not None and h.leak.basis != LeakBasis.NONE for h in hosts):
                return (
                    "Nothing to suggest: the PyTorch processes use no GPU (CPU only); their "
                    "host memory after each step is steady."
                )
            return (
                "Nothing to judge yet: the PyTorch processes use no GPU (CPU only); their host "
                "memory is judged after a few dozen steps."
            )
        return COLLECTING
    if any(d.diagnosis.leak.basis == LeakBasis.NONE for d in devices):
        return COLLECTING
    return "Nothing to suggest: memory looks healthy."


COLLECTING = "Collecting… suggestions come after a few dozen steps of history."


def _source(obs: Observation) -> str:
    if obs.nvml_available:
        if obs.nvml_source == SOURCE_SIM:
            return "simulated GPUs"
        if obs.nvml_source == "prometheus":  # the fleet view (memtop.engine.fleet)
            return "via Prometheus"
        label = _DRIVER_LABELS.get(obs.nvml_source, "NVML")
        return f"{label} {obs.driver_version}" if obs.driver_version else label
    return "agents only" if obs.agents else "no devices"


# How the header names the driver a reading came from (the version follows).
_DRIVER_LABELS = {"amdsmi": "ROCm amdgpu", "nvml+amdsmi": "NVML + ROCm amdgpu"}


# ----------------------------------------------------------------------------------- GPUs


def _gpu_row(gpu: GpuObservation, flagged: set[tuple[int | None, int | None]]) -> GpuRow:
    on_it = gpu.agents
    reserved = sum(d.reserved_bytes for d in on_it)
    used = gpu.used_bytes
    return GpuRow(
        index=gpu.index,
        uuid=gpu.uuid,
        name=gpu.name if gpu.name or gpu.source != SOURCE_AGENT else f"cuda:{gpu.index}",
        total=gpu.total_bytes,
        used=used,
        allocated=sum(d.allocated_bytes for d in on_it),
        reserved=reserved,
        peak=gpu.peak_sum_bytes,
        other=None if used is None or not on_it else max(0, used - reserved),
        agents=len(on_it),
        processes=gpu.process_count,
        fragmentation=max((d.diagnosis.fragmentation.gauge_smoothed for d in on_it), default=None),
        trend=_trend(gpu),
        error=gpu.error,
        fragmentation_flagged=any((d.pid, d.index) in flagged for d in on_it),
        utilization=gpu.utilization_percent,
        temperature=gpu.temperature_c,
        power_watts=getattr(gpu, "power_watts", None),
        host=short_host(gpu.host) if gpu.host else "",
        mig=gpu.mig.label() if gpu.mig is not None else "",
        gpu_instance=gpu.mig.gpu_instance_id if gpu.mig is not None else None,
    )


def _trend(gpu: GpuObservation) -> Trend:
    """The sparkline follows the device most worth watching: the fastest leak on the GPU, else
    the largest PyTorch process, else the driver's used memory.  It draws the per-step
    baseline (allocated right after each step), where a leak is a staircase and the
    activations' sawtooth is gone; without step marks, the minimum of sampled allocated."""
    on_it = gpu.agents
    leaking = [d for d in on_it if d.diagnosis.leak.detected]
    focus: DeviceDiagnosis | None
    if leaking:
        focus = max(leaking, key=lambda d: d.diagnosis.leak.bytes_per_second or 0.0)
    else:
        focus = max(on_it, key=lambda d: d.reserved_bytes, default=None)
    if focus is None:
        used = gpu.used_history[1][-TREND_SAMPLES:]
        return Trend(TrendLine(used), TrendStatus.NO_AGENT, None)
    # One column of the round's windows, not the device's whole drawn `history` cut for it:
    # the newest of what `history` holds, as it held them.
    marks = focus.newest("allocated", min(TREND_MARKS, MARK_ROWS), marks=True)
    raw = focus.newest("allocated", min(TREND_SAMPLES, HISTORY_ROWS)) if len(marks) < 2 else marks
    leak = focus.diagnosis.leak
    if leak.detected:
        status = TrendStatus.LEAK
    elif leak.basis == LeakBasis.NONE:
        status = TrendStatus.COLLECTING
    else:
        status = TrendStatus.STEADY
    return Trend(
        TrendLine(raw, focus.sample.total_bytes),
        status,
        focus.pid,
        leak.bytes_per_step if leak.detected else None,
        leak.bytes_per_second if leak.detected else None,
        leak.seconds_to_full if leak.detected else None,
    )


# ------------------------------------------------------------------------------ processes


# ------------------------------------------------------------------------------ processes


def _viewer_row(row: ProcessRow, my_uid: int, users: MutableMapping[int, str]) -> ProcessRow:
    """The observation's row as this viewer shows it: the owner it remembers of a process the
    host no longer names (an exited one), and `own` for a viewer of another uid than the
    observation's.  Most rounds, the row itself."""
    info = row.info
    if info is not None and info.user:
        users[row.pid] = info.user
    user = users.get(row.pid, "?")
    own = info is not None and info.uid == my_uid
    if user == row.user and own == row.own:
        return row
    return replace(row, user=user, own=own)


# ---------------------------------------------------------------------------- suggestions


def _gpu_numbers(obs: Observation) -> dict[tuple[int, int], int]:
    """(pid, the agent's device index) → the GPU as the driver numbers it."""
    return {(d.pid, d.index): d.gpu for a in obs.agents for d in obs.devices_of(a)}


_GpuNumbers = dict[tuple[int, int], int]
_ItemsMade = tuple[Sequence[Suggestion], bool, _GpuNumbers, tuple["SuggestionItem", ...]]
# The last items made, with what they were made from: most rounds the rules say what they said
# the round before, word for word.
_last_items: list[_ItemsMade] = []


def suggestion_items(
    suggestions: Sequence[Suggestion],
    have_agents: bool,
    gpu_numbers: dict[tuple[int, int], int] | None = None,
) -> tuple[SuggestionItem, ...]:
    numbers = gpu_numbers or {}
    for made, agents, numbered, items in _last_items:
        if made == suggestions and agents == have_agents and numbered == numbers:
            return items
    items = _suggestion_items(suggestions, have_agents, numbers)
    _last_items[:] = [(suggestions, have_agents, numbers, items)]
    return items


# Each item made last round, by the suggestion (and the GPU number it is shown with) it was
# made from; a folded roll-up by its tips.  The rules reword a few suggestions each round (a
# usage's bytes, a leak's confidence): in the `mixed` demo 82 % of them are the round before's
# word for word, and the list as a whole never is.  Only the last round's are kept.
_ItemKey = tuple[Suggestion, int | None]
_items_made: dict[object, SuggestionItem] = {}


def _suggestion_items(
    suggestions: Sequence[Suggestion],
    have_agents: bool,
    numbers: dict[tuple[int, int], int],
) -> tuple[SuggestionItem, ...]:
    """Warnings and worse one by one; the info-level tips of one process folded into one item
    (a healthy 8-rank job would otherwise fill the pane with the same two tips).  A process's
    suggestion names its GPU as the driver numbers it, not by the trainer's own cuda index."""
    last = _items_made
    made: dict[object, SuggestionItem] = {}

    def item_of(key: _ItemKey) -> SuggestionItem:
        found = made.get(key) or last.get(key)
        if found is None:
            found = _item(_numbered(key))
        made[key] = found
        return found

    items: list[SuggestionItem] = []
    tips: dict[int | None, list[_ItemKey]] = {}
    for s in suggestions:
        key = (
            (s, numbers.get((s.pid, s.device), s.device))
            if s.pid is not None and s.device is not None
            else (s, s.device)
        )
        if s.severity == Severity.INFO:
            tips.setdefault(s.pid, []).append(key)
            continue
        items.append(item_of(key))
    for pid, keys in tips.items():
        if len(keys) == 1:
            items.append(item_of(keys[0]))
            continue
        folded = (pid, *keys)
        found = made.get(folded) or last.get(folded)
        if found is None:
            found = _tips_item(pid, [_numbered(key) for key in keys])
        made[folded] = found
        items.append(found)
    _items_made.clear()
    _items_made.update(made)
    if not have_agents:
        items.append(
            SuggestionItem(
                key="no-agents",
                severity=Severity.INFO,
                pid=None,
                device=None,
                title="No PyTorch process is attached: the allocator view needs the agent",
                evidence="start the trainer under memtop to see allocated, reserved, "
                "fragmentation and leaks",
                fix="memtop run train.py",
                effect=None,
            )
        )
    items.sort(key=lambda i: -SEVERITY_RANK[i.severity])
    return tuple(items)


def _numbered(key: _ItemKey) -> Suggestion:
    """The suggestion with the GPU it names as the driver numbers it."""
    s, device = key
    return s if device == s.device else replace(s, device=device)


def _tips_item(pid: int | None, group: list[Suggestion]) -> SuggestionItem:
    """One process's info-level tips, folded into one item."""
    # Savings add up (each is memory the process would stop using); a bigger batch's
    # headroom is memory it does not use yet: never summed with them.
    saving = sum(s.effect_bytes or 0 for s in group if s.effect_kind == EffectKind.SAVING)
    room = sum(s.effect_bytes or 0 for s in group if s.effect_kind == EffectKind.ROOM)
    names = ", ".join(s.short_title for s in group)
    effect = f"saves up to {format_bytes(saving)}" if saving else None
    unused = f"{format_bytes(room)} unused" if room else None
    return SuggestionItem(
        key=f"tips:{process_key(pid)}",
        severity=Severity.INFO,
        pid=pid,
        device=None,
        title=f"{len(group)} tips: {names}",
        evidence="; ".join(s.evidence for s in group if s.evidence),
        fix=None,
        effect=effect or unused,
        detail=" ".join(s.detail for s in group if s.detail),
        effect_kind=EffectKind.SAVING if saving else EffectKind.ROOM,
        rule="tips",
        room=unused if effect else None,
    )


def _item(s: Suggestion) -> SuggestionItem:
    # What `effect_bytes` means differs by rule: its rule record says it in words.
    return SuggestionItem(
        key=f"{s.rule}:{process_key(s.pid)}:{s.device}",
        severity=s.severity,
        pid=s.pid,
        device=s.device,
        title=s.title,
        evidence=s.evidence,
        fix=s.fix,
        effect=s.effect_text,
        detail=s.detail,
        effect_kind=s.effect_kind,
        rule=s.rule,
        fix_by_agent=s.fix_by_agent,
        fix_is_prose=s.fix_is_prose,
    )


suggestion_item = _item  # one suggestion as the pane draws it, unfolded


# --------------------------------------------------------------------------------- detail

DETAIL_SAMPLES = 1 << 30  # the chart's window: the whole history the store holds
CHART_POINTS = 240


@record(frozen=True)
class Series:
    """One line (or band) of a chart: its points over the window held."""

    name: str
    xs: tuple[float, ...]  # seconds relative to the newest sample (≤ 0)
    ys: tuple[float, ...]  # bytes (a band's highs)
    lows: tuple[float, ...] | None = None  # a band (allocated): each bin's minimum


@record(frozen=True)
class Detail:
    """The detail screen of one process on one GPU."""

    row: ProcessRow
    series: tuple[Series, ...]
    trend_line: Series | None
    device: DeviceDiagnosis | None
    suggestions: tuple[SuggestionItem, ...]
    allocator_conf: str
    newest: float | None = None  # unix time of x = 0 (the chart's wall-clock axis)
    # What the newest actions memtop performed on this device did, newest first, in lines.
    actions: tuple[str, ...] = ()


def build_detail(obs: Observation, row: ProcessRow, gpu_uuid: str | None) -> Detail:
    series: list[Series] = []
    dev = obs.device(row.pid, row.device) if row.device is not None else None
    device = dev.diagnosis if dev is not None else None
    trend_line = None
    conf = ""
    newest: float | None = None
    actions: tuple[str, ...] = ()
    if dev is not None:
        history = dev.history
        times = history.time[-DETAIL_SAMPLES:]
        if times:
            newest = times[-1]
            skip = len(history.time) - len(times)
            for values, name in (
                (history.reserved, "reserved"),
                (history.torch_peak, "peak"),
            ):
                series.append(_series(name, times, values[skip:], newest))
            # Allocated swings within a step: each bin's min and max, a band on the chart
            # (its maxima alone, sampled at 1 Hz, aliased into scattered points).
            band = _series("allocated", times, history.allocated[skip:], newest)
            lows = bin_reduce(history.allocated[skip:], CHART_POINTS, min)
            series.append(replace(band, lows=tuple(lows)))
            marks = history
            mark_times = [t for t in marks.mark_time if t >= times[0]]
            if mark_times:
                first = len(marks.mark_time) - len(mark_times)
                series.append(
                    _series("baseline", mark_times, marks.mark_allocated[first:], newest, min)
                )
            if dev.diagnosis.leak.detected:
                trend_line = _trend_line(history, dev.diagnosis, newest, times[0])
        agent = obs.agent(row.pid)
        conf = agent.settings_in_force if agent is not None else ""
        done = [e for e in obs.effects_of(agent.pid) if e.device == row.device] if agent else []
        actions = tuple(
            line for e in reversed(done[-ACTIONS_SHOWN:]) for line in effect_lines(e, obs.time)
        )
    elif (agent := obs.agent(row.pid)) is not None and obs.host_history(agent.pid).time:
        # No CUDA device (a CPU trainer): its host memory is its history.
        history = obs.host_history(agent.pid)
        times = history.time[-DETAIL_SAMPLES:]
        newest = times[-1]
        skip = len(history.time) - len(times)
        series.append(_series("RSS", times, history.allocated[skip:], newest))
        mark_times = [t for t in history.mark_time if t >= times[0]]
        if mark_times:
            first = len(history.mark_time) - len(mark_times)
            series.append(
                _series("RSS after step", mark_times, history.mark_allocated[first:], newest, min)
            )
    elif gpu_uuid is not None:
        gpu = obs.gpu(gpu_uuid)
        if gpu is not None and gpu.used_history[0]:
            times, used = gpu.used_history
            times, used = times[-DETAIL_SAMPLES:], used[-DETAIL_SAMPLES:]
            series.append(_series("GPU used", times, used, times[-1]))
            newest = times[-1]
    # Every suggestion in full here: the info tips are not folded as in the main pane.
    items = tuple(
        _item(s if row.gpu is None else replace(s, device=row.gpu))
        for s in obs.diagnosis.suggestions_for(row.pid)
        if s.device in (None, row.device)
    )
    return Detail(row, tuple(series), trend_line, device, items, conf, newest, actions)


ACTIONS_SHOWN = 1  # the newest action the detail screen says the effect of


def effect_lines(effect: ActionEffect, now: float) -> tuple[str, ...]:
    """What an action did, in two short lines that never wrap (the allocator box is half the
    screen): `tune 40 s ago: rsvd 3.4G→3.1G split 973M→445M` and `retries 14→0/min · step
    20→20 ms (+0.4±0.6 %)`, the minute before against the minute after (or what there is of
    it so far); a figure missing on either side is left out."""
    before, after = effect.before, effect.after
    action = effect.action
    said = f"{action.kind} {format_duration(max(0.0, now - action.time))} ago"
    # Who asked, where it was not this memtop (an action known from the agent's log).
    who = [action.by_words()] if action.by_words() else []
    if action.step is not None and who:
        who.append(f"after step {action.step}")
    if not action.ok:
        return (
            _cut(f"{said}: refused"),
            *((_cut(action.why),) if action.why else ()),
            *((_cut(" · ".join(who)),) if who else ()),
        )
    if before is not None and before.basis == BASIS_AGENT:
        who.append("before: agent's reading")
    tail = (_cut(" · ".join(who)),) if who else ()
    if before is None or after is None:
        if after is None:
            late = now - action.time > EFFECT_WINDOW_S  # a viewer that came after it
            return (f"{said}: no samples after it{'' if late else ' yet'}", *tail)
        return (f"{said}: none before it", *tail)
    sizes = [
        f"{name} {short_bytes(was)}→{short_bytes(now_is)}"
        for name, was, now_is in (
            ("rsvd", before.reserved_bytes, after.reserved_bytes),
            ("split", before.split_bytes, after.split_bytes),
        )
        if was is not None and now_is is not None
    ]
    rest = []
    if before.retries_per_min is not None and after.retries_per_min is not None:
        rest.append(f"retries {_count(before.retries_per_min)}→{_count(after.retries_per_min)}/min")
    if before.step_time_s is not None and after.step_time_s is not None:
        step = f"step {_ms(before.step_time_s)}→{_ms(after.step_time_s)} ms"
        change = effect.step_time_change()
        if change is not None:
            precise = f"{step} ({change[0]:+.1f}±{change[1]:.1f} %)"
            # Whole percents where one decimal would not fit ("164→147 ms (-11±18 %)").
            fits = len(" · ".join([*rest, precise])) <= EFFECT_LINE_WIDTH
            step = precise if fits else f"{step} ({change[0]:+.0f}±{change[1]:.0f} %)"
        rest.append(step)
    first = f"{said}: {' '.join(sizes)}" if sizes else said
    if len(first) > EFFECT_LINE_WIDTH:  # "cleanup 1 min ago: rsvd 4.0G→3.0G split …": drop "ago"
        first = _cut(first.replace(" ago: ", ": ", 1))
    lines = [first]
    if rest:
        lines.append(_cut(" · ".join(rest)))
    return (*lines, *tail)


EFFECT_LINE_WIDTH = 46  # the allocator box at 100 columns


def _cut(text: str) -> str:
    return text if len(text) <= EFFECT_LINE_WIDTH else text[: EFFECT_LINE_WIDTH - 1] + "…"


def _count(value: float) -> str:
    return f"{value:.0f}" if value >= 1 or value == 0 else f"{value:.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.01 else f"{seconds * 1000:.1f}"


def _series(name, times, values, newest, reduce=max) -> Series:  # type: ignore[no-untyped-def]
    xs = bin_reduce([t - newest for t in times], CHART_POINTS, max)
    ys = bin_reduce(values, CHART_POINTS, reduce)
    return Series(name, tuple(xs), tuple(ys))


def _trend_line(
    marks: DeviceHistory, device: DeviceDiagnosis, newest: float, oldest: float
) -> Series | None:
    """The leak's fitted line over the analysed regime: its slope is the reported rate, its
    level the median offset of the baselines from that slope."""
    leak = device.leak
    steps, times, allocated = marks.mark_step, marks.mark_time, marks.mark_allocated
    if leak.basis != LeakBasis.STEPS or leak.bytes_per_step is None or not steps:
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


# ------------------------------------------------------------------------------ GPU detail


@record(frozen=True, slots=True)
class GpuDetailLine:
    """One line of a GPU's own detail: a part of its used bytes, or a process in one."""

    bytes: int | None
    text: str  # the part's name, or "pid N  <what memtop can say of it>"
    pids: str = ""  # a part's pids, "4101,4102"
    process: bool = False  # a process of the part above (indented)
    note: str = ""


@record(frozen=True, slots=True)
class GpuDetail:
    """The GPU screen of one GPU (or MIG instance): its accounting and its chart."""

    title: str  # "GPU 0 · MIG 3g.40gb #1  NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    used: int | None
    total: int | None
    lines: tuple[GpuDetailLine, ...]
    missing: str = ""  # why there is no accounting (used bytes not read)
    # Its chart (memtop.ui.widgets.gpu_chart): the driver's used bytes over the window held,
    # its processes' reserved stacked under them in a fixed order, and what happened on it.
    used_timeline: Timeline | None = None
    bands: tuple[Band, ...] = ()
    events: tuple[ChartEvent, ...] = ()
    start: float | None = None  # the window's oldest and newest unix times
    newest: float | None = None


def build_gpu_detail(obs: Observation, uuid: str) -> GpuDetail | None:
    """A GPU's own detail (enter on its card): who holds its used bytes, part by part, with the
    pids of each and what memtop can say of each process (DESIGN §13 accounting).  None: the
    GPU is gone from view."""
    gpu = obs.gpu(uuid)
    if gpu is None:
        return None
    title = f"{gpu.label}  {gpu.name}"
    chart = _gpu_chart(gpu, obs)
    accounting = gpu.accounting
    if accounting is None:
        missing = gpu.error or "used memory not read"
        return GpuDetail(title, None, gpu.total_bytes, (), missing, *chart)
    lines: list[GpuDetailLine] = []
    for part in accounting.parts:
        if not part.bytes and not part.pids:
            continue
        pids = ",".join(str(p) for p in part.pids[:12]) + ("…" if len(part.pids) > 12 else "")
        lines.append(GpuDetailLine(part.bytes, part.label, pids, note=part.note))
        for process in part.processes:
            said = [process.why] if process.why else []
            if process.user and part.name in ("no_agent", "other_users"):
                said.insert(0, process.user)
            for holder in process.holders:
                said.append(
                    f"holder {holder.pid}{' (its process group)' if holder.kin else ''}: "
                    f"{holder.command[:60]}"
                )
            lines.append(
                GpuDetailLine(
                    process.bytes, f"pid {process.pid}  " + " · ".join(said), process=True
                )
            )
    return GpuDetail(title, accounting.used_bytes, gpu.total_bytes, tuple(lines), "", *chart)


GPU_CHART_PROCESSES = 5  # the largest reservers stacked each in a band; the rest in one
# Each process's band by its place in the stack; then the band of the rest of the agents.
PROCESS_COLOURS = ("#e6be00", "#5fa02a", "#50c8e6", "#e63c50", "#f0a030")
MORE_COLOUR = "#8c8cdc"


def _gpu_chart(
    gpu: GpuObservation, obs: Observation
) -> tuple[Timeline | None, tuple[Band, ...], tuple[ChartEvent, ...], float | None, float | None]:
    """The GPU's chart: its used bytes over the window held, and the reserved of every agent's
    process that was on it in that window (live or exited, while the store keeps it), each a
    band in a fixed order (by arrival: a band does not move when another grows), the largest
    GPU_CHART_PROCESSES each its own, the rest summed in one.  Then the events to mark."""
    from memtop.ui.stacked import Band, Timeline  # the GPU's screen only: not at start

    times, used = gpu.used_history
    agents = obs.agents
    devices = [
        d for a in agents for d in obs.devices_of(a) if d.uuid == gpu.uuid and d.history.time
    ]
    ends = [d.history.time[-1] for d in devices] + ([times[-1]] if times else [])
    if not ends:
        return None, (), (), None, None
    newest = max(ends)
    start = min([d.history.time[0] for d in devices] + ([times[0]] if times else []))
    if times:
        start = times[0]  # the driver's window is the chart's: the agents' may be longer
    exited = {a.pid for a in agents if a.status == AgentStatus.EXITED}
    largest = sorted(devices, key=lambda d: -max(d.history.reserved, default=0.0))
    own = sorted(largest[:GPU_CHART_PROCESSES], key=lambda d: (d.history.time[0], d.pid))
    rest = largest[GPU_CHART_PROCESSES:]

    def timeline(dev: DeviceDiagnosis) -> Timeline:
        return Timeline(f"pid {dev.pid}", dev.history.time, dev.history.reserved, dev.pid in exited)

    bands = [Band(f"pid {d.pid}", PROCESS_COLOURS[i], (timeline(d),)) for i, d in enumerate(own)]
    if rest:
        more = f"{len(rest)} more pid{'s' if len(rest) > 1 else ''}"
        bands.append(Band(more, MORE_COLOUR, tuple(timeline(d) for d in rest)))
    used_timeline = Timeline("GPU used", times, used) if times else None
    events = gpu_events(gpu.uuid, obs, start)
    return used_timeline, tuple(bands), events, start, newest


def gpu_events(uuid: str, obs: Observation, since: float) -> tuple[ChartEvent, ...]:
    """What happened on GPU `uuid` since `since`, oldest first: its agents' OOMs (a rise of
    torch's counter between two samples; at the flight recorder's own time for the newest),
    the actions memtop performed in them on it (memtop.diagnosis.effects), and their arriving
    (a process that started in the window, at its first sample here) and leaving (an exited
    agent, at its last).  One home: another source of events (an agent's own log of actions)
    adds its records here."""
    from memtop.ui.stacked import ChartEvent  # the GPU's screen only: not at start

    events: list[ChartEvent] = []
    for agent in obs.agents:
        info = obs.info(agent.pid)
        for dev in obs.devices_of(agent):
            if dev.uuid != uuid or not dev.history.time:
                continue
            history = dev.history
            times, ooms = history.time, history.num_ooms
            rises = [i for i in range(1, len(ooms)) if ooms[i] > ooms[i - 1] and times[i] >= since]
            oom_times = [times[i] for i in rises]
            reported = (dev.diagnosis.last_oom or {}).get("time")
            # The newest OOM happened between its two samples: its report says exactly when.
            if (
                rises
                and isinstance(reported, int | float)
                and times[rises[-1] - 1] <= reported <= times[rises[-1]]
            ):
                oom_times[-1] = float(reported)
            events += [ChartEvent(t, "oom", agent.pid) for t in oom_times]
            events += [
                ChartEvent(e.action.time, e.action.kind, agent.pid)
                for e in obs.effects_of(agent.pid)
                # A refused action (the agent's log keeps those too) changed nothing: no mark.
                if e.device == dev.index and e.action.time >= since and e.action.ok
            ]
            created = info.create_time if info is not None else None
            if created is not None and created >= since:
                events.append(ChartEvent(history.time[0], "arrived", agent.pid))
            if agent.status == AgentStatus.EXITED:
                events.append(ChartEvent(history.time[-1], "left", agent.pid))
    return tuple(sorted(events, key=lambda e: (e.time, e.pid)))
