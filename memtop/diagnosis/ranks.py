"""The ranks of one job beside each other (issue 25.4): each agent device learns its rank and
the median peak of the job's OTHER ranks, so the `rank_drift` rule can say which rank peaks
above the rest.

Ranks are grouped as the fleet groups them (memtop.base.jobs: same Slurm job, torchrun rendezvous
or pod set, run by the same user) among the agents this diagnosis sees.  The median of the
others, not of all: with two ranks the median of all sits halfway and a rank 30 % above the
other would read 13 %.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from memtop.base.jobs import job_identity
from memtop.diagnosis.facts import DeviceDiagnosis

if TYPE_CHECKING:
    from memtop.engine.store import AgentView


def _rank(extra: Mapping[str, object], slurm_proc_id: int | None) -> int | None:
    rank = extra.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        return rank
    return slurm_proc_id


def with_job_peers(
    devices: dict[tuple[int, int], DeviceDiagnosis],
    agents: Sequence[AgentView],
    owners: Mapping[int, int | None] | None = None,
) -> dict[tuple[int, int], DeviceDiagnosis]:
    """`devices` with `rank`, `job`, `peer_ranks` and `peers_median_peak_bytes` filled in for
    the agents that are ranks of a job with at least one other rank in view.

    `owners`: the uid running each pid.  A job is one owner's: anyone can claim any Slurm job
    id in their own trainer's environment, and another user's agents claiming ours must not
    make our ranks drift (issue 36, item 9)."""
    owners = owners or {}
    groups: dict[tuple[int | None, tuple[str, ...]], list[tuple[int, int | None, str, int]]] = {}
    for agent in agents:
        extra = agent.hello.extra if agent.hello is not None else {}
        job = job_identity(extra)
        key = job.group_key if job is not None else None
        peaks = [d.peak_bytes for (pid, _), d in devices.items() if pid == agent.pid]
        if job is None or key is None or not peaks:
            continue
        rank = _rank(extra, job.slurm_proc_id)
        groups.setdefault((owners.get(agent.pid), key), []).append(
            (agent.pid, rank, job.label, max(peaks))
        )
    if not groups:
        return devices
    out = dict(devices)
    for members in groups.values():
        if len(members) < 2:
            continue
        for pid, rank, label, _ in members:
            others = [peak for other, _, _, peak in members if other != pid]
            median = int(statistics.median(others))
            for (dev_pid, index), dev in devices.items():
                if dev_pid == pid:
                    out[(dev_pid, index)] = replace(
                        dev,
                        rank=rank,
                        job=label,
                        peer_ranks=len(others),
                        peers_median_peak_bytes=median,
                    )
    return out
