"""The agent protocol's closed command set (DESIGN §6), one record per command: its name, the
arguments the agent reads, how the viewer asks it, whether it changes the trainer, its cooldown
in the agent, and whether a recording keeps its replies.

Both sides read it, so it is standard library only (the agent loads it inside the trainer).
What else a command is lives beside its kind, each keyed by the name here (tests check that
every table holds exactly these names):

- its reply builder: memtop.protocol.replies (the agent's side, standard library only);
- its parser into a typed record of memtop.model: memtop.protocol.schema.REPLY_PARSERS;
- its handler: memtop.agent.handlers.HANDLERS (the agent serves those names, nothing else);
- its use: the agent pool's polling (the LOW_RATE ones, memtop.engine.sampler), the replay (the
  RECORDED ones, memtop.sources.replay), the conformance check (memtop.protocol.check), a key
  (memtop.ui.actions names the command it sends).

A new command is its record here, its builder and parser, its handler, and its use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any

from memtop.base.records import record

# How the viewer asks a command.
ON_CONNECT = "on connect"  # hello: on connecting, and again when the trainer's devices change
EVERY_ROUND = "every round"  # sample
LOW_RATE = "low rate"  # at its own interval (viewer_every_s), a few agents at a time
ON_KEY = "on a key"  # only when the user asks (a key; `memtop cleanup`, `memtop snapshot`)


@record(frozen=True, slots=True)
class Command:
    """One command the agent serves: its arguments, when the viewer asks it, what it answers."""

    name: str
    # Each argument the agent reads → what it takes, in words (the handler checks it and
    # answers bad_request otherwise).
    args: Mapping[str, str]
    asked: str  # ON_CONNECT, EVERY_ROUND, LOW_RATE or ON_KEY
    what: str  # what it answers, in a line
    viewer_every_s: float | None = None  # LOW_RATE: how often the viewer asks by default
    # It changes the trainer whatever its arguments (cleanup, reset_peak) ...
    changes_trainer: bool = False
    # ... or with any of these arguments (a snapshot written to a file, stacks switched).
    acting_args: tuple[str, ...] = ()
    # Served from work on the trainer's thread at a step boundary (DESIGN §6): its reply may
    # wait for the next step, up to its wait_s.
    trainer_thread: bool = False
    # The agent refuses it again (rate_limited) for this long after it ran; longer when it
    # cost more (memtop.agent.handlers.Cooldown).  None: no cooldown of its own.
    cooldown_s: float | None = None
    # `memtop record` keeps its replies and `memtop replay` plays them back.
    recorded: bool = False
    # The wire schema's required fields of its reply, where DESIGN §6 fixes them.
    required: tuple[str, ...] = field(default=())

    def acts(self, args: Mapping[str, Any] | None = None) -> bool:
        """Whether asking it with `args` changes the trainer (never under --readonly)."""
        return self.changes_trainer or any(a in (args or {}) for a in self.acting_args)


WAIT_S = "seconds >= 0 to wait for the trainer's next step (at most 60)"

COMMANDS: tuple[Command, ...] = (
    Command(
        "hello",
        {},
        ON_CONNECT,
        "the process: protocol version, pid, argv, versions, devices, allocator settings",
        recorded=True,
        required=("protocol", "pid", "argv", "python", "torch", "allocator_conf", "devices"),
    ),
    Command(
        "sample",
        {
            "max_marks": "int >= 1: at most this many step marks",
            "mark_layout": '"rows" (default) or "columns"',
        },
        EVERY_ROUND,
        "allocator counters per device, the step marks and the action log's entries since "
        "this connection's last sample",
        recorded=True,
        required=("time", "step", "devices", "step_marks"),
    ),
    Command(
        "breakdown",
        {"wait_s": WAIT_S + " (default 0: the latest measurement)"},
        LOW_RATE,
        "bytes by role per device (parameters, gradients, optimizer state, activations)",
        # Parameters and optimizer state do not change during a run, and each request is a job
        # on a worker thread of the viewer (a wake-up and two replies, ~1 ms of its CPU on a
        # 2-core box): every 30 s, the figures are at most a minute old and eight agents cost
        # the viewer ~0.3 ms/s, against ~0.8 at 10 s.
        viewer_every_s=30.0,
        trainer_thread=True,
        recorded=True,
    ),
    Command(
        "snapshot",
        {
            "path": "absolute path of a new file for a torch-compatible pickle",
            "overwrite": "boolean: the file may exist",
            "wait_s": WAIT_S,
        },
        LOW_RATE,
        "a trace-free snapshot's summary per device; with `path`, the snapshot file written",
        # The summary gives the external fragmentation; the agent walks every segment for it.
        viewer_every_s=60.0,
        acting_args=("path",),
        trainer_thread=True,
        cooldown_s=5.0,
        recorded=True,
    ),
    Command(
        "cleanup",
        {"wait_s": WAIT_S},
        ON_KEY,
        "gc.collect() + empty_cache() at a step boundary: bytes released per device",
        changes_trainer=True,
        trainer_thread=True,
        cooldown_s=5.0,
    ),
    Command(
        "tune",
        {
            "set": "object: allocator option → value (expandable_segments, "
            "garbage_collection_threshold, max_split_size_mb)",
            "empty_cache": "boolean: empty the cache right after, so it is rebuilt in the new kind",
            "wait_s": WAIT_S,
        },
        ON_KEY,
        "the allocator's settings changed at a step boundary: the whole string before and after",
        changes_trainer=True,
        trainer_thread=True,
        cooldown_s=5.0,
    ),
    Command(
        "reset_peak",
        {},
        ON_KEY,
        "torch's peak statistics reset: the devices reset",
        changes_trainer=True,
    ),
    Command(
        "sites",
        {"stacks": "boolean: switch stack recording at the trainer's next step"},
        LOW_RATE,
        "live memory by the user's line, where stacks are recorded",
        # The agent groups its live blocks every 2 s at most; a leak's site is named from a
        # few readings.
        viewer_every_s=5.0,
        acting_args=("stacks",),
        recorded=True,
    ),
)

BY_NAME: Mapping[str, Command] = {command.name: command for command in COMMANDS}
NAMES: frozenset[str] = frozenset(BY_NAME)
LOW_RATE_NAMES: tuple[str, ...] = tuple(c.name for c in COMMANDS if c.asked == LOW_RATE)
RECORDED: frozenset[str] = frozenset(c.name for c in COMMANDS if c.recorded)


def acts(name: str, args: Mapping[str, Any] | None = None) -> bool:
    """Whether command `name` with `args` changes the trainer (an unknown name: assume so)."""
    command = BY_NAME.get(name)
    return command is None or command.acts(args)


def cooldown_s(name: str) -> float:
    """The agent's cooldown of command `name` (one that has one)."""
    cooldown = BY_NAME[name].cooldown_s
    if cooldown is None:
        raise KeyError(f"{name} has no cooldown")
    return cooldown
