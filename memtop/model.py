"""Plain data shared by the sources, the store, the analysis, the report and the UI.

Everything here is immutable and free of I/O, so the sampler thread can hand objects to the UI
thread without copying or locking them.  Sizes are integer bytes throughout.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import field
from typing import Any

from memtop.base.choice import Choice as Choice  # re-exported: memtop.model is its usual home
from memtop.base.jobs import JobIdentity, job_identity
from memtop.base.records import record

# The newest per-step baselines memtop judges a trend by: the leak verdict's window, the rows the
# observation reads, and so all a viewer asks an agent for (DESIGN §6, `sample` `max_marks`).
MARK_WINDOW = 1024


class SourceKind(Choice):
    """Where a device reading came from (DESIGN §12): a driver library, a simulated GPU of
    `memtop demo`, or, with neither, what an agent reported through torch.cuda.mem_get_info.
    The JSON's `source` and a recording's `src` carry these words."""

    NVML = "nvml"
    AMDSMI = "amdsmi"  # AMD GPUs through AMD's own library (ROCm), memtop.sources.amdsmi
    SIM = "sim"
    AGENT = "agent"


# The names every module imports (kept: they are the kinds above).
SOURCE_NVML = SourceKind.NVML
SOURCE_AMDSMI = SourceKind.AMDSMI
SOURCE_SIM = SourceKind.SIM
SOURCE_AGENT = SourceKind.AGENT


class AgentStatus(Choice):
    """An agent as the viewer sees it.  A str enum, so the values compare and serialise as the
    plain strings the JSON report has always carried."""

    CONNECTED = "connected"  # answering; its numbers are used
    EXITED = "exited"  # the process is gone (kept on screen a while, dimmed)
    UNREACHABLE = "unreachable"  # alive, but its socket refuses or breaks; retried with back-off
    HUNG = "hung"  # connected but missed its deadline (stopped, deadlocked, flooding frames)
    INCONSISTENT = "inconsistent"  # answers, but its numbers break sanity rules; not summed
    REFUSED = "refused"  # failed authentication (wrong peer pid/uid, symlink, foreign directory)


class Severity(Choice):
    """How urgent a suggestion is, in rising order.  A str enum: the JSON carries the plain
    strings it always has ("info", "warning", "critical", "emergency")."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"
    EMERGENCY = "emergency"

    @property
    def rank(self) -> int:
        """0 for info … 3 for emergency."""
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {severity: i for i, severity in enumerate(Severity)}


class HostPid(int):
    """A pid of another machine: the number, and the host it runs on (the fleet view).

    A pid names a process only on its own host; containers number theirs from 1, so two hosts
    behind one Prometheus often share pids.  The fleet writes every host into one store, and
    the store, the observation, the diagnosis and the screens all key processes by pid: as a
    HostPid, that key is (host, pid) everywhere without any of them changing.  It reads and
    prints as the plain pid ("pid 21062"), and equals only the same pid of the same host (never
    a plain int: a local pid is not a remote one).  `host_of` tells a remote pid from a local."""

    host: str

    def __new__(cls, pid: int, host: str) -> HostPid:
        self = super().__new__(cls, pid)
        self.host = host
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostPid) and int(self) == int(other) and self.host == other.host

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((self.host, int(self)))

    def __repr__(self) -> str:
        return f"HostPid({int(self)}, {self.host!r})"

    def __str__(self) -> str:
        return str(int(self))

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)

    def __getnewargs__(self) -> tuple[int, str]:  # type: ignore[override]
        return (int(self), self.host)


def host_of(pid: int | None) -> str | None:
    """The host a pid runs on when it is another machine's (a HostPid); None for a local pid."""
    return pid.host if isinstance(pid, HostPid) else None


@record(frozen=True, slots=True)
class GpuProcess:
    """One process NVML lists on a device."""

    pid: int
    # None when the driver cannot say (NVML_VALUE_NOT_AVAILABLE, e.g. under WSL or in a container).
    used_bytes: int | None
    kind: str = "compute"  # "compute" or "graphics"


def bare_uuid(uuid: str | None) -> str:
    """A GPU's UUID without NVML's `GPU-`/`MIG-` prefix, lower case: torch gives it bare (CUDA's
    cuDeviceGetUuid), NVML prefixed, and a MIG instance's may come from either side with either
    prefix.  Every comparison of an agent's UUID with the driver's goes through this."""
    text = (uuid or "").strip()
    for prefix in ("MIG-", "GPU-"):
        if text[:4].upper() == prefix:
            text = text[4:]
    return text.lower()


@record(frozen=True, slots=True)
class MigInfo:
    """Where a MIG instance sits: its parent GPU's index, its GPU and compute instance ids
    (DCGM's GPU_I_ID and the CI id), and its profile ("3g.40gb")."""

    parent_index: int
    gpu_instance_id: int
    compute_instance_id: int
    profile: str

    def label(self) -> str:
        """ "MIG 3g.40gb #1" (the GPU instance id: DCGM's GPU_I_ID, `--only 0:1`)."""
        return f"MIG {self.profile} #{self.gpu_instance_id}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "parent_index": self.parent_index,
            "gpu_instance_id": self.gpu_instance_id,
            "compute_instance_id": self.compute_instance_id,
            "profile": self.profile,
        }


@record(frozen=True, slots=True)
class DeviceReading:
    """What the driver reports for one GPU at one moment."""

    index: int
    uuid: str
    name: str
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None = None
    utilization_percent: int | None = None
    memory_utilization_percent: int | None = None
    temperature_c: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    source: str = SOURCE_NVML
    # A one-line description of what failed for this device ("GPU is lost", "not supported: …").
    # Fields that could not be read are None; the others are still valid.
    error: str | None = None
    power_watts: float | None = None  # board power draw (nvmlDeviceGetPowerUsage)
    # "dddd:bb:dd.f", lower case (protocol.canonical_pci_bus_id): what joins an agent's device
    # with the driver's where their UUIDs differ (ROCm).  None: not read.
    pci_bus_id: str | None = None
    # "amd" for AMD's GPUs (amdsmi, or the demo's simulated MI300Xs): the exporter then adds
    # AMD's labels.  None: NVIDIA's, or not said.
    vendor: str | None = None
    host: str | None = None  # the machine it is in, when not this one (the fleet view)
    # A MIG instance: where it sits (its `index` is its parent's).  None: a whole GPU.
    mig: MigInfo | None = None
    # A GPU in MIG mode: its instances are devices of their own and carry the processes; the
    # parent lists none (for a user the driver refuses them, for root they are the instances').
    mig_mode: bool = False


@record(frozen=True, slots=True)
class DriverReading:
    """One poll of the driver: every device, or why there are none.  NVML, AMD's amdsmi and the
    simulator each give one; `source` says which (the JSON report still calls it "nvml")."""

    available: bool
    devices: tuple[DeviceReading, ...] = ()
    driver_version: str | None = None
    error: str | None = None
    source: str = SOURCE_NVML


@record(frozen=True, slots=True)
class AgentDevice:
    """A device as an agent's `hello` describes it."""

    index: int
    uuid: str
    name: str
    total_bytes: int
    # The device's PCI address as torch reports it (canonical form), where it does: on ROCm the
    # agent's UUID is not the driver's, and this is what joins them.
    pci_bus_id: str | None = None


@record(frozen=True, slots=True)
class AgentHello:
    """The first reply of an agent: who it is and what it sees."""

    protocol: int
    pid: int
    argv: tuple[str, ...]
    python: str
    torch: str | None
    allocator_conf: str
    devices: tuple[AgentDevice, ...]
    # Anything else the agent volunteered (extra fields are allowed by the wire schema).
    extra: Mapping[str, Any] = field(default_factory=dict)
    # The allocator's option string in force (None: an agent that does not say): it differs
    # from `allocator_conf`, the environment's, once `memtop tune` changed it.
    allocator_settings: str | None = None

    @property
    def settings_in_force(self) -> str:
        """The allocator options the trainer runs with: what the agent says is in force, else
        its environment's."""
        return self.allocator_conf if self.allocator_settings is None else self.allocator_settings


def _stat(stats: Mapping[str, Any], key: str) -> int:
    value = stats.get(key, 0)
    return int(value) if isinstance(value, int | float) else 0


@record(frozen=True, slots=True)
class AgentDeviceSample:
    """torch.cuda.memory_stats() of one device in one agent, with the metrics DESIGN §4 defines."""

    index: int
    stats: Mapping[str, int]
    free_bytes: int
    total_bytes: int
    # The lowest allocated bytes the agent read since the viewer's previous sample (its floor
    # readings, ~10 Hz while a process without steps is watched; memtop/agent/floor.py), and
    # how many reads that is the lowest of; None where the sample carried none.
    allocated_floor: int | None = None
    floor_readings: int | None = None

    @property
    def allocated(self) -> int:
        return _stat(self.stats, "allocated_bytes.all.current")

    @property
    def reserved(self) -> int:
        return _stat(self.stats, "reserved_bytes.all.current")

    @property
    def torch_peak(self) -> int:
        return _stat(self.stats, "allocated_bytes.all.peak")

    @property
    def cached(self) -> int:
        return max(0, self.reserved - self.allocated)

    @property
    def inactive_split(self) -> int:
        return _stat(self.stats, "inactive_split_bytes.all.current")

    @property
    def fragmentation(self) -> float:
        """Inactive split bytes of the large pool over its reserved bytes (0 when none reserved)."""
        reserved_large = _stat(self.stats, "reserved_bytes.large_pool.current")
        if reserved_large <= 0:
            return 0.0
        return _stat(self.stats, "inactive_split_bytes.large_pool.current") / reserved_large

    @property
    def num_alloc_retries(self) -> int:
        return _stat(self.stats, "num_alloc_retries")

    @property
    def num_ooms(self) -> int:
        return _stat(self.stats, "num_ooms")


@record(frozen=True, slots=True)
class StepMark:
    """Allocated bytes per device right after one optimizer step: the per-step baseline."""

    step: int
    time: float
    allocated: Mapping[int, int]
    # The process's resident set (host memory, /proc/self/statm) right after the step, and the
    # bytes of it glibc holds free (mallinfo2, about once a second); None from an agent that
    # does not report them.
    host_rss: int | None = None
    host_heap_free: int | None = None

    @property
    def host_in_use(self) -> int | None:
        """The resident set less glibc's free bytes: what the process holds after the step."""
        if self.host_rss is None or self.host_heap_free is None:
            return None
        return max(0, self.host_rss - self.host_heap_free)


# A figure a step mark does not have, in StepMarks' integer columns (every figure is >= 0).
MISSING_FIGURE = -1


class StepMarks(Sequence[StepMark]):
    """A sample's step marks, oldest first, held as columns of machine numbers: a `StepMark` is
    made only when one is read (`marks[i]`, iterating).

    A connection's first sample carries up to MARK_WINDOW marks per agent (its backlog).  One
    record (and a mapping, a float) per mark was ~90 bytes each, 1 MB for the `mixed` demo's 11
    agents at once, which raised the dashboard's heap for good (CPython keeps the arenas it
    grew); as columns they are 8 bytes a figure.  The store appends the columns to its rings as
    they are (`device_rows`, `host_rows`); the few other readers (estimate, the conformance
    check, tests) read marks as before.  Treat it as immutable, as every record here.

    `steps`: int64; `times`: doubles; `allocated`: device index -> int64 allocated bytes,
    MISSING_FIGURE where that mark has no figure for the device; `host_rss` and
    `host_heap_free`: int64 (MISSING_FIGURE where a mark has none), or None where no mark has
    one."""

    __slots__ = ("allocated", "host_heap_free", "host_rss", "steps", "times")

    def __init__(
        self,
        steps: array[int],
        times: array[float],
        allocated: Mapping[int, array[int]],
        host_rss: array[int] | None = None,
        host_heap_free: array[int] | None = None,
    ) -> None:
        self.steps = steps
        self.times = times
        self.allocated = allocated
        self.host_rss = host_rss
        self.host_heap_free = host_heap_free

    @classmethod
    def of(cls, marks: Sequence[StepMark]) -> StepMarks:
        """`marks` as columns (itself if it is StepMarks already): the marks of rows (an agent
        that predates the columns layout, a record made in code) take the same path."""
        if isinstance(marks, StepMarks):
            return marks
        indices = sorted({index for mark in marks for index in mark.allocated})
        host_rss = [MISSING_FIGURE if m.host_rss is None else m.host_rss for m in marks]
        heap = [MISSING_FIGURE if m.host_heap_free is None else m.host_heap_free for m in marks]
        return cls(
            array("q", [m.step for m in marks]),
            array("d", [m.time for m in marks]),
            {
                index: array("q", [m.allocated.get(index, MISSING_FIGURE) for m in marks])
                for index in indices
            },
            array("q", host_rss) if any(m.host_rss is not None for m in marks) else None,
            array("q", heap) if any(m.host_heap_free is not None for m in marks) else None,
        )

    def __len__(self) -> int:
        return len(self.steps)

    def _mark(self, i: int) -> StepMark:
        rss = self.host_rss[i] if self.host_rss is not None else MISSING_FIGURE
        heap = self.host_heap_free[i] if self.host_heap_free is not None else MISSING_FIGURE
        return StepMark(
            self.steps[i],
            self.times[i],
            {index: column[i] for index, column in self.allocated.items() if column[i] >= 0},
            None if rss < 0 else rss,
            None if heap < 0 else heap,
        )

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self._mark(j) for j in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("step mark index out of range")
        return self._mark(i)

    def __iter__(self) -> Iterator[StepMark]:
        return (self._mark(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        """The same marks (a tuple of StepMark included: what a sample's marks always were)."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __repr__(self) -> str:
        return f"StepMarks({list(self)!r})"

    def device_rows(self, index: int) -> tuple[array[float], array[float], array[float]]:
        """Step, time and allocated bytes (doubles: the store's ring columns) of the marks that
        have a figure for device `index`, oldest first."""
        column = self.allocated.get(index)
        if column is None:
            return array("d"), array("d"), array("d")
        return self._rows(column)

    def host_rows(self) -> tuple[array[float], array[float], array[float]]:
        """Step, time and resident set (doubles) of the marks that have one, oldest first."""
        if self.host_rss is None:
            return array("d"), array("d"), array("d")
        return self._rows(self.host_rss)

    def _rows(self, column: array[int]) -> tuple[array[float], array[float], array[float]]:
        if MISSING_FIGURE not in column:  # nearly always: every mark has it
            return array("d", self.steps), self.times, array("d", column)
        kept = [i for i, value in enumerate(column) if value >= 0]
        return (
            array("d", [self.steps[i] for i in kept]),
            array("d", [self.times[i] for i in kept]),
            array("d", [column[i] for i in kept]),
        )


NO_STEP_MARKS = StepMarks(array("q"), array("d"), {})


@record(frozen=True, slots=True)
class HostMemory:
    """A trainer process's own host (CPU) memory, as the kernel counts it (`sample`'s
    `host_memory` block): a CPU trainer's only memory figure, torch keeping no CPU counters."""

    rss_bytes: int  # resident now (VmRSS)
    peak_rss_bytes: int  # the kernel's high-water mark of the resident set since the start (VmHWM)
    total_bytes: int | None  # the machine's memory (MemTotal)


@record(frozen=True, slots=True)
class AgentSample:
    """One `sample` reply."""

    time: float
    step: int | None
    devices: tuple[AgentDeviceSample, ...]
    # Oldest first; a parsed reply's are StepMarks (columns), a record made in code may hold a
    # tuple: StepMarks.of reads either.
    step_marks: Sequence[StepMark] = ()
    # The agent's OOM flight recorder: {"ooms", "reports", "last": the newest report's
    # headline (time, step, phase, device, requested_bytes, free_bytes, path, diagnosis)}.
    oom: Mapping[str, Any] | None = None
    host_memory: HostMemory | None = None  # None from an agent that does not report it
    # The allocator's option string in force (None: an agent that does not report it).
    allocator_settings: str | None = None
    # The entries of the agent's action log this connection had not seen (pid 0: the store sets
    # the trainer's pid as the viewer knows it).
    actions: tuple[ActionRecord, ...] = ()


# ------------------------------------------------------------------ the low-rate replies
# protocol.parse_breakdown / parse_snapshot / parse_cleanup / parse_reset_peak make these; no
# dict from the wire goes past protocol.py.


@record(frozen=True, slots=True)
class AgentBreakdown:
    """A `breakdown` reply: bytes by role (parameters, gradients, optimizer_state, other,
    allocated, ...) per device, measured on the trainer's thread right after a step."""

    time: float | None
    step: int | None
    pending: bool  # not measured yet: the trainer's next step boundary will
    devices: Mapping[int, Mapping[str, int]]
    measured: str | None = None  # when in the step it was measured ("after_step")


@record(frozen=True, slots=True)
class AgentSnapshot:
    """A `snapshot` reply: the per-device summary of a trace-free snapshot (DESIGN §4), and the
    file written when one was asked for."""

    time: float | None
    pending: bool
    devices: Mapping[int, Mapping[str, float]]
    path: str | None = None
    bytes: int | None = None


MEMORY_VIZ = "https://pytorch.org/memory_viz"


def snapshot_note(devices: Mapping[Any, Mapping[str, float]]) -> str:
    """What to say of a snapshot file just written: where to open it, or, for one without a
    segment (memory_viz would draw nothing), that it is empty and why."""
    if any(summary.get("segments", 0) for summary in devices.values()):
        return f"open it at {MEMORY_VIZ}"
    return (
        "an empty snapshot, 0 segments: the process holds no CUDA memory (a CPU-only trainer, "
        "or no tensor on a GPU yet)"
    )


@record(frozen=True, slots=True)
class AgentCleanup:
    """A `cleanup` reply: what gc.collect + empty_cache released, and where it ran."""

    released_bytes: Mapping[int, int]
    reserved_before: Mapping[int, int]
    reserved_after: Mapping[int, int]
    gc_collected: int | None
    at_step_boundary: bool
    after_step: int | None
    took_s: float | None


@record(frozen=True, slots=True)
class AgentTune:
    """A `tune` reply: the allocator's whole option string before and after the change, the keys
    changed, and the step it ran after; with the cache emptied, reserved bytes around it."""

    before: str
    after: str
    changed: Mapping[str, str]
    at_step_boundary: bool
    after_step: int | None
    took_s: float | None
    reserved_before: Mapping[int, int] = field(default_factory=dict)
    reserved_after: Mapping[int, int] = field(default_factory=dict)


# The commands that change the trainer (memtop.protocol.commands' acting ones; a test holds the
# two to the same names): an action's kind as the exporter labels it, any other is "other".
ACTION_KINDS = ("cleanup", "tune", "reset_peak", "snapshot", "sites")
ACTION_OK = "ok"
ACTION_REFUSED = "refused"
ACTION_BY_VIEWER = "viewer"
ACTION_FROM_AGENT = "agent"


@record(frozen=True, slots=True)
class ActionRecord:
    """An action memtop performed in a trainer (cleanup, tune, reset_peak, a snapshot file,
    stacks switched): what, when, in which pid, with which arguments.  Its effect is read from
    the windows of history before and after `time` (memtop.diagnosis.effects)."""

    kind: str  # the protocol command
    time: float
    pid: int
    args: Mapping[str, Any] = field(default_factory=dict)
    # Who asked, from the agent's action log (the client's uid and pid by SO_PEERCRED; both
    # None for the agent's own, an --auto-cleanup) or, for what this memtop did, its own.
    by_uid: int | None = None
    by_pid: int | None = None
    result: str = ACTION_OK  # ACTION_OK, or ACTION_REFUSED with `why`
    why: str | None = None
    step: int | None = None  # the trainer's step it ran after, where the agent says
    # Its number in the agent's action log: the one action the viewer performed and then read
    # back from the log is kept once (memtop.engine.store.Store.record_action).
    seq: int | None = None
    # ACTION_BY_VIEWER: this memtop performed it; ACTION_FROM_AGENT: known from the agent's log
    # (another shell's `memtop cleanup`, another viewer, the exporter's host, the agent itself).
    source: str = ACTION_BY_VIEWER
    # Per device, the allocator's counters the agent read right before it ran (reserved_bytes,
    # split_bytes, num_alloc_retries, num_ooms): a viewer that connected after it has no
    # history before it, and still this.
    before: Mapping[int, Mapping[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result == ACTION_OK

    def by_words(self) -> str:
        """Who asked, in a few words: "by uid 1000", "by the agent itself", "" for this memtop."""
        if self.source == ACTION_BY_VIEWER:
            return ""
        if self.by_uid is None:
            return "by the agent itself"
        return f"by uid {self.by_uid}"


@record(frozen=True, slots=True)
class AgentResetPeak:
    """A `reset_peak` reply: the devices whose torch peak restarted."""

    devices: tuple[int, ...]


@record(frozen=True, slots=True)
class Site:
    """A line of the user's code that allocated live memory (DESIGN §12); strings cleaned."""

    file: str
    line: int
    function: str
    text: str


@record(frozen=True, slots=True)
class SiteUsage:
    """One site's live blocks on one device: old blocks were alive at the previous reading."""

    device: int
    site: Site
    bytes: int
    blocks: int
    old_blocks: int


@record(frozen=True, slots=True)
class AgentSites:
    """A `sites` reply: whether stacks are recorded, and the newest grouping (top N)."""

    enabled: bool
    time: float | None
    step: int | None
    sites: tuple[SiteUsage, ...]
    pending: bool = False  # never: the newest grouping is served at once (the pool asks)
    wanted: bool = False  # stacks asked for, switched on at the trainer's next boundary
    # With `{"history": true}` (a connection's first request, DESIGN §13): the agent's kept
    # rounds before this one, oldest first, each an AgentSites of its own (no history of its own).
    history: tuple[AgentSites, ...] = ()


@record(frozen=True, slots=True)
class ProcessInfo:
    """A process as the host shows it (memtop.sources.processes reads it with psutil)."""

    pid: int
    uid: int | None  # None when the process is not visible here
    user: str | None
    cmdline: tuple[str, ...]  # cleaned of control characters (any user's argv may carry some)
    name: str
    # When the process started (psutil's create_time): tells a reused pid from the original.
    create_time: float | None = None
    ppid: int | None = None  # the launcher of a torchrun rank
    # Host usage, refreshed every USAGE_EVERY_S (the dashboard's CPU% and RSS columns).
    cpu_percent: float | None = None
    rss: int | None = None
    # What tells an inference server's share (memtop.diagnosis.workload): its launcher's command
    # line (vLLM's and SGLang's engine processes rename themselves and keep no flags), and the
    # ENGINE_ENVIRONMENT variables of its environment where /proc lets the viewer read it (the
    # same user, or root: read, never run); nothing else of either environment is kept.
    launcher_cmdline: tuple[str, ...] = ()
    engine_environ: Mapping[str, str] = field(default_factory=dict)

    @property
    def command(self) -> str:
        return " ".join(self.cmdline) if self.cmdline else self.name

    @property
    def visible(self) -> bool:
        return self.uid is not None


# ------------------------------------------------------------------ who holds a GPU's memory
# What memtop.sources.owners finds of each pid the driver charges (the accounting of DESIGN §13).

HERE = "here"
OTHER_NAMESPACE = "other_namespace"
HIDDEN = "hidden"
GONE = "gone"


@record(frozen=True, slots=True)
class Holder:
    """A live process that holds a GPU device file open and that the driver does not list."""

    pid: int
    command: str
    files: tuple[str, ...]
    kin: bool  # in the gone pid's process group or session: one of its children, likely


@record(frozen=True, slots=True)
class PidFacts:
    """What memtop can say of a pid the driver charges: where it runs, whether it can take an
    agent and why, and what holds its memory."""

    pid: int
    state: str  # HERE, OTHER_NAMESPACE, HIDDEN, GONE
    container: str | None = None  # "container 3f2a9c1b7d4e", "pod 1b2c…" where cgroup says
    attachable: bool = False
    why: str = ""  # why it can or cannot take an agent; where it runs; what holds its memory
    holders: tuple[Holder, ...] = ()


# The parts of a GPU's used bytes, in order (DESIGN §13, `accounting` in --once --json), and
# how the screens name them.
PART_LABELS = {
    "agents_reserved": "PyTorch's caches (agents' reserved)",
    "agents_outside_pytorch": "agents' processes outside PyTorch",
    "no_agent": "processes without an agent",
    "other_namespace": "processes in other pid namespaces",
    "other_users": "other users' processes",
    "gone": "exited pids still charged",
    "mig_instances": "MIG instances",
    "overcounted": "charged twice (per-process sum exceeds used)",
    "unattributed": "charged to no listed process",
}


@record(frozen=True, slots=True)
class AccountedProcess:
    """One process in a part of a GPU's accounting, and what memtop can say of it."""

    pid: int
    bytes: int | None  # what the driver charges it (None: N/A, counted as unattributed)
    why: str = ""  # attachable or not and why; where it runs; what holds its memory
    attachable: bool | None = None
    container: str | None = None
    user: str | None = None
    holders: tuple[Holder, ...] = ()  # a gone pid: live processes holding GPU device files


@record(frozen=True, slots=True)
class AccountPart:
    """One part of a GPU's used bytes (a key of PART_LABELS) and the processes it counts."""

    name: str  # a key of PART_LABELS
    bytes: int
    pids: tuple[int, ...] = ()
    processes: tuple[AccountedProcess, ...] = ()
    note: str = ""

    @property
    def label(self) -> str:
        return PART_LABELS.get(self.name, self.name)


@record(frozen=True, slots=True)
class Accounting:
    """Every byte the driver counts as used on one GPU, by who holds it: parts that sum exactly
    to `used_bytes` (the last, `unattributed`, is what no listed process is charged)."""

    used_bytes: int
    parts: tuple[AccountPart, ...]

    def part(self, name: str) -> AccountPart | None:
        return next((p for p in self.parts if p.name == name), None)


# ------------------------------------------------------------------ one agent, polled and kept
# The mark of an `AgentView` field the store writes (its part of the record, kept across rounds):
# the store reads the names from the record's own fields (`store_kept_fields`), no list of them.
STORE_KEPT: Mapping[str, bool] = {"store_kept": True}

# One record per agent and round: the agents' pool (memtop.sources.agents; a recording, the fleet
# reader and a scrape make them too) fills in what it read this round, and the store
# (memtop.engine.store) completes that same record with what it keeps across rounds, once,
# before it publishes the round; from then on nobody writes it.  The store hands a round of them
# out as one `RoundView`; the diagnosis, the observation and the renderers read these.


@record(frozen=True, slots=True)
class AgentView:
    """One agent: what its poll read this round, and what the store keeps of it across rounds
    (each device's newest sample, the parsed reply's record itself; where the hello says the
    device is: `device_identity`).  A device's windows (history, step marks) are the round's:
    `RoundView.windows`.

    The pool's part (pid to owner) is the round's reading.  The store's part (from `step` on)
    is written by `Store.update_agents` into the pool's record itself, the one time a store
    keeps it (`kept`), before any reader sees it; a record a store kept already is copied,
    never written again.  So the store holds the pool's record as it is: no second record of
    the agent per round."""

    # ---- the round's reading (the pool's)
    pid: int
    state: AgentStatus
    # Who it is, as it said on connecting (the store keeps the last one through a poll without).
    hello: AgentHello | None = None
    sample: AgentSample | None = None  # this round's `sample` reply (None: none this round)
    error: str | None = None
    # Replies to the low-rate commands that arrived this round, parsed by the protocol (the
    # store keeps their figures below).
    breakdown_reply: AgentBreakdown | None = None
    snapshot_reply: AgentSnapshot | None = None
    sites_reply: AgentSites | None = None  # live memory by the user's line (DESIGN §12)
    # The uid owning the socket directory (who runs the agent).
    owner: int | None = None
    # ---- what the store keeps across rounds (written by the store, once; marked STORE_KEPT)
    step: int | None = field(default=None, metadata=STORE_KEPT)
    last_sample_time: float | None = field(default=None, metadata=STORE_KEPT)
    # Each device's newest sample, by index: the `AgentDeviceSample` parsed from the reply, as
    # it is (a device a later sample does not list keeps its last one).
    devices: tuple[AgentDeviceSample, ...] = field(default=(), metadata=STORE_KEPT)
    breakdown: dict[int, dict[str, int]] | None = field(default=None, metadata=STORE_KEPT)
    snapshot_summary: dict[int, dict[str, Any]] | None = field(default=None, metadata=STORE_KEPT)
    # when the agent measured it (its clock: this host's)
    breakdown_time: float | None = field(default=None, metadata=STORE_KEPT)
    # the step after which the agent measured it
    breakdown_step: int | None = field(default=None, metadata=STORE_KEPT)
    snapshot_time: float | None = field(default=None, metadata=STORE_KEPT)
    # The newest OOM report's headline, as the agent's sample says (None: no OOM yet).
    last_oom: Mapping[str, Any] | None = field(default=None, metadata=STORE_KEPT)
    # its `sites` readings, oldest first
    sites: tuple[AgentSites, ...] = field(default=(), metadata=STORE_KEPT)
    # The allocator's option string in force, as the agent last said (None: it does not say;
    # the hello's environment string is all there is).  `memtop tune` changes it.
    allocator_settings: str | None = field(default=None, metadata=STORE_KEPT)
    # memtop's own maximum of the allocated bytes it sampled, by device index (misses a step's
    # peak between samples; torch's is the sample's `torch_peak`); the `r` key restarts it.
    sampled_peaks: Mapping[int, int] = field(default_factory=dict, metadata=STORE_KEPT)
    # Host memory's newest reading (its windows are the round's: `RoundView.host_windows`).
    host_memory: HostMemory | None = field(default=None, metadata=STORE_KEPT)
    # Actions performed in it by (kind, result), each counted once (the exporter's counter).
    action_counts: Mapping[tuple[str, str], int] = field(default_factory=dict, metadata=STORE_KEPT)
    # Whether a store has kept this record (written its part and published it): it is then
    # never written again (`dataclasses.replace` makes a record that is not kept yet).
    kept: bool = field(default=False, init=False, repr=False, compare=False)

    def device_identity(self, index: int) -> tuple[str, str]:
        """(UUID, name) of its device `index`, as its hello declares it; ("", "cuda:N") where
        the hello does not say (no hello yet, or a device it did not list)."""
        if self.hello is not None:
            for declared in self.hello.devices:
                if declared.index == index:
                    return declared.uuid, declared.name
        return "", f"cuda:{index}"

    def sampled_peak(self, index: int) -> int:
        """memtop's own peak of device `index` (0: never sampled)."""
        return self.sampled_peaks.get(index, 0)

    @property
    def status(self) -> AgentStatus:
        return AgentStatus(self.state)

    @property
    def live(self) -> bool:
        return self.state == AgentStatus.CONNECTED

    @property
    def cpu_only(self) -> bool:
        """Sampled, and no CUDA device in use: cleanup, snapshots and stacks have nothing to
        act on (they are CUDA's caching allocator's)."""
        return self.live and not self.devices and self.host_memory is not None

    @property
    def argv(self) -> tuple[str, ...]:
        return self.hello.argv if self.hello is not None else ()

    @property
    def allocator_conf(self) -> str:
        """The environment's allocator options, as the trainer started."""
        return self.hello.allocator_conf if self.hello is not None else ""

    @property
    def settings_in_force(self) -> str:
        """The allocator options the trainer runs with: what its agent last said is in force,
        else its environment's (an agent that does not say)."""
        if self.allocator_settings is not None:
            return self.allocator_settings
        return self.hello.settings_in_force if self.hello is not None else ""

    @property
    def job(self) -> JobIdentity | None:
        """Its scheduler job and rendezvous, as its hello said (memtop.base.jobs)."""
        return job_identity(self.hello.extra) if self.hello is not None else None

    @property
    def hip(self) -> str | None:
        """The HIP version of the trainer's torch when it is a ROCm build (torch.version.hip, in
        the hello since AMD support); None on CUDA, or from an older agent."""
        value = self.hello.extra.get("hip") if self.hello is not None else None
        return value if isinstance(value, str) and value else None

    @property
    def rank(self) -> int | None:
        """Its rank in its job: RANK as its hello said, else Slurm's SLURM_PROCID."""
        rank = self.hello.extra.get("rank") if self.hello is not None else None
        if isinstance(rank, int) and not isinstance(rank, bool):
            return rank
        job = self.job
        return job.slurm_proc_id if job is not None else None


# A window of history: (rows, step marks), each columns by name, oldest first: sequences of
# floats read where the store's ring keeps them (store.RingWindow), whose slices are arrays (a
# memcpy of the rows cut, no float object per row until one is read).
Windows = tuple[Mapping[str, Sequence[float]], Mapping[str, Sequence[float]]]
NO_WINDOWS: Windows = ({}, {})


def search_column(column: Sequence[float], value: float, right: bool = False) -> int:
    """Where `value` goes in an ascending column of a window: `bisect_left` (`bisect_right`
    with `right`), at C speed on a store's window too (its own `search`, in place)."""
    search = getattr(column, "search", None)
    if search is not None:
        return int(search(value, right))
    return (bisect_right if right else bisect_left)(column, value)


@record(frozen=True)
class RoundView:
    """Everything the store holds of one generation, taken under one lock: what the
    observation joins and the diagnosis judges.  Nothing in it changes afterwards: the agents'
    records are the store's own (frozen, never written once kept), and the windows of history
    beside them are the rows its rings held in the same lock take (so they are of one round),
    read where they lie: a ring never writes a row again, so a later round's rows never show
    through, and a reader copies only what it cuts (memtop.engine.store.RingWindow).
    """

    generation: int
    driver: DriverReading | None
    # (times, used bytes) of each GPU the driver reported, by UUID, oldest first
    device_used: Mapping[str, tuple[Sequence[float], Sequence[float]]]
    agents: tuple[AgentView, ...]  # by pid, each device with its windows
    processes: Mapping[int, ProcessInfo]
    problems: tuple[str, ...]
    events: tuple[tuple[float, str], ...]  # newest last
    # Who each pid the driver charges is (memtop.sources.owners): the accounting sorts by it.
    owners: Mapping[int, PidFacts] = field(default_factory=dict)
    # The actions memtop performed in trainers, oldest first (Store.record_action).
    actions: tuple[ActionRecord, ...] = ()
    # Each agent device's windows by (pid, index): the store's HISTORY_COLUMNS of every row it
    # keeps, and its newest step marks (step, time, allocated).
    device_windows: Mapping[tuple[int, int], Windows] = field(default_factory=dict)
    # Each agent's host memory's windows by pid: ("time", "rss") per sample, ("step", "time",
    # "rss") per step mark; none without readings.
    host_windows: Mapping[int, Windows] = field(default_factory=dict)

    def used_window(self, uuid: str) -> tuple[Sequence[float], Sequence[float]]:
        return self.device_used.get(uuid) or (array("d"), array("d"))

    def windows(self, pid: int, index: int) -> Windows:
        """One agent device's (history, step marks); empty where none were kept."""
        return self.device_windows.get((pid, index), NO_WINDOWS)

    def host_window(self, pid: int) -> Windows:
        """One agent's host memory's (RSS per sample, RSS per step mark); empty without any."""
        return self.host_windows.get(pid, NO_WINDOWS)
