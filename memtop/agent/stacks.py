"""The user's line behind an allocation: a bounded walk of the calling thread's Python frames.

A *site* is the innermost frame of the user's own code - not torch, not site-packages, not the
standard library, not memtop - because that is the line an engineer can change.  Two callers:
- the OOM observer, on the allocating thread, takes the failing request's stack (`capture`):
  always on, so it must be cheap (a frame walk capped at MAX_DEPTH frames, one cached
  classification per file, linecache for the text);
- the simulated allocator, when its history is on, keeps each block's frames in torch's snapshot
  format (`frames`), like torch does with `_record_memory_history(stacks="python")`.

Nothing here imports torch or raises: a frame that cannot be read is skipped.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

MAX_DEPTH = 96  # frames walked from the allocation outwards, at most
USER_FRAMES = 4  # the innermost user frame and a few of its callers, for context
MAX_TEXT = 160  # characters of a source line kept
_CACHE_LIMIT = 4096

_MEMTOP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The simulator's workloads play the user's training script: their lines are the sites the demo
# shows (the `leak` scenario's leak is one of them), though they live inside memtop.
_SIMULATED_USER_CODE = frozenset({os.path.join(_MEMTOP_DIR, "sim", "scenarios.py")})


def _library_prefixes() -> tuple[str, ...]:
    import sysconfig  # here, not at import: the agent starts in every `memtop run` program

    prefixes = {_MEMTOP_DIR}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = paths.get(key)
        if path:
            prefixes.add(os.path.abspath(path) + os.sep)
    for base in {sys.base_prefix, sys.prefix, sys.exec_prefix}:
        # The interpreter's own lib/pythonX.Y (a venv's stdlib is the base's).
        prefixes.add(
            os.path.join(base, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}") + os.sep
        )
    return tuple(sorted(prefixes))


_library: tuple[str, ...] | None = None  # the prefixes, computed at the first site asked
_LIBRARY_PARTS = (
    f"{os.sep}site-packages{os.sep}",
    f"{os.sep}dist-packages{os.sep}",
    f"{os.sep}torch{os.sep}",  # a torch built from source, outside site-packages
)
_user_file: dict[str, bool] = {}
# Functions of user code that only pass an allocation on (the simulator's `Workload._m`, which
# plays torch's op): their frames are skipped, so that the site is the line that called them.
_plumbing: set[object] = set()


def plumbing(function: Any) -> Any:
    """Decorator: `function`'s frames are never a site (it stands for a library call)."""
    _plumbing.add(function.__code__)
    return function


def is_user_file(filename: str) -> bool:
    """True for the user's own code: what a site may name."""
    known = _user_file.get(filename)
    if known is not None:
        return known
    if filename in _SIMULATED_USER_CODE:
        answer = True
    elif not filename or filename.startswith("<"):
        answer = False  # <frozen importlib._bootstrap>, <string>: no line to show
    else:
        global _library
        if _library is None:
            _library = _library_prefixes()
        answer = not filename.startswith(_library) and not any(
            part in filename for part in _LIBRARY_PARTS
        )
    if len(_user_file) >= _CACHE_LIMIT:
        _user_file.clear()
    _user_file[filename] = answer
    return answer


def user_frames(
    frame: FrameType | None, keep: int = USER_FRAMES, max_depth: int = MAX_DEPTH
) -> list[dict[str, Any]]:
    """The innermost `keep` user frames from `frame` outwards, in torch's snapshot format
    ({"filename", "line", "name"}, innermost first); at most `max_depth` frames are walked."""
    found: list[dict[str, Any]] = []
    depth = 0
    while frame is not None and depth < max_depth and len(found) < keep:
        code = frame.f_code
        if code not in _plumbing and is_user_file(code.co_filename):
            found.append(
                {"filename": code.co_filename, "line": frame.f_lineno or 0, "name": code.co_name}
            )
        frame = frame.f_back
        depth += 1
    return found


def source_text(filename: str, line: int) -> str:
    """The source line, stripped and cut at MAX_TEXT characters ("" when unreadable)."""
    import linecache  # imported by the first OOM or grouping round, not at the agent's start

    try:
        text = linecache.getline(filename, int(line)).strip()
    except Exception:
        return ""
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def with_text(frame: dict[str, Any]) -> dict[str, Any]:
    """A torch-format frame as a report's: {"file", "line", "function", "text"}."""
    filename = str(frame.get("filename", ""))
    line = int(frame.get("line") or 0)
    return {
        "file": filename,
        "line": line,
        "function": str(frame.get("name", "")),
        "text": source_text(filename, line),
    }


def capture(skip: int = 1) -> list[dict[str, Any]]:
    """The calling thread's user stack, innermost first, with each line's text; [] when no
    user code is on it (autograd's device thread in a backward).  Never raises."""
    try:
        frame: FrameType | None = sys._getframe(skip + 1)
    except (ValueError, AttributeError):
        return []
    try:
        return [with_text(f) for f in user_frames(frame)]
    except Exception:
        return []
    finally:
        del frame
