"""The unit constants and how sizes and durations are written for people (the JSON keeps
integer bytes and seconds).  Every module takes its KiB/MiB/GiB from here."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def format_bytes(n: int | float | None) -> str:
    """512 B, 8.0 KiB, 263.0 MiB, 30.2 GiB, 1.0 GiB for 1023.9 MiB; "n/a" for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        # A figure moves to the next unit once it reads 1.0 there (1023.9 MiB is "1.0 GiB",
        # not a four-digit "1023.9 MiB" beside "1.0 GiB" for a hair more).
        if abs(value) / 1024 < 0.95 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # pragma: no cover


def short_bytes(n: int | float | None) -> str:
    """Byte counts in at most 6 characters: 512B, 8.0K, 263M, 30.2G, 1.5T; "—" for None."""
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(value) < 1024 or unit == "T":
            if unit == "B":
                return f"{int(value)}B"
            return f"{value:.1f}{unit}" if abs(value) < 100 else f"{value:.0f}{unit}"
        value /= 1024
    return f"{value:.1f}T"  # pragma: no cover - the loop always returns


def format_duration(seconds: float | None) -> str:
    """12 s, 9 min, 3.5 h, 2.1 d."""
    if seconds is None:
        return "n/a"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def short_host(host: str, width: int = 8) -> str:
    """A host name in `width` cells (the process table's owner column, a GPU card's label),
    keeping its distinctive end: gpu-node-01 and gpu-node-02 must not both read "gpu-node"."""
    name = host.split(".")[0]
    return name if len(name) <= width else "…" + name[-(width - 1) :]
