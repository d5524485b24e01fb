"""Cost of one Prometheus scrape of `memtop export` with 8 GPUs and 16 agents (budget < 5 ms).

A store is filled with two minutes of made-up readings (8 GPUs, two trainers on each, every
trainer with step marks and a breakdown), one observation is built from it as the exporter's
loop does, and then measured:

- render: the collector's families plus the text exposition (`generate_latest`), in-process;
- http: a whole GET /metrics over loopback against the exporter's own HTTP server (keep-alive
  off, as Prometheus' scrapes are new requests on a kept connection or not);
- observation: building the observation itself, which the exporter does once per sampler round,
  not per scrape (shown for scale).

    python bench/export_cost.py [--gpus 8] [--agents 16] [--scrapes 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest

from memtop.engine.observation import Observer
from memtop.engine.store import Store
from memtop.export.metrics import ObservationCollector
from memtop.export.server import Exporter
from memtop.export.text import exposition
from memtop.model import (
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentSample,
    AgentView,
    DeviceReading,
    DriverReading,
    GpuProcess,
    StepMark,
)
from memtop.protocol.schema import parse_breakdown
from memtop.sources.agents import CONNECTED

MiB, GiB = 1 << 20, 1 << 30
TOTAL = 80 * GiB
T0 = 1_790_000_000.0


def filled_store(gpus: int, agents: int, seconds: int) -> Store:
    store = Store()
    uuids = [f"GPU-{i:08x}-bench" for i in range(gpus)]
    pids = [5000 + i for i in range(agents)]
    for t in range(seconds):
        polls: list[AgentView] = []
        processes: dict[str, list[GpuProcess]] = {u: [] for u in uuids}
        for n, pid in enumerate(pids):
            gpu = n % gpus
            allocated = (8 + n % 3) * GiB + t * (4 * MiB if n % 5 == 0 else 0)
            reserved = allocated + 2 * GiB
            stats = {
                "allocated_bytes.all.current": allocated,
                "reserved_bytes.all.current": reserved,
                "allocated_bytes.all.peak": allocated + 3 * GiB,
                "inactive_split_bytes.all.current": 300 * MiB,
                "inactive_split_bytes.large_pool.current": 280 * MiB,
                "reserved_bytes.large_pool.current": reserved - 100 * MiB,
                "num_alloc_retries": t // 60,
                "num_ooms": 0,
            }
            hello = AgentHello(
                1, pid, ("train.py", f"--rank={n}"), "3.12", "2.13.0", "",
                (AgentDevice(0, uuids[gpu], "NVIDIA H100 80GB HBM3", TOTAL),),
                {"rank": n},
            )  # fmt: skip
            marks = (
                StepMark(2 * t, T0 + t, {0: allocated}),
                StepMark(2 * t + 1, T0 + t + 0.5, {0: allocated}),
            )
            sample = AgentSample(
                T0 + t, 2 * t + 1, (AgentDeviceSample(0, stats, 20 * GiB, TOTAL),), marks
            )
            polls.append(AgentView(pid, CONNECTED, hello, sample))
            processes[uuids[gpu]].append(GpuProcess(pid, reserved + 500 * MiB))
        devices = tuple(
            DeviceReading(i, u, "NVIDIA H100 80GB HBM3", TOTAL, _used(processes[u]),
                          processes=tuple(processes[u]))
            for i, u in enumerate(uuids)
        )  # fmt: skip
        store.update_driver(DriverReading(True, devices, "550.54.15"), T0 + t)
        store.update_agents(polls, T0 + t + 0.01)
    for pid in pids:
        parts = {"parameters": 3 * GiB, "gradients": 3 * GiB, "optimizer_state": 6 * GiB}
        reply = parse_breakdown({"devices": {"0": {**parts, "other": GiB}}})
        store.update_breakdown(pid, reply, T0 + seconds)
    return store


def _used(processes: list[GpuProcess]) -> int:
    return sum(p.used_bytes or 0 for p in processes)


def percentiles(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return (
        f"median {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * (len(ms) - 1))]:.2f} ms, "
        f"max {ms[-1]:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=120, help="history filled in")
    parser.add_argument("--scrapes", type=int, default=300)
    args = parser.parse_args()

    store = filled_store(args.gpus, args.agents, args.seconds)
    observer = Observer(store, host="bench-node", clock=lambda: T0 + args.seconds)
    builds = []
    for _ in range(5):
        started = time.perf_counter()
        observation = observer.publish()
        builds.append(time.perf_counter() - started)

    collector = ObservationCollector(host="bench-node")
    collector.observe(observation)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry)
    samples = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    stock, renders = [], []
    for _ in range(args.scrapes // 3):
        started = time.perf_counter()
        generate_latest(registry)
        stock.append(time.perf_counter() - started)
    for _ in range(args.scrapes):
        started = time.perf_counter()
        exposition(collector.collect())
        renders.append(time.perf_counter() - started)

    class _Sampler:  # the HTTP path only: the exporter's loop is not run here
        store = observer.store

    exporter = Exporter(_Sampler(), "127.0.0.1:0", host="bench-node")  # type: ignore[arg-type]
    host, port = exporter.start_http()
    url = f"http://{host}:{port}/metrics"
    https: list[float] = []
    cached: list[float] = []
    for n in range(2 * args.scrapes):
        if n % 2 == 0:  # a new observation object: what each sampler round hands over
            exporter.collector.observe(dataclasses.replace(observation))
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=5) as reply:
            reply.read()
        (https if n % 2 == 0 else cached).append(time.perf_counter() - started)
    exporter.stop()

    print(f"export cost: {args.gpus} GPUs, {args.agents} agents, {args.seconds} s of history")
    print(f"  exposition: {samples} samples, {len(text) / 1024:.1f} KiB")
    print(f"  render with generate_latest: {percentiles(stock)}")
    print(f"  render with memtop.export.text (a new observation): {percentiles(renders)}")
    print(f"  GET /metrics rendering a new observation: {percentiles(https)}")
    print(f"  GET /metrics as served (rendered once per round): {percentiles(cached)}")
    print(f"  observation build (once per round, not per scrape): {percentiles(builds)}")
    verdict = "within" if statistics.median(cached) < 0.005 else "OVER"
    print(f"  budget < 5 ms per scrape: {verdict}")


if __name__ == "__main__":
    main()
