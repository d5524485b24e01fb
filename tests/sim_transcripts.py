"""What the simulated allocator decided, step by step, as digests: the yardstick that holds a
faster simulator to the same simulation (tests/test_sim_transcripts.py).

A transcript is one digest per step (or per slice of a random program) of everything an
observer can read: memory_stats() at every pause of the step and at its end, the snapshot
(segments, blocks, their states and frames, the settings) at its end, every reserve and release
the device saw and what each returned, the device's publishes (a shared GPU's ledger, read back
at each), the workload's breakdown, pass, step and OOM counts and its log (the OOM messages).
Mid-run the cases do what an agent's actions do (empty_cache, peak and accumulated resets,
history on and off, new allocator settings), so those paths are in the transcript too.

The digests pinned in tests/data/sim_transcripts.json were made by the simulator as it was
before its hot path was rewritten (main at ebe63c4, w19-sim).  A change that is meant to change the
simulation makes them again, on purpose:

    python tests/sim_transcripts.py --write      # from the repository root
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the tree's memtop, as pytest imports it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memtop.agent import stacks
from memtop.sim.allocator import SimulatedCachingAllocator, SimulatedOutOfMemoryError
from memtop.sim.device import LocalDeviceMemory, SharedDeviceMemory, read_ledger
from memtop.sim.scenarios import SERVER_SCENARIOS, ServerWorkload, Workload, model_for

MiB = 1 << 20
GiB = 1 << 30
PINNED = Path(__file__).parent / "data" / "sim_transcripts.json"
STEPS = 16  # per workload case: past the first steps' segments, retries, OOMs and actions
CONFS = (
    "",
    "expandable_segments:True",
    "max_split_size_mb:20",
    # The model alone is over the threshold: every cache miss collects old cached segments.
    "garbage_collection_threshold:0.3,per_process_memory_fraction:0.9",
    "roundup_power2_divisions:4",
)
# A GPU where each scenario does what it is for within STEPS (the leak and the oom scenario run
# out of memory, pressure retries and runs out).
TOTAL = 6 * GiB
WORKLOAD_SCENARIOS = ("healthy", "leak", "fragment", "pressure", "oom", *SERVER_SCENARIOS)


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RecordingDevice:
    """A device that writes down every cudaMalloc/cudaFree it is asked for (and its answer)
    and every publish, around a real one (local, or a shared GPU's ledger)."""

    def __init__(self, inner: LocalDeviceMemory | SharedDeviceMemory) -> None:
        self.inner = inner
        self.total_bytes = inner.total_bytes
        self.pid = inner.pid
        self.log: list[Any] = []
        self._shared = isinstance(inner, SharedDeviceMemory)

    def try_reserve(self, nbytes: int) -> bool:
        ok = self.inner.try_reserve(nbytes)
        self.log.append(("reserve", nbytes, ok))
        return ok

    def release(self, nbytes: int) -> None:
        self.inner.release(nbytes)
        self.log.append(("release", nbytes))

    def free_bytes(self) -> int:
        return self.inner.free_bytes()

    def usage_by_pid(self) -> dict[int, int]:
        return self.inner.usage_by_pid()

    def _ledger(self) -> list[int]:
        if not isinstance(self.inner, SharedDeviceMemory):
            return []
        return sorted(read_ledger(self.inner.ledger_path, locked=False).values())

    def batch(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def recorded() -> Iterator[None]:
            self.log.append("batch")
            if self._shared:
                assert isinstance(self.inner, SharedDeviceMemory)
                with self.inner.batch():
                    yield
            else:
                yield
            self.log.append(("batch end", self._ledger()))

        return recorded()

    def publish_batch(self) -> None:
        if isinstance(self.inner, SharedDeviceMemory):
            self.inner.publish_batch()
        self.log.append(("publish", self._ledger()))

    def take_log(self) -> list[Any]:
        log, self.log = self.log, []
        return log


def _frames_text(snapshot: dict[str, Any]) -> None:
    # Frames name a file and a line: the line's text stands in for its number, so that the
    # transcript holds across edits that move lines but not across a changed call site.  Only
    # the workload's own frames count: those outside it are whoever runs the case (this script,
    # or pytest's test function).
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            block["frames"] = [
                (f["name"], stacks.source_text(f["filename"], f["line"]))
                for f in block["frames"]
                if os.path.basename(f["filename"]) == "scenarios.py"
            ]


def _state(allocator: SimulatedCachingAllocator, device: RecordingDevice) -> dict[str, Any]:
    snapshot = allocator.snapshot()
    _frames_text(snapshot)
    return {
        "stats": allocator.memory_stats(),
        "snapshot": snapshot,
        "device": device.take_log(),
        "free": device.free_bytes(),
        "counts": allocator.allocated_counts(),
        "reserved": allocator.memory_reserved(),
        "peaks": (allocator.max_memory_allocated(), allocator.max_memory_reserved()),
    }


def _action(step: int, allocator: SimulatedCachingAllocator, conf: str) -> Any:
    """What an agent's key presses do, at fixed steps (their effects are in the next digests)."""
    if step == 3:
        return ("empty_cache", allocator.empty_cache())
    if step == 4:
        allocator.record_history(True)
    elif step == 6:
        allocator.reset_peak_memory_stats()
    elif step == 7:
        allocator.reset_accumulated_memory_stats()
    elif step == 8:
        allocator.record_history(False)
    elif step == 9:
        # tune: new settings in a running trainer (expandable segments toggled)
        if "expandable_segments:True" in conf:
            allocator.set_settings(conf.replace("expandable_segments:True", ""))
        else:
            allocator.set_settings(",".join(filter(None, (conf, "expandable_segments:True"))))
    elif step == 13:
        return ("empty_cache", allocator.empty_cache())
    return None


def workload_transcript(scenario: str, conf: str, total: int, shared_dir: Path | None) -> list[str]:
    """One digest per step of `scenario` on a `total`-byte GPU under `conf` (a shared GPU's
    ledger when `shared_dir` is given, else a local device)."""
    overhead = 518 * MiB
    inner: LocalDeviceMemory | SharedDeviceMemory
    if shared_dir is not None:
        inner = SharedDeviceMemory(
            shared_dir / "gpu0.ledger.json", total, pid=os.getpid(), overhead_bytes=overhead
        )
    else:
        inner = LocalDeviceMemory(total, overhead)
    device = RecordingDevice(inner)
    allocator = SimulatedCachingAllocator(device, 0, conf)
    logged: list[str] = []
    ooms_observed: list[tuple[int, ...]] = []
    allocator.attach_out_of_memory_observer(lambda *args: ooms_observed.append(args))
    paused: list[Any] = []

    def pace() -> None:
        paused.append((allocator.memory_stats(), device.take_log()))

    workload: Workload | ServerWorkload
    if scenario in SERVER_SCENARIOS:
        workload = ServerWorkload(
            scenario, allocator, total, 0.92, overhead, seed=7, grow_after=4, log=logged.append
        )
    else:
        workload = Workload(
            scenario,
            allocator,
            model_for(scenario, total),
            seed=7,
            leak_bytes_per_step=total // 25,
            log=logged.append,
            pace=pace,
            layers_per_pause=4,  # the trainer's
        )
    digests = [_digest(_state(allocator, device))]  # the model (or the server's start)
    try:
        for step in range(STEPS):
            ok = workload.step()
            action = _action(step, allocator, conf)
            record: dict[str, Any] = {
                "ok": ok,
                "action": action,
                "paused": paused[:],
                "state": _state(allocator, device),
                "log": logged[:],
                "ooms": ooms_observed[:],
                "workload": (
                    workload.steps,
                    workload.ooms,
                    workload.current_pass,
                    getattr(workload, "batch_factor", None),
                ),
                "breakdown": repr(workload.breakdown(0)),
            }
            paused.clear()
            logged.clear()
            ooms_observed.clear()
            digests.append(_digest(record))
    finally:
        if isinstance(inner, SharedDeviceMemory):
            inner.close()
    return digests


def program_transcript(conf: str, seed: int, ops: int = 1500, every: int = 25) -> list[str]:
    """A random program of mallocs (two streams, every pool and size band), frees and
    empty_caches on a 512 MiB device: one digest per `every` operations."""
    rng = random.Random(seed)
    device = RecordingDevice(LocalDeviceMemory(512 * MiB))
    allocator = SimulatedCachingAllocator(device, 0, conf)
    bands = ((1, 4096), (4097, MiB), (MiB + 1, 10 * MiB), (10 * MiB, 60 * MiB))
    live: list[int] = []
    events: list[Any] = []
    digests = []
    for op in range(ops):
        roll = rng.random()
        if roll < 0.55 or not live:
            low, high = rng.choice(bands)
            try:
                address = allocator.malloc(rng.randint(low, high), stream=rng.choice((0, 0, 0, 1)))
                live.append(address)
                events.append(address)
            except SimulatedOutOfMemoryError as exc:
                events.append(str(exc))
        elif roll < 0.97:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            events.append(("empty_cache", allocator.empty_cache()))
        if (op + 1) % every == 0:
            digests.append(_digest({"events": events, "state": _state(allocator, device)}))
            events = []
    return digests


def cases() -> Iterator[tuple[str, Callable[[Path], list[str]]]]:
    """(name, the function that makes its transcript in a scratch folder), every case."""
    for scenario in WORKLOAD_SCENARIOS:
        for conf in CONFS:
            yield (
                f"{scenario} {conf or '-'}",
                (lambda tmp, s=scenario, c=conf: workload_transcript(s, c, TOTAL, None)),
            )
    for scenario in ("healthy", "pressure", "oom"):  # a shared GPU's ledger
        yield f"{scenario} shared", lambda tmp, s=scenario: workload_transcript(s, "", TOTAL, tmp)
    for conf in CONFS:
        for seed in (1, 2):
            yield (
                f"program {conf or '-'} seed {seed}",
                (lambda tmp, c=conf, seed=seed: program_transcript(c, seed)),
            )


def main(argv: list[str]) -> int:
    out: dict[str, list[str]] = {}
    for name, make in cases():
        with tempfile.TemporaryDirectory() as tmp:
            out[name] = make(Path(tmp))
    text = json.dumps(out, indent=0, sort_keys=True) + "\n"
    if "--write" in argv:
        PINNED.write_text(text)
        print(f"wrote {len(out)} transcripts to {PINNED}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
