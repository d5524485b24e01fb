"""What an nvitop / htop user expects, driven through the pilot on frozen data: sort, filter,
GPU choice, torchrun ranks under their launcher, a user keymap and theme; and the issue-12
fixes a user sees (80×24 leak line, y on the selected row, exited rows, expiring events)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from test_ui_frozen import frozen_app
from ui_frozen import LAUNCHER, MY_UID, NOW, frozen_store
from ui_helpers import notifications, screen_text, wait_for

from memtop.sources.agents import EXITED, AgentView
from memtop.ui import app as app_module
from memtop.ui import config
from memtop.ui.app import MemtopApp
from memtop.ui.screens.detail import DetailScreen
from memtop.ui.screens.help import HelpScreen
from memtop.ui.widgets.process_table import Group, ProcessTable

SIZE = (120, 36)


def drive(app: MemtopApp, body, size: tuple[int, int] = SIZE) -> None:  # type: ignore[no-untyped-def]
    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: len(app.query("FooterKey")) > 0)
            await pilot.pause(0.1)
            await body(app, pilot)

    asyncio.run(run())


def pids(app: MemtopApp) -> list[int]:
    return [row.pid for row in app.query_one(ProcessTable).rows]


def table_lines(app: MemtopApp) -> list[str]:
    text = screen_text(app.export_screenshot())
    return [line for line in text.splitlines() if re.match(r"^│\s+\d{4}\s", line)]


def test_sort_by_keys_and_by_header_click() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        table = app.query_one(ProcessTable)
        assert pids(app) == [4101, 4102, 7001, 4201, 7002]  # by GPU, then pid
        for _ in range(4):  # pid, user, gpu, used
            await pilot.press("greater_than_sign")
        assert table.sort_key == "used"
        assert pids(app) == [4101, 4102, 4201, 7001, 7002]  # largest first
        assert "USED▼" in screen_text(app.export_screenshot())
        await pilot.press("I")  # inverted
        assert pids(app) == [7002, 7001, 4201, 4102, 4101]
        await pilot.pause()
        assert "USED▲" in screen_text(app.export_screenshot())  # the header says so too
        table.set_sort("gpu")  # a column too narrow for the arrow keeps its whole name
        await pilot.pause()
        assert " GPU " in screen_text(app.export_screenshot()) and "GP…" not in screen_text(
            app.export_screenshot()
        )
        table.set_sort("used", reverse=True)
        # A click on a header sorts by that column; a second click inverts it.
        _key, x0, _ = next(span for span in table._column_spans if span[0] == "pid")
        await pilot.click(ProcessTable, offset=(2 + x0 + 1, 1))
        assert table.sort_key == "pid" and pids(app) == [4101, 4102, 4201, 7001, 7002]
        await pilot.click(ProcessTable, offset=(2 + x0 + 1, 1))
        assert pids(app) == [7002, 7001, 4201, 4102, 4101]
        # The cursor stays on its process through a re-sort.
        table.move_cursor(table.get_row_index("4201:GPU-4e5f6a7b"))
        await pilot.press("less_than_sign")
        assert table.selected() is not None and table.selected().pid == 4201

    drive(frozen_app(), body)


@pytest.mark.slow
def test_filter_with_slash_keeps_and_escape_clears() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("slash")
        assert app.focused is app.filter_input
        for key in "leak":
            await pilot.press(key)
        await pilot.press("enter")
        assert pids(app) == [4102]
        assert isinstance(app.focused, ProcessTable)  # back on the table, filter kept
        lines = table_lines(app)
        assert len(lines) == 1 and "4102" in lines[0]
        assert "filter “leak” 1/5" in screen_text(app.export_screenshot())
        # The typed letters were the filter's: no cleanup ("c"), no kill ("k") ran.
        assert not any("Cleaning" in n for n in notifications(app))
        await pilot.press("slash")
        for key in "gpu1":
            await pilot.press(key)
        await pilot.pause(0.05)
        await pilot.press("enter")
        # Reopened, the old filter is selected and typing replaces it: "gpu1" is GPU 1's rows.
        assert pids(app) == [4201, 7002]
        await pilot.press("slash")
        await pilot.press("escape")
        assert pids(app) == [4101, 4102, 7001, 4201, 7002]

    drive(frozen_app(), body)


def test_the_slash_filter_filters_the_suggestions_too() -> None:
    # `/gpu1` filtered the table but the pane kept suggesting about GPU 0's trainers.
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        everything = app.suggestions.items
        assert {i.pid for i in everything} - {None, 4201, 7002}, "nothing about GPU 0 to hide"
        await pilot.press("slash")
        for key in "gpu1":
            await pilot.press(key)
        await pilot.pause(0.05)
        assert pids(app) == [4201, 7002]
        shown = app.suggestions.items
        assert shown and all(
            i.pid in (4201, 7002) if i.pid is not None else i.device in (None, 1) for i in shown
        ), [(i.pid, i.device, i.title) for i in shown]
        await pilot.press("escape")  # the filter cleared: every suggestion again
        assert app.suggestions.items == everything

    drive(frozen_app(), body)


def test_keys_typed_fast_after_slash_are_the_filters() -> None:
    # A terminal delivers "/leak" typed (or pasted) fast as five keys queued at once. The
    # filter line took focus only after them: "lea" went nowhere, and `k` opened the kill
    # dialog (`c`, `r`, `s` would have acted inside a trainer).
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        from textual import events

        default = app.screen
        for key, char in (("slash", "/"), ("l", "l"), ("e", "e"), ("a", "a"), ("k", "k")):
            app.post_message(events.Key(key, char))
        await pilot.pause(0.2)
        assert app.screen is default  # no dialog
        assert app.filter_input.value == "leak" and pids(app) == [4102]

    drive(frozen_app(), body)


def test_only_chosen_gpus_are_shown() -> None:
    app = MemtopApp(
        frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID, only={1}
    )

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        text = screen_text(app.export_screenshot())
        assert "only GPU 1" in text
        assert "GPU 1" in text and "GPU 0 " not in text
        assert pids(app) == [4201, 7002]
        assert app.dashboard is not None
        assert all(s.device in (None, 1) for s in app.dashboard.suggestions)
        assert "Leak" not in text  # the leak is on GPU 0

    drive(app, body)


def test_only_rejects_bad_gpu_lists() -> None:
    from memtop.cli import build_parser

    assert build_parser().parse_args(["--only", "0,2"]).only == frozenset({0, 2})
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--only", "zero"])
    assert exited.value.code == 2


def test_torchrun_ranks_grouped_under_their_launcher_with_the_spread() -> None:
    app = MemtopApp(
        frozen_store(ranked=True), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID
    )

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        table = app.query_one(ProcessTable)
        groups = [line for line in table.lines if isinstance(line, Group)]
        assert len(groups) == 1 and groups[0].launcher == LAUNCHER
        assert [r.pid for r in groups[0].rows] == [4101, 4201]  # rank order
        first = table.lines.index(groups[0])
        assert [getattr(x, "pid", None) for x in table.lines[first + 1 : first + 3]] == [
            4101,
            4201,
        ]
        text = screen_text(app.export_screenshot())
        assert f"launcher pid {LAUNCHER}" in text and "2 of 2 ranks" in text
        # 12.0 GiB allocated on rank 0 against 2.0 GiB on rank 1 (the frozen readings)
        assert "alloc spread 10.0G (r0 − r1)" in text
        assert "r0 train.py" in text and "r1 train.py" in text
        # The cursor skips the group header.
        table.move_cursor(0)
        await pilot.press("down")
        assert table.selected() is not None and table.selected().pid == 4201
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
        assert "rank 1/2" in screen_text(app.export_screenshot())

    drive(app, body)


def test_keymap_from_config_rebinds_and_the_help_follows(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[keys]\nhelp = "h"\ncopy_fix = "Y"\nnot_a_binding = "x"\n')
    cfg = config.load(path)
    assert cfg.keys == {"help": "h", "copy_fix": "Y", "not_a_binding": "x"}
    app = MemtopApp(
        frozen_store(), None, clock=lambda: NOW, host="gpu-box", my_uid=MY_UID, config=cfg
    )

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert any("no binding with id not_a_binding" in n for n in notifications(app))
        await pilot.press("question_mark")  # no longer bound
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("h")
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app.export_screenshot())
        help_line = next(line for line in text.splitlines() if "copy a fix" in line)
        assert re.search(r"\bY\b", help_line) and "copy_fix" in help_line
        await pilot.press("escape")
        await pilot.press("Y")  # copies the selected process's fix (4101: the 8-bit optimizer)
        assert app.clipboard.startswith("optimizer = bitsandbytes")

    drive(app, body)


def test_bad_config_is_one_line_and_memtop_runs(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("theme = [1\n")
    cfg = config.load(path)
    assert len(cfg.problems) == 1 and "not valid TOML" in cfg.problems[0]
    assert config.load(tmp_path / "missing.toml").problems == ()


def _colours(svg: str) -> set[str]:
    # Rich's SVG export: one CSS class per style, `fill: #rrggbb`; the window's three
    # decoration dots and the export theme's default foreground are not the app's.
    found = set(re.findall(r"fill:\s*(#[0-9a-fA-F]{6})", svg))
    return found - {"#ff5f57", "#febc2e", "#28c840", "#c5c8c6"}


def _grey(colour: str) -> bool:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return max(r, g, b) - min(r, g, b) <= 2


@pytest.mark.parametrize("theme", ["memtop", "monochrome", "textual-light"])
def test_theme_from_config(tmp_path: Path, theme: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'theme = "{theme}"\n')
    app = MemtopApp(
        frozen_store(),
        None,
        clock=lambda: NOW,
        host="gpu-box",
        my_uid=MY_UID,
        config=config.load(path),
    )

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        colours = _colours(app.export_screenshot())
        if theme == "monochrome":
            assert colours and all(_grey(c) for c in colours), [c for c in colours if not _grey(c)]
        else:
            assert any(not _grey(c) for c in colours)
        if theme == "textual-light":
            assert app.theme == "textual-light"

    drive(app, body)


def test_unknown_theme_warns_and_falls_back(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('theme = "sepia-noir"\n')
    app = MemtopApp(
        frozen_store(), None, clock=lambda: NOW, my_uid=MY_UID, config=config.load(path)
    )

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert any("no theme 'sepia-noir'" in n for n in notifications(app))
        assert app.theme == "textual-dark"

    drive(app, body)


def test_80x24_shows_the_leaking_pid_and_rate_and_its_culprits() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        first = screen_text(app.export_screenshot())
        leak = next(line for line in first.splitlines() if "Leak:" in line)
        assert "pid 4102" in leak and "+8.0 MiB per step" in leak
        assert "Usual culprits" in first  # what to do, on the main screen
        # Stable: the same lines on the next refreshes (nothing re-wraps).
        for _ in range(3):
            app._generation = -1
            app.refresh_view()
            await pilot.pause(0.1)
        again = screen_text(app.export_screenshot())
        assert [x for x in again.splitlines() if "pid 4102" in x] == [
            x for x in first.splitlines() if "pid 4102" in x
        ]

    drive(frozen_app(), body, size=(80, 24))


def test_y_copies_the_selected_rows_fix_never_anothers() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        table = app.query_one(ProcessTable)
        table.move_cursor(table.get_row_index("4201:GPU-4e5f6a7b"))
        await pilot.press("y")
        assert app.clipboard == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        table.move_cursor(table.get_row_index("7001:GPU-0a1b2c3d"))
        await pilot.press("y")
        assert "No suggestion for pid 7001 has a fix" in " ".join(notifications(app))
        assert app.clipboard == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"

    drive(frozen_app(), body)


def test_exited_row_is_dim_marked_last_known_and_keeps_its_user() -> None:
    store = frozen_store()
    app = frozen_app(store)

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        # The process goes: its agent reports exited and /proc no longer has it.
        trainer_hello = store.agent(4102).hello  # type: ignore[union-attr]
        store.update_agents([AgentView(4102, EXITED, trainer_hello, error="gone")], NOW + 1)
        store.update_processes({p: i for p, i in store.processes().items() if p != 4102})
        await wait_for(
            pilot,
            lambda: (
                pids(app)
                and app.dashboard
                and any(r.pid == 4102 and r.state == "exited" for r in app.dashboard.processes)
            ),
        )
        await pilot.pause(0.2)
        line = next(x for x in table_lines(app) if "4102" in x)
        assert "ada" in line and "?" not in line.split("4102")[1][:12]
        assert "~10.7G" in line and "exited" in line

    drive(app, body)


def test_attached_event_leaves_the_status_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # Shown from the first refresh for this long: 0.5 s had passed before the first screenshot
    # under two suites at once.
    monkeypatch.setattr(app_module, "EVENT_SHOW_S", 3.0)

    def status_line(app: MemtopApp) -> str:
        return screen_text(app.export_screenshot()).splitlines()[-2]

    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        assert "attached" in status_line(app)
        # Gone at the first refresh (every second) after the 3 s.
        await wait_for(pilot, lambda: "attached" not in status_line(app), timeout=10)

    drive(frozen_app(), body)


def test_htop_navigation_keys_f1_help_and_f10_quit() -> None:
    async def body(app: MemtopApp, pilot) -> None:  # type: ignore[no-untyped-def]
        table = app.query_one(ProcessTable)
        await pilot.press("G")
        assert table.cursor_row == len(table.rows) - 1
        await pilot.press("g")
        assert table.cursor_row == 0
        await pilot.press("pagedown")
        assert table.cursor_row == len(table.rows) - 1  # a page is longer than 5 rows
        await pilot.press("home")
        assert table.cursor_row == 0
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("f10")
        await pilot.pause(0.2)
        assert not app.is_running

    drive(frozen_app(), body)


def test_tips_roll_up_keeps_savings_apart_from_headroom_and_leak_growth_is_red() -> None:
    from memtop.diagnosis.suggestions import Suggestion
    from memtop.model import Severity
    from memtop.ui.view import suggestion_items
    from memtop.ui.widgets.suggestions import suggestion_text

    gib = 1 << 30
    tips = [
        Suggestion("8bit_optimizer", Severity.INFO, 7, 0, "t", "d", "e", "fix", 6 * gib),
        Suggestion("bf16_parameters", Severity.INFO, 7, 0, "t", "d", "e", "fix", 2 * gib),
        Suggestion("bigger_batch", Severity.INFO, 7, 0, "t", "d", "e", None, 50 * gib),
        Suggestion("leak", Severity.CRITICAL, 8, 0, "Leak", "culprits", "e", None, 250 * gib),
    ]
    items = {i.pid: i for i in suggestion_items(tips, True)}
    rolled = items[7]
    assert rolled.effect == "saves up to 8.0 GiB" and rolled.room == "50.0 GiB unused"
    text = suggestion_text(rolled, compact=False, width=200)
    assert "saves up to 8.0 GiB · 50.0 GiB unused" in text.plain
    leak = suggestion_text(items[8], compact=False, width=200)
    growth = [s for s in leak.spans if leak.plain[s.start : s.end].strip().startswith("+250")]
    assert growth and "red" in str(growth[0].style)
    assert "→ culprits" in leak.plain  # an urgent item without a fix shows what to do


def test_once_text_draws_the_leak_advice() -> None:
    """`memtop --once` text renders the same observation: the leak's culprits are there."""
    from memtop.engine.observation import observe
    from memtop.present import report

    text = report.render_text(report.build(observe(frozen_store(), clock=lambda: NOW)))
    leak = text.split("Leak:", 1)[1]
    assert "what to do: Usual culprits" in leak.split("\n[", 1)[0]
