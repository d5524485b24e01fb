"""Issue 35: every key that does something is one record (memtop.ui.actions), and `--readonly`,
replay, the footer and the help screen all read that one table.

The bug the parallel lists caused: `stacks` (`w`) was in none of the four lists of keys that act
on a process, so under `--readonly` it still asked and then turned on stack recording inside
the trainer (a few % of every step), and a replay offered it and then refused it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_ui_nvitop import drive
from ui_helpers import live_app, notifications, screen_text, wait_for

from memtop.engine.playback import Player
from memtop.engine.store import Store
from memtop.sources.replay import load
from memtop.ui.app import MemtopApp
from memtop.ui.replay_app import ReplayApp
from memtop.ui.screens.confirm import ConfirmScreen

TRACES = Path(__file__).parent / "data" / "traces"


@pytest.mark.slow
def test_readonly_refuses_the_stacks_key_and_the_trainer_records_no_stacks(
    socket_dir: Path,
) -> None:
    from test_ui_live import agent_rows, select

    from memtop.sim.demo import Demo
    from memtop.sources.agent_client import AgentClient

    demo = Demo(gpus=1, scenario="leak", step_time=0.05, socket_dir=socket_dir)
    demo.start()
    app, sampler = live_app(socket_dir, readonly=True)
    seen: dict[str, object] = {}

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: len(agent_rows(app)) == 1, 30)
            pid = agent_rows(app)[0].pid
            await select(app, pid)
            default = app.screen
            await pilot.press("w")
            await pilot.pause(0.3)
            seen["asked"] = app.screen is not default
            await pilot.press("y")  # had it asked, this is "on"
            await pilot.pause(1.0)  # the trainer steps every 50 ms: 20 boundaries
            with AgentClient(pid, socket_dir, timeout=5.0) as client:
                client.connect()
                seen["trainer"] = client.request("sites")
            seen["said"] = notifications(app)

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
        demo.stop()
    trainer = seen["trainer"]
    assert isinstance(trainer, dict)
    # The trainer's own word: nobody asked it to record stacks, and it does not.
    assert trainer["wanted"] is False and trainer["enabled"] is False, trainer
    assert seen["asked"] is False  # no "Record allocation stacks?" question
    said = seen["said"]
    assert isinstance(said, list)
    assert any("Read-only" in n and "stacks" in n for n in said), said
    assert not any("Stack recording" in n for n in said), said


def replay_app() -> tuple[ReplayApp, Player]:
    recording = load(TRACES / "leak.jsonl.gz")
    store = Store()
    player = Player(store, recording)
    player.seek_offset(20)
    return ReplayApp(store, player, recording, host="replay"), player


def test_a_replay_offers_no_key_that_acts_on_a_process() -> None:
    # `w` opened "Record allocation stacks in pid 427?" on a recording, which then failed.
    app, player = replay_app()
    ids = {b.id for b in app._bindings_with_ids()}
    assert {"cleanup", "reset_peak", "snapshot", "kill", "attach", "stacks", "pause"}.isdisjoint(
        ids
    ), ids
    assert "replay.play" in ids and "copy_fix" in ids

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("space")  # paused: the recording's agent row stays put
        await wait_for(pilot, lambda: app.observation is not None and app.observation.agents)
        for key in ("w", "c", "s", "k", "a"):
            await pilot.press(key)
            await pilot.pause(0.1)
            assert not isinstance(app.screen, ConfirmScreen), key
        assert not any("failed" in n or "not live" in n for n in notifications(app))
        await pilot.press("question_mark")
        await pilot.pause(0.3)
        help_screen = screen_text(app.export_screenshot())
        assert "record allocation stacks" not in help_screen  # help lists this app's keys
        assert "gc.collect()" not in help_screen
        assert "pause / play" in help_screen

    try:
        drive(app, body)
    finally:
        player.stop()


# A key that acts on a process, added to the table and nowhere else (its handler set on the
# class, as a new `action_poke` method would be): --readonly refuses it, a replay does not offer
# it, the help screen lists it and says it is off. In a process of its own: the app's classes
# read the table when they are made.
ONE_MORE_KEY = """
import asyncio, sys
from memtop.ui import actions
POKE = actions.Action(
    "poke", "x", "poke", "Poke", "poke the selected process", acts_on_process=True
)
actions.DASHBOARD = (*actions.DASHBOARD, POKE)

from test_ui_nvitop import drive
from ui_frozen import MY_UID, NOW, frozen_store
from ui_helpers import notifications, screen_text
from memtop.engine.playback import Player
from memtop.sources.replay import load
from memtop.engine.store import Store
from memtop.ui.app import MemtopApp
from memtop.ui.replay_app import ReplayApp

poked = []
MemtopApp.action_poke = lambda self: poked.append(self.readonly)


def app(readonly):
    return MemtopApp(frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, readonly=readonly)


async def live(app, pilot):
    await pilot.press("x")
    await pilot.pause(0.1)
    assert "Poke" in screen_text(app.export_screenshot()).splitlines()[-1]

drive(app(False), live)
assert poked == [False], poked

async def readonly(app, pilot):
    footer = screen_text(app.export_screenshot()).splitlines()[-1]
    assert "Poke" not in footer and footer.endswith("read-only"), footer
    await pilot.press("x")
    await pilot.pause(0.1)
    said = [n for n in notifications(app) if "Read-only" in n]
    assert said and "poke" in said[0], said
    await pilot.press("question_mark")
    await pilot.pause(0.3)
    text = screen_text(app.export_screenshot())
    assert "poke the selected process" in text and "expandable, poke are off" in text, text

drive(app(True), readonly)
assert poked == [False], poked

from pathlib import Path
recording = load(Path(sys.argv[1]))
store = Store()
player = Player(store, recording)
replay = ReplayApp(store, player, recording, host="replay")
assert "poke" not in {b.id for b in replay._bindings_with_ids()}

async def on_replay(app, pilot):
    await pilot.press("x")
    await pilot.pause(0.1)
    await pilot.press("question_mark")
    await pilot.pause(0.3)
    assert "poke the selected process" not in screen_text(app.export_screenshot())

try:
    drive(replay, on_replay)
finally:
    player.stop()
assert poked == [False], poked
print("refused where it must be")
"""


def test_a_key_added_to_the_table_alone_is_refused_in_readonly_and_replay(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    tests = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", ONE_MORE_KEY, str(TRACES / "leak.jsonl.gz")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("refused where it must be")


def test_readme_key_table_names_only_keys_of_the_table_and_what_readonly_takes_off() -> None:
    # (tests/test_ui_truth.py checks the other way: every key of the table is in the README.)
    import re

    from memtop.ui import actions

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ")]
    start = rows.index("| key | binding id | does |")
    ids = set()
    for row in rows[start + 1 :]:
        cells = row.split("|")
        if len(cells) < 4 or "`" not in cells[2]:
            break
        ids.update(re.findall(r"`([\w.]+)`", cells[2]))
    known = {a.id for a in (*actions.DASHBOARD, *actions.TABLE, *actions.GPU_CARD)}
    assert ids and ids <= known, ids - known
    # Its sentence on --readonly names what the table takes off, every one.
    words = " ".join(readme.split())
    assert f"acts on a process ({actions.refused_words(actions.DASHBOARD)}) off" in words
    # Every command a key sends is one of the protocol's, and one that can change the trainer
    # (a key that sends one is a key that acts on a process: off under --readonly).
    from memtop.protocol import commands

    for action in actions.DASHBOARD:
        assert (action.command is not None) == action.needs_agent, action.id
        if action.command is not None:
            command = commands.BY_NAME[action.command]
            assert command.changes_trainer or command.acting_args, action.id
            assert action.acts_on_process, action.id


@pytest.mark.slow
@pytest.mark.parametrize("readonly", [False, True])
def test_the_expandable_key_asks_then_tunes_the_trainer_live(
    socket_dir: Path, readonly: bool
) -> None:
    # Issue 34: `e` turns expandable segments on inside the selected trainer, after a question
    # that says the setting before → after, that cached segments keep their kind and how to
    # undo; under --readonly it neither asks nor changes anything.
    from test_ui_live import INTERVAL, agent_rows, select

    from memtop.engine.sampler import Sampler
    from memtop.sim.demo import Demo
    from memtop.sources.agent_client import AgentClient
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource

    demo = Demo(
        gpus=1,
        scenario="fragment",
        step_time=0.05,
        socket_dir=socket_dir,
        extra_env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"},
    )
    demo.start()
    store = Store()
    sampler = Sampler(
        store,
        DefaultDeviceSource(socket_dir, simulated_only=True),
        AgentPool(socket_dir),
        interval=INTERVAL,
    )
    sampler.start()
    app = MemtopApp(store, sampler, interval=INTERVAL, readonly=readonly)
    seen: dict[str, object] = {}

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: len(agent_rows(app)) == 1, 30)
            pid = agent_rows(app)[0].pid
            seen["pid"] = pid
            await select(app, pid)
            await pilot.press("e")
            await pilot.pause(0.3)
            asked = app.screen if isinstance(app.screen, ConfirmScreen) else None
            seen["question"] = (asked.question, asked.detail) if asked is not None else None
            await pilot.press("y")
            if not readonly:
                await wait_for(
                    pilot, lambda: any("→" in n for n in notifications(app) if "256" in n), 20
                )
            else:
                await pilot.pause(1.0)
            with AgentClient(pid, socket_dir, timeout=5.0) as client:
                client.connect()
                seen["settings"] = client.request("sample")["allocator_settings"]
            seen["said"] = notifications(app)

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
        demo.stop()
    said = seen["said"]
    assert isinstance(said, list)
    if readonly:
        assert seen["question"] is None
        assert seen["settings"] == "max_split_size_mb:256"
        assert any("Read-only" in n and "expandable" in n for n in said), said
        return
    question = seen["question"]
    assert isinstance(question, tuple)
    title, detail = question
    assert title == f"Expandable segments in pid {seen['pid']}?"
    assert "max_split_size_mb:256 → max_split_size_mb:256,expandable_segments:True" in detail
    assert "Segments already cached keep their kind" in detail
    assert f"Undo: memtop tune {seen['pid']} expandable_segments=False" in detail
    # The trainer's own word: the user's key kept, expandable segments on.
    assert seen["settings"] == "max_split_size_mb:256,expandable_segments:True"
