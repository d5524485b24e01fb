"""The dashboard's memory under churn: trainers that come and go, against a control that has none
(issue 36 item 10: 0.5-0.7 MB a minute with a trainer arriving every 10 s, for good).

    .venv/bin/python bench/churn.py [--minutes 60] [--rate 1] [--life 4] [--tracemalloc]

Two real dashboards (`python -m memtop`, Textual on a pseudo-terminal of --size, its frames
drained by a reader thread: what a user's terminal runs), each on its own private socket
directory with --gpus simulated GPUs and one long-lived simulated trainer per GPU:
- "churn": besides those, --rate new simulated trainers a second (memtop.sim.trainer with the
  real agent), each living --life seconds then stopped with SIGTERM; each is a new process (new
  pid, its own seed in its command line) and the scenarios take turns (healthy, leak, fragment,
  pressure, oom, …), so every per-process map in the viewer sees new keys and their departures.
- "control": the same, with no churn: what the dashboard's memory does when nothing comes or goes.

Every --every seconds (default a minute) a line: each dashboard's RSS (and USS) in MB, and how
many trainers have come and gone.  With --tracemalloc both dashboards run under tracemalloc and
each report adds the churn dashboard's top growth sites since its first report.  At the end:
RSS at start, at 10 minutes and at the end, and the slope (least squares, MB a minute) after the
first --settle minutes; the last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZE = (120, 36)
FIRST_FRAME_TIMEOUT_S = 240.0  # under tracemalloc on a loaded box: minutes
TRACE_FRAMES = 6
TRACE_TOP = 12
CHURN_SCENARIOS = ("healthy", "leak", "fragment", "pressure", "oom", "healthy", "server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="how long (default 60)")
    parser.add_argument("--rate", type=float, default=1.0, help="new trainers a second (1)")
    parser.add_argument("--life", type=float, default=4.0, help="each trainer's life, s (4)")
    parser.add_argument("--gpus", type=int, default=2, help="simulated GPUs per dashboard (2)")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between reports")
    parser.add_argument("--settle", type=float, default=5.0, help="minutes before the slope")
    parser.add_argument("--no-control", action="store_true", help="the churn dashboard alone")
    parser.add_argument(
        "--tracemalloc", action="store_true", help="top growth sites of the churn dashboard"
    )
    parser.add_argument(
        "--caches", action="store_true", help="the fullest lru_caches of the churn dashboard"
    )
    parser.add_argument("--dashboard", metavar="TRACE_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.life <= 0 or args.minutes <= 0 or args.every <= 0:
        parser.error("--minutes, --rate, --life and --every must be positive")
    return args


# -- inside the dashboard's process (--dashboard) ----------------------------------------------


def run_dashboard(trace_file: str) -> int:
    """memtop's dashboard as `python -m memtop` runs it; with a trace file, under tracemalloc,
    its top growth sites since the first snapshot written there every `MEMTOP_CHURN_EVERY` s."""
    if trace_file != "-" and os.environ.get("MEMTOP_CHURN_CACHES"):
        every = float(os.environ.get("MEMTOP_CHURN_EVERY", "60"))

        def caches() -> None:
            while True:
                time.sleep(every)
                Path(trace_file + ".caches").write_text("\n".join(lru_sizes()) + "\n")

        threading.Thread(target=caches, daemon=True).start()
    if trace_file != "-" and os.environ.get("MEMTOP_CHURN_TRACE"):
        import tracemalloc

        tracemalloc.start(TRACE_FRAMES)
        every = float(os.environ.get("MEMTOP_CHURN_EVERY", "60"))

        def dump() -> None:
            try:
                snapshots()
            except Exception:  # said where the bench reads, not on the dashboard's terminal
                import traceback

                Path(trace_file).write_text(traceback.format_exc())

        def snapshots() -> None:
            first = None
            while True:
                time.sleep(every)
                snapshot = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(False, tracemalloc.__file__)]
                )
                if first is None:
                    first = snapshot
                    continue
                lines = []
                for stat in snapshot.compare_to(first, "traceback")[:TRACE_TOP]:
                    frames = " <- ".join(
                        f"{Path(f.filename).name}:{f.lineno}" for f in reversed(stat.traceback)
                    )
                    lines.append(
                        f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d}  {frames}"
                    )
                text = f"traced {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MB\n"
                tmp = trace_file + ".tmp"
                with open(tmp, "w") as f:
                    f.write(text + "\n".join(lines) + "\n")
                os.replace(tmp, trace_file)

        threading.Thread(target=dump, daemon=True).start()
    from memtop.cli import main

    return main([])


def lru_sizes() -> list[str]:
    """Every functools.lru_cache of Rich, Textual and memtop that holds something, fullest
    first: `currsize/maxsize  module.name`."""
    found: dict[int, tuple[int, str]] = {}

    def look(owner: object, prefix: str) -> None:
        for name, value in list(vars(owner).items()):
            func = getattr(value, "__func__", value)  # a classmethod's or staticmethod's
            info = getattr(func, "cache_info", None)
            if callable(info) and id(func) not in found:
                found[id(func)] = (
                    info().currsize,
                    f"{info().currsize}/{info().maxsize}  {prefix}.{name}",
                )
            elif isinstance(value, type) and value.__module__ == getattr(owner, "__name__", None):
                look(value, f"{prefix}.{name}")

    for module_name, module in list(sys.modules.items()):
        if module is not None and module_name.split(".")[0] in ("rich", "textual", "memtop"):
            look(module, module_name)
    return [text for size, text in sorted(found.values(), reverse=True) if size][:25]


# -- the bench ------------------------------------------------------------------------------


class Arm:
    """One dashboard on its own socket directory, its simulated GPUs and long-lived trainers."""

    def __init__(self, name: str, args: argparse.Namespace, workdir: Path) -> None:
        from memtop import protocol
        from memtop.sim.demo import registry_dir
        from memtop.sim.device import SimGpuRegistry, simulated_gpu_specs

        self.name = name
        self.args = args
        self.socket_dir = workdir / name
        protocol.ensure_socket_dir(self.socket_dir)
        self.registry = registry_dir(self.socket_dir, os.getpid())
        SimGpuRegistry(self.registry).create(
            simulated_gpu_specs(args.gpus, seed=f"{name}-{os.getpid()}")
        )
        self.env = dict(os.environ, MEMTOP_SOCKET_DIR=str(self.socket_dir), TERM="xterm-256color")
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), self.env.get("PYTHONPATH")])
        )
        self.env["MEMTOP_CHURN_EVERY"] = str(args.every)
        for var in ("NO_COLOR", "TEXTUAL", "TEXTUAL_DRIVER", "COLUMNS", "LINES"):
            self.env.pop(var, None)
        self.trace_file = str(workdir / f"{name}.trace")
        if args.tracemalloc:
            self.env["MEMTOP_CHURN_TRACE"] = "1"
        if args.caches:
            self.env["MEMTOP_CHURN_CACHES"] = "1"
        self.steady: list[subprocess.Popen[bytes]] = []
        self.live: list[tuple[float, subprocess.Popen[bytes]]] = []  # (stop at, trainer)
        self.started = 0
        self.terminated: set[int] = set()
        self.seeds = itertools.count(1000)
        self.dashboard: subprocess.Popen[bytes] | None = None
        self.master = -1
        self.screen = bytearray()

    def trainer(self, gpu: int, scenario: str) -> subprocess.Popen[bytes]:
        from memtop.base.children import python_command

        command = python_command(
            "memtop.sim.trainer",
            "--registry", str(self.registry), "--gpu", str(gpu), "--scenario", scenario,
            "--step-time", "0.1", "--seed", str(next(self.seeds)), "--parent", str(os.getpid()),
            environ=self.env,
        )  # fmt: skip
        return subprocess.Popen(
            command, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def start(self) -> None:
        from memtop.base.children import start_in_terminal

        self.steady = [self.trainer(gpu, "healthy") for gpu in range(self.args.gpus)]
        command = [
            sys.executable,
            "-I",
            str(Path(__file__).resolve()),
            "--dashboard",
            self.trace_file,
        ]
        self.dashboard, self.master = start_in_terminal(command, SIZE, self.env)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.screen += data
            del self.screen[:-65536]

    def wait_first_frame(self) -> None:
        deadline = time.monotonic() + FIRST_FRAME_TIMEOUT_S
        while b"Processes" not in self.screen:
            if time.monotonic() > deadline or (
                self.dashboard and self.dashboard.poll() is not None
            ):
                tail = bytes(self.screen[-2000:]).decode("utf-8", "replace")
                raise SystemExit(f"{self.name}: no first frame; the terminal ends with:\n{tail}")
            time.sleep(0.1)

    def churn(self, now: float) -> None:
        """One new trainer, on the GPUs in turn, its scenario in turn; the expired stopped."""
        scenario = CHURN_SCENARIOS[self.started % len(CHURN_SCENARIOS)]
        self.live.append(
            (now + self.args.life, self.trainer(self.started % self.args.gpus, scenario))
        )
        self.started += 1

    def reap(self, now: float) -> None:
        """SIGTERM to each trainer whose life is over; SIGKILL 5 s later if it is still there."""
        keep = []
        for stop_at, process in self.live:
            if process.poll() is not None:
                continue
            if now >= stop_at:
                if process.pid in self.terminated:
                    process.kill()
                else:
                    process.send_signal(signal.SIGTERM)
                    self.terminated.add(process.pid)
                    keep.append((now + 5.0, process))
                continue
            keep.append((stop_at, process))
        self.live = keep
        self.terminated &= {p.pid for _, p in keep}

    def memory_mb(self) -> tuple[float, float]:
        assert self.dashboard is not None
        info = psutil.Process(self.dashboard.pid).memory_full_info()
        return info.rss / 2**20, info.uss / 2**20

    def trace(self) -> str:
        text = ""
        for path in (self.trace_file, self.trace_file + ".caches"):
            with contextlib.suppress(OSError):
                text += Path(path).read_text()
        return text

    def stop(self) -> None:
        if self.dashboard is not None and self.dashboard.poll() is None:
            with contextlib.suppress(OSError):
                os.write(self.master, b"q")
            try:
                self.dashboard.wait(15)
            except subprocess.TimeoutExpired:
                self.dashboard.kill()
                self.dashboard.wait()
        with contextlib.suppress(OSError):
            os.close(self.master)
        for process in self.steady + [p for _, p in self.live]:
            if process.poll() is None:
                process.terminate()
        for process in self.steady + [p for _, p in self.live]:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least squares MB a minute through (minute, MB) points."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def at_minute(points: list[tuple[float, float]], minute: float) -> float | None:
    before = [y for x, y in points if x <= minute + 0.01]
    if not points or points[-1][0] < minute - 0.01:
        return None
    return round(before[-1], 1) if before else None


def bench(args: argparse.Namespace) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="memtop-churn-"))
    os.chmod(workdir, 0o700)
    arms = [Arm("churn", args, workdir)]
    if not args.no_control:
        arms.append(Arm("control", args, workdir))
    series: dict[str, list[tuple[float, float]]] = {arm.name: [] for arm in arms}
    try:
        for arm in arms:
            arm.start()
        for arm in arms:
            arm.wait_first_frame()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_trainer = t0
        next_report = t0
        churn = arms[0]
        while True:
            now = time.monotonic()
            if now >= next_report:
                minute = (now - t0) / 60
                parts = [f"{minute:6.1f} min"]
                for arm in arms:
                    if arm.dashboard is None or arm.dashboard.poll() is not None:
                        code = arm.dashboard.returncode if arm.dashboard else None
                        raise SystemExit(f"{arm.name}: the dashboard ended ({code})")
                    rss, uss = arm.memory_mb()
                    series[arm.name].append((minute, rss))
                    parts.append(f"{arm.name} rss {rss:6.1f} MB uss {uss:6.1f} MB")
                parts.append(f"trainers started {churn.started}, alive {len(churn.live)}")
                print("  ".join(parts), flush=True)
                if (args.tracemalloc or args.caches) and minute > 0:
                    trace = churn.trace()
                    if trace:
                        print(trace.rstrip(), flush=True)
                next_report += args.every
                if now >= end:
                    break
            if now >= next_trainer:
                churn.churn(now)
                next_trainer += 1 / args.rate
            churn.reap(now)
            time.sleep(max(0.0, min(next_trainer, next_report) - time.monotonic()))
    finally:
        for arm in arms:
            arm.stop()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    result: dict[str, object] = {
        "minutes": args.minutes, "rate": args.rate, "life": args.life,
        "trainers": churn.started,
    }  # fmt: skip
    for name, points in series.items():
        settled = [(x, y) for x, y in points if x >= args.settle]
        rate = slope(settled)
        result[name] = {
            "rss_start_mb": at_minute(points, 0),
            "rss_10min_mb": at_minute(points, 10),
            "rss_end_mb": round(points[-1][1], 1) if points else None,
            "slope_mb_per_min": round(rate, 4) if rate is not None else None,
        }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dashboard:
        return run_dashboard(args.dashboard)
    result = bench(args)
    for name in ("churn", "control"):
        figures = result.get(name)
        if isinstance(figures, dict):
            print(
                f"{name}: RSS start {figures['rss_start_mb']} MB, 10 min {figures['rss_10min_mb']}"
                f" MB, end {figures['rss_end_mb']} MB; slope after {args.settle:g} min"
                f" {figures['slope_mb_per_min']} MB/min"
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
