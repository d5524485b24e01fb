"""`memtop replay` of real H100 agent wire recordings (tests/data/traces, copies of
shared/traces/cuda-h100): the diagnosis runs on them as on a live run."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from memtop.cli import main
from memtop.engine.observation import Observer
from memtop.engine.playback import Player
from memtop.engine.store import Store
from memtop.sources.replay import load

TRACES = Path(__file__).parent / "data" / "traces"
LEAK_BYTES_PER_STEP = 12 * 2**20  # the ground truth of leak.jsonl.gz


def replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code = main(["replay", *args, "--once", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def leaks(data: dict) -> list[dict]:
    return [d["leak"] for a in data["agents"] for d in a["devices"] if d.get("leak")]


def test_leak_recording_finds_12_mib_per_step(capsys):
    data = replay_json(capsys, str(TRACES / "leak.jsonl.gz"))
    (agent,) = data["agents"]
    assert agent["pid"] == 427 and agent["torch"] == "2.11.0+cu130"
    (leak,) = leaks(data)
    assert leak["detected"] is True
    assert abs(leak["bytes_per_step"] - LEAK_BYTES_PER_STEP) / LEAK_BYTES_PER_STEP < 0.05
    assert any(s["title"].startswith("Leak") for s in data["suggestions"])
    assert data["replay"]["duration_s"] == pytest.approx(170.4, abs=0.5)
    assert data["replay"]["at_s"] == data["replay"]["duration_s"]


@pytest.mark.parametrize(
    "name", ["healthy", "fragment", "fragment-expandable", "oom", "hf-trainer"]
)
def test_other_recordings_give_no_leak(capsys, name):
    data = replay_json(capsys, str(TRACES / f"{name}.jsonl.gz"))
    (agent,) = data["agents"]
    found = leaks(data)
    assert found, "no leak verdict at all: the steps were not replayed"
    assert all(not leak["detected"] for leak in found), found
    assert agent["devices"][0]["step"] > 500
    assert not any(s["title"].startswith("Leak") for s in data["suggestions"])
    if name == "fragment-expandable":  # it has them already: never suggest them
        assert not any("expandable" in s["title"].lower() for s in data["suggestions"])


def test_trainers_that_died_show_as_exited_with_their_devices(capsys):
    # hf-trainer initialised CUDA after its agent's hello: its devices come from the samples.
    data = replay_json(capsys, str(TRACES / "hf-trainer.jsonl.gz"))
    (agent,) = data["agents"]
    assert agent["state"] == "exited"
    assert agent["devices"][0]["uuid"].startswith("GPU-")


def test_a_folder_plays_every_agent_together(capsys, tmp_path: Path):
    data = replay_json(capsys, str(TRACES))
    assert sorted(a["pid"] for a in data["agents"]) == [426, 427, 430, 431, 432, 434]
    detected = [
        a["pid"]
        for a in data["agents"]
        for d in a["devices"]
        if (d.get("leak") or {}).get("detected")
    ]
    assert detected == [427]
    # Two recordings with the same pid (two machines) stay two agents.
    shutil.copy(TRACES / "leak.jsonl.gz", tmp_path / "a.jsonl.gz")
    shutil.copy(TRACES / "leak.jsonl.gz", tmp_path / "b.jsonl.gz")
    assert len(replay_json(capsys, str(tmp_path))["agents"]) == 2


def test_at_shows_the_moment_asked_for(capsys):
    early = replay_json(capsys, str(TRACES / "leak.jsonl.gz"), "--at", "30")
    late = replay_json(capsys, str(TRACES / "leak.jsonl.gz"), "--at", "150")
    assert early["replay"]["at_s"] == pytest.approx(30, abs=0.01)
    step = lambda d: d["agents"][0]["devices"][0]["step"]  # noqa: E731
    assert 0 < step(early) < step(late)
    assert early["time"] == pytest.approx(early["replay"]["started"] + 30, abs=0.01)
    allocated = lambda d: d["agents"][0]["devices"][0]["allocated_bytes"]  # noqa: E731
    assert allocated(early) < allocated(late)  # it leaks


def test_seeking_back_replays_from_the_start():
    recording = load(TRACES / "leak.jsonl.gz")
    store = Store()
    player = Player(store, recording)
    observer = Observer(store, clock=player.clock)
    player.seek_offset(150)
    late = observer.latest().agents[0].step
    player.seek_offset(30)
    back = observer.latest().agents[0].step
    fresh_store = Store()
    fresh = Player(fresh_store, recording)
    fresh.seek_offset(30)
    assert back == Observer(fresh_store, clock=fresh.clock).latest().agents[0].step
    assert back is not None and late is not None and back < late
    steps = store.step_marks(427, 0)["step"]
    assert steps and max(steps) <= back


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: d / "missing.jsonl.gz", "no such file or directory"),
        (lambda d: _write(d / "x.jsonl.gz", b'{"hello": 1}\n'), "neither a memtop record"),
        (lambda d: _write(d / "x.memtop", b"\x1f\x8bnot gzip at all"), "not a readable gzip"),
        (lambda d: _write(d / "x.jsonl", b"not json\n{}\n"), "not JSON"),
        (lambda d: d, "no recordings in"),
    ],
)
def test_bad_input_gets_one_line(capsys, tmp_path: Path, make, says):
    target = make(tmp_path)
    code = main(["replay", str(target), "--once", "--json"])
    err = capsys.readouterr().err
    assert code == 1
    assert says in err and err.count("\n") == 1 and err.startswith("memtop: ")


def test_at_outside_the_recording_is_refused(capsys):
    code = main(["replay", str(TRACES / "leak.jsonl.gz"), "--once", "--at", "1000"])
    err = capsys.readouterr().err
    assert code == 1 and "outside the recording (0 to 170.4 s)" in err


def test_a_recording_cut_mid_line_plays_what_is_whole(capsys, tmp_path: Path):
    lines = gzip.decompress((TRACES / "leak.jsonl.gz").read_bytes()).splitlines(keepends=True)
    cut = b"".join(lines[:100]) + lines[100][:50]  # the 101st line half-written
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(cut)[:-20])  # no gzip trailer either
    data = replay_json(capsys, str(tmp_path / "cut.jsonl.gz"))
    assert data["agents"][0]["devices"][0]["step"] > 0


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_replay_dashboard_cursor_keys():
    import asyncio

    from memtop.ui.replay_app import ReplayApp

    recording = load(TRACES / "leak.jsonl.gz")
    store = Store()
    player = Player(store, recording)
    player.seek_offset(20)
    app = ReplayApp(store, player, recording, host="replay")

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.3)
            await pilot.press("space")  # pause: the cursor stops
            stopped = player.offset
            assert player.paused
            await pilot.pause(0.3)
            assert player.offset == stopped
            assert "REPLAY 00:2" in app.header_bar.render().plain  # type: ignore[union-attr]
            assert "PAUSED" in app.header_bar.render().plain  # type: ignore[union-attr]
            await pilot.press("right")
            assert player.offset == pytest.approx(stopped + 10)
            await pilot.press("left", "left")
            assert player.offset == pytest.approx(stopped - 10)
            await pilot.press("right_square_bracket", "right_square_bracket")
            assert player.speed == 4.0
            await pilot.press("left_square_bracket")
            assert player.speed == 2.0
            await pilot.press("space")
            await pilot.pause(0.5)
            assert player.offset > stopped - 10 + 0.5  # playing at x2
            assert app.observation is not None and app.observation.agents[0].pid == 427
            # Actions that would reach a process are not offered on a replay.
            await pilot.press("k")
            assert not app.screen_stack[1:]
            await pilot.press("q")

    try:
        asyncio.run(main())
    finally:
        player.stop()
