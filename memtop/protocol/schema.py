"""The wire schema of the replies, as the viewer reads them: each command's result checked
(types, bounds, no negative sizes) and turned into its typed model object (memtop.model), every
string cleaned (memtop.protocol.text).  What the agent sends is built in memtop.protocol.replies.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Mapping
from typing import Any, TypeGuard

from memtop.model import (
    ACTION_FROM_AGENT,
    ACTION_OK,
    ACTION_REFUSED,
    MISSING_FIGURE,
    NO_STEP_MARKS,
    ActionRecord,
    AgentBreakdown,
    AgentCleanup,
    AgentDevice,
    AgentDeviceSample,
    AgentHello,
    AgentResetPeak,
    AgentSample,
    AgentSites,
    AgentSnapshot,
    AgentTune,
    HostMemory,
    Site,
    SiteUsage,
    StepMark,
    StepMarks,
)
from memtop.protocol.framing import ProtocolError
from memtop.protocol.text import canonical_pci_bus_id, clean_text, clean_value, decimal


def _require(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} missing or of the wrong type")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


MAX_DEVICES = 64
MAX_ARGV = 256
MAX_STATS = 1024
MAX_MARKS = 8192


def _bounded(items: list[Any], limit: int, what: str) -> list[Any]:
    if len(items) > limit:
        raise ProtocolError("bad_reply", f"{what}: {len(items)} entries, more than {limit}")
    return items


def _count(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = _require(obj, key, int, where)
    if value < 0:
        raise ProtocolError("bad_reply", f"{where}: field {key!r} is negative")
    return int(value)


def parse_hello(result: Mapping[str, Any]) -> AgentHello:
    """Validate a `hello` result against the wire schema and turn it into an AgentHello.

    Every string is cleaned of control characters here (clean_text), so whatever shows it, in
    whatever output mode, shows inert text.
    """
    protocol = _require(result, "protocol", int, "hello")
    pid = _require(result, "pid", int, "hello")
    argv = _bounded(_require(result, "argv", list, "hello"), MAX_ARGV, "hello argv")
    python = _require(result, "python", str, "hello")
    torch_version = result.get("torch")
    if torch_version is not None and not isinstance(torch_version, str):
        raise ProtocolError("bad_reply", "hello: field 'torch' must be a string or null")
    conf = _require(result, "allocator_conf", str, "hello")
    devices = []
    for raw in _bounded(_require(result, "devices", list, "hello"), MAX_DEVICES, "hello devices"):
        if not isinstance(raw, dict):
            raise ProtocolError("bad_reply", "hello: each device must be an object")
        devices.append(
            AgentDevice(
                index=_count(raw, "index", "hello device"),
                uuid=clean_text(_require(raw, "uuid", str, "hello device"), 96),
                name=clean_text(_require(raw, "name", str, "hello device"), 96),
                total_bytes=_count(raw, "total_bytes", "hello device"),
                # Optional (an agent before 0.x, or torch without PCI numbers, leaves it out);
                # anything but an address is ignored rather than refused.
                pci_bus_id=canonical_pci_bus_id(raw.get("pci_bus_id")),
            )
        )
    known = {
        "protocol",
        "pid",
        "argv",
        "python",
        "torch",
        "allocator_conf",
        "devices",
        "allocator_settings",
    }
    return AgentHello(
        protocol=protocol,
        pid=pid,
        argv=tuple(clean_text(a) for a in argv),
        python=clean_text(python, 200),
        torch=None if torch_version is None else clean_text(torch_version, 200),
        allocator_conf=clean_text(conf, 1000),
        devices=tuple(devices),
        extra={clean_text(k, 100): clean_value(v) for k, v in result.items() if k not in known},
        allocator_settings=_settings(result, "hello"),
    )


def _settings(result: Mapping[str, Any], where: str) -> str | None:
    """The optional `allocator_settings` (the option string in force), cleaned; None where the
    agent does not say."""
    value = _optional(result, "allocator_settings", str, where)
    return None if value is None else clean_text(value, 1000)


def _finite(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = float(_require(obj, key, (int, float), where))
    if not math.isfinite(value):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} is not a finite number")
    return value


def _marks_from_columns(columns: object) -> StepMarks:
    """The step marks of `sample`'s columns, each column checked whole and kept as a column of
    machine numbers (model.StepMarks): no object per mark.

    A first sample holds up to a thousand marks per agent (MARK_WINDOW), which the store appends
    to its rings: a record, a mapping and a float per mark were ~90 bytes each, 1 MB for the
    mixed demo's 11 agents, held at once in the dashboard's first round (its heap's high-water
    mark, which CPython does not give back); columns are 8 bytes a figure, and the checks run
    over each column in C (`set(map(type, …))`, `array`, `min`), not a Python test per value."""
    where = "sample step_mark_columns"
    if not isinstance(columns, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object")
    steps = _require(columns, "step", list, where)
    times = _require(columns, "time", list, where)
    allocated = _require(columns, "allocated_bytes", dict, where)
    count = len(_bounded(steps, MAX_MARKS, where))
    if len(times) != count or len(allocated) > MAX_DEVICES:
        raise ProtocolError("bad_reply", f"{where}: columns of different lengths")
    per_device: dict[int, array[int]] = {}
    for key, values in allocated.items():
        if not _index(key) or not isinstance(values, list) or len(values) != count:
            raise ProtocolError("bad_reply", f"{where}: bad 'allocated_bytes'")
        per_device[int(key)] = _byte_column(values, f"{where}: bad 'allocated_bytes'")
    try:
        # (a bool, a float, a str, null: not an int; beyond int64: not a step)
        if not set(map(type, steps)) <= {int}:
            raise TypeError
        step_column = array("q", steps)
    except (TypeError, OverflowError):
        raise ProtocolError("bad_reply", f"{where}: 'step' must hold ints") from None
    try:
        if not set(map(type, times)) <= {int, float}:
            raise TypeError
        time_column = array("d", times)
    except (TypeError, OverflowError):
        time_column = None
    if time_column is None or not all(map(math.isfinite, time_column)):
        raise ProtocolError("bad_reply", f"{where}: 'time' must hold finite numbers")
    # The optional host memory columns (agents before them, or off Linux, send none).
    host = {}
    for key in ("host_rss_bytes", "host_heap_free_bytes"):
        column = _optional_column(columns, key, count, where)
        host[key] = _byte_column(column, f"{where}: bad {key!r}") if column else None
    return StepMarks(
        step_column,
        time_column,
        dict(sorted(per_device.items())),
        host["host_rss_bytes"],
        host["host_heap_free_bytes"],
    )


def _byte_column(values: list[Any], problem: str) -> array[int]:
    """A column of optional byte counts (ints >= 0, or null) as int64, MISSING_FIGURE for a
    null; ProtocolError(`problem`) for anything else (a bool, a float, a negative, a count
    beyond int64: 8 EiB)."""
    kinds = set(map(type, values))
    if not kinds <= {int, type(None)}:
        raise ProtocolError("bad_reply", problem)
    nulls = values.count(None) if type(None) in kinds else 0
    if nulls:
        values = [MISSING_FIGURE if v is None else v for v in values]
    try:
        column = array("q", values)
    except OverflowError:
        raise ProtocolError("bad_reply", problem) from None
    lowest = min(column, default=0)
    # No negative but the nulls' stand-ins.
    if lowest < 0 and (lowest < MISSING_FIGURE or column.count(MISSING_FIGURE) != nulls):
        raise ProtocolError("bad_reply", problem)
    return column


def _integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _byte_count(value: object) -> bool:
    """An int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional_column(columns: dict[str, Any], key: str, count: int, where: str) -> list[Any]:
    column = columns.get(key)
    if column is not None and (not isinstance(column, list) or len(column) != count):
        raise ProtocolError("bad_reply", f"{where}: bad {key!r}")
    return column or []


def _mark_bytes(value: object, key: str, where: str) -> int | None:
    """An optional byte count of a step mark: None, or an int >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError("bad_reply", f"{where}: bad {key!r}")
    return value


def _host_memory(raw: object) -> HostMemory | None:
    """`sample`'s optional `host_memory` block: the process's RSS, its high-water mark and the
    machine's memory, in bytes (an agent without it, or off Linux, sends none)."""
    if raw is None:
        return None
    where = "sample host_memory"
    if not isinstance(raw, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object")
    total = _optional(raw, "total_bytes", int, where)
    if total is not None and total < 0:
        raise ProtocolError("bad_reply", f"{where}: field 'total_bytes' is negative")
    return HostMemory(
        rss_bytes=_count(raw, "rss_bytes", where),
        peak_rss_bytes=_count(raw, "peak_rss_bytes", where),
        total_bytes=total,
    )


def _floor_reading(raw: dict[str, Any]) -> dict[str, int]:
    """A sample device's optional floor reading (docs/protocol.md): `allocated_floor_bytes` and
    `floor_readings`, both counts (readings ≥ 1), or neither: a pair that is not is left out,
    as an agent without them is read."""
    floor, reads = raw.get("allocated_floor_bytes"), raw.get("floor_readings")
    if _whole(floor) and _whole(reads) and reads >= 1:
        return {"allocated_floor": floor, "floor_readings": reads}
    return {}


# Stat names as clean_text makes them, by the name an agent sent: every agent sends the same
# ~15 names for each device every second.  Bounded: an agent minting names empties it.
_STAT_NAMES: dict[str, str] = {}
_STAT_NAMES_KEPT = 4096
_INT64_LOW, _INT64_HIGH = -(1 << 63), (1 << 63) - 1


def _stats(stats: dict[str, Any]) -> dict[str, int]:
    """A sample device's `stats`: the finite numbers (as ints) by their cleaned names; anything
    else (a bool, a string, null) left out."""
    kept = {}
    names = _STAT_NAMES
    for key, value in stats.items():
        kind = type(value)
        if kind is int:
            if not _INT64_LOW <= value <= _INT64_HIGH:
                continue  # no count is; the store's float() of one beyond a double raises
        elif kind is float and math.isfinite(value):
            value = int(value)
        else:
            continue  # a bool (JSON makes no subclass of int or float), a string, null
        name = names.get(key)
        if name is None:
            if len(names) >= _STAT_NAMES_KEPT:
                names.clear()
            name = names[key] = clean_text(key, 200)
        kept[name] = value
    return kept


def parse_sample(result: Mapping[str, Any]) -> AgentSample:
    """Validate a `sample` result against the wire schema and turn it into an AgentSample.

    The shape is checked here (types, bounds, no negative sizes); whether the numbers make sense
    together (allocated <= reserved <= total, counters that only grow) is the viewer's call, see
    memtop.sources.agents.
    """
    when = _finite(result, "time", "sample")
    step = result.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ProtocolError("bad_reply", "sample: field 'step' must be an integer or null")
    devices = []
    for raw in _bounded(_require(result, "devices", list, "sample"), MAX_DEVICES, "sample devices"):
        if not isinstance(raw, dict):
            raise ProtocolError("bad_reply", "sample: each device must be an object")
        stats = _require(raw, "stats", dict, "sample device")
        if len(stats) > MAX_STATS:
            raise ProtocolError("bad_reply", f"sample: more than {MAX_STATS} stats")
        devices.append(
            AgentDeviceSample(
                index=_count(raw, "index", "sample device"),
                stats=_stats(stats),
                free_bytes=_count(raw, "free_bytes", "sample device"),
                total_bytes=_count(raw, "total_bytes", "sample device"),
                **_floor_reading(raw),
            )
        )
    columns = result.get("step_mark_columns")
    by_columns = NO_STEP_MARKS if columns is None else _marks_from_columns(columns)
    marks: list[StepMark] = []  # of rows (an agent that predates the columns layout)
    raw_marks = result.get("step_marks") or []
    if not isinstance(raw_marks, list):
        raise ProtocolError("bad_reply", "sample: 'step_marks' must be a list")
    for raw in _bounded(raw_marks, MAX_MARKS, "sample step_marks"):
        if not isinstance(raw, dict):
            raise ProtocolError("bad_reply", "sample: each step mark must be an object")
        allocated = _require(raw, "allocated_bytes", dict, "step mark")
        if len(allocated) > MAX_DEVICES:
            raise ProtocolError("bad_reply", "step mark: too many devices")
        per_device = {}
        for k, v in allocated.items():
            if not _index(k) or isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ProtocolError("bad_reply", "step mark: bad 'allocated_bytes'")
            per_device[int(k)] = v
        marks.append(
            StepMark(
                step=_require(raw, "step", int, "step mark"),
                time=_finite(raw, "time", "step mark"),
                allocated=per_device,
                # The host memory figures (memtop.agent.host_memory): optional.
                host_rss=_mark_bytes(raw.get("host_rss_bytes"), "host_rss_bytes", "step mark"),
                host_heap_free=_mark_bytes(
                    raw.get("host_heap_free_bytes"), "host_heap_free_bytes", "step mark"
                ),
            )
        )
    oom = result.get("oom")
    return AgentSample(
        time=when,
        step=step,
        devices=tuple(devices),
        step_marks=StepMarks.of([*by_columns, *marks]) if marks else by_columns,
        oom=clean_value(oom) if isinstance(oom, dict) and oom.get("ooms") else None,
        host_memory=_host_memory(result.get("host_memory")),
        allocator_settings=_settings(result, "sample"),
        actions=_actions(result.get("actions")),
    )


MAX_ACTIONS = 256  # entries of the action log in one sample (an agent keeps ~120)
MAX_ACTION_ARGS = 8  # arguments (and keys of a nested one) kept of an action
ACTION_TEXT = 300


def _actions(raw: object) -> tuple[ActionRecord, ...]:
    """`sample`'s optional `actions` (DESIGN §13): the agent's action log entries, each checked
    and cleaned; an entry of the wrong shape is left out (the rest of the sample stands)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ProtocolError("bad_reply", "sample: 'actions' must be a list")
    found = []
    for entry in _bounded(raw, MAX_ACTIONS, "sample actions"):
        action = _action(entry)
        if action is not None:
            found.append(action)
    return tuple(found)


def _action(entry: object) -> ActionRecord | None:
    if not isinstance(entry, dict):
        return None
    cmd, when, seq = entry.get("cmd"), entry.get("time"), entry.get("seq")
    step, by = entry.get("step"), entry.get("by")
    result = entry.get("result")
    if (
        not isinstance(cmd, str)
        or isinstance(when, bool)
        or not isinstance(when, int | float)
        or not math.isfinite(when)
        or not _whole(seq)
        or (step is not None and not _whole(step))
        or not isinstance(by, dict)
        or result not in (ACTION_OK, ACTION_REFUSED)
    ):
        return None
    uid, pid = by.get("uid"), by.get("pid")
    if (uid is not None and not _whole(uid)) or (pid is not None and not _whole(pid)):
        return None
    why = entry.get("why")
    args = entry.get("args")
    return ActionRecord(
        kind=clean_text(cmd, 40),
        time=float(when),
        pid=0,
        args=_small(args) if isinstance(args, dict) else {},
        by_uid=uid,
        by_pid=pid,
        result=result,
        why=clean_text(why, ACTION_TEXT) if isinstance(why, str) else None,
        step=step,
        seq=seq,
        source=ACTION_FROM_AGENT,
        before=_action_figures(entry.get("devices")),
    )


ACTION_FIGURE_NAMES = ("reserved_bytes", "split_bytes", "num_alloc_retries", "num_ooms")


def _action_figures(raw: object) -> dict[int, dict[str, int]]:
    """An action entry's optional `devices`: per device index, the counters read right before
    it; anything not a count is left out."""
    if not isinstance(raw, dict) or len(raw) > MAX_DEVICES:
        return {}
    figures = {}
    for key, values in raw.items():
        if _index(key) and isinstance(values, dict):
            figures[int(key)] = {
                name: values[name] for name in ACTION_FIGURE_NAMES if _whole(values.get(name))
            }
    return figures


def _whole(value: object) -> TypeGuard[int]:
    """An int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _small(raw: Mapping[str, Any], depth: int = 0) -> dict[str, Any]:
    """An action's arguments, cleaned and bounded: at most MAX_ACTION_ARGS keys, two levels,
    strings cut, only numbers, booleans, strings and null kept as values."""
    kept: dict[str, Any] = {}
    for key, value in list(raw.items())[:MAX_ACTION_ARGS]:
        if isinstance(value, dict) and depth < 1:
            kept[clean_text(key, 64)] = _small(value, depth + 1)
        elif isinstance(value, str):
            kept[clean_text(key, 64)] = clean_text(value, ACTION_TEXT)
        elif (
            value is None
            or isinstance(value, bool | int)
            or (isinstance(value, float) and math.isfinite(value))
        ):
            kept[clean_text(key, 64)] = value
    return kept


def _optional(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in _as_tuple(kind):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} has the wrong type")
    if not isinstance(value, kind):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} has the wrong type")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError("bad_reply", f"{where}: field {key!r} is not a finite number")
    return value


def _index(key: object) -> bool:
    """A device-index key: ASCII digits only."""
    return isinstance(key, str) and decimal(key) is not None


def _device_map(raw: Any, where: str, numbers: type | tuple[type, ...] = int) -> dict[int, Any]:
    """`{"<index>": value}` with digit keys, at most MAX_DEVICES of them."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object keyed by device index")
    if len(raw) > MAX_DEVICES:
        raise ProtocolError("bad_reply", f"{where}: more than {MAX_DEVICES} devices")
    out: dict[int, Any] = {}
    for key, value in raw.items():
        if not _index(key):
            raise ProtocolError("bad_reply", f"{where}: device key {clean_text(key, 20)!r}")
        if isinstance(value, bool) or not isinstance(value, numbers):
            raise ProtocolError("bad_reply", f"{where}: device {key} has the wrong type")
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError("bad_reply", f"{where}: device {key} is not finite")
        out[int(key)] = value
    return out


def _figures(raw: Any, where: str) -> dict[str, Any]:
    """A flat object of named numbers (bytes, counts, ratios); other values are left out."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_reply", f"{where}: must be an object")
    if len(raw) > MAX_STATS:
        raise ProtocolError("bad_reply", f"{where}: more than {MAX_STATS} fields")
    return {
        clean_text(k, 100): v
        for k, v in raw.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def parse_breakdown(result: Mapping[str, Any]) -> AgentBreakdown:
    """Validate a `breakdown` result: `{"time", "step", "devices": {"<index>": {role: bytes}}}`
    (`"pending": true` while the trainer's next step boundary has not measured it)."""
    pending = result.get("pending") is True
    devices = {}
    for index, parts in _device_map(result.get("devices", {}), "breakdown devices", dict).items():
        figures = _figures(parts, "breakdown device")
        if any(isinstance(v, float) or v < 0 for v in figures.values()):
            raise ProtocolError("bad_reply", "breakdown: bytes must be integers >= 0")
        devices[index] = figures
    measured = _optional(result, "measured", str, "breakdown")
    return AgentBreakdown(
        time=_optional(result, "time", (int, float), "breakdown"),
        step=_optional(result, "step", int, "breakdown"),
        pending=pending,
        devices=devices,
        measured=None if measured is None else clean_text(measured, 40),
    )


def parse_snapshot(result: Mapping[str, Any]) -> AgentSnapshot:
    """Validate a `snapshot` result: the per-device summary (segments, reserved, allocated,
    fragmentation figures, DESIGN §4) and, when a file was asked for, its path and size."""
    devices = {
        index: _figures(summary, "snapshot device")
        for index, summary in _device_map(
            result.get("devices", {}), "snapshot devices", dict
        ).items()
    }
    path = _optional(result, "path", str, "snapshot")
    size = _optional(result, "bytes", int, "snapshot")
    if size is not None and size < 0:
        raise ProtocolError("bad_reply", "snapshot: 'bytes' must be >= 0")
    return AgentSnapshot(
        time=_optional(result, "time", (int, float), "snapshot"),
        pending=result.get("pending") is True,
        devices=devices,
        path=None if path is None else clean_text(path, 4096),
        bytes=size,
    )


def parse_cleanup(result: Mapping[str, Any]) -> AgentCleanup:
    """Validate a `cleanup` result: bytes released / reserved before and after, per device."""
    released = _device_map(result.get("released_bytes", {}), "cleanup released_bytes")
    if any(v < 0 for v in released.values()):
        raise ProtocolError("bad_reply", "cleanup: released bytes must be >= 0")
    return AgentCleanup(
        released_bytes=released,
        reserved_before=_device_map(result.get("reserved_before", {}), "cleanup reserved_before"),
        reserved_after=_device_map(result.get("reserved_after", {}), "cleanup reserved_after"),
        gc_collected=_optional(result, "gc_collected", int, "cleanup"),
        at_step_boundary=result.get("at_step_boundary") is True,
        after_step=_optional(result, "after_step", int, "cleanup"),
        took_s=_optional(result, "took_s", (int, float), "cleanup"),
    )


def parse_tune(result: Mapping[str, Any]) -> AgentTune:
    """Validate a `tune` result: the option strings before and after, the keys changed, the
    step it ran after, and with the cache emptied the reserved bytes per device around it."""
    changed = _require(result, "changed", dict, "tune")
    if len(changed) > 16 or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in changed.items()
    ):
        raise ProtocolError("bad_reply", "tune: 'changed' must map option names to strings")
    return AgentTune(
        before=clean_text(_require(result, "before", str, "tune"), 1000),
        after=clean_text(_require(result, "after", str, "tune"), 1000),
        changed={clean_text(k, 100): clean_text(v, 100) for k, v in changed.items()},
        at_step_boundary=result.get("at_step_boundary") is True,
        after_step=_optional(result, "after_step", int, "tune"),
        took_s=_optional(result, "took_s", (int, float), "tune"),
        reserved_before=_device_map(result.get("reserved_before", {}), "tune reserved_before"),
        reserved_after=_device_map(result.get("reserved_after", {}), "tune reserved_after"),
    )


def parse_reset_peak(result: Mapping[str, Any]) -> AgentResetPeak:
    """Validate a `reset_peak` result: `{"devices": [index, ...]}`."""
    raw = _bounded(_require(result, "devices", list, "reset_peak"), MAX_DEVICES, "reset_peak")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in raw):
        raise ProtocolError("bad_reply", "reset_peak: devices must be indices >= 0")
    return AgentResetPeak(devices=tuple(raw))


MAX_SITES = 1024
MAX_SITES_HISTORY = 64  # past rounds in one reply (the agent keeps 24)
MAX_SITES_HISTORY_ENTRIES = 8192  # their entries, all together


def parse_sites(result: Mapping[str, Any]) -> AgentSites:
    """Validate a `sites` result (DESIGN §12): `{"enabled": bool, "time", "step", "sites":
    [{"device", "site": {"file", "line", "function", "text"}, "bytes", "blocks",
    "old_blocks"}]}`; every string cleaned, every number a count.  An optional `history`
    (DESIGN §13) lists past rounds, oldest first, each `{"time", "step", "sites"}` as above;
    an agent that predates it sends none, and the reply reads as before."""
    enabled = _require(result, "enabled", bool, "sites")
    history: list[AgentSites] = []
    raw_history = result.get("history")
    if raw_history is not None:
        if not isinstance(raw_history, list):
            raise ProtocolError("bad_reply", "sites: 'history' must be a list")
        for past in _bounded(raw_history, MAX_SITES_HISTORY, "sites history"):
            if not isinstance(past, Mapping):
                raise ProtocolError("bad_reply", "sites: a history round is not an object")
            if _optional(past, "time", (int, float), "sites history") is None:
                raise ProtocolError("bad_reply", "sites: a history round without its time")
            history.append(_parse_sites_round(past, enabled=True))
        if sum(len(r.sites) for r in history) > MAX_SITES_HISTORY_ENTRIES:
            raise ProtocolError("bad_reply", "sites: more history entries than a trend needs")
    current = _parse_sites_round(result, enabled)
    if not history:
        return current
    return dataclasses.replace(current, history=tuple(history))


def _parse_sites_round(result: Mapping[str, Any], enabled: bool) -> AgentSites:
    """One round of a `sites` result: its time, step and entries."""
    raw = _bounded(_require(result, "sites", list, "sites"), MAX_SITES, "sites")
    entries = []
    for item in raw:
        if not isinstance(item, Mapping):
            raise ProtocolError("bad_reply", "sites: an entry is not an object")
        site = _require(item, "site", Mapping, "sites entry")
        counts = [
            _require(item, key, int, "sites entry")
            for key in ("device", "bytes", "blocks", "old_blocks")
        ]
        line = _require(site, "line", int, "site")
        if min([*counts, line]) < 0 or counts[3] > counts[2]:
            raise ProtocolError(
                "bad_reply", "sites: a negative count or more old blocks than blocks"
            )
        entries.append(
            SiteUsage(
                device=counts[0],
                site=Site(
                    file=clean_text(_require(site, "file", str, "site"), 1000),
                    line=line,
                    function=clean_text(_require(site, "function", str, "site"), 200),
                    text=clean_text(_require(site, "text", str, "site"), 400),
                ),
                bytes=counts[1],
                blocks=counts[2],
                old_blocks=counts[3],
            )
        )
    when = _optional(result, "time", (int, float), "sites")
    return AgentSites(
        enabled=enabled,
        time=None if when is None else float(when),
        step=_optional(result, "step", int, "sites"),
        sites=tuple(entries),
        wanted=_optional(result, "wanted", bool, "sites") is True,
    )


REPLY_PARSERS = {
    "hello": parse_hello,
    "sample": parse_sample,
    "breakdown": parse_breakdown,
    "snapshot": parse_snapshot,
    "cleanup": parse_cleanup,
    "reset_peak": parse_reset_peak,
    "sites": parse_sites,
    "tune": parse_tune,
}


def parse_reply(cmd: str, result: Mapping[str, Any]) -> Any:
    """The typed model object of any command's result (ProtocolError if it breaks the schema)."""
    if not isinstance(result, Mapping):
        raise ProtocolError("bad_reply", f"{cmd}: the result must be an object")
    return REPLY_PARSERS[cmd](result)
