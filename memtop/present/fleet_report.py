"""`memtop --prometheus URL --once [--json]`: one report per host, as `memtop --once` on it.

The JSON object extends the local one (DESIGN §7): `hosts` holds each host's report in the local
shape (its `host` field names it), and `devices`, `agents` and `suggestions` list every host's
entries with a `host` field added, so a script written for one machine reads a fleet the same
way.  Only a renderer: `memtop.engine.fleet` built the observations.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from memtop._version import __version__
from memtop.engine import job_groups
from memtop.engine.observation import Observation
from memtop.figures.units import format_bytes
from memtop.present import report


def build(
    url: str, observations: Sequence[Observation], problems: Sequence[str] = ()
) -> dict[str, Any]:
    hosts = [report.build(obs) for obs in observations]
    for host in hosts:
        host["actions"] = "local-only"  # cleanup, snapshot, kill: run memtop on that host
    return {
        "version": __version__,
        "time": time.time(),
        "prometheus": url,
        "hosts": hosts,
        "devices": [{**d, "host": h["host"]} for h in hosts for d in h["devices"]],
        "agents": [{**a, "host": h["host"]} for h in hosts for a in h["agents"]],
        "suggestions": [{**s, "host": h["host"]} for h in hosts for s in h["suggestions"]],
        "problems": list(problems),
        # The ranks of one job across hosts, one entry per job (issue 25).
        "jobs": [group.as_json() for group in job_groups.job_groups(observations)],
    }


def render_text(data: dict[str, Any]) -> str:
    lines = [
        f"memtop {data['version']}: fleet of {len(data['hosts'])} host(s) in {data['prometheus']}"
    ]
    lines += [f"! {problem}" for problem in data["problems"]]
    if not data["hosts"]:
        lines.append("No memtop exporter found there (no memtop_* series).")
        lines.append("  On each host: memtop export   (then add it to Prometheus's scrape_configs)")
        return "\n".join(lines) + "\n"
    if data.get("jobs"):
        lines.append("")
        lines.append("Jobs across hosts:")
        lines += [f"  {line}" for line in job_groups.render_lines(data["jobs"], format_bytes)]
    for host in data["hosts"]:
        lines.append("")
        lines.append("=" * 100)
        lines.append(report.render_text(host).rstrip("\n"))
    lines.append("")
    lines.append("Actions (cleanup, snapshot, kill) are local-only: run memtop on the host.")
    return "\n".join(lines) + "\n"
