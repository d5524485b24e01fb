"""The command line's parser: every subcommand, flag and help text (DESIGN §7).

They are a contract (tests/data/cli-help.txt pins each `--help`): extend them, never rename or
drop one.  The subcommands that grew their own module add their arguments there
(`add_arguments`), imported only when that subcommand parses or prints its help.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memtop._version import __version__
from memtop.sim.scenario_names import DEMO_SCENARIOS


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memtop",
        description="GPU memory dashboard for PyTorch: live allocator view, diagnosis, actions.",
        epilog=(
            "commands: memtop demo | memtop run [--] script.py args | memtop run -m module args"
            " | memtop cleanup PID | memtop snapshot PID -o FILE"
            " | memtop tune PID KEY=VALUE"
        ),
    )
    parser.add_argument("--version", action="version", version=f"memtop {__version__}")
    parser.add_argument("--once", action="store_true", help="print one report and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print JSON")
    parser.add_argument(
        "--interval", type=_positive_float, default=1.0, help="refresh interval in seconds"
    )
    parser.add_argument(
        "--only",
        type=_gpu_list,
        default=None,
        metavar="0,2",
        help="show only these GPUs (the driver's numbers) and their processes; 0:1 is GPU 0's "
        "MIG instance 1 (its GPU instance id)",
    )
    _add_filters(parser)
    parser.add_argument(
        "--readonly",
        action="store_true",
        help="no key acts on a process (cleanup, reset, snapshot, kill, attach): for shared "
        "boxes and screenshares (config: readonly = true)",
    )
    _add_alerts(parser)
    parser.add_argument("--socket-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="the fleet: every host whose `memtop export` this Prometheus scrapes",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="simulated GPUs and trainers, then the dashboard")
    demo.add_argument(
        "--gpus", type=int, default=None, help="simulated GPUs, 1 to 16 (default 1; mixed: 2)"
    )
    demo.add_argument(
        "--scenario",
        default="mixed",
        choices=DEMO_SCENARIOS,
        help="workload the simulated trainers run (default mixed)",
    )
    demo.add_argument("--step-time", type=_positive_float, default=0.1, help="seconds per step")
    demo.add_argument(
        "--vendor",
        choices=["nvidia", "amd"],
        default="nvidia",
        help="simulate NVIDIA H100s (default) or AMD MI300Xs with trainers on ROCm",
    )
    demo.add_argument("--no-ui", action="store_true", help="only run the trainers until Ctrl-C")
    demo.add_argument("--interval", type=_positive_float, default=None, help=argparse.SUPPRESS)
    demo.add_argument("--only", type=_gpu_list, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    demo.add_argument(
        "--readonly", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )

    cleanup = sub.add_parser("cleanup", help="gc + empty_cache inside a trainer")
    cleanup.add_argument("pid", type=int)
    cleanup.add_argument("--json", action="store_true")
    cleanup.add_argument(
        "--wait",
        type=float,
        default=8.0,
        metavar="SECONDS",
        help="how long to wait for the trainer's next step boundary (default 8)",
    )

    tune = sub.add_parser(
        "tune",
        help="change the caching allocator's settings inside a running trainer",
        description=(
            "Applies expandable_segments, garbage_collection_threshold or max_split_size_mb "
            "inside the trainer, on its own thread at its next step boundary; the trainer's "
            "other allocator settings are kept. Segments already cached keep their kind "
            "(--empty-cache releases them, and the next steps allocate afresh). Undo with the "
            "old value, e.g. `memtop tune PID expandable_segments=False`."
        ),
    )
    tune.add_argument("pid", type=int)
    tune.add_argument("settings", nargs="+", metavar="KEY=VALUE")
    tune.add_argument(
        "--empty-cache",
        action="store_true",
        help="empty the cache right after, so that it is rebuilt in the new kind",
    )
    tune.add_argument("--json", action="store_true")
    tune.add_argument(
        "--wait",
        type=float,
        default=8.0,
        metavar="SECONDS",
        help="how long to wait for the trainer's next step boundary (default 8)",
    )

    snapshot = sub.add_parser("snapshot", help="write a memory snapshot (memory_viz pickle)")
    snapshot.add_argument("pid", type=int)
    snapshot.add_argument("-o", "--output", required=True, type=Path)
    snapshot.add_argument("--json", action="store_true")
    snapshot.add_argument("--force", action="store_true", help="overwrite an existing file")
    snapshot.add_argument(
        "--wait",
        type=float,
        default=8.0,
        metavar="SECONDS",
        help="how long to wait for the trainer's next step boundary (default 8)",
    )

    sub.add_parser("run", help="run a Python program with the agent: run [--] script.py args")

    # These subcommands' arguments are in their own modules, imported only when the subcommand
    # parses or prints its help (memtop.commands.<name>.add_arguments): the dashboard's start
    # never needs them.  `memtop estimate`'s come from the estimator's tables (architectures,
    # GPUs, dtypes): ~30 ms of imports and a megabyte.  Their names and help are here, for the
    # command list of `memtop --help`.
    _add_when_used(
        sub,
        "attach",
        "memtop.commands.attach",
        help="start the agent inside a running Python process (gdb or sys.remote_exec)",
    )
    _add_when_used(
        sub,
        "record",
        "memtop.commands.record",
        help="record what memtop reads (devices, processes, agents) to a file",
    )
    _add_when_used(
        sub,
        "replay",
        "memtop.commands.replay",
        help="play a recording (memtop record file, agent wire recordings, or a folder of them)",
    )
    _add_when_used(
        sub,
        "report",
        "memtop.commands.report",
        help="write one self-contained HTML page from a recording, to hand on",
        description="One HTML file (inline CSS and SVG; nothing is fetched when it opens): "
        "timelines per GPU and per process, the leak's fit, the breakdown, the sites, the "
        "suggestions with their fixes, OOMs marked, and the figures at five marked moments "
        "as `memtop replay FILE --once --json --at T` gives them.",
    )
    _add_when_used(
        sub,
        "compare",
        "memtop.commands.compare",
        help="two runs side by side: memory, breakdown, sites, retries, step time, and noise",
        description="Compare two runs (recordings or live pids): peak, reserved, the breakdown, "
        "the top lines, fragmentation, retries and step time, each difference judged against "
        "the runs' own noise.",
    )
    _add_when_used(
        sub,
        "estimate",
        "memtop.estimate.command",
        help="will a training run fit: memory per GPU, before the run",
    )

    oom = sub.add_parser("oom", help="the OOM reports trainers left here, each explained")
    oom.add_argument("file", nargs="?", type=Path, help="explain this report")
    oom.add_argument("--json", action="store_true")

    export = sub.add_parser("export", help="serve Prometheus metrics on /metrics")
    export.add_argument(
        "--listen",
        default="127.0.0.1:9482",
        metavar="HOST:PORT",
        help="address to serve on (default 127.0.0.1:9482; 0.0.0.0:PORT exposes it)",
    )
    export.add_argument("--job", help="the job label (default: each trainer's command)")
    export.add_argument("--hostname", help="the hostname label (default: this node's name)")
    export.add_argument(
        "--web-config", type=Path, metavar="FILE", help="JSON file with TLS and basic auth"
    )
    export.add_argument("--interval", type=_positive_float, default=argparse.SUPPRESS)
    export.add_argument(
        "--only",
        type=_gpu_list,
        default=argparse.SUPPRESS,
        metavar="0,2",
        help="export only these GPUs (0:1: GPU 0's MIG instance 1) and their processes",
    )
    _add_filters(export, default=argparse.SUPPRESS)
    _add_alerts(export, default=argparse.SUPPRESS)
    return parser


class _ArgumentsWhenUsed(argparse.ArgumentParser):
    """A subcommand's parser whose arguments `add_arguments` adds the first time it parses or
    formats its help or usage (each of argparse's ways in), so that what they import is
    imported only when that subcommand runs."""

    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None

    def _add_now(self) -> None:
        add, self.add_arguments = self.add_arguments, None
        if add is not None:
            add(self)

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        self._add_now()
        return super().parse_known_args(*args, **kwargs)

    def format_help(self) -> str:
        self._add_now()
        return super().format_help()

    def format_usage(self) -> str:
        self._add_now()
        return super().format_usage()


def _add_when_used(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    name: str,
    module: str,
    **kwargs: Any,
) -> None:
    """`memtop NAME`'s parser, its arguments added by `module`'s `add_arguments` when it is
    used (_ArgumentsWhenUsed)."""
    sub._parser_class = _ArgumentsWhenUsed
    try:
        parser = sub.add_parser(name, **kwargs)
    finally:
        sub._parser_class = argparse.ArgumentParser
    assert isinstance(parser, _ArgumentsWhenUsed)

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        importlib.import_module(module).add_arguments(parser)

    parser.add_arguments = add_arguments


def _add_alerts(parser: argparse.ArgumentParser, default: object = None) -> None:
    """--on-alert and --alert-severity (memtop.present.alerts): the dashboard, the text view,
    export."""
    parser.add_argument(
        "--on-alert",
        metavar="CMD",
        default=default,
        help="run CMD (by the shell) once for each suggestion that reaches --alert-severity, "
        "with it as JSON on stdin; again only after it has cleared",
    )
    parser.add_argument(
        "--alert-severity",
        choices=("warning", "critical", "emergency"),
        default="critical" if default is None else default,
        help="the least severity that runs --on-alert (default critical)",
    )


def _add_filters(parser: argparse.ArgumentParser, default: object = None) -> None:
    """--user and --pid, as nvitop has them (memtop.engine.scope): the dashboard, --once and
    export."""
    parser.add_argument(
        "--user",
        type=_name_list,
        default=default,
        metavar="NAME",
        help="show only the processes of these users (comma-separated)",
    )
    parser.add_argument(
        "--pid",
        type=_pid_list,
        default=default,
        metavar="PID",
        help="show only these processes (comma-separated pids)",
    )


def _gpu_list(text: str) -> frozenset[int | tuple[int, int]]:
    """`--only 0,2`: GPU numbers as the driver numbers them; `0:1` is GPU 0's MIG instance
    whose GPU instance id is 1 (the `GPU_I_ID` of DCGM, `#1` on the dashboard's row)."""
    wrong = argparse.ArgumentTypeError(
        f"expected GPU numbers like 0,2 or MIG instances like 0:1, got {text!r}"
    )
    chosen: set[int | tuple[int, int]] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        numbers = part.split(":")
        if len(numbers) > 2 or not all(n.isascii() and n.isdigit() for n in numbers):
            raise wrong
        chosen.add(int(numbers[0]) if len(numbers) == 1 else (int(numbers[0]), int(numbers[1])))
    if not chosen:
        raise wrong
    return frozenset(chosen)


def _pid_list(text: str) -> frozenset[int]:
    """`--pid 4101,4102`."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isascii() and part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected process ids like 4101,4102, got {text!r}")
    return frozenset(int(part) for part in parts)


def _name_list(text: str) -> frozenset[str]:
    """`--user ada,grace`."""
    names = frozenset(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected user names like ada,grace, got {text!r}")
    return names
