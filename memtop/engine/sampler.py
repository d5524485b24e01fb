"""The sampler thread: the only code in the memtop process that does I/O.

Each round it reads the devices (NVML, or the simulated GPUs of a demo), polls every agent, and
writes what it got into the store.  The UI never waits on it; actions a key triggers run on a
small worker pool with their own connection, so a 3-second cleanup does not stall sampling.

A round ends on time whatever the sources do: agents are polled concurrently, each request with
its own deadline (memtop.sources.agents), and the device read runs on a thread of its own, so a
driver call that hangs leaves the last reading on screen and the agents sampled.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from memtop import protocol
from memtop.base.records import record
from memtop.engine.feed import ActionReply, FeedLoop
from memtop.engine.store import Store
from memtop.model import (
    SOURCE_AGENT,
    ActionRecord,
    AgentStatus,
    AgentView,
    DriverReading,
    bare_uuid,
)
from memtop.protocol import commands
from memtop.sources.agents import AgentClient, AgentError, AgentPool, AgentUnreachable
from memtop.sources.owners import GpuOwners
from memtop.sources.processes import ProcessDirectory, ProcessInfo, TerminateRefused, terminate


class DeviceSource(Protocol):
    def read(self) -> DriverReading: ...

    def close(self) -> None: ...


class SamplerTap(Protocol):
    """What `memtop record` is told of each round (the agents' replies it taps on the wire,
    AgentPool.tap)."""

    def driver(self, when: float, reading: DriverReading) -> None: ...

    def processes(self, when: float, processes: dict[int, ProcessInfo]) -> None: ...

    def agent_state(self, when: float, pid: int, state: str, error: str | None) -> None: ...


class IsolatedDevices:
    """Runs `read()` of a device source on a thread of its own: a read that hangs (a wedged
    driver) costs a round at most `wait` seconds, after which the last reading stands in.

    The thread lives as long as the source (a thread started per round cost more than the
    read); a hung read keeps it, and no new read is asked until that one returns."""

    def __init__(self, source: DeviceSource) -> None:
        self.source = source
        self._done = threading.Event()
        self._asked = threading.Event()
        self._closed = False
        self._worker: threading.Thread | None = None
        self._result: DriverReading | None = None
        self._error: BaseException | None = None
        self._running_since: float | None = None  # wall time of the read in flight
        self._latest: DriverReading | None = None
        self.stalled_since: float | None = None

    def read(self, wait: float) -> DriverReading:
        """The newest reading within `wait` seconds, else the last one.  A read still in flight
        from an earlier round that already waited for it is not waited for again, only taken
        if it has come back: with the driver wedged, waiting again every round took each round's
        budget from the agents (each left the 50 ms floor, and on a busy box some replies
        missed it).  So a read slower than a round lands a round later."""
        if self.stalled_since is not None:
            wait = 0.0
        if self._running_since is None:
            self._done.clear()
            self._running_since = time.time()
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._serve, name="memtop-devices", daemon=True
                )
                self._worker.start()
            self._asked.set()
        if self._done.wait(wait):
            self._running_since = None
            self.stalled_since = None
            if self._result is not None:
                self._latest = self._result
            else:
                self._latest = DriverReading(available=False, error=f"device read: {self._error}")
            return self._latest
        self.stalled_since = self._running_since
        if self._latest is not None:
            return self._latest
        since = time.strftime("%H:%M:%S", time.localtime(self._running_since))
        return DriverReading(
            available=False, error=f"the GPU driver is not answering (since {since})"
        )

    def _serve(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            if self._closed:
                return
            try:
                self._result, self._error = self.source.read(), None
            except Exception as exc:
                self._result, self._error = None, exc
            self._done.set()

    def close(self) -> None:
        self._closed = True
        self._asked.set()  # an idle worker wakes and leaves; a hung one is a daemon
        # A hung read holds the source's lock: close on a daemon thread, never wait for it.
        closer = threading.Thread(target=self.source.close, name="memtop-close", daemon=True)
        closer.start()
        closer.join(timeout=1.0)


def _every(name: str) -> float:
    every = commands.BY_NAME[name].viewer_every_s
    assert every is not None, name  # a low-rate command has its interval
    return every


# How often each agent is asked for its low-rate commands: memtop.protocol.commands says why each
# interval is what it is.
BREAKDOWN_INTERVAL_S = _every("breakdown")
SNAPSHOT_INTERVAL_S = _every("snapshot")


class Sampler(FeedLoop):
    """The live feed (memtop.engine.feed.Feed): NVML or the demo's GPUs, and the agents."""

    thread_name = "memtop-sampler"
    failure_label = "sampler"

    def __init__(
        self,
        store: Store,
        devices: DeviceSource,
        agents: AgentPool,
        interval: float = 1.0,
        breakdown_interval: float = BREAKDOWN_INTERVAL_S,
        snapshot_interval: float = SNAPSHOT_INTERVAL_S,
    ) -> None:
        super().__init__(store)
        self.devices = IsolatedDevices(devices)
        self.agents = agents
        self.interval = interval
        self.breakdown_interval = breakdown_interval
        self.snapshot_interval = snapshot_interval
        # The low-rate requests: the breakdown, and a trace-free snapshot whose summary gives the
        # external fragmentation (the agent walks every segment for it, so not every round).
        # (sites: only where stacks are recorded; the pool backs off otherwise.)
        chosen = {"breakdown": breakdown_interval, "snapshot": snapshot_interval}
        agents.low_rate = {name: chosen.get(name, _every(name)) for name in commands.LOW_RATE_NAMES}
        self.last_round_s = 0.0
        self.processes = ProcessDirectory()
        self.owners = GpuOwners()
        self._device_stall_noted: float | None = None
        self._actions = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="memtop-action"
        )
        self.tap: SamplerTap | None = None
        # Told of each driver reading as soon as it is read, before the agents are asked (the
        # dashboard's start paints the GPUs with the first one: memtop.ui.splash).
        self.on_reading: Callable[[DriverReading], None] | None = None
        self._tapped_processes: dict[int, ProcessInfo] | None = None
        self._tapped_states: dict[int, str] = {}

    def round_budget(self) -> float:
        """How long one round may wait for answers: the first, a whole request deadline (every
        agent is new); later ones half the interval, so sampling keeps its pace."""
        if self.rounds == 0:
            return self.agents.timeout + 0.2
        return max(0.1, min(0.5 * self.interval, self.agents.timeout))

    def sample_once(self, budget: float | None = None) -> None:
        started = time.monotonic()
        budget = self.round_budget() if budget is None else budget
        now = time.time()
        reading = self.devices.read(wait=min(budget, 0.5) if self.rounds else budget)
        if self.on_reading is not None:
            self.on_reading(reading)
        known = None
        if reading.available and reading.source != SOURCE_AGENT:
            # By UUID without its prefix (torch gives it bare), and by PCI bus id for the agents
            # whose UUID is not the driver's (ROCm): never a MIG instance's, which is its GPU's.
            known = {
                key: d.total_bytes
                for d in reading.devices
                if d.total_bytes is not None
                for key in (bare_uuid(d.uuid), d.pci_bus_id if d.mig is None else None)
                if key
            }
        remaining = max(0.05, budget - (time.monotonic() - started))
        polls = self.agents.poll(known, budget=remaining)
        polled = time.time()
        # Owners and command lines first: a row must never be on screen before its owner is
        # known (the kill key checks it).
        listed = {p.pid for d in reading.devices for p in d.processes}
        pids = listed | {p.pid for p in polls}
        infos = self.processes.lookup(pids)
        # Who the driver's pids are (container, another user's, gone and what holds their
        # memory): the accounting of each GPU's bytes.  Not for the agents' own account.
        owners = self.owners.survey(listed, infos, listed) if reading.source != SOURCE_AGENT else {}
        if self.tap is not None:
            self._tap_round(now, polled, reading, infos, polls)
        # The round's I/O is done: its writes are published together, as one generation (a
        # dashboard refreshing meanwhile sees the previous round whole, never half of this one).
        with self.store.round():
            stalled = self.devices.stalled_since
            if stalled is not None and self._device_stall_noted != stalled:
                self._device_stall_noted = stalled
                self.store.note("the GPU driver is not answering: showing its last reading")
            self.store.update_processes(infos)
            self.store.update_owners(owners)
            self.store.update_driver(reading, now)
            self.store.update_agents(polls, polled)
            problems = self.agents.problems
            if self.processes.problem is not None:
                problems = [*problems, self.processes.problem]
            self.store.set_problems(problems)
        self.rounds += 1
        self.last_round_s = time.monotonic() - started

    def _tap_round(
        self,
        now: float,
        polled: float,
        reading: DriverReading,
        infos: dict[int, ProcessInfo],
        polls: list[AgentView],
    ) -> None:
        assert self.tap is not None
        if infos != self._tapped_processes:  # as the store: only when it changed
            self._tapped_processes = dict(infos)
            self.tap.processes(now, infos)
        self.tap.driver(now, reading)
        states: dict[int, str] = {}
        for poll in polls:
            state = states[poll.pid] = str(poll.state)
            # A connected agent's replies say it all.
            if self._tapped_states.get(poll.pid) != state and state != "connected":
                self.tap.agent_state(polled, poll.pid, state, poll.error)
        # The pids of this round only: the pool says "exited" once, then no more of that pid.
        self._tapped_states = states

    def _driver_lists(self, pid: int) -> bool:
        reading = self.store.driver()
        if reading is None or reading.source == SOURCE_AGENT:
            return False
        return any(p.pid == pid for d in reading.devices for p in d.processes)

    def may_signal(self, pid: int) -> str | None:
        """Why the kill key must not signal `pid` (None: it may, after the usual owner check).

        A pid qualifies when the driver lists it, or when an agent serving as that pid passed
        authentication (SO_PEERCRED) since the viewer started.  A socket that merely carries a
        pid's number in its name qualifies nothing."""
        if self._driver_lists(pid):
            return None
        state = self.agents.state_of(pid)
        if state == AgentStatus.REFUSED:
            return f"the agent socket of pid {pid} failed authentication; memtop sends it nothing"
        if not self.agents.verified(pid):
            return f"pid {pid} was never verified as the process behind its agent socket"
        return None

    # ------------------------------------------------------------------ thread

    def _period(self) -> float:
        return self.interval

    def _round(self) -> None:
        self.sample_once()
        if self.on_round is not None:
            self.on_round()

    def stop(self) -> None:
        self._stop_thread()
        self._actions.shutdown(wait=False, cancel_futures=True)
        self.agents.close()
        self.devices.close()

    # ------------------------------------------------------------------ actions

    def run_action(
        self, pid: int, cmd: str, args: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """Run one agent command on a worker with its own connection; the future holds the
        result, or raises AgentError / AgentUnreachable with a one-line message."""
        where = self._agent_address(pid)
        return self._actions.submit(ask_agent, pid, cmd, args, where, timeout)

    def act(
        self, pid: int, cmd: str, args: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> concurrent.futures.Future[ActionReply]:
        """`run_action` as the dashboard takes it: a typed reply, failures in its `error`; and
        what the command changes in what this feed shows, done here."""
        where = self._agent_address(pid)

        def work() -> ActionReply:
            try:
                result = ask_agent(pid, cmd, args, where, timeout)
            except (AgentError, AgentUnreachable) as exc:
                return ActionReply(pid, cmd, error=str(exc))
            parsed = protocol.parse_reply(cmd, result) if cmd in protocol.REPLY_PARSERS else None
            if commands.acts(cmd, args):
                # Done in the trainer: its effect is measured from the history around it.  The
                # agent's log number, where it says one, keeps it once when the log comes back.
                seq = result.get("action_seq") if isinstance(result, dict) else None
                self.store.record_action(
                    ActionRecord(
                        cmd,
                        time.time(),
                        pid,
                        {k: v for k, v in (args or {}).items() if k != "wait_s"},
                        by_uid=os.getuid(),
                        by_pid=os.getpid(),
                        seq=seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
                    )
                )
            if cmd == "reset_peak":
                self.store.reset_peak(pid)  # the sampled peak restarts with torch's
            elif cmd == "sites":
                self.agents.ask_soon(pid, "sites")  # the new state now, not at its slow rate
            return ActionReply(pid, cmd, wire=result, parsed=parsed)

        return self._actions.submit(work)

    def _agent_address(self, pid: int) -> AgentAddress:
        agents = self.agents
        return AgentAddress(
            agents.directory_of(pid), agents.owner_of(pid), agents.socket_name_of(pid)
        )

    def signal(self, pid: int, sig: signal.Signals, expected: ProcessInfo | None) -> ActionReply:
        # Checked again just before the signal (terminate re-reads owner, command, start).
        refusal = self.may_signal(pid)
        if refusal is not None:
            return ActionReply(pid, "signal", error=refusal)
        # A pid vouched for by its agent only: it must still be the process that passed the
        # checks (its start time then; a pid handed on and reused is another process).
        started = self.agents.verified_start(pid)
        if self.agents.verified(pid) and started is None and not self._driver_lists(pid):
            return ActionReply(
                pid,
                "signal",
                error=f"cannot tell whether pid {pid} is still the process its agent ran in "
                "(its start time could not be read); nothing sent",
            )
        try:
            message = terminate(pid, expected=expected, sig=sig, started=started)
            return ActionReply(pid, "signal", message=message)
        except TerminateRefused as exc:
            return ActionReply(pid, "signal", error=str(exc))


@record(frozen=True, slots=True)
class AgentAddress:
    """Where the agent of a pid listens and who must own it (its socket's directory, the uid
    behind it, and its name when the process runs in a container)."""

    directory: Path | None
    owner: int | None
    name: str | None = None


def ask_agent(
    pid: int,
    cmd: str,
    args: dict[str, Any] | None,
    where: AgentAddress,
    timeout: float,
    connect_timeout: float | None = None,
) -> dict[str, Any]:
    """One agent command on a connection of its own, authenticated like every other (lstat, no
    symlink, SO_PEERCRED pid and uid, hello): the result, or AgentError / AgentUnreachable with
    one line.  The dashboard's keys and the CLI's commands both act through here."""
    # One deadline for the whole action (connect, authenticate, hello, the reply): the
    # dashboard waits `timeout` for it, so the worker never outlives that wait.
    deadline = time.monotonic() + timeout
    with AgentClient(pid, where.directory, timeout, where.owner, where.name) as client:
        client.connect(timeout=connect_timeout)
        result = client.request(cmd, args, max(0.001, deadline - time.monotonic()))
    if cmd in protocol.REPLY_PARSERS:
        # The reply keeps the wire schema or the action fails with one line: what is then
        # shown of it (bytes per device) is known to be numbers.
        try:
            protocol.parse_reply(cmd, result)
        except protocol.ProtocolError as exc:
            raise MalformedReply(
                exc.code, f"the agent of pid {pid} sent a malformed reply: {exc.message}"
            ) from None
    return result


class MalformedReply(AgentError):
    """A reply that breaks the wire schema: the agent's fault, said without the wire's code."""
