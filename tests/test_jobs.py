"""Where a trainer runs (issue 25.2): its Slurm job or Kubernetes pod and its rendezvous, read
once by the agent, carried in `hello`, shown by `--once --json` and the dashboard and exported
under DCGM's label names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop import protocol
from memtop.agent import identity
from memtop.base import children
from memtop.base.jobs import JobIdentity, dcgm_labels, job_identity, pod_set
from memtop.sim.demo import registry_dir
from memtop.sim.device import SimGpuRegistry, simulated_gpu_specs

GiB = 2**30
CID = "3f" * 32

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "llama-7b",
    "SLURM_PROCID": "3",
    "SLURM_ARRAY_JOB_ID": "4240",
    "SLURM_ARRAY_TASK_ID": "2",
    "MASTER_ADDR": "node-a",
    "MASTER_PORT": "29500",
    "WORLD_SIZE": "16",
}
POD = {
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    "POD_NAME": "trainer-3",
    "POD_NAMESPACE": "ml",
    "CONTAINER_NAME": "pytorch",
}


def test_slurm_identity_and_rendezvous() -> None:
    assert identity.scheduler(SLURM) == {
        "kind": "slurm",
        "job_id": "4242",
        "job_name": "llama-7b",
        "proc_id": 3,
        "array_job_id": "4240",
        "array_task_id": "2",
    }
    assert identity.rendezvous(SLURM) == {
        "master_addr": "node-a",
        "master_port": 29500,
        "world_size": 16,
    }
    assert identity.scheduler({}) is None and identity.rendezvous({}) is None


def test_kubernetes_from_the_downward_api_else_hostname_namespace_file_and_cgroup() -> None:
    files = {
        identity.SERVICE_ACCOUNT_NAMESPACE: "team-a\n",
        identity.CGROUP_FILE: f"0::/kubepods/burstable/pod1/cri-containerd-{CID}.scope\n",
    }

    def read(path: str, limit: int) -> str | None:
        return files.get(path)

    named = identity.kubernetes(POD, read)
    assert named is not None
    assert (named["pod"], named["namespace"], named["container"]) == ("trainer-3", "ml", "pytorch")
    bare = identity.kubernetes({"KUBERNETES_SERVICE_HOST": "x", "HOSTNAME": "trainer-0"}, read)
    assert bare is not None
    assert (bare["pod"], bare["namespace"], bare["container"]) == ("trainer-0", "team-a", CID)
    assert identity.kubernetes({}, read) is None  # not in a pod


def test_a_broken_environment_never_raises_into_the_trainer() -> None:
    class Hostile(dict):  # type: ignore[type-arg]
        def get(self, *args: object, **kwargs: object) -> object:
            raise RuntimeError("boom")

    assert identity.scheduler(Hostile()) is None
    assert identity.rendezvous(Hostile()) is None


def test_reads_are_bounded_and_skip_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert identity.read_small_file(str(fifo)) is None  # no writer: would block forever
    assert time.monotonic() - started < 1.0
    big = tmp_path / "big"
    big.write_bytes(b"x" * (1 << 20))
    assert len(identity.read_small_file(str(big), 100) or "") == 100
    assert identity.read_small_file(str(tmp_path / "missing")) is None


def test_the_viewer_types_and_bounds_what_an_agent_says() -> None:
    job = job_identity(
        {"scheduler": {"kind": "slurm", "job_id": "x" * 500, "proc_id": True}, "rendezvous": 7}
    )
    assert job is not None and len(job.hpc_job) == 128 and job.slurm_proc_id is None
    assert job_identity({"scheduler": "slurm"}) is None
    assert job_identity({"scheduler": {"kind": "other"}}) is None
    assert dcgm_labels(None) == ["", "", "", ""]
    assert dcgm_labels(JobIdentity(pod="p", namespace="n", container="c")) == ["", "p", "n", "c"]
    assert (
        JobIdentity(slurm_job_id="1", slurm_array_job_id="7", slurm_array_task_id="3").hpc_job
        == "7_3"
    )
    assert [pod_set(p) for p in ("trainer-3", "w-7d9f8-x2kqp", "solo")] == [
        "trainer",
        "w-7d9f8",
        "solo",
    ]


# ------------------------------------------------------------------ end to end


class Trainer:
    """A simulated trainer with the real agent, started with `env` added; it ends with this
    process however this one ends (`--parent`), and a start that fails stops it."""

    def __init__(self, socket_dir: Path, env: dict[str, str], registry: Path, *extra: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "memtop.sim.trainer",
                "--registry",
                str(registry),
                "--step-time",
                "0.05",
                "--parent",
                str(os.getpid()),
                *extra,
            ],
            env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), **env),
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not protocol.socket_path(self.process.pid, socket_dir).exists():
                assert self.process.poll() is None, "the trainer exited before it listened"
                assert time.monotonic() < deadline, "the trainer did not listen within 60 s"
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        children.stop(self.process)  # TERM, then KILL past its deadline


@pytest.fixture
def trainers(socket_dir: Path) -> Iterator[list[Trainer]]:
    registry = registry_dir(socket_dir, os.getpid())
    SimGpuRegistry(registry).create(simulated_gpu_specs(2, total_bytes=16 * GiB))
    started: list[Trainer] = []
    try:
        started.append(Trainer(socket_dir, SLURM, registry))
        started.append(Trainer(socket_dir, POD, registry))
        yield started
    finally:
        for trainer in started:
            trainer.stop()


def test_once_json_shows_the_job(trainers: list[Trainer], socket_dir: Path) -> None:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    done = subprocess.run(
        [sys.executable, "-m", "memtop", "--once", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    agents = {a["pid"]: a for a in json.loads(done.stdout)["agents"]}
    slurm = agents[trainers[0].process.pid]["job"]
    assert slurm["label"] == "slurm 4240_2"
    assert slurm["scheduler"]["job_id"] == "4242" and slurm["scheduler"]["proc_id"] == 3
    assert slurm["rendezvous"] == {"master_addr": "node-a", "master_port": 29500, "world_size": 16}
    pod = agents[trainers[1].process.pid]["job"]
    assert pod["label"] == "pod ml/trainer-3"
    assert pod["scheduler"] == {
        "kind": "kubernetes",
        "pod": "trainer-3",
        "namespace": "ml",
        "container": "pytorch",
    }


def test_exported_series_carry_dcgms_job_labels(trainers: list[Trainer], socket_dir: Path) -> None:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    exporter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memtop.cli",
            "export",
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline()
        port = int(re.search(r":(\d+)/metrics", line).group(1))  # type: ignore[union-attr]
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                body = reply.read().decode()
            allocated = [s for s in body.splitlines() if s.startswith("memtop_allocated_bytes{")]
            if len(allocated) >= 2:
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.3)
        slurm_pid, pod_pid = (str(t.process.pid) for t in trainers)
        by_pid = {re.search(r'pid="(\d+)"', s).group(1): s for s in allocated}  # type: ignore[union-attr]
        assert 'hpc_job="4240_2"' in by_pid[slurm_pid] and 'pod=""' in by_pid[slurm_pid]
        assert all(
            f'{k}="{v}"' in by_pid[pod_pid]
            for k, v in (("hpc_job", ""), ("pod", "trainer-3"), ("namespace", "ml"))
        )
        assert 'container="pytorch"' in by_pid[pod_pid]
        info = [s for s in body.splitlines() if s.startswith("memtop_agent_info{")]
        assert any('hpc_job="4240_2"' in s for s in info)
    finally:
        children.stop(exporter)
