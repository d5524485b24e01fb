"""A small, real PyTorch training loop to watch with memtop.

    memtop run examples/train_cpu.py               # until Ctrl-C
    memtop run examples/train_cpu.py --steps 500 --step-time 0.01
    memtop run examples/train_cpu.py --device cpu --keep-logits   # a host-memory leak

An MLP learns a fixed random function on synthetic data with AdamW.  Nothing here knows about
memtop: under `memtop run`, the agent counts steps through torch's global optimizer step hook.
Runs on CUDA when available (then memtop shows its allocator live), else on the CPU.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="steps to run (0: until Ctrl-C)")
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step, seconds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument(
        "--keep-logits",
        action="store_true",
        help="keep each step's logits with their graph (a leak: their activations stay alive)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    features = 32
    model = nn.Sequential(
        nn.Linear(features, args.width),
        nn.GELU(),
        nn.LayerNorm(args.width),
        nn.Linear(args.width, args.width),
        nn.GELU(),
        nn.Linear(args.width, 1),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    target = torch.randn(features, 1, device=device)  # the function to learn: sin(x @ target)

    kept: list[torch.Tensor] = []  # --keep-logits: the classic leak, `outputs.append(logits)`
    step, started = 0, time.monotonic()
    try:
        while args.steps == 0 or step < args.steps:
            x = torch.randn(args.batch_size, features, device=device)
            loss = nn.functional.mse_loss(model(x), torch.sin(x @ target))
            if args.keep_logits:
                # Logits kept for a metric later, outside torch.no_grad() and not detached: the
                # graph they carry keeps this step's activations alive.
                kept.append(model(x))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 100 == 0:
                rate = step / (time.monotonic() - started)
                memory = ""
                if device.type == "cuda":
                    memory = f"  allocated {torch.cuda.memory_allocated(device) / 2**20:.1f} MiB"
                print(
                    f"step {step}  loss {loss.item():.4f}  {rate:.0f} steps/s{memory}", flush=True
                )
            if args.step_time > 0:
                time.sleep(args.step_time)
    except KeyboardInterrupt:
        print(f"interrupted after {step} steps", flush=True)


if __name__ == "__main__":
    main()
