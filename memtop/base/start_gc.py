"""Python's cyclic garbage collector held off while the dashboard starts (issue 35: the full
frame ≤ 0.4 s after Enter).

Importing Textual and memtop makes some hundred thousand objects (classes, functions, their
dicts) that all live for the whole run; each 700 allocations the collector woke up and walked
the young ones, ~100 collections before the first frame: 15-25 % of the start's CPU, to free
under a thousand objects.  So `python -m memtop` and the `memtop` command (both through
memtop/__main__.py, the console script's entry point) hold the collector from their first line,
and `memtop.cli.main` for its other callers; the dashboard gives it back once its first frame is
out (memtop.ui.app, which then freezes what start-up left), and every other command as soon as
its arguments are parsed.  Only a collector turned off here is turned back on: a caller that
had it off (a test, an embedding program) keeps it off.
"""

from __future__ import annotations

import gc

_held = False  # the collector was on, and is off because of `hold`


def hold() -> None:
    """Turn the collector off for the start, if it is on."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release(freeze: bool = False) -> None:
    """Turn the collector back on, if `hold` turned it off; idempotent.

    `freeze`: what the start made is first moved out of the collector's sight (gc.freeze), for
    a process whose start-up objects live as long as it does (the dashboard).  Held, the
    collector left them all in its youngest generation, and the first collections after the
    release walked every one of them, young, middle, then old: some 200 000 objects three
    times over in the dashboard's first second, to free a few thousand."""
    global _held
    if _held:
        _held = False
        if freeze:
            gc.freeze()
        gc.enable()


def held() -> bool:
    return _held
