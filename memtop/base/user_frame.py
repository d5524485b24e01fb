"""Sites: the user's line of code behind memory (DESIGN §12), as the viewer reads and names them.

An agent sends a site as {"file", "line", "function", "text"} (an OOM report's `stack` entries,
the `sites` command's `site`).  They are an agent's strings, so untrusted: every one was made
inert where it entered the viewer (protocol.clean_value on each reply, oom.reports on each
report file); here they are only bounded in length.  Pure: the diagnosis and the renderers use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_SITE_TEXT = 120  # characters of a source line shown
MAX_FILE_TEXT = 80


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def site_name(site: Any) -> str | None:
    """`model.py:88 attn = q @ k.transpose(-2, -1)`: the file's base name, the line and its
    text, as a suggestion or `memtop oom` names it; None for anything that is not a site."""
    if not isinstance(site, Mapping):
        return None
    file = site.get("file")
    line = site.get("line")
    if not isinstance(file, str) or not file or type(line) is not int:
        return None
    base = _cut(file.replace("\\", "/").rsplit("/", 1)[-1], MAX_FILE_TEXT)
    text = site.get("text")
    text = _cut(text, MAX_SITE_TEXT).strip() if isinstance(text, str) else ""
    return f"{base}:{line} {text}".rstrip()


def stack_phrase(stack: Any, function: bool = False) -> str | None:
    """ "in `model.py:88 attn = …`" (and "in forward()" with `function`): the innermost frame
    of an OOM report's `stack`; None when it has none (an old agent, autograd's thread)."""
    if not isinstance(stack, list) or not stack:
        return None
    name = site_name(stack[0])
    if name is None:
        return None
    called = stack[0].get("function")
    where = ""
    if function and isinstance(called, str) and called:
        where = f" in {_cut(called, 60)}()"
    return f"in `{name}`{where}"
