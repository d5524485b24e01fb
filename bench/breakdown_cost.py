"""Cost of the agent's memory breakdown (`count_optimizer_memory`) on a realistic optimizer.

    .venv/bin/python bench/breakdown_cost.py [--layers 48] [--width 128] [--runs 50]

The breakdown runs on the agent thread, under the GIL, while the trainer trains: its time is
time the trainer may wait.  What it costs depends on the number of tensors it walks, not on
their size, so the model is a CPU stack with the tensor count of a 48-layer transformer (per
layer: two LayerNorms, a fused QKV projection, an output projection and a two-layer MLP, each
with weight and bias; ~580 parameter tensors) at a small width.  Adam has taken one step, so
each parameter has a gradient and three state tensors (exp_avg, exp_avg_sq, step).

The count is timed `--runs` times after a few warm-up runs, with one torch thread, and the
median and p99 (with 50 runs: the slowest but one) are reported in milliseconds.  The last line
of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARMUP = 5


def build(layers: int, width: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, h: Any) -> Any:
            q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
            h = h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return h + self.down(F.gelu(self.up(self.ln2(h))))

    torch.manual_seed(0)
    vocab = 1000
    model = nn.Sequential(
        nn.Embedding(vocab, width), *(Block() for _ in range(layers)), nn.LayerNorm(width)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (2, 16))
    model(tokens).square().mean().backward()
    optimizer.step()
    return model, optimizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()

    import torch

    from memtop.agent.torch_probe import count_optimizer_memory

    torch.set_num_threads(1)
    _, optimizer = build(args.layers, args.width)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert len(grads) == len(params), "every parameter should have a gradient"
    assert len(state) == 3 * len(params), "Adam keeps exp_avg, exp_avg_sq and step"

    for _ in range(WARMUP):
        counts = count_optimizer_memory([optimizer], device_type="cpu")
    times_ms = []
    for _ in range(args.runs):
        start = time.perf_counter()
        counts = count_optimizer_memory([optimizer], device_type="cpu")
        times_ms.append((time.perf_counter() - start) * 1e3)
    times_ms.sort()
    median = statistics.median(times_ms)
    p99 = statistics.quantiles(times_ms, n=100, method="inclusive")[98]
    tensors = len(params) + len(grads) + len(state)

    roles = counts[-1]
    print(f"model: {args.layers} layers, width {args.width}, {len(params)} parameter tensors")
    print(
        f"counted: parameters {roles.parameters / 2**20:.1f} MiB, gradients"
        f" {roles.gradients / 2**20:.1f} MiB, optimizer state {roles.optimizer_state / 2**20:.1f}"
        " MiB"
    )
    print(f"{args.runs} runs over {tensors} tensors: median {median:.3f} ms, p99 {p99:.3f} ms")
    print(
        json.dumps(
            {
                "parameter_tensors": len(params),
                "tensors": tensors,
                "runs": args.runs,
                "median_ms": round(median, 3),
                "p99_ms": round(p99, 3),
                "max_ms": round(times_ms[-1], 3),
                "median_us_per_tensor": round(median * 1e3 / tensors, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
