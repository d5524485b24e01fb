"""The sampler thread: the only code in the memtop process that does I/O.

Each round it reads the devices (NVML, or the simulated GPUs of a demo), polls every agent, and
writes what it got into the store.  The UI never waits on it; actions a key triggers run on a
small worker pool with their own connection, so a 3-second cleanup does not stall sampling.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from memtop.model import NvmlReading
from memtop.sources.agents import CONNECTED, AgentClient, AgentPool
from memtop.sources.processes import ProcessDirectory
from memtop.store import Store


class DeviceSource(Protocol):
    def read(self) -> NvmlReading: ...

    def close(self) -> None: ...


class Sampler:
    def __init__(
        self,
        store: Store,
        devices: DeviceSource,
        agents: AgentPool,
        interval: float = 1.0,
        breakdown_interval: float = 10.0,
        snapshot_interval: float = 60.0,
    ) -> None:
        self.store = store
        self.devices = devices
        self.agents = agents
        self.interval = interval
        self.breakdown_interval = breakdown_interval
        self.snapshot_interval = snapshot_interval
        self.rounds = 0
        self.last_round_s = 0.0
        self._due: dict[tuple[int, str], float] = {}
        self.processes = ProcessDirectory()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._actions = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="memtop-action"
        )

    def sample_once(self) -> None:
        started = time.monotonic()
        now = time.time()
        reading = self.devices.read()
        polls = self.agents.poll()
        polled = time.time()
        # Owners and command lines first: a row must never be on screen before its owner is
        # known (the kill key checks it).
        pids = {p.pid for d in reading.devices for p in d.processes} | {p.pid for p in polls}
        self.store.update_processes(self.processes.lookup(pids))
        self.store.update_nvml(reading, now)
        self.store.update_agents(polls, polled)
        self.store.set_problems(self.agents.problems)
        for poll in polls:
            if poll.state == CONNECTED:
                self._maybe_breakdown(poll.pid)
        live = {poll.pid for poll in polls}
        self._due = {key: due for key, due in self._due.items() if key[0] in live}
        self.rounds += 1
        self.last_round_s = time.monotonic() - started

    def _maybe_breakdown(self, pid: int) -> None:
        """The low-rate requests: the breakdown, and a trace-free snapshot whose summary gives
        the external fragmentation (the agent walks every segment for it, so not every round).
        """
        now = time.monotonic()
        for cmd, interval, keep in (
            ("breakdown", self.breakdown_interval, self.store.update_breakdown),
            ("snapshot", self.snapshot_interval, self.store.update_snapshot_summary),
        ):
            if interval <= 0 or now < self._due.get((pid, cmd), 0.0):
                continue
            self._due[(pid, cmd)] = now + interval
            client = self.agents.client(pid)
            if client is None:
                return
            # An agent without the command (another implementation of the protocol) is still a
            # fine agent: the dashboard just goes without that figure.
            with contextlib.suppress(Exception):
                keep(pid, client.request(cmd))

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memtop-sampler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            deadline = time.monotonic() + self.interval
            if not self._paused.is_set():
                try:
                    self.sample_once()
                except Exception as exc:  # keep sampling; say what happened
                    self.store.note(f"sampler: {type(exc).__name__}: {exc}")
            self._stop.wait(max(0.0, deadline - time.monotonic()))

    def pause(self, paused: bool) -> None:
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._actions.shutdown(wait=False, cancel_futures=True)
        self.agents.close()
        self.devices.close()

    # ------------------------------------------------------------------ actions

    def run_action(
        self, pid: int, cmd: str, args: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """Run one agent command on a worker with its own connection; the future holds the
        result, or raises AgentError / AgentUnreachable with a one-line message."""
        directory: Path | None = self.agents.directory_of(pid)

        def work() -> dict[str, Any]:
            with AgentClient(pid, directory, timeout) as client:
                client.connect()
                return client.request(cmd, args, timeout)

        return self._actions.submit(work)
