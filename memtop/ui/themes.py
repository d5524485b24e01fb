"""Themes: memtop's own (Textual's dark theme), any Textual theme by name, and `monochrome`
(no colour at all: every cell in greys, for terminals and eyes that need it; the bars keep
their meaning through glyphs and brightness)."""

from __future__ import annotations

from typing import Any

from textual.app import App
from textual.filter import Monochrome

DEFAULT = "textual-dark"


def apply_theme(app: App[Any], name: str) -> str | None:
    """Switch `app` to theme `name`; returns a one-line reason if the name is unknown."""
    if name in ("memtop", "", None):
        app.theme = DEFAULT
        return None
    if name == "monochrome":
        app.theme = DEFAULT
        if not any(isinstance(f, Monochrome) for f in app._filters):
            app._filters.append(Monochrome())
        return None
    if name in app.available_themes:
        app.theme = name
        return None
    app.theme = DEFAULT
    known = ", ".join(["memtop", "monochrome", *sorted(app.available_themes)][:8])
    return f"config: no theme {name!r} (try {known}, …)"
