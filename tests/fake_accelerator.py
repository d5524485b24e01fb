"""A device backend in pure Python, for tests/test_probe_seam.py: what a second accelerator's
module of memtop.agent.backends looks like (NAME, detect(), a class with DeviceBackend's
methods), with no torch.cuda and no device behind it.  It has one device, "Fake Accelerator",
whose allocator holds 3 MiB of a 1 GiB budget, and it remembers the thread of every call."""

from __future__ import annotations

import threading
from typing import Any

from memtop.agent.probe import ProbeDevice

NAME = "fake"
MiB = 1 << 20
GiB = 1 << 30
DEVICE = ProbeDevice(0, "FAKE-0000-0001", "Fake Accelerator", GiB, "0000:42:00.0")
STATS = {
    "allocated_bytes.all.current": 3 * MiB,
    "allocated_bytes.all.peak": 5 * MiB,
    "reserved_bytes.all.current": 8 * MiB,
    "num_ooms": 0,
}
# (method, thread name) of every call, in order: the test reads it.
calls: list[tuple[str, str]] = []


def detect() -> FakeBackend:
    return FakeBackend()


class FakeBackend:
    tensor_device_type = "cpu"  # the breakdown walks the trainer's CPU tensors

    def _called(self, name: str) -> None:
        calls.append((name, threading.current_thread().name))

    def devices(self) -> list[ProbeDevice]:
        self._called("devices")
        return [DEVICE]

    def memory_stats(self, index: int) -> dict[str, int]:
        self._called("memory_stats")
        return dict(STATS)

    def memory_allocated(self, index: int) -> int:
        self._called("memory_allocated")
        return STATS["allocated_bytes.all.current"]

    def reset_peak(self, index: int) -> None:
        self._called("reset_peak")

    def is_capturing(self) -> bool:
        self._called("is_capturing")
        return False

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self._called("mem_get_info")
        return GiB - 100 * MiB, GiB

    def empty_cache(self, index: int) -> None:
        self._called("empty_cache")

    def snapshot(self) -> dict[str, Any]:
        self._called("snapshot")
        return {"segments": [], "device_traces": [[]]}
