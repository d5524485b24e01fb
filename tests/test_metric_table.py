"""The per-device figures are contracts (DESIGN §7 and §11): the `--once --json` fields of each
agent device, and the Prometheus families with their type, help text and labels.  These pins
were taken from the hand-written lists before `memtop.figures.metric_table` replaced them: a name, a
help text or a label that changes here breaks a user's script, dashboard or alert.  The driver's
per-GPU figures (`metric_table.GPU_METRICS`: the `devices[]` of the report, the `memtop_gpu_*`
families) are pinned the same way."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.observations import frozen_observation
from nvml_standin import Gpu, State, build, env
from prometheus_client.parser import text_string_to_metric_families

from memtop.export.metrics import render
from memtop.export.text import exposition
from memtop.figures import metric_table
from memtop.figures.metric_table import DeviceMetric, GpuMetric
from memtop.present import report
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

# devices[] of `memtop --once --json`: one GPU each.
GPU_JSON_FIELDS = {
    "index",
    "uuid",
    "name",
    "total_bytes",
    "used_bytes",
    "free_bytes",
    "utilization_percent",
    "temperature_c",
    "power_watts",
    "source",
    "error",
    "pci_bus_id",
    "processes",
    "peak_sum_bytes",
    "mig",
    "mig_mode",
    "accounting",
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
    "memtop_gpu_power_watts": (
        "gauge",
        "The board's power draw in watts (NVML power usage, amdsmi socket power).",
        GPU,
    ),
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
    # Every action performed in a trainer, whoever asked (issue 34): bounded labels.
    "memtop_process_actions_total": (
        "counter",
        "Actions performed in the trainer (cleanup, tune, reset_peak, snapshot, sites), by "
        "anyone, by result (ok, refused), each counted once as this memtop learnt of it.",
        (*AGENT, "action", "result"),
    ),
    "memtop_process_last_action_time_seconds": (
        "gauge",
        "Unix time of the newest action of each kind that ran in the trainer.",
        (*AGENT, "action"),
    ),
    "memtop_process_last_action_reserved_bytes": (
        "gauge",
        "The newest action of each kind: median reserved bytes the minute before and after it.",
        (*PROCESS, "action", "window"),
    ),
    "memtop_process_last_action_split_bytes": (
        "gauge",
        "The newest action of each kind: median free bytes inside split segments (stranded) "
        "the minute before and after it.",
        (*PROCESS, "action", "window"),
    ),
    "memtop_process_last_action_alloc_retries_per_second": (
        "gauge",
        "The newest action of each kind: the allocator's retries per second the minute before "
        "and after it.",
        (*PROCESS, "action", "window"),
    ),
    "memtop_process_last_action_step_seconds": (
        "gauge",
        "The newest action of each kind: the median step time the minute before and after it.",
        (*PROCESS, "action", "window"),
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


def test_the_json_fields_of_a_gpu_are_the_contracted_ones():
    built = report.build(frozen_observation())
    assert built["devices"]
    for gpu in built["devices"]:
        assert set(gpu) == GPU_JSON_FIELDS


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
    dev = observation.devices_of(observation.agents[0])[0]
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


# ------------------------------------------------------------------ the driver's figures: one table

ROOT = Path(__file__).resolve().parent.parent

# In a child (pynvml binds its library once per process): one observation of the stand-in
# driver, its GPU's power as observed and the exposition of it.
EXPOSE = """
import json, sys
from memtop.cli import _make_sampler, build_parser
from memtop.export.metrics import render
from memtop.export.text import exposition
from memtop.engine.observation import Observer
sampler = _make_sampler(build_parser().parse_args(["--socket-dir", sys.argv[1]]))
sampler.sample_once()
observation = Observer(sampler.store).latest()
print(json.dumps([gpu.power_watts for gpu in observation.gpus]))
sys.stdout.write(exposition(render(observation)).decode())
sampler.stop()
"""


def test_the_power_draw_reaches_the_json_report_and_the_exporter(tmp_path: Path) -> None:
    """The board's draw, on screen since the GPU panel had it, is in `--once --json`,
    `memtop export` and the fleet's readings too: read by the real nvidia-ml-py from the
    stand-in driver, whose nvmlDeviceGetPowerUsage says 100 W + 5 W per percent of
    utilisation."""
    state = State(gpus=[Gpu(util=50), Gpu(util=10)]).write(tmp_path / "state")
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    child_env = env(build(tmp_path / "lib"), state)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), *sys.path) if p)

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, *args], env=child_env, capture_output=True, text=True, timeout=90
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    report_ = json.loads(run("-m", "memtop", "--socket-dir", str(sockets), "--once", "--json"))
    assert report_["nvml"]["source"] == "nvml", report_["nvml"]
    assert [gpu["power_watts"] for gpu in report_["devices"]] == [350.0, 150.0]

    observed_line, text = run("-c", EXPOSE, str(sockets)).split("\n", 1)
    observed = json.loads(observed_line)
    assert observed == [350.0, 150.0]  # what the screen shows
    exposed = _exposed(text)
    assert exposed["memtop_gpu_power_watts"]["TYPE"] == "gauge"
    power = {
        s.labels["gpu"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "memtop_gpu_power_watts"
    }
    assert power == {"0": observed[0], "1": observed[1]}
    # And the fleet's reader gives it back to the host's readings (the fleet's GPU cards).
    (host,) = hosts_of(_as_prometheus_stores_it(text))
    assert [d.power_watts for d in host.driver.devices] == observed


def test_a_gpu_figure_added_to_the_table_reaches_the_report_the_exporter_and_the_fleet(
    monkeypatch,
):
    """A driver figure the sources read (here the memory controller's busy share, which no
    output had) is one GpuMetric row: the JSON report, the exporter and the fleet's reader
    follow from it."""
    row = GpuMetric(
        "memory_utilization_percent",
        "memory_busy_percent",
        "memtop_gpu_memory_busy_percent",
        "The memory controller's busy share (a family made up for this test).",
        "percent",
    )
    monkeypatch.setattr(metric_table, "GPU_METRICS", (*metric_table.GPU_METRICS, row))
    observation = frozen_observation()
    busy = {gpu.uuid: 30 + gpu.index for gpu in observation.gpus}
    observation = dataclasses.replace(
        observation,
        gpus=tuple(
            dataclasses.replace(
                gpu,
                reading=dataclasses.replace(gpu.reading, memory_utilization_percent=busy[gpu.uuid]),
            )
            for gpu in observation.gpus
        ),
    )

    built = report.build(observation)
    assert {gpu["uuid"]: gpu["memory_busy_percent"] for gpu in built["devices"]} == busy

    text = exposition(render(observation)).decode()
    assert _exposed(text)["memtop_gpu_memory_busy_percent"] == {
        "HELP": "The memory controller's busy share (a family made up for this test).",
        "TYPE": "gauge",
    }
    (host,) = hosts_of(_as_prometheus_stores_it(text))
    assert {d.uuid: d.memory_utilization_percent for d in host.driver.devices} == busy


def test_every_gpu_row_reads_a_real_reading_and_follows_the_naming_conventions():
    reading = frozen_observation().gpus[0].reading
    jsons, names = set(), set()
    for row in metric_table.GPU_METRICS:
        row.read(reading)  # every row names a field the reading has
        assert row.json not in jsons and row.prometheus not in names
        if row.json is not None:
            jsons.add(row.json)
        if row.prometheus is None:
            continue
        names.add(row.prometheus)
        assert row.prometheus.startswith("memtop_gpu_")
        suffix = {"bytes": "_bytes", "watts": "_watts", "percent": "_percent"}.get(row.unit)
        if suffix is not None:
            assert row.prometheus.endswith(suffix), row
