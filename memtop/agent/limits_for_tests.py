"""Limits a test may lower in a trainer it starts, so that it need not sleep through them.

A test that checks what follows a snapshot, or that sends thousands of frames on fresh
connections, would otherwise wait out the agent's cooldowns (5 s and more) or be refused by its
connection governor and send again (a fuzz run took 108 s).  It starts the trainer with

    MEMTOP_AGENT_TEST_LIMITS="snapshot_min_interval_s=0,connect_exempt_burst=1e9"

and the agent runs with those limits instead of the defaults in `memtop.agent.server`.

For tests only; nothing else sets it.  Read once, when the agent starts, from the trainer's own
environment (only the trainer's owner sets that).  Bounded and never raised into the trainer: a
name it does not know, or a value that is not a finite number >= 0 (> 0 for a share), is
ignored; unset, every
limit is its default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

ENV = "MEMTOP_AGENT_TEST_LIMITS"
# The limits a test may set, by their names in lower case (the constants of memtop.agent.server
# and memtop.agent.sites).
NAMES = frozenset(
    {
        "snapshot_min_interval_s",  # a snapshot file may be written again after this long
        "cleanup_min_interval_s",  # ... a cleanup run again
        "on_demand_max_share",  # the share of the trainer's time a snapshot or cleanup may cost
        "connect_exempt_burst",  # connections a uid may open at once and never be refused
        "sites_min_interval_s",  # sites grouping rounds at most this often (memtop.agent.sites)
        "sites_history_every_s",  # ... and one kept in the history at most this often
    }
)
MAX_CHARS = 512


def read(environ: Mapping[str, str]) -> dict[str, float]:
    """The limits `environ` sets for tests, by name; {} when it sets none."""
    text = environ.get(ENV, "")[:MAX_CHARS]
    limits: dict[str, float] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            number = float(value)
        except ValueError:
            continue
        if name in NAMES and math.isfinite(number) and number >= 0:
            limits[name] = number
    if limits.get("on_demand_max_share") == 0:  # a share of nothing: it divides
        del limits["on_demand_max_share"]
    return limits
