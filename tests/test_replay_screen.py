"""The replay dashboard's screen against `memtop replay FILE --once --json --at T` (issue 21,
item 1): after a seek, a speed change, while paused and at the end, every figure the dashboard
draws for each process and GPU is the one the report gives for the cursor's moment.

The recordings are tests/data/traces, byte-for-byte copies of shared/traces/cuda-h100 (real
PyTorch trainers on one H100).  The screen is read as text from a screenshot of the real app
under Textual's pilot: what the widgets draw, held figures included, not the values behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from ui_helpers import screen_text, wait_for

from memtop.cli import main
from memtop.engine.playback import Player
from memtop.engine.store import Store
from memtop.figures.units import format_bytes
from memtop.sources.replay import load
from memtop.ui.render import short_bytes
from memtop.ui.replay_app import ReplayApp, _clock_text
from memtop.ui.view import leak_label

TRACES = Path(__file__).parent / "data" / "traces"


def report_at(path: Path, player: Player) -> dict:
    """`memtop replay PATH --once --json --at T` for the player's cursor."""
    args = ["replay", str(path), "--once", "--json"]
    if not player.at_end:  # at the end: the default (start + offset may miss it by an ulp)
        args += ["--at", repr(player.offset)]
    out = io.StringIO()  # the app under the pilot has stdout: the report's is our own
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return json.loads(out.getvalue())


def _mem(value: int | None, exited: bool) -> str:
    if value is None:
        return "—"
    return ("~" if exited else "") + short_bytes(value)


def expected_rows(report: dict) -> dict[int, str]:
    """Each process line of the table as a pattern, from the report's figures."""
    rows = {}
    for agent in report["agents"]:
        exited = agent["state"] == "exited"
        for dev in agent["devices"]:
            leak = dev.get("leak") or {}
            trend = ""
            if leak.get("detected") and agent["state"] == "connected":
                trend = leak_label(leak["bytes_per_step"], leak["bytes_per_second"], None, True)
            if agent["state"] != "connected":
                step = "exited" if exited else agent["state"][:7]
            else:
                step = "—" if agent["step"] is None else str(agent["step"])
            # What the driver charges it (these recordings hold no driver readings: "—").
            other = dev["non_pytorch_bytes"]
            used = "—" if other is None else _mem(other + dev["reserved_bytes"], exited)
            cells = [
                str(agent["pid"]),
                r"\S+",  # user
                str(dev["gpu"]),
                re.escape(used),
                re.escape(_mem(dev["allocated_bytes"], exited)),
                re.escape(_mem(dev["reserved_bytes"], exited)),
                re.escape(_mem(dev["peak_bytes"], exited)),
                r"\S+",  # CPU%
                r"\S+",  # RSS
                r"\S+",  # TIME
                step,
            ]
            rows[agent["pid"]] = r"│\s+" + r"\s+".join(cells) + (r"\s+" + re.escape(trend))
    return rows


def expected_cards(report: dict) -> list[tuple[str, str]]:
    """Each GPU card's two lines (the figures on them) as patterns."""
    cards = []
    for gpu in report["devices"]:
        live = [
            {**d, "pid": a["pid"]}
            for a in report["agents"]
            if a["state"] == "connected"
            for d in a["devices"]
            if d["uuid"] == gpu["uuid"]
        ]
        used, total = gpu["used_bytes"], gpu["total_bytes"]
        first = f"{format_bytes(used)} / {format_bytes(total)} {100 * used / total:5.1f} %"
        reserved = sum(d["reserved_bytes"] for d in live)
        figures = (
            f"alloc {short_bytes(sum(d['allocated_bytes'] for d in live))} "
            f"rsvd {short_bytes(reserved)} other {short_bytes(max(0, used - reserved))} "
            f"Σpeak {short_bytes(gpu['peak_sum_bytes'])} "
            f"frag {max(d['fragmentation_smoothed'] for d in live):.2f}"
        )
        leaking = [d for d in live if (d.get("leak") or {}).get("detected")]
        if leaking:
            leader = max(leaking, key=lambda d: d["leak"]["bytes_per_second"] or 0)
            leak = leader["leak"]
            # The card names the leaking pid before its rate (issue 21.10).
            label = f"pid {leader['pid']} " + leak_label(
                leak["bytes_per_step"], leak["bytes_per_second"], leak["seconds_to_full"]
            )
        else:
            focus = max(live, key=lambda d: d["reserved_bytes"])
            label = "collecting" if focus["leak"]["basis"] == "none" else "steady"
        second = re.escape(figures) + r"\s+\S*\s" + re.escape(label) + r"\s*│"
        cards.append((re.escape(first), second))
    return cards


def _clipped(shown: str, whole: str) -> bool:
    """`shown` is `whole`, or its start cut with an ellipsis (the pane's one row per line)."""
    shown = shown.strip()
    return shown == whole or (shown.endswith("…") and whole.startswith(shown[:-1].rstrip()))


def check_screen(app: ReplayApp, report: dict) -> None:
    text = screen_text(app.export_screenshot())
    where = f"at {app.player.offset:.2f} s:\n{text}"
    clock = _clock_text(app.player.offset)
    assert f"REPLAY {clock} /" in text, where
    assert report["replay"]["at_s"] == pytest.approx(app.player.offset, abs=0.002)
    lines = text.splitlines()
    for pid, pattern in expected_rows(report).items():
        row = [line for line in lines if re.match(rf"│\s+{pid}\s", line)]
        assert row and re.match(pattern, row[0]), f"pid {pid}: {row} ≠ /{pattern}/ {where}"
    for first, second in expected_cards(report):
        assert any(re.search(first, line) for line in lines), f"{first} {where}"
        assert any(re.search(second, line) for line in lines), f"{second} {where}"
    # The suggestions: the same ones, each with the report's wording (a pane row is cut at its
    # width with an ellipsis; info tips of one process are folded into one item).
    pane = app.suggestions
    reported = report["suggestions"]
    urgent = {(s["rule"], s["pid"]): s for s in reported if s["severity"] != "info"}
    shown = {(i.rule, i.pid): i for i in pane.items if i.rule not in ("tips", "")}
    shown = {k: v for k, v in shown.items() if v.severity != "info"}
    assert set(shown) == set(urgent), where
    for index, item in enumerate(pane.items):
        if (item.rule, item.pid) not in urgent:
            continue
        drawn = pane.get_option_at_index(index).prompt.plain.splitlines()  # type: ignore[union-attr]
        said = urgent[(item.rule, item.pid)]
        title = drawn[0].split(f"GPU {item.device}", 1)[-1]
        assert _clipped(title.split("  ")[1], said["title"]), f"{drawn[0]!r} ≠ {said['title']!r}"
        assert _clipped(drawn[1], said["evidence"]), f"{drawn[1]!r} ≠ {said['evidence']!r}"
    # Each visible suggestion row on screen is one of the pane's prompts, as drawn now.
    prompts = {
        line.strip()
        for i in range(pane.option_count)
        for line in pane.get_option_at_index(i).prompt.plain.splitlines()  # type: ignore[union-attr]
    }
    box = text.split("Suggestions", 1)[1].split("╰", 1)[0]
    for line in box.splitlines()[1:]:
        content = line.strip("│ ").rstrip("▁▂▃▄▅▆▇█ ")
        if content:
            assert any(p.startswith(content[:60]) for p in prompts), f"{content!r} {where}"


def check_detail(text: str, agent: dict) -> None:
    """The detail screen's figures of the process's (only) device, against the report's."""
    (dev,) = agent["devices"]
    pressure = dev["pressure"]
    expected = [
        f"pid {agent['pid']} ",
        f"step {agent['step']}",
        f"frag {dev['fragmentation_smoothed']:.2f} (now {dev['fragmentation']:.2f})",
        f"retries {pressure['num_alloc_retries']}, OOMs {pressure['num_ooms']}",
        (
            "trend "
            + leak_label(
                dev["leak"]["bytes_per_step"],
                dev["leak"]["bytes_per_second"],
                dev["leak"]["seconds_to_full"],
            )
            if dev["leak"].get("detected")
            else f"trend {dev['leak']['reason']}"
        ),
        f"alloc {short_bytes(dev['allocated_bytes'])} · rsvd {short_bytes(dev['reserved_bytes'])}",
    ]
    for figure in expected:
        assert figure in text, f"{figure!r} not on the detail screen:\n{text}"


def run_replay(path: Path, script) -> None:  # type: ignore[no-untyped-def]
    recording = load(path)
    store = Store()
    player = Player(store, recording)
    player.seek(recording.start)
    app = ReplayApp(store, player, recording, host="replay")

    async def go() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: app.dashboard is not None and app.dashboard.processes)
            await script(app, pilot, player)
            await pilot.press("q")

    try:
        asyncio.run(go())
    finally:
        player.stop()


@pytest.mark.parametrize("at", ["50", None])
def test_the_report_at_a_moment_parses_each_line_once(capsys, tmp_path, at, replay_parses):
    # `memtop replay FILE --once --at T` (each check above asks it): the first event was read
    # for "holds nothing to replay" (every file's reorder window: all of a small recording),
    # then again by the player, and the skipped lines counted by a third reading to the end.
    import gzip

    # The leak recording with a line it skips at its end, after the moment asked for.
    path = tmp_path / "leak.jsonl.gz"
    path.write_bytes(
        gzip.compress(gzip.decompress((TRACES / path.name).read_bytes()) + b'{"cmd": "sample"}\n')
    )
    parsed = replay_parses
    recording = load(path)
    lines = len(recording.events)  # one whole reading: a parse a line that can be an event
    once = parsed[0]
    assert once >= lines > 100 and recording.skipped_count == 1
    parsed[0] = 0
    assert main(["replay", str(path), "--once", "--json", *(["--at", at] if at else [])]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replay"]["skipped_lines"] == 1  # the whole recording's, read once
    # One reading, and the first line again for the check (its one file's hello).
    assert parsed[0] == once + 1, f"{parsed[0]} parses for {once} lines"


@pytest.mark.slow
def test_every_figure_after_seeks_speed_changes_pauses_and_at_the_end():
    path = TRACES  # all six trainers on one GPU

    async def script(app, pilot, player):  # type: ignore[no-untyped-def]
        await pilot.pause(0.5)
        await pilot.press("space")  # pause
        assert player.paused
        await pilot.pause(0.2)
        check_screen(app, report_at(path, player))
        for _ in range(9):  # seek while paused: 90 s later
            await pilot.press("right")
        await pilot.pause(0.2)
        check_screen(app, report_at(path, player))
        await pilot.press("right_square_bracket", "right_square_bracket")  # speed, paused
        await pilot.pause(0.2)
        check_screen(app, report_at(path, player))
        await pilot.press("shift+left")  # back 60 s
        await pilot.pause(0.2)
        check_screen(app, report_at(path, player))
        # Play at ×64 to the end: the last frame must be the recording's end, not a figure
        # held from a round seen on the way.
        await pilot.press(*["right_square_bracket"] * 5, "space")
        await wait_for(pilot, lambda: player.at_end, timeout=30)
        await wait_for(pilot, lambda: app._settled_at == player.cursor, timeout=5)
        await pilot.pause(0.3)
        check_screen(app, report_at(path, player))
        await pilot.press("left")  # a seek back from the end, while it stands still there
        await pilot.press("space")  # and paused right after
        await pilot.pause(0.3)
        check_screen(app, report_at(path, player))

    run_replay(path, script)


def test_the_leak_paused_at_01_45_shows_its_recorded_allocation():
    # The second case: space, → ×10, paused at 01:45.
    path = TRACES / "leak.jsonl.gz"

    async def script(app, pilot, player):  # type: ignore[no-untyped-def]
        await pilot.pause(1.2)
        await pilot.press("space")
        await pilot.press(*["right"] * 10)
        await pilot.pause(0.3)
        assert 100 <= player.offset < 110
        report = report_at(path, player)
        check_screen(app, report)
        # Still true a while later: paused means nothing changes, and nothing is held.
        await pilot.pause(1.5)
        check_screen(app, report)
        # The detail screen of the leaking trainer, at the same moment.
        await pilot.press("enter")
        await wait_for(pilot, lambda: "frag " in screen_text(app.export_screenshot()), 30)
        check_detail(screen_text(app.export_screenshot()), report["agents"][0])

    run_replay(path, script)


@pytest.mark.slow
def test_while_playing_a_suggestion_and_the_table_show_one_rounds_figures():
    # Issue 21, item 9: the same figure in two places on one screen read from two rounds (the
    # pane reworded every 8 s from rules judged every 2 s, the table every 4 s).  While the
    # replay plays, every cleanup suggestion on screen quotes the reserved and allocated bytes
    # its process's table row shows at that moment.
    path = TRACES

    def gib(text: str) -> str | None:
        """ "14.7 GiB" or "14.7G" as "14.7"; None for other units (printed to other precisions)."""
        match = re.fullmatch(r"~?([\d.]+) ?G(?:iB)?", text.strip())
        return match.group(1) if match else None

    async def script(app, pilot, player):  # type: ignore[no-untyped-def]
        player.seek_offset(40)
        await pilot.press("right_square_bracket", "right_square_bracket")  # ×4
        compared = 0
        for _ in range(12):
            await pilot.pause(0.6)
            text = screen_text(app.export_screenshot())
            rows = {
                int(m.group(1)): (m.group(3), m.group(2))  # pid: (reserved, allocated)
                for m in re.finditer(r"│\s+(\d+)\s+\S+\s+\d+\s+\S+\s+(\S+)\s+(\S+)\s", text)
            }
            lines = text.splitlines()
            for index, line in enumerate(lines):
                said = re.search(r"pid (\d+) · GPU \d+\s+pid \d+ caches", line)
                if not said or index + 1 >= len(lines):
                    continue
                quote = re.search(
                    r"reserved ([\d.]+ \w+), allocated ([\d.]+ \w+)", lines[index + 1]
                )
                pid = int(said.group(1))
                if quote is None or "no longer" in lines[index + 1] or pid not in rows:
                    continue
                for shown, quoted in zip(rows[pid], quote.groups(), strict=True):
                    if gib(shown) and gib(quoted):
                        assert gib(shown) == gib(quoted), f"pid {pid}: {shown} ≠ {quoted}\n{text}"
                        compared += 1
        assert compared >= 10

    run_replay(path, script)
