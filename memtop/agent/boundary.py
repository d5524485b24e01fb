"""What the agent does on the trainer's own thread, at the end of each training step.

The hard-won rule (DESIGN §6): whatever touches tensors, optimizers, modules or the CUDA runtime
runs here, on the trainer's thread, between steps, never on the agent's thread.  On torch 2.11
CUDA and 2.13 CPU, walking an optimizer's tensors from another thread while the trainer runs
`zero_grad(set_to_none=True)` kills the trainer within seconds; `empty_cache`, `mem_get_info` or
a snapshot from another thread can invalidate a CUDA graph the trainer is capturing.

So the agent thread only *asks*: it queues a `TrainerJob`, and `StepBoundary.on_step` (called by
torch's optimizer step post-hook or by `memtop.step()`) runs it right after the step, when
gradients are alive and nothing is mid-flight.  The hot path is O(1): a counter, a clock read,
and two attribute tests; the allocator read behind a step mark is rate-limited by time, so the
step count stays exact at any step rate while the cost per step falls as the rate rises.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from memtop.agent.host_memory import HostMemory
from memtop.agent.probe import Probe, ProbeDevice

MARK_BUFFER = 4096  # step marks kept for viewers; the wire contract promises at least 1024
MARK_MIN_INTERVAL_S = 0.05  # at most 20 step marks a second: one allocator read each
DEVICES_REFRESH_S = 1.0  # how often the hot path re-reads which devices the trainer uses
MEM_INFO_INTERVAL_S = 1.0  # mem_get_info (a CUDA call) at most this often, and only when wanted
HEAP_FREE_INTERVAL_S = 1.0  # glibc's free heap bytes (its cost grows with free chunks): 1/s


class TrainerJob:
    """One piece of work for the trainer's thread, with a deadline.

    Exactly one party gets to act on a job: the trainer (it runs it) or the agent loop (the
    deadline passed, it answers "no step came").  `claim()` decides who, under a lock.
    """

    __slots__ = (
        "_claimed",
        "_lock",
        "deadline",
        "error",
        "name",
        "on_done",
        "result",
        "run",
        "submitted",
    )

    def __init__(
        self,
        name: str,
        run: Callable[[], Any],
        deadline: float,
        on_done: Callable[[TrainerJob], None] | None = None,
    ) -> None:
        self.name = name
        self.run = run
        self.deadline = deadline  # time.monotonic()
        self.submitted = time.monotonic()
        self.on_done = on_done
        self.result: Any = None
        self.error: BaseException | None = None
        self._claimed = False
        self._lock = threading.Lock()

    def claim(self) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    @property
    def claimed(self) -> bool:
        return self._claimed


class StepBoundary:
    """Step counting, step marks and trainer-thread jobs.  Only `on_step` runs on the trainer's
    thread; everything else is called from the agent's thread and never touches torch."""

    def __init__(
        self,
        probe: Probe,
        mark_interval_s: float = MARK_MIN_INTERVAL_S,
        mem_info_interval_s: float = MEM_INFO_INTERVAL_S,
    ) -> None:
        self.probe = probe
        self.mark_interval_s = mark_interval_s
        self.mem_info_interval_s = mem_info_interval_s
        self.step: int | None = None
        self.explicit_steps = False
        self.last_step_time: float | None = None
        self.trainer_thread_ident: int | None = None
        self.marks: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(
            maxlen=MARK_BUFFER
        )
        self.mark_seq = 0
        self._mark_due = 0.0
        self._indices: list[int] = []
        self._indices_due = 0.0
        # The devices the trainer uses, as read here on its thread (the CUDA driver is asked
        # which have a context): once the trainer steps, the agent thread serves this list
        # instead of asking the driver itself.
        self.devices: list[ProbeDevice] = []
        self.devices_known = False  # set once `devices` has been read at a step boundary
        # Jobs: the agent thread appends under the lock and raises the flag; the hot path reads
        # only the flag (a plain attribute read), so an idle boundary costs nothing.
        self._jobs: list[TrainerJob] = []
        self._jobs_lock = threading.Lock()
        self._has_jobs = False
        # (free, total, when) per device, measured here; served by the agent thread.
        self.mem_info: dict[int, tuple[int, int, float]] = {}
        self._mem_info_wanted_until = 0.0
        self._mem_info_due = 0.0
        # What it costs the trainer, measured where it is spent.
        self.hook_calls = 0
        self.hook_ns = 0
        self.work_ns = 0
        self.jobs_run = 0
        self.deferred_while_capturing = 0
        self.last_capture_deferral: float | None = None  # time.monotonic() of the newest
        self.errors: collections.deque[str] = collections.deque(maxlen=50)
        # What the trainer is doing, as a framework callback or memtop.phase() says ("train",
        # "eval", "save", ...): OOM reports name it, viewers can leave eval out of baselines.
        self.phase = "train"
        self.phase_since = time.time()
        self.phase_changes: collections.deque[tuple[float, int | None, str]] = collections.deque(
            maxlen=64
        )
        # Optimizer-hook steps since a framework last said its own step count (sync_step).
        self._hook_steps = 0
        # Opt-in work at every boundary, rate-limited by itself (auto_cleanup.AutoCleanup).
        self.on_boundary: Callable[[float], None] | None = None
        # Stack recording and the grouping of live blocks by site (sites.SiteTracker): O(1)
        # until a switch or a round is due, rate- and time-capped by itself.
        self.sites_hook: Callable[[float, int | None], None] | None = None
        # The process's resident memory (the host's baseline in each step mark; the agent
        # thread serves its high-water mark): a trainer without a CUDA device has no other.
        self.host = HostMemory()
        self._heap_free_due = 0.0

    # ------------------------------------------------------------ trainer's thread

    def on_step(self, explicit: bool = False) -> None:
        """The end of a training step.  Runs on the trainer's thread: cheap, and never raises."""
        started = time.perf_counter_ns()
        try:
            if explicit:
                self.explicit_steps = True
            elif self.explicit_steps:
                return  # memtop.step() is counting; the optimizer hook would count twice
            else:
                self._hook_steps += 1
            self._reached((self.step or 0) + 1)
        except Exception as exc:  # the trainer must never see our failures
            self.errors.append(f"step hook: {exc!r}")
        finally:
            self.hook_calls += 1
            self.hook_ns += time.perf_counter_ns() - started

    def sync_step(self, step: int) -> None:
        """A framework's own count of optimizer updates (HF `global_step`, Lightning's): the
        step memtop reports follows it.  When no optimizer hook counted this update (an
        optimizer that is not a torch one, a step skipped by the loss scaler), this call is the
        step boundary itself.  Trainer's thread; O(1); never raises."""
        started = time.perf_counter_ns()
        try:
            if self._hook_steps == 0 and step != self.step:
                self._reached(int(step))
            else:
                self.step = int(step)
            self._hook_steps = 0
        except Exception as exc:
            self.errors.append(f"sync step: {exc!r}")
        finally:
            self.hook_ns += time.perf_counter_ns() - started

    def set_phase(self, phase: str) -> None:
        """What the trainer does now ("train", "eval", "save", ...).  Trainer's thread; O(1)."""
        try:
            if phase != self.phase:
                now = time.time()
                self.phase = str(phase)[:32]
                self.phase_since = now
                self.phase_changes.append((now, self.step, self.phase))
        except Exception as exc:
            self.errors.append(f"phase: {exc!r}")

    def _reached(self, step: int) -> None:
        """A step boundary: count, mark, and run what waits for the trainer's thread."""
        now = time.time()
        self.step = step
        self.last_step_time = now
        self.trainer_thread_ident = threading.get_ident()
        if now >= self._mark_due:
            self._mark_due = now + self.mark_interval_s
            self._mark(now)
        if self.on_boundary is not None:
            self.on_boundary(now)
        if self.sites_hook is not None:
            self.sites_hook(now, step)
        if self._has_jobs or self._mem_info_due <= now < self._mem_info_wanted_until:
            self._boundary_work(now)

    def _mark(self, now: float) -> None:
        if now >= self._indices_due:
            self.devices = self.probe.devices()
            self.devices_known = True
            self._indices = [d.index for d in self.devices]
            self._indices_due = now + DEVICES_REFRESH_S
        mark: dict[str, Any] = {"step": self.step, "time": now}
        reading = getattr(self.probe, "mark_reading", None)
        if reading is None:
            mark["allocated_bytes"] = {
                str(i): self.probe.memory_allocated(i) for i in self._indices
            }
        else:
            # One allocator read gives the baseline, the running peak and the cumulative bytes
            # allocated: its growth per step is the step's size (a growing batch shows in it;
            # the OOM report reads it).
            allocated, peak, cumulative = {}, {}, {}
            for i in self._indices:
                key = str(i)
                allocated[key], peak[key], cumulative[key] = reading(i)
            mark["allocated_bytes"] = allocated
            mark["peak_bytes"] = peak
            mark["allocated_total_bytes"] = cumulative
        # The resident set right after the step (3 µs, /proc/self/statm), and now and then
        # what of it glibc keeps free (memtop.agent.host_memory): the host's baseline.
        host_rss = self.host.rss_bytes()
        if host_rss is not None:
            mark["host_rss_bytes"] = host_rss
            if now >= self._heap_free_due:
                self._heap_free_due = now + HEAP_FREE_INTERVAL_S
                heap_free = self.host.heap_free_bytes()
                if heap_free is not None:
                    mark["host_heap_free_bytes"] = heap_free
        self.mark_seq += 1
        self.marks.append((self.mark_seq, mark))

    def _boundary_work(self, now: float) -> None:
        started = time.perf_counter_ns()
        try:
            if self.probe.is_capturing():
                # A CUDA graph is being captured on this thread: any CUDA call now could
                # invalidate it.  Try again after the next step.
                self.deferred_while_capturing += 1
                self.last_capture_deferral = time.monotonic()
                return
            if self._mem_info_due <= now < self._mem_info_wanted_until:
                self._mem_info_due = now + self.mem_info_interval_s
                for index in self._indices:
                    free, total = self.probe.mem_get_info(index)
                    self.mem_info[index] = (free, total, now)
            if self._has_jobs:
                with self._jobs_lock:
                    jobs, self._jobs = self._jobs, []
                    self._has_jobs = False
                for job in jobs:
                    if job.claim():
                        self._run_job(job)
        finally:
            self.work_ns += time.perf_counter_ns() - started

    def _run_job(self, job: TrainerJob) -> None:
        try:
            job.result = job.run()
        except Exception as exc:
            job.error = exc
        except BaseException as exc:
            # A Ctrl-C or SystemExit that lands while our job runs is the trainer's, not ours:
            # answer the viewer, then let it go on its way.
            job.error = exc
            self._finish(job)
            raise
        self._finish(job)

    def _finish(self, job: TrainerJob) -> None:
        self.jobs_run += 1
        if job.on_done is not None:
            try:
                job.on_done(job)
            except Exception as exc:
                self.errors.append(f"job {job.name}: {exc!r}")

    # ------------------------------------------------------------ agent's thread

    def submit(self, job: TrainerJob) -> None:
        with self._jobs_lock:
            self._jobs.append(job)
            self._has_jobs = True

    def want_mem_info(self, for_s: float = 5.0) -> None:
        """A viewer is sampling: refresh (free, total) at the next steps, for a while."""
        self._mem_info_wanted_until = time.time() + for_s

    def stepping(self, within_s: float) -> bool:
        """Whether a step ended within the last `within_s` seconds."""
        last = self.last_step_time
        return last is not None and time.time() - last <= within_s

    def costs(self) -> dict[str, Any]:
        return {
            "hook_calls": self.hook_calls,
            "hook_ns": self.hook_ns,
            "boundary_work_ns": self.work_ns,
            "jobs_run": self.jobs_run,
            "deferred_while_capturing": self.deferred_while_capturing,
            "errors": len(self.errors),
        }
