"""The fleet source: what `memtop export` on many hosts put into Prometheus, read back through
the PromQL HTTP API (`/api/v1/query`, `/api/v1/query_range`).

One instant query fetches every `memtop_*` series; they are grouped by their `hostname` label into
one `HostReading` per host holding the same kinds of readings the local sampler writes into a
store: an `NvmlReading` of the host's GPUs, one `AgentPoll` per agent (hello and sample rebuilt
from the series), the breakdowns, and the host's own verdicts (leak, smoothed fragmentation,
snapshot figures), which the fleet view shows as judged there rather than judging again from
coarser data.  The metric names are those of `memtop.export.metrics`.

Prometheus attaches its own `job` target label to every series; with `honor_labels: false` (its
default) memtop's `job` arrives as `exported_job`, and both spellings are read.
"""

from __future__ import annotations

import base64
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memtop.jobs import hello_fields_from_labels
from memtop.model import (
    SOURCE_AGENT,
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentSample,
    AgentStatus,
    DeviceReading,
    GpuProcess,
    NvmlReading,
)
from memtop.protocol import clean_text, decimal
from memtop.sources.agents import AgentPoll

ALL_SERIES = '{__name__=~"memtop_.+"}'
# Targets that exported memtop series in the last hour and failed their newest scrape.
DOWN = "count_over_time(memtop_observation_time_seconds[1h]) and on (job, instance) (up == 0)"
MAX_REPLY_BYTES = 64 << 20
# The torch stats key each per-device series stands for (the sample is rebuilt from them).
STAT_SERIES = {
    "memtop_allocated_bytes": "allocated_bytes.all.current",
    "memtop_reserved_bytes": "reserved_bytes.all.current",
    "memtop_peak_bytes": "allocated_bytes.all.peak",
    "memtop_inactive_split_bytes": "inactive_split_bytes.all.current",
    "memtop_large_pool_inactive_split_bytes": "inactive_split_bytes.large_pool.current",
    "memtop_large_pool_reserved_bytes": "reserved_bytes.large_pool.current",
    "memtop_alloc_retries_total": "num_alloc_retries",
    "memtop_ooms_total": "num_ooms",
}
# The verdicts judged on the host, by the short names `memtop.fleet` reads.
VERDICT_SERIES = {
    "memtop_leak_bytes_per_step": "bytes_per_step",
    "memtop_leak_bytes_per_second": "bytes_per_second",
    "memtop_leak_detected": "detected",
    "memtop_leak_confidence_ratio": "confidence",
    "memtop_leak_samples": "samples",
    "memtop_time_to_full_seconds": "seconds_to_full",
    "memtop_leak_since_step": "since_step",
    "memtop_leak_since_timestamp_seconds": "since_time",
    "memtop_steps_to_full": "steps_to_full",
    "memtop_step_baseline_bytes": "baseline_bytes",
    "memtop_fragmentation_smoothed_ratio": "gauge_smoothed",
    "memtop_fragmentation_samples": "fragmentation_samples",
    "memtop_external_fragmentation_ratio": "external",
    "memtop_stranded_bytes": "stranded_bytes",
    "memtop_largest_cached_request_bytes": "largest_free_block_bytes",
    "memtop_sampled_peak_bytes": "sampled_peak_bytes",
}
# The sampled history the dashboard draws, by store column.
HISTORY_SERIES = {
    "allocated": "memtop_allocated_bytes",
    "reserved": "memtop_reserved_bytes",
    "torch_peak": "memtop_peak_bytes",
}


class PrometheusError(Exception):
    """Prometheus could not be asked, or did not answer a query: one line for the user."""


@dataclass(frozen=True)
class HostReading:
    """Everything one host's exporter reported, as readings of the local kinds."""

    host: str
    time: float  # the host's newest observation (unix seconds)
    nvml: NvmlReading
    polls: tuple[AgentPoll, ...]
    breakdowns: Mapping[int, dict[str, Any]]  # pid -> a `breakdown` reply
    verdicts: Mapping[tuple[int, int], dict[str, float]]  # (pid, cuda index) -> judged there
    jobs: Mapping[int, str]  # pid -> job label
    instance: str | None = None  # the scrape target, as Prometheus names it


@dataclass(frozen=True)
class FleetReading:
    time: float
    hosts: tuple[HostReading, ...]
    problems: tuple[str, ...] = ()


@dataclass
class _Device:
    index: int | None = None
    uuid: str = ""
    name: str = ""
    gpu: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    free: int = 0
    total: int = 0
    verdict: dict[str, float] = field(default_factory=dict)
    breakdown: dict[str, int] = field(default_factory=dict)


class PrometheusSource:
    """A client of one Prometheus server's HTTP API (no state between reads)."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PrometheusError(f"--prometheus wants http(s)://HOST:PORT, got {url!r}")
        self.headers = {"Accept": "application/json"}
        if parts.username is not None:  # http://user:password@host:9090
            secret = f"{urllib.parse.unquote(parts.username)}:"
            secret += urllib.parse.unquote(parts.password or "")
            self.headers["Authorization"] = "Basic " + base64.b64encode(secret.encode()).decode()
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            parts = parts._replace(netloc=netloc)
        self.url = urllib.parse.urlunsplit(parts).rstrip("/")
        self.timeout = timeout

    # ------------------------------------------------------------------ the HTTP API

    def _get(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                body = reply.read(MAX_REPLY_BYTES + 1)
        except urllib.error.HTTPError as exc:
            detail = clean_text(_error_of(exc.read(4096)) or exc.reason, 300)
            raise PrometheusError(f"Prometheus at {self.url}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = clean_text(getattr(exc, "reason", exc), 300)
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        if len(body) > MAX_REPLY_BYTES:
            raise PrometheusError(f"Prometheus at {self.url}: reply over {MAX_REPLY_BYTES} bytes")
        try:
            data = json.loads(body)
        except ValueError:
            raise PrometheusError(
                f"{self.url} did not answer as Prometheus does (not JSON)"
            ) from None
        if not isinstance(data, dict) or data.get("status") != "success":
            error = clean_text(data.get("error") if isinstance(data, dict) else None, 300)
            raise PrometheusError(f"Prometheus at {self.url}: query failed: {error}")
        found = data.get("data")
        if not isinstance(found, dict) or not isinstance(found.get("result", []), list):
            raise PrometheusError(f"Prometheus at {self.url}: a reply without its data")
        return found

    def query(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant vector: (labels, value) per series."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params)
        if data.get("resultType") != "vector":
            raise PrometheusError(f"Prometheus at {self.url}: not a vector: {promql}")
        out = []
        for series in data.get("result", []):
            sample = series.get("value") if isinstance(series, dict) else None
            if not isinstance(sample, list) or len(sample) != 2:
                continue
            value = _number(sample[1])
            if value is not None:
                out.append((_labels(series), value))
        return out

    def query_range(
        self, promql: str, start: float, end: float, step: float
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """A range vector: (labels, [(time, value), ...]) per series, oldest first."""
        data = self._get(
            "/api/v1/query_range",
            {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
        )
        out = []
        for series in data.get("result", []):
            values = series.get("values") if isinstance(series, dict) else None
            if not isinstance(values, list):
                continue
            points = []
            for pair in values:
                if not isinstance(pair, list) or len(pair) != 2:
                    continue
                stamp, value = _number(pair[0]), _number(pair[1])
                if stamp is not None and value is not None:
                    points.append((stamp, value))
            out.append((_labels(series), points))
        return out

    # ------------------------------------------------------------------ readings

    def read(self) -> FleetReading:
        """Every host's newest readings (one query), and which exporters Prometheus could not
        scrape lately (their series go stale at once, so without this a host would just
        vanish)."""
        hosts = tuple(hosts_of(self.query(ALL_SERIES)))
        problems = []
        try:
            for labels, _ in self.query(DOWN):
                problems.append(
                    f"{labels.get('hostname', '?')}: its exporter at {labels.get('instance', '?')} "
                    "did not answer Prometheus's last scrape (up == 0)"
                )
        except PrometheusError:
            pass  # the readings stand without it
        return FleetReading(time.time(), hosts, tuple(sorted(problems)))

    def history(
        self, seconds: float, step: float, end: float | None = None
    ) -> dict[str, dict[tuple[int, int], dict[str, list[tuple[float, float]]]]]:
        """The sampled history of every agent device: host -> (pid, cuda index) -> column ->
        [(time, value)], for the dashboard's charts (one range query per column)."""
        end = time.time() if end is None else end
        out: dict[str, dict[tuple[int, int], dict[str, list[tuple[float, float]]]]] = {}
        index_of = {
            (labels.get("hostname", ""), labels.get("pid", ""), labels.get("UUID", "")): int(v)
            for labels, v in self.query("memtop_cuda_device_index", at=end)
        }
        for column, name in HISTORY_SERIES.items():
            for labels, points in self.query_range(name, end - seconds, end, step):
                host, pid = labels.get("hostname", ""), labels.get("pid", "")
                index = index_of.get((host, pid, labels.get("UUID", "")))
                pid_number = decimal(pid)
                if index is None or pid_number is None:
                    continue
                out.setdefault(host, {}).setdefault((pid_number, index), {})[column] = points
        return out


def _labels(series: dict[str, Any]) -> dict[str, str]:
    """A series' labels, every name and value made inert for a terminal: they come from
    whatever Prometheus (and any exporter it scrapes) says, and the fleet view prints them."""
    metric = series.get("metric")
    if not isinstance(metric, dict):
        return {}
    return {clean_text(k, 200): clean_text(v, 1000) for k, v in metric.items()}


def _number(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def _error_of(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return str(data.get("error")) if isinstance(data, dict) and data.get("error") else None


def _int(text: str | None, default: int = 0) -> int:
    if text is None:
        return default
    digits = text.removeprefix("-")
    return int(text) if digits.isascii() and digits.isdigit() else default


def hosts_of(series: Iterable[tuple[dict[str, str], float]]) -> list[HostReading]:
    """Group `memtop_*` series by host and rebuild each host's readings."""
    by_host: dict[str, list[tuple[dict[str, str], float]]] = {}
    for labels, value in series:
        host = labels.get("hostname")
        if host:
            by_host.setdefault(host, []).append((labels, value))
    return [_host(host, rows) for host, rows in sorted(by_host.items())]


def _host(host: str, rows: list[tuple[dict[str, str], float]]) -> HostReading:
    stamp = 0.0
    instance = None
    gpus: dict[str, dict[str, Any]] = {}
    processes: dict[str, list[GpuProcess]] = {}
    agents: dict[int, dict[str, Any]] = {}
    devices: dict[tuple[int, str], _Device] = {}
    steps: dict[int, int] = {}

    def device(labels: dict[str, str]) -> _Device:
        key = (_int(labels.get("pid")), labels.get("UUID", ""))
        found = devices.get(key)
        if found is None:
            found = devices[key] = _Device(
                uuid=key[1], name=labels.get("modelName", ""), gpu=_int(labels.get("gpu"))
            )
        return found

    for labels, value in rows:
        name = labels.get("__name__", "")
        instance = instance or labels.get("instance")
        if name == "memtop_observation_time_seconds":
            stamp = max(stamp, value)
        elif name == "memtop_gpu_info":
            gpu = gpus.setdefault(labels.get("UUID", ""), {})
            gpu.update(
                index=_int(labels.get("gpu")),
                name=labels.get("modelName", ""),
                source=labels.get("source", "nvml"),
            )
        elif name in ("memtop_gpu_memory_used_bytes", "memtop_gpu_memory_total_bytes",
                      "memtop_gpu_memory_free_bytes"):  # fmt: skip
            gpus.setdefault(labels.get("UUID", ""), {})[name.split("_")[3]] = int(value)
        elif name == "memtop_gpu_process_used_bytes":
            processes.setdefault(labels.get("UUID", ""), []).append(
                GpuProcess(_int(labels.get("pid")), int(value))
            )
        elif name == "memtop_agent_info":
            agents[_int(labels.get("pid"))] = labels
        elif name == "memtop_steps_total":
            steps[_int(labels.get("pid"))] = int(value)
        elif name in STAT_SERIES:
            device(labels).stats[STAT_SERIES[name]] = int(value)
        elif name in VERDICT_SERIES:
            device(labels).verdict[VERDICT_SERIES[name]] = value
        elif name == "memtop_breakdown_bytes":
            device(labels).breakdown[labels.get("part", "other")] = int(value)
        elif name == "memtop_fp32_parameter_bytes":
            device(labels).breakdown["fp32_parameter_bytes"] = int(value)
        elif name == "memtop_cuda_free_bytes":
            device(labels).free = int(value)
        elif name == "memtop_cuda_total_bytes":
            device(labels).total = int(value)
        elif name == "memtop_cuda_device_index":
            device(labels).index = int(value)

    readings = []
    for uuid, gpu in gpus.items():
        listed = tuple(sorted(processes.get(uuid, []), key=lambda p: p.pid))
        readings.append(
            DeviceReading(
                index=gpu.get("index", 0),
                uuid=uuid,
                name=gpu.get("name", ""),
                total_bytes=gpu.get("total"),
                used_bytes=gpu.get("used"),
                free_bytes=gpu.get("free"),
                processes=listed,
                source=gpu.get("source", "nvml"),
            )
        )
    driver = [r for r in readings if r.source != SOURCE_AGENT]
    if driver:
        nvml = NvmlReading(
            True, tuple(sorted(driver, key=lambda r: r.index)), source=driver[0].source
        )
    else:  # the host had no driver view: its GPUs come from the agents, as they did there
        nvml = NvmlReading(False, error="no NVML on this host", source=SOURCE_AGENT)

    polls = []
    breakdowns: dict[int, dict[str, Any]] = {}
    verdicts: dict[tuple[int, int], dict[str, float]] = {}
    jobs: dict[int, str] = {}
    for pid, labels in sorted(agents.items()):
        mine = sorted(
            (d for (p, _), d in devices.items() if p == pid and d.index is not None),
            key=lambda d: d.index or 0,
        )
        rank = labels.get("rank")
        hello = AgentHello(
            protocol=1,
            pid=pid,
            argv=tuple(labels.get("command", "").split()),
            python=labels.get("python", ""),
            torch=labels.get("torch") or None,
            allocator_conf=labels.get("allocator_conf", ""),
            devices=tuple(AgentDevice(d.index or 0, d.uuid, d.name, d.total) for d in mine),
            extra={
                "rank": _int(rank) if rank else None,
                "host": host,
                **hello_fields_from_labels(labels),
            },
        )
        jobs[pid] = labels.get("exported_job") or labels.get("job", "")
        try:
            state = AgentStatus(labels.get("state", "connected"))
        except ValueError:
            state = AgentStatus.INCONSISTENT
        sample = None
        if state == AgentStatus.CONNECTED:
            sample = AgentSample(
                time=stamp,
                step=steps.get(pid),
                devices=tuple(
                    AgentDeviceSample(d.index or 0, dict(d.stats), d.free, d.total) for d in mine
                ),
            )
            for d in mine:
                verdicts[(pid, d.index or 0)] = dict(d.verdict)
            parts = {str(d.index): dict(d.breakdown) for d in mine if d.breakdown}
            if parts:
                breakdowns[pid] = {"devices": parts}
        polls.append(AgentPoll(pid, state, hello, sample))
    return HostReading(
        host=host,
        time=stamp,
        nvml=nvml,
        polls=tuple(polls),
        breakdowns=breakdowns,
        verdicts=verdicts,
        jobs=jobs,
        instance=instance,
    )
