"""The suite's modules by how long each takes, for the order `--dist loadfile` hands them out in
(tests/conftest.py, `pytest_xdist_make_scheduler`).

xdist's own order is by number of tests, most first: the modules of two long tests (the soak,
the replay screen, markup through every dialog: ~30 s each) were handed out last, and the
suite ended on one or two workers while the others had finished.  Longest first instead, by
the seconds of tests/module_seconds.json; a module not listed there weighs SECONDS_PER_TEST a
test (most modules of many short tests run at about that pace).

    MEMTOP_TEST_CPU_LOG=/tmp/cpu.jsonl python -m pytest -q -n 4 --dist loadfile
    python tests/helpers/module_seconds.py /tmp/cpu.jsonl

writes the table again from a run's log (README, "Where the suite's time goes").  Only the order
matters: a stale table costs some balance, never a test."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "module_seconds.json"
SECONDS_PER_TEST = 0.3


def load(table: Path = TABLE) -> dict[str, float]:
    """The table, or nothing when it is missing or unreadable (xdist's order stands then)."""
    try:
        data = json.loads(table.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float)}


def weight(module: str, tests: int, seconds: Mapping[str, float]) -> float:
    """How long `module` (a path as pytest names it, "tests/test_x.py") is expected to take."""
    return seconds.get(Path(module).name, tests * SECONDS_PER_TEST)


def from_log(lines: list[str]) -> dict[str, float]:
    """Each module's wall seconds, summed over its tests, from a MEMTOP_TEST_CPU_LOG file."""
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        entry = json.loads(line)
        seconds[Path(entry["test"].split("::")[0]).name] += entry["wall_s"]
    return {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    log = Path(sys.argv[1])
    TABLE.write_text(json.dumps(from_log(log.read_text().splitlines()), indent=0) + "\n")
    print(f"{TABLE}: {len(load())} modules")
