"""What one floor reading costs (memtop/agent/floor.py), on CPU torch or on CUDA.

    .venv/bin/python bench/floor_cost.py [--device cpu|cuda] [--reads 5000] [--steps 200]

While a viewer watches a process without steps, the agent thread reads each device's allocated
bytes ~10 times a second (`FloorReader.read_if_due` over the real `TorchProbe`).  This prints:
- `read_us`: one floor reading (one device), the agent thread's side, median of `--reads`;
- `probe_read_us`: the probe's `memory_allocated` alone (on CUDA the allocator's host-side
  counters, `torch._C._cuda_memoryStats`, which takes the allocator's mutex; on a CPU-only torch
  it returns at `torch.cuda.is_initialized()`, so the figure there is the Python around it);
- on CUDA, a small trainer's step time with a thread taking floor readings at 10 Hz (what the
  agent does) and at 1 kHz (100 times more, to make any contention on the allocator's mutex
  visible), each against the same loop without, alternated so drift cancels.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from memtop.agent.boundary import StepBoundary
from memtop.agent.floor import FloorReader, FloorState
from memtop.agent.torch_probe import TorchProbe


def per_call_us(call: Callable[[], object], count: int) -> float:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reads", type=int, default=5000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)
    ).to(args.device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 1024, device=args.device)

    def step() -> None:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    step()
    probe = TorchProbe()
    reader = FloorReader(probe, StepBoundary(probe))
    reader.devices_sampled([0])
    state = FloorState()

    def one_reading() -> None:
        state.sampled_at = time.monotonic()
        reader.next_at = 0.0
        reader.read_if_due([state], time.monotonic())

    result: dict[str, object] = {
        "device": args.device,
        "torch": torch.__version__,
        "read_us": per_call_us(one_reading, args.reads),
        "probe_read_us": per_call_us(lambda: probe.memory_allocated(0), args.reads),
        "reads_counted": reader.reads,
    }
    if cuda:
        for hz in (10, 1000):
            stop = threading.Event()

            def read_at(rate: float, stop: threading.Event) -> None:
                while not stop.wait(1.0 / rate):
                    one_reading()

            off: list[float] = []
            on: list[float] = []
            for _ in range(3):
                for target, reading in ((off, False), (on, True)):
                    thread = threading.Thread(target=read_at, args=(hz, stop), daemon=True)
                    if reading:
                        stop.clear()
                        thread.start()
                    for _ in range(args.steps // 3):
                        started = time.perf_counter()
                        step()
                        target.append(time.perf_counter() - started)
                    if reading:
                        stop.set()
                        thread.join()
            off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
            result[f"step_ms_without_{hz}hz"] = round(off_ms, 4)
            result[f"step_ms_with_{hz}hz"] = round(on_ms, 4)
            result[f"slowdown_pct_{hz}hz"] = round(100 * (on_ms / off_ms - 1), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
