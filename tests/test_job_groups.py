"""The ranks of one job across hosts (issue 25.3): two simulated hosts (each its own socket
directory, simulated GPUs and `memtop export --hostname`), one trainer each with the same Slurm
job, read back the way the fleet view reads Prometheus: one job group with both ranks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_fleet import _as_prometheus_has_it
from test_jobs import Trainer

from memtop.base import children
from memtop.engine.fleet import host_observation
from memtop.present import fleet_report
from memtop.sim.demo import registry_dir
from memtop.sim.device import SimGpuRegistry, simulated_gpu_specs
from memtop.sources.prometheus import hosts_of

GiB = 2**30


class Host:
    def __init__(self, name: str, socket_dir: Path, env: dict[str, str], scale: float) -> None:
        self.name = name
        registry = registry_dir(socket_dir, os.getpid())
        SimGpuRegistry(registry).create(simulated_gpu_specs(1, total_bytes=16 * GiB, seed=name))
        self.trainer = Trainer(socket_dir, env, registry, "--scale", str(scale))
        self.exporter = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "memtop.cli",
                "export",
                "--listen",
                "127.0.0.1:0",
                "--hostname",
                name,
                "--interval",
                "0.5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
        )
        assert self.exporter.stdout is not None
        line = self.exporter.stdout.readline()
        self.port = int(re.search(r":(\d+)/metrics", line).group(1))  # type: ignore[union-attr]

    def scrape(self) -> str:
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                body = r.read().decode()
            steps = re.search(r"^memtop_steps_total\{.*\} (\S+)$", body, re.MULTILINE)
            if "memtop_allocated_bytes{" in body and steps and float(steps.group(1)) >= 5:
                return body  # a few steps in: the true peak is reached
            assert time.monotonic() < deadline, body
            time.sleep(0.3)

    def stop(self) -> None:
        try:
            children.stop(self.exporter)  # TERM, then KILL past its deadline
        finally:
            self.trainer.stop()


def slurm_rank(rank: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "777",
        "SLURM_JOB_NAME": "pretrain",
        "SLURM_PROCID": str(rank),
        "RANK": str(rank),
        "MASTER_ADDR": "node-a",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "2",
    }


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    hosts: list[Host] = []
    # Short (AF_UNIX paths are limited to 108 bytes), private and random: one per host.
    directories = [Path(tempfile.mkdtemp(prefix="mtj-")) for _ in range(2)]
    try:
        for i, name in enumerate(("Node-A", "node-b")):
            directories[i].chmod(0o700)
            # Rank 0 evaluates on top of training: its peak runs 30 % above rank 1's.
            hosts.append(Host(name, directories[i], slurm_rank(i), 1.3 if i == 0 else 1.0))
        yield hosts
    finally:
        for host in hosts:
            host.stop()
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_one_job_on_two_hosts_is_one_group_with_both_ranks(two_hosts: list[Host]) -> None:
    rows = []
    for host in two_hosts:
        rows += _as_prometheus_has_it(host.scrape(), instance=f"{host.name}:9482")
    readings = hosts_of(rows)
    assert [r.host for r in readings] == ["node-a", "node-b"]
    data = fleet_report.build("http://prometheus", [host_observation(r) for r in readings])
    (job,) = data["jobs"]
    assert job["label"] == "slurm 777"
    assert job["hosts"] == ["node-a", "node-b"]
    assert [(r["host"], r["rank"]) for r in job["ranks"]] == [("node-a", 0), ("node-b", 1)]
    assert [r["pid"] for r in job["ranks"]] == [h.trainer.process.pid for h in two_hosts]
    assert job["spread_bytes"] > 2**30 and job["median_peak_bytes"] > 0
    # Each host's diagnosis sees one rank; the fleet sees that rank 0 drifts above rank 1.
    assert job["drifting"]["rank"] == 0 and job["drifting"]["host"] == "node-a"
    assert 0.25 < job["drifting"]["above_share"] < 0.35
    text = fleet_report.render_text(data)
    assert "slurm 777: 2 ranks on 2 hosts (node-a, node-b)" in text
    assert "rank 0 on node-a peaks 3" in text
