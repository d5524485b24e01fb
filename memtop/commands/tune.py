"""`memtop tune PID KEY=VALUE ...`: change the caching allocator's settings inside a running
trainer, on its own thread at a step boundary (DESIGN §13), through the same agent path as
`memtop cleanup`.  The agent writes the whole option string in force back with these keys
changed, so the user's other keys survive (torch's parser resets every key it is not given)."""

from __future__ import annotations

import argparse
import json

from memtop.base import alloc_conf
from memtop.base.errors import MemtopError
from memtop.commands import EXIT_OK
from memtop.commands.actions import agent_action


def settings_args(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` words as {key: value as torch takes it}; MemtopError in one line."""
    changes: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            key, sep, value = pair.partition(":")  # torch's own spelling, key:value
        if not sep or not key.strip():
            raise MemtopError(f"{pair!r}: give KEY=VALUE (e.g. expandable_segments=True)")
        try:
            changes[key.strip()] = alloc_conf.checked_setting(key.strip(), value)
        except alloc_conf.BadSetting as exc:
            raise MemtopError(str(exc)) from None
    return changes


def run(args: argparse.Namespace) -> int:
    from memtop.figures.units import format_bytes
    from memtop.protocol import parse_tune

    if args.wait < 0:
        raise MemtopError("--wait must be seconds >= 0")
    changes = settings_args(args.settings)
    request: dict[str, object] = {"set": changes, "wait_s": args.wait}
    if args.empty_cache:
        request["empty_cache"] = True
    result = agent_action(args.pid, "tune", request, args.socket_dir)
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    tune = parse_tune(result)
    when = f"after step {tune.after_step}" if tune.after_step is not None else "at a step boundary"
    print(
        f"pid {args.pid}: allocator settings changed on the trainer's thread {when} "
        f"({(tune.took_s or 0) * 1000:.0f} ms)"
    )
    print(f"  before: {tune.before or '(default)'}")
    print(f"  after:  {tune.after or '(default)'}")
    for index, before in sorted(tune.reserved_before.items()):
        after = tune.reserved_after.get(index, 0)
        print(
            f"  GPU {index}: cache emptied, reserved {format_bytes(before)} → {format_bytes(after)}"
        )
    if not tune.reserved_before:
        print("  segments already cached keep their kind; new ones follow the new settings")
    return EXIT_OK
