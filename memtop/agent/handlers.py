"""The agent's command handlers: one per protocol command, in one dispatch table (HANDLERS).

A handler runs on the agent thread (memtop.agent.server's selector loop) and so obeys its
discipline (DESIGN §6): it never touches a tensor, an optimizer, a module or the CUDA runtime.
It answers from what was measured on the trainer's thread at a step boundary, from the
allocator's host-side counters, or queues a TrainerJob for the trainer's thread and answers
later (it then returns None: the reply is posted when the job ran, or at its deadline).  Every
result is built by memtop.protocol.replies; a ProtocolError raised here becomes an error frame.

A new protocol command is: its record (memtop.protocol.commands), its reply builder
(memtop.protocol.replies), its parser (memtop.protocol.schema, with its entry in REPLY_PARSERS),
a handler here with its entry in HANDLERS, and the viewer's use (tests hold the tables to the
same names).
"""

from __future__ import annotations

import gc
import os
import pickle
import platform
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memtop._version import __version__
from memtop.agent import files, limits_for_tests
from memtop.agent.boundary import TrainerJob
from memtop.agent.probe import SAMPLE_STAT_KEYS, ProbeDevice
from memtop.agent.snapshot_summary import summarize_snapshot
from memtop.base import alloc_conf
from memtop.protocol import replies
from memtop.protocol.commands import cooldown_s
from memtop.protocol.environment import ENGINE_ENVIRONMENT
from memtop.protocol.framing import (
    E_BAD_REQUEST,
    E_FAILED,
    E_RATE_LIMITED,
    E_UNAVAILABLE,
    ProtocolError,
    Request,
)
from memtop.protocol.replies import Result

if TYPE_CHECKING:
    from memtop.agent.server import Agent, Connection

# ------------------------------------------------------------------ trainer-thread work
STEP_STALE_S = 60.0  # no step for this long: the trainer's thread is not coming back soon
BREAKDOWN_MIN_INTERVAL_S = 10.0  # at most one walk of the optimizers per this many seconds
BREAKDOWN_MAX_SHARE = 0.001  # ... and at most this share of wall time, however big the model
SUMMARY_MIN_INTERVAL_S = 30.0  # trace-free snapshot for the fragmentation summary
HISTORY_BACKOFF_S = 600.0  # memory history recording seen on: no periodic snapshots for this long
# The on-demand actions' cooldowns are the command table's (memtop.protocol.commands).
CLEANUP_MIN_INTERVAL_S = cooldown_s("cleanup")
SNAPSHOT_MIN_INTERVAL_S = cooldown_s("snapshot")
TUNE_MIN_INTERVAL_S = cooldown_s("tune")
# How long the allocator settings in force are served as last read (Commands.settings_in_force).
SETTINGS_REREAD_S = 5.0
# gc.collect() takes ~120 ms in a process that imported torch (measured on this repo's CI
# machine): a cleanup or a snapshot file may take at most this share of the trainer's time,
# however often viewers ask; the interval after each grows with what it cost.
ON_DEMAND_MAX_SHARE = 0.002
DEFAULT_WAIT_S = 8.0  # how long a cleanup / snapshot waits for a step boundary by default
MAX_WAIT_S = 60.0


class Unavailable(ProtocolError):
    def __init__(self, message: str) -> None:
        super().__init__(E_UNAVAILABLE, message)


class Cooldown:
    """When an on-demand action may run again: `minimum` after it last started, and late enough
    that what it cost (measured where it ran) stays under ON_DEMAND_MAX_SHARE of the time."""

    def __init__(self, what: str, minimum: float, max_share: float = ON_DEMAND_MAX_SHARE) -> None:
        self.what = what
        self.minimum = minimum
        self.max_share = max_share
        self.started_at = -1e9
        self.ready_at = 0.0

    def check(self) -> None:
        wait = self.ready_at - time.monotonic()
        if wait > 0:
            raise ProtocolError(
                E_RATE_LIMITED,
                f"{self.what} ran moments ago; it can run again in {max(1.0, wait):.0f} s",
            )

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.ready_at = self.started_at + self.minimum

    def cost(self, seconds: float) -> None:
        self.ready_at = max(self.ready_at, self.started_at + seconds / self.max_share)

    def refund(self) -> None:
        """The action found nothing to do and did nothing: it starts no cooldown."""
        self.ready_at = 0.0


class Commands:
    """What the commands keep between requests: the breakdown and the fragmentation summary
    measured on the trainer's thread (served from here), the jobs measuring the next ones, and
    the cooldowns of the on-demand actions.  `agent` is the transport: the probe, the step
    boundary, deferring a reply to a trainer job, the worker thread."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        # The defaults above, but where a test lowered them (read once: limits_for_tests).
        limits = limits_for_tests.read(os.environ)
        share = limits.get("on_demand_max_share", ON_DEMAND_MAX_SHARE)
        self.cleanup_cooldown = Cooldown(
            "cleanup", limits.get("cleanup_min_interval_s", CLEANUP_MIN_INTERVAL_S), share
        )
        self.snapshot_cooldown = Cooldown(
            "a snapshot", limits.get("snapshot_min_interval_s", SNAPSHOT_MIN_INTERVAL_S), share
        )
        self.tune_cooldown = Cooldown(
            "a change of the allocator's settings",
            limits.get("tune_min_interval_s", TUNE_MIN_INTERVAL_S),
            share,
        )
        # The allocator settings in force, as last read, and when (monotonic): `sample` serves
        # them at 10 Hz a viewer, and they change only when someone sets them.
        self._settings: tuple[float, str | None] | None = None
        # Measured on the trainer's thread, served from here.
        self.latest_breakdown: dict[str, Any] | None = None
        self.breakdown_job: TrainerJob | None = None
        self.breakdown_interval = BREAKDOWN_MIN_INTERVAL_S
        self.summary: dict[str, Any] | None = None
        self.summary_job: TrainerJob | None = None
        self.history_seen_at: float | None = None

    def handle(self, conn: Connection, request: Request) -> Result | None:
        """The result of `request` (None: deferred); ProtocolError for a refusal."""
        # parse_request lets only HANDLERS' commands through
        return HANDLERS[request.cmd](self, conn, request)

    def expired(self, job: TrainerJob) -> None:
        """A periodic measurement no step came for: the next request schedules a fresh one."""
        if job is self.breakdown_job:
            self.breakdown_job = None
        if job is self.summary_job:
            self.summary_job = None

    # ---------------------------------------------------------------- shared checks

    def _require_steps(self, what: str) -> None:
        boundary = self.agent.boundary
        if not boundary.stepping(STEP_STALE_S):
            why = (
                "no training step has been seen"
                if boundary.step is None
                else f"no step for over {STEP_STALE_S:.0f} s"
            )
            raise Unavailable(
                f"{what} runs between steps on the trainer's thread and {why} "
                "(steps are counted at optimizer.step() or memtop.step())"
            )

    def _devices(self) -> list[ProbeDevice]:
        """The devices the trainer uses.  Once it steps, the list read on its own thread at a
        step boundary (refreshed every second of steps): the agent thread then asks the CUDA
        driver nothing.  A process that never stepped is asked from here."""
        boundary = self.agent.boundary
        if boundary.devices_known:
            return boundary.devices
        return self.agent.probe.devices()

    # ---------------------------------------------------------------- hello

    def hello(self, conn: Connection, request: Request) -> Result:
        agent = self.agent
        return replies.hello_result(
            pid=agent.pid,
            argv=agent.argv,
            python=platform.python_version(),
            torch=agent.probe.torch_version(),
            allocator_conf=agent.probe.allocator_conf(),
            devices=[
                replies.hello_device(
                    index=d.index,
                    uuid=d.uuid,
                    name=d.name,
                    total_bytes=d.total_bytes,
                    pci_bus_id=d.pci_bus_id,
                )
                for d in self._devices()
            ],
            hip=self._hip_version(),
            agent_version=__version__,
            started=agent.started_at,
            step=agent.boundary.step,
            cwd=os.getcwd(),
            agent_thread_id=agent.thread_native_id,
            rank=agent.rank,
            local_rank=agent.local_rank,
            world_size=agent.world_size,
            scheduler=agent.scheduler,
            rendezvous=agent.rendezvous,
            allocator_settings=self.settings_in_force(fresh=True),
            engine_environment=_engine_environment(),
        )

    def settings_in_force(self, fresh: bool = False) -> str | None:
        """The allocator's option string the trainer runs with (a probe that reads it), else
        None: the environment's `allocator_conf` is all the viewer has.  Read again at most
        every SETTINGS_REREAD_S (a call into torch each `sample` of each viewer was most of
        what it cost), and at once when `fresh` (a `tune` just set them; a `hello`)."""
        now = time.monotonic()
        kept = self._settings
        if not fresh and kept is not None and now - kept[0] < SETTINGS_REREAD_S:
            return kept[1]
        read = getattr(self.agent.probe, "allocator_settings", None)
        settings: str | None = None
        if read is not None:
            try:
                value = read()
            except Exception:
                value = None
            settings = value if isinstance(value, str) else None
        self._settings = (now, settings)
        return settings

    def _hip_version(self) -> str | None:
        hip = getattr(self.agent.probe, "hip_version", None)  # optional in a Probe
        try:
            version = hip() if hip is not None else None
        except Exception:
            return None
        return version if isinstance(version, str) else None

    # ---------------------------------------------------------------- sample

    def sample(self, conn: Connection, request: Request) -> Result:
        columns = _mark_layout_arg(request) == "columns"
        max_marks = _max_marks_arg(request)
        agent = self.agent
        boundary = agent.boundary
        boundary.want_mem_info()
        devices = []
        for device in self._devices():
            stats = agent.probe.memory_stats(device.index)
            if len(stats) > len(SAMPLE_STAT_KEYS):  # a probe that returns everything
                stats = {k: stats[k] for k in SAMPLE_STAT_KEYS if k in stats}
            measured = boundary.mem_info.get(device.index)
            if measured is not None:
                free, total, when = measured
            else:
                # Not measured on the trainer's thread yet (or the trainer does not step): what
                # this process alone leaves free, an upper bound.  NVML has the real figure.
                total = device.total_bytes
                free = max(0, total - stats.get("reserved_bytes.all.current", 0))
                when = None
            floor = conn.floor.take(device.index, stats.get("allocated_bytes.all.current", 0))
            devices.append(
                replies.sample_device(
                    index=device.index,
                    uuid=device.uuid,
                    name=device.name,
                    stats=stats,
                    free_bytes=free,
                    total_bytes=total,
                    free_measured_at=when,
                    floor=floor,
                )
            )
        # Floor readings (agent/floor.py) of these devices until this viewer's next sample.
        conn.floor.restart(time.monotonic())
        agent.floor.devices_sampled(d["index"] for d in devices)
        marks = self._marks_since(conn, len(devices), max_marks)
        # The actions performed in the trainer this viewer has not seen (all kept, at first).
        actions, conn.action_cursor = agent.actions.since(conn.action_cursor)
        return replies.sample_result(
            time=time.time(),
            step=boundary.step,
            devices=devices,
            step_marks=marks,
            columns=columns,
            last_step_time=boundary.last_step_time,
            phase=boundary.phase,
            phase_since=boundary.phase_since,
            oom=agent.oom.status(),
            host_memory=boundary.host.reading(),
            allocator_settings=self.settings_in_force(),
            actions=actions,
            agent=replies.agent_costs(
                boundary_costs=boundary.costs(),
                connections=agent.connection_count,
                refused_requests=agent.refused_requests,
                agent_cpu_s=round(time.thread_time(), 6) if agent.on_agent_thread() else None,
                governed_s=round(agent.governed_s, 3),
                floor_reads=agent.floor.reads,
                floor_read_s=round(agent.floor.read_s, 6),
            ),
        )

    def _marks_since(
        self, conn: Connection, device_count: int, max_marks: int | None = None
    ) -> list[dict[str, Any]]:
        """The step marks this viewer has not seen, newest kept when they would not fit a frame
        or pass the viewer's own `max_marks` (the dashboard reads the newest 1024 and asks for
        no more: a first reply of 4096 marks from each of 8 agents was its peak memory).

        list() of a deque is atomic under the GIL, so the trainer may append meanwhile; the
        cursor moves to the last mark actually taken, so none is skipped.
        """
        taken = list(self.agent.boundary.marks)
        if not taken:
            return []
        last_seq = taken[-1][0]
        new = max(0, last_seq - conn.mark_cursor)
        # A mark costs ~60 bytes plus ~24 per device: stay well inside the 1 MiB frame.
        fit = max(1024, 500_000 // (60 + 24 * max(1, device_count)))
        if max_marks is not None:
            fit = min(fit, max_marks)
        conn.mark_cursor = last_seq
        return [mark for _, mark in taken[len(taken) - min(new, fit, len(taken)) :]]

    # ---------------------------------------------------------------- breakdown
    # Measured on the trainer's thread right after a step, served from here.

    def breakdown(self, conn: Connection, request: Request) -> Result | None:
        wait = _wait_arg(request, 0.0)
        latest = self.latest_breakdown
        if not self.agent.boundary.stepping(STEP_STALE_S):
            if latest is not None:
                return replies.breakdown_stale(latest)
            self._require_steps("the breakdown")
        age = time.time() - latest["time"] if latest is not None else None
        if (age is None or age >= self.breakdown_interval) and self.breakdown_job is None:
            self.breakdown_job = self._schedule_breakdown()
        if latest is None:
            job = self.breakdown_job
            if wait > 0 and job is not None:
                # Answer when the first measurement lands (or the wait runs out).
                # A job queued after the measurement runs right after it, at the same boundary.
                self.agent.defer(
                    conn,
                    request,
                    "the breakdown",
                    lambda: None,
                    lambda _: self.latest_breakdown or replies.breakdown_pending(),
                    wait,
                )
                return None
            return replies.breakdown_pending()
        return latest

    def _schedule_breakdown(self) -> TrainerJob:
        agent = self.agent

        def measure() -> dict[str, Any]:
            started = time.perf_counter()
            parts = agent.probe.breakdown()
            took = time.perf_counter() - started
            return replies.breakdown_result(
                time=time.time(),
                step=agent.boundary.step,
                measured="after_step",
                took_s=took,
                devices={i: b.as_dict() for i, b in parts.items()},
            )

        def done(job: TrainerJob) -> None:
            self.breakdown_job = None
            if job.error is None and job.result is not None:
                self.latest_breakdown = job.result
                # However big the model, the walk takes at most BREAKDOWN_MAX_SHARE of the time.
                self.breakdown_interval = max(
                    BREAKDOWN_MIN_INTERVAL_S, job.result["took_s"] / BREAKDOWN_MAX_SHARE
                )
            elif job.error is not None:
                agent.errors.append(f"breakdown: {job.error!r}")

        job = TrainerJob("the breakdown", measure, time.monotonic() + MAX_WAIT_S, done)
        agent.boundary.submit(job)
        agent.expire_later(job)
        return job

    # ---------------------------------------------------------------- snapshot
    # The data is taken on the trainer's thread; the file is written by the worker.

    def snapshot(self, conn: Connection, request: Request) -> Result | None:
        path = request.args.get("path")
        if path is None:
            return self._snapshot_summary()
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
            raise ProtocolError(E_BAD_REQUEST, "'path' must be an absolute path")
        overwrite = request.args.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise ProtocolError(E_BAD_REQUEST, "'overwrite' must be a boolean")
        self.snapshot_cooldown.check()
        self._require_steps("a snapshot")
        try:
            files.check_target(path, overwrite)  # refuse early, before the trainer pays
        except files.UnsafeTarget as exc:
            raise ProtocolError(E_BAD_REQUEST, str(exc)) from None
        self.snapshot_cooldown.start()
        request_id = request.id
        wait = _wait_arg(request, DEFAULT_WAIT_S)
        agent = self.agent

        def hand_to_worker(data: dict[str, Any]) -> None:
            # On the trainer's thread only the data was taken; pickling and writing happen on
            # the worker, which answers the viewer itself (and logs the action).
            taken_at = time.time()

            def write() -> None:
                started = time.perf_counter()
                try:
                    size = files.write_private_file(
                        path, pickle.dumps(data, protocol=4), overwrite=overwrite
                    )
                except files.UnsafeTarget as exc:
                    agent.log_action(conn, request, refused=(E_BAD_REQUEST, str(exc)))
                    reply = replies.error_reply(request_id, E_BAD_REQUEST, str(exc))
                except OSError as exc:
                    why = f"cannot write {path}: {exc.strerror}"
                    agent.log_action(conn, request, refused=(E_FAILED, why), when=taken_at)
                    reply = replies.error_reply(request_id, E_FAILED, why)
                else:
                    summary = summarize_snapshot(data.get("segments", []))
                    result = replies.snapshot_file_result(path=path, size=size, devices=summary)
                    seq = agent.log_action(conn, request, outcome={"bytes": size}, when=taken_at)
                    if seq is not None:
                        result["action_seq"] = seq
                    reply = replies.result_reply(request_id, result)
                self.snapshot_cooldown.cost(time.perf_counter() - started)
                agent.post(conn, reply)

            if not agent.worker.submit(write):
                raise ProtocolError(E_RATE_LIMITED, "snapshot writer is busy")
            return None

        agent.defer(conn, request, "a snapshot", agent.probe.snapshot, hand_to_worker, wait)
        return None

    def _snapshot_summary(self) -> Result:
        """The fragmentation summary of a trace-free snapshot taken on the trainer's thread at a
        low rate; served at once (the viewer asks now and then and must never wait)."""
        latest = self.summary
        age = time.time() - latest["time"] if latest is not None else None
        history_off = (
            self.history_seen_at is None
            or time.monotonic() - self.history_seen_at > HISTORY_BACKOFF_S
        )
        if (
            (age is None or age >= SUMMARY_MIN_INTERVAL_S)
            and self.summary_job is None
            and history_off
            and self.agent.boundary.stepping(STEP_STALE_S)
        ):
            self.summary_job = self._schedule_summary()
        if latest is None:
            return replies.snapshot_summary_pending()
        return replies.snapshot_summary_served(latest, history_recording=not history_off)

    def _schedule_summary(self) -> TrainerJob:
        agent = self.agent

        def measure() -> dict[str, Any]:
            data = agent.probe.snapshot()
            traced = any(data.get("device_traces") or ()) or any(
                block.get("frames")
                for seg in data.get("segments", ())
                for block in seg.get("blocks", ())
            )
            return replies.snapshot_summary(
                time=time.time(),
                step=agent.boundary.step,
                traced=traced,
                devices=summarize_snapshot(data.get("segments", [])),
            )

        def done(job: TrainerJob) -> None:
            self.summary_job = None
            if job.error is None and job.result is not None:
                if job.result.pop("traced"):
                    # The trainer records memory history: every snapshot now carries stack
                    # traces and costs hundreds of ms.  Stop the periodic ones for a while.
                    self.history_seen_at = time.monotonic()
                self.summary = job.result
            elif job.error is not None:
                agent.errors.append(f"snapshot summary: {job.error!r}")

        job = TrainerJob("a snapshot", measure, time.monotonic() + MAX_WAIT_S, done)
        agent.boundary.submit(job)
        agent.expire_later(job)
        return job

    # ---------------------------------------------------------------- cleanup
    # gc + empty_cache, on the trainer's thread between two steps.

    def cleanup(self, conn: Connection, request: Request) -> Result | None:
        self.cleanup_cooldown.check()
        self._require_steps("cleanup")
        wait = _wait_arg(request, DEFAULT_WAIT_S)
        self.cleanup_cooldown.start()
        self.agent.defer(conn, request, "cleanup", self.cleanup_now, lambda result: result, wait)
        return None

    def cleanup_now(self) -> Result:
        """Runs on the trainer's thread, right after a step."""
        started = time.perf_counter()
        probe = self.agent.probe
        indices = [d.index for d in self._devices()]
        if not indices:
            # No CUDA device in use: there is no cache to empty, and gc.collect() (a few
            # hundred ms in a process that imported torch) would free no GPU memory. Nothing is
            # done, so nothing is charged: the next cleanup may run at once.
            self.cleanup_cooldown.refund()
            return replies.cleanup_result(
                before={},
                after={},
                gc_collected=0,
                after_step=self.agent.boundary.step,
                thread=threading.current_thread().name,
                thread_ident=threading.get_ident(),
                took_s=time.perf_counter() - started,
                nothing_to_do="no CUDA device in use",
            )
        before = {i: probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices}
        collected = gc.collect()
        for index in indices:
            probe.empty_cache(index)
        after = {i: probe.memory_stats(i).get("reserved_bytes.all.current", 0) for i in indices}
        took = time.perf_counter() - started
        self.cleanup_cooldown.cost(took)
        return replies.cleanup_result(
            before=before,
            after=after,
            gc_collected=collected,
            after_step=self.agent.boundary.step,
            thread=threading.current_thread().name,
            thread_ident=threading.get_ident(),
            took_s=took,
        )

    # ---------------------------------------------------------------- tune
    # The allocator's settings, changed on the trainer's thread between two steps.

    def tune(self, conn: Connection, request: Request) -> Result | None:
        """`{"set": {key: value}, "empty_cache": bool}`: the whole option string in force with
        those keys replaced, handed to torch's setter at the next step boundary (torch resets
        every key its string leaves out: writing the one key would drop the user's others)."""
        changes = _settings_arg(request)
        empty = request.args.get("empty_cache", False)
        if not isinstance(empty, bool):
            raise ProtocolError(E_BAD_REQUEST, "'empty_cache' must be a boolean")
        probe = self.agent.probe
        setter = getattr(probe, "set_allocator_settings", None)
        if setter is None or getattr(probe, "allocator_settings", None) is None:
            raise Unavailable(
                "this trainer's torch cannot change allocator settings while it runs "
                "(no torch._C._accelerator_setAllocatorSettings nor "
                "torch.cuda.memory._set_allocator_settings)"
            )
        if changes.get("expandable_segments") == "True":
            refusal = alloc_conf.rocm_expandable_refusal(probe.torch_version(), self._hip_version())
            if refusal is not None:
                raise Unavailable(refusal)
        self.tune_cooldown.check()
        self._require_steps("a change of the allocator's settings")
        wait = _wait_arg(request, DEFAULT_WAIT_S)
        self.tune_cooldown.start()
        self.agent.defer(
            conn,
            request,
            "a change of the allocator's settings",
            lambda: self.tune_now(changes, empty),
            lambda result: result,
            wait,
        )
        return None

    def tune_now(self, changes: dict[str, str], empty_cache: bool) -> Result:
        """Runs on the trainer's thread, right after a step (never while a graph is captured:
        the boundary holds its jobs then)."""
        started = time.perf_counter()
        probe = self.agent.probe
        before = self.settings_in_force(fresh=True)
        if before is None:
            before = probe.allocator_conf()
        wanted = alloc_conf.with_options(before, changes)
        setter = getattr(probe, "set_allocator_settings", None)  # optional in a Probe
        try:
            if setter is None:
                raise NotImplementedError("this probe cannot change allocator settings")
            setter(wanted)
        except NotImplementedError as exc:
            raise Unavailable(str(exc)) from None
        except (RuntimeError, ValueError) as exc:  # torch refused the string: nothing changed
            raise ProtocolError(E_FAILED, f"torch refused {wanted!r}: {exc}") from None
        after = self.settings_in_force(fresh=True)
        reserved_before = reserved_after = None
        if empty_cache:
            indices = [d.index for d in self._devices()]
            reserved = "reserved_bytes.all.current"
            reserved_before = {i: probe.memory_stats(i).get(reserved, 0) for i in indices}
            for index in indices:
                probe.empty_cache(index)
            reserved_after = {i: probe.memory_stats(i).get(reserved, 0) for i in indices}
        took = time.perf_counter() - started
        self.tune_cooldown.cost(took)
        return replies.tune_result(
            before=before,
            after=wanted if after is None else after,
            changed=changes,
            after_step=self.agent.boundary.step,
            thread=threading.current_thread().name,
            took_s=took,
            reserved_before=reserved_before,
            reserved_after=reserved_after,
        )

    # ---------------------------------------------------------------- reset_peak, sites

    def reset_peak(self, conn: Connection, request: Request) -> Result:
        # A host-side counter reset: safe from this thread.
        indices = [d.index for d in self._devices()]
        for index in indices:
            self.agent.probe.reset_peak(index)
        return replies.reset_peak_result(indices)

    def sites(self, conn: Connection, request: Request) -> Result:
        """The newest grouping of live blocks by site; `{"stacks": true|false}` asks the
        trainer's thread to switch stack recording at its next step boundary; `{"history":
        true}` adds the kept rounds before the newest (a viewer's first request, DESIGN §13)."""
        tracker = self.agent.sites
        history = request.args.get("history", False)
        if not isinstance(history, bool):
            raise ProtocolError(E_BAD_REQUEST, "'history' must be a boolean")
        wanted = request.args.get("stacks")
        if wanted is not None:
            if not isinstance(wanted, bool):
                raise ProtocolError(E_BAD_REQUEST, "'stacks' must be a boolean")
            if wanted and not tracker.supported():
                raise ProtocolError(E_UNAVAILABLE, "this trainer's allocator cannot record stacks")
            if wanted != tracker.wanted:
                # An action only when it switches them (a viewer repeats what it wants).
                self.agent.log_action(conn, request)
            tracker.wanted = wanted
        return tracker.result(history=history)


Handler = Callable[[Commands, "Connection", Request], "Result | None"]

# The closed command set the agent serves: protocol.parse_request lets nothing else through.
HANDLERS: dict[str, Handler] = {
    "hello": Commands.hello,
    "sample": Commands.sample,
    "breakdown": Commands.breakdown,
    "snapshot": Commands.snapshot,
    "cleanup": Commands.cleanup,
    "reset_peak": Commands.reset_peak,
    "sites": Commands.sites,
    "tune": Commands.tune,
}


# ---------------------------------------------------------------- request arguments


def _wait_arg(request: Request, default: float) -> float:
    wait = request.args.get("wait_s", default)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
        raise ProtocolError(E_BAD_REQUEST, "'wait_s' must be seconds >= 0")
    return min(float(wait), MAX_WAIT_S)


def _settings_arg(request: Request) -> dict[str, str]:
    """`set`: one to three tunable allocator options, each value as torch's parser takes it."""
    wanted = request.args.get("set")
    if not isinstance(wanted, dict) or not wanted:
        raise ProtocolError(E_BAD_REQUEST, "'set' must be an object of allocator options")
    if len(wanted) > len(alloc_conf.TUNABLE):
        raise ProtocolError(E_BAD_REQUEST, "'set' names too many options")
    changes = {}
    for key, value in wanted.items():
        try:
            changes[str(key)] = alloc_conf.checked_setting(str(key), value)
        except alloc_conf.BadSetting as exc:
            raise ProtocolError(E_BAD_REQUEST, str(exc)[:300]) from None
    return changes


def _max_marks_arg(request: Request) -> int | None:
    limit = request.args.get("max_marks")
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ProtocolError(E_BAD_REQUEST, "'max_marks' must be an int >= 1")
    return limit


def _mark_layout_arg(request: Request) -> str:
    layout = request.args.get("mark_layout", "rows")
    if layout not in ("rows", "columns"):
        raise ProtocolError(E_BAD_REQUEST, '\'mark_layout\' must be "rows" or "columns"')
    return str(layout)


def _engine_environment() -> dict[str, str]:
    """The ENGINE_ENVIRONMENT variables of the trainer's environment (a dictionary lookup each,
    no other variable read: an environment holds secrets)."""
    environ = os.environ
    return {name: environ[name][:64] for name in ENGINE_ENVIRONMENT if name in environ}
