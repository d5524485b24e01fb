"""Themes: memtop's own (Textual's dark theme), any Textual theme by name, and `monochrome`
(no colour at all: every cell in greys, for terminals and eyes that need it; the bars keep
their meaning through glyphs and brightness)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from rich.segment import Segment
from rich.style import Style
from textual.app import App
from textual.color import Color
from textual.filter import LineFilter

# A coloured foreground turned grey by luminance alone goes dark (red text on a dark background
# was unreadable): coloured text is drawn light and bold instead, greys keep their brightness.
COLOURED_TEXT = Color(235, 235, 235)

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


def _is_graphic(text: str) -> bool:
    """Bars and sparklines (block elements): their shades of grey carry the meaning."""
    return bool(text) and all("\u2580" <= ch <= "\u259f" for ch in text.strip() or "x")


@lru_cache(1024)
def _grey_style(style: Style, graphic: bool = False) -> Style:
    color = style.color
    fg = None
    bold = None
    if color is not None:
        rgb = Color.from_rich_color(color)
        coloured = max(rgb.r, rgb.g, rgb.b) - min(rgb.r, rgb.g, rgb.b) > 24
        if coloured and not graphic:  # coloured text: light and bold
            fg, bold = COLOURED_TEXT.rich_color, True
        else:
            fg = rgb.monochrome.rich_color
    bg = style.bgcolor
    back = None if bg is None else Color.from_rich_color(bg).monochrome.rich_color
    return style + Style(color=fg, bgcolor=back, bold=bold)


class Monochrome(LineFilter):
    """Every cell in greys; coloured text light and bold so that it stays readable."""

    def apply(self, segments: list[Segment], background: Color) -> list[Segment]:
        out = []
        for text, style, _ in segments:
            if not style:
                out.append(Segment(text, style))
                continue
            graphic = _is_graphic(text)
            if graphic and style.color is not None and set(text) == {"█"}:
                text = _SHADES[_hue_class(style.color)] * len(text)
            out.append(Segment(text, _grey_style(style, graphic)))
        return out


# The memory bar's parts differ by colour; without colour they differ by shade of glyph:
# allocated (green) solid, cached (yellow) dark shade, outside PyTorch (magenta) light shade.
_SHADES = {"green": "█", "yellow": "▓", "magenta": "▒", "other": "█"}


@lru_cache(256)
def _hue_class(color: Any) -> str:
    import colorsys

    rgb = Color.from_rich_color(color)
    hue, _, saturation = colorsys.rgb_to_hls(rgb.r / 255, rgb.g / 255, rgb.b / 255)
    if saturation < 0.2:
        return "other"
    degrees = hue * 360
    if 70 <= degrees < 170:
        return "green"
    if 20 <= degrees < 70:
        return "yellow"
    if degrees >= 270 or degrees < 20:
        return "magenta"
    return "other"
