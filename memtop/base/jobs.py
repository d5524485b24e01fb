"""Which job a trainer belongs to, from its agent's `hello` (issue 25): the one reader of the
`scheduler` and `rendezvous` fields for the report, the table, the exporter and the fleet.

Pure: the strings were already cleaned by the protocol (clean_value); here they are only typed,
bounded and named.  An agent that sends something else for these fields has no job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memtop.base.records import record

MAX_CHARS = 128  # of any one identity string shown or exported


def _text(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if isinstance(value, str) and value:
        return value[:MAX_CHARS]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _int(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31:
        return value
    return None


@record(frozen=True, slots=True)
class JobIdentity:
    """Where one trainer runs.  Every field None when unknown."""

    scheduler: str | None = None  # "slurm" | "kubernetes"
    slurm_job_id: str | None = None
    slurm_job_name: str | None = None
    slurm_proc_id: int | None = None
    slurm_array_job_id: str | None = None
    slurm_array_task_id: str | None = None
    pod: str | None = None
    namespace: str | None = None
    container: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    world_size: int | None = None

    @property
    def hpc_job(self) -> str:
        """DCGM exporter's `hpc_job` label: the Slurm job (an array task as JOB_TASK)."""
        if self.slurm_array_job_id and self.slurm_array_task_id:
            return f"{self.slurm_array_job_id}_{self.slurm_array_task_id}"
        return self.slurm_job_id or ""

    @property
    def rendezvous(self) -> str | None:
        if self.master_addr is None and self.master_port is None:
            return None
        return f"{self.master_addr or '?'}:{self.master_port or '?'}"

    @property
    def label(self) -> str:
        """Compact, for a table cell or a header: `slurm 4242`, `pod ns/name`, `rdzv h:29500`."""
        if self.hpc_job:
            return f"slurm {self.hpc_job}"
        if self.pod:
            return f"pod {self.namespace}/{self.pod}" if self.namespace else f"pod {self.pod}"
        if self.rendezvous:
            return f"rdzv {self.rendezvous}"
        return ""

    @property
    def group_key(self) -> tuple[str, ...] | None:
        """What the ranks of one job share across hosts (None: cannot be grouped): the Slurm
        job, else the torchrun rendezvous with its world size, else the pod set (the pod name
        without its ordinal or random suffix, in its namespace)."""
        if self.hpc_job:
            return ("slurm", self.hpc_job)
        if self.rendezvous is not None and self.world_size:
            return ("rendezvous", self.rendezvous, str(self.world_size))
        if self.pod:
            return ("pods", self.namespace or "", pod_set(self.pod))
        return None

    def as_json(self) -> dict[str, Any]:
        scheduler: dict[str, Any] | None = None
        if self.scheduler == "slurm":
            scheduler = {
                "kind": "slurm",
                "job_id": self.slurm_job_id,
                "job_name": self.slurm_job_name,
                "proc_id": self.slurm_proc_id,
                "array_job_id": self.slurm_array_job_id,
                "array_task_id": self.slurm_array_task_id,
            }
        elif self.scheduler == "kubernetes":
            scheduler = {
                "kind": "kubernetes",
                "pod": self.pod,
                "namespace": self.namespace,
                "container": self.container,
            }
        rendezvous = (
            {
                "master_addr": self.master_addr,
                "master_port": self.master_port,
                "world_size": self.world_size,
            }
            if self.rendezvous is not None
            else None
        )
        return {"label": self.label, "scheduler": scheduler, "rendezvous": rendezvous}


def pod_set(pod: str) -> str:
    """The set a pod belongs to: `trainer-3` -> `trainer` (StatefulSet / indexed Job ordinal),
    `trainer-worker-0` -> `trainer-worker`, `trainer-7d9f8-x2kqp` -> `trainer-7d9f8`."""
    head, dash, tail = pod.rpartition("-")
    if dash and head and (tail.isdigit() or len(tail) == 5):
        return head
    return pod


def job_identity(extra: Mapping[str, Any] | None) -> JobIdentity | None:
    """The job of an agent whose hello carried `extra` fields; None when it says nothing."""
    if not extra:
        return None
    scheduler = extra.get("scheduler")
    rendezvous = extra.get("rendezvous")
    fields: dict[str, Any] = {}
    if isinstance(scheduler, Mapping):
        kind = scheduler.get("kind")
        if kind == "slurm" and _text(scheduler, "job_id"):
            fields.update(
                scheduler="slurm",
                slurm_job_id=_text(scheduler, "job_id"),
                slurm_job_name=_text(scheduler, "job_name"),
                slurm_proc_id=_int(scheduler, "proc_id"),
                slurm_array_job_id=_text(scheduler, "array_job_id"),
                slurm_array_task_id=_text(scheduler, "array_task_id"),
            )
        elif kind == "kubernetes":
            fields.update(
                scheduler="kubernetes",
                pod=_text(scheduler, "pod"),
                namespace=_text(scheduler, "namespace"),
                container=_text(scheduler, "container"),
            )
    if isinstance(rendezvous, Mapping):
        fields.update(
            master_addr=_text(rendezvous, "master_addr"),
            master_port=_int(rendezvous, "master_port"),
            world_size=_int(rendezvous, "world_size"),
        )
    if not fields:
        return None
    return JobIdentity(**fields)


def dcgm_labels(job: JobIdentity | None) -> list[str]:
    """Values of DCGM exporter's `hpc_job`, `pod`, `namespace`, `container` labels (empty when
    unknown, as DCGM leaves them)."""
    if job is None:
        return ["", "", "", ""]
    return [job.hpc_job, job.pod or "", job.namespace or "", job.container or ""]


DCGM_LABELS = ("hpc_job", "pod", "namespace", "container")


def info_labels(job: JobIdentity | None) -> list[str]:
    """Values of the exporter's `rendezvous` and `world_size` labels of `memtop_agent_info`
    (what groups ranks of one torchrun job across hosts in the fleet view)."""
    if job is None:
        return ["", ""]
    return [job.rendezvous or "", str(job.world_size) if job.world_size else ""]


INFO_JOB_LABELS = ("rendezvous", "world_size")


def hello_fields_from_labels(labels: Mapping[str, str]) -> dict[str, Any]:
    """`scheduler` and `rendezvous` hello fields rebuilt from an exported `memtop_agent_info`
    series' labels (the fleet view reads agents back from Prometheus)."""
    out: dict[str, Any] = {}
    hpc_job = labels.get("hpc_job", "")
    if hpc_job:
        job_id, _, task = hpc_job.partition("_")
        out["scheduler"] = {
            "kind": "slurm",
            "job_id": hpc_job,
            "array_job_id": job_id if task else None,
            "array_task_id": task or None,
        }
    elif labels.get("pod"):
        out["scheduler"] = {
            "kind": "kubernetes",
            "pod": labels.get("pod"),
            "namespace": labels.get("namespace") or None,
            "container": labels.get("container") or None,
        }
    addr, colon, port = labels.get("rendezvous", "").rpartition(":")
    if colon:
        world = labels.get("world_size", "")
        out["rendezvous"] = {
            "master_addr": addr if addr != "?" else None,
            "master_port": int(port) if port.isdigit() and len(port) <= 5 else None,
            "world_size": int(world) if world.isdigit() and len(world) <= 9 else None,
        }
    return out
