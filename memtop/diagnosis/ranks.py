"""The ranks of one job beside each other (issue 25.4): each agent learns the median peak of
its job's OTHER ranks, so the `rank_drift` rule can say which rank peaks above the rest.

Ranks are grouped as the fleet groups them (memtop.base.jobs: same Slurm job, torchrun rendezvous
or pod set, run by the same user) among the agents this diagnosis sees.  The median of the
others, not of all: with two ranks the median of all sits halfway and a rank 30 % above the
other would read 13 %.  Its rank and job are the agent's own (`AgentView.rank`, `.job`, from
its hello); what this adds is the peers' figures, which the diagnoser writes onto each device's
one record as it makes it (no copy afterwards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from memtop.figures.median import median
from memtop.model import AgentView


class JobPeers(NamedTuple):
    """What a rank's job's other ranks in view say of it: its rank and job (its own hello's),
    how many other ranks, and the median of their true peaks."""

    rank: int | None
    job: str
    peer_ranks: int
    peers_median_peak_bytes: int


def job_peers(
    agents: Sequence[AgentView], owners: Mapping[int, int | None] | None = None
) -> dict[int, JobPeers]:
    """By pid, the agents that are ranks of a job with at least one other rank in view.

    `owners`: the uid running each pid.  A job is one owner's: anyone can claim any Slurm job
    id in their own trainer's environment, and another user's agents claiming ours must not
    make our ranks drift (issue 36, item 9)."""
    owners = owners or {}
    groups: dict[tuple[int | None, tuple[str, ...]], list[tuple[int, int | None, str, int]]] = {}
    for agent in agents:
        job = agent.job
        key = job.group_key if job is not None else None
        if job is None or key is None or not agent.devices:
            continue
        peak = max(d.torch_peak for d in agent.devices)
        groups.setdefault((owners.get(agent.pid), key), []).append(
            (agent.pid, agent.rank, job.label, peak)
        )
    found: dict[int, JobPeers] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        for pid, rank, label, _ in members:
            others = [peak for other, _, _, peak in members if other != pid]
            found[pid] = JobPeers(rank, label, len(others), int(median(others)))
    return found
