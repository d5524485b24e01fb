"""Where the trainer runs, for `hello` (issue 25): its scheduler's job and its rendezvous.

Read ONCE when the agent starts (the environment and two small files), every read bounded in
size, never raising: whatever cannot be read is left out.  The viewer cleans these strings like
every agent string (protocol.clean_value).

- `scheduler`: `{"kind": "slurm", "job_id", "job_name", "proc_id", "array_job_id",
  "array_task_id"}` from SLURM_JOB_ID (SLURM_JOBID), SLURM_JOB_NAME, SLURM_PROCID,
  SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID; or `{"kind": "kubernetes", "pod", "namespace",
  "container", "container_id"}` from the downward-API variables a pod spec usually sets
  (POD_NAME / MY_POD_NAME / K8S_POD_NAME, POD_NAMESPACE / MY_POD_NAMESPACE /
  K8S_POD_NAMESPACE, CONTAINER_NAME / MY_CONTAINER_NAME / K8S_CONTAINER_NAME), else the pod's
  hostname, the service account's namespace file and the container id in /proc/self/cgroup.
- `rendezvous`: `{"master_addr", "master_port", "world_size"}` from torchrun's MASTER_ADDR,
  MASTER_PORT and WORLD_SIZE.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any

MAX_VALUE = 256  # characters kept of any one value
MAX_FILE_READ = 16 << 10  # bytes read of /proc/self/cgroup or the namespace file
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
CGROUP_FILE = "/proc/self/cgroup"

POD_NAME_VARS = ("POD_NAME", "MY_POD_NAME", "K8S_POD_NAME")
POD_NAMESPACE_VARS = ("POD_NAMESPACE", "MY_POD_NAMESPACE", "K8S_POD_NAMESPACE")
CONTAINER_NAME_VARS = ("CONTAINER_NAME", "MY_CONTAINER_NAME", "K8S_CONTAINER_NAME")

# A container id as runtimes write it in cgroup paths: 64 hex digits (docker-<id>.scope,
# cri-containerd-<id>.scope, crio-<id>.scope, /kubepods/.../<id>).
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")


def _value(environ: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = environ.get(name)
        if value:
            return value[:MAX_VALUE]
    return None


def _number(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if value.isascii() and value.isdigit() and len(value) <= 12:
        return int(value)
    return None


def read_small_file(path: str, limit: int = MAX_FILE_READ) -> str | None:
    """The first `limit` bytes of a regular file, or None (missing, not regular, unreadable).
    Opened non-blocking and checked before reading: a FIFO planted there costs nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def container_id(cgroup_text: str | None) -> str | None:
    """The container id in /proc/self/cgroup's text (the last one named), or None."""
    if not cgroup_text:
        return None
    found = _CONTAINER_ID.findall(cgroup_text)
    return found[-1] if found else None


def slurm(environ: Mapping[str, str]) -> dict[str, Any] | None:
    job_id = _value(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if job_id is None:
        return None
    return {
        "kind": "slurm",
        "job_id": job_id,
        "job_name": _value(environ, "SLURM_JOB_NAME"),
        "proc_id": _number(environ, "SLURM_PROCID"),
        "array_job_id": _value(environ, "SLURM_ARRAY_JOB_ID"),
        "array_task_id": _value(environ, "SLURM_ARRAY_TASK_ID"),
    }


def kubernetes(
    environ: Mapping[str, str],
    read: Any = read_small_file,
    hostname: str | None = None,
) -> dict[str, Any] | None:
    pod = _value(environ, *POD_NAME_VARS)
    namespace = _value(environ, *POD_NAMESPACE_VARS)
    in_pod = (
        pod is not None or namespace is not None or bool(environ.get("KUBERNETES_SERVICE_HOST"))
    )
    if not in_pod:
        return None
    if namespace is None:
        text = read(SERVICE_ACCOUNT_NAMESPACE, 256)
        namespace = (text.strip()[:MAX_VALUE] or None) if text else None
    if pod is None:
        pod = _value(environ, "HOSTNAME") or (hostname or os.uname().nodename)[:MAX_VALUE]
    cid = container_id(read(CGROUP_FILE, MAX_FILE_READ))
    return {
        "kind": "kubernetes",
        "pod": pod,
        "namespace": namespace,
        "container": _value(environ, *CONTAINER_NAME_VARS) or cid,
        "container_id": cid,
    }


def scheduler(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The trainer's scheduler identity, or None outside Slurm and Kubernetes.  Never raises."""
    environ = os.environ if environ is None else environ
    try:
        return slurm(environ) or kubernetes(environ)
    except Exception:  # the agent never raises into the trainer
        return None


def rendezvous(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """torchrun's rendezvous (MASTER_ADDR, MASTER_PORT, WORLD_SIZE), or None.  Never raises."""
    environ = os.environ if environ is None else environ
    try:
        addr = _value(environ, "MASTER_ADDR")
        port = _number(environ, "MASTER_PORT")
        if addr is None and port is None:
            return None
        return {
            "master_addr": addr,
            "master_port": port,
            "world_size": _number(environ, "WORLD_SIZE"),
        }
    except Exception:
        return None
