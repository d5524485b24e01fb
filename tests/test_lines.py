"""memtop.ui.widgets.lines: a line of Rich Text cut into Textual segments without Text.render."""

from __future__ import annotations

import random

from rich.cells import cell_len
from rich.console import Console
from rich.segment import Segment
from rich.style import Style
from rich.text import Span, Text
from textual.geometry import Region
from textual.strip import Strip
from ui_helpers import full_frame, play_into_terminal

from memtop.ui.widgets.lines import cells, changed_cells, moved_cells, text_strip

CONSOLE = Console()
BASE = Style(color="white", bgcolor="blue")
STYLES = ["bold", "red", "bold red", "dim", "cyan on black", "", "yellow", Style(italic=True)]


def by_cell(strip: Strip) -> list[tuple[str, Style | None]]:
    return [(char, segment.style) for segment in strip for char in segment.text]


def through_rich(text: Text, width: int) -> Strip:
    segments = Segment.apply_style(text.render(CONSOLE, end=""), style=BASE)
    return Strip(list(segments)).crop_extend(0, width, BASE)


def test_cells_counts_as_rich_does():
    pool = "abc …·▕█┃▏▁中文é\u0301😀\u200d🔥\ufe0f\t\x1b"
    rng = random.Random(7)
    for _ in range(20_000):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 30)))
        assert cells(text) == cell_len(text), text


def test_a_line_looks_as_rich_draws_it_cell_by_cell():
    rng = random.Random(1)
    for _ in range(3000):
        plain = "".join(rng.choice("ab …█中") for _ in range(rng.randint(0, 40)))
        spans = []
        for _ in range(rng.randint(1, 5)):  # Rich drops a text's own style when it has no span
            start = rng.randint(0, len(plain))
            spans.append(Span(start, rng.randint(start, len(plain) + 3), rng.choice(STYLES)))
        text = Text(plain, style=rng.choice(STYLES), spans=spans)
        width = rng.randint(1, 50)
        ours = text_strip(CONSOLE, text, width, BASE)
        assert ours.cell_length == width
        assert by_cell(ours) == by_cell(through_rich(text, width)), (text, width)


def test_a_text_without_spans_keeps_its_own_style():
    strip = text_strip(CONSOLE, Text("exited", style="dim"), 8, BASE)
    assert by_cell(strip)[0] == ("e", BASE + Style(dim=True))
    assert by_cell(strip)[-1] == (" ", BASE)  # the padding is the widget's


def test_a_gpu_card_repaints_only_when_what_it_prints_changes():
    """A figure that moved below the card's precision (a few MiB of 80 GiB) is no repaint."""
    import asyncio
    from dataclasses import replace

    from textual.app import App, ComposeResult
    from ui_helpers import a_gpu_row

    from memtop.ui.widgets import gpu_panel

    gib = 1 << 30
    row = a_gpu_row()

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield gpu_panel.GpuCard(row)

    async def run() -> None:
        app = One()
        terminal = play_into_terminal(app)
        async with app.run_test(size=(120, 4)) as pilot:
            card = app.query_one(gpu_panel.GpuCard)
            await pilot.pause()
            drawn = card._strips
            assert drawn is not None
            card.show(replace(row, used=40 * gib + 3 * (1 << 20)))  # "40.0 GiB" either way
            assert card._strips is drawn and card.row.used == 40 * gib + 3 * (1 << 20)
            card.show(replace(row, used=41 * gib))
            assert card._strips is None  # "41.0 GiB": repainted
            await pilot.pause()
            assert "41.0 GiB" in "".join(seg.text for seg in card._strips[0])
            # A figure that moved in place repaints its cells, not the card's lines.
            regions: list[Region] = []
            refresh = card.refresh
            card.refresh = lambda *r, **k: regions.extend(r) or refresh(*r, **k)  # type: ignore[method-assign]
            card._slow_tick = -1  # the gauge is a slow figure: its period is over
            card.show(replace(card.row, fragmentation=0.07))
            card.refresh = refresh  # type: ignore[method-assign]
            await pilot.pause()
            (region,) = regions
            assert region.width <= 2 and region.height == 1  # "0.05" → "0.07"
            assert terminal.cells == full_frame(app).cells

    asyncio.run(run())


def test_the_suggestions_pane_rewords_only_what_reads_differently(monkeypatch):
    """Every slow period a changed suggestion is worded again, and its prompt replaced only when
    the words differ (a figure below the printed precision, or prose not shown, is no repaint)."""
    import asyncio
    from dataclasses import replace

    from textual.app import App, ComposeResult

    from memtop.model import Severity
    from memtop.ui.view import SuggestionItem
    from memtop.ui.widgets import suggestions

    tick = {"now": 0}
    monkeypatch.setattr(suggestions, "slow_tick", lambda period=0: tick["now"])
    item = SuggestionItem(
        key="frag:1:0",
        severity=Severity.WARNING,
        pid=1,
        device=0,
        title="Fragmentation 0.24: use expandable segments",
        evidence="fragmentation 0.24",
        fix="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        effect="1.5 GiB stuck in splits",
        detail="why, in prose",
    )

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield suggestions.SuggestionsPane()

    async def run() -> None:
        app = One()
        async with app.run_test(size=(120, 10)) as pilot:
            pane = app.query_one(suggestions.SuggestionsPane)
            pane.show((item,), compact=False)
            await pilot.pause()
            replaced: list[int] = []
            original = pane._reword  # (the reworded prompts of a round, replaced together)
            pane._reword = lambda prompts: (
                replaced.extend(i for i, *_ in prompts) or original(prompts)
            )  # type: ignore[method-assign]
            tick["now"] = 1
            pane.show((replace(item, detail="other prose, not shown with a fix"),), False)
            assert replaced == [] and pane.items[0].detail.startswith("other")
            pane.show((replace(item, effect="1.7 GiB stuck in splits"),), False)
            assert replaced == []  # worded at most once a period
            tick["now"] = 2
            pane.show((replace(item, effect="1.7 GiB stuck in splits"),), False)
            assert replaced == [0]
            assert "1.7 GiB" in pane.get_option_at_index(0).prompt.plain

    asyncio.run(run())


def test_changed_cells_is_where_characters_moved_in_place_or_the_whole_line():
    row = Text(" 4101  12.0G  step  1299  train.py --mode…", spans=[Span(1, 5, "bold")])
    moved = Text(" 4101  12.0G  step  1300  train.py --mode…", spans=[Span(1, 5, "bold")])
    assert changed_cells(row, moved) == (21, 24)  # "299" → "300"; "…" takes one cell
    assert changed_cells(row, row.copy()) is None  # nothing moved: not a partial repaint
    restyled = Text(moved.plain, spans=[Span(1, 5, "red")])
    assert changed_cells(row, restyled) is None  # a style: the whole line
    assert changed_cells(row, Text(moved.plain, style="dim", spans=moved.spans)) is None
    assert changed_cells(row, Text(moved.plain[:-1], spans=moved.spans)) is None  # length
    wide = Text(" 4101  GPU 状态  1299"), Text(" 4101  GPU 状态  1300")
    assert changed_cells(*wide) is None  # characters are not cells here


def test_moved_cells_spans_every_character_that_differs_and_nothing_else():
    # (The process table compares its rows' characters with it each round: no Rich Text.)
    rng = random.Random(5)
    for _ in range(20_000):
        old = "".join(rng.choice("ab1…") for _ in range(rng.randint(0, 40)))
        new = "".join(rng.choice("ab1…") if rng.random() < 0.1 else char for char in old)
        moved = [i for i, (x, y) in enumerate(zip(old, new, strict=True)) if x != y]
        expected = (moved[0], moved[-1] + 1) if moved else None
        assert moved_cells(old, new) == expected, (old, new)
    assert moved_cells("ab", "abc") is None  # not in place
    assert moved_cells(" 状态 1299", " 状态 1300") is None  # characters are not cells here


def test_a_new_set_of_suggestions_with_as_many_lines_lays_nothing_out_again():
    """Suggestions come and go every few seconds in a busy run: a new set that fills as many
    lines is drawn in place, without a layout of the whole screen (the pane was cleared to zero
    lines and filled again: two changes of its virtual size, each a layout and a full frame)."""
    import asyncio
    from dataclasses import replace

    from textual.app import App, ComposeResult

    from memtop.model import Severity
    from memtop.ui.view import SuggestionItem
    from memtop.ui.widgets import suggestions

    first = SuggestionItem(
        key="frag:1:0",
        severity=Severity.WARNING,
        pid=1,
        device=0,
        title="Fragmentation 0.24: use expandable segments",
        evidence="fragmentation 0.24",
        fix="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        effect="1.5 GiB stuck in splits",
    )
    second = replace(first, key="frag:2:1", pid=2, device=1)

    from pathlib import Path

    from memtop.ui import app as dashboard

    class One(App[None]):
        # The dashboard's CSS: the pane's height is the room it has, not its content's.
        CSS_PATH = Path(dashboard.__file__).with_name("memtop.tcss")

        def compose(self) -> ComposeResult:
            yield suggestions.SuggestionsPane()

    async def run() -> None:
        app = One()
        async with app.run_test(size=(120, 12)) as pilot:
            pane = app.query_one(suggestions.SuggestionsPane)
            pane.show((first,), compact=False)
            await pilot.pause()
            layouts: list[str] = []
            refresh = pane.refresh

            def record(*regions, **kwargs):  # type: ignore[no-untyped-def]
                if kwargs.get("layout"):
                    layouts.append("layout")
                return refresh(*regions, **kwargs)

            pane.refresh = record  # type: ignore[method-assign]
            pane.show((second,), compact=False)  # another suggestion, as many lines
            await pilot.pause()
            assert pane.items == (second,) and pane.get_option_at_index(0).id == second.key
            assert "pid 2" in pane.get_option_at_index(0).prompt.plain
            assert layouts == []
            pane.show((first, second), compact=False)  # more lines: laid out again
            await pilot.pause()
            assert layouts and pane.option_count == 2

    asyncio.run(run())


def test_rewording_one_suggestion_renders_that_one_again_not_every_one():
    """A suggestion's figures moved: its prompt is replaced and only it is wrapped and styled
    again (Textual's OptionList dropped every option's rendering on each replacement)."""
    import asyncio
    from dataclasses import replace
    from pathlib import Path

    from textual.app import App, ComposeResult

    from memtop.model import Severity
    from memtop.ui import app as dashboard
    from memtop.ui.view import SuggestionItem
    from memtop.ui.widgets import suggestions

    items = tuple(
        SuggestionItem(
            key=f"frag:{pid}:0",
            severity=Severity.WARNING,
            pid=pid,
            device=0,
            title="Fragmentation 0.24: use expandable segments",
            evidence="fragmentation 0.24",
            fix="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
            effect="1.5 GiB stuck in splits",
        )
        for pid in (1, 2, 3)
    )

    class One(App[None]):
        CSS_PATH = Path(dashboard.__file__).with_name("memtop.tcss")

        def compose(self) -> ComposeResult:
            yield suggestions.SuggestionsPane()

    async def run() -> None:
        app = One()
        async with app.run_test(size=(120, 20)) as pilot:
            pane = app.query_one(suggestions.SuggestionsPane)
            pane.show(items, compact=False, renew=True)
            await pilot.pause()
            rendered: list[int] = []
            render = pane._get_option_render
            padding = pane.get_component_styles("option-list--option").padding

            def record(option, style):  # type: ignore[no-untyped-def]
                if (option, style, padding) not in pane._option_render_cache:
                    rendered.append(pane.options.index(option))  # wrapped and styled anew
                return render(option, style)

            pane._get_option_render = record  # type: ignore[method-assign]
            moved = (items[0], replace(items[1], effect="2.5 GiB stuck in splits"), items[2])
            pane.show(moved, compact=False, renew=True)
            await pilot.pause()
            assert rendered == [1]
            assert "2.5 GiB" in pane.get_option_at_index(1).prompt.plain
            assert "1.5 GiB" in pane.get_option_at_index(2).prompt.plain

    asyncio.run(run())


def test_a_cards_and_a_suggestions_new_figures_add_nothing_to_richs_cell_length_cache():
    """Rich's `cached_cell_len` (an LRU of 4,096 strings) keeps every string it is asked to
    measure.  A GPU card's line and a suggestion's hold figures that move every second, and
    each new one was measured there when the line was cut to its width (Text.truncate,
    Text.cell_len): the cache filled with them (~2 MB when full, issue 35 item 8).  memtop
    measures its own lines (lines.cells), and lays out the same lines."""
    from dataclasses import replace

    from rich.cells import cached_cell_len
    from ui_helpers import a_gpu_row

    from memtop.model import Severity
    from memtop.ui.view import SuggestionItem
    from memtop.ui.widgets.gpu_panel import GpuCard
    from memtop.ui.widgets.suggestions import suggestion_text

    gib = 1 << 30
    row = a_gpu_row()
    card = GpuCard(row)
    item = SuggestionItem(
        key="leak:1:0",
        severity=Severity.CRITICAL,
        pid=4101,
        device=0,
        title="Leak: +8.0 MiB per step (3.7 GiB/min), full in ~12 min (5805 steps)",
        evidence="allocated grew 221.6 GiB/hour over 488 samples",
        fix=None,
        effect="+221.6 GiB/hour",
        detail="tensors kept across steps",
    )

    def lay_out(round_: int) -> list[tuple[str, int]]:
        """This round's lines, each with the width it was laid out for."""
        grown = round_ * gib // 7
        card.row = replace(row, used=row.used + grown, allocated=row.allocated + grown)
        title = item.title.replace("5805", str(5805 - round_)).replace("+8.0", f"+{8 + round_}.0")
        steps = replace(item, title=title)
        return [
            (card._first_line(120, False).plain, 120),
            (card._second_line(120, False).plain, 120),
            (card._first_line(30, True).plain, 30),  # cut to the width
            (suggestion_text(steps, False, 100).plain, 100),
            (suggestion_text(steps, False, 40).plain, 40),  # cut to the width: an ellipsis
        ]

    lay_out(0)
    misses = cached_cell_len.cache_info().misses
    lines = [line for round_ in range(1, 21) for line in lay_out(round_)]
    assert cached_cell_len.cache_info().misses == misses  # no string measured there
    assert len(set(lines)) == len(lines)  # (each round's lines were new)
    assert all(cell_len(row) <= width for text, width in lines for row in text.split("\n"))
    assert any(cell_len(row) == width for text, width in lines for row in text.split("\n"))


def test_cut_cuts_as_text_truncate_does():
    """lines.cut: the characters, spans and style Text.truncate leaves, on lines of ASCII,
    memtop's one-cell symbols, wide and zero-width characters, cut or not."""
    from memtop.ui.widgets.lines import cut

    rng = random.Random(7)
    alphabet = "ab 1.%…—·▕▏█┃▁" + "界" + "\u0301" + "\x1b"
    for _ in range(3000):
        plain = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        spans = []
        for _ in range(rng.randrange(0, 4)):
            start = rng.randrange(0, len(plain) + 1)
            spans.append(Span(start, rng.randrange(start, len(plain) + 2), rng.choice(STYLES)))
        overflow = rng.choice([None, "fold", "crop", "ellipsis"])
        width = rng.randrange(0, 32)
        made = [Text(plain, style="bold", spans=spans, overflow=overflow) for _ in range(2)]
        made[0].truncate(width)
        ours = cut(made[1], width)
        assert ours is made[1]
        assert (ours.plain, ours.spans, ours.style) == (made[0].plain, made[0].spans, "bold")
