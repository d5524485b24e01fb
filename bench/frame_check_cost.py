"""What reading one frame costs (protocol.decode_body: the depth check, then json), by shape.

    .venv/bin/python bench/frame_check_cost.py

Every agent request and every viewer reply goes through decode_body, on the agent's thread
inside the trainer for requests: a frame a client crafts must be refused in time bounded by its
size, and an ordinary request must cost what it did (issue 27, finding 4).  For each shape it
prints the median µs per call (at least 3 calls, more while under 0.3 s) and what happened;
the last line is JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memtop import protocol  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20


def deep(size: int) -> bytes:
    """A request as large as `size` whose args nest as deep as fits (balanced)."""
    head, tail = b'{"id":1,"cmd":"sample","args":', b"}"
    depth = (size - len(head) - len(tail)) // 2
    return head + b"[" * depth + b"]" * depth + tail


def shallow(size: int) -> bytes:
    """A frame of `size` bytes full of small arrays, 2 deep: all of it must be scanned."""
    head, tail = b'{"id":1,"cmd":"sample","args":{"a":[', b"[1]]}}"
    return head + b"[1]," * ((size - len(head) - len(tail)) // 4) + tail


def sample_reply(marks: int) -> bytes:
    """A `sample` reply as the dashboard reads it, with `marks` step marks in rows."""
    mark = {"step": 1, "time": 1.7e9, "allocated": {"0": 123456789}, "reserved": {"0": 1 << 30}}
    device = {"index": 0, "uuid": "GPU-x", "name": "H100", "stats": {"a.b.c": 1} | {}}
    device |= {"free_bytes": 1, "total_bytes": 2, "free_measured_at": None}
    result = {"time": 1.7e9, "step": 5, "devices": [device] * 8, "step_marks": [mark] * marks}
    return json.dumps({"id": 7, "result": result}, separators=(",", ":")).encode()


SHAPES: dict[str, bytes] = {
    "sample request": b'{"id":12,"cmd":"sample","args":{"max_marks":1024,"mark_layout":"columns"}}',
    "hello request": b'{"id":1,"cmd":"hello"}',
    "sample reply, 1024 marks": sample_reply(1024),
    "strings of brackets, 64 KiB": json.dumps(
        {"id": 1, "cmd": "hello", "args": {"s": '[{\\"' * (13 * KiB)}}
    ).encode(),
    "shallow, 64 KiB": shallow(64 * KiB),
    "shallow, 1 MiB": shallow(MiB),
    "deep, 64 KiB": deep(64 * KiB),
    "deep, 1 MiB": deep(MiB),
}


def measure(body: bytes) -> tuple[float, str]:
    times: list[float] = []
    outcome = ""
    spent = 0.0
    while len(times) < 3 or (spent < 0.3 and len(times) < 2000):
        started = time.perf_counter()
        try:
            protocol.decode_body(body)
            outcome = "parsed"
        except protocol.ProtocolError as exc:
            outcome = f"refused: {exc.message[:48]}"
        took = time.perf_counter() - started
        times.append(took)
        spent += took
    return statistics.median(times) * 1e6, outcome


def main() -> int:
    report: dict[str, Any] = {}
    for name, body in SHAPES.items():
        micros, outcome = measure(body)
        report[name] = {"bytes": len(body), "us": round(micros, 1), "outcome": outcome}
        print(f"{name:30} {len(body):>8} B {micros:>12.1f} µs  {outcome}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
