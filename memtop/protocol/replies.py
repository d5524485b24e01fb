"""The replies an agent sends, built by typed functions (DESIGN §6): one builder per command's
result, so the wire schema's field names are written once, here, next to the keys the viewer's
parsers read (memtop.protocol.schema), and never by hand in the agent.

The agent imports this module inside the trainer: it needs nothing but the standard library and
memtop.protocol.framing.  Extra fields are allowed by the schema; a new one is a new keyword here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memtop.protocol.framing import PROTOCOL_VERSION

# The closed command set's replies are objects of these shapes; `Result` is what a handler gives.
Result = dict[str, Any]

# The torch.cuda.memory_stats() keys every `sample` must carry (DESIGN §6 allows a documented
# subset of torch's keys): all that memtop, its JSON report and its exporter read.
SAMPLE_STAT_KEYS: tuple[str, ...] = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "reserved_bytes.large_pool.current",
    "active_bytes.all.current",
    "requested_bytes.all.current",
    "inactive_split_bytes.all.current",
    "inactive_split_bytes.large_pool.current",
    "allocation.all.current",
    "segment.all.current",
    "num_alloc_retries",
    "num_ooms",
    "num_device_alloc",
    "num_device_free",
)


# --------------------------------------------------------------------------------------------
# Envelopes


def result_reply(request_id: int | str, result: Mapping[str, Any]) -> dict[str, Any]:
    """A request answered: `{"id", "result"}`."""
    return {"id": request_id, "result": result}


def error_reply(request_id: Any, code: str, message: str) -> dict[str, Any]:
    """A request refused: `{"id", "error": {"code", "message"}}` (`id` None when the request
    had none the agent could read)."""
    return {"id": request_id, "error": {"code": code, "message": message}}


# --------------------------------------------------------------------------------------------
# hello


def hello_device(
    *, index: int, uuid: str, name: str, total_bytes: int, pci_bus_id: str | None = None
) -> Result:
    """One device of the hello.  `pci_bus_id` only where the probe knows it (the wire schema
    grows: a viewer before AMD support ignores it)."""
    entry: Result = {"index": index, "uuid": uuid, "name": name, "total_bytes": total_bytes}
    if pci_bus_id is not None:
        entry["pci_bus_id"] = pci_bus_id
    return entry


def hello_result(
    *,
    pid: int,
    argv: list[str],
    python: str,
    torch: str | None,
    allocator_conf: str,
    devices: list[Result],
    hip: str | None,
    agent_version: str,
    started: float,
    step: int | None,
    cwd: str,
    agent_thread_id: int | None,
    rank: int | None,
    local_rank: int | None,
    world_size: int | None,
    scheduler: Mapping[str, Any] | None,
    rendezvous: Mapping[str, Any] | None,
    allocator_settings: str | None = None,
    engine_environment: Mapping[str, str] | None = None,
) -> Result:
    """`hello`: the schema's required fields (protocol, pid, argv, python, torch,
    allocator_conf, devices), then what memtop shows of the process: `hip` (torch.version.hip:
    the trainer runs on ROCm; None on CUDA), the agent's version and start, the step, the
    working directory, the agent thread's id, torchrun's ranks, the scheduler and rendezvous.
    `allocator_settings`: the allocator's option string in force (`memtop tune` may have
    changed it since the environment's `allocator_conf` was read); None: unknown."""
    return {
        "protocol": PROTOCOL_VERSION,
        "pid": pid,
        "argv": argv,
        "python": python,
        "torch": torch,
        "allocator_conf": allocator_conf,
        "devices": devices,
        "hip": hip,
        "agent_version": agent_version,
        "started": started,
        "step": step,
        "cwd": cwd,
        "agent_thread_id": agent_thread_id,
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "scheduler": scheduler,
        "rendezvous": rendezvous,
        "allocator_settings": allocator_settings,
        # The variables that set an engine's share of the GPU (model.ENGINE_ENVIRONMENT), only
        # those, only where set: what makes JAX or a TGI shard a preallocator.
        "engine_environment": dict(engine_environment or {}),
    }


# --------------------------------------------------------------------------------------------
# sample


def sample_device(
    *,
    index: int,
    uuid: str,
    name: str,
    stats: Mapping[str, int],
    free_bytes: int,
    total_bytes: int,
    free_measured_at: float | None,
    floor: tuple[int, int] | None = None,
) -> Result:
    """One device of a sample: the allocator's counters (at least SAMPLE_STAT_KEYS) and the
    device's free and total bytes, with when the trainer's thread measured them (None: not
    measured there, an upper bound from this process alone).  `floor`: (the lowest allocated
    bytes read since the connection's previous sample, this sample's own read included; how
    many reads that is the lowest of), sent as `allocated_floor_bytes` / `floor_readings`
    (optional: only where the agent took floor readings, docs/protocol.md)."""
    device: Result = {
        "index": index,
        "uuid": uuid,
        "name": name,
        "stats": stats,
        "free_bytes": free_bytes,
        "total_bytes": total_bytes,
        "free_measured_at": free_measured_at,
    }
    if floor is not None:
        device["allocated_floor_bytes"], device["floor_readings"] = floor
    return device


def agent_costs(
    *,
    boundary_costs: Mapping[str, Any],
    connections: int,
    refused_requests: int,
    agent_cpu_s: float | None,
    governed_s: float,
    floor_reads: int | None = None,
    floor_read_s: float | None = None,
) -> Result:
    """A sample's `agent` object: what the agent costs its trainer (the step hook's and the
    boundary's counters), how many viewers it serves and refused, its thread's CPU, and how
    long it paused heavy viewers to stay in its CPU bound."""
    return {
        **boundary_costs,
        "connections": connections,
        "refused_requests": refused_requests,
        "agent_cpu_s": agent_cpu_s,
        "governed_s": governed_s,
        # Floor readings (agent/floor.py): device reads taken, and the agent thread's CPU spent.
        **({} if floor_reads is None else {"floor_reads": floor_reads}),
        **({} if floor_read_s is None else {"floor_read_s": floor_read_s}),
    }


def sample_result(
    *,
    time: float,
    step: int | None,
    devices: list[Result],
    step_marks: list[dict[str, Any]],
    columns: bool,
    last_step_time: float | None,
    phase: str | None,
    phase_since: float | None,
    oom: Mapping[str, Any] | None,
    agent: Mapping[str, Any],
    host_memory: Mapping[str, Any] | None = None,
    allocator_settings: str | None = None,
    actions: Sequence[Mapping[str, Any]] = (),
) -> Result:
    """`sample`.  `columns` (the viewer asked `mark_layout: "columns"`): the step marks go out
    as `step_mark_columns` (mark_columns) and `step_marks` is empty.  `host_memory`: the
    process's RSS and its high-water mark (memtop.agent.host_memory), where it could be read.
    `actions`: the entries of the agent's action log this connection has not seen (each an
    `action_entry`; all still kept in a connection's first sample), only when there are some."""
    extra: Result = {}
    if columns:
        extra["step_mark_columns"] = mark_columns(step_marks)
        step_marks = []
    # "host_memory", not "host": the fleet's JSON already says "host" for a machine's name.
    if host_memory is not None:
        extra["host_memory"] = dict(host_memory)
    # The allocator's option string in force (it changes under `memtop tune`).
    if allocator_settings is not None:
        extra["allocator_settings"] = allocator_settings
    if actions:
        extra["actions"] = list(actions)
    return {
        **extra,
        "time": time,
        "step": step,
        "devices": devices,
        "step_marks": step_marks,
        "last_step_time": last_step_time,
        "phase": phase,
        "phase_since": phase_since,
        "oom": oom,
        "agent": agent,
    }


def action_entry(
    *,
    cmd: str,
    args: Mapping[str, Any],
    time: float,
    step: int | None,
    uid: int | None,
    pid: int | None,
    refused: tuple[str, str] | None = None,
    outcome: Mapping[str, Any] | None = None,
    devices: Mapping[str, Mapping[str, int]] | None = None,
) -> Result:
    """One entry of the agent's action log (`sample`'s optional `actions`, DESIGN §13): the
    command and its arguments, the wall time and step it ran at, who asked (`by`: the client's
    uid and pid from SO_PEERCRED; null for the agent's own), `result` "ok" or "refused" with
    the error's `code` and `why`, a few figures of its reply (`outcome`) and, per device, the
    allocator's counters read right before it ran (`devices`: `{"<index>": {"reserved_bytes",
    "split_bytes", "num_alloc_retries", "num_ooms"}}`), so a viewer that connects after it
    still knows the state before.  `seq`, its number in the log, is set when it is appended."""
    entry: Result = {
        "seq": 0,
        "cmd": cmd,
        "args": dict(args),
        "time": time,
        "step": step,
        "by": {"uid": uid, "pid": pid},
        "result": "ok" if refused is None else "refused",
    }
    if refused is not None:
        entry["code"], entry["why"] = refused
    if outcome:
        entry["outcome"] = dict(outcome)
    if devices:
        entry["devices"] = {index: dict(figures) for index, figures in devices.items()}
    return entry


def mark_columns(marks: list[dict[str, Any]]) -> dict[str, Any]:
    """Step marks as columns (`sample` with `mark_layout: "columns"`): one list per field, and
    for a per-device field one list per device, null where a mark lacks that device.

    The same numbers as the rows, without an object per mark and per device: 1024 marks decode
    into 0.19 MB instead of 0.89 MB (tracemalloc), and the dashboard's RSS against 8 agents
    with full buffers no longer jumps to 62-68 MB in its first round (52-56 MB)."""
    # The three columns every reader needs are there even with no marks (a trainer between
    # steps, or one that never steps).
    # Whole columns by comprehension (C speed): the agent thread builds 1024 marks' worth once
    # per new viewer, and a loop over every field of every mark cost 2.5× as much as rows.
    columns: dict[str, Any] = {"step": [], "time": [], "allocated_bytes": {}}
    for key in set().union(*marks) if marks else ():
        values = [mark.get(key) for mark in marks]
        if any(isinstance(value, dict) for value in values):
            maps = [value if isinstance(value, dict) else {} for value in values]
            devices = set().union(*maps)
            columns[key] = {device: [m.get(device) for m in maps] for device in sorted(devices)}
        else:
            columns[key] = values
    return columns


# --------------------------------------------------------------------------------------------
# breakdown


def breakdown_pending() -> Result:
    """`breakdown` before the trainer's first step boundary measured one."""
    return {"time": None, "step": None, "devices": {}, "pending": True}


def breakdown_result(
    *,
    time: float,
    step: int | None,
    measured: str,
    took_s: float,
    devices: Mapping[int, Mapping[str, int]],
) -> Result:
    """`breakdown`: bytes by role per device, where it was measured (`after_step`) and what
    the walk cost."""
    return {
        "time": time,
        "step": step,
        "measured": measured,
        "took_s": took_s,
        "devices": {str(index): dict(parts) for index, parts in devices.items()},
    }


def breakdown_stale(latest: Mapping[str, Any]) -> Result:
    """The newest breakdown, marked stale: the trainer stopped stepping since."""
    return {**latest, "stale": True}


# --------------------------------------------------------------------------------------------
# snapshot


def snapshot_summary_pending() -> Result:
    """`snapshot` without a file, before the first trace-free snapshot was summarized."""
    return {"path": None, "time": None, "devices": {}, "pending": True}


def snapshot_summary(
    *, time: float, step: int | None, devices: Mapping[str, Any], traced: bool
) -> Result:
    """The fragmentation summary of a snapshot taken on the trainer's thread; `traced` (whether
    the snapshot carried stack traces) is the agent's own note, taken out before it is served
    (snapshot_summary_served)."""
    return {"path": None, "time": time, "step": step, "traced": traced, "devices": devices}


def snapshot_summary_served(summary: Mapping[str, Any], history_recording: bool) -> Result:
    """`snapshot` without a file: the newest summary, and whether the trainer records memory
    history (then periodic snapshots pause: each would cost hundreds of ms)."""
    return {**summary, "history_recording": history_recording}


def snapshot_file_result(*, path: str, size: int, devices: Mapping[str, Any]) -> Result:
    """`snapshot` with a file: where it was written, its size, and its summary."""
    return {"path": path, "bytes": size, "devices": devices}


# --------------------------------------------------------------------------------------------
# cleanup, reset_peak


def cleanup_result(
    *,
    before: Mapping[int, int],
    after: Mapping[int, int],
    gc_collected: int,
    after_step: int | None,
    thread: str,
    thread_ident: int,
    took_s: float,
    nothing_to_do: str | None = None,
) -> Result:
    """`cleanup`: reserved bytes per device before and after gc + empty_cache, what that
    released, and proof of where it ran (the trainer's thread, at a step boundary).
    `nothing_to_do`: why nothing was done (no device in use)."""
    result: Result = {
        "released_bytes": {str(i): max(0, before[i] - after[i]) for i in before},
        "reserved_before": {str(i): before[i] for i in before},
        "reserved_after": {str(i): after[i] for i in before},
        "gc_collected": gc_collected,
        "at_step_boundary": True,
        "after_step": after_step,
        "thread": thread,
        "thread_ident": thread_ident,
        "took_s": took_s,
    }
    if nothing_to_do is not None:
        result["nothing_to_do"] = nothing_to_do
    return result


def tune_result(
    *,
    before: str,
    after: str,
    changed: Mapping[str, str],
    after_step: int | None,
    thread: str,
    took_s: float,
    reserved_before: Mapping[int, int] | None = None,
    reserved_after: Mapping[int, int] | None = None,
) -> Result:
    """`tune`: the allocator's whole option string before and after (as torch reads it back),
    the keys changed, the step it ran after, on which thread; with `empty_cache`, reserved bytes
    per device before and after emptying the cache."""
    result: Result = {
        "before": before,
        "after": after,
        "changed": dict(changed),
        "at_step_boundary": True,
        "after_step": after_step,
        "thread": thread,
        "took_s": took_s,
    }
    if reserved_before is not None and reserved_after is not None:
        result["emptied_cache"] = True
        result["reserved_before"] = {str(i): reserved_before[i] for i in reserved_before}
        result["reserved_after"] = {str(i): reserved_after.get(i, 0) for i in reserved_before}
    return result


def reset_peak_result(devices: Sequence[int]) -> Result:
    """`reset_peak`: the devices whose peak counters were reset."""
    return {"devices": list(devices)}


# --------------------------------------------------------------------------------------------
# sites


def site_place(*, file: str, line: int, function: str, text: str) -> Result:
    """Where blocks were allocated: the innermost user frame (all empty: no user frame)."""
    return {"file": file, "line": line, "function": function, "text": text}


# Shared by every entry without a user frame, as it always was: entries are built on the
# trainer's thread and only ever serialized, never changed, so nothing is copied for them.
UNKNOWN_SITE: Result = site_place(file="", line=0, function="", text="")


def site_entry(*, device: int, site: Result, nbytes: int, blocks: int, old_blocks: int) -> Result:
    """One site's live blocks on one device; `old_blocks` were live the round before too."""
    return {
        "device": device,
        "site": site,
        "bytes": nbytes,
        "blocks": blocks,
        "old_blocks": old_blocks,
    }


def sites_round(
    *, time: float, step: int | None, sites: list[Result], blocks: int, took_s: float
) -> Result:
    """One grouping round of the live blocks by site, taken on the trainer's thread (the list
    is the round's own: kept, not copied)."""
    return {"time": time, "step": step, "sites": sites, "blocks": blocks, "took_s": took_s}


def sites_result(
    *,
    enabled: bool,
    wanted: bool,
    supported: bool,
    latest: Mapping[str, Any] | None,
    rounds: int,
    rounds_abandoned: int,
    error: str | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
) -> Result:
    """`sites`: whether stacks are recorded (and asked for, and possible), and the newest round
    (`sites_round`; empty before the first or while stacks are off); `history`, when asked for:
    the kept rounds before it, oldest first (each a `sites_round`)."""
    result: Result = {
        "enabled": enabled,
        "wanted": wanted,
        "supported": supported,
        "sites": [],
        "time": None,
        "step": None,
    }
    if latest is not None and enabled:
        result.update(latest)
    result["rounds"] = rounds
    result["rounds_abandoned"] = rounds_abandoned
    if history is not None:
        result["history"] = list(history)
    if error:
        result["error"] = error
    return result


# --------------------------------------------------------------------------------------------
# OOM status (carried by `sample`)


def oom_status(*, ooms: int, reports: int, last: Mapping[str, Any] | None) -> Result:
    """How many OOMs the trainer hit, how many reports it wrote, and the newest one's headline."""
    return {"ooms": ooms, "reports": reports, "last": last}
