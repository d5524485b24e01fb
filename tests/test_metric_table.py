"""The per-device figures are contracts (DESIGN §7 and §11): the `--once --json` fields of each
agent device, and the Prometheus families with their type, help text and labels.  These pins
were taken from the hand-written lists before `memtop.metric_table` replaced them: a name, a
help text or a label that changes here breaks a user's script, dashboard or alert."""

from __future__ import annotations

from helpers.observations import frozen_observation
from prometheus_client.parser import text_string_to_metric_families

from memtop import metric_table, report
from memtop.export.metrics import render
from memtop.export.text import exposition
from memtop.metric_table import DeviceMetric
from memtop.sources.prometheus import hosts_of

# agents[].devices[] of `memtop --once --json`.
DEVICE_JSON_FIELDS = {
    "breakdown_step",  # the step after which the breakdown was measured
    "breakdown_age_s",  # and how long before the report
    "workload",  # what the process is and what it reserved on purpose (a server's share)
    "index",
    "uuid",
    "name",
    "gpu",
    "allocated_bytes",
    "reserved_bytes",
    "peak_bytes",
    "torch_peak_bytes",
    "sampled_peak_bytes",
    "cached_bytes",
    "inactive_split_bytes",
    "fragmentation",
    "num_alloc_retries",
    "num_ooms",
    "step",
    "free_bytes",
    "total_bytes",
    "non_pytorch_bytes",
    "leak",
    "fragmentation_smoothed",
    "fragmentation_samples",
    "external_fragmentation",
    "stranded_bytes",
    "largest_cached_request_bytes",
    "internal_fragmentation_bytes",
    "pressure",
    "baseline_bytes",
    "breakdown",
}

GPU = ("hostname", "UUID", "gpu", "modelName")
AGENT = ("hostname", "pid", "rank", "job", "hpc_job", "pod", "namespace", "container")
PROCESS = (*GPU, "pid", "rank", "job", "hpc_job", "pod", "namespace", "container")
INFO = (
    *AGENT,
    "state",
    "command",
    "python",
    "torch",
    "allocator_conf",
    "rendezvous",
    "world_size",
)

# exposition name -> (type, help, label names) of every family.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "memtop_observation_time_seconds": ("gauge", "Unix time of the observation.", ("hostname",)),
    "memtop_gpu_info": (
        "gauge",
        "One per GPU in view: where its numbers come from.",
        (*GPU, "source"),
    ),
    "memtop_gpu_memory_used_bytes": (
        "gauge",
        "Device memory in use (NVML, or the agents' mem_get_info).",
        GPU,
    ),
    "memtop_gpu_memory_total_bytes": ("gauge", "Device memory in all.", GPU),
    "memtop_gpu_memory_accounted_bytes": (
        "gauge",
        "A GPU's used memory by who holds it (the parts sum to memtop_gpu_memory_used_bytes): "
        "agents_reserved, agents_outside_pytorch, no_agent, other_namespace, other_users, gone, "
        "mig_instances, overcounted, unattributed.",
        (*GPU, "part"),
    ),
    "memtop_gpu_memory_free_bytes": ("gauge", "Device memory free.", GPU),
    "memtop_gpu_process_used_bytes": (
        "gauge",
        "Device memory the driver charges one process (NVML per-process used).",
        (*GPU, "pid"),
    ),
    "memtop_process_workload_info": (
        "gauge",
        "One per process on a GPU whose kind is known: trainer, server (engine), preallocator.",
        (*GPU, "pid", "kind", "engine"),
    ),
    "memtop_process_budget_share": (
        "gauge",
        "The share of the GPU a server or preallocator takes on purpose (0-1), and the "
        "setting that sets it (vLLM's --gpu-memory-utilization, …).",
        (*GPU, "pid", "engine", "setting"),
    ),
    "memtop_agent_info": (
        "gauge",
        "One per memtop agent in view (any state), with its command line and versions.",
        INFO,
    ),
    "memtop_steps_total": ("counter", "Training steps the agent counted.", AGENT),
    "memtop_allocated_bytes": ("gauge", "torch allocated_bytes.all.current.", PROCESS),
    "memtop_reserved_bytes": ("gauge", "torch reserved_bytes.all.current.", PROCESS),
    "memtop_peak_bytes": (
        "gauge",
        "torch allocated_bytes.all.peak: the true peak since start or reset.",
        PROCESS,
    ),
    "memtop_sampled_peak_bytes": (
        "gauge",
        "The highest allocated bytes memtop sampled.",
        PROCESS,
    ),
    "memtop_cached_bytes": (
        "gauge",
        "Reserved minus allocated: reusable by this process.",
        PROCESS,
    ),
    "memtop_inactive_split_bytes": ("gauge", "torch inactive_split_bytes.all.current.", PROCESS),
    "memtop_large_pool_inactive_split_bytes": (
        "gauge",
        "torch inactive_split_bytes.large_pool.current.",
        PROCESS,
    ),
    "memtop_large_pool_reserved_bytes": (
        "gauge",
        "torch reserved_bytes.large_pool.current.",
        PROCESS,
    ),
    "memtop_fragmentation_ratio": (
        "gauge",
        "Inactive split over reserved bytes of the large pool (latest sample).",
        PROCESS,
    ),
    "memtop_fragmentation_smoothed_ratio": (
        "gauge",
        "Median of the recent fragmentation samples (what rules judge).",
        PROCESS,
    ),
    "memtop_fragmentation_samples": (
        "gauge",
        "How many samples the smoothed fragmentation is the median of (rules want 3).",
        PROCESS,
    ),
    "memtop_external_fragmentation_ratio": (
        "gauge",
        "Stranded over reserved large-pool bytes, from the newest snapshot summary.",
        PROCESS,
    ),
    "memtop_stranded_bytes": (
        "gauge",
        "Free bytes inside large segments that also hold live blocks.",
        PROCESS,
    ),
    "memtop_largest_cached_request_bytes": (
        "gauge",
        "The largest request the cache can serve without a new cudaMalloc.",
        PROCESS,
    ),
    "memtop_non_pytorch_bytes": (
        "gauge",
        "Driver-charged bytes outside PyTorch's caches (context, NCCL, ...).",
        PROCESS,
    ),
    "memtop_cuda_free_bytes": (
        "gauge",
        "The device's free bytes as the agent's mem_get_info saw them.",
        PROCESS,
    ),
    "memtop_cuda_total_bytes": ("gauge", "The device's bytes as the agent sees them.", PROCESS),
    "memtop_fp32_parameter_bytes": (
        "gauge",
        "Bytes of parameters held in fp32 (a bf16 copy would halve them).",
        PROCESS,
    ),
    "memtop_cuda_device_index": (
        "gauge",
        "The trainer's own CUDA index of this GPU "
        "(CUDA_VISIBLE_DEVICES renumbers; `gpu` is the driver's number).",
        PROCESS,
    ),
    "memtop_step_baseline_bytes": (
        "gauge",
        "Allocated bytes right after the newest step.",
        PROCESS,
    ),
    "memtop_leak_bytes_per_step": (
        "gauge",
        "Trend of the per-step baseline (bytes/step).",
        PROCESS,
    ),
    "memtop_leak_bytes_per_second": (
        "gauge",
        "Trend of the baseline in bytes per second.",
        PROCESS,
    ),
    "memtop_leak_detected": ("gauge", "1 when the trend is called a leak.", PROCESS),
    "memtop_leak_confidence_ratio": ("gauge", "Confidence of the leak verdict.", PROCESS),
    "memtop_leak_samples": ("gauge", "Baselines or samples the verdict rests on.", PROCESS),
    "memtop_leak_since_step": (
        "gauge",
        "The step where the judged regime starts (per-step verdicts).",
        PROCESS,
    ),
    "memtop_leak_since_timestamp_seconds": (
        "gauge",
        "Unix time where the judged regime starts (verdicts over time, without steps).",
        PROCESS,
    ),
    "memtop_time_to_full_seconds": (
        "gauge",
        "Seconds until the device is full at the leak's rate (only while a leak is detected).",
        PROCESS,
    ),
    "memtop_steps_to_full": (
        "gauge",
        "Steps until the device is full at the leak's rate (only while a leak is detected).",
        PROCESS,
    ),
    "memtop_breakdown_bytes": (
        "gauge",
        "Allocated bytes by role: parameters, gradients, optimizer state, other (activations).",
        (*PROCESS, "part"),
    ),
    "memtop_site_bytes": (
        "gauge",
        "Live bytes allocated at a line of user code (file:line), the top 5 per device; "
        "only while stacks are recorded.",
        (*PROCESS, "site"),
    ),
    "memtop_leak_site_bytes_per_step": (
        "gauge",
        "How fast the live bytes of the leak's line of user code (file:line) grow per step; "
        "only while a leak is detected and stacks name its line.",
        (*PROCESS, "site"),
    ),
    "memtop_alloc_retries_total": (
        "counter",
        "torch num_alloc_retries: free-the-cache-and-retry rounds.",
        PROCESS,
    ),
    "memtop_ooms_total": ("counter", "torch num_ooms: out-of-memory errors raised.", PROCESS),
    "memtop_suggestions": (
        "gauge",
        "Suggestions standing now, by severity and rule.",
        ("hostname", "severity", "rule"),
    ),
}


def _exposed(text: str) -> dict[str, dict[str, str]]:
    """name -> {"HELP": ..., "TYPE": ...} from the exposition's comment lines."""
    found: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if line.startswith("# "):
            _, kind, name, rest = line.split(" ", 3)
            found.setdefault(name, {})[kind] = rest
    return found


def test_the_json_fields_of_an_agent_device_are_the_contracted_ones():
    built = report.build(frozen_observation())
    devices = [dev for agent in built["agents"] for dev in agent["devices"]]
    assert devices
    for dev in devices:
        assert set(dev) == DEVICE_JSON_FIELDS


def test_every_family_keeps_its_name_type_help_and_labels():
    families = render(frozen_observation())
    exposed = _exposed(exposition(families).decode())
    assert {name: (d["TYPE"], d["HELP"]) for name, d in exposed.items()} == {
        name: (kind, help_text) for name, (kind, help_text, _) in FAMILIES.items()
    }
    # Labels as the families declare them (a family without samples here still has them).
    labels = {
        family.name + ("_total" if family.type == "counter" else ""): tuple(family._labelnames)
        for family in families
    }
    assert labels == {name: names for name, (_, _, names) in FAMILIES.items()}


# ------------------------------------------------------------------ the table is the one home


def _as_prometheus_stores_it(text: str) -> list[tuple[dict[str, str], float]]:
    """An exposition's samples as an instant query returns them (empty labels dropped)."""
    return [
        ({**{k: v for k, v in s.labels.items() if v != ""}, "__name__": s.name}, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def test_a_figure_added_to_the_table_reaches_the_report_the_exporter_and_the_fleet(monkeypatch):
    widgets = DeviceMetric(
        "widgets",
        "widget_bytes",
        "memtop_widget_bytes",
        "Bytes of widgets (a figure made up for this test).",
        "bytes",
        lambda d: 4096 + d.index,
        fleet=(metric_table.VERDICT, "widget_bytes"),
    )
    counted = DeviceMetric(
        "gadgets",
        "num_gadgets",
        "memtop_gadgets",
        "Gadgets made (a counter made up for this test).",
        "count",
        lambda d: 7,
        kind="counter",
        fleet=(metric_table.STATS, "num_gadgets"),
    )
    monkeypatch.setattr(
        metric_table, "DEVICE_METRICS", (*metric_table.DEVICE_METRICS, widgets, counted)
    )
    observation = frozen_observation()
    devices = [(a.pid, d.index) for a in observation.agents for d in a.devices]

    built = report.build(observation)
    for agent in built["agents"]:
        for dev in agent["devices"]:
            assert dev["widget_bytes"] == 4096 + dev["index"]
            assert dev["num_gadgets"] == 7

    text = exposition(render(observation)).decode()
    exposed = _exposed(text)
    assert exposed["memtop_widget_bytes"] == {
        "HELP": "Bytes of widgets (a figure made up for this test).",
        "TYPE": "gauge",
    }
    assert exposed["memtop_gadgets_total"]["TYPE"] == "counter"

    (host,) = hosts_of(_as_prometheus_stores_it(text))
    for pid, index in devices:
        assert host.verdicts[(pid, index)]["widget_bytes"] == 4096 + index
    for poll in host.polls:
        assert poll.sample is not None
        for dev in poll.sample.devices:
            assert dev.stats["num_gadgets"] == 7


def test_every_row_reads_a_real_device_and_follows_the_naming_conventions():
    observation = frozen_observation()
    dev = observation.agents[0].devices[0]
    keys, jsons, names = set(), set(), set()
    for row in metric_table.DEVICE_METRICS:
        row.read(dev)  # every getter names attributes the observation has
        assert row.key not in keys and row.json not in jsons and row.prometheus not in names
        keys.add(row.key)
        if row.json is not None:
            jsons.add(row.json)
        if row.prometheus is None:
            continue
        names.add(row.prometheus)
        assert row.prometheus.startswith("memtop_") and not row.prometheus.endswith("_total")
        suffix = {"bytes": "_bytes", "ratio": "_ratio", "seconds": "_seconds"}.get(row.unit)
        if suffix is not None:
            assert row.prometheus.endswith(suffix), row
        if row.unit == "timestamp":
            assert row.prometheus.endswith("_timestamp_seconds"), row
    # The fleet reads back what it rebuilds its readings from: torch's stats, the device's
    # own figures and the host's verdicts.
    fleet = {row.fleet for row in metric_table.DEVICE_METRICS if row.fleet}
    assert (metric_table.DEVICE, "index") in fleet
    assert (metric_table.STATS, "allocated_bytes.all.current") in fleet
