"""The OOM flight recorder: what the allocator looked like when it ran out of memory.

The allocator calls `OomRecorder.observe(device, alloc_size, limit, free)` at every OOM (torch's
out-of-memory observer; the simulator calls the same), on the *allocating* thread - the
trainer's, or autograd's device thread in a backward - with its lock released, before the error
is raised.  That moment is the only one at which the state that failed can be seen: once the
error unwinds, the step's tensors are freed.  So, there and then, and only host-side:
- the allocator's counters and a trace-free snapshot summary (the largest free block, stranded
  split bytes) - host-side reads of the allocator's own bookkeeping, no CUDA call;
- what the agent already holds: step, phase, the step marks of the last 60 s, the breakdown.
The driver's per-process usage (this process's bytes outside PyTorch vs other processes') is an
NVML call: it is read on the I/O worker, just after, with the report's encoding.
That is a few ms of Python on a path that is about to raise anyway, and it is bounded: calls
within COALESCE_S of an OOM are the same OOM (cuDNN retries), and at most one report is taken
per REPORT_MIN_INTERVAL_S (the others are counted into the next).  Encoding and writing the file
happen on the agent's I/O worker; `flush()` at the agent's stop waits for them, so a trainer
that dies of its OOM still leaves its report.  Nothing here raises into the trainer.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtop._version import __version__
from memtop.agent import files, stacks
from memtop.agent.driver_usage import read_driver_usage, split_usage
from memtop.agent.snapshot_summary import summarize_snapshot
from memtop.oom.diagnose import diagnose
from memtop.protocol import places, replies

if TYPE_CHECKING:
    from memtop.agent.server import Agent

COALESCE_S = 0.05  # observer calls this close to an OOM's first are that OOM (cuDNN retries)
REPORT_MIN_INTERVAL_S = 10.0  # at most one report per this many seconds per process
MAX_REPORTS_PER_PROCESS = 100
RECENT_S = 60.0  # the step marks a report carries
MAX_REPORTS_KEPT = 50  # per user: the oldest reports beyond this are removed
MAX_REPORT_BYTES = 256 << 10
REPORT_NAME = re.compile(r"^oom-(\d+)-(\d+)\.json$")


def report_name(when: float, pid: int) -> str:
    return f"oom-{int(when * 1000):015d}-{pid}.json"


class OomRecorder:
    def __init__(self, agent: Agent, submit: Callable[[Callable[[], None]], bool]) -> None:
        self.agent = agent
        self._submit = submit
        self._event_started = -1e9
        self._last_report = -1e9
        self._busy = False
        self.enabled = True  # off once the agent stops (torch cannot detach an observer)
        self.ooms = 0  # OOMs seen (coalesced observer calls count once)
        self.observer_calls = 0
        self.reports_taken = 0
        self.suppressed = 0  # OOMs since the last report that got none
        self.last: dict[str, Any] | None = None  # the newest report's headline, for `sample`
        self.written: collections.deque[str] = collections.deque(maxlen=16)
        self.cleanups: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)
        # Every observer call (reported or not): step marks that span one are not a step's size.
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self._pending = 0
        self._cond = threading.Condition()
        self._host = socket.gethostname()
        # The driver's per-process usage: read on the I/O worker only (tests replace it).
        self.driver_usage: Callable[[str | None], dict[str, Any] | None] = read_driver_usage

    # ---------------------------------------------------------------- allocating thread

    def observe(self, device: int, requested: int, limit: int, free: int) -> None:
        """The allocator's out-of-memory observer.  Never raises."""
        if self._busy or not self.enabled:
            return  # an OOM inside our own collection: never recurse
        self._busy = True
        try:
            self.observer_calls += 1
            now = time.time()
            self.events.append(
                {"time": now, "step": self.agent.boundary.step, "requested_bytes": int(requested)}
            )
            if now - self._event_started < COALESCE_S:
                return
            self._event_started = now
            self.ooms += 1
            if (
                now - self._last_report < REPORT_MIN_INTERVAL_S
                or self.reports_taken >= MAX_REPORTS_PER_PROCESS
            ):
                self.suppressed += 1
                return
            self._last_report = now
            report = self._collect(now, int(device), int(requested), int(limit), int(free))
            self.reports_taken += 1
            self.suppressed = 0
            self._hand_off(report)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.agent.errors.append(f"oom report: {exc!r}")
        finally:
            self._busy = False

    def _collect(
        self, now: float, device: int, requested: int, limit: int, free: int
    ) -> dict[str, Any]:
        agent, boundary, probe = self.agent, self.agent.boundary, self.agent.probe
        key = str(device)
        # First, while the failing call's frames are still the ones above us: its user line.
        started = time.perf_counter()
        stack = stacks.capture()
        stack_us = round((time.perf_counter() - started) * 1e6, 1)
        stats = _safe(lambda: probe.memory_stats(device), {})
        summary = _safe(
            lambda: summarize_snapshot(probe.snapshot().get("segments", [])).get(key), None
        )
        current_pass = _safe(lambda: getattr(probe, "current_pass", lambda: None)(), None)
        framework_phase = boundary.phase
        # The phase the user recognises: forward / backward / optimizer inside a training step,
        # else what the framework said (eval, save, ...).
        phase = current_pass if framework_phase == "train" and current_pass else framework_phase
        info = next((d for d in _safe(probe.devices, []) if d.index == device), None)
        recent = []
        for _, mark in list(boundary.marks):
            if mark["time"] < now - RECENT_S:
                continue
            entry: dict[str, Any] = {"step": mark["step"], "time": mark["time"]}
            for field in ("allocated_bytes", "peak_bytes", "allocated_total_bytes"):
                value = mark.get(field, {}).get(key)
                if value is not None:
                    entry[field] = value
            recent.append(entry)
        breakdown = agent.latest_breakdown
        device_breakdown = None
        if breakdown is not None and key in breakdown.get("devices", {}):
            device_breakdown = {
                **breakdown["devices"][key],
                "step": breakdown.get("step"),
                "time": breakdown.get("time"),
            }
        return {
            "memtop_oom_report": 1,
            "version": __version__,
            "time": now,
            "host": self._host,
            "pid": agent.pid,
            "argv": agent.argv,
            "rank": agent.rank,
            "step": boundary.step,
            "phase": phase,
            "framework_phase": framework_phase,
            "pass": current_pass,
            "device": device,
            "device_uuid": info.uuid if info else None,
            "device_name": info.name if info else None,
            "total_bytes": info.total_bytes if info else None,
            "requested_bytes": requested,
            # The failing request's innermost user frames, innermost first (DESIGN §12).
            "stack": stack,
            "stack_capture_us": stack_us,
            # The top live sites of the latest grouping, when stack recording was on.
            "sites": _safe(agent.sites.top_sites, []),
            "limit_bytes": limit,
            "free_bytes": free,
            "allocated_bytes": stats.get("allocated_bytes.all.current"),
            "reserved_bytes": stats.get("reserved_bytes.all.current"),
            "peak_bytes": stats.get("allocated_bytes.all.peak"),
            "inactive_split_bytes": stats.get("inactive_split_bytes.all.current"),
            "largest_free_block_bytes": summary.get("largest_request_bytes") if summary else None,
            "stranded_bytes": summary.get("stranded_bytes") if summary else None,
            "num_ooms": stats.get("num_ooms"),
            "num_alloc_retries": stats.get("num_alloc_retries"),
            "baseline_bytes": recent[-1].get("allocated_bytes") if recent else None,
            "breakdown": device_breakdown,
            "recent": recent,
            "recent_window_s": RECENT_S,
            "recent_ooms": [e for e in list(self.events) if e["time"] >= now - RECENT_S],
            "phase_changes": [
                {"time": t, "step": s, "phase": p} for t, s, p in list(boundary.phase_changes)[-8:]
            ],
            "allocator_conf": _safe(probe.allocator_conf, ""),
            # torch.version.hip on a ROCm build: the fix is spelt for ROCm (optional in a Probe).
            "hip": _safe(getattr(probe, "hip_version", lambda: None), None),
            "ooms_in_process": self.ooms,
            "ooms_without_report": self.suppressed,
            "auto_cleanups": list(self.cleanups),
        }

    def _hand_off(self, report: dict[str, Any]) -> None:
        with self._cond:
            self._pending += 1
        if not self._submit(lambda: self._write(report)):
            with self._cond:
                self._pending -= 1
            self.agent.errors.append("oom report dropped: the writer is busy")

    # ---------------------------------------------------------------- agent's I/O worker

    def _write(self, report: dict[str, Any]) -> None:
        try:
            # The driver's split of the GPU between this process (outside PyTorch) and others:
            # an NVML call, so here on the I/O worker, never on the allocating thread.
            usage = _safe(lambda: self.driver_usage(report.get("device_uuid")), None)
            report.update(split_usage(usage, report.get("reserved_bytes")))
            # Judged here, off the trainer's thread; `memtop oom` judges again with its own
            # (possibly newer) rules.
            report["diagnosis"] = diagnose(report)
            verdict = {k: report["diagnosis"].get(k) for k in ("cause", "detail", "fix")}
            data = encode_report(report)
            directory = places.ensure_private_dir(places.oom_dir())
            path = directory / report_name(report["time"], report["pid"])
            files.write_private_file(str(path), data)
            self.written.append(str(path))
            # Published whole once judged and written (the agent thread may be encoding the
            # previous one; a headline without its diagnosis is never served).
            headline = ("time", "step", "phase", "device", "requested_bytes", "free_bytes")
            self.last = {
                **{k: report[k] for k in headline},
                "path": str(path),
                "diagnosis": verdict,
                "stack": report.get("stack", [])[:1],  # the line the dashboard names
            }
            prune(directory)
        except Exception as exc:
            self.agent.errors.append(f"oom report not written: {exc}")
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait for reports being written (the agent's stop: the trainer may be dying)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def status(self) -> dict[str, Any]:
        """What `sample` carries: how many OOMs, and the newest report's headline."""
        return replies.oom_status(ooms=self.ooms, reports=self.reports_taken, last=self.last)


def encode_report(report: dict[str, Any]) -> bytes:
    """JSON, at most MAX_REPORT_BYTES: the oldest recent marks go first when it is too big."""
    data = json.dumps(report, separators=(",", ":"), default=str).encode()
    recent = report.get("recent") or []
    while len(data) > MAX_REPORT_BYTES and recent:
        recent = recent[len(recent) // 2 :] if len(recent) > 1 else []
        report = {**report, "recent": recent, "recent_trimmed": True}
        data = json.dumps(report, separators=(",", ":"), default=str).encode()
    return data


def prune(directory: Path, keep: int = MAX_REPORTS_KEPT) -> int:
    """Remove the oldest of this user's reports beyond `keep`; returns how many went."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not REPORT_NAME.match(entry.name):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    found.append(entry.name)
    found.sort()
    removed = 0
    for name in found[: max(0, len(found) - keep)]:
        with contextlib.suppress(OSError):
            os.unlink(directory / name)
            removed += 1
    return removed


def _safe(call: Callable[[], Any], default: Any) -> Any:
    try:
        return call()
    except Exception:
        return default
