"""What the OOM flight recorder costs the trainer, on the simulated allocator.

Prints: the time `OomRecorder.observe` spends on the allocating thread (counters, a trace-free
snapshot summary, the step marks of the last 60 s) for caches of increasing size, the time
until the report is on disk (the agent's I/O worker), and the report's size.  The observer
runs only at an OOM; the step hook's added work (one more optimizer pre-hook, the peak and
cumulative counters read with the allocated bytes) is measured by bench/agent_overhead.py.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe

MiB = 1 << 20
GiB = 1 << 30


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="mt-oom-bench-"))
    os.environ["MEMTOP_OOM_DIR"] = str(root / "oom")
    sockets = root / "s"
    sockets.mkdir(mode=0o700)
    print(f"{'live blocks':>12} {'segments':>9} {'observe ms':>11} {'on disk ms':>11} {'KiB':>6}")
    for blocks in (100, 1000, 10000):
        allocator = SimulatedCachingAllocator(LocalDeviceMemory(80 * GiB), 0)
        device = ProbeDevice(0, "GPU-bench", "Sim", 80 * GiB)
        agent = Agent(SimulatedProbe([SimulatedGpu(device, allocator)]), sockets)
        agent.start()
        agent.boundary.mark_interval_s = 0.0
        live = [allocator.malloc((i % 37 + 1) * 64 * 1024) for i in range(blocks)]
        for i in range(0, len(live), 3):
            allocator.free(live[i])  # holes: a realistic, split cache
        for _ in range(1200):  # 60 s of marks at 20 a second
            agent.on_step(explicit=True)
        observe, disk = [], []
        for _ in range(5):
            recorder = agent.oom
            recorder._last_report = -1e9  # one report each, for the bench
            recorder._event_started = -1e9
            started = time.perf_counter()
            recorder.observe(0, 10 * GiB, 80 * GiB, 1 * GiB)
            observe.append(time.perf_counter() - started)
            recorder.flush(10)
            disk.append(time.perf_counter() - started)
        size = max(p.stat().st_size for p in (root / "oom").glob("oom-*.json"))
        segments = len(allocator.memory_snapshot())
        print(
            f"{blocks:>12} {segments:>9} {statistics.median(observe) * 1e3:>11.2f} "
            f"{statistics.median(disk) * 1e3:>11.2f} {size / 1024:>6.0f}"
        )
        agent.stop()


if __name__ == "__main__":
    main()
