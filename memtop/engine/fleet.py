"""The fleet view: every host whose `memtop export` Prometheus scrapes, as observations.

`memtop.sources.prometheus` reads the series back into readings of the local kinds; here each
host's readings go into a store of its own and the usual `Observer` builds that host's
`Observation` (one join, one diagnosis), so `--once` renders each host exactly as a local
`--once` on it would.  Judgements that need the host's full-rate data (the leak verdict from
every step's baseline, the smoothed fragmentation, the snapshot figures) are not redone from
scrape-rate samples: `RemoteDiagnoser` takes the host's own.  Suggestions are derived here from
those, by the same rules.

For the dashboard, `FleetSampler` stands in for the local sampler: each round it reads
Prometheus and writes all hosts into one store, keyed by host (`in_fleet`: every pid a
`HostPid`, every GPU named with its host; two hosts share pids and even GPU UUIDs), so the
unchanged app shows host -> GPU -> process.  Actions are local-only: on a remote row they are
refused with a line that says where to run them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memtop.diagnosis import DeviceDiagnosis, Diagnoser
from memtop.diagnosis.fragmentation import GAUGE_SAMPLES
from memtop.diagnosis.leak import LeakBasis, LeakEstimate
from memtop.engine.feed import ActionReply, FeedLoop, refused
from memtop.engine.observation import Observation, Observer
from memtop.engine.store import Store
from memtop.figures.units import short_host
from memtop.model import (
    AgentDeviceSample,
    AgentSample,
    AgentStatus,
    AgentView,
    DeviceReading,
    DriverReading,
    HostPid,
    ProcessInfo,
    host_of,
)
from memtop.protocol.schema import parse_breakdown
from memtop.sources.prometheus import FleetReading, HostReading, PrometheusSource

REMOTE_UID = -1  # no remote process is "ours": the kill key never qualifies one
HISTORY_S = 900.0  # what the dashboard's charts draw, fetched once at start


class RemoteDiagnoser(Diagnoser):
    """A Diagnoser that takes each device's leak verdict and snapshot figures as judged on its
    host (exported next to the numbers), and judges the rest (gauge, pressure, rules) as usual."""

    def __init__(self, host: str = "its host") -> None:
        super().__init__(leak_refresh_s=float("inf"))
        self.verdicts: Mapping[tuple[int, int], dict[str, float]] = {}
        self.host = host  # where the verdicts were judged, for a pid that does not say (local)

    def _device(
        self,
        agent: AgentView,
        dev: AgentDeviceSample,
        now: float,
        launcher_argv: Sequence[str] = (),
        **where: Any,
    ) -> DeviceDiagnosis:
        key = (agent.pid, dev.index)
        verdict = self.verdicts.get(key, {})
        # Seeding the verdict cache keeps the base class from judging the leak again from
        # scrape-rate samples.
        self._leaks[key] = (now, remote_leak(verdict, host_of(agent.pid) or self.host))
        found = super()._device(agent, dev, now, launcher_argv, **where)
        frag = found.fragmentation
        return dataclasses.replace(
            found,
            baseline_bytes=_opt_int(verdict.get("baseline_bytes")),
            fragmentation=dataclasses.replace(
                frag,
                gauge_smoothed=verdict.get("gauge_smoothed", frag.gauge_smoothed),
                # An older exporter does not say how many readings its median rests on; its
                # median is then the host's judgement, over as many as it keeps.
                samples=round(
                    verdict.get(
                        "fragmentation_samples",
                        GAUGE_SAMPLES if "gauge_smoothed" in verdict else frag.samples,
                    )
                ),
                external=verdict.get("external"),
                stranded_bytes=_opt_int(verdict.get("stranded_bytes")),
                largest_free_block_bytes=_opt_int(verdict.get("largest_free_block_bytes")),
            ),
        )


def _opt_int(value: float | None) -> int | None:
    return None if value is None else round(value)


def remote_leak(verdict: Mapping[str, float], host: str) -> LeakEstimate:
    per_step = verdict.get("bytes_per_step")
    per_second = verdict.get("bytes_per_second")
    basis = (
        LeakBasis.STEPS
        if per_step is not None
        else LeakBasis.TIME
        if per_second is not None
        else LeakBasis.NONE
    )
    detected = bool(verdict.get("detected", 0))
    to_full = verdict.get("seconds_to_full")
    steps_to_full = verdict.get("steps_to_full")
    return LeakEstimate(
        detected=detected,
        bytes_per_step=per_step,
        bytes_per_second=per_second,
        steps_to_full=None if steps_to_full is None else round(steps_to_full),
        seconds_to_full=to_full,
        confidence=verdict.get("confidence", 0.0),
        basis=basis,
        samples=round(verdict.get("samples", 0)),
        since=verdict.get("since_step" if basis == LeakBasis.STEPS else "since_time"),
        reason=f"as judged by memtop export on {host}"
        if basis != LeakBasis.NONE
        else f"too little data yet on {host}",
    )


def _process_infos(reading: HostReading, owner: str) -> dict[int, ProcessInfo]:
    """The owner column says where a remote process runs; its command line is the agent's."""
    infos = {}
    for poll in reading.polls:
        argv = poll.hello.argv if poll.hello else ()
        infos[poll.pid] = ProcessInfo(poll.pid, REMOTE_UID, owner, argv, argv[0] if argv else "")
    for device in reading.driver.devices:
        for process in device.processes:
            infos.setdefault(process.pid, ProcessInfo(process.pid, REMOTE_UID, owner, (), ""))
    return infos


def in_fleet(reading: HostReading) -> HostReading:
    """One host's readings as the fleet's one store keeps them, keyed by host: every pid a
    `HostPid` (pids are unique on their host only: containers share them), every GPU UUID
    prefixed with the host and every GPU told its host (two containers on one machine, or two
    simulated hosts, list the same UUID)."""
    host = reading.host

    def pid(number: int) -> HostPid:
        return HostPid(number, host)

    def uuid(text: str) -> str:
        return f"{host}/{text}" if text else text

    devices = tuple(
        dataclasses.replace(
            d,
            uuid=uuid(d.uuid),
            host=host,
            processes=tuple(dataclasses.replace(p, pid=pid(p.pid)) for p in d.processes),
        )
        for d in reading.driver.devices
    )
    polls = []
    for poll in reading.polls:
        hello = poll.hello
        if hello is not None:
            hello = dataclasses.replace(
                hello,
                pid=pid(hello.pid),
                devices=tuple(dataclasses.replace(d, uuid=uuid(d.uuid)) for d in hello.devices),
            )
        polls.append(dataclasses.replace(poll, pid=pid(poll.pid), hello=hello))
    return dataclasses.replace(
        reading,
        driver=dataclasses.replace(reading.driver, devices=devices),
        polls=tuple(polls),
        breakdowns={pid(p): reply for p, reply in reading.breakdowns.items()},
        verdicts={(pid(p), index): v for (p, index), v in reading.verdicts.items()},
        jobs={pid(p): job for p, job in reading.jobs.items()},
    )


def _feed(store: Store, reading: HostReading, polls: Sequence[AgentView], driver: DriverReading,
          owner: str) -> None:  # fmt: skip
    with store.round():  # one host's read is one round
        store.update_processes(_process_infos(reading, owner))
        store.update_driver(driver, reading.time)
        store.update_agents(polls, reading.time)
        for pid, reply in reading.breakdowns.items():
            store.update_breakdown(pid, parse_breakdown(reply), reading.time)


def host_observation(reading: HostReading) -> Observation:
    """One host's observation, as `memtop --once` on that host would build it."""
    store = Store()
    diagnoser = RemoteDiagnoser(reading.host)
    diagnoser.verdicts = dict(reading.verdicts)
    _feed(store, reading, reading.polls, reading.driver, reading.host)
    observer = Observer(
        store, diagnoser, clock=lambda: reading.time, host=reading.host, uid=REMOTE_UID
    )
    return observer.latest()


def fleet_observations(source: PrometheusSource) -> tuple[FleetReading, list[Observation]]:
    reading = source.read()
    return reading, [host_observation(host) for host in reading.hosts]


class FleetSampler(FeedLoop):
    """The fleet's feed (memtop.engine.feed.Feed) under the dashboard: reads Prometheus at the
    interval and writes every host into one store."""

    thread_name = "memtop-fleet"
    failure_label = "fleet"

    def __init__(self, source: PrometheusSource, interval: float = 2.0) -> None:
        super().__init__(Store())
        self.source = source
        self.interval = interval
        self.diagnoser = RemoteDiagnoser()
        self.error: str | None = None  # why the newest read failed; None when it did not

    def observer(
        self,
        *,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        uid: int | None = None,
    ) -> Observer:
        # Every host's verdicts are the fleet diagnoser's; no remote process is the viewer's.
        return Observer(self.store, self.diagnoser, clock=clock, host="fleet", uid=REMOTE_UID)

    def sample_once(self, budget: float | None = None) -> None:
        try:
            fleet = self.source.read()
        except Exception as exc:  # PrometheusError or worse: say it, keep the last picture
            self.error = str(exc)
            self.store.set_problems([str(exc)])
            self.rounds += 1
            return
        self.error = None
        # Every host's readings of this read are published together, as one generation.
        with self.store.round():
            if self.rounds == 0:
                self._load_history(fleet)
            self._apply(fleet)
        self.rounds += 1

    def _apply(self, fleet: FleetReading) -> None:
        problems = list(fleet.problems)
        if not fleet.hosts:
            problems.append(f"no memtop exporter in {self.source.url} (memtop_* series)")
        devices: list[DeviceReading] = []
        verdicts: dict[tuple[int, int], dict[str, float]] = {}
        infos: dict[int, ProcessInfo] = {}
        in_view: set[int] = set()
        for reading in map(in_fleet, fleet.hosts):
            # Fleet-wide GPU numbers in host order, so that the cards and the process table
            # (both sorted by GPU number) group host -> GPU -> process; the card names the
            # host and the GPU's own number there.
            for d in sorted(reading.driver.devices, key=lambda d: d.index):
                name = f"{reading.host} #{d.index}: {d.name}"
                devices.append(dataclasses.replace(d, index=len(devices), name=name))
            infos.update(_process_infos(reading, short_host(reading.host)))
            in_view.update(poll.pid for poll in reading.polls)
            verdicts.update(reading.verdicts)
            # Owners first: a row must never be on screen before its owner is known.
            self.store.update_processes(dict(infos))
            self.store.update_agents(reading.polls, reading.time)
            for pid, reply in reading.breakdowns.items():
                self.store.update_breakdown(pid, parse_breakdown(reply), reading.time)
        self.store.update_driver(
            DriverReading(available=bool(devices), devices=tuple(devices), source="prometheus"),
            max((h.time for h in fleet.hosts), default=time.time()),
        )
        # Agents that left Prometheus's view are gone from the fleet.
        gone = [view.pid for view in self.store.agents() if view.pid not in in_view]
        if gone:
            self.store.update_agents([AgentView(pid, AgentStatus.EXITED) for pid in gone])
        self.diagnoser.verdicts = verdicts
        self.store.set_problems(problems)

    def _load_history(self, fleet: FleetReading) -> None:
        """The charts' history from Prometheus, replayed into the store before the first
        reading (sampled at the interval; best effort)."""
        try:
            history = self.source.history(HISTORY_S, max(self.interval, 1.0))
        except Exception:
            return
        hellos = {p.pid: p.hello for h in map(in_fleet, fleet.hosts) for p in h.polls}
        rows: dict[float, list[AgentView]] = {}
        for host, columns in history.items():
            for (number, index), series in columns.items():
                pid = HostPid(number, host)
                hello = hellos.get(pid)
                if hello is None:
                    continue
                allocated = dict(series.get("allocated", []))
                reserved = dict(series.get("reserved", []))
                peak = dict(series.get("torch_peak", []))
                for stamp, value in allocated.items():
                    stats = {
                        "allocated_bytes.all.current": int(value),
                        "reserved_bytes.all.current": int(reserved.get(stamp, value)),
                        "allocated_bytes.all.peak": int(peak.get(stamp, value)),
                    }
                    sample = AgentSample(stamp, None, (AgentDeviceSample(index, stats, 0, 0),))
                    rows.setdefault(stamp, []).append(
                        AgentView(pid, AgentStatus.CONNECTED, hello, sample)
                    )
        for stamp in sorted(rows):
            self.store.update_agents(rows[stamp], stamp)

    # ------------------------------------------------------------------ the sampler's face

    def _period(self) -> float:
        return self.interval

    def _round(self) -> None:
        self.sample_once()

    def stop(self) -> None:
        self._stop.set()
        self.source.close()  # a read in progress ends now: quitting never waits for a server
        self._stop_thread()

    def where(self, pid: int) -> str:
        return host_of(pid) or "a remote host"

    def may_signal(self, pid: int) -> str | None:
        host = self.where(pid)
        return f"pid {pid} runs on {host}: the fleet view acts locally only (ssh {host})"

    def act(
        self, pid: int, cmd: str, args: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> concurrent.futures.Future[ActionReply]:
        host = self.where(pid)
        return refused(pid, cmd, f"pid {pid} runs on {host}: {cmd} is local-only; run memtop there")
