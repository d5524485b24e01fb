"""Replay: what the sampler once read, as a source.

A recording is read into one time-ordered list of `ReplayEvent`s, each a thing the sampler read
live: a driver reading, a process list, an agent's `hello` / `sample` / `breakdown` / `snapshot`
reply (parsed and checked by the same protocol code as a live reply), or an agent going away.
`memtop.engine.playback` writes them into a store through the sampler's own store calls, so the
observation and the diagnosis cannot tell a replay from a live run.

Two kinds of recording are read:
- a `memtop record` file (memtop.sources.recording: header line, then lines with `src`);
- agent wire recordings (`shared/traces`): one gzip'd JSON-lines file per agent, lines
  `{"t", "cmd", "reply": {"id", "result"}}`, `{"t", "error"}` when the trainer died; a folder
  of them plays every agent together.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memtop import protocol
from memtop.base.records import record
from memtop.model import AgentDevice, AgentHello, AgentSample, AgentStatus
from memtop.protocol import commands
from memtop.sources.recording import (
    LineTally,
    RecordError,
    decode_processes,
    decode_reading,
    read_lines,
    read_marked_lines,
)

# The commands whose replies a recording keeps (memtop.protocol.commands): sites too, which this
# list, kept by hand, once dropped.
AGENT_COMMANDS = commands.RECORDED
# Times a clock can show (time.localtime of t=1e308 raised OverflowError): year 1970 to 9999.
LATEST_TIME = 253_402_300_799.0
RECORDING_SUFFIXES = (".memtop", ".jsonl.gz", ".jsonl", ".gz")


@record(frozen=True, slots=True)
class ReplayEvent:
    t: float
    kind: str  # "nvml", "processes", "state", or a recorded command: "hello", "sample", …
    pid: int | None = None
    # DriverReading | dict[int, ProcessInfo] | AgentHello | AgentSample | reply dict |
    # (AgentStatus, error)
    value: Any = None


# Events a file's stream may hold back to put them in time order: a record file is written as
# things are read, agent replies on worker threads, so its times are in order but for a few
# neighbours (the whole recording was sorted at once before, which held all of it in memory).
REORDER_WINDOW = 1024


@record(frozen=True, slots=True)
class _FileScan:
    """What the first reading of one file found: its kind, how many lines to read of it, and the
    shift for pids another file of the folder holds too."""

    path: Path
    kind: str  # "record" or "wire"
    lines: int
    clash: frozenset[int] = frozenset()
    shift: int = 0
    pids: frozenset[int] = frozenset()  # the pids its events carry, shifted where they clash


class Recording:
    """A recording, read as a stream (a 9 MB gzip of valid lines was 850 MB held as events).

    `load` reads each file once for what a screen shows before playing (its time span, whether
    it holds driver readings, its header, where reading stopped); `stream()` reads the files
    again, parsing each line as the live viewer parses a reply, and yields the events in time
    order: memory stays bounded by a file's reader and the reorder window, whatever the
    recording's length.  `events` (all of them in a list) is for small recordings and tests."""

    def __init__(
        self,
        files: list[Path],
        kind: str,
        *,
        header: dict[str, Any] | None = None,
        start: float = 0.0,
        end: float = 0.0,
        has_devices: bool = False,
        notes: tuple[str, ...] = (),
        scans: tuple[_FileScan, ...] = (),
    ) -> None:
        self.files = files
        self.kind = kind  # "record" (memtop record) or "wire" (agent wire recordings)
        self.header = header or {}
        self.start = start
        self.end = end
        self.has_devices = has_devices
        self.notes = notes  # one line per file that was not read to its end, and why
        self._scans = scans
        self._passed_over: LineTally | None = None  # of the newest stream read to its end

    @property
    def duration(self) -> float:
        return self.end - self.start

    def stream(self, pids: Collection[int] | None = None) -> Iterator[ReplayEvent]:
        """Every event in time order, parsed and checked as the live viewer checks a reply.
        `pids`: only the files that hold events of one of them are read (a folder of one
        recording per trainer: `memtop estimate --from DIR --pid P` parsed every trainer's);
        their other events come too."""
        tally = LineTally()
        scans = [s for s in self._scans if pids is None or not s.pids.isdisjoint(pids)]
        per_file = [_in_time_order(_file_events(scan, tally)) for scan in scans]
        yield from heapq.merge(*per_file, key=_when)
        if pids is None:  # every line read: what was passed over is known
            self._passed_over = tally

    def holds_events(self) -> bool:
        """Whether any line is an event, read only up to the first one: the first event of
        `stream()` is known only once every file's reorder window is read and parsed, which is
        all of a recording under REORDER_WINDOW events a file (`memtop replay --once` parsed it
        once more for the answer)."""
        tally = LineTally()
        return any(next(iter(_file_events(scan, tally)), None) for scan in self._scans)

    @property
    def events(self) -> list[ReplayEvent]:
        return list(self.stream())

    def _tally(self) -> LineTally:
        if self._passed_over is None:
            for _ in self.stream():  # the skipped lines are known once every line was read
                pass
        assert self._passed_over is not None
        return self._passed_over

    @property
    def skipped(self) -> list[str]:
        """The first few lines that were skipped, with why (a reply that fails the wire schema,
        say)."""
        return self._tally().examples

    @property
    def skipped_count(self) -> int:
        return self._tally().count


def _when(event: ReplayEvent) -> float:
    return event.t


def _in_time_order(events: Iterable[ReplayEvent]) -> Iterator[ReplayEvent]:
    """`events` sorted by time within a window of REORDER_WINDOW (ties keep their order)."""
    held: list[tuple[float, int, ReplayEvent]] = []
    for n, event in enumerate(events):
        heapq.heappush(held, (event.t, n, event))
        if len(held) > REORDER_WINDOW:
            yield heapq.heappop(held)[2]
    while held:
        yield heapq.heappop(held)[2]


def _file_events(scan: _FileScan, tally: LineTally) -> Iterator[ReplayEvent]:
    lines = read_marked_lines(scan.path, tally, max_lines=scan.lines)
    first = next(lines, None)
    if first is None:
        return
    if scan.kind == "record":
        events = _record_events(lines, scan.path, tally)
    else:
        events = _wire_events(first, lines, scan.path, tally)
    for event in events:
        yield _shift_pid(event, scan.shift) if event.pid in scan.clash else event


def load(path: Path) -> Recording:
    """A record file, one wire recording, or a folder of either; raises RecordError.  Each file
    is read once here, for its time span and kind (see Recording), and kept nothing of."""
    if path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.is_file() and p.name.endswith(RECORDING_SUFFIXES)
        )
        if not files:
            raise RecordError(f"no recordings in {path} (*.memtop, *.jsonl.gz)")
    elif path.exists():
        files = [path]
    else:
        raise RecordError(f"no such file or directory: {path}")
    tally = LineTally()
    kinds = set()
    header: dict[str, Any] = {}
    taken: set[int] = set()
    unread: list[Path] = []
    scans: list[_FileScan] = []
    start, end, has_devices = math.inf, -math.inf, False
    for index, file in enumerate(files):
        if tally.exhausted:  # a folder of many: the caps hold for all of them together
            unread = files[index:]
            break
        lines = read_lines(file, tally)
        first = next(lines, None)
        if first is None:
            raise RecordError(f"{file}: empty")
        if "memtop_record" in first:
            if first["memtop_record"] != 1:
                raise RecordError(f"{file}: record format {first['memtop_record']!r} is newer")
            kind = "record"
            header = header or first
            span = _record_span(lines)
        elif first.get("cmd") == "hello":
            kind = "wire"
            span = _wire_span(first, lines, file)
        else:
            raise RecordError(f"{file}: neither a memtop record nor an agent wire recording")
        kinds.add(kind)
        if span.start is not None and span.end is not None:
            start, end = min(start, span.start), max(end, span.end)
        has_devices = has_devices or span.driver
        # Two recordings from different machines may share a pid: keep them apart.
        clash = span.pids & taken
        shift = (max(taken | span.pids) // 1_000_000 + 1) * 1_000_000 if clash else 0
        taken |= span.pids if not clash else {p + shift if p in clash else p for p in span.pids}
        pids = frozenset(p + shift if p in clash else p for p in span.pids)
        scans.append(_FileScan(file, kind, tally.file_lines, frozenset(clash), shift, pids))
    if unread:
        tally.notes.append(
            f"{len(unread)} of the {len(files)} files not read ({unread[0].name}, …): "
            "the ones before hold all one replay reads"
        )
    if start > end:
        start = end = 0.0
    return Recording(
        files,
        "+".join(sorted(kinds)),
        header=protocol.clean_value(header),
        start=start,
        end=end,
        has_devices=has_devices,
        notes=tuple(protocol.clean_text(note, 300) for note in tally.notes),
        scans=tuple(scans),
    )


@dataclass(slots=True)
class _Span:
    """The first reading of one file: the times of the lines that can be events, the pids, and
    whether it holds driver readings (parsing each reply waits for `Recording.stream`)."""

    start: float | None = None
    end: float | None = None
    pids: set[int] = field(default_factory=set)
    driver: bool = False

    def add(self, t: float) -> None:
        self.start = t if self.start is None else min(self.start, t)
        self.end = t if self.end is None else max(self.end, t)


def _record_span(lines: Iterable[dict[str, Any]]) -> _Span:
    span = _Span()
    for line in lines:
        t = _time(line)
        src = line.get("src")
        if t is None:
            continue
        if src in ("nvml", "processes"):
            span.add(t)
            span.driver = span.driver or src == "nvml"
        elif src == "agent":
            pid = line.get("pid")
            event = "state" in line or line.get("cmd") in AGENT_COMMANDS
            if isinstance(pid, int) and not isinstance(pid, bool) and event:
                span.add(t)
                span.pids.add(pid)
    return span


def _wire_span(first: dict[str, Any], lines: Iterable[dict[str, Any]], file: Path) -> _Span:
    reply = first.get("reply")
    result = reply.get("result") if isinstance(reply, dict) else None
    pid = result.get("pid") if isinstance(result, dict) else None
    t0 = _time(first)
    if not isinstance(pid, int) or t0 is None:
        raise RecordError(f"{file}: the hello line names no pid or time")
    refused = LineTally()
    if _agent_event(t0, pid, "hello", result, (file, 1), refused) is None:
        raise RecordError(f"bad hello ({refused.examples[-1]})")
    span = _Span(pids={pid})
    span.add(t0)
    for line in lines:
        t = _time(line)
        if t is None:
            continue
        if "error" in line and "cmd" not in line:
            span.add(t)
        else:
            answer = line.get("reply")
            replied = isinstance(answer, dict) and "error" not in answer
            if line.get("cmd") in AGENT_COMMANDS and replied:
                span.add(t)
    return span


def _shift_pid(event: ReplayEvent, shift: int) -> ReplayEvent:
    assert event.pid is not None
    return ReplayEvent(event.t, event.kind, event.pid + shift, event.value)


def _time(line: dict[str, Any]) -> float | None:
    t = line.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t <= LATEST_TIME:
        return None  # NaN fails the comparison too
    return float(t)


def _agent_event(
    t: float,
    pid: int,
    cmd: str,
    result: Any,
    where: tuple[Path, int],
    tally: LineTally,
    inert: bool = False,
) -> ReplayEvent | None:
    """`inert`: every string of the line is clean as it is (read_marked_lines), as the live
    client knows of a frame: the walk that cleans them would change nothing."""
    if not isinstance(result, dict):
        tally.skip(*where, f"{cmd} without a result")
        return None
    if not inert:
        result = protocol.clean_value(result)  # as the live client does to every reply
    try:
        if cmd == "hello":
            hello: AgentHello = protocol.parse_hello(result)
            return ReplayEvent(t, "hello", pid, hello)
        if cmd == "sample":
            sample: AgentSample = protocol.parse_sample(result)
            return ReplayEvent(t, "sample", pid, sample)
        if cmd in AGENT_COMMANDS:
            # Parsed here, at load, as the live pool parses them: a reply that breaks the
            # schema is one skipped line, never an error in the middle of playback.
            reply = protocol.parse_reply(cmd, result)
            return None if reply.pending else ReplayEvent(t, cmd, pid, reply)
    except protocol.ProtocolError as exc:
        tally.skip(*where, f"{cmd}: {exc}")
        return None
    except (TypeError, ValueError, AttributeError) as exc:  # a key like "²" that isdigit()
        tally.skip(*where, f"{cmd}: {type(exc).__name__}")
        return None
    return None


def _wire_events(
    marked_first: tuple[dict[str, Any], bool],
    lines: Iterable[tuple[dict[str, Any], bool]],
    file: Path,
    tally: LineTally,
) -> Iterable[ReplayEvent]:
    first, first_inert = marked_first
    reply = first.get("reply")
    result = reply.get("result") if isinstance(reply, dict) else None
    pid = result.get("pid") if isinstance(result, dict) else None
    t0 = _time(first)
    if not isinstance(pid, int) or t0 is None:
        raise RecordError(f"{file}: the hello line names no pid or time")
    refused = LineTally()
    event = _agent_event(t0, pid, "hello", result, (file, 1), refused, first_inert)
    if event is None:
        raise RecordError(f"bad hello ({refused.examples[-1]})")
    yield event
    hello: AgentHello = event.value
    for number, (line, inert) in enumerate(lines, start=2):
        t = _time(line)
        if t is None:
            tally.skip(file, number, "no time")
            continue
        if "error" in line and "cmd" not in line:
            error = protocol.clean_text(line["error"], 300)
            yield ReplayEvent(t, "state", pid, (AgentStatus.EXITED, error))
            continue
        cmd = line.get("cmd")
        reply = line.get("reply")
        if cmd not in AGENT_COMMANDS or not isinstance(reply, dict):
            continue
        if "error" in reply:
            continue  # a refused or failed request: the live viewer keeps nothing of it either
        event = _agent_event(t, pid, cmd, reply.get("result"), (file, number), tally, inert)
        if event is None:
            continue
        if event.kind == "sample":
            # A trainer that initialised CUDA after its agent said hello: the live viewer asks
            # for hello again; a wire recording has the one hello, so the devices its samples
            # describe (index, uuid, name, total) are added to it here.
            renewed = _hello_with_sampled_devices(hello, reply["result"])
            if renewed is not None:
                hello = renewed
                yield ReplayEvent(t, "hello", pid, hello)
        yield event


def _hello_with_sampled_devices(hello: AgentHello, result: dict[str, Any]) -> AgentHello | None:
    listed = {d.index for d in hello.devices}
    added = []
    for raw in result.get("devices") or ():
        index, uuid = raw.get("index"), raw.get("uuid")
        if not isinstance(index, int) or index in listed or not isinstance(uuid, str):
            continue
        name = protocol.clean_text(str(raw.get("name") or f"cuda:{index}"))
        total = raw.get("total_bytes")
        if isinstance(total, int):
            added.append(AgentDevice(index, protocol.clean_text(uuid), name, total))
            listed.add(index)
    if not added:
        return None
    return dataclasses.replace(hello, devices=(*hello.devices, *added))


def _record_events(
    lines: Iterable[tuple[dict[str, Any], bool]], file: Path, tally: LineTally
) -> Iterable[ReplayEvent]:
    for number, (line, inert) in enumerate(lines, start=2):
        t = _time(line)
        src = line.get("src")
        where = (file, number)
        if t is None:
            tally.skip(file, number, "no time")
            continue
        try:
            if src == "nvml":
                reading = decode_reading(line["reading"], inert=inert)
                yield ReplayEvent(t, "nvml", None, reading)
            elif src == "processes":
                processes = decode_processes(line["processes"], inert=inert)
                yield ReplayEvent(t, "processes", None, processes)
            elif src == "agent":
                pid = line.get("pid")
                if not isinstance(pid, int):
                    tally.skip(file, number, "agent line without a pid")
                elif "state" in line:
                    state = AgentStatus(line["state"])
                    error = line.get("error")
                    error = None if error is None else protocol.clean_text(error, 300)
                    yield ReplayEvent(t, "state", pid, (state, error))
                else:
                    cmd = line.get("cmd")
                    result = (line.get("reply") or {}).get("result")
                    if cmd in AGENT_COMMANDS:
                        event = _agent_event(t, pid, cmd, result, where, tally, inert)
                        if event is not None:
                            yield event
            else:
                tally.skip(file, number, f"unknown src {str(src)[:40]!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a line of wrong shape
            tally.skip(file, number, f"{src}: {type(exc).__name__}: {exc}")
