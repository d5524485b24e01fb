"""The per-device figures, in one table: what `--once --json`, the Prometheus exporter and the
fleet's Prometheus reader each call them, and how to read each from an observed agent device.
The driver's per-GPU figures are a second table, `GPU_METRICS`, at the end.

`memtop.present.report` writes a row's `json` field into each agent device of the JSON report,
`memtop.export.metrics` a family named `prometheus` with its help text (DESIGN §11), and
`memtop.sources.prometheus` reads that family back into the fleet's readings wherever `fleet`
says.  Adding a per-device figure is one row here.  The names are contracts (DESIGN §7, §11:
dashboards, alerts and scripts depend on them): a row may be added, never renamed or dropped.

A row's `read` takes one `memtop.diagnosis.DeviceDiagnosis` (an agent's device).  It is typed
`Any` here because this table sits below the sources in the import layers (the fleet's reader,
a source, reads it) and so cannot import the diagnosis; tests/test_metric_table.py reads every
row of a real observation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, Final, Literal

from memtop.base.records import record

# Where the fleet's reader puts a series it reads back (DeviceMetric.fleet):
STATS: Final = "stats"  # into the rebuilt sample's torch memory_stats(), under this key
VERDICT: Final = (
    "verdict"  # a verdict judged on the host (memtop.engine.fleet shows it, never re-judges)
)
BREAKDOWN: Final = "breakdown"  # into the rebuilt breakdown reply, under this key
DEVICE: Final = "device"  # the agent device's own figure: "free", "total" or "index"
FleetPlace = Literal["stats", "verdict", "breakdown", "device"]


@record(frozen=True)
class DeviceMetric:
    """One figure of one agent device."""

    key: str  # the table's own name for it
    json: str | None  # field of agents[].devices[] in `--once --json`; None: not in the report
    prometheus: str | None  # metric family (without a counter's `_total`); None: not exported
    help: str  # the family's help text (a contract, like the name)
    unit: str  # "bytes", "ratio", "seconds", "timestamp", "count", "steps", "bytes/step", ...
    read: Callable[[Any], Any]  # its value from a DeviceDiagnosis; None: not known
    kind: Literal["gauge", "counter"] = "gauge"
    digits: int | None = None  # the JSON report rounds it to this many decimals
    fleet: tuple[FleetPlace, str] | None = None  # where the fleet's reader puts it back

    @property
    def series(self) -> str | None:
        """The name of its samples as Prometheus stores them (a counter's carry `_total`)."""
        if self.prometheus is None:
            return None
        return self.prometheus + ("_total" if self.kind == "counter" else "")

    def json_value(self, device: Any) -> Any:
        value = self.read(device)
        if self.digits is not None and value is not None:
            return round(value, self.digits)
        return value


def _leak_judged(device: Any) -> bool:
    return bool(device.diagnosis.leak.basis != "none")


# In the order of the JSON report's fields; the exporter writes its families in this order too.
DEVICE_METRICS: tuple[DeviceMetric, ...] = (
    DeviceMetric(
        "allocated",
        "allocated_bytes",
        "memtop_allocated_bytes",
        "torch allocated_bytes.all.current.",
        "bytes",
        lambda d: d.sample.allocated,
        fleet=(STATS, "allocated_bytes.all.current"),
    ),
    DeviceMetric(
        "reserved",
        "reserved_bytes",
        "memtop_reserved_bytes",
        "torch reserved_bytes.all.current.",
        "bytes",
        lambda d: d.sample.reserved,
        fleet=(STATS, "reserved_bytes.all.current"),
    ),
    DeviceMetric(
        "peak",
        "peak_bytes",
        "memtop_peak_bytes",
        "torch allocated_bytes.all.peak: the true peak since start or reset.",
        "bytes",
        lambda d: d.peak_bytes,
        fleet=(STATS, "allocated_bytes.all.peak"),
    ),
    DeviceMetric(
        "torch_peak",
        "torch_peak_bytes",
        None,  # memtop_peak_bytes is the same figure
        "torch allocated_bytes.all.peak, by the name that says whose peak it is.",
        "bytes",
        lambda d: d.torch_peak_bytes,
    ),
    DeviceMetric(
        "sampled_peak",
        "sampled_peak_bytes",
        "memtop_sampled_peak_bytes",
        "The highest allocated bytes memtop sampled.",
        "bytes",
        lambda d: d.sampled_peak_bytes,
        fleet=(VERDICT, "sampled_peak_bytes"),
    ),
    DeviceMetric(
        "cached",
        "cached_bytes",
        "memtop_cached_bytes",
        "Reserved minus allocated: reusable by this process.",
        "bytes",
        lambda d: d.sample.cached,
    ),
    DeviceMetric(
        "inactive_split",
        "inactive_split_bytes",
        "memtop_inactive_split_bytes",
        "torch inactive_split_bytes.all.current.",
        "bytes",
        lambda d: d.sample.inactive_split,
        fleet=(STATS, "inactive_split_bytes.all.current"),
    ),
    DeviceMetric(
        "large_split",
        None,
        "memtop_large_pool_inactive_split_bytes",
        "torch inactive_split_bytes.large_pool.current.",
        "bytes",
        lambda d: d.sample.stats.get("inactive_split_bytes.large_pool.current"),
        fleet=(STATS, "inactive_split_bytes.large_pool.current"),
    ),
    DeviceMetric(
        "large_reserved",
        None,
        "memtop_large_pool_reserved_bytes",
        "torch reserved_bytes.large_pool.current.",
        "bytes",
        lambda d: d.sample.stats.get("reserved_bytes.large_pool.current"),
        fleet=(STATS, "reserved_bytes.large_pool.current"),
    ),
    DeviceMetric(
        "fragmentation",
        "fragmentation",
        "memtop_fragmentation_ratio",
        "Inactive split over reserved bytes of the large pool (latest sample).",
        "ratio",
        lambda d: d.sample.fragmentation,
        digits=4,
    ),
    DeviceMetric(
        "alloc_retries",
        "num_alloc_retries",
        "memtop_alloc_retries",
        "torch num_alloc_retries: free-the-cache-and-retry rounds.",
        "count",
        lambda d: d.sample.num_alloc_retries,
        kind="counter",
        fleet=(STATS, "num_alloc_retries"),
    ),
    DeviceMetric(
        "ooms",
        "num_ooms",
        "memtop_ooms",
        "torch num_ooms: out-of-memory errors raised.",
        "count",
        lambda d: d.sample.num_ooms,
        kind="counter",
        fleet=(STATS, "num_ooms"),
    ),
    DeviceMetric(
        "cuda_free",
        "free_bytes",
        "memtop_cuda_free_bytes",
        "The device's free bytes as the agent's mem_get_info saw them.",
        "bytes",
        lambda d: d.sample.free_bytes,
        fleet=(DEVICE, "free"),
    ),
    DeviceMetric(
        "cuda_total",
        "total_bytes",
        "memtop_cuda_total_bytes",
        "The device's bytes as the agent sees them.",
        "bytes",
        lambda d: d.sample.total_bytes,
        fleet=(DEVICE, "total"),
    ),
    DeviceMetric(
        "non_pytorch",
        "non_pytorch_bytes",
        "memtop_non_pytorch_bytes",
        "Driver-charged bytes outside PyTorch's caches (context, NCCL, ...).",
        "bytes",
        lambda d: d.non_pytorch_bytes,
    ),
    DeviceMetric(
        "fragmentation_smoothed",
        "fragmentation_smoothed",
        "memtop_fragmentation_smoothed_ratio",
        "Median of the recent fragmentation samples (what rules judge).",
        "ratio",
        lambda d: d.diagnosis.fragmentation.gauge_smoothed,
        digits=4,
        fleet=(VERDICT, "gauge_smoothed"),
    ),
    DeviceMetric(
        "fragmentation_samples",
        "fragmentation_samples",
        "memtop_fragmentation_samples",
        "How many samples the smoothed fragmentation is the median of (rules want 3).",
        "count",
        lambda d: d.diagnosis.fragmentation.samples,
        fleet=(VERDICT, "fragmentation_samples"),
    ),
    DeviceMetric(
        "external",
        "external_fragmentation",
        "memtop_external_fragmentation_ratio",
        "Stranded over reserved large-pool bytes, from the newest snapshot summary.",
        "ratio",
        lambda d: d.diagnosis.fragmentation.external,
        digits=4,
        fleet=(VERDICT, "external"),
    ),
    DeviceMetric(
        "stranded",
        "stranded_bytes",
        "memtop_stranded_bytes",
        "Free bytes inside large segments that also hold live blocks.",
        "bytes",
        lambda d: d.diagnosis.fragmentation.stranded_bytes,
        fleet=(VERDICT, "stranded_bytes"),
    ),
    DeviceMetric(
        "largest",
        "largest_cached_request_bytes",
        "memtop_largest_cached_request_bytes",
        "The largest request the cache can serve without a new cudaMalloc.",
        "bytes",
        lambda d: d.diagnosis.fragmentation.largest_free_block_bytes,
        fleet=(VERDICT, "largest_free_block_bytes"),
    ),
    DeviceMetric(
        "internal_fragmentation",
        "internal_fragmentation_bytes",
        None,
        "Allocated minus requested bytes: what rounding adds (when torch reports requested).",
        "bytes",
        lambda d: d.diagnosis.fragmentation.internal_bytes,
    ),
    DeviceMetric(
        "baseline",
        "baseline_bytes",
        "memtop_step_baseline_bytes",
        "Allocated bytes right after the newest step.",
        "bytes",
        lambda d: d.diagnosis.baseline_bytes,
        fleet=(VERDICT, "baseline_bytes"),
    ),
    DeviceMetric(
        "fp32_parameters",
        None,  # the JSON report has it in the device's `breakdown`
        "memtop_fp32_parameter_bytes",
        "Bytes of parameters held in fp32 (a bf16 copy would halve them).",
        "bytes",
        lambda d: (d.diagnosis.breakdown or {}).get("fp32_parameter_bytes"),
        fleet=(BREAKDOWN, "fp32_parameter_bytes"),
    ),
    DeviceMetric(
        "cuda_index",
        None,  # the device's `index` in the JSON report
        "memtop_cuda_device_index",
        "The trainer's own CUDA index of this GPU "
        "(CUDA_VISIBLE_DEVICES renumbers; `gpu` is the driver's number).",
        "index",
        lambda d: d.index,
        fleet=(DEVICE, "index"),
    ),
    # The leak verdict (the JSON report has it whole in the device's `leak`).
    DeviceMetric(
        "leak_step",
        None,
        "memtop_leak_bytes_per_step",
        "Trend of the per-step baseline (bytes/step).",
        "bytes/step",
        lambda d: d.diagnosis.leak.bytes_per_step,
        fleet=(VERDICT, "bytes_per_step"),
    ),
    DeviceMetric(
        "leak_second",
        None,
        "memtop_leak_bytes_per_second",
        "Trend of the baseline in bytes per second.",
        "bytes/second",
        lambda d: d.diagnosis.leak.bytes_per_second,
        fleet=(VERDICT, "bytes_per_second"),
    ),
    DeviceMetric(
        "leak_detected",
        None,
        "memtop_leak_detected",
        "1 when the trend is called a leak.",
        "boolean",
        lambda d: (1 if d.diagnosis.leak.detected else 0) if _leak_judged(d) else None,
        fleet=(VERDICT, "detected"),
    ),
    DeviceMetric(
        "leak_confidence",
        None,
        "memtop_leak_confidence_ratio",
        "Confidence of the leak verdict.",
        "ratio",
        lambda d: d.diagnosis.leak.confidence if _leak_judged(d) else None,
        fleet=(VERDICT, "confidence"),
    ),
    DeviceMetric(
        "leak_samples",
        None,
        "memtop_leak_samples",
        "Baselines or samples the verdict rests on.",
        "count",
        lambda d: d.diagnosis.leak.samples,
        fleet=(VERDICT, "samples"),
    ),
    DeviceMetric(
        "leak_since_step",
        None,
        "memtop_leak_since_step",
        "The step where the judged regime starts (per-step verdicts).",
        "steps",
        lambda d: d.diagnosis.leak.since if d.diagnosis.leak.basis == "steps" else None,
        fleet=(VERDICT, "since_step"),
    ),
    DeviceMetric(
        "leak_since_time",
        None,
        "memtop_leak_since_timestamp_seconds",
        "Unix time where the judged regime starts (verdicts over time, without steps).",
        "timestamp",
        lambda d: d.diagnosis.leak.since if d.diagnosis.leak.basis == "time" else None,
        fleet=(VERDICT, "since_time"),
    ),
    DeviceMetric(
        "time_to_full",
        None,
        "memtop_time_to_full_seconds",
        "Seconds until the device is full at the leak's rate (only while a leak is detected).",
        "seconds",
        lambda d: d.diagnosis.leak.seconds_to_full,
        fleet=(VERDICT, "seconds_to_full"),
    ),
    DeviceMetric(
        "steps_to_full",
        None,
        "memtop_steps_to_full",
        "Steps until the device is full at the leak's rate (only while a leak is detected).",
        "steps",
        lambda d: d.diagnosis.leak.steps_to_full,
        fleet=(VERDICT, "steps_to_full"),
    ),
)


def by_key(table: tuple[DeviceMetric, ...] | None = None) -> dict[str, DeviceMetric]:
    """The rows by their key (of DEVICE_METRICS unless another table is given)."""
    return _by_key(DEVICE_METRICS if table is None else table)


def by_series(table: tuple[DeviceMetric, ...] | None = None) -> dict[str, DeviceMetric]:
    """The rows the fleet reads back, by the name of their samples in Prometheus."""
    return _by_series(DEVICE_METRICS if table is None else table)


@cache
def _by_key(table: tuple[DeviceMetric, ...]) -> dict[str, DeviceMetric]:
    return {row.key: row for row in table}


@cache
def _by_series(table: tuple[DeviceMetric, ...]) -> dict[str, DeviceMetric]:
    return {row.series: row for row in table if row.series is not None and row.fleet}


# The driver's per-GPU figures (NVML, amdsmi, the demo's simulated GPUs, or the agents' account
# where no driver answers): one row each.  `memtop.present.report` writes a row's `json` field into
# each
# entry of the JSON report's `devices`, `memtop.export.metrics` its family (labelled by GPU,
# as dcgm-exporter's), and `memtop.sources.prometheus` reads that family back into the same
# field of a remote host's `DeviceReading`.  Adding a driver figure the sources already read is
# one row here; the names are contracts like the agent devices' above.


@record(frozen=True)
class GpuMetric:
    """One figure the driver reports for one GPU."""

    field: str  # the memtop.model.DeviceReading field it is (and the fleet's reader refills)
    json: str | None  # field of devices[] in `--once --json`; None: not in the report
    prometheus: str | None  # gauge family; None: not exported
    help: str  # the family's help text (a contract, like the name)
    unit: str  # "bytes", "percent", "celsius", "watts"
    # A sample's value back into the reading's type, for the fleet's reader (bytes are ints).
    parse: Callable[[float], Any] = int

    def read(self, reading: Any) -> Any:
        """Its value from a memtop.model.DeviceReading; None: not read."""
        return getattr(reading, self.field)


# In the order of the JSON report's fields; the exporter writes its families in this order too.
GPU_METRICS: tuple[GpuMetric, ...] = (
    GpuMetric(
        "total_bytes",
        "total_bytes",
        "memtop_gpu_memory_total_bytes",
        "Device memory in all.",
        "bytes",
    ),
    GpuMetric(
        "used_bytes",
        "used_bytes",
        "memtop_gpu_memory_used_bytes",
        "Device memory in use (NVML, or the agents' mem_get_info).",
        "bytes",
    ),
    GpuMetric(
        "free_bytes",
        "free_bytes",
        "memtop_gpu_memory_free_bytes",
        "Device memory free.",
        "bytes",
    ),
    GpuMetric(
        "utilization_percent",
        "utilization_percent",
        None,
        "The share of the last sample period a kernel ran (NVML's GPU utilisation).",
        "percent",
    ),
    GpuMetric(
        "temperature_c",
        "temperature_c",
        None,
        "The GPU's temperature in degrees Celsius.",
        "celsius",
    ),
    GpuMetric(
        "power_watts",
        "power_watts",
        "memtop_gpu_power_watts",
        "The board's power draw in watts (NVML power usage, amdsmi socket power).",
        "watts",
        parse=float,
    ),
)
