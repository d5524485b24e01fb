"""`memtop demo`: simulated GPUs and simulated trainer processes with real agents.

The simulated GPUs live in a registry directory `sim-<demo pid>` beside the agent sockets, so a
separate `memtop` (or `memtop --once`) finds them while the demo runs, and stops seeing them
when it ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

from memtop import protocol
from memtop.base.children import python_command, stop_all
from memtop.base.records import record
from memtop.sim.device import VENDORS, SimGpuRegistry, simulated_gpu_specs
from memtop.sim.scenario_names import DEMO_SCENARIOS

GiB = 1 << 30
LOGS_KEPT = 5  # the newest demo logs kept in the state directory's demo/


@record(frozen=True)
class TrainerPlan:
    """One simulated trainer the demo starts: its GPU, scenario, scale and seed."""

    gpu: int
    scenario: str
    scale: float = 1.0
    seed: int = 0
    rank: int | None = None  # a rank of a DDP job: RANK / LOCAL_RANK / WORLD_SIZE set for it
    world_size: int | None = None


# The most GPUs one demo simulates: one trainer each (a few more with `mixed`), every one a
# Python process stepping a simulated allocator.  16 is the most one box holds (DGX-2 and HGX-2
# boards; 8 on today's DGX/HGX H100 and MI300X platforms); `--gpus 1000` started ~1,003 trainers
# (load 50, nothing on screen for 20 s).
MAX_GPUS = 16


def gpus_problem(gpus: int) -> str:
    """Why `--gpus N` cannot be simulated (one line)."""
    if gpus < 1:
        return "--gpus must be at least 1"
    return (
        f"--gpus {gpus}: a demo simulates at most {MAX_GPUS} GPUs (one trainer each; "
        f"{MAX_GPUS} is the most one box holds)"
    )


def plan(scenario: str, gpus: int) -> list[TrainerPlan]:
    """Which trainer runs where.  `mixed`: one healthy rank per GPU (like DDP), plus a leaking
    job sharing GPU 0 and a fragmenting one sharing the last GPU."""
    if scenario != "mixed":
        return [TrainerPlan(gpu, scenario, seed=gpu) for gpu in range(gpus)]
    ranked = gpus >= 2  # a job of one rank per GPU, as torchrun would start it
    plans = [
        TrainerPlan(
            gpu,
            "healthy",
            scale=0.5,
            seed=gpu,
            rank=gpu if ranked else None,
            world_size=gpus if ranked else None,
        )
        for gpu in range(gpus)
    ]
    plans.append(TrainerPlan(0, "leak", scale=0.5, seed=100))
    plans.append(TrainerPlan(gpus - 1, "fragment", scale=0.5, seed=101))
    if gpus >= 3:
        plans.append(TrainerPlan(1, "pressure", scale=0.55, seed=102))
    return plans


def registry_dir(socket_dir: Path, demo_pid: int) -> Path:
    return socket_dir / f"sim-{demo_pid}"


def live_registries(socket_dir: Path | None = None) -> list[Path]:
    """Registries of demos still running (a dead demo's registry is removed on the way)."""
    directory = socket_dir or protocol.socket_dir()
    found = []
    with contextlib.suppress(OSError):
        # Names first, a Path only for a registry: the directory also holds every agent's
        # socket, and a viewer looks here every second.
        for name in sorted(os.listdir(directory)):
            stem, _, pid_text = name.partition("-")
            pid = protocol.decimal(pid_text)
            if stem != "sim" or pid is None:
                continue
            if protocol.pid_alive(pid):
                found.append(directory / name)
            else:
                shutil.rmtree(directory / name, ignore_errors=True)
    return found


def log_path(demo_pid: int) -> Path:
    """Where the dashboard's demo keeps its trainers' messages: on the terminal they would be
    drawn over the dashboard. Private (0700) and pruned to the newest LOGS_KEPT."""
    directory = protocol.ensure_private_dir(protocol.state_dir() / "demo")
    logs = []
    for path in directory.glob("demo-*.log"):
        with contextlib.suppress(OSError):  # another demo may be pruning too
            logs.append((path.lstat().st_mtime, path))
    for _, old in sorted(logs)[: max(0, len(logs) - (LOGS_KEPT - 1))]:
        with contextlib.suppress(OSError):
            old.unlink()
    return directory / f"demo-{demo_pid}.log"


def open_log(path: Path) -> int:
    """A fresh private file for the trainers' stdout and stderr; never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Demo:
    def __init__(
        self,
        gpus: int = 1,
        scenario: str = "mixed",
        step_time: float = 0.1,
        total_bytes: int | None = None,
        socket_dir: Path | None = None,
        extra_env: dict[str, str] | None = None,
        log_messages: bool = False,
        vendor: str = "nvidia",
    ) -> None:
        """`log_messages`: the trainers' messages (OOMs, restarts) go to a log file (`log_path`;
        on a dashboard's terminal they would be drawn over it), not to this process's stderr.
        `vendor`: "amd" simulates MI300X GPUs (192 GiB) and trainers on ROCm: amdsmi's UUIDs
        for the GPUs, HIP's in the trainers' hellos, so the viewer joins them by PCI bus id.
        `total_bytes`: each GPU's memory (default: 80 GiB, an H100; 192 GiB, an MI300X)."""
        if scenario not in DEMO_SCENARIOS:
            raise ValueError(
                f"unknown scenario {scenario!r}; choose from {', '.join(DEMO_SCENARIOS)}"
            )
        if not 1 <= gpus <= MAX_GPUS:
            raise ValueError(gpus_problem(gpus))
        if vendor not in VENDORS:
            raise ValueError(f"unknown vendor {vendor!r}; choose from {', '.join(VENDORS)}")
        if total_bytes is None:
            total_bytes = (192 if vendor == "amd" else 80) * GiB
        self.vendor = vendor
        self.gpus = gpus
        self.scenario = scenario
        self.step_time = step_time
        self.total_bytes = total_bytes
        self.socket_dir = socket_dir
        self.extra_env = extra_env or {}
        self.log_messages = log_messages
        self.log: Path | None = None  # the log file, once started with log_messages
        self.log_problem: str | None = None  # why there is none
        self.registry: Path | None = None
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> list[int]:
        directory = protocol.ensure_socket_dir(self.socket_dir)
        self.registry = registry_dir(directory, os.getpid())
        SimGpuRegistry(self.registry).create(
            simulated_gpu_specs(
                self.gpus, self.total_bytes, seed=str(os.getpid()), vendor=self.vendor
            )
        )
        # The user's *_VISIBLE_DEVICES name real GPUs, not the demo's: the simulated trainers
        # would map their --gpu through them (extra_env may set them on purpose).
        env = {k: v for k, v in os.environ.items() if not k.endswith("_VISIBLE_DEVICES")}
        env.update(self.extra_env)
        if self.socket_dir is not None:
            env["MEMTOP_SOCKET_DIR"] = str(self.socket_dir)
        output = self._open_log() if self.log_messages else None
        try:
            self._spawn(env, output)
        finally:
            if output is not None:
                os.close(output)  # the trainers hold their own copies
        return [p.pid for p in self.processes]

    def _spawn(self, env: dict[str, str], output: int | None) -> None:
        for trainer in plan(self.scenario, self.gpus):
            # Isolated from the caller's directory (root's demo in another user's folder).
            command = python_command(
                "memtop.sim.trainer",
                "--registry",
                str(self.registry),
                "--gpu",
                str(trainer.gpu),
                "--scenario",
                trainer.scenario,
                "--step-time",
                str(self.step_time),
                "--scale",
                str(trainer.scale),
                "--seed",
                str(trainer.seed),
                "--parent",
                str(os.getpid()),
                environ=env,
            )
            rank_env = {}
            if trainer.rank is not None:
                rank_env = {
                    "RANK": str(trainer.rank),
                    "LOCAL_RANK": str(trainer.rank),
                    "WORLD_SIZE": str(trainer.world_size),
                }
            self.processes.append(
                subprocess.Popen(
                    command,
                    env={**env, **rank_env},
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=output,
                    start_new_session=True,
                )
            )

    def _open_log(self) -> int:
        try:
            path = log_path(os.getpid())
            fd = open_log(path)
        except (protocol.UnsafeSocketDir, OSError) as exc:
            # The demo runs on: its messages would only be in the way of the dashboard.
            self.log_problem = f"memtop demo: the simulated trainers' messages are lost: {exc}"
            return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        self.log = path
        return fd

    def log_summary(self) -> str | None:
        """After stop(): one line naming the log when the trainers said something (an empty
        log is removed)."""
        if self.log is None:
            return self.log_problem
        try:
            with open(self.log, "rb") as f:
                lines = f.read().count(b"\n")
            if lines == 0:
                os.unlink(self.log)
                return None
        except OSError:
            return None
        said = f"{lines} line{'s' if lines != 1 else ''}"
        return f"memtop demo: the simulated trainers' messages ({said}) are in {self.log}"

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """True once every trainer's agent socket exists."""
        directory = self.socket_dir or protocol.socket_dir()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = set(protocol.list_agent_sockets(directory, remove_stale=False))
            if all(p.pid in live for p in self.processes):
                return True
            if any(p.poll() is not None for p in self.processes):
                return False
            time.sleep(0.05)
        return False

    def failed(self) -> list[int]:
        return [p.pid for p in self.processes if p.poll() not in (None, 0)]

    def stop(self, timeout: float = 5.0) -> None:
        stop_all(self.processes, signal.SIGTERM, timeout)
        directory = self.socket_dir or protocol.socket_dir()
        for process in self.processes:
            with contextlib.suppress(OSError):
                os.unlink(protocol.socket_path(process.pid, directory))
        if self.registry is not None:
            shutil.rmtree(self.registry, ignore_errors=True)

    def __enter__(self) -> Demo:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
