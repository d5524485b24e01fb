"""What the user asked to see: `--only GPUS`, `--user NAME`, `--pid PID[,PID]` (as nvitop has
them); `--only 0:1` is GPU 0's MIG instance whose GPU instance id is 1 (DCGM's GPU_I_ID). One
home for the filter: the dashboard, `--once` (text and JSON) and `memtop export` all render
`Scope.apply(observation)`, so a process hidden from the table is also gone from the
suggestions, the report and the metrics.
"""

from __future__ import annotations

from dataclasses import field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from memtop.base.records import record
from memtop.model import Accounting, AgentView

if TYPE_CHECKING:
    # Names for the annotations only: the dashboard's start makes its scope before the GPUs are
    # read, and the observation module brings the whole diagnosis (memtop.commands.watch).
    from memtop.engine.observation import (
        GpuObservation,
        Observation,
        ProcessRow,
    )


@record(frozen=True)
class Scope:
    """What the user asked to see (--only, --user, --pid): every panel renders an observation
    through it."""

    gpus: frozenset[int] | None = None  # the driver's numbers
    # MIG instances asked for (`--only 0:1`: GPU 0's GPU instance 1), as (GPU, GPU instance id):
    # shown without the rest of their GPU (a number in `gpus` shows the whole GPU).
    instances: frozenset[tuple[int, int]] | None = None
    users: frozenset[str] | None = None  # user names, as the process table shows them
    pids: frozenset[int] | None = None
    # The suggestions last filtered and what was kept: between two runs of the rules the
    # observation carries the very same tuple, and the view reuses its items by identity.
    _memo: list[Any] = field(default_factory=list, init=False, compare=False, repr=False)

    def __bool__(self) -> bool:
        return any(x is not None for x in (self.gpus, self.instances, self.users, self.pids))

    def describe(self) -> str:
        """ "only GPU 1 · user ada · pid 4101,4102", for a header."""
        parts = []
        if self.gpus is not None or self.instances is not None:
            chosen = [str(i) for i in sorted(self.gpus or ())]
            chosen += [f"{g}:{i}" for g, i in sorted(self.instances or ())]
            parts.append("only GPU " + ",".join(chosen))
        if self.users is not None:
            parts.append("user " + ",".join(sorted(self.users)))
        if self.pids is not None:
            parts.append("pid " + ",".join(str(p) for p in sorted(self.pids)))
        return " · ".join(parts)

    def flags(self) -> str:
        """The flags as typed: "--only 1 --user nobody --pid 4101,4102"."""
        parts = []
        if self.gpus is not None:
            parts.append("--only " + ",".join(str(i) for i in sorted(self.gpus)))
        if self.users is not None:
            parts.append("--user " + ",".join(sorted(self.users)))
        if self.pids is not None:
            parts.append("--pid " + ",".join(str(p) for p in sorted(self.pids)))
        return " ".join(parts)

    def hidden(self, whole: Observation, shown: Observation) -> str | None:
        """What the scope hid, in one line ("4 agents filtered out by --user nobody"), or None:
        a filter that matches nothing is not "no GPUs and no agents found"."""
        if not self:
            return None
        agents = len(whole.agents) - len(shown.agents)
        gpus = len(whole.gpus) - len(shown.gpus)
        seen = {a.pid for a in whole.agents}
        others = len({e.pid for e in whole.entries} - seen - {e.pid for e in shown.entries})
        parts = [
            f"{n} {name}{'' if n == 1 else 's'}"
            for n, name in ((agents, "agent"), (gpus, "GPU"), (others, "other process"))
            if n > 0
        ]
        if not parts:
            return None
        counted = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        return f"{counted} filtered out by {self.flags()}"

    def missing(self, obs: Observation) -> list[str]:
        """One line for each GPU asked for that this machine does not have (`--only 5`, or
        `--only 0:9` where GPU 0 has no MIG instance 9)."""
        lines = []
        if self.gpus is not None:
            here = sorted({g.index for g in obs.gpus})
            absent = sorted(self.gpus - set(here))
            if absent:
                names = ", ".join(str(i) for i in absent)
                has = f"it has GPU {', '.join(map(str, here))}" if here else "no GPU is visible"
                lines.append(f"--only: no GPU {names} on this machine ({has})")
        if self.instances is not None:
            here_mig = {(g.index, g.mig.gpu_instance_id) for g in obs.gpus if g.mig is not None}
            for gpu, instance in sorted(self.instances - here_mig):
                ids = sorted(i for g, i in here_mig if g == gpu)
                lines.append(
                    f"--only: GPU {gpu} has no MIG instance {instance} "
                    + (f"(it has {', '.join(map(str, ids))})" if ids else "(not in MIG mode)")
                )
        return lines

    def _gpu_shown(self, gpu: GpuObservation) -> bool:
        if self.gpus is None and self.instances is None:
            return True
        if self.gpus is not None and gpu.index in self.gpus:
            return True
        mig = gpu.mig
        return mig is not None and (gpu.index, mig.gpu_instance_id) in (self.instances or ())

    # ------------------------------------------------------------------ the filter

    def _owner_ok(self, pid: int, obs: Observation) -> bool:
        if self.pids is not None and pid not in self.pids:
            return False
        if self.users is not None:
            info = obs.processes.get(pid)
            if info is None or info.user not in self.users:
                return False
        return True

    def _entry_ok(self, entry: ProcessRow, obs: Observation, uuids: frozenset[str]) -> bool:
        if self.instances is not None and entry.uuid not in uuids:
            return False
        if self.instances is None and self.gpus is not None and entry.gpu not in self.gpus:
            return False
        return self._owner_ok(entry.pid, obs)

    def apply(self, obs: Observation) -> Observation:
        """`obs` with only what the scope shows: its GPUs, the processes on them that belong to
        its users and pids, their agents' devices on those GPUs, and the suggestions about
        them (a process-wide tip of a hidden process goes too)."""
        if not self:
            return obs
        gpus = tuple(g for g in obs.gpus if self._gpu_shown(g))
        uuids = frozenset(g.uuid for g in gpus)
        if self.users is not None or self.pids is not None:
            # A GPU's own figures (used, total, its agents' sums) stay the whole GPU's; the
            # processes it lists are the chosen ones.
            gpus = tuple(
                replace(
                    g,
                    processes=tuple(p for p in g.processes if self._owner_ok(p.pid, obs)),
                    accounted=partial(self._accounting, g, obs),
                )
                for g in gpus
            )
        agents: list[AgentView] = []
        for agent in obs.agents:
            if not self._owner_ok(agent.pid, obs):
                continue
            if self.instances is not None:
                devices = tuple(
                    d
                    for d, found in zip(agent.devices, obs.devices_of(agent), strict=True)
                    if found.uuid in uuids
                )
                if not devices:
                    continue
                agent = replace(agent, devices=devices)
            elif self.gpus is not None:
                devices = tuple(
                    d
                    for d, found in zip(agent.devices, obs.devices_of(agent), strict=True)
                    if found.gpu in self.gpus
                )
                if not devices:
                    continue  # nothing of it on the GPUs shown (a CPU-only agent included)
                agent = replace(agent, devices=devices)
            agents.append(agent)
        shown = {a.pid for a in agents}
        entries = tuple(e for e in obs.entries if self._entry_ok(e, obs, uuids))
        shown |= {e.pid for e in entries}
        suggestions = self._suggestions(obs, frozenset(shown), frozenset(g.index for g in gpus))
        return replace(
            obs,
            gpus=gpus,
            agents=tuple(agents),
            entries=entries,
            diagnosis=replace(obs.diagnosis, suggestions=suggestions),
        )

    def _accounting(self, gpu: GpuObservation, obs: Observation) -> Accounting | None:
        """The GPU's accounting with its bytes whole (they are the GPU's figures) but naming
        only the chosen processes: a hidden process's pid is not shown through it (worked out
        when read, as the whole GPU's is)."""
        accounting = gpu.accounting
        if accounting is None:
            return None
        parts = tuple(
            replace(
                part,
                pids=tuple(pid for pid in part.pids if self._owner_ok(pid, obs)),
                processes=tuple(p for p in part.processes if self._owner_ok(p.pid, obs)),
            )
            for part in accounting.parts
        )
        return replace(accounting, parts=parts)

    def _suggestions(
        self, obs: Observation, shown: frozenset[int], numbers_shown: frozenset[int]
    ) -> tuple[Any, ...]:
        made = obs.diagnosis.suggestions
        if self._memo and self._memo[0] is made and self._memo[1] == shown:
            return self._memo[2]  # type: ignore[no-any-return]
        chosen = numbers_shown if self.instances is not None else self.gpus
        numbers = {(d.pid, d.index): d.gpu for a in obs.agents for d in obs.devices_of(a)}
        kept = tuple(
            s
            for s in obs.diagnosis.suggestions
            if (s.pid is None or s.pid in shown)
            and (
                chosen is None
                or s.device is None
                # a process's device is its own cuda index; a GPU-wide finding's the driver's
                or (numbers.get((s.pid, s.device), s.device) if s.pid is not None else s.device)
                in chosen
            )
        )
        self._memo[:] = [made, shown, kept]
        return kept
