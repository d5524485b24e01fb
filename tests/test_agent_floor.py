"""Floor readings (issue 31 item 3): while a viewer watches a process without steps, the agent
reads allocated ~10 times between two samples and the sample carries the lowest
(`allocated_floor_bytes`, `floor_readings`); no viewer, or steps marked, and it reads nothing.

A real agent in a real trainer process (the simulated allocator, a sawtooth of activations),
asked over its socket as a viewer asks it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memtop import protocol
from memtop.agent import floor
from memtop.protocol import replies

MiB, GiB = 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parents[1]

# A trainer whose allocated is a sawtooth: 64 MiB of weights, and 2 GiB of activations held
# for 0.6 s of every 0.8 s.  With `steps`, each period ends with a marked step.
TRAINER = """
import json, sys, threading, time
from pathlib import Path
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe
GiB = 1 << 30
allocator = SimulatedCachingAllocator(LocalDeviceMemory(16 * GiB), 0)
allocator.malloc(64 << 20)
probe = SimulatedProbe([SimulatedGpu(ProbeDevice(0, "GPU-f", "Sim", 16 * GiB), allocator)])
agent = Agent(probe, Path({directory!r}))
agent.start()
steps = {steps!r}
def train():
    while True:
        block = allocator.malloc(2 * GiB)
        time.sleep(0.6)
        allocator.free(block)
        time.sleep(0.2)
        if steps:
            agent.on_step(explicit=True)
threading.Thread(target=train, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps({{"reads": agent.floor.reads, "errors": list(agent.errors)}}), flush=True)
"""


class _Trainer:
    def __init__(self, directory: Path, steps: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER.format(directory=str(directory), steps=steps)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(ROOT),
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"
        self.path = directory / f"{self.proc.pid}.sock"

    def state(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class _Viewer:
    """One connection, asking `sample` as the dashboard does."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.id = 0

    def sample(self) -> dict[str, Any]:
        self.id += 1
        protocol.send_message(self.sock, {"id": self.id, "cmd": "sample", "args": {}})
        reply = protocol.recv_message(self.sock)
        assert "result" in reply, reply
        return dict(reply["result"])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def no_steps(socket_dir: Path) -> Iterator[_Trainer]:
    trainer = _Trainer(socket_dir, steps=False)
    yield trainer
    trainer.close()


@pytest.fixture
def stepping(socket_dir: Path) -> Iterator[_Trainer]:
    trainer = _Trainer(socket_dir, steps=True)
    yield trainer
    trainer.close()


def _wait_for_socket(path: Path) -> None:
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_sample_carries_the_lowest_allocated_read_since_the_previous_one(no_steps):
    _wait_for_socket(no_steps.path)
    viewer = _Viewer(no_steps.path)
    try:
        first = viewer.sample()
        # A connection's first sample has no readings behind it: the field is absent.
        assert "allocated_floor_bytes" not in first["devices"][0]
        floors, sampled = [], []
        for _ in range(6):
            time.sleep(1.0)
            (device,) = viewer.sample()["devices"]
            floors.append((device["allocated_floor_bytes"], device["floor_readings"]))
            sampled.append(device["stats"]["allocated_bytes.all.current"])
    finally:
        viewer.close()
    # The sample parses, and the viewer keeps the floor beside allocated.
    for floor_bytes, reads in floors:
        # ~10 reads a second, on a busy box fewer; never more than the loop's pace allows.
        assert 3 <= reads <= 1.0 / floor.READING_INTERVAL_S * 1.6 + 1
        assert 64 * MiB <= floor_bytes
    for (floor_bytes, _), allocated in zip(floors, sampled, strict=True):
        assert floor_bytes <= allocated
    # Each second spans a trough of the sawtooth (0.2 s of every 0.8 s): the readings find the
    # weights alone, where the 1 Hz samples mostly land on the activations.
    assert all(floor_bytes < 1 * GiB for floor_bytes, _ in floors), floors
    parsed = protocol.parse_sample(viewer_sample_for_parse(floors[-1]))
    assert parsed.devices[0].allocated_floor == floors[-1][0]
    assert parsed.devices[0].floor_readings == floors[-1][1]
    assert not no_steps.state()["errors"]


def viewer_sample_for_parse(floor_pair: tuple[int, int]) -> dict[str, Any]:
    """A minimal sample reply carrying a floor reading, as the agent writes it."""
    return replies.sample_result(
        time=time.time(),
        step=None,
        devices=[
            replies.sample_device(
                index=0,
                uuid="GPU-f",
                name="Sim",
                stats={"allocated_bytes.all.current": floor_pair[0] + 1},
                free_bytes=0,
                total_bytes=16 * GiB,
                free_measured_at=None,
                floor=floor_pair,
            )
        ],
        step_marks=[],
        columns=False,
        last_step_time=None,
        phase=None,
        phase_since=None,
        oom=None,
        agent={},
    )


def test_no_floor_readings_while_no_viewer_samples(no_steps):
    _wait_for_socket(no_steps.path)
    assert no_steps.state()["reads"] == 0  # nobody connected yet
    viewer = _Viewer(no_steps.path)
    try:
        viewer.sample()
        time.sleep(1.0)
        viewer.sample()
        assert no_steps.state()["reads"] > 0
        # Connected, but no sample for longer than a viewer's window: the readings stop.
        time.sleep(floor.VIEWER_WINDOW_S + 0.5)
        stopped = no_steps.state()["reads"]
        time.sleep(1.5)
        assert no_steps.state()["reads"] == stopped
    finally:
        viewer.close()
    time.sleep(1.0)
    assert no_steps.state()["reads"] == stopped


def test_no_floor_readings_while_the_trainer_marks_steps(stepping):
    _wait_for_socket(stepping.path)
    viewer = _Viewer(stepping.path)
    try:
        # Wait for the first step mark (one a period), then watch as a dashboard does.
        deadline = time.monotonic() + 10
        while viewer.sample()["step"] is None and time.monotonic() < deadline:
            time.sleep(0.2)
        reads_then = stepping.state()["reads"]
        devices = []
        for _ in range(4):
            time.sleep(0.5)
            devices.extend(viewer.sample()["devices"])
    finally:
        viewer.close()
    assert stepping.state()["reads"] == reads_then
    assert all("allocated_floor_bytes" not in device for device in devices)


def test_the_viewer_keeps_the_floor_beside_allocated(no_steps, socket_dir):
    # The real sampler and store: each round's floor reading is kept in the device's history
    # (`allocated_floor`), NaN for the connection's first sample, which has none.
    import math

    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource

    _wait_for_socket(no_steps.path)
    store = Store()
    sampler = Sampler(
        store, DefaultDeviceSource(socket_dir, simulated_only=True), AgentPool(socket_dir)
    )
    try:
        for _ in range(4):
            sampler.sample_once()
            time.sleep(1.0)
    finally:
        sampler.stop()
    history = store.history(no_steps.proc.pid, 0)
    floors, allocated = history["allocated_floor"], history["allocated"]
    assert len(floors) == len(allocated) >= 3
    assert math.isnan(floors[0])
    assert all(f <= a for f, a in zip(floors[1:], allocated[1:], strict=True)), history
    assert all(64 * MiB <= f < 1 * GiB for f in floors[1:]), floors
