"""The README's replay screenshot: the six real H100 recordings of tests/data/traces played
together, paused 100 s in (the leak has grown, the OOM run is thrashing).

    .venv/bin/python screenshots/make_replay.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from make import to_png  # type: ignore[import-not-found]

from memtop.engine.playback import Player
from memtop.engine.store import Store
from memtop.sources.replay import load
from memtop.ui.replay_app import ReplayApp

HERE = Path(__file__).parent
TRACES = HERE.parent / "tests" / "data" / "traces"


async def shoot(size: tuple[int, int] = (120, 36)) -> Path:
    recording = load(TRACES)
    store = Store()
    player = Player(store, recording)
    player.seek_offset(100)
    app = ReplayApp(store, player, recording, host="h100-box")
    try:
        async with app.run_test(size=size) as pilot:
            await pilot.press("space")  # paused: the picture shows 01:40 exactly
            await pilot.pause(2.0)
            app.save_screenshot("replay.svg", path=str(HERE))
    finally:
        player.stop()
    return to_png(HERE / "replay.svg")


if __name__ == "__main__":
    print(asyncio.run(shoot()))
