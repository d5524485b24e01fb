"""Every byte on a GPU has an owner, or memtop says why not (issue 31, item 5).

The stand-in libnvidia-ml.so.1 (tests/nvml_standin.c, through the real nvidia-ml-py) charges one
GPU to real processes of every kind memtop must tell apart:

- a trainer with an agent (its reserved, and what the driver charges it beyond);
- a Python process without an agent (attachable: `memtop attach PID`);
- a pid that is gone, whose forked child still holds a (stand-in) GPU device file open: the
  child, in the gone pid's process group, is named as what to stop;
- a process in another pid namespace (`unshare --pid`);
- another local user's process;
- and bytes charged to no listed pid.

`accounting` in `--once --json` must sum exactly to the device's `used_bytes` and name each, as
root and as a user (to whom root's processes are another user's, which it may not read).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from local_users import LocalUser, local_user
from nvml_standin import RESERVED, GiB, Gpu, MiB, State, build, env

from memtop.sim.device import SimGpuRegistry, SimGpuSpec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("unshare") is None,
        reason="needs root (a second local user, unshare --pid)",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
SITE_PACKAGES = next(p for p in sys.path if p.endswith("site-packages"))
UNATTRIBUTED = 1536 * MiB

# Opens the stand-in device file, forks a child that keeps it (inherited) and sleeps, exits.
FORKER = """
import os, sys, time
device = open(sys.argv[1], "rb")
child = os.fork()
if child == 0:
    print(os.getpid(), flush=True)
    time.sleep(1000)
    os._exit(0)
os._exit(0)
"""


@dataclass
class Box:
    work: Path
    library: Path
    sockets: Path
    state: Path
    device_file: Path
    pids: dict[str, int]
    charges: dict[str, int]

    def once(self, user: LocalUser | None = None) -> dict[str, Any]:
        base = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{ROOT}:{SITE_PACKAGES}",
            "MEMTOP_SOCKET_DIR": str(self.sockets),
            "MEMTOP_DEVICE_FILES": str(self.device_file.parent / "nvidia"),
            "HOME": str(self.work),
        }
        python = "/usr/bin/python3" if user is not None else sys.executable
        done = subprocess.run(
            [python, "-m", "memtop", "--socket-dir", str(self.sockets), "--once", "--json"],
            env=env(self.library, self.state, base),
            cwd=str(self.work),
            capture_output=True,
            text=True,
            timeout=90,
            **({"user": user.uid, "group": user.gid, "extra_groups": []} if user else {}),
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


@pytest.fixture(scope="module")
def user() -> Iterator[LocalUser]:
    with local_user("mtacc") as made:
        yield made


@pytest.fixture(scope="module")
def box(user: LocalUser) -> Iterator[Box]:
    work = Path(tempfile.mkdtemp(prefix="mt-acc-", dir="/tmp"))
    work.chmod(0o755)
    library = build(work / "lib")
    sockets = work / "sockets"
    sockets.mkdir(mode=0o700)
    device_file = work / "dev" / "nvidia0"
    device_file.parent.mkdir()
    device_file.write_bytes(b"")
    registry = work / "registry"
    SimGpuRegistry(registry).create(
        [SimGpuSpec(0, "fa4e0000-0000-4000-8000-000000000000", "A100", 80 * GiB)]
    )
    state = work / "state"
    State(gpus=[Gpu()]).write(state)
    started: list[subprocess.Popen[bytes]] = []
    loose: list[int] = []  # processes started here that are no Popen's child any more
    pids: dict[str, int] = {}

    def start(command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, **kwargs)
        started.append(process)
        return process

    try:
        environment = env(library, state, {**os.environ, "MEMTOP_SOCKET_DIR": str(sockets)})
        trainer = start(
            [sys.executable, "-m", "memtop.sim.trainer", "--registry", str(registry),
             "--gpu", "0", "--scenario", "healthy", "--step-time", "0.1", "--scale", "0.1"],
            env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        pids["trainer"] = trainer.pid
        python = start([sys.executable, "-c", "import time; time.sleep(1000)"])
        pids["python"] = python.pid
        forker = start(
            [sys.executable, "-c", FORKER, str(device_file)],
            stdout=subprocess.PIPE,
            start_new_session=True,  # its process group is its pid, which its child keeps
        )
        assert forker.stdout is not None
        child = int(forker.stdout.readline())
        loose.append(child)
        forker.wait(timeout=10)
        pids["gone"], pids["child"] = forker.pid, child
        unshared = start(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "1000"])
        deadline = time.monotonic() + 10
        while not _children(unshared.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (pids["namespaced"],) = _children(unshared.pid)
        other = start(["sleep", "1000"], user=user.uid, group=user.gid, extra_groups=[])
        pids["other_user"] = other.pid
        charges = {
            "trainer": 0,  # set below, from its reserved
            "python": 3 * GiB,
            "gone": 6 * GiB,
            "namespaced": 2 * GiB,
            "other_user": 1 * GiB,
        }
        made = Box(work, library, sockets, state, device_file, pids, charges)
        # The trainer's charge: its reserved and 700 MiB outside PyTorch (its context, say).
        deadline = time.monotonic() + 60
        reserved = None
        while reserved is None and time.monotonic() < deadline:
            agents = made.once()["agents"]
            devices = [a["devices"] for a in agents if a["pid"] == pids["trainer"]]
            if devices and devices[0]:
                reserved = devices[0][0]["reserved_bytes"]
            else:
                time.sleep(0.5)
        assert reserved is not None, "the trainer did not connect"
        charges["trainer"] = reserved + 700 * MiB
        used = sum(charges.values()) + UNATTRIBUTED + RESERVED  # v2 keeps RESERVED out of used
        State(
            gpus=[Gpu(used=used)],
            processes=[(0, pids[name], charge) for name, charge in charges.items()],
        ).write(state)
        yield made
    finally:
        for process in started:
            process.kill()
        for pid in loose:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in started:
            process.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def _parts(device: dict[str, Any]) -> dict[str, dict[str, Any]]:
    accounting = device["accounting"]
    assert accounting["used_bytes"] == device["used_bytes"]
    assert sum(p["bytes"] for p in accounting["parts"]) == device["used_bytes"]  # exactly
    return {p["part"]: p for p in accounting["parts"]}


def _process(part: dict[str, Any], pid: int) -> dict[str, Any]:
    return next(p for p in part["processes"] if p["pid"] == pid)


def test_every_byte_has_an_owner_or_a_reason_as_root(box: Box) -> None:
    report = box.once()
    (device,) = report["devices"]
    parts = _parts(device)
    pids, charges = box.pids, box.charges
    trainer = next(a for a in report["agents"] if a["pid"] == pids["trainer"])["devices"][0]

    assert parts["agents_reserved"]["pids"] == [pids["trainer"]]
    assert parts["agents_reserved"]["bytes"] == trainer["reserved_bytes"]
    assert parts["agents_outside_pytorch"]["pids"] == [pids["trainer"]]
    assert parts["agents_outside_pytorch"]["bytes"] == trainer["non_pytorch_bytes"]

    # A Python process of root's without an agent: attachable, and how.
    assert parts["no_agent"]["pids"] == [pids["python"], pids["other_user"]]
    python = _process(parts["no_agent"], pids["python"])
    assert python["attachable"] is True and python["why"] == f"memtop attach {pids['python']}"
    # Another user's process, seen by root: not Python, so no agent.
    sleeper = _process(parts["no_agent"], pids["other_user"])
    assert sleeper["attachable"] is False and "not a Python process" in sleeper["why"]
    assert parts["no_agent"]["bytes"] == charges["python"] + charges["other_user"]

    # Another pid namespace: named as such, with its pid there.
    assert parts["other_namespace"]["pids"] == [pids["namespaced"]]
    assert parts["other_namespace"]["bytes"] == charges["namespaced"]
    assert "pid 1 there" in _process(parts["other_namespace"], pids["namespaced"])["why"]

    # The gone pid, and its child that keeps the device file open: what to stop.
    assert parts["gone"]["pids"] == [pids["gone"]]
    assert parts["gone"]["bytes"] == charges["gone"]
    gone = _process(parts["gone"], pids["gone"])
    holders = gone["holders"]
    assert holders[0]["pid"] == pids["child"] and holders[0]["kin"] is True
    assert holders[0]["files"] == [str(box.device_file)]
    assert f"held by {pids['child']}" in gone["why"] and "stop it" in gone["why"]

    assert parts["other_users"]["bytes"] == 0
    assert parts["unattributed"]["bytes"] == UNATTRIBUTED
    assert parts["unattributed"]["note"]


def test_every_byte_has_an_owner_or_a_reason_as_a_user(box: Box, user: LocalUser) -> None:
    """To a user, root's processes are another user's: it may not read where they run, nor
    attach to them; the sum is still exact."""
    report = box.once(user)
    (device,) = report["devices"]
    parts = _parts(device)
    pids, charges = box.pids, box.charges
    # The trainer's agent is root's: the user sees no agent (its socket folder is root's).
    others = {pids["trainer"], pids["python"], pids["namespaced"]}
    assert set(parts["other_users"]["pids"]) == others
    assert parts["other_users"]["bytes"] == sum(
        charges[n] for n in ("trainer", "python", "namespaced")
    )
    assert all("attach as that user" in p["why"] for p in parts["other_users"]["processes"])
    # Its own process: no agent, not Python.
    assert parts["no_agent"]["pids"] == [pids["other_user"]]
    # The gone pid is gone for it too; root's child holding the device it may not read.
    assert parts["gone"]["pids"] == [pids["gone"]]
    assert _process(parts["gone"], pids["gone"])["holders"] == []
    assert parts["unattributed"]["bytes"] == UNATTRIBUTED


def test_the_exporter_says_each_part(box: Box) -> None:
    """`memtop_gpu_memory_accounted_bytes{part=...}` sums to the used bytes."""
    scrape = (
        "import sys\n"
        "from pathlib import Path\n"
        "from memtop.export.metrics import render\n"
        "from memtop.export.text import exposition\n"
        "from memtop.engine.observation import Observer\n"
        "from memtop.engine.sampler import Sampler\n"
        "from memtop.sources.agents import AgentPool\n"
        "from memtop.sources.devices import DefaultDeviceSource\n"
        "from memtop.engine.store import Store\n"
        "store = Store()\n"
        "sockets = Path(sys.argv[1])\n"
        "sampler = Sampler(store, DefaultDeviceSource(sockets), AgentPool(sockets))\n"
        "sampler.sample_once()\n"
        "print(exposition(render(Observer(store).latest())).decode())\n"
    )
    environment = env(
        box.library,
        box.state,
        {**os.environ, "MEMTOP_DEVICE_FILES": str(box.device_file.parent / "nvidia")},
    )
    done = subprocess.run(
        [sys.executable, "-c", scrape, str(box.sockets)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    parts: dict[str, float] = {}
    used = None
    for line in done.stdout.splitlines():
        if line.startswith("memtop_gpu_memory_accounted_bytes{"):
            part = line.split('part="', 1)[1].split('"', 1)[0]
            parts[part] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("memtop_gpu_memory_used_bytes{"):
            used = float(line.rsplit(" ", 1)[1])
    assert used is not None and sum(parts.values()) == used
    assert parts["gone"] == box.charges["gone"]
    assert parts["other_namespace"] == box.charges["namespaced"]
    assert parts["unattributed"] == UNATTRIBUTED
