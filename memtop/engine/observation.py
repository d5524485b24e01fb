"""One observation per sampler round: the whole picture, joined and diagnosed once.

`Observer.latest()` takes the store's view of its newest generation (`Store.view()`: one lock
take, one whole round) and builds one immutable `Observation` from it, at most once per
generation: every GPU with the processes the driver lists on it and the agent devices on it
(joined by GPU UUID, else by PCI bus id, never by index: CUDA_VISIBLE_DEVICES and
HIP_VISIBLE_DEVICES renumber, and on ROCm torch's UUID is not amdsmi's), every agent with each of
its devices' metrics, the history windows the screens draw, the diagnosis and the suggestions.
The dashboard, the detail screen, `--once` (text and JSON) and any exporter only render it.
The observation holds the round's readings by reference (a GPU's `DeviceReading`, an agent
device's `AgentDeviceSample`) and reads their figures through properties; it copies none.  Its
agents are the store's records themselves (`AgentView`); what it adds to an agent is keyed by
pid or (pid, device index) beside them: each device's one record (`devices_of`, the
diagnosis's), its actions' effects, its host memory's windows, the host's view of its process.
A GPU's accounting (who holds its used bytes) is joined from the same round when first read
(`GpuObservation.accounted`): the GPU screen, the JSON and the exporter read it, not the
dashboard's main screen.

This module is the only place that joins NVML devices, NVML processes and agents; one `Diagnoser`
lives in each `Observer`, and a running memtop has one `Observer`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import field, replace
from functools import partial
from typing import Any

from memtop.base.records import record
from memtop.diagnosis import DeviceDiagnosis, Diagnoser, Diagnosis, GpuObservation, HostDiagnosis
from memtop.diagnosis.effects import ActionEffect, effect
from memtop.diagnosis.facts import HISTORY_ROWS, MARK_ROWS, DeviceHistory
from memtop.diagnosis.leak import leak_label
from memtop.diagnosis.stability import Stabilizer
from memtop.diagnosis.suggestions import host_leak_suggestions, last_seen_leaks, most_severe_first
from memtop.diagnosis.workload import Workload, recognise
from memtop.engine.store import Store
from memtop.figures.units import short_host
from memtop.model import (
    GONE,
    HIDDEN,
    OTHER_NAMESPACE,
    SOURCE_AGENT,
    AccountedProcess,
    Accounting,
    AccountPart,
    ActionRecord,
    AgentDeviceSample,
    AgentHello,
    AgentStatus,
    AgentView,
    Choice,
    DeviceReading,
    DriverReading,
    GpuProcess,
    PidFacts,
    ProcessInfo,
    RoundView,
    Windows,
    bare_uuid,
    host_of,
)

EVENTS = 20  # the newest event messages kept
_NO_HISTORY = DeviceHistory()  # an agent without host memory windows


class ProcessState(Choice):
    """A process row's state, in the words the table shows: its agent's status (AgentStatus),
    or that it has none."""

    AGENT = "agent"  # an agent answers: its numbers are live
    EXITED = "exited"  # gone; its last numbers stay a while, dimmed
    NO_AGENT = "no agent"  # the driver lists it; no memtop agent runs in it
    UNREACHABLE = "unreachable"
    HUNG = "hung"
    INCONSISTENT = "inconsistent"
    REFUSED = "refused"


STATE_LABELS = {
    AgentStatus.CONNECTED: ProcessState.AGENT,
    AgentStatus.EXITED: ProcessState.EXITED,
    AgentStatus.UNREACHABLE: ProcessState.UNREACHABLE,
    AgentStatus.HUNG: ProcessState.HUNG,
    AgentStatus.INCONSISTENT: ProcessState.INCONSISTENT,
    AgentStatus.REFUSED: ProcessState.REFUSED,
}


@record(frozen=True, slots=True)
class ProcessRow:
    """One line of the process table, and the one record of a process on a GPU above the
    store: an agent device, an agent that has no device yet, or a process the driver lists
    without an agent, joined on (pid, GPU UUID) (`_entries`), with the figures and words the
    table, the detail screen and the keys read.  The agent, its device's record and the host's
    view of the process are held by reference and not compared: two rows are equal when what
    they show is (the table repaints only then).  The dashboard adds only what its viewer
    remembers (an exited process's user; `own` for another uid: `memtop.ui.view.build`)."""

    key: str  # stable across refreshes: the table's row key
    pid: int
    user: str
    command: str
    gpu: int | None  # the GPU as the driver numbers it
    device: int | None  # the agent's own device index (for actions and the detail screen)
    used: int | None  # what the driver charges to the process
    allocated: int | None
    reserved: int | None
    peak: int | None  # torch's allocated_bytes.all.peak
    step: int | None
    state: ProcessState
    trend: str  # "+8.0M/step" for a leak, "" otherwise
    own: bool
    full_command: str = ""  # the whole command line (the table shows `command`: basename + args)
    rank: int | None = None  # RANK / LOCAL_RANK / WORLD_SIZE from the agent's hello
    local_rank: int | None = None
    world_size: int | None = None
    launcher: int | None = None  # the parent pid of a rank (torchrun): the group it sits in
    cpu_percent: float | None = None  # host CPU of the process
    rss: int | None = None  # host resident memory
    started: float | None = None  # unix time the process started
    run_seconds: float | None = None  # how long it has run, at the observation's time
    rocm: str | None = None  # the HIP version when its torch is a ROCm build (AMD GPUs)
    host: str = ""  # the machine it runs on, short, when not this one (the fleet view)
    job: str = ""  # its scheduler job or rendezvous, compact (memtop.base.jobs): "slurm 4242"
    # An agent that uses no CUDA device (a CPU trainer): judged by its host memory, and the
    # keys that act on CUDA's caching allocator (cleanup, snapshot, stacks) have nothing to do.
    cpu_only: bool = False
    mig_instance: int | None = None  # the GPU instance id of the MIG instance it runs on
    uuid: str | None = None  # the GPU as the driver names it (None: no GPU)
    # What the process is (memtop.diagnosis.workload): an agent device's as its diagnosis
    # judged it; a process without an agent's from its command line and environment, when they
    # say (None otherwise).  Shown through `command`'s label.
    workload: Workload | None = field(default=None, compare=False)
    # Its agent's record as the store keeps it (the observation's agent: `Observation.agents`).
    agent: AgentView | None = field(default=None, compare=False, repr=False)
    agent_device: DeviceDiagnosis | None = field(default=None, compare=False, repr=False)
    info: ProcessInfo | None = field(default=None, compare=False, repr=False)  # when visible

    @property
    def used_bytes(self) -> int | None:
        """What the driver charges the process on its GPU (`used`)."""
        return self.used

    @property
    def gpu_label(self) -> str:
        """ "0", "0:1" on GPU 0's MIG instance 1 (as `--only` takes it), "—" without a GPU."""
        if self.gpu is None:
            return "—"
        return f"{self.gpu}:{self.mig_instance}" if self.mig_instance is not None else str(self.gpu)

    @property
    def last_known(self) -> bool:
        """Its memory figures are the last ones seen, not live (the process has exited)."""
        return self.state == ProcessState.EXITED

    @property
    def has_agent(self) -> bool:
        return self.state == ProcessState.AGENT


@record(frozen=True)
class Observation:
    """Everything one round shows: the GPUs, the agents and processes on them, and their
    diagnosis."""

    time: float
    generation: int  # the store generation it was built from
    host: str
    uid: int  # the viewer's own uid (whose processes may be terminated)
    nvml_available: bool
    nvml_source: str
    nvml_error: str | None
    driver_version: str | None
    gpus: tuple[GpuObservation, ...]
    # Every agent in view, in any state, by pid: the store's records themselves (who it is,
    # its state, its settings in force, its host memory); each of its devices' one record
    # above the store is the diagnosis's (`devices_of`).
    agents: tuple[AgentView, ...]
    entries: tuple[ProcessRow, ...]  # the process table, by GPU then pid
    diagnosis: Diagnosis
    problems: tuple[str, ...] = ()
    events: tuple[str, ...] = ()  # newest last
    processes: Mapping[int, ProcessInfo] = field(default_factory=dict)
    # What each action performed in an agent did (by this memtop, or anyone: the agent's log),
    # per device, by pid: the windows before and after.
    effects: Mapping[int, tuple[ActionEffect, ...]] = field(default_factory=dict)
    # By pid, the windows the detail screen draws of an agent's own host memory (a CPU
    # trainer's only memory figure): RSS per sample; RSS right after each step.
    host_histories: Mapping[int, DeviceHistory] = field(default_factory=dict)

    @property
    def suggestions(self) -> tuple:  # type: ignore[type-arg]
        return self.diagnosis.suggestions

    @property
    def live_agents(self) -> tuple[AgentView, ...]:
        return tuple(a for a in self.agents if a.live)

    def agent(self, pid: int) -> AgentView | None:
        return next((a for a in self.agents if a.pid == pid), None)

    def devices_of(self, agent: AgentView) -> tuple[DeviceDiagnosis, ...]:
        """Each device of `agent` (as this observation shows it: a scope keeps some), as the
        diagnosis's one record of it, by index."""
        found = self.diagnosis.devices
        return tuple(found[(agent.pid, d.index)] for d in agent.devices)

    def device(self, pid: int, index: int) -> DeviceDiagnosis | None:
        agent = self.agent(pid)
        if agent is None or not any(d.index == index for d in agent.devices):
            return None
        return self.diagnosis.devices.get((pid, index))

    def info(self, pid: int) -> ProcessInfo | None:
        """Owner and command line of `pid`, when visible."""
        return self.processes.get(pid)

    def effects_of(self, pid: int) -> tuple[ActionEffect, ...]:
        return self.effects.get(pid, ())

    def host_history(self, pid: int) -> DeviceHistory:
        return self.host_histories.get(pid) or _NO_HISTORY

    def gpu(self, uuid: str) -> GpuObservation | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


class Observer:
    """Builds the observation of the store's newest generation, at most once per generation.

    One per running memtop (it holds the one `Diagnoser`, whose leak verdicts are cached between
    rounds).  Safe to call from any thread.  `publish()` builds at once: a sampler can call it
    at the end of each round so that the consumers never build on their own thread.
    """

    def __init__(
        self,
        store: Store,
        diagnoser: Diagnoser | None = None,
        *,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        uid: int | None = None,
    ) -> None:
        self.store = store
        self.diagnoser = diagnoser if diagnoser is not None else Diagnoser()
        # Suggestions with hysteresis and a minimum time on screen (no flicker, no reflow).
        self.stabilizer = Stabilizer()
        self.clock = clock
        self.host = host if host is not None else os.uname().nodename
        self.uid = os.getuid() if uid is None else uid
        self.builds = 0
        self._lock = threading.Lock()
        self._latest: Observation | None = None
        # What each agent's rows said of it from its hello last round (`_entries`), by pid.
        self._said: dict[int, _Said] = {}
        # Called with each new observation, on the thread that built it (`--on-alert`): each
        # must be quick and must not raise.
        self.listeners: list[Callable[[Observation], None]] = []

    def latest(self) -> Observation:
        with self._lock:
            latest = self._latest
            built = latest is None or latest.generation != self.store.generation
            if latest is None or built:
                latest = self._latest = self._build(self.store.view())
        if built:
            self._tell(latest)
        return latest

    def forget(self) -> None:
        """Build the next observation as a new observer would (`--once`): no leak verdict, rule
        timing or dwelling suggestion carried over from earlier rounds.  A replay calls it when
        its cursor jumps or stops: what was judged at another moment of the recording must not
        show at this one, and a still screen must read as `replay --once --at T` does."""
        with self._lock:
            self.diagnoser.forget()
            self.stabilizer.forget()
            self._said.clear()
            self._latest = None

    def publish(self) -> Observation:
        """Build now (the sampler's end-of-round hook); later `latest()` calls reuse it."""
        with self._lock:
            latest = self._latest = self._build(self.store.view())
        self._tell(latest)
        return latest

    def _tell(self, observation: Observation) -> None:
        for listener in self.listeners:
            listener(observation)

    # ------------------------------------------------------------------ the one join

    def _build(self, view: RoundView) -> Observation:
        """The one join, of one round: everything read comes from `view` (no store query)."""
        now = self.clock()
        reading = view.driver or DriverReading(available=False, error="devices not read")
        views = view.agents
        infos = view.processes
        driver = reading.available and reading.source != SOURCE_AGENT
        diagnosed = self.diagnoser.diagnose_devices(
            view, now, _placement(reading, driver, _driver_uuids(reading if driver else None))
        )

        effects = {
            agent.pid: _effects(agent, [a for a in view.actions if a.pid == agent.pid], view)
            for agent in views
        }
        host_histories = _HostHistories(view.host_windows)

        gpus = _gpus(
            view, reading, [diagnosed[(a.pid, d.index)] for a in views if a.live for d in a.devices]
        )
        # Each GPU made again with its accounting (joined when a screen reads it) over the
        # GPUs as first made: never over these, which would hold it (a cycle: every round's
        # records left to the cyclic collector, which the dashboard runs rarely).
        gpus = tuple(
            replace(
                g,
                accounted=partial(_accounting, g, gpus, view.owners, view.processes, self.uid),
                workloads=_workloads(g, infos),
            )
            for g in gpus
        )
        hosts = self.diagnoser.diagnose_hosts(view, now)
        # Agents still there that did not answer this round: their suggestions are not gone.
        silent = {a.pid for a in views if not a.live and a.status != AgentStatus.EXITED}
        suggestions = (
            *self.stabilizer.suggest(gpus, now, silent),
            *host_leak_suggestions(hosts.values()),
        )
        diagnosis = Diagnosis(
            time=now,
            devices=diagnosed,
            gpus=gpus,
            suggestions=tuple(
                most_severe_first(
                    [
                        *suggestions,
                        # An exited trainer's leak, kept (marked) while its row is.
                        *last_seen_leaks(
                            diagnosed[(a.pid, d.index)].diagnosis
                            for a in views
                            if a.status == AgentStatus.EXITED
                            for d in a.devices
                        ),
                    ]
                )
            ),
            hosts=hosts,
        )
        self.builds += 1
        return Observation(
            time=now,
            generation=view.generation,
            host=self.host,
            uid=self.uid,
            nvml_available=reading.available,
            nvml_source=reading.source,
            nvml_error=reading.error,
            driver_version=reading.driver_version,
            gpus=gpus,
            agents=views,
            entries=_entries(
                reading, views, diagnosed, infos, gpus, hosts, self.uid, now, self._said
            ),
            diagnosis=diagnosis,
            problems=view.problems,
            events=tuple(message for _, message in view.events[-EVENTS:]),
            processes=infos,
            effects=effects,
            host_histories=host_histories,
        )


def _driver_uuids(
    reading: DriverReading | None,
) -> Callable[[AgentView, AgentDeviceSample], str]:
    """The GPU an agent's device is, as the driver's UUID (DESIGN §13):

    - the driver's device whose UUID is the agent's, compared without the `GPU-`/`MIG-` prefix
      (torch gives it bare; on a MIG slice it is the instance's, or through older paths its
      parent's);
    - where that is a GPU in MIG mode, the instance that lists the agent's pid and whose size
      is the one torch reports (no such single instance: the parent, which is true if vague);
    - else the driver's GPU at the PCI bus id the agent's hello gave (on ROCm torch's UUID is
      HIP's, not amdsmi's), never a GPU in MIG mode or an instance: they share one address;
    - else the agent's UUID as it is (no driver, or a GPU the driver does not list)."""
    devices = reading.devices if reading is not None else ()
    by_uuid = {bare_uuid(d.uuid): d for d in devices}
    instances: dict[int, list[DeviceReading]] = {}
    for d in devices:
        if d.mig is not None:
            instances.setdefault(d.mig.parent_index, []).append(d)
    by_bus = {
        d.pci_bus_id: d.uuid for d in devices if d.pci_bus_id and d.mig is None and not d.mig_mode
    }

    def resolve(agent: AgentView, dev: AgentDeviceSample) -> str:
        declared = (
            next((d for d in agent.hello.devices if d.index == dev.index), None)
            if agent.hello is not None
            else None
        )
        own_uuid = declared.uuid if declared is not None else ""
        found = by_uuid.get(bare_uuid(own_uuid))
        if found is not None:
            if found.mig_mode:
                size = declared.total_bytes if declared is not None else dev.total_bytes
                return _settled_instance(agent.pid, size, instances.get(found.index, [])) or (
                    found.uuid
                )
            return found.uuid
        if not by_bus or declared is None or declared.pci_bus_id is None:
            return own_uuid
        return by_bus.get(declared.pci_bus_id, own_uuid)

    return resolve


class _HostHistories(Mapping[int, DeviceHistory]):
    """Each agent's host memory windows (`_host_history`), made when first read: only the
    detail screen of a CPU trainer draws them, and every round made one per agent (eleven in
    the `mixed` demo) that no screen read."""

    def __init__(self, windows: Mapping[int, Windows]) -> None:
        self._windows = windows
        self._made: dict[int, DeviceHistory] = {}

    def __getitem__(self, pid: int) -> DeviceHistory:
        made = self._made.get(pid)
        if made is None:
            made = self._made[pid] = _host_history(self._windows[pid])
        return made

    def __iter__(self) -> Iterator[int]:
        return iter(self._windows)

    def __len__(self) -> int:
        return len(self._windows)

    def __repr__(self) -> str:
        return repr(dict(self))


def _host_history(windows: Windows) -> DeviceHistory:
    """A process's RSS per sample (as `allocated`) and right after each step (as the marks'
    `allocated`): the detail screen's host memory chart."""
    rows, marks = windows
    return DeviceHistory(
        time=rows.get("time", ())[-HISTORY_ROWS:],
        allocated=rows.get("rss", ())[-HISTORY_ROWS:],
        mark_step=marks.get("step", ())[-MARK_ROWS:],
        mark_time=marks.get("time", ())[-MARK_ROWS:],
        mark_allocated=marks.get("rss", ())[-MARK_ROWS:],
    )


def _settled_instance(pid: int, size: int, instances: Sequence[DeviceReading]) -> str | None:
    """The UUID of the one MIG instance that lists `pid` and is `size` bytes large (within 5 %:
    torch's total_memory and NVML's total may differ by what the driver keeps; profiles differ
    by a factor), else None."""
    matching = [
        d.uuid
        for d in instances
        if any(p.pid == pid for p in d.processes)
        and d.total_bytes is not None
        and abs(d.total_bytes - size) <= 0.05 * max(d.total_bytes, 1)
    ]
    return matching[0] if len(matching) == 1 else None


def _effects(
    agent: AgentView, actions: Sequence[ActionRecord], view: RoundView
) -> tuple[ActionEffect, ...]:
    """Each action's windows before and after it, on each device of its trainer."""
    found = []
    for action in actions:
        if not agent.devices:
            # No device to measure it on (a CPU trainer): the action is still said.
            found.append(ActionEffect(action, None, None, None))
        for dev in agent.devices:
            rows, marks = view.windows(agent.pid, dev.index)
            found.append(
                effect(
                    action,
                    dev.index,
                    rows.get("time", ()),
                    rows.get("reserved", ()),
                    rows.get("split", ()),
                    rows.get("num_alloc_retries", ()),
                    marks.get("step", ()),
                    marks.get("time", ()),
                )
            )
    return tuple(found)


def _placement(
    reading: DriverReading,
    driver: bool,
    driver_uuid: Callable[[AgentView, AgentDeviceSample], str],
) -> Callable[[AgentView, AgentDeviceSample], tuple[str, int, int | None]]:
    """Where each agent device is, for the diagnoser to make its one record there: the driver's
    UUID of its GPU (`driver_uuid`), the driver's number of it (the agent's index without a
    driver view) and what the driver charges the process on it (None: not listed)."""
    gpu_number = {d.uuid: d.index for d in reading.devices} if reading.available else {}
    charged: dict[tuple[int, str], int | None] = {}
    if driver:
        for d in reading.devices:
            for p in d.processes:
                charged[(p.pid, d.uuid)] = p.used_bytes

    def place(agent: AgentView, dev: AgentDeviceSample) -> tuple[str, int, int | None]:
        uuid = driver_uuid(agent, dev)
        return uuid, gpu_number.get(uuid, dev.index), charged.get((agent.pid, uuid))

    return place


def _gpus(
    view: RoundView, reading: DriverReading, devices: Sequence[DeviceDiagnosis]
) -> tuple[GpuObservation, ...]:
    """The driver's GPUs, each with the live agent devices on it (by UUID); then the GPUs only
    agents know about (no driver view, or a UUID the driver does not list), whose account is
    the agents' own mem_get_info."""
    on_gpu: dict[str, list[DeviceDiagnosis]] = {}
    for dev in devices:
        on_gpu.setdefault(dev.uuid or f"{dev.pid}:{dev.index}", []).append(dev)
    gpus = []
    if reading.available:
        for d in reading.devices:
            on_it = on_gpu.pop(d.uuid, [])
            gpus.append(GpuObservation(d, d.processes, tuple(on_it), _used_window(view, d.uuid)))
    for uuid, on_it in on_gpu.items():
        first = on_it[0].sample
        processes = tuple(GpuProcess(a.pid, None) for a in on_it)
        account = DeviceReading(  # the agents' own mem_get_info stands in for a driver's
            index=on_it[0].index,
            uuid=on_it[0].uuid,
            name=on_it[0].name,
            total_bytes=first.total_bytes,
            used_bytes=first.total_bytes - first.free_bytes,
            free_bytes=first.free_bytes,
            processes=processes,
            source=SOURCE_AGENT,
            host=host_of(on_it[0].pid),
        )
        gpus.append(GpuObservation(account, processes, tuple(on_it), _used_window(view, uuid)))
    # A MIG instance right after its parent (its index is the parent's), by instance ids.
    gpus.sort(
        key=lambda g: (
            g.source == SOURCE_AGENT,
            g.index,
            (g.mig.gpu_instance_id, g.mig.compute_instance_id) if g.mig else (-1, -1),
            g.uuid,
        )
    )
    return tuple(gpus)


def _accounting(
    gpu: GpuObservation,
    gpus: Sequence[GpuObservation],
    owners: Mapping[int, PidFacts],
    infos: Mapping[int, ProcessInfo],
    my_uid: int,
) -> Accounting | None:
    """Who holds the used bytes of `gpu` (DESIGN §13): the agents' reserved, their processes'
    bytes outside PyTorch, then every other listed process by what memtop can say of it (no
    agent, another pid namespace, another user's, gone), a GPU in MIG mode's instances, and the
    rest, unattributed.  The parts sum exactly to the driver's used bytes."""
    used = gpu.used_bytes
    if used is None:
        return None
    parts: list[AccountPart] = []
    live = gpu.agents
    parts.append(
        AccountPart(
            "agents_reserved",
            sum(d.reserved_bytes for d in live),
            tuple(sorted({d.pid for d in live})),
        )
    )
    outside = [(d.pid, d.non_pytorch_bytes) for d in live if d.non_pytorch_bytes is not None]
    parts.append(
        AccountPart(
            "agents_outside_pytorch",
            sum(b for _, b in outside),
            tuple(sorted({pid for pid, _ in outside})),
            note=(
                ""
                if len(outside) == len(live)
                else "the driver charges no listed process for "
                + ", ".join(str(d.pid) for d in live if d.non_pytorch_bytes is None)
                + ": its bytes outside PyTorch are in the unattributed rest"
            ),
        )
    )
    agent_pids = {d.pid for d in live}
    groups: dict[str, list[AccountedProcess]] = {
        "no_agent": [],
        "other_namespace": [],
        "other_users": [],
        "gone": [],
    }
    if gpu.source != SOURCE_AGENT:
        for process in gpu.processes:
            if process.pid in agent_pids:
                continue
            name, entry = _accounted(process, owners, infos, my_uid)
            groups[name].append(entry)
    for name, entries in groups.items():
        parts.append(
            AccountPart(
                name,
                sum(e.bytes or 0 for e in entries),
                tuple(e.pid for e in entries),
                tuple(entries),
            )
        )
    if gpu.reading.mig_mode:
        instances = [
            g
            for g in gpus
            if g.mig is not None and g.mig.parent_index == gpu.index and g.host == gpu.host
        ]
        parts.append(
            AccountPart(
                "mig_instances",
                sum(g.used_bytes or 0 for g in instances),
                tuple(sorted({p.pid for g in instances for p in g.processes})),
                note=", ".join(f"{g.label} {g.uuid}" for g in instances),
            )
        )
    rest = used - sum(p.bytes for p in parts)
    if rest < 0:
        parts.append(
            AccountPart(
                "overcounted",
                rest,
                note="the parts above add up to more than the driver's used bytes (a process "
                "charged on two lists, or used read a moment apart from the charges)",
            )
        )
        rest = 0
    unknown = tuple(
        p.pid for p in gpu.processes if p.used_bytes is None and gpu.source != SOURCE_AGENT
    )
    parts.append(
        AccountPart(
            "unattributed",
            rest,
            unknown,
            note=(
                "the driver lists no process for it (an exited process's memory not yet freed, "
                "another container's processes the driver hides, the driver's own)"
                if rest and not unknown
                else "includes processes whose charge the driver does not say (N/A)"
                if unknown
                else ""
            ),
        )
    )
    return Accounting(used, tuple(parts))


def _accounted(
    process: GpuProcess,
    owners: Mapping[int, PidFacts],
    infos: Mapping[int, ProcessInfo],
    my_uid: int,
) -> tuple[str, AccountedProcess]:
    """The part a listed process without an agent belongs to, and what is said of it."""
    facts = owners.get(process.pid)
    info = infos.get(process.pid)
    user = info.user if info is not None and info.visible else None
    base = AccountedProcess(process.pid, process.used_bytes, user=user)
    if facts is None:  # not surveyed (a recording, the fleet): what the process table knows
        why = "not looked at here" if info is None else ("" if info.visible else "not visible")
        return "no_agent", replace(base, why=why)
    state = facts.state
    if state == OTHER_NAMESPACE:
        return "other_namespace", replace(base, why=facts.why, container=facts.container)
    if state == HIDDEN:
        return "other_users", replace(base, why=facts.why)
    if state == GONE:
        return "gone", replace(base, why=facts.why, holders=facts.holders)
    if my_uid != 0 and info is not None and info.visible and info.uid != my_uid:
        return "other_users", replace(base, why=facts.why, attachable=False)
    return "no_agent", replace(base, why=facts.why, attachable=facts.attachable)


def _used_window(view: RoundView, uuid: str) -> tuple[Sequence[float], Sequence[float]]:
    """The newest HISTORY_ROWS of one GPU's used bytes: (times, used), oldest first."""
    times, used = view.used_window(uuid)
    return (times[-HISTORY_ROWS:], used[-HISTORY_ROWS:])


def process_workload(info: ProcessInfo | None) -> Workload | None:
    """What a process without an agent is, where its command line (or its launcher's) or its
    environment says (memtop.diagnosis.workload)."""
    if info is None or not info.visible:
        return None
    return recognise(info.cmdline, info.engine_environ, info.launcher_cmdline)


def _workloads(gpu: GpuObservation, infos: Mapping[int, ProcessInfo]) -> dict[int, Workload]:
    """What each process on `gpu` without an agent is, where it says (the rules read it)."""
    with_agent = {a.pid for a in gpu.agents}
    return {
        p.pid: found
        for p in gpu.processes
        if p.pid not in with_agent and (found := process_workload(infos.get(p.pid))) is not None
    }


def _entries(
    reading: DriverReading,
    agents: Sequence[AgentView],
    diagnosed: Mapping[tuple[int, int], DeviceDiagnosis],
    infos: Mapping[int, ProcessInfo],
    gpus: Sequence[GpuObservation] = (),
    hosts: Mapping[int, HostDiagnosis] | None = None,
    my_uid: int = -1,
    now: float = 0.0,
    said: dict[int, _Said] | None = None,
) -> tuple[ProcessRow, ...]:
    """Agent devices joined with the driver's processes on (pid, GPU UUID); then the driver's
    processes that have no agent: each one row, made once.  `said`: what the previous round's
    rows said of each agent from its hello (`_said`), by pid, kept up to date here."""
    # A process on a MIG instance shows its GPU as "0:1" (GPU 0, GPU instance 1).
    instances = {g.uuid: g.mig.gpu_instance_id for g in gpus if g.mig is not None}
    hosts = hosts or {}
    said = {} if said is None else said
    rows: list[ProcessRow] = []
    seen: set[tuple[int, str]] = set()
    for agent in agents:
        info = infos.get(agent.pid)
        for sampled in agent.devices:
            dev = diagnosed[(agent.pid, sampled.index)]
            seen.add((agent.pid, dev.uuid))
            rows.append(
                _agent_row(agent, info, dev, my_uid, now, instances.get(dev.uuid), hosts, said)
            )
        if not agent.devices:  # not sampled yet, or unreachable
            rows.append(_agent_row(agent, info, None, my_uid, now, None, hosts, said))
    for gone in said.keys() - {agent.pid for agent in agents}:
        del said[gone]
    if reading.available:
        for d in reading.devices:
            for p in d.processes:
                if (p.pid, d.uuid) not in seen:
                    rows.append(
                        _stranger_row(
                            p.pid,
                            d.index,
                            d.uuid,
                            p.used_bytes,
                            infos.get(p.pid),
                            my_uid,
                            now,
                            instances.get(d.uuid),
                        )
                    )
    rows.sort(key=lambda e: (e.gpu if e.gpu is not None else 1 << 30, e.pid))
    return tuple(rows)


def _stranger_row(
    pid: int,
    gpu: int,
    uuid: str,
    used: int | None,
    info: ProcessInfo | None,
    my_uid: int,
    now: float,
    mig_instance: int | None,
) -> ProcessRow:
    """A process the driver lists on a GPU, without an agent."""
    workload = process_workload(info)
    argv = info.cmdline if info and info.visible and info.cmdline else ()
    return ProcessRow(
        key=f"{process_key(pid)}:{uuid}",
        pid=pid,
        host=_where(pid),
        user=_user(info),
        command=_labelled(
            workload,
            short_command(argv) if argv else (info.name if info and info.visible else "?"),
        ),
        full_command=info.command if info and info.visible else "?",
        **_host_usage(info, now),
        gpu=gpu,
        mig_instance=mig_instance,
        device=None,
        used=used,
        allocated=None,
        reserved=None,
        peak=None,
        step=None,
        state=ProcessState.NO_AGENT,
        trend="",
        own=info is not None and info.uid == my_uid,
        uuid=uuid,
        workload=workload,
        info=info,
    )


def _agent_row(
    agent: AgentView,
    info: ProcessInfo | None,
    dev: DeviceDiagnosis | None,
    my_uid: int,
    now: float,
    mig_instance: int | None,
    hosts: Mapping[int, HostDiagnosis],
    said: dict[int, _Said] | None = None,
) -> ProcessRow:
    """An agent's device (or, `dev` None, an agent without one yet: the row keeps its process
    and agent columns and leaves the GPU's blank)."""
    workload = dev.workload if dev is not None else None
    argv = agent.argv or (info.cmdline if info else ())
    words = said.get(agent.pid) if said is not None else None
    if (
        words is None
        or words.hello is not agent.hello
        or words.argv != argv
        or words.workload != workload
    ):
        words = _said(agent, argv, workload)
        if said is not None:
            said[agent.pid] = words
    state = STATE_LABELS[agent.status]
    trend = ""
    if dev is not None and dev.leak.detected and state == ProcessState.AGENT:
        leak = dev.leak
        trend = leak_label(leak.bytes_per_step, leak.bytes_per_second, None, short=True)
    elif dev is not None and dev.leak.detected and state == ProcessState.EXITED:
        # The verdict stays with the row of a trainer that exited, marked as the last seen.
        leak = dev.leak
        trend = "was " + leak_label(leak.bytes_per_step, leak.bytes_per_second, None, short=True)
    own_host = hosts.get(agent.pid)
    if (
        dev is None
        and own_host is not None
        and own_host.leak.detected
        and state == ProcessState.AGENT
    ):
        # A CPU trainer: its verdict is on its host memory (RSS after each step).
        leak = own_host.leak
        trend = "host " + leak_label(leak.bytes_per_step, leak.bytes_per_second, None, short=True)
    process = process_key(agent.pid)
    return ProcessRow(
        key=f"{process}:{dev.uuid or dev.index}" if dev else f"{process}:-",
        pid=agent.pid,
        host=_where(agent.pid),
        user=_user(info),
        command=words.command,
        full_command=words.full_command,
        rank=words.rank,
        local_rank=words.local_rank,
        world_size=words.world_size,
        launcher=getattr(info, "ppid", None) if words.ranked else None,
        **_host_usage(info, now),
        job=words.job,
        gpu=dev.gpu if dev else None,
        mig_instance=mig_instance if dev else None,
        device=dev.index if dev else None,
        used=dev.nvml_used_bytes if dev else None,
        allocated=dev.allocated_bytes if dev else None,
        reserved=dev.reserved_bytes if dev else None,
        peak=dev.peak_bytes if dev else None,
        step=agent.step,
        state=state,
        trend=trend,
        own=info is not None and info.uid == my_uid,
        rocm=words.rocm,
        cpu_only=agent.cpu_only,
        uuid=dev.uuid if dev else None,
        workload=workload,
        agent=agent,
        agent_device=dev,
        info=info,
    )


@record(frozen=True, slots=True)
class _Said:
    """What an agent's row says of it that only its hello, its command line and its workload
    decide: made again only when one of them is another (`_entries`' `said`), not every round
    for every device (job identity, the command's label and its ranks were a tenth of the
    rows' making in the `mixed` demo)."""

    hello: AgentHello | None  # the hello it was said from (compared by identity)
    argv: Sequence[str]
    workload: Workload | None
    command: str
    full_command: str
    rank: int | None
    local_rank: int | None
    world_size: int | None
    ranked: bool  # its hello names a rank: its launcher is its group
    job: str
    rocm: str | None


def _said(agent: AgentView, argv: Sequence[str], workload: Workload | None) -> _Said:
    extra = agent.hello.extra if agent.hello is not None else {}
    job = agent.job
    return _Said(
        hello=agent.hello,
        argv=argv,
        workload=workload,
        command=_labelled(workload, short_command(argv) if argv else "?"),
        full_command=" ".join(argv) if argv else "?",
        rank=_int_or_none(extra.get("rank")),
        local_rank=_int_or_none(extra.get("local_rank")),
        world_size=_int_or_none(extra.get("world_size")),
        ranked=extra.get("rank") is not None,
        job=job.label if job is not None else "",
        rocm=agent.hip,
    )


def short_command(argv: Sequence[str]) -> str:
    """`train_gpt.py --mode leak …`: the program's basename and its arguments (the arguments
    tell runs apart; the directory rarely does).  An interpreter in front of a script goes."""
    args = list(argv)
    if not args:
        return "?"
    program = os.path.basename(args[0])
    if program.startswith("python") and len(args) > 1 and not args[1].startswith("-"):
        args = args[1:]
        program = os.path.basename(args[0])
    return " ".join([program, *args[1:]])


def _labelled(workload: Workload | None, command: str) -> str:
    """A server's command with what it is and what it reserved on purpose in front ("vLLM ·
    0.92 of GPU  vllm serve …"): its usage is then read against its own request."""
    label = workload.label if workload is not None else ""
    return f"{label}  {command}" if label else command


def process_key(pid: int | None) -> str:
    """A pid as a widget key: with its host in the fleet view, where two hosts share pids."""
    remote = host_of(pid)
    return f"{remote}/{pid}" if remote else str(pid)


def _where(pid: int) -> str:
    """The machine a pid runs on, short, when not this one (the fleet view)."""
    remote = host_of(pid)
    return short_host(remote) if remote else ""


def _user(info: ProcessInfo | None) -> str:
    """Its owner as the host names it ("?" where the host does not say)."""
    return info.user if info is not None and info.user else "?"


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _host_usage(info: ProcessInfo | None, now: float) -> dict[str, Any]:
    """Host CPU %, RSS, start and run time, where the process directory measured them."""
    started = info.create_time if info is not None else None
    return {
        "cpu_percent": getattr(info, "cpu_percent", None),
        "rss": getattr(info, "rss", None),
        "started": started,
        "run_seconds": max(0.0, now - started) if started is not None else None,
    }


def observe(store: Store, **kwargs: object) -> Observation:
    """One observation of a store, with a fresh Diagnoser (a one-shot report)."""
    return Observer(store, **kwargs).latest()  # type: ignore[arg-type]
