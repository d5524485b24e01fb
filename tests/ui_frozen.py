"""A store filled with fixed, made-up readings: the dashboard's frozen data for snapshot tests.

Two GPUs; on GPU 0 a healthy trainer and a leaking one, on GPU 1 a fragmenting trainer, plus
processes without an agent (one of another user).  Every time is fixed, so the diagnosis and
the rendered screen are the same on every run.
"""

from __future__ import annotations

from memtop.engine.store import Store
from memtop.model import (
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentSample,
    DeviceReading,
    DriverReading,
    GpuProcess,
    StepMark,
)
from memtop.protocol.schema import parse_breakdown
from memtop.sources.agents import CONNECTED, EXITED, AgentView
from memtop.sources.processes import ProcessInfo

MiB = 1 << 20
GiB = 1 << 30
T0 = 1_790_000_000.0
SECONDS = 300  # of history
NOW = T0 + SECONDS
TOTAL = 80 * GiB
MY_UID = 1000
UUIDS = ("GPU-0a1b2c3d", "GPU-4e5f6a7b")
CONTEXT = 500 * MiB  # what the driver charges beyond reserved (CUDA context)


def _stats(allocated: int, reserved: int, peak: int, split: int, retries: int = 0) -> dict:
    return {
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": peak,
        "inactive_split_bytes.all.current": split,
        "inactive_split_bytes.large_pool.current": split,
        "reserved_bytes.large_pool.current": reserved,
        "requested_bytes.all.current": allocated - 2 * MiB,
        "num_alloc_retries": retries,
        "num_ooms": 0,
    }


class Trainer:
    def __init__(self, pid: int, gpu: int, kind: str, rank: int | None = None) -> None:
        self.pid = pid
        self.gpu = gpu
        self.kind = kind
        self.rank = rank  # set: a rank of a 2-rank torchrun job launched by LAUNCHER

    def baseline(self, step: int) -> int:
        if self.kind == "leak":
            return 6 * GiB + step * 8 * MiB
        if self.kind == "fragment":
            return 2 * GiB
        return 12 * GiB

    def at(self, t: int) -> tuple[int, int, int, int]:
        """allocated, reserved, peak, inactive split at second t."""
        step = 2 * t
        base = self.baseline(step)
        activations = {"healthy": 6 * GiB, "leak": 4 * GiB, "fragment": 1 * GiB}[self.kind]
        allocated = base + (activations * (t % 3)) // 3
        peak = self.baseline(step) + activations
        reserved = {"healthy": 19 * GiB, "leak": peak + GiB, "fragment": 5 * GiB}[self.kind]
        split = {"healthy": 200 * MiB, "leak": 300 * MiB, "fragment": int(1.6 * GiB)}[self.kind]
        return allocated, reserved, peak, split

    def hello(self) -> AgentHello:
        return AgentHello(
            protocol=1,
            pid=self.pid,
            argv=("train.py", f"--config={self.kind}.yaml"),
            python="3.12.3",
            torch="2.13.0",
            allocator_conf="",
            devices=(AgentDevice(0, UUIDS[self.gpu], "NVIDIA H100 80GB HBM3", TOTAL),),
            extra={}
            if self.rank is None
            else {"rank": self.rank, "local_rank": 0, "world_size": 2},
        )


TRAINERS = (Trainer(4101, 0, "healthy"), Trainer(4102, 0, "leak"), Trainer(4201, 1, "fragment"))
LAUNCHER = 4000
# The same machine with 4101 and 4201 as ranks 0 and 1 of one torchrun job.
RANKED = (
    Trainer(4101, 0, "healthy", rank=0),
    Trainer(4102, 0, "leak"),
    Trainer(4201, 1, "fragment", rank=1),
)
OTHERS = ((0, 7001, 3 * GiB), (1, 7002, 900 * MiB))  # (gpu, pid, used) without an agent


def nvml_at(t: int, gpu_error: str | None = None) -> DriverReading:
    devices = []
    for gpu in (0, 1):
        processes = [GpuProcess(tr.pid, tr.at(t)[1] + CONTEXT) for tr in TRAINERS if tr.gpu == gpu]
        processes += [GpuProcess(pid, used) for g, pid, used in OTHERS if g == gpu]
        used = sum(p.used_bytes or 0 for p in processes)
        error = gpu_error if gpu == 1 else None
        devices.append(
            DeviceReading(
                index=gpu,
                uuid=UUIDS[gpu],
                name="NVIDIA H100 80GB HBM3",
                total_bytes=TOTAL,
                used_bytes=None if error else used,
                free_bytes=None if error else TOTAL - used,
                processes=tuple(processes),
                error=error,
            )
        )
    return DriverReading(available=True, devices=tuple(devices), driver_version="550.54.15")


def poll_at(trainer: Trainer, t: int, free: int) -> AgentView:
    allocated, reserved, peak, split = trainer.at(t)
    marks = tuple(
        StepMark(step, T0 + step / 2, {0: trainer.baseline(step)}) for step in (2 * t, 2 * t + 1)
    )
    sample = AgentSample(
        time=T0 + t,
        step=2 * t + 1,
        devices=(AgentDeviceSample(0, _stats(allocated, reserved, peak, split), free, TOTAL),),
        step_marks=marks,
    )
    return AgentView(trainer.pid, CONNECTED, trainer.hello(), sample)


def frozen_store(
    exited: int | None = None,
    gpu_error: str | None = None,
    problem: str | None = None,
    ranked: bool = False,
) -> Store:
    """The store after SECONDS of sampling; `exited` names a trainer whose agent went away at
    the end, `gpu_error` fails GPU 1 in the last reading, `ranked` makes two trainers ranks
    of one torchrun job."""
    trainers = RANKED if ranked else TRAINERS
    store = Store()
    for t in range(SECONDS + 1):
        reading = nvml_at(t, gpu_error if t == SECONDS else None)
        store.update_driver(reading, T0 + t)
        polls = []
        for trainer in trainers:
            if trainer.pid == exited and t == SECONDS:
                polls.append(AgentView(trainer.pid, EXITED, trainer.hello(), error="socket gone"))
                continue
            device = reading.devices[trainer.gpu]
            free = device.free_bytes if device.free_bytes is not None else TOTAL // 2
            polls.append(poll_at(trainer, t, free))
        store.update_agents(polls, T0 + t + 0.01)
    for trainer in TRAINERS:
        store.update_breakdown(
            trainer.pid,
            parse_breakdown(
                {
                    "devices": {
                        "0": {
                            "parameters": 3 * GiB,
                            "gradients": 3 * GiB,
                            "optimizer_state": 6 * GiB,
                            "other": 2 * GiB,
                            "fp32_parameter_bytes": 3 * GiB,
                        }
                    }
                }
            ),
            NOW,
        )
    store.update_processes(
        {
            **{
                tr.pid: ProcessInfo(
                    tr.pid,
                    MY_UID,
                    "ada",
                    ("python", *tr.hello().argv),
                    "python",
                    create_time=T0 - 3600 + tr.pid % 100 * 60,
                    ppid=LAUNCHER if tr.rank is not None else 1,
                    cpu_percent=98.0 + tr.pid % 3,
                    rss=3 * GiB + tr.pid % 100 * MiB,
                )
                for tr in trainers
            },
            7001: ProcessInfo(7001, 1001, "grace", ("python", "eval.py"), "python"),
            7002: ProcessInfo(7002, MY_UID, "ada", ("Xorg",), "Xorg"),
        }
    )
    if problem:
        store.set_problems([problem])
    return store
