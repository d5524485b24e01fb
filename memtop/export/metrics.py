"""One `Observation` as Prometheus metric families (the names are a contract: DESIGN §11).

Only a renderer, like `memtop.present.report`: what it writes was joined and diagnosed once in
`memtop.engine.observation`.  Conventions (https://prometheus.io/docs/practices/naming/): the
`memtop_`
prefix, base units (bytes, seconds, ratios 0–1), `_bytes` / `_seconds` suffixes, `_total` for
counters and no `_created` series.  Labels join with the DCGM exporter's: `hostname` (lower
case), `UUID`, `gpu` (the driver's number) and `modelName`; the per-process series add `pid`,
`rank` (RANK, else LOCAL_RANK, of the trainer) and `job` (`--job`, else the trainer command's
basename).  Where AMD GPUs are in view (amdsmi, or `demo --vendor amd`), the GPU and
per-process series also carry the labels of AMD's device metrics exporter
(ROCm/device-metrics-exporter, GPUMetricLabel):
`gpu_id` (amdsmi's GPU number), `gpu_uuid` and `card_model`, empty on an NVIDIA GPU beside them;
a host without AMD GPUs exports exactly what it did before.

The per-device families are the rows of `memtop.figures.metric_table`, which
`memtop.present.report` and the
fleet's reader (`memtop.sources.prometheus`) read too: a new per-device figure is a row there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from memtop.base.jobs import DCGM_LABELS, INFO_JOB_LABELS, dcgm_labels, info_labels
from memtop.diagnosis.sites import leaking_site
from memtop.engine.observation import Observation
from memtop.export.text import exposition
from memtop.figures import metric_table
from memtop.model import ACTION_KINDS, AgentStatus, AgentView

GPU_LABELS = ("hostname", "UUID", "gpu", "modelName")
AMD_GPU_LABELS = ("gpu_id", "gpu_uuid", "card_model")
# DCGM exporter's MIG labels: the GPU instance id and its profile ("3g.40gb").
MIG_GPU_LABELS = ("GPU_I_ID", "GPU_I_PROFILE")
# DCGM exporter's job labels (hpc_job, pod, namespace, container), so series join its own.
AGENT_LABELS = ("hostname", "pid", "rank", "job", *DCGM_LABELS)
INFO_LABELS = (
    *AGENT_LABELS,
    "state",
    "command",
    "python",
    "torch",
    "allocator_conf",
    *INFO_JOB_LABELS,
)
BREAKDOWN_PARTS = ("parameters", "gradients", "optimizer_state", "other")


def action_label(kind: str) -> str:
    """An action's kind as a label value: a command of the closed set, else "other" (an agent's
    string never becomes a label of its own: the family stays bounded)."""
    return kind if kind in ACTION_KINDS else "other"


EXPORT_TOP_SITES = 5  # `site` label values per device: a bounded family


def site_label(file: str, line: int) -> str | None:
    """A site as a label value: the file's base name and the line ("train.py:45")."""
    if not file:
        return None  # blocks allocated before stacks were recorded
    return f"{file.replace(chr(92), '/').rsplit('/', 1)[-1][:80]}:{line}"


def hostname(name: str | None = None) -> str:
    """DCGM exporter's `hostname` label: the node name, lower case."""
    return (name or os.uname().nodename).lower()


def job_name(argv: Iterable[str]) -> str:
    """The trainer's command as a job name: `train.py` for `python train.py`, the module for
    `python -m pkg.train`, `torchrun` for torchrun."""
    args = list(argv)
    if not args:
        return ""
    first = os.path.basename(args[0])
    if first.startswith("python") and len(args) > 1:
        if args[1] == "-m" and len(args) > 2:
            return args[2]
        if not args[1].startswith("-"):
            return os.path.basename(args[1])
    return first


def rank_of(agent: AgentView) -> str:
    extra = agent.hello.extra if agent.hello is not None else {}
    for key in ("rank", "local_rank"):
        value = extra.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    return ""


class ObservationCollector(Collector):
    """A custom collector over the newest published observation.

    `observe()` is called by whoever builds observations (the exporter's loop, once per sampler
    round); a scrape only renders the one it holds, so it never waits for agents or NVML.
    """

    def __init__(self, *, host: str | None = None, job: str | None = None) -> None:
        self.host = hostname(host)
        self.job = job
        self._observation: Observation | None = None
        self._body: tuple[Observation | None, bytes] = (None, b"")
        self._lock = threading.Lock()

    def observe(self, observation: Observation) -> None:
        self._observation = observation  # one reference swap: atomic for the scraping thread

    @property
    def ready(self) -> bool:
        return self._observation is not None

    def body(self) -> bytes:
        """The text exposition of the newest observation, rendered at most once per
        observation however many scrapers ask (`memtop.export.text`)."""
        with self._lock:
            observation = self._observation
            if self._body[0] is not observation:
                self._body = (observation, exposition(self.collect()))
            return self._body[1]

    def describe(self) -> Iterator[Metric]:
        # Registering must not build an observation: no families up front.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        observation = self._observation
        if observation is None:
            return iter(())
        return iter(render(observation, host=self.host, job=self.job))


def render(
    observation: Observation, *, host: str | None = None, job: str | None = None
) -> list[Metric]:
    """Every metric family of one observation."""
    host = hostname(host or observation.host)
    obs = observation
    # amdsmi numbers its GPUs from 0 (the AMD exporter's gpu_id); memtop's `gpu` counts
    # NVIDIA's first on a mixed box.
    amd_ids = {g.uuid: str(n) for n, g in enumerate(g for g in obs.gpus if g.vendor == "amd")}
    amd_labels = AMD_GPU_LABELS if amd_ids else ()
    # A box with MIG instances: DCGM's instance labels on every GPU series ("" on a whole
    # GPU), so a dashboard built on dcgm-exporter's reads memtop's; `gpu` is the parent's.
    migs = {g.uuid: g.mig for g in obs.gpus if g.mig is not None}
    mig_labels = MIG_GPU_LABELS if migs else ()
    gpu_label_names = (*GPU_LABELS, *amd_labels, *mig_labels)
    process_label_names = (*gpu_label_names, "pid", "rank", "job", *DCGM_LABELS)

    def gpu_labels(uuid: str, index: int, name: str) -> list[str]:
        values = [host, uuid, str(index), name]
        if amd_ids:
            amd_id = amd_ids.get(uuid)
            values += [amd_id, uuid, name] if amd_id is not None else ["", "", ""]
        if migs:
            mig = migs.get(uuid)
            values += [str(mig.gpu_instance_id), mig.profile] if mig is not None else ["", ""]
        return values

    def gauge(name: str, text: str, labels: tuple[str, ...]) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, text, labels=labels)

    def counter(name: str, text: str, labels: tuple[str, ...]) -> CounterMetricFamily:
        return CounterMetricFamily(name, text, labels=labels)

    time_g = gauge(
        "memtop_observation_time_seconds", "Unix time of the observation.", ("hostname",)
    )
    time_g.add_metric([host], obs.time)
    # One family per exported driver figure of the GPU table
    # (memtop.figures.metric_table.GPU_METRICS).
    gpu_families = [
        (figure, gauge(figure.prometheus, figure.help, gpu_label_names))
        for figure in metric_table.GPU_METRICS
        if figure.prometheus is not None
    ]
    gpu_processes = gauge(
        "memtop_gpu_process_used_bytes",
        "Device memory the driver charges one process (NVML per-process used).",
        (*gpu_label_names, "pid"),
    )
    gpu_info = gauge(
        "memtop_gpu_info",
        "One per GPU in view: where its numbers come from.",
        (*gpu_label_names, "source"),
    )
    gpu_accounted = gauge(
        "memtop_gpu_memory_accounted_bytes",
        "A GPU's used memory by who holds it (the parts sum to memtop_gpu_memory_used_bytes): "
        "agents_reserved, agents_outside_pytorch, no_agent, other_namespace, other_users, gone, "
        "mig_instances, overcounted, unattributed.",
        (*gpu_label_names, "part"),
    )
    for gpu in obs.gpus:
        labels = gpu_labels(gpu.uuid, gpu.index, gpu.name)
        gpu_info.add_metric([*labels, gpu.source], 1)
        if gpu.accounting is not None:
            for share in gpu.accounting.parts:
                gpu_accounted.add_metric([*labels, share.name], share.bytes)
        for figure, family in gpu_families:
            if (value := figure.read(gpu.reading)) is not None:
                family.add_metric(labels, value)
        for process in gpu.processes:
            if process.used_bytes is not None:
                gpu_processes.add_metric([*labels, str(process.pid)], process.used_bytes)

    info = gauge(
        "memtop_agent_info",
        "One per memtop agent in view (any state), with its command line and versions.",
        INFO_LABELS,
    )
    steps = counter("memtop_steps", "Training steps the agent counted.", AGENT_LABELS)
    # One family per exported figure of the metric table (memtop.figures.metric_table).
    table = [row for row in metric_table.DEVICE_METRICS if row.prometheus is not None]
    families = {
        row.key: (counter if row.kind == "counter" else gauge)(
            row.prometheus or "", row.help, process_label_names
        )
        for row in table
    }
    breakdown = gauge(
        "memtop_breakdown_bytes",
        "Allocated bytes by role: parameters, gradients, optimizer state, other (activations).",
        (*process_label_names, "part"),
    )

    # Live bytes by the user's line (stack recording on): the top few per device, so the
    # family's cardinality stays bounded however many lines allocate (DESIGN §12).
    site_bytes = gauge(
        "memtop_site_bytes",
        f"Live bytes allocated at a line of user code (file:line), the top {EXPORT_TOP_SITES} "
        "per device; only while stacks are recorded.",
        (*process_label_names, "site"),
    )
    # The leak's line and its rate (DESIGN §13: named from the agent's kept rounds, so the
    # first scrape has it): one series per leaking process and device at most.
    leak_site = gauge(
        "memtop_leak_site_bytes_per_step",
        "How fast the live bytes of the leak's line of user code (file:line) grow per step; "
        "only while a leak is detected and stacks name its line.",
        (*process_label_names, "site"),
    )

    # Every action performed in a trainer, whoever asked (the agent's action log, issue 34), by
    # kind and result; and the newest one of each kind that ran, its minute before and after.
    actions_total = counter(
        "memtop_process_actions",
        "Actions performed in the trainer (cleanup, tune, reset_peak, snapshot, sites), by "
        "anyone, by result (ok, refused), each counted once as this memtop learnt of it.",
        (*AGENT_LABELS, "action", "result"),
    )
    action_time = gauge(
        "memtop_process_last_action_time_seconds",
        "Unix time of the newest action of each kind that ran in the trainer.",
        (*AGENT_LABELS, "action"),
    )
    window_labels = (*process_label_names, "action", "window")
    action_reserved = gauge(
        "memtop_process_last_action_reserved_bytes",
        "The newest action of each kind: median reserved bytes the minute before and after it.",
        window_labels,
    )
    action_split = gauge(
        "memtop_process_last_action_split_bytes",
        "The newest action of each kind: median free bytes inside split segments (stranded) "
        "the minute before and after it.",
        window_labels,
    )
    action_retries = gauge(
        "memtop_process_last_action_alloc_retries_per_second",
        "The newest action of each kind: the allocator's retries per second the minute before "
        "and after it.",
        window_labels,
    )
    action_step = gauge(
        "memtop_process_last_action_step_seconds",
        "The newest action of each kind: the median step time the minute before and after it.",
        window_labels,
    )

    for agent in obs.agents:
        rank = rank_of(agent)
        agent_job = job or job_name(agent.argv)
        where = dcgm_labels(agent.job)
        agent_labels = [host, str(agent.pid), rank, agent_job, *where]
        info.add_metric(
            [
                *agent_labels,
                agent.status.value,
                " ".join(agent.argv),
                agent.hello.python if agent.hello else "",
                (agent.hello.torch or "") if agent.hello else "",
                agent.allocator_conf,
                *info_labels(agent.job),
            ],
            1,
        )
        if agent.step is not None:
            steps.add_metric(agent_labels, agent.step)
        counted: dict[tuple[str, str], int] = {}
        for (kind, result), n in agent.action_counts.items():
            key = (action_label(kind), result if result in ("ok", "refused") else "other")
            counted[key] = counted.get(key, 0) + n
        for (kind, result), n in sorted(counted.items()):
            actions_total.add_metric([*agent_labels, kind, result], n)
        newest = {}
        for effect in obs.effects_of(
            agent.pid
        ):  # oldest first: the newest of each kind and device wins
            if effect.action.ok:
                newest[(action_label(effect.action.kind), effect.device)] = effect
        for kind in sorted({kind for kind, _ in newest}):
            when = max(e.action.time for (k, _), e in newest.items() if k == kind)
            action_time.add_metric([*agent_labels, kind], when)
        if agent.status != AgentStatus.CONNECTED:
            continue  # an exited or hung agent's last numbers are not the present
        for dev in obs.devices_of(agent):
            labels = [
                *gpu_labels(dev.uuid, dev.gpu, dev.name),
                str(agent.pid),
                rank,
                agent_job,
                *where,
            ]
            for row in table:
                value = row.read(dev)
                if value is not None:
                    families[row.key].add_metric(labels, value)
            parts = dev.diagnosis.breakdown or {}
            for part in BREAKDOWN_PARTS:
                if part in parts:
                    breakdown.add_metric([*labels, part], parts[part])
            for trend in dev.diagnosis.sites[:EXPORT_TOP_SITES]:
                name = site_label(trend.site.file, trend.site.line)
                if name is not None:
                    site_bytes.add_metric([*labels, name], trend.bytes)
            for (kind, index), effect in sorted(newest.items(), key=lambda item: item[0][0]):
                if index != dev.index:
                    continue
                for window, side in (("before", effect.before), ("after", effect.after)):
                    if side is None:
                        continue
                    at = [*labels, kind, window]
                    if side.reserved_bytes is not None:
                        action_reserved.add_metric(at, side.reserved_bytes)
                    if side.split_bytes is not None:
                        action_split.add_metric(at, side.split_bytes)
                    if side.retries_per_min is not None:
                        action_retries.add_metric(at, side.retries_per_min / 60.0)
                    if side.step_time_s is not None:
                        action_step.add_metric(at, side.step_time_s)
            culprit = leaking_site(dev.diagnosis.sites)
            name = site_label(culprit.site.file, culprit.site.line) if culprit else None
            if culprit is not None and name is not None and culprit.bytes_per_step is not None:
                leak_site.add_metric([*labels, name], culprit.bytes_per_step)

    # What each process on a GPU is (DESIGN §13): trainer, server (its engine), preallocator,
    # and the share of the GPU a server or preallocator asked for, with the setting that sets it.
    workload_info = gauge(
        "memtop_process_workload_info",
        "One per process on a GPU whose kind is known: trainer, server (engine), preallocator.",
        (*gpu_label_names, "pid", "kind", "engine"),
    )
    budget_share = gauge(
        "memtop_process_budget_share",
        "The share of the GPU a server or preallocator takes on purpose (0-1), and the "
        "setting that sets it (vLLM's --gpu-memory-utilization, …).",
        (*gpu_label_names, "pid", "engine", "setting"),
    )
    names = {g.uuid: g.name for g in obs.gpus}
    for entry in obs.entries:
        what = entry.workload
        if what is None or entry.uuid is None or entry.gpu is None:
            continue
        labels = [*gpu_labels(entry.uuid, entry.gpu, names.get(entry.uuid, "")), str(entry.pid)]
        workload_info.add_metric([*labels, what.kind.value, what.engine or ""], 1)
        if what.budget_share is not None:
            budget_share.add_metric(
                [*labels, what.engine or "", what.setting or ""],
                what.budget_share,
            )

    suggestions = gauge(
        "memtop_suggestions",
        "Suggestions standing now, by severity and rule.",
        ("hostname", "severity", "rule"),
    )
    counts: dict[tuple[str, str], int] = {}
    for suggestion in obs.suggestions:
        found = (str(suggestion.severity), suggestion.rule)
        counts[found] = counts.get(found, 0) + 1
    for (severity, rule), n in sorted(counts.items()):
        suggestions.add_metric([host, severity, rule], n)

    return [
        time_g,
        gpu_info,
        *(family for _, family in gpu_families),
        gpu_processes,
        gpu_accounted,
        info,
        steps,
        *families.values(),
        breakdown,
        site_bytes,
        workload_info,
        budget_share,
        leak_site,
        suggestions,
        actions_total,
        action_time,
        action_reserved,
        action_split,
        action_retries,
        action_step,
    ]
