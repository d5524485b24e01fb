"""The agent's wire replies, pinned byte for byte (apart from what changes from run to run), for
a simulated trainer and a CPU torch trainer: the probe seam (memtop.agent.backends) moved every
torch.cuda call of the agent without changing one byte a viewer reads.

`tests/probe_wire_trainer.py` starts the agent as a trainer does and prints the raw reply
frames; the volatile values (times, pids, counters, the host's memory) are replaced by their
type's placeholder, a null kept null, so that every key, its order and every other value is
compared.  `MEMTOP_PIN_WIRE=1` writes the files again (only when a change of the wire is meant).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
PINNED = HERE / "data" / "probe_wire"
# Keys whose values change from run to run (or machine to machine): their type is kept.
VOLATILE = {
    "pid", "started", "cwd", "agent_thread_id", "python", "agent_version", "torch", "time",
    "took_s", "step", "last_step_time", "phase_since", "free_measured_at", "host_memory",
    "host_rss_bytes", "host_heap_free_bytes", "agent",
}  # fmt: skip
COMPACT = (",", ":")


def _mask(value: Any, volatile: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _mask(v, volatile or k in VOLATILE) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, volatile) for v in value]
    if not volatile or value is None or isinstance(value, bool):
        return value
    return {int: 0, float: 0.0, str: "<s>"}.get(type(value), value)


def normalised(raw: str) -> str:
    reply = json.loads(raw)
    # The agent writes compact JSON in its own key order: re-encoding gives the same bytes.
    assert json.dumps(reply, separators=COMPACT) == raw
    result = reply.get("result", {})
    marks = result.get("step_marks")
    if marks:  # how many steps fall between two requests varies: the first one stands for all
        first = dict(marks[0])
        first.pop("host_heap_free_bytes", None)  # read now and then, not at every mark
        result["step_marks"] = [first]
    return json.dumps(_mask(reply), separators=COMPACT)


@pytest.mark.parametrize("kind", ["sim", "torch"])
def test_the_agents_replies_are_the_pinned_ones(kind: str, socket_dir: Path) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    env = dict(os.environ, MEMTOP_BREAKDOWN_DEVICE="cpu")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        env.pop(name, None)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MEMTOP_STACKS"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(HERE / "probe_wire_trainer.py"), kind, str(socket_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = [normalised(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 5, done.stdout
    pinned = PINNED / f"{kind}.jsonl"
    if os.environ.get("MEMTOP_PIN_WIRE") == "1":
        pinned.write_text("\n".join(lines) + "\n")
    assert lines == pinned.read_text().splitlines()
