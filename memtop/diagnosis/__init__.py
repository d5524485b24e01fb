"""Diagnosis: from what the sampler stored to answers (DESIGN §4–5).

`Diagnoser.diagnose_devices` judges each agent device (leak estimate, fragmentation, pressure,
breakdown); `suggestions.suggest` turns the facts of each GPU into what to do.  Joining devices,
processes and agents is not done here: `memtop.engine.observation` does it once per round and
assembles the `Diagnosis` every consumer renders.

The diagnosis is a function of one `RoundView` (the store's immutable view of one generation,
with each device's windows): it never sees the store, so it cannot read two rounds at once.

May import: `memtop.model` (the round's view it judges: `RoundView`), `memtop.figures`,
`memtop.base`, `memtop.estimate`'s arithmetic and `memtop.oom`'s readers; no transport, no source,
no I/O (contracts). Imported by the observation and above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memtop.base.records import record
from memtop.diagnosis.facts import (
    DeviceDiagnosis,
    GpuObservation,
    HostDiagnosis,
)
from memtop.diagnosis.fragmentation import (
    GAUGE_SAMPLES,
    PRESSURE_WINDOW_S,
    SnapshotFigures,
    fragmentation,
    pressure,
    snapshot_figures,
)
from memtop.diagnosis.leak import MAX_MARKS, MIN_MARKS, LeakEstimate, detect
from memtop.diagnosis.ranks import JobPeers, job_peers
from memtop.diagnosis.sites import site_trends
from memtop.diagnosis.suggestions import Suggestion
from memtop.diagnosis.workload import Workload, flat_high_share, of_agent
from memtop.model import (
    NO_WINDOWS,
    AgentDeviceSample,
    AgentView,
    RoundView,
    Windows,
    search_column,
)
from memtop.oom.diagnose import growing_batch

__all__ = [
    "DeviceDiagnosis",
    "Diagnoser",
    "Diagnosis",
    "GpuObservation",
    "HostDiagnosis",
    "LeakEstimate",
    "Suggestion",
]

# Where an agent's device is (the observation's join): the driver's UUID and number of its GPU,
# and what the driver charges the process there.
Placement = tuple[str, int, int | None]

# The leak test costs a few ms per device; a dashboard refreshing every second re-judges each
# device at most this often (a trend judged over minutes of steps does not change in ten
# seconds, and eight devices judged every 5 s were a twentieth of the dashboard's CPU).
LEAK_REFRESH_S = 10.0
# What a leak verdict was judged on: the marks (step, time, allocated), the headroom, and, where
# the marks are too few for the step basis, the sampled history (time, allocated, floor).
LeakInputs = tuple[Any, ...]
# Which inputs a verdict was judged on, told apart without listing them (`_leak_key`).
LeakKey = tuple[Any, ...]

# The step marks a growing batch is judged on when OOMs show only as a counter (a recording):
# the OOM report's `recent` holds about as many.
GROWTH_MARKS = 60


@record(frozen=True)
class Diagnosis:
    """One round's diagnosis: each agent's devices, the GPUs, the suggestions, the CPU trainers'
    host memory."""

    time: float
    devices: dict[tuple[int, int], DeviceDiagnosis]  # by (pid, device index)
    gpus: tuple[GpuObservation, ...]
    suggestions: tuple[Suggestion, ...]
    # Host memory of the processes that use no CUDA device (CPU trainers), by pid.
    hosts: dict[int, HostDiagnosis] = field(default_factory=dict)

    def device(self, pid: int, index: int) -> DeviceDiagnosis | None:
        return self.devices.get((pid, index))

    def suggestions_for(self, pid: int | None = None) -> list[Suggestion]:
        return [s for s in self.suggestions if pid is None or s.pid == pid]


@dataclass
class Diagnoser:
    """Keeps the last leak estimate per device so repeated diagnoses stay cheap: judged again
    every `leak_refresh_s`, and then only where what it is judged on changed since (`detect`
    is a function of its inputs: the same inputs give the same verdict)."""

    leak_refresh_s: float = LEAK_REFRESH_S
    _leaks: dict[tuple[int, int], tuple[float, LeakEstimate]] = field(default_factory=dict)
    _host_leaks: dict[int, tuple[float, LeakEstimate]] = field(default_factory=dict)
    # What each verdict in `_leaks` / `_host_leaks` was judged on: a device whose marks and
    # headroom are the same when its verdict is due again (an exited or stalled trainer, whose
    # row stays) keeps it without the analysis, which is most of the leak test's cost.
    # Only a key of a few numbers is held (`_leak_key`), not the inputs: these were ~100 kB of
    # listed floats per device.
    _leak_inputs: dict[tuple[int, int], LeakKey] = field(default_factory=dict)
    _host_leak_inputs: dict[int, LeakKey] = field(default_factory=dict)
    analyses: int = 0  # leak analyses run (`detect` called), for the tests and the bench
    # Each device's snapshot summary (its process's record's, by reference: a summary is read
    # once a snapshot interval) with its figures (`snapshot_figures`), worked out once per
    # summary rather than every round.
    _snapshots: dict[tuple[int, int], tuple[Mapping[str, Any], SnapshotFigures]] = field(
        default_factory=dict
    )

    def forget(self) -> None:
        """Judge every device anew next time (see Observer.forget)."""
        self._leaks.clear()
        self._host_leaks.clear()
        self._leak_inputs.clear()
        self._host_leak_inputs.clear()
        self._snapshots.clear()

    def diagnose_hosts(self, view: RoundView, now: float) -> dict[int, HostDiagnosis]:
        """The host memory of each agent that uses no CUDA device (a CPU trainer), by pid: its
        RSS after each step is its baseline, judged as a device's allocated bytes are."""
        hosts: dict[int, HostDiagnosis] = {}
        for agent in view.agents:
            memory = agent.host_memory
            if agent.devices or memory is None:
                continue
            cached = self._host_leaks.get(agent.pid)
            if cached is not None and 0 <= now - cached[0] < self.leak_refresh_s:
                leak = cached[1]
            else:
                history, marks = view.host_window(agent.pid)
                headroom = (
                    max(0, memory.total_bytes - memory.rss_bytes) if memory.total_bytes else None
                )
                judged_on = _leak_key(marks, "rss", history, None, headroom)
                if cached is not None and self._host_leak_inputs.get(agent.pid) == judged_on:
                    leak = cached[1]
                else:
                    leak = self._detect(_leak_inputs(marks, "rss", history, "rss", None, headroom))
                self._host_leaks[agent.pid] = (now, leak)
                self._host_leak_inputs[agent.pid] = judged_on
            hosts[agent.pid] = HostDiagnosis(
                agent.pid, memory.rss_bytes, memory.peak_rss_bytes, memory.total_bytes, leak
            )
        self._host_leaks = {k: v for k, v in self._host_leaks.items() if k in hosts}
        self._host_leak_inputs = {
            k: v for k, v in self._host_leak_inputs.items() if k in self._host_leaks
        }
        return hosts

    def _detect(self, inputs: LeakInputs) -> LeakEstimate:
        """The leak test on `inputs` (`_leak_inputs`)."""
        self.analyses += 1
        steps, times, values, headroom, history_time, history_values, history_floor = inputs
        return detect(
            steps,
            times,
            values,
            history_time,
            history_values,
            headroom_bytes=headroom,
            history_floor=history_floor,
        )

    def diagnose_devices(
        self,
        view: RoundView,
        now: float,
        place: Callable[[AgentView, AgentDeviceSample], Placement] | None = None,
    ) -> dict[tuple[int, int], DeviceDiagnosis]:
        """Every agent device of one round's `view`, by (pid, device index): each one record,
        made once, with where it is (`place`: the observation's join; without it, the agent's
        own UUID and index) and its job's other ranks in view."""
        devices: dict[tuple[int, int], DeviceDiagnosis] = {}
        owners = {pid: info.uid for pid, info in view.processes.items()}
        peers = job_peers(view.agents, owners)
        for agent in view.agents:
            for dev in agent.devices:
                info = view.processes.get(agent.pid)
                launcher = info.launcher_cmdline if info is not None else ()
                devices[(agent.pid, dev.index)] = self._device(
                    agent,
                    dev,
                    now,
                    launcher,
                    place=place(agent, dev) if place is not None else None,
                    peers=peers.get(agent.pid),
                    windows=view.windows(agent.pid, dev.index),
                )
        self._leaks = {k: v for k, v in self._leaks.items() if k in devices}
        self._leak_inputs = {k: v for k, v in self._leak_inputs.items() if k in self._leaks}
        if len(self._snapshots) > len(devices):
            self._snapshots = {k: v for k, v in self._snapshots.items() if k in devices}
        return devices

    def _snapshot_figures(
        self, key: tuple[int, int], summary: Mapping[str, Any] | None
    ) -> SnapshotFigures | None:
        """`snapshot_figures` of a device's summary, worked out when the summary is another."""
        if summary is None:
            return None
        kept = self._snapshots.get(key)
        if kept is None or kept[0] is not summary:
            kept = self._snapshots[key] = (summary, snapshot_figures(summary))
        return kept[1]

    def _device(
        self,
        agent: AgentView,
        dev: AgentDeviceSample,
        now: float,
        launcher_argv: Sequence[str] = (),
        *,
        place: Placement | None = None,
        peers: JobPeers | None = None,
        windows: Windows = NO_WINDOWS,
    ) -> DeviceDiagnosis:
        """One agent device's record, made once: judged on its newest sample (`dev`, the
        parsed reply's record, held by reference) and its `windows` of the round (history, step
        marks), where `place` says it is, with its job's `peers`."""
        latest = dev
        key = (agent.pid, dev.index)
        history, marks = windows
        # Only the rows each measure needs: the gauge's median and the pressure window, judged
        # every time; the whole allocated history only when the leak verdict is due again (a
        # dashboard diagnoses every second, and an hour of history is 3600 rows per device).
        newest_sample = agent.last_sample_time if agent.last_sample_time is not None else now
        times = history.get("time", ())
        first = search_column(times, newest_sample - PRESSURE_WINDOW_S)
        recent = {name: history.get(name, ())[first:] for name in _PRESSURE_COLUMNS}
        gauge = history.get("fragmentation", ())[-GAUGE_SAMPLES:]
        # The baseline is the newest step mark.
        newest = marks.get("allocated", ())[-1:]
        cached = self._leaks.get(key)
        if cached is not None and 0 <= now - cached[0] < self.leak_refresh_s:
            leak = cached[1]
        else:
            headroom = latest.free_bytes + latest.cached
            judged_on = _leak_key(marks, "allocated", history, "allocated_floor", headroom)
            if cached is not None and self._leak_inputs.get(key) == judged_on:
                leak = cached[1]
            else:
                leak = self._detect(
                    _leak_inputs(
                        marks, "allocated", history, "allocated", "allocated_floor", headroom
                    )
                )
            self._leaks[key] = (now, leak)
            self._leak_inputs[key] = judged_on
        reported = agent.last_oom is not None and agent.last_oom.get("device") == dev.index
        pressure_now = pressure(
            latest,
            recent.get("time", []),
            recent.get("num_alloc_retries", []),
            recent.get("num_ooms", []),
        )
        oom_growth = None
        ooms = pressure_now.ooms if pressure_now.ooms_recent is None else pressure_now.ooms_recent
        if not reported and ooms > 0:
            oom_growth = _growth_from_marks(marks, recent)
        summary = (agent.snapshot_summary or {}).get(dev.index)
        snapshot_age = now - agent.snapshot_time if agent.snapshot_time is not None else None
        declared_uuid, name = agent.device_identity(dev.index)
        uuid, gpu, charged = place if place is not None else (declared_uuid, dev.index, None)
        return DeviceDiagnosis(
            pid=agent.pid,
            index=dev.index,
            uuid=uuid,
            sample=latest,
            baseline_bytes=int(newest[-1]) if newest else None,
            leak=leak,
            fragmentation=fragmentation(
                latest, gauge, summary, snapshot_age, self._snapshot_figures(key, summary)
            ),
            pressure=pressure_now,
            breakdown=(agent.breakdown or {}).get(dev.index),
            breakdown_measured=agent.breakdown is not None,
            breakdown_step=agent.breakdown_step if agent.breakdown is not None else None,
            breakdown_time=agent.breakdown_time if agent.breakdown is not None else None,
            # Who it is (settings in force, ROCm, newest OOM) is its process's, read through.
            process=agent,
            oom_growth=oom_growth,
            sites=site_trends(agent.sites, dev.index, leak) if agent.sites else (),
            workload=_workload(agent, dev, launcher_argv, history, marks),
            rank=peers.rank if peers is not None else None,
            job=peers.job if peers is not None else None,
            peer_ranks=peers.peer_ranks if peers is not None else 0,
            peers_median_peak_bytes=peers.peers_median_peak_bytes if peers is not None else None,
            name=name,
            gpu=gpu,
            sampled_peak_bytes=agent.sampled_peak(dev.index),
            nvml_used_bytes=charged,
            windows=windows,  # its `history` is cut from them when a screen reads it
        )


_PRESSURE_COLUMNS = ("time", "num_alloc_retries", "num_ooms")


def _workload(
    agent: AgentView,
    dev: AgentDeviceSample,
    launcher_argv: Sequence[str],
    history: Mapping[str, Sequence[float]],
    marks: Mapping[str, Sequence[float]],
) -> Workload:
    """What the process is (memtop.diagnosis.workload), from its hello, its steps and its
    reserved bytes since the first sample the store keeps."""
    hello = agent.hello
    environ = hello.extra.get("engine_environment") if hello is not None else None
    stepped = bool(agent.step) or bool(marks.get("step", ()))
    latest = dev
    pattern = None
    if not stepped:
        pattern = flat_high_share(
            history.get("reserved", ()),
            latest.total_bytes,
            latest.num_alloc_retries,
            latest.num_ooms,
        )
    return of_agent(
        hello.argv if hello is not None else (),
        environ if isinstance(environ, dict) else None,
        launcher_argv,
        stepped,
        pattern,
    )


def _leak_key(
    marks: Mapping[str, Sequence[float]],
    marked: str,
    history: Mapping[str, Sequence[float]],
    floor: str | None,
    headroom: float | None,
) -> LeakKey:
    """Which inputs `_leak_inputs` would give, told apart by a few numbers: the store's mark and
    history rings only append (a row is never written again), so a window whose row count and
    newest row are the same holds the same rows.  The history counts only where the marks are
    too few for the step basis (`detect` reads it only then)."""
    count = len(marks.get("step", ()))
    newest = (_last(marks, "step"), _last(marks, "time"), _last(marks, marked))
    if count >= MIN_MARKS:
        return count, newest, headroom
    sampled = (_last(history, "time"), _last(history, marked), floor and _last(history, floor))
    return count, newest, headroom, len(history.get("time", ())), sampled


def _last(columns: Mapping[str, Sequence[float]], name: str) -> float | None:
    column = columns.get(name, ())
    return column[-1] if len(column) else None


def _leak_inputs(
    marks: Mapping[str, Sequence[float]],
    marked: str,
    history: Mapping[str, Sequence[float]],
    sampled: str,
    floor: str | None,
    headroom: float | None,
) -> LeakInputs:
    """What `detect` judges one series on, as `Diagnoser._detect` takes it: the newest MAX_MARKS
    step marks of column `marked`, the headroom, and the whole sampled history of column
    `sampled` (with its floor readings) only where the marks are too few for the step basis:
    with MIN_MARKS marks `detect` reads no history, and listing an hour of it (3600 rows of
    three columns per device) was most of the cost of asking whether anything changed."""
    steps = _newest(marks, "step", MAX_MARKS)
    times = _newest(marks, "time", MAX_MARKS)
    values = _newest(marks, marked, MAX_MARKS)
    if len(steps) >= MIN_MARKS:
        return steps, times, values, headroom, [], [], None
    return (
        steps,
        times,
        values,
        headroom,
        _newest(history, "time"),
        _newest(history, sampled),
        _newest(history, floor) if floor is not None else None,
    )


def _newest(
    columns: Mapping[str, Sequence[float]], name: str, last: int | None = None
) -> list[float]:
    """The newest `last` rows (all: None) of one column as floats, oldest first."""
    column = columns.get(name, ())
    return list(column if last is None else column[-last:])


def _growth_from_marks(
    marks: Mapping[str, Sequence[float]], recent: Mapping[str, Sequence[float]]
) -> dict[str, Any] | None:
    """A growing batch judged from the newest step marks as an OOM report judges it
    (memtop.oom.diagnose, one home), for OOMs seen only as a counter."""
    recent_marks = [
        {"step": int(step), "time": when, "allocated_bytes": int(allocated)}
        for step, when, allocated in zip(
            _newest(marks, "step", GROWTH_MARKS),
            _newest(marks, "time", GROWTH_MARKS),
            _newest(marks, "allocated", GROWTH_MARKS),
            strict=False,
        )
    ]
    counts = recent.get("num_ooms", [])
    times = recent.get("time", [])
    oom_times = [t for t, a, b in zip(times[1:], counts, counts[1:], strict=False) if b > a]
    ooms = int(counts[-1] - counts[0]) if len(counts) > 1 else 0
    headline = f"{ooms} out-of-memory error{'s' if ooms != 1 else ''} while stepping"
    return growing_batch(recent_marks, oom_times, headline)
