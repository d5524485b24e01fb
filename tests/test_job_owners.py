"""Another user's agents claiming our Slurm job (issue 36, item 9): a job is one owner's, so
they cannot make our ranks look as if they drifted apart.

Root runs two balanced ranks of Slurm job 9 (simulated trainers with the real agent); another
real local user runs an agent that claims rank 2 of job 9 with a far smaller peak, which, in
one group with root's ranks, put each of them far above "the others".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_users import as_user, local_user, needs_root, wait_ready
from test_rank_drift import start_rank

from memtop import protocol
from memtop.base import children
from memtop.sim.demo import registry_dir
from memtop.sim.device import SimGpuRegistry, simulated_gpu_specs

pytestmark = [pytest.mark.slow, needs_root]

GiB = 2**30
HOSTILE = str(Path(__file__).with_name("hostile_agent.py"))
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


@pytest.fixture
def shared_job() -> Iterator[tuple[Path, list[int], int]]:
    xdg = Path(tempfile.mkdtemp(prefix="mtjob-"))
    xdg.chmod(0o700)
    root_dir = xdg / "memtop"
    root_dir.mkdir(mode=0o700)
    registry = registry_dir(root_dir, os.getpid())
    specs = simulated_gpu_specs(2, total_bytes=16 * GiB)
    SimGpuRegistry(registry).create(specs)
    processes: list[subprocess.Popen[bytes]] = []
    with local_user("mtjob") as user:
        theirs = protocol.socket_dir({}, user.uid)
        try:
            subprocess.run(
                ["mkdir", "-m", "700", str(theirs)], user=user.uid, group=user.gid, check=True
            )
            for rank in range(2):
                processes.append(start_rank(root_dir, registry, rank, 1.0))
            # On a GPU the driver knows (the simulated one rank 1 uses), as a real rank would be.
            claimer = as_user(
                user, SYSTEM_PYTHON, HOSTILE, "slurm", str(theirs),
                "--uuid", specs[1].uuid, "--total", str(16 * GiB),
            )  # fmt: skip
            wait_ready(claimer)
            yield xdg, [p.pid for p in processes], claimer.pid
            claimer.kill()
            claimer.wait()
        finally:
            for process in processes:
                children.stop(process)
            shutil.rmtree(theirs, ignore_errors=True)
            shutil.rmtree(xdg, ignore_errors=True)


def test_another_users_agent_claiming_our_job_makes_no_rank_drift(
    shared_job: tuple[Path, list[int], int],
) -> None:
    xdg, ranks, claimer = shared_job
    env = {k: v for k, v in os.environ.items() if k != "MEMTOP_SOCKET_DIR"}
    env["XDG_RUNTIME_DIR"] = str(xdg)
    deadline = time.monotonic() + 60
    while True:
        done = subprocess.run(
            [sys.executable, "-m", "memtop", "--once", "--json"],
            capture_output=True, text=True, env=env, timeout=60, cwd="/",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        agents = {a["pid"]: a for a in data["agents"]}
        steps = [agents[pid].get("step") or 0 for pid in ranks if pid in agents]
        if len(steps) == 2 and min(steps) >= 5 and claimer in agents:
            break
        assert time.monotonic() < deadline, data["agents"]
        time.sleep(0.5)
    assert agents[claimer]["state"] == "connected", agents[claimer]
    assert agents[claimer]["job"]["scheduler"]["job_id"] == "9"
    drift = [s for s in data["suggestions"] if s["rule"] == "rank_drift"]
    assert drift == [], [(s["pid"], s["title"]) for s in drift]
