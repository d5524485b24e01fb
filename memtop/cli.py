"""Command line: argument parsing and dispatch only (DESIGN §7).

Exit codes: 0 ok, 1 error (one line on stderr), 2 usage.  Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memtop._version import __version__
from memtop.commands import CommandError
from memtop.protocol import UnsafeSocketDir
from memtop.sim.scenario_names import DEMO_SCENARIOS

if TYPE_CHECKING:
    from memtop.scope import Scope
    from memtop.ui.config import UiConfig

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """Shown as one line on stderr with exit code 1."""


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
        help="show only these GPUs (the driver's numbers) and their processes",
    )
    _add_filters(parser)
    parser.add_argument(
        "--readonly",
        action="store_true",
        help="no key acts on a process (cleanup, reset, snapshot, kill, attach): for shared "
        "boxes and screenshares (config: readonly = true)",
    )
    parser.add_argument("--socket-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="the fleet: every host whose `memtop export` this Prometheus scrapes",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="simulated GPUs and trainers, then the dashboard")
    demo.add_argument("--gpus", type=int, default=None, help="simulated GPUs (default 1; mixed: 2)")
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

    from memtop.commands import attach as attach_command
    from memtop.commands import record as record_command
    from memtop.commands import replay as replay_command

    attach_command.add_parser(sub)
    record_command.add_parser(sub)
    replay_command.add_parser(sub)

    from memtop.estimate.command import add_arguments as add_estimate_arguments

    add_estimate_arguments(
        sub.add_parser("estimate", help="will a training run fit: memory per GPU, before the run")
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
        help="export only these GPUs and their processes",
    )
    _add_filters(export, default=argparse.SUPPRESS)
    return parser


def _add_filters(parser: argparse.ArgumentParser, default: object = None) -> None:
    """--user and --pid, as nvitop has them (memtop.scope): the dashboard, --once and export."""
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


def _scope(args: argparse.Namespace) -> Scope:
    from memtop.scope import Scope

    return Scope(
        gpus=getattr(args, "only", None),
        users=getattr(args, "user", None),
        pids=getattr(args, "pid", None),
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `memtop | head -1`: the reader left.  End quietly, as `cat` would, and keep Python's
        # final flush of stdout from raising again.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "run":
        return _run(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.json and not args.once and args.command is None:
        parser.error("--json needs --once")
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "cleanup":
            return _cleanup(args)
        if args.command == "snapshot":
            return _snapshot(args)
        if args.command == "replay":
            from memtop.commands import replay as replay_command

            return replay_command.run(args)
        if args.command == "record":
            from memtop.commands import record as record_command

            return record_command.run(args)
        if args.command == "attach":
            from memtop.commands import attach as attach_command

            return attach_command.run(args)
        if args.command == "estimate":
            return _estimate(args)
        if args.command == "oom":
            return _oom(args)
        if args.command == "export":
            return _export(args)
        if args.prometheus and args.command is None:
            if _scope(args):  # said, not silently ignored
                raise CliError("--only, --user and --pid do not apply to --prometheus (yet)")
            return _fleet(args)
        if args.once:
            return _once(args)
        return _watch(args, simulated_only=False)
    except CliError as exc:
        print(f"memtop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except UnsafeSocketDir as exc:
        print(f"memtop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except CommandError as exc:
        print(f"memtop: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK


# ---------------------------------------------------------------------------------- commands


def _run(rest: list[str]) -> int:
    usage = (
        "usage: memtop run [--auto-cleanup] [--stacks] [--] script.py [args...] | "
        "memtop run [--auto-cleanup] [--stacks] -m module [args...]"
    )
    # The options, in any order, before the program; the environment carries them to the
    # ranks this program starts (their agents read it too).
    options = {
        # gc + empty_cache at a step boundary when a GPU is >= 95 % full
        "--auto-cleanup": "MEMTOP_AUTO_CLEANUP",
        # record each live block's allocating stack from the first step (the `sites`)
        "--stacks": "MEMTOP_STACKS",
    }
    while rest and rest[0] in options:
        os.environ[options[rest[0]]] = "1"
        rest = rest[1:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] in ("-h", "--help"):
        print(usage, file=sys.stdout if rest else sys.stderr)
        return EXIT_OK if rest else EXIT_USAGE
    from memtop.agent.launcher import LaunchError, run_program

    if rest[0] == "-m":
        if len(rest) < 2:
            print(usage, file=sys.stderr)
            return EXIT_USAGE
        target, args, as_module = rest[1], rest[2:], True
    else:
        target, args, as_module = rest[0], rest[1:], False
    try:
        return run_program(target, args, as_module)
    except LaunchError as exc:
        # Python's own one line (and exit code) for a target it cannot run.
        print(f"memtop run: {exc}", file=sys.stderr)
        return exc.code
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return EXIT_OK
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return EXIT_ERROR


def _make_sampler(args: argparse.Namespace, simulated_only: bool = False):  # type: ignore[no-untyped-def]
    from memtop.sampler import Sampler
    from memtop.sources.agents import AgentPool
    from memtop.sources.devices import DefaultDeviceSource
    from memtop.store import Store

    store = Store()
    devices = DefaultDeviceSource(args.socket_dir, simulated_only=simulated_only)
    return Sampler(store, devices, AgentPool(args.socket_dir), interval=args.interval)


ONCE_EXTRA_ROUNDS = 6
ONCE_ROUND_GAP_S = 0.05
# --once waits at most this long for agents in all (a stopped or hostile agent included), then
# reports whatever answered; each agent request has its own deadline within it.
ONCE_BUDGET_S = 1.5
ONCE_EXTRA_ROUND_S = 0.15
# The fleet dashboard waits this long for its first read before it opens (then reads on).
FLEET_FIRST_READ_S = 3.0


def _once(args: argparse.Namespace) -> int:
    from memtop import report
    from memtop.observation import Observer

    sampler = _make_sampler(args)
    deadline = time.monotonic() + ONCE_BUDGET_S
    try:
        sampler.sample_once()
        # The fragmentation gauge swings within a step; with agents attached, a few quick
        # rounds let the report judge its median rather than one mid-step reading.
        for _ in range(ONCE_EXTRA_ROUNDS if sampler.store.agents() else 0):
            left = deadline - time.monotonic() - ONCE_ROUND_GAP_S
            if left <= 0.02:
                break
            time.sleep(ONCE_ROUND_GAP_S)
            sampler.sample_once(budget=min(ONCE_EXTRA_ROUND_S, left))
        scope = _scope(args)
        whole = Observer(sampler.store).latest()
        for line in scope.missing(whole):
            print(f"memtop: warning: {line}", file=sys.stderr)
        data = report.build(scope.apply(whole))
    finally:
        sampler.stop()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.write(report.render_text(data))
    return EXIT_OK


# Textual draws on stderr (its driver writes to sys.__stderr__); the first paint goes there too.
TERMINAL_FD = 2
# How long Textual's import waits for the first sampling round (whose figures are painted
# first); a round that takes longer (a hung agent) is drawn by Textual when it lands.
FIRST_ROUND_WAIT_S = 0.3


def _first_round_wait_s() -> float:
    """FIRST_ROUND_WAIT_S, or MEMTOP_FIRST_ROUND_WAIT_S (seconds, at most 30) where a slow or
    loaded machine (a test on a busy CI box) would rather wait for the first figures."""
    text = os.environ.get("MEMTOP_FIRST_ROUND_WAIT_S", "")
    try:
        value = float(text) if text.isascii() else FIRST_ROUND_WAIT_S
    except ValueError:
        return FIRST_ROUND_WAIT_S
    return min(30.0, value) if value >= 0 else FIRST_ROUND_WAIT_S


def _terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(TERMINAL_FD)
    except OSError:
        return 80, 24
    return size.columns, size.lines


def _watch(args: argparse.Namespace, simulated_only: bool, painted: bool = False) -> int:
    """The dashboard on a terminal; the plain text view when stdout is not one.  `painted`: the
    header is on screen already (`memtop demo` paints it while its trainers start)."""
    if _on_a_terminal():
        return _dashboard(args, simulated_only, painted)
    return _text_view(args, simulated_only)


def _gpu_list(text: str) -> frozenset[int]:
    """`--only 0,2`: GPU numbers as the driver numbers them."""
    try:
        numbers = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU numbers like 0,2, got {text!r}") from None
    if not numbers or min(numbers) < 0:
        raise argparse.ArgumentTypeError(f"expected GPU numbers like 0,2, got {text!r}")
    return numbers


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


def _on_a_terminal() -> bool:
    return sys.stdout.isatty() and sys.stdin.isatty()


def _paint_header(settings: UiConfig) -> bool:
    """The dashboard's header row on the terminal before Textual is imported (start-up budget,
    DESIGN §9); whether it was painted (memtop.ui.splash)."""
    from memtop.ui import splash

    return splash.paint(TERMINAL_FD, colour=settings.theme != "monochrome")


def _dashboard(args: argparse.Namespace, simulated_only: bool, painted: bool = False) -> int:
    from memtop.ui import config, splash

    settings = config.load()
    try:
        if not painted:
            _paint_header(settings)
        from memtop.observation import Observer

        sampler = _make_sampler(args, simulated_only)
        try:
            # The first sampling round runs while Textual is imported (~0.4 s of CPU, most of
            # the start-up budget of DESIGN §9), its observation built on the sampler's thread.
            # Its figures go on screen under the header as soon as they are known (splash), and
            # Textual's first frame draws the same observation (the app takes `on_round` over).
            observer = Observer(sampler.store)
            scope = _scope(args)
            first_round = threading.Event()
            size = _terminal_size()

            def on_first_round() -> None:
                observation = observer.publish()
                if not first_round.is_set():
                    first_round.set()
                    lines = splash.figure_lines(observation, *size, scope)
                    splash.paint_figures(TERMINAL_FD, lines)

            sampler.on_round = on_first_round
            sampler.start()
            # The figures first: Textual's import would take most of the CPU from the round.
            first_round.wait(_first_round_wait_s())
            from memtop.ui.app import MemtopApp

            app = MemtopApp(
                sampler.store,
                sampler,
                interval=args.interval,
                scope=scope,
                config=settings,
                readonly=getattr(args, "readonly", False) or settings.readonly,
                observer=observer,
            )
            splash.hand_over()
            app.run()
        finally:
            sampler.stop()
    finally:
        # Textual leaves the alternate screen when it ran; when it never got that far (an
        # error or Ctrl-C while importing, even one that lands as the header is written) this
        # gives the terminal back.  Twice is harmless; without a header it does nothing.
        splash.restore(TERMINAL_FD)
    return EXIT_OK


def _text_view(args: argparse.Namespace, simulated_only: bool) -> int:
    """A plain refreshing text report, for a pipe or a log file."""
    from memtop import report
    from memtop.observation import Observer

    sampler = _make_sampler(args, simulated_only)
    sampler.start()
    observer = Observer(sampler.store)  # one for the run: it keeps the leak verdicts
    interactive = sys.stdout.isatty()
    scope = _scope(args)
    warned = False
    try:
        while True:
            time.sleep(min(args.interval, 0.5) if sampler.rounds == 0 else args.interval)
            whole = observer.latest()
            if not warned and whole.gpus:
                warned = True
                for line in scope.missing(whole):
                    print(f"memtop: warning: {line}", file=sys.stderr, flush=True)
            data = report.build(scope.apply(whole))
            text = report.render_text(data)
            if interactive:
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n(Ctrl-C to quit)\n")
            else:
                sys.stdout.write(text + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        sampler.stop()


def _demo(args: argparse.Namespace) -> int:
    from memtop import protocol
    from memtop.sim.demo import Demo

    gpus = args.gpus if args.gpus is not None else (2 if args.scenario == "mixed" else 1)
    # The trainers would refuse an unsafe socket directory one by one: say it once, up front.
    protocol.ensure_socket_dir(args.socket_dir)
    # With the dashboard, the trainers' messages go to a log: on its terminal they would be
    # drawn over it.
    dashboard = not args.no_ui and _on_a_terminal()
    try:
        demo = Demo(
            gpus,
            args.scenario,
            args.step_time,
            socket_dir=args.socket_dir,
            log_messages=dashboard,
            vendor=args.vendor,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        raise KeyboardInterrupt

    # SIGHUP too (`--no-ui` in a terminal that closes): the trainers are stopped and the
    # simulated GPUs removed here, not left to the trainers' watch on their parent.
    previous = signal.signal(signal.SIGTERM, on_signal)
    previous_hup = signal.signal(signal.SIGHUP, on_signal)
    painted = False
    try:
        # The trainers take a few seconds to start: the header says memtop is on its way
        # meanwhile.
        if dashboard:
            from memtop.ui import config

            painted = _paint_header(config.load())
        pids = demo.start()
        if not demo.wait_ready():
            raise CliError(f"simulated trainers failed to start (exited: {demo.failed()})")
        if args.no_ui:
            print(
                f"memtop demo: {len(pids)} simulated trainer(s) ({args.scenario}) on {gpus} "
                f"simulated GPU(s): pids {' '.join(map(str, pids))}. Ctrl-C stops them.",
                flush=True,
            )
            while not stop.is_set():
                stop.wait(0.5)
                if demo.failed():
                    raise CliError(f"simulated trainer(s) exited: {demo.failed()}")
            return EXIT_OK
        args.interval = args.interval or 1.0
        return _watch(args, simulated_only=True, painted=painted)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGHUP, previous_hup)
        demo.stop()
        if not args.no_ui:  # an error above is printed on the normal screen, not lost with it
            from memtop.ui import splash

            splash.restore(TERMINAL_FD)  # a no-op unless the header was painted
        said = demo.log_summary()
        if said:
            print(said, file=sys.stderr)


def _export(args: argparse.Namespace) -> int:
    from memtop.export.server import Exporter, ExportError, load_web_config

    try:
        config = load_web_config(args.web_config) if args.web_config else None
        exporter = Exporter(
            _make_sampler(args),
            args.listen,
            host=args.hostname,
            job=args.job,
            web_config=config,
            scope=_scope(args),
        )
    except ExportError as exc:
        raise CliError(str(exc)) from None
    try:
        host, port = exporter.start_http()  # a port in use fails before any sampling
    except ExportError as exc:
        exporter.sampler.stop()
        raise CliError(str(exc)) from None
    exporter.round()  # "serving" is said once there is something to serve
    scheme = "https" if config is not None and config.tls else "http"
    print(f"memtop export: serving {scheme}://{host}:{port}/metrics", flush=True)
    if exporter.exposed:
        print(
            f"memtop export: warning: {host} is not loopback; anyone who reaches port {port} "
            "reads this host's process ids, commands and memory"
            + ("" if config is not None and config.users else " (no basic auth: see --web-config)"),
            file=sys.stderr,
            flush=True,
        )

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        exporter.run(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        exporter.stop()
        exporter.sampler.stop()
    return EXIT_OK


def _fleet(args: argparse.Namespace) -> int:
    from memtop import fleet, fleet_report
    from memtop.sources.prometheus import PrometheusError, PrometheusSource

    try:
        source = PrometheusSource(args.prometheus)
        if args.once:
            reading, observations = fleet.fleet_observations(source)
            data = fleet_report.build(source.url, observations, reading.problems)
            if args.json:
                print(json.dumps(data, indent=2))
            else:
                sys.stdout.write(fleet_report.render_text(data))
            return EXIT_OK
    except PrometheusError as exc:
        raise CliError(str(exc)) from None
    sampler = fleet.FleetSampler(source, interval=max(args.interval, 1.0))
    if sys.stdout.isatty() and sys.stdin.isatty():
        # The first read, on the sampler's thread: a wrong URL is one line now, not an empty
        # dashboard, and a fleet that answers in time opens the dashboard on the fleet, not on
        # an empty state (which would also take the process table's focus away).  A server
        # that does not answer soon gets the dashboard anyway, where `q` works while it waits.
        sampler.start()
        waited = time.monotonic() + FLEET_FIRST_READ_S
        while sampler.rounds == 0 and time.monotonic() < waited:
            time.sleep(0.02)
        if sampler.rounds and sampler.error:
            sampler.stop()
            raise CliError(sampler.error)
        from memtop.ui.app import MemtopApp

        try:
            MemtopApp(
                sampler.store,
                sampler,  # type: ignore[arg-type]
                interval=args.interval,
                host=f"fleet ({source.url})",
                observer=sampler.observer(),
                readonly=args.readonly,
            ).run()
        finally:
            sampler.stop()
        return EXIT_OK
    try:  # not a terminal: the fleet report at the interval
        while True:
            _, observations = fleet.fleet_observations(source)
            data = fleet_report.build(source.url, observations)
            sys.stdout.write(fleet_report.render_text(data) + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except PrometheusError as exc:
        raise CliError(str(exc)) from None


def _agent_location(pid: int, socket_dir: Path | None) -> tuple[Path, int]:
    """The socket directory of `pid` and the uid that must own it: ours, or as root the
    directory of the user who runs `pid` (never another user's socket for that pid)."""
    from memtop import protocol
    from memtop.protocol import namespaces

    if socket_dir is not None or os.geteuid() != 0 or os.environ.get("MEMTOP_SOCKET_DIR"):
        return socket_dir or protocol.socket_dir(), os.getuid()
    process_owner = protocol.pid_owner(pid)
    if process_owner is None:
        raise CliError(f"no process {pid}")
    name = namespaces.foreign_socket_name(pid)
    for directory, owner in protocol.discovery_dirs():
        path = directory / name if name else protocol.socket_path(pid, directory)
        if owner == process_owner and os.path.lexists(path):
            return directory, owner
    raise CliError(
        f"no agent socket for pid {pid} in the socket directory of its owner (uid "
        f"{process_owner}): start it under `memtop run`, or add an agent with "
        f"`memtop attach {pid}`"
    )


def _action(pid: int, cmd: str, cmd_args: dict[str, object], socket_dir: Path | None) -> dict:  # type: ignore[type-arg]
    from memtop import protocol
    from memtop.protocol import namespaces
    from memtop.sources.agents import AgentClient, AgentError, AgentUnreachable

    directory, owner = _agent_location(pid, socket_dir)
    # A process in a container: its agent's socket carries its own pid and namespace.
    name = namespaces.foreign_socket_name(pid)
    # The agent answers within its wait for a step boundary; give the reply time to come.
    wait = cmd_args.get("wait_s", 0.0)
    timeout = 15.0 + (float(wait) if isinstance(wait, int | float) else 0.0)
    try:
        # The same checks as the dashboard: lstat, no symlink, SO_PEERCRED pid and uid, hello.
        with AgentClient(pid, directory, timeout=timeout, owner=owner, name=name) as client:
            client.connect(timeout=5.0)
            reply = client.request(cmd, cmd_args or None, timeout=timeout)
    except (AgentUnreachable, AgentError) as exc:
        raise CliError(str(exc)) from None
    try:
        protocol.parse_reply(cmd, reply)  # the reply keeps the wire schema, or we say so
    except protocol.ProtocolError as exc:
        raise CliError(f"the agent of pid {pid} sent a malformed reply: {exc.message}") from None
    return reply


def _cleanup(args: argparse.Namespace) -> int:
    from memtop.units import format_bytes

    if args.wait < 0:
        raise CliError("--wait must be seconds >= 0")
    result = _action(args.pid, "cleanup", {"wait_s": args.wait}, args.socket_dir)
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    from memtop.protocol import parse_cleanup

    cleanup = parse_cleanup(result)
    if cleanup.after_step is not None:
        print(
            f"pid {args.pid}: ran on the trainer's thread after step {cleanup.after_step}, "
            f"before the next one ({(cleanup.took_s or 0) * 1000:.0f} ms)"
        )
    if not cleanup.released_bytes:
        print(f"pid {args.pid}: no CUDA device in use: nothing to clean up")
    for index, n in sorted(cleanup.released_bytes.items()):
        after = cleanup.reserved_after.get(index)
        print(
            f"pid {args.pid} GPU {index}: released {format_bytes(n)} "
            f"(reserved now {format_bytes(after)})"
        )
    return EXIT_OK


def _snapshot(args: argparse.Namespace) -> int:
    from memtop.model import snapshot_note
    from memtop.units import format_bytes

    if args.wait < 0:
        raise CliError("--wait must be seconds >= 0")
    path = snapshot_output(args.output, args.pid, args.force)
    request: dict[str, object] = {"path": str(path), "wait_s": args.wait}
    if args.force:
        request["overwrite"] = True
    result = _action(args.pid, "snapshot", request, args.socket_dir)
    # Believe the file system, not the agent: say "wrote" only for a file that is there.
    written = os.path.lexists(path) and os.path.isfile(path) and not os.path.islink(path)
    if not written:
        raise CliError(f"the agent of pid {args.pid} answered, but no snapshot file is at {path}")
    if args.json:
        print(json.dumps(result, indent=2))
        return EXIT_OK
    from memtop.protocol import parse_snapshot

    devices = parse_snapshot(result).devices
    print(f"wrote {path}  ({snapshot_note(devices)})")
    for index, dev in sorted(devices.items()):
        print(
            f"GPU {index}: {dev.get('segments', 0):.0f} segments, "
            f"reserved {format_bytes(int(dev.get('reserved_bytes', 0)))}, "
            f"allocated {format_bytes(int(dev.get('allocated_bytes', 0)))}, "
            f"external fragmentation {dev.get('external_fragmentation', 0.0):.2f}"
        )
    return EXIT_OK


def snapshot_output(output: Path, pid: int, force: bool) -> Path:
    """The path the agent will write: made absolute by joining the current directory, never
    resolved.  A link resolved here was followed past the agent's checks (its lstat, O_EXCL and
    O_NOFOLLOW apply to the path it is given): another user's /tmp/snap.pickle -> a third user's
    authorized_keys was overwritten with --force, and a dangling link made the trainer create
    the file it named.  What the agent would refuse is refused here at once, in one line."""
    path = output if output.is_absolute() else Path.cwd() / output
    try:
        info: os.stat_result | None = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        info = None
    except OSError as exc:
        raise CliError(f"cannot inspect {path}: {exc.strerror}") from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise CliError(
                f"{path} is a symbolic link: memtop never writes through one, with --force or "
                "without; give the path of the file itself"
            )
        if stat.S_ISDIR(info.st_mode):
            raise CliError(
                f"{path} is a directory: give a file name in it "
                f"(-o {path / f'snapshot-{pid}.pickle'})"
            )
        if not stat.S_ISREG(info.st_mode):
            raise CliError(f"{path} exists and is not a regular file")
        if not force:
            raise CliError(f"{path} exists; add --force to overwrite it")
    # A link in a directory above, owned by someone else, leads the write where they chose.
    for folder in reversed(path.parents):
        try:
            above = os.lstat(folder)
        except OSError:
            break  # missing: said below
        if stat.S_ISLNK(above.st_mode) and above.st_uid not in (0, os.geteuid()):
            raise CliError(
                f"{folder} is a symbolic link owned by uid {above.st_uid}: memtop does not write "
                "through another user's link; give the real directory"
            )
    if not path.parent.is_dir():
        raise CliError(f"no such directory: {path.parent}")
    return path


def _oom(args: argparse.Namespace) -> int:
    from memtop.oom import render
    from memtop.oom.reports import ReportError, list_reports, load_report

    if args.file is not None:
        try:
            report = load_report(args.file)
        except ReportError as exc:
            raise CliError(str(exc)) from None
        if args.json:
            print(json.dumps(render.report_json(report), indent=2))
        else:
            print(render.report_text(report))
        return EXIT_OK
    directory, reports, problems = list_reports()
    if args.json:
        print(json.dumps(render.list_json(str(directory), reports, problems), indent=2))
    else:
        print(render.list_text(str(directory), reports, problems))
    return EXIT_OK


def _estimate(args: argparse.Namespace) -> int:
    from memtop import protocol
    from memtop.estimate.command import EstimateError, EstimateUsageError, run

    source = getattr(args, "from_recording", None)
    pid = protocol.decimal(str(source)) if source is not None else None
    if source is not None and pid is not None and not source.exists():
        # `--from PID`: a live agent's figures, asked as `memtop cleanup` asks (same checks).
        sample = _action(pid, "sample", {}, None)
        breakdown = _action(pid, "breakdown", {"wait_s": 10.0}, None)
        args.live_replies = (pid, sample, None if breakdown.get("pending") else breakdown)
    try:
        return run(args)
    except EstimateUsageError as exc:
        print(f"memtop: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EstimateError as exc:
        raise CliError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
