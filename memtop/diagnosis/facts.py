"""What the diagnosis knows about each agent device and each GPU: the input of the rules.

`DeviceDiagnosis` is the one record of an agent's device above the store: the diagnoser makes it
once from the round's view, where the observation's join says it is (the driver's UUID and
number of its GPU, what the driver charges), with the windows the screens draw, and the rules,
the screens, the report and the exporter read that same record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Any

from memtop.base import alloc_conf
from memtop.base.records import record
from memtop.diagnosis.fragmentation import Fragmentation, Pressure
from memtop.diagnosis.leak import LeakEstimate
from memtop.diagnosis.sites import SiteTrend
from memtop.diagnosis.workload import Workload, WorkloadKind
from memtop.model import (
    MARK_WINDOW,
    NO_WINDOWS,
    Accounting,
    AgentDeviceSample,
    AgentView,
    DeviceReading,
    GpuProcess,
    MigInfo,
    Windows,
)

# The history windows the screens draw (the store keeps an hour).
HISTORY_ROWS = 900  # sampled rows: 15 minutes at the default 1 s interval
MARK_ROWS = MARK_WINDOW  # per-step baselines


class ReadsSample:
    """The byte figures of one agent device's latest sample, read through the `sample` a class
    holds by reference: the diagnosis and the observation share these instead of copying the
    bytes into fields of their own."""

    __slots__ = ()
    sample: AgentDeviceSample

    @property
    def allocated_bytes(self) -> int:
        return self.sample.allocated

    @property
    def reserved_bytes(self) -> int:
        return self.sample.reserved

    @property
    def cached_bytes(self) -> int:
        return self.sample.cached

    @property
    def peak_bytes(self) -> int:
        """torch's allocated_bytes.all.peak: the true peak (since start or `r`)."""
        return self.sample.torch_peak

    @property
    def free_bytes(self) -> int:
        """The device's free bytes as the agent's mem_get_info saw them."""
        return self.sample.free_bytes

    @property
    def total_bytes(self) -> int:
        return self.sample.total_bytes


@record(frozen=True, slots=True)
class DeviceHistory:
    """The newest sampled rows and step marks of one agent device, oldest first.

    Each column is a sequence of floats that nobody changes: slices of the round's windows
    (`array('d')`, store.RingWindow), which cost a memcpy rather than a float object per row; most
    rounds nobody reads them (the detail screen and the trend, once in a while)."""

    time: Sequence[float] = ()
    allocated: Sequence[float] = ()
    reserved: Sequence[float] = ()
    torch_peak: Sequence[float] = ()
    num_ooms: Sequence[float] = ()  # torch's OOM counter: a rise is an OOM (the GPU's chart)
    mark_step: Sequence[float] = ()
    mark_time: Sequence[float] = ()
    mark_allocated: Sequence[float] = ()


def device_history(
    rows: Mapping[str, Sequence[float]], marks: Mapping[str, Sequence[float]]
) -> DeviceHistory:
    """The windows the screens draw: the newest HISTORY_ROWS sampled rows and MARK_ROWS step
    marks of the round's view (slices of its arrays: a memcpy, no float object per row)."""
    return DeviceHistory(
        time=rows.get("time", ())[-HISTORY_ROWS:],
        allocated=rows.get("allocated", ())[-HISTORY_ROWS:],
        reserved=rows.get("reserved", ())[-HISTORY_ROWS:],
        torch_peak=rows.get("torch_peak", ())[-HISTORY_ROWS:],
        num_ooms=rows.get("num_ooms", ())[-HISTORY_ROWS:],
        mark_step=marks.get("step", ())[-MARK_ROWS:],
        mark_time=marks.get("time", ())[-MARK_ROWS:],
        mark_allocated=marks.get("allocated", ())[-MARK_ROWS:],
    )


@record(frozen=True, slots=True)
class DeviceDiagnosis(ReadsSample):
    """One CUDA device of one agent, as everything above the store sees it: where it is (the
    GPU as the driver names and numbers it, what the driver charges the process there), the
    judgements behind every rule (leak, fragmentation, pressure, baseline), and the windows the
    screens draw, beside the sample they were judged on, held by reference: its bytes are read
    through it (ReadsSample), never copied.  The diagnoser makes it once (`Diagnoser._device`),
    placed where the observation's join says (`observation._placement`)."""

    pid: int
    index: int  # the agent's own cuda index (actions and the detail screen use it)
    # The GPU as the driver names it once placed (the agent's own UUID until then, and where
    # the driver lists no such GPU).
    uuid: str
    sample: AgentDeviceSample  # the round's latest sample of this device
    baseline_bytes: int | None  # allocated right after the newest step
    leak: LeakEstimate
    fragmentation: Fragmentation
    pressure: Pressure
    breakdown: dict[str, int] | None
    # Its process: who it is (hello, allocator settings in force, newest OOM), the agent's own
    # record in the round's view, read through (allocator_conf, hip, last_oom), never copied
    # onto each of its devices.  None: a device judged without one (the tests' own).
    process: AgentView | None = field(default=None, compare=False, repr=False)
    # Without a report of its newest OOM (a recording, an agent that wrote none): the
    # growing-batch finding of memtop.oom.diagnose from the step marks and the OOM counter.
    oom_growth: dict[str, Any] | None = None
    # Whether the agent has measured a breakdown at all: `breakdown` is None both before the
    # first measurement and when it found no optimizer holding this device's parameters.
    breakdown_measured: bool = False
    # The step after which the breakdown was measured, and when (unix time: its age is the
    # reader's to say, so that this value does not change every round).
    breakdown_step: int | None = None
    breakdown_time: float | None = None
    # Its job's other ranks in view (memtop.diagnosis.ranks): its rank and the job's label (its
    # agent's own, AgentView.rank / .job, set here only where a peer is in view), how many
    # other ranks, and the median of their peaks.
    rank: int | None = None
    job: str | None = None
    peer_ranks: int = 0
    peers_median_peak_bytes: int | None = None
    # Live memory by the user's line (stack recording on), largest first; the leak's marked.
    sites: tuple[SiteTrend, ...] = ()
    # What the process is (memtop.diagnosis.workload): a trainer, a server with the share it
    # asked for, a PyTorch process with no steps.  None: not judged (taken for a trainer).
    workload: Workload | None = None
    # Where it is (the observation's join) and what the screens draw.
    name: str = ""
    gpu: int = -1  # the GPU as the driver numbers it (the agent's index without a driver view)
    sampled_peak_bytes: int = 0  # memtop's own maximum of what it sampled (misses step peaks)
    nvml_used_bytes: int | None = None  # what the driver charges this process on this GPU
    # The round's windows of this device (its sampled rows and step marks: the view's arrays,
    # which nobody changes).  `history`, the newest of them that the screens draw, is cut from
    # them when first read: most rounds only one device per GPU card's trend reads it, and
    # cutting eight columns for every device every round was a tenth of the diagnosis's own
    # work in the `mixed` demo.
    windows: Windows = field(default=NO_WINDOWS, compare=False, repr=False)
    # `history` once read (a list: the record is frozen); two threads reading it at once both
    # cut the same windows.
    _history: list[DeviceHistory] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @property
    def history(self) -> DeviceHistory:
        """The windows the screens draw: the newest HISTORY_ROWS sampled rows and MARK_ROWS
        step marks of the round."""
        if not self._history:
            self._history.append(device_history(*self.windows))
        return self._history[0]

    def newest(self, column: str, last: int, marks: bool = False) -> Sequence[float]:
        """The newest `last` values of one column of the round's windows (of the step marks,
        with `marks`), oldest first, without cutting the whole `history`: a GPU card's trend
        reads one column of one device every round."""
        rows, step_marks = self.windows
        return (step_marks if marks else rows).get(column, ())[-last:]

    @property
    def allocator_conf(self) -> str:
        """The allocator options its process runs with: in force (`memtop tune` changes them),
        else its environment's."""
        return self.process.settings_in_force if self.process is not None else ""

    @property
    def hip(self) -> str | None:
        """torch.version.hip of its process: a ROCm build (AMD GPUs), whose fixes are spelt for
        ROCm; None on CUDA, or from an agent that does not say."""
        return self.process.hip if self.process is not None else None

    @property
    def last_oom(self) -> dict[str, Any] | None:
        """The newest OOM report of its process when it was on this device (its headline and
        diagnosis, as the agent's sample carries it), None without one."""
        oom = self.process.last_oom if self.process is not None else None
        return dict(oom) if oom is not None and oom.get("device") == self.index else None

    @property
    def diagnosis(self) -> DeviceDiagnosis:
        """Itself: the device and its diagnosis are one record (call sites read
        `device.diagnosis.leak` as they did when they were two)."""
        return self

    @property
    def torch_peak_bytes(self) -> int:
        return self.sample.torch_peak

    @property
    def non_pytorch_bytes(self) -> int | None:
        """Driver-charged bytes outside PyTorch's caches (CUDA context, NCCL, workspaces)."""
        if self.nvml_used_bytes is None:
            return None
        return max(0, self.nvml_used_bytes - self.sample.reserved)

    @property
    def trains(self) -> bool:
        """Whether the rules for a training loop apply (8-bit optimizer, checkpointing, a
        bigger batch): not to a server, nor to a process that has never stepped."""
        return self.workload is None or self.workload.kind == WorkloadKind.TRAINER

    @property
    def transient_bytes(self) -> int | None:
        """What one step adds on top of its baseline at its peak (activations, temporaries)."""
        if self.baseline_bytes is None:
            return None
        return max(0, self.peak_bytes - self.baseline_bytes)

    @property
    def releasable_bytes(self) -> int:
        """What empty_cache() could hand back: cached bytes not stuck in split segments."""
        return max(0, self.cached_bytes - self.fragmentation.inactive_split_bytes)


@record(frozen=True, slots=True)
class HostDiagnosis:
    """A process's own host memory (a CPU trainer's only memory): its resident set now, and the
    leak verdict on its RSS right after each step (the host's per-step baseline), or over time
    without steps."""

    pid: int
    rss_bytes: int | None
    peak_rss_bytes: int | None
    total_bytes: int | None  # the machine's memory
    leak: LeakEstimate


@record(frozen=True, slots=True)
class GpuObservation:
    """One physical GPU: the driver's reading of it (or, without one, the agents' account,
    as a reading of source "agent"), the processes the driver lists on it, and the devices of
    live agents on it.  The reading's figures are read through it (the properties below).
    It is also what the suggestion rules judge (`suggestions.Rule`): one record of a GPU from
    the join to the rules and the screens."""

    reading: DeviceReading
    processes: tuple[GpuProcess, ...]  # as the driver lists them (agents' pids without one)
    agents: tuple[DeviceDiagnosis, ...]  # the live agents' devices on it
    used_history: tuple[Sequence[float], Sequence[float]] = ((), ())  # times, used bytes
    # Who holds the used bytes (`accounting`, DESIGN §13), worked out when first read: only the
    # GPU screen, the JSON and the exporter read it, and a dashboard built it for every GPU
    # every second (~7 % of the observation's build).  None: the used bytes are not known.
    accounted: Callable[[], Accounting | None] | None = field(
        default=None, repr=False, compare=False
    )
    # What each process without an agent is, where its command line or environment says
    # (memtop.diagnosis.workload), by pid: a vLLM without an agent still asked for its share.
    workloads: Mapping[int, Workload] = field(default_factory=dict)
    # `accounted`'s answer once asked (a list: the record is frozen); two threads asking at
    # once both work out the same answer from the same round.
    _accounting: list[Accounting | None] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @property
    def accounting(self) -> Accounting | None:
        """Who holds the used bytes; None: the used bytes are not known."""
        if self.accounted is None:
            return None
        if not self._accounting:
            self._accounting.append(self.accounted())
        return self._accounting[0]

    @property
    def index(self) -> int:
        return self.reading.index

    @property
    def uuid(self) -> str:
        return self.reading.uuid

    @property
    def name(self) -> str:
        return self.reading.name

    @property
    def total_bytes(self) -> int | None:
        return self.reading.total_bytes

    @property
    def used_bytes(self) -> int | None:
        return self.reading.used_bytes

    @property
    def free_bytes(self) -> int | None:
        return self.reading.free_bytes

    @property
    def utilization_percent(self) -> int | None:
        return self.reading.utilization_percent

    @property
    def temperature_c(self) -> int | None:
        return self.reading.temperature_c

    @property
    def source(self) -> str:
        return self.reading.source

    @property
    def error(self) -> str | None:
        return self.reading.error

    @property
    def power_watts(self) -> float | None:
        return self.reading.power_watts

    @property
    def pci_bus_id(self) -> str | None:
        """ "dddd:bb:dd.f" where the driver (or the agent) says."""
        return self.reading.pci_bus_id

    @property
    def vendor(self) -> str | None:
        """ "amd" for AMD's GPUs (DeviceReading.vendor)."""
        return self.reading.vendor

    @property
    def host(self) -> str | None:
        """The machine it is in, when not this one (the fleet view)."""
        return self.reading.host

    @property
    def mig(self) -> MigInfo | None:
        """Where a MIG instance sits (None: a whole GPU)."""
        return self.reading.mig

    @property
    def label(self) -> str:
        """ "GPU 0", or "GPU 0 · MIG 3g.40gb #1" for a MIG instance."""
        if self.mig is not None:
            return f"GPU {self.index} · {self.mig.label()}"
        return f"GPU {self.index}"

    @property
    def peak_sum_bytes(self) -> int:
        """The sum of the true peaks of the PyTorch processes on it (they need not coincide)."""
        return sum(a.peak_bytes for a in self.agents)

    @property
    def judged_total_bytes(self) -> int:
        """What the rules judge a share against: the driver's total, else its agents' own
        (torch's mem_get_info), else 0."""
        if self.total_bytes:
            return self.total_bytes
        return self.agents[0].total_bytes if self.agents else 0

    @property
    def used_share(self) -> float | None:
        total = self.judged_total_bytes
        if self.used_bytes is None or not total:
            return None
        return self.used_bytes / total

    @property
    def process_count(self) -> int:
        return len({p.pid for p in self.processes} | {a.pid for a in self.agents})


# The trainer's allocator options, read as torch reads them (memtop.base.alloc_conf: the one reader
# of them, which the simulator and the OOM diagnosis use too).
def parse_allocator_conf(conf: str) -> dict[str, str]:
    """`PYTORCH_CUDA_ALLOC_CONF` ("key:value,key:value") as a dict, in the order given."""
    return alloc_conf.options(conf)


def has_expandable_segments(conf: str) -> bool:
    return alloc_conf.parse(conf).expandable_segments


def uses_async_backend(conf: str) -> bool:
    """cudaMallocAsync replaces the caching allocator: its segment options do not apply."""
    return alloc_conf.parse(conf).async_backend


def as_json(value: Any) -> Any:
    return value.as_dict() if hasattr(value, "as_dict") else value
