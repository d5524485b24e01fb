"""A viewer that watches trainers come and go keeps only what it shows (issue 36 item 10: the
dashboard grew 0.5-0.7 MB a minute with a trainer arriving every 10 s).

After 2,000 distinct trainers have arrived and left, every map the viewer keeps by pid holds the
live ones and the recently exited ones the dashboard still shows (the store's grace), no more.
bench/churn.py measures the real dashboard's memory under the same churn for an hour."""

from __future__ import annotations

import asyncio
import subprocess

from ui_frozen import CONTEXT, MY_UID, T0, TOTAL, UUIDS, Trainer, poll_at

from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.model import DeviceReading, DriverReading, GpuProcess
from memtop.sources.agents import CONNECTED, EXITED, AgentPool, AgentView
from memtop.sources.processes import ProcessInfo
from memtop.ui.app import MemtopApp
from memtop.ui.widgets.process_table import ProcessTable

ARRIVALS = 2000
PER_ROUND = 40  # trainers arriving each second, each leaving a second later
GRACE_S = 5.0  # the store's exited rows


def _round(store: Store, t: int, live: list[Trainer], leaving: list[Trainer]) -> None:
    devices = []
    for gpu in (0, 1):
        procs = [GpuProcess(tr.pid, tr.at(t)[1] // 64 + CONTEXT) for tr in live if tr.gpu == gpu]
        used = sum(p.used_bytes or 0 for p in procs)
        devices.append(
            DeviceReading(
                index=gpu, uuid=UUIDS[gpu], name="NVIDIA H100 80GB HBM3", total_bytes=TOTAL,
                used_bytes=used, free_bytes=TOTAL - used, processes=tuple(procs),
            )
        )  # fmt: skip
    store.update_driver(DriverReading(available=True, devices=tuple(devices)), T0 + t)
    polls = [poll_at(tr, t, TOTAL // 2) for tr in live]
    polls += [AgentView(tr.pid, EXITED, tr.hello(), error="process exited") for tr in leaving]
    store.update_agents(polls, T0 + t + 0.01)
    store.update_processes(
        {
            tr.pid: ProcessInfo(
                tr.pid,
                MY_UID,
                f"user{tr.pid}",
                ("python", "train.py", str(tr.pid)),
                "python",
                create_time=T0 + t - 1,
                ppid=1,
            )
            for tr in live
        }
    )


async def _churn(app: MemtopApp, store: Store, clock: list[float]) -> dict[str, set[int]]:
    kinds = ("healthy", "leak", "fragment")
    async with app.run_test(size=(120, 36)) as pilot:
        live: list[Trainer] = []
        arrived = 0
        t = 0
        while arrived < ARRIVALS or live:
            t += 1
            clock[0] = T0 + t + 0.5
            leaving, live = live, []
            for _ in range(PER_ROUND if arrived < ARRIVALS else 0):
                live.append(Trainer(20_000 + arrived, arrived % 2, kinds[arrived % 3]))
                arrived += 1
            _round(store, t, live, leaving)
            app.refresh_view()  # the dashboard's view of the round (and its maps by pid)
            if t % 5 == 0:
                await pilot.pause()  # and now and then on screen
        for _ in range(3):  # the last ones exited; a few rounds inside the grace
            t += 1
            clock[0] = T0 + t + 0.5
            _round(store, t, [], [])
            app.refresh_view()
            await pilot.pause()
        observation = app.observer.latest()
        table = app.query_one(ProcessTable)
        return {
            "store": {agent.pid for agent in store.agents()},
            "shown": {entry.pid for entry in observation.entries},
            "users": set(app._users),
            "leaks": {pid for pid, _ in app.observer.diagnoser._leaks},
            "suggestions": {
                entry.suggestion.pid
                for entry in app.observer.stabilizer._shown.values()
                if entry.suggestion.pid is not None
            },
            "rows": {row.pid for row in table.rows},
        }


def test_after_2000_trainers_came_and_went_the_dashboard_keeps_only_what_it_shows():
    clock = [T0]
    store = Store(keep_exited_s=GRACE_S)
    app = MemtopApp(store, None, clock=lambda: clock[0], my_uid=MY_UID)

    seen = asyncio.run(_churn(app, store, clock))
    # The last PER_ROUND trainers exited 3 s ago, inside the grace: they, and only they, remain.
    last = set(range(20_000 + ARRIVALS - PER_ROUND, 20_000 + ARRIVALS))
    assert seen["store"] == last
    assert seen["shown"] <= last
    assert seen["users"] <= seen["shown"], f"{len(seen['users'])} owners kept"
    assert seen["leaks"] <= last and seen["suggestions"] <= last
    assert seen["rows"] <= last


def test_the_agent_pool_forgets_what_it_verified_of_processes_that_exited(tmp_path):
    pool = AgentPool(tmp_path)
    dead = []
    for _ in range(3):
        child = subprocess.Popen(["true"])
        child.wait()
        dead.append(child.pid)
    from memtop.sources.agents import _Agent

    for pid in dead:
        pool._agents[pid] = _Agent(pid, tmp_path, MY_UID)
        pool._verified[pid] = 12345
    polls = pool.poll(budget=0.1)
    assert {p.pid for p in polls} == set(dead) and {p.state for p in polls} == {EXITED}
    assert not any(pool.verified(pid) for pid in dead)
    assert pool._verified == {}


class _Tap:
    def __init__(self) -> None:
        self.states: list[tuple[int, str]] = []

    def driver(self, when: float, reading: DriverReading) -> None:
        pass

    def processes(self, when: float, processes: dict[int, ProcessInfo]) -> None:
        pass

    def agent_state(self, when: float, pid: int, state: str, error: str | None) -> None:
        self.states.append((pid, state))


def test_a_recording_sampler_keeps_the_states_of_the_agents_of_this_round_only(tmp_path):
    sampler = Sampler(Store(), None, AgentPool(tmp_path))  # type: ignore[arg-type]
    tap = sampler.tap = _Tap()
    reading = DriverReading(available=False, devices=())
    for pid in range(1000, 1000 + 500):
        sampler._tap_round(0.0, 0.0, reading, {}, [AgentView(pid, CONNECTED)])
        sampler._tap_round(0.0, 0.0, reading, {}, [AgentView(pid, EXITED)])
    sampler._tap_round(0.0, 0.0, reading, {}, [])
    assert len(tap.states) == 500  # each exit said once
    assert sampler._tapped_states == {}


def test_the_agent_pool_forgets_container_sockets_that_are_gone(tmp_path):
    directory = tmp_path / "sockets"
    directory.mkdir(mode=0o700)
    pool = AgentPool(directory)
    # What the pool had resolved of 500 container trainers' sockets (name -> inode, pid here),
    # each trainer since gone with its socket.
    pool._foreign = {f"{n}-4026532{n:03d}.sock": (n, 30_000 + n) for n in range(500)}
    pool.poll(budget=0.1)
    assert pool._foreign == {}


def test_a_short_lived_trainer_holds_the_rows_it_sent_not_an_hour_of_them():
    from memtop.engine.store import HISTORY_COLUMNS, HISTORY_SAMPLES, Ring

    ring = Ring(HISTORY_SAMPLES, HISTORY_COLUMNS)
    for t in range(4):  # four seconds of samples
        ring.append(*(float(t),) * len(HISTORY_COLUMNS))
    held = sum(column.buffer_info()[1] * column.itemsize for column in ring._columns)
    assert held < 1024, f"{held} bytes held for 4 rows"
    assert ring.column("time") == [0.0, 1.0, 2.0, 3.0]
    for t in range(4, HISTORY_SAMPLES + 10):  # full, then wrapping as before
        ring.append(*(float(t),) * len(HISTORY_COLUMNS))
    assert len(ring) == HISTORY_SAMPLES
    assert ring.column("time", last=3) == [float(HISTORY_SAMPLES + 7 + i) for i in range(3)]
    assert ring.last("time") == HISTORY_SAMPLES + 9
