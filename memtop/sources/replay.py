"""Replay: what the sampler once read, as a source.

A recording is read into one time-ordered list of `ReplayEvent`s, each a thing the sampler read
live: a driver reading, a process list, an agent's `hello` / `sample` / `breakdown` / `snapshot`
reply (parsed and checked by the same protocol code as a live reply), or an agent going away.
`memtop.playback` writes them into a store through the sampler's own store calls, so the
observation and the diagnosis cannot tell a replay from a live run.

Two kinds of recording are read:
- a `memtop record` file (memtop.sources.recording: header line, then lines with `src`);
- agent wire recordings (`shared/traces`): one gzip'd JSON-lines file per agent, lines
  `{"t", "cmd", "reply": {"id", "result"}}`, `{"t", "error"}` when the trainer died; a folder
  of them plays every agent together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memtop import protocol
from memtop.model import AgentDevice, AgentHello, AgentSample, AgentStatus
from memtop.protocol import commands
from memtop.sources.recording import (
    LineTally,
    RecordError,
    decode_processes,
    decode_reading,
    read_lines,
)

# The commands whose replies a recording keeps (memtop.protocol.commands): sites too, which this
# list, kept by hand, once dropped.
AGENT_COMMANDS = commands.RECORDED
# Times a clock can show (time.localtime of t=1e308 raised OverflowError): year 1970 to 9999.
LATEST_TIME = 253_402_300_799.0
RECORDING_SUFFIXES = (".memtop", ".jsonl.gz", ".jsonl", ".gz")


@dataclass(frozen=True, slots=True)
class ReplayEvent:
    t: float
    kind: str  # "nvml", "processes", "state", or a recorded command: "hello", "sample", …
    pid: int | None = None
    # DriverReading | dict[int, ProcessInfo] | AgentHello | AgentSample | reply dict |
    # (AgentStatus, error)
    value: Any = None


@dataclass(slots=True)
class Recording:
    events: list[ReplayEvent]
    files: list[Path]
    kind: str  # "record" (memtop record) or "wire" (agent wire recordings)
    # The first few lines that were skipped, with why (a reply that fails the wire schema, say).
    skipped: list[str] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)
    skipped_count: int = 0  # all of them
    notes: tuple[str, ...] = ()  # one line per file that was not read to its end, and why

    @property
    def start(self) -> float:
        return self.events[0].t if self.events else 0.0

    @property
    def end(self) -> float:
        return self.events[-1].t if self.events else 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def has_devices(self) -> bool:
        return any(e.kind == "nvml" for e in self.events)


def load(path: Path) -> Recording:
    """A record file, one wire recording, or a folder of either; raises RecordError."""
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
    events: list[ReplayEvent] = []
    tally = LineTally()
    kinds = set()
    header: dict[str, Any] = {}
    taken: set[int] = set()
    unread: list[Path] = []
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
            kinds.add("record")
            header = header or first
            mine = list(_record_events(lines, file, tally))
        elif first.get("cmd") == "hello":
            kinds.add("wire")
            mine = list(_wire_events(first, lines, file, tally))
        else:
            raise RecordError(f"{file}: neither a memtop record nor an agent wire recording")
        # Two recordings from different machines may share a pid: keep them apart.
        pids = {e.pid for e in mine if e.pid is not None}
        clash = pids & taken
        if clash:
            shift = (max(taken | pids) // 1_000_000 + 1) * 1_000_000
            mine = [_shift_pid(e, shift) if e.pid in clash else e for e in mine]
            pids = {e.pid for e in mine if e.pid is not None}
        taken |= pids
        events += mine
    if unread:
        tally.notes.append(
            f"{len(unread)} of the {len(files)} files not read ({unread[0].name}, …): "
            "the ones before hold all one replay reads"
        )
    events.sort(key=lambda e: e.t)
    header = protocol.clean_value(header)
    notes = tuple(protocol.clean_text(note, 300) for note in tally.notes)
    return Recording(
        events, files, "+".join(sorted(kinds)), tally.examples, header, tally.count, notes
    )


def _shift_pid(event: ReplayEvent, shift: int) -> ReplayEvent:
    assert event.pid is not None
    return ReplayEvent(event.t, event.kind, event.pid + shift, event.value)


def _time(line: dict[str, Any]) -> float | None:
    t = line.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t <= LATEST_TIME:
        return None  # NaN fails the comparison too
    return float(t)


def _agent_event(
    t: float, pid: int, cmd: str, result: Any, where: tuple[Path, int], tally: LineTally
) -> ReplayEvent | None:
    if not isinstance(result, dict):
        tally.skip(*where, f"{cmd} without a result")
        return None
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
    first: dict[str, Any], lines: Iterable[dict[str, Any]], file: Path, tally: LineTally
) -> Iterable[ReplayEvent]:
    reply = first.get("reply")
    result = reply.get("result") if isinstance(reply, dict) else None
    pid = result.get("pid") if isinstance(result, dict) else None
    t0 = _time(first)
    if not isinstance(pid, int) or t0 is None:
        raise RecordError(f"{file}: the hello line names no pid or time")
    refused = LineTally()
    event = _agent_event(t0, pid, "hello", result, (file, 1), refused)
    if event is None:
        raise RecordError(f"bad hello ({refused.examples[-1]})")
    yield event
    hello: AgentHello = event.value
    for number, line in enumerate(lines, start=2):
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
        event = _agent_event(t, pid, cmd, reply.get("result"), (file, number), tally)
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
    lines: Iterable[dict[str, Any]], file: Path, tally: LineTally
) -> Iterable[ReplayEvent]:
    for number, line in enumerate(lines, start=2):
        t = _time(line)
        src = line.get("src")
        where = (file, number)
        if t is None:
            tally.skip(file, number, "no time")
            continue
        try:
            if src == "nvml":
                yield ReplayEvent(t, "nvml", None, decode_reading(line["reading"]))
            elif src == "processes":
                yield ReplayEvent(t, "processes", None, decode_processes(line["processes"]))
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
                        event = _agent_event(t, pid, cmd, result, where, tally)
                        if event is not None:
                            yield event
            else:
                tally.skip(file, number, f"unknown src {str(src)[:40]!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a line of wrong shape
            tally.skip(file, number, f"{src}: {type(exc).__name__}: {exc}")
