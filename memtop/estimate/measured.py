"""What a recorded run measured, for `memtop estimate --from RECORDING`.

Read through memtop.sources.replay (the same loader and wire-schema checks as `memtop replay`):
per agent device, torch's allocated peak, the cache's reserved bytes, the step marks' baselines
and the newest breakdown that saw the optimizer's state.  The device of the largest peak is the
one measured.  The arithmetic on it is memtop.estimate.calibrate's.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memtop.base.records import record
from memtop.model import AgentBreakdown, AgentSample, HostMemory, StepMark
from memtop.sources.agent_sanity import host_memory_problem, this_machine_bytes
from memtop.sources.recording import RecordError
from memtop.sources.replay import load

HOST_DEVICE = -1  # Measured.device when the memory measured is the process's own host memory


class MeasuredError(Exception):
    """A recording that cannot be calibrated from: one line for the user."""


class ChooseTrainer(MeasuredError):
    """A recording of several trainers and no --pid: which one is the user's to say."""


class Leaking(MeasuredError):
    """The trainer's baseline grows (memtop's leak verdict): its peak holds the leak, which no
    batch fit can tell from activations."""


@record(frozen=True, slots=True)
class Measured:
    pid: int
    device: int
    peak_bytes: int  # torch's allocated_bytes.all.peak, the largest seen
    reserved_bytes: int  # torch's reserved_bytes.all.current, the largest seen
    total_bytes: int  # the device's memory as the driver reported it
    parameters_bytes: int | None  # from the newest breakdown with optimizer state
    gradients_bytes: int | None
    optimizer_state_bytes: int | None
    baseline_bytes: int | None  # the lowest step mark: allocated right after a step
    steps: int  # step marks seen
    first_step: int | None = None  # the step marks' range: the steps the figures come from
    last_step: int | None = None
    leak: str = ""  # memtop's leak verdict on the baseline, in words (why it is not a leak)
    # "device": torch's allocator on a GPU; "host": the process's resident set (a CPU trainer:
    # torch keeps no CPU counters), its peak the kernel's high-water mark, its baseline the
    # resident set right after a step.  The device index is then HOST_DEVICE.
    memory: str = "device"

    @property
    def fixed_bytes(self) -> int:
        """What does not grow with the batch at the step's peak: the weights and the optimizer
        state (torch frees gradients between steps, so the loss's peak at the start of the
        backward has none); without a breakdown, the lowest baseline a step left.  For host
        memory always the baseline: the resident set holds the interpreter and torch's
        libraries (~330 MB) besides any tensor, and no breakdown counts those."""
        if (
            self.memory == "device"
            and self.parameters_bytes is not None
            and self.optimizer_state_bytes is not None
        ):
            return self.parameters_bytes + self.optimizer_state_bytes
        return self.baseline_bytes or 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_total_bytes": self.total_bytes,
            "parameters_bytes": self.parameters_bytes,
            "gradients_bytes": self.gradients_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "baseline_bytes": self.baseline_bytes,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "leak": self.leak,
            "memory": self.memory,
        }


def judge_leak(pid: int, marks: dict[int, tuple[float, int]], what: str) -> str:
    """memtop's leak verdict (memtop.diagnosis.leak) on a trainer's per-step baseline: raises
    Leaking when it grows, else says in words what was judged.  `marks`: step -> (time, bytes)."""
    from memtop.diagnosis.leak import MIN_MARKS, detect_from_steps
    from memtop.figures.units import format_bytes

    if len(marks) < MIN_MARKS:
        return f"not judged: {len(marks)} of the {MIN_MARKS} step marks a leak verdict needs"
    steps = sorted(marks)
    verdict = detect_from_steps(
        [float(s) for s in steps], [marks[s][0] for s in steps], [marks[s][1] for s in steps], None
    )
    if verdict.detected:
        raise Leaking(
            f"pid {pid}'s {what} after each step grows {format_bytes(verdict.bytes_per_step)} a "
            f"step (memtop's leak verdict over steps {steps[0]}-{steps[-1]}, confidence "
            f"{verdict.confidence:.0%}): its peak holds the leak, not only activations, so no "
            "batch is fitted from it; fix the leak (`memtop --once` shows it) or calibrate on a "
            "run without it"
        )
    return f"no leak: {verdict.reason}"


def from_replies(pid: int, sample: AgentSample, breakdown: AgentBreakdown | None) -> Measured:
    """A live agent's `sample` and `breakdown` replies (`memtop estimate --from PID`): torch's
    peak since the trainer started (or since a dashboard's `r`), its reserved bytes now."""
    if not sample.devices or max(d.torch_peak for d in sample.devices) <= 0:
        if sample.host_memory is not None:
            host_marks = HostMarks().add(sample.step_marks)
            return _host(pid, sample.host_memory, host_marks, this_machine_bytes())
        raise MeasuredError(
            f"pid {pid}: no device with torch's memory counters and no host memory reading "
            "(a CPU trainer under an older agent?)"
        )
    dev = max(sample.devices, key=lambda d: d.torch_peak)
    parts: dict[str, int] = {}
    if breakdown is not None and dev.index in breakdown.devices:
        parts = dict(breakdown.devices[dev.index])
    by_step = {
        m.step: (m.time, m.allocated[dev.index])
        for m in sample.step_marks
        if dev.index in m.allocated
    }
    leak = judge_leak(pid, by_step, "allocated memory")
    marks = [allocated for _, allocated in by_step.values()]
    return Measured(
        pid=pid,
        device=dev.index,
        peak_bytes=dev.torch_peak,
        reserved_bytes=dev.reserved,
        total_bytes=dev.total_bytes,
        parameters_bytes=parts.get("parameters"),
        gradients_bytes=parts.get("gradients"),
        optimizer_state_bytes=parts.get("optimizer_state")
        if parts.get("optimizer_state")
        else None,
        baseline_bytes=min(marks) if marks else None,
        steps=len(marks),
        first_step=min(by_step) if by_step else None,
        last_step=max(by_step) if by_step else None,
        leak=leak,
    )


def _host(
    pid: int, host: HostMemory, marks: HostMarks, machine_bytes: int | None = None
) -> Measured:
    """A trainer without a CUDA device, measured by its host memory (memtop.agent.host_memory):
    the peak is the kernel's exact high-water mark of its resident set; nothing is cached above
    it (glibc's kept heap is resident already), so reserved is the peak.  Figures that cannot
    be true are refused, as the viewer refuses them (`machine_bytes`: live, this machine's)."""
    problem = host_memory_problem(host, machine_bytes)
    if problem is not None:
        raise MeasuredError(f"pid {pid}: numbers that cannot be true: {problem}")
    leak = judge_leak(pid, marks.series, "resident memory")
    return Measured(
        pid=pid,
        device=HOST_DEVICE,
        peak_bytes=host.peak_rss_bytes,
        reserved_bytes=host.peak_rss_bytes,
        total_bytes=host.total_bytes or 0,
        parameters_bytes=None,
        gradients_bytes=None,
        optimizer_state_bytes=None,
        baseline_bytes=marks.baseline,
        steps=marks.steps,
        first_step=min(marks.series) if marks.series else None,
        last_step=max(marks.series) if marks.series else None,
        leak=leak,
        memory="host",
    )


class HostMarks:
    """The host baseline of a run, folded over its step marks (a recording holds many)."""

    def __init__(self) -> None:
        self.lowest_in_use: int | None = None
        self.lowest_rss: int | None = None
        self.steps = 0
        # step -> (time, what the process holds after it): the series a leak is judged on.
        self.series: dict[int, tuple[float, int]] = {}

    def add(self, marks: Iterable[StepMark]) -> HostMarks:
        for mark in marks:
            if mark.host_rss is None:
                continue
            self.steps += 1
            held = mark.host_in_use
            self.series[mark.step] = (mark.time, held if held is not None else mark.host_rss)
            low = self.lowest_rss
            self.lowest_rss = mark.host_rss if low is None else min(low, mark.host_rss)
            in_use = mark.host_in_use
            if in_use is not None:
                low = self.lowest_in_use
                self.lowest_in_use = in_use if low is None else min(low, in_use)
        return self

    @property
    def baseline(self) -> int | None:
        """What does not grow with the batch: the resident set right after a step less what
        glibc keeps free of the step's tensors (the lowest of the marks that say both), else
        the lowest resident set after a step.  The resident set alone counts what glibc kept
        of the activations as fixed: from batch 1024 of examples/train_cpu.py it predicted
        batch 2048's peak 1.3 % low (21 % of the growth); see memtop.agent.host_memory."""
        return self.lowest_in_use if self.lowest_in_use is not None else self.lowest_rss


def from_recording(path: Path, pid: int | None = None) -> Measured:
    """The trainer `pid` of a recording, or its only trainer; ChooseTrainer when it holds
    several and `pid` is None, Leaking when the one measured leaks."""
    try:
        recording = load(path)
    except RecordError as exc:
        raise MeasuredError(str(exc)) from None
    except OSError as exc:
        raise MeasuredError(f"cannot read {path}: {exc.strerror or exc}") from None
    peaks: dict[tuple[int, int], dict[str, Any]] = {}
    # Per (pid, device), step -> (time, allocated): marks repeat across samples, kept once.
    marks_of: dict[tuple[int, int], dict[int, tuple[float, int]]] = {}
    # The pids that sent samples: the trainers a recording holds.  Every pid's figures are
    # gathered in the one reading, and the trainer chosen after it (reading the recording once
    # for its trainers and again for one of them parsed it twice, and held it all in a list);
    # with --pid, the reading is of the files that hold that pid's events.
    trainers: set[int] = set()
    breakdowns: dict[tuple[int, int], dict[str, int]] = {}
    # Per pid, its newest host memory reading (its peak only grows) and the resident set after
    # each step: what a CPU trainer is measured by.
    hosts: dict[int, HostMemory] = {}
    host_marks: dict[int, HostMarks] = {}
    for event in recording.stream(None if pid is None else {pid}):
        if event.pid is None:
            continue
        if event.kind == "sample" and isinstance(event.value, AgentSample):
            trainers.add(event.pid)
            if event.value.host_memory is not None:
                hosts[event.pid] = event.value.host_memory
                host_marks.setdefault(event.pid, HostMarks()).add(event.value.step_marks)
            for dev in event.value.devices:
                seen = peaks.setdefault(
                    (event.pid, dev.index),
                    {"peak": 0, "reserved": 0, "total": 0, "baseline": None},
                )
                seen["peak"] = max(seen["peak"], dev.torch_peak)
                seen["reserved"] = max(seen["reserved"], dev.reserved)
                seen["total"] = dev.total_bytes or seen["total"]
            for mark in event.value.step_marks:
                for index, allocated in mark.allocated.items():
                    marked = peaks.get((event.pid, index))
                    if marked is None:
                        continue
                    marks_of.setdefault((event.pid, index), {})[mark.step] = (
                        mark.time,
                        allocated,
                    )
                    low = marked["baseline"]
                    marked["baseline"] = allocated if low is None else min(low, allocated)
        elif event.kind == "breakdown" and isinstance(event.value, AgentBreakdown):
            for index, parts in event.value.devices.items():
                if parts.get("optimizer_state", 0) > 0:
                    breakdowns[(event.pid, index)] = dict(parts)
    if pid is not None and pid not in trainers:
        # Which trainers there are, for the message: the whole recording, read for it alone.
        trainers = {
            event.pid
            for event in recording.stream()
            if event.pid is not None
            and event.kind == "sample"
            and isinstance(event.value, AgentSample)
        }
        listed = ", ".join(str(p) for p in sorted(trainers)) or "none"
        raise ChooseTrainer(
            f"--pid {pid}: no trainer of that pid in {path} (its trainers: {listed})"
        )
    if pid is None and len(trainers) > 1:
        raise ChooseTrainer(
            f"{path} holds {len(trainers)} trainers (pids "
            f"{', '.join(str(p) for p in sorted(trainers))}): choose one with --pid"
        )
    if pid is not None:  # the chosen trainer's figures alone
        peaks = {key: seen for key, seen in peaks.items() if key[0] == pid}
        hosts = {key: host for key, host in hosts.items() if key == pid}
    if not peaks or max(p["peak"] for p in peaks.values()) <= 0:
        if hosts:
            pid, host = max(hosts.items(), key=lambda item: item[1].peak_rss_bytes)
            return _host(pid, host, host_marks.get(pid, HostMarks()))
        raise MeasuredError(
            f"{path}: no agent sample with torch's memory counters or host memory readings"
        )
    (pid, device), seen = max(peaks.items(), key=lambda item: item[1]["peak"])
    parts = breakdowns.get((pid, device), {})
    by_step = marks_of.get((pid, device), {})
    leak = judge_leak(pid, by_step, "allocated memory")
    return Measured(
        first_step=min(by_step) if by_step else None,
        last_step=max(by_step) if by_step else None,
        leak=leak,
        pid=pid,
        device=device,
        peak_bytes=seen["peak"],
        reserved_bytes=seen["reserved"],
        total_bytes=seen["total"],
        parameters_bytes=parts.get("parameters"),
        gradients_bytes=parts.get("gradients"),
        optimizer_state_bytes=parts.get("optimizer_state"),
        baseline_bytes=seen["baseline"],
        steps=len(by_step),
    )
