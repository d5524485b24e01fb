"""The ranks of one job, across hosts (issue 25.3): grouped by their Slurm job, else their
torchrun rendezvous (MASTER_ADDR:MASTER_PORT with WORLD_SIZE), else their pod set.

Pure: a function of observations (one per host in the fleet view, or the local one), keyed by
(host, pid) so that equal pids on two hosts stay two ranks, and grouped per owner as well as per
job: another user's trainers claiming our Slurm job id are a job of their own.  One `JobGroup`
per job: its ranks, hosts, the spread of the ranks' peaks and the rank that leaks.  What drifts
apart is judged from these groups (memtop.diagnosis rule `rank_drift`, fed by `rank_peaks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from memtop.base.jobs import JobIdentity
from memtop.base.records import record
from memtop.diagnosis import DeviceDiagnosis
from memtop.diagnosis.suggestions import RANK_DRIFT_MIN_BYTES, RANK_DRIFT_SHARE
from memtop.engine.observation import Observation
from memtop.figures.median import median
from memtop.model import AgentView, host_of


@record(frozen=True, slots=True)
class RankView:
    """One rank of a distributed job, as its group shows it."""

    host: str
    pid: int
    rank: int | None  # RANK, else SLURM_PROCID
    peak_bytes: int | None  # torch's true peak, the highest of its devices
    leak_bytes_per_step: float | None  # when its leak verdict says leak
    phase: str | None = None


@record(frozen=True, slots=True)
class JobGroup:
    """The ranks of one distributed job, one user's, across hosts."""

    key: tuple[str, ...]
    label: str
    ranks: tuple[RankView, ...]
    # The uid running its ranks (None: not known): a job is one user's, whatever job id another
    # user's trainers claim.
    owner: int | None = None

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({r.host for r in self.ranks}))

    @property
    def peaks(self) -> list[int]:
        return [r.peak_bytes for r in self.ranks if r.peak_bytes is not None]

    @property
    def spread_bytes(self) -> int | None:
        peaks = self.peaks
        return max(peaks) - min(peaks) if len(peaks) >= 2 else None

    @property
    def median_peak_bytes(self) -> int | None:
        peaks = self.peaks
        return int(median(peaks)) if peaks else None

    @property
    def drifting(self) -> tuple[RankView, float] | None:
        """The rank whose peak is furthest above the median of the job's other ranks, when it
        is above by more than the `rank_drift` rule's limits (15 % and 1 GiB), with its share
        above: across hosts, where each host's own diagnosis sees only its ranks."""
        best: tuple[RankView, float] | None = None
        for rank in self.ranks:
            others = [r.peak_bytes for r in self.ranks if r is not rank and r.peak_bytes]
            if rank.peak_bytes is None or not others:
                continue
            middle = median(others)
            excess = rank.peak_bytes - middle
            share = excess / middle if middle > 0 else 0.0
            if (
                share > RANK_DRIFT_SHARE
                and excess > RANK_DRIFT_MIN_BYTES
                and (best is None or share > best[1])
            ):
                best = (rank, share)
        return best

    @property
    def leaking(self) -> RankView | None:
        """The rank that leaks fastest, if any does."""
        leaks = [r for r in self.ranks if r.leak_bytes_per_step]
        return max(leaks, key=lambda r: r.leak_bytes_per_step or 0.0) if leaks else None

    def as_json(self) -> dict[str, Any]:
        leaking = self.leaking
        drifting = self.drifting
        return {
            "key": list(self.key),
            "label": self.label,
            "owner": self.owner,
            "hosts": list(self.hosts),
            "ranks": [
                {"host": r.host, "pid": r.pid, "rank": r.rank, "peak_bytes": r.peak_bytes}
                for r in self.ranks
            ],
            "spread_bytes": self.spread_bytes,
            "median_peak_bytes": self.median_peak_bytes,
            "drifting": (
                None
                if drifting is None
                else {
                    "host": drifting[0].host,
                    "pid": drifting[0].pid,
                    "rank": drifting[0].rank,
                    "above_share": round(drifting[1], 4),
                }
            ),
            "leaking": (
                None
                if leaking is None
                else {
                    "host": leaking.host,
                    "pid": leaking.pid,
                    "rank": leaking.rank,
                    "bytes_per_step": leaking.leak_bytes_per_step,
                }
            ),
        }


def _rank_of(agent: AgentView, job: JobIdentity) -> int | None:
    extra = agent.hello.extra if agent.hello is not None else {}
    rank = extra.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        return rank
    return job.slurm_proc_id


def _rank_view(
    host: str, agent: AgentView, devices: Sequence[DeviceDiagnosis], job: JobIdentity
) -> RankView:
    peaks = [d.peak_bytes for d in devices]
    leaks = [
        d.diagnosis.leak.bytes_per_step
        for d in devices
        if d.diagnosis.leak.detected and d.diagnosis.leak.bytes_per_step
    ]
    return RankView(
        host=host,
        pid=agent.pid,
        rank=_rank_of(agent, job),
        peak_bytes=max(peaks) if peaks else None,
        leak_bytes_per_step=max(leaks) if leaks else None,
    )


def job_groups(observations: Iterable[Observation]) -> list[JobGroup]:
    """Every job with at least one live rank in view, its ranks in rank order; keyed by
    (host, pid), so one pid on two hosts is two ranks.  One observation per host (the report),
    or the fleet dashboard's one observation whose pids are `HostPid`s."""
    found: dict[
        tuple[int | None, tuple[str, ...]],
        tuple[str, str | None, dict[tuple[str, int], RankView]],
    ] = {}
    for observation in observations:
        for agent in observation.agents:
            # The fleet dashboard's one merged observation keys every pid with its host.
            host = host_of(agent.pid) or observation.host
            job = agent.job
            key = job.group_key if job is not None and agent.live else None
            if job is None or key is None:
                continue
            # Per owner: another user's trainers claiming the same job id are not its ranks.
            info = observation.info(agent.pid)
            owner = info.uid if info is not None else None
            user = info.user if info is not None else None
            _, _, ranks = found.setdefault((owner, key), (_group_label(key, job), user or None, {}))
            ranks[(host, agent.pid)] = _rank_view(host, agent, observation.devices_of(agent), job)
    labels = [label for label, _, _ in found.values()]
    groups = []
    for (owner, key), (label, user, ranks) in found.items():
        ordered = sorted(ranks.values(), key=lambda r: (r.rank is None, r.rank or 0, r.host, r.pid))
        if labels.count(label) > 1:  # two users' jobs of one id: say whose each is
            label = f"{label} of {user or f'uid {owner}'}"
        groups.append(JobGroup(key, label, tuple(ordered), owner))
    return sorted(groups, key=lambda g: g.label)


def _group_label(key: tuple[str, ...], job: JobIdentity) -> str:
    if key[0] == "slurm":
        name = f" ({job.slurm_job_name})" if job.slurm_job_name else ""
        return f"slurm {key[1]}{name}"
    if key[0] == "rendezvous":
        return f"torchrun {key[1]} x{key[2]}"
    return f"pods {key[1]}/{key[2]}" if key[1] else f"pods {key[2]}"


def render_lines(groups: Sequence[dict[str, Any]], format_bytes: Any) -> list[str]:
    """One line per job (from `JobGroup.as_json()`): `slurm 4242: 2 ranks on 2 hosts (a, b) ·
    peak median 8.0 GiB, spread 2.4 GiB · leaks: rank 1 on b (+8.0 MiB/step)`."""
    lines = []
    for group in groups:
        n = len(group["ranks"])
        hosts = group["hosts"]
        text = (
            f"{group['label']}: {n} rank{'s' if n != 1 else ''} on {len(hosts)} "
            f"host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts)})"
        )
        if group["median_peak_bytes"] is not None:
            text += f" · peak median {format_bytes(group['median_peak_bytes'])}"
        if group["spread_bytes"] is not None:
            text += f", spread {format_bytes(group['spread_bytes'])}"
        drifting = group.get("drifting")
        if drifting is not None:
            who = (
                f"rank {drifting['rank']}"
                if drifting["rank"] is not None
                else f"pid {drifting['pid']}"
            )
            text += (
                f" · {who} on {drifting['host']} peaks "
                f"{100 * drifting['above_share']:.0f} % above the others"
            )
        leaking = group["leaking"]
        if leaking is not None:
            who = (
                f"rank {leaking['rank']}"
                if leaking["rank"] is not None
                else f"pid {leaking['pid']}"
            )
            text += (
                f" · leaks: {who} on {leaking['host']} "
                f"(+{format_bytes(int(leaking['bytes_per_step'] or 0))}/step)"
            )
        lines.append(text)
    return lines
