"""The user's dashboard settings: `~/.config/memtop/config.toml` (platformdirs' user config).

    theme = "monochrome"          # or "memtop" (the default), or any Textual theme name
    readonly = true               # as --readonly: no key acts on a process
    [keys]                        # binding id = keys, comma-separated (see the help screen)
    cleanup = "C"
    quit = "q,ctrl+q"

A file that cannot be read or holds a bad value gives a one-line warning on the dashboard;
everything it got right still applies and memtop keeps running.  MEMTOP_CONFIG may point
anywhere: only a regular file of at most MAX_CONFIG_BYTES, nested at most MAX_DEPTH levels, is
read (`/dev/zero` read until MemoryError, a FIFO hung the dashboard on a blank screen, deep
nesting was a RecursionError); anything else is one warning and the defaults.
"""

from __future__ import annotations

import os
from dataclasses import field
from pathlib import Path

from platformdirs import user_config_dir

from memtop.base.records import record
from memtop.base.untrusted import UntrustedInput, loads_toml, read_regular

MAX_CONFIG_BYTES = 64 << 10  # a theme and a few dozen keys: far less
THEMES = ("memtop", "monochrome")  # ours; Textual's own names are accepted too


def config_path() -> Path:
    override = os.environ.get("MEMTOP_CONFIG")
    if override:
        return Path(override)
    return Path(user_config_dir("memtop", appauthor=False)) / "config.toml"


@record(frozen=True)
class UiConfig:
    """The dashboard's settings from config.toml: theme, read-only, key bindings, and what was
    wrong in it."""

    theme: str = "memtop"
    readonly: bool = False
    keys: dict[str, str] = field(default_factory=dict)  # binding id → "key,key"
    problems: tuple[str, ...] = ()  # one line each, shown as warnings
    path: Path | None = None


def load(path: Path | None = None) -> UiConfig:
    path = path if path is not None else config_path()
    try:
        data = loads_toml(read_regular(path, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        return UiConfig(path=path)
    except OSError as exc:
        return UiConfig(problems=(f"{path}: cannot read ({exc.__class__.__name__})",), path=path)
    except UntrustedInput as exc:
        return UiConfig(problems=(f"{path} {exc}: the defaults apply",), path=path)
    problems: list[str] = []
    theme = data.get("theme", "memtop")
    if not isinstance(theme, str) or not theme:
        problems.append(f'{path}: theme must be a name, e.g. "monochrome"')
        theme = "memtop"
    readonly = data.get("readonly", False)
    if not isinstance(readonly, bool):
        problems.append(f"{path}: readonly must be true or false")
        readonly = False
    keys: dict[str, str] = {}
    raw_keys = data.get("keys", {})
    if not isinstance(raw_keys, dict):
        problems.append(f'{path}: [keys] must be a table of binding id = "key,key"')
        raw_keys = {}
    for binding_id, value in raw_keys.items():
        if isinstance(value, str) and value.strip():
            keys[str(binding_id)] = value.replace(" ", "")
        elif isinstance(value, str):
            problems.append(f'{path}: keys.{binding_id} is empty; give a key such as "C"')
        else:
            problems.append(f'{path}: keys.{binding_id} must be a string such as "C"')
    unknown = sorted(set(data) - {"theme", "keys", "readonly"})
    if unknown:
        problems.append(f"{path}: unknown setting {', '.join(unknown)} (ignored)")
    return UiConfig(theme=theme, readonly=readonly, keys=keys, problems=tuple(problems), path=path)
