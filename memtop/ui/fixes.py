"""A suggestion's fix: how the dashboard shows it and what `y` copies (issue 36, items 6, 13).

One home, so that what is copied is what was shown, in full, and is a command:
- a command or setting is shown after `$`; advice in words after `→` (an OOM report's "cap
  the batch at about 80 % of the one that failed" is not a command), and is never copied;
- the pane shows a fix whole, wrapped over as many rows as it needs (a command memtop copies
  is at most COPY_LIMIT characters), where it used to be cut at the pane's edge;
- a fix holding a run of blanks, a tab or newline, or a control or format character is not
  copied, and is shown with each of them in sight (`⟨200 blanks⟩`, `\x1b`):
  `…expandable_segments:True` + 200 spaces + `; curl … | sh #` was drawn as `…True…` and the
  whole line went to the clipboard;
- an agent's fix (a trainer wrote the OOM report it comes from) says so wherever it is shown,
  and when it is copied.
"""

from __future__ import annotations

import math
import re
import unicodedata

from rich.cells import chop_cells
from rich.text import Text

from memtop.ui.render import FREE
from memtop.ui.view import SuggestionItem

COPY_LIMIT = 200  # characters: memtop's own fixes are under 80
BY_AGENT = "(the agent's words, from its OOM report)"
_BLANKS = re.compile(r"\s{2,}|[^\S ]")  # two blanks or more, or any blank but a space
_COMMAND = "bold cyan"


def not_copied(item: SuggestionItem) -> str | None:
    """Why `y` does not copy `item`'s fix, in one line; None when it copies it."""
    fix = item.fix
    if not fix:
        return f"“{item.title}” has no one-line fix."
    if item.fix_is_prose:
        return f"“{item.title}”: what to do is advice in words, not a command: nothing copied."
    if len(fix) > COPY_LIMIT:
        return f"The fix is {len(fix)} characters long (over {COPY_LIMIT}): not copied."
    blanks = _BLANKS.search(fix)
    if blanks is not None:
        what = "a run of blanks" if len(blanks.group()) > 1 else "a blank that is not a space"
        return f"The fix holds {what} (what is pasted would differ from what is read): not copied."
    control = next((c for c in fix if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    if control is not None:
        return f"The fix holds a control character (U+{ord(control):04X}): not copied."
    return None


def copied(item: SuggestionItem) -> str:
    """What the notification says once `item`'s fix is on the clipboard: the fix, whole."""
    if item.fix_by_agent:
        return f"Copied the agent's fix (its words, not memtop's): {item.fix}"
    return f"Copied: {item.fix}"


def shown(fix: str) -> str:
    """`fix` as it is drawn: a run of blanks (or a blank that is not a space) as `⟨N blanks⟩`,
    a control or format character as its escape: nothing in it hides the rest."""

    def blanks(match: re.Match[str]) -> str:
        return f"⟨{len(match.group())} blank{'s' if len(match.group()) != 1 else ''}⟩"

    def visible(c: str) -> str:
        if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp"):
            return c.encode("unicode_escape").decode("ascii")
        return c

    return _BLANKS.sub(blanks, "".join(visible(c) for c in fix))


def fix_text(item: SuggestionItem) -> Text:
    """`$ command` or `→ advice`, then whose words they are when an agent's: unwrapped, for a
    place that wraps (the detail screen)."""
    text = Text()
    if item.fix:
        text.append(*_mark(item))
        text.append(shown(item.fix), style=_COMMAND if not item.fix_is_prose else "bold")
        if item.fix_by_agent:
            text.append(f"  {BY_AGENT}", style=FREE)
    return text


def fix_lines(item: SuggestionItem, indent: str, width: int | None) -> list[Text]:
    """The fix as the pane shows it: `indent`, the mark (`$ ` or `→ `), the fix wrapped to
    `width` cells (every row of it: at least as many as a COPY_LIMIT fix needs, which is what
    `y` may copy), and whose words they are."""
    if not item.fix:
        return []
    mark, mark_style = _mark(item)
    room = None if width is None else max(10, width - len(indent) - len(mark))
    words = shown(item.fix)
    chunks = [words] if room is None else chop_cells(words, room)
    if room is not None:
        most = math.ceil(COPY_LIMIT / room)
        if len(chunks) > most:  # longer than anything copied: cut, and said so
            chunks = [*chunks[: most - 1], chunks[most - 1][: max(0, room - 1)] + "…"]
    style = _COMMAND if not item.fix_is_prose else "bold"
    lines = [
        Text.assemble(indent, (mark if i == 0 else " " * len(mark), mark_style), (chunk, style))
        for i, chunk in enumerate(chunks)
    ]
    if item.fix_by_agent:
        lines.append(Text.assemble(indent, " " * len(mark), (BY_AGENT, FREE)))
    return lines


def _mark(item: SuggestionItem) -> tuple[str, str]:
    return ("→ ", FREE) if item.fix_is_prose else ("$ ", FREE)
