"""What the dashboard itself costs while it shows 8 GPUs and 8 agents (DESIGN §9 budgets:
CPU < 3 % of one core at the default refresh, < 20 KB/s written to the terminal, first frame
< 0.5 s after start, resident memory < 80 MB).

    .venv/bin/python bench/tui_cost.py [--seconds 30] [--gpus 8] [--interval 1] [--size 120x36]

How it measures:
- A private socket directory (mode 0700) is made for the run and passed to every child as
  MEMTOP_SOCKET_DIR, so no other memtop or trainer on the machine is seen or disturbed.
- `memtop demo --no-ui --gpus N --scenario healthy` runs N simulated GPUs with one simulated
  trainer (and its real agent) on each; its "pids" line says they are up.
- `memtop --interval 1` (the real dashboard, not the demo's built-in one) runs in a pseudo-terminal
  of the given size, stdin, stdout and stderr all on the pty slave (Textual writes its frames to
  stderr).  A reader thread drains the pty master the whole time, timing each chunk.
- first_frame_s: from spawning the dashboard to the first output that paints the header ("memtop"
  on screen, escape sequences stripped); first_data_s: until the last GPU ("GPU 7") is on screen.
- After --warmup seconds past first data, a window of --seconds is measured: the dashboard
  process's user+system CPU time (psutil; that process only, not the trainers) over the wall time
  of the window, the bytes read from the pty master in the window, and its RSS at the end.
  The CPU is also split into the main thread (Textual's event loop: refresh, layout, render) and
  the others (the sampler, Textual's input and writer threads); output chunks less than 10 ms
  apart are counted as one burst (about one frame).
- Then "q" is typed; the exit code is recorded; the demo is stopped with SIGINT.

The last line of output is one JSON object.  `--profile FILE` (hidden) runs the dashboard under
cProfile instead, writes the profile to FILE and prints the top functions to stderr; its figures
carry the profiler's overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

BUDGET_CPU_PCT = 3.0
BUDGET_TTY_BYTES_S = 20_000
BUDGET_FIRST_FRAME_S = 0.5
BUDGET_RSS_MB = 80.0

DEMO_READY_TIMEOUT_S = 60.0
AGENTS_SETTLE_S = 2.0
FIRST_FRAME_TIMEOUT_S = 30.0
FIRST_DATA_TIMEOUT_S = 30.0
QUIT_TIMEOUT_S = 10.0
TAIL_BYTES = 64 * 1024
BURST_GAP_S = 0.01  # chunks closer than this belong to one burst of output (about one frame)
DEMO = [sys.executable, "-m", "memtop", "demo", "--no-ui"]

# CSI ... final byte, OSC ... BEL/ST, and two-byte escapes (ESC 7, ESC =, ...).
ANSI = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_=>78]")


def strip_ansi(data: bytes) -> bytes:
    return ANSI.sub(b"", data)


class PtyReader(threading.Thread):
    """Drains the pty master: (time, bytes) per chunk, the last TAIL_BYTES of output, and the
    first times at which each of some markers appeared on screen."""

    def __init__(self, fd: int, markers: dict[str, re.Pattern[bytes]]) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.markers = markers
        self.seen: dict[str, float] = {}
        self.last: dict[str, bytes] = {}  # the latest text each marker matched
        self.chunks: list[tuple[float, int]] = []
        self.tail = bytearray()
        self.total = 0
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # EIO once every holder of the slave has closed it
                break
            if not data:
                break
            now = time.monotonic()
            with self.lock:
                # A marker may straddle two chunks: search the end of the tail with the chunk.
                window = strip_ansi(bytes(self.tail[-4096:]) + data)
                for name, pattern in self.markers.items():
                    found = pattern.findall(window)
                    if found:
                        self.seen.setdefault(name, now)
                        self.last[name] = found[-1]
                self.chunks.append((now, len(data)))
                self.total += len(data)
                self.tail += data
                del self.tail[:-TAIL_BYTES]
                self.changed.notify_all()
        with self.lock:
            self.changed.notify_all()

    def wait_for(self, name: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while name not in self.seen and self.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(min(left, 0.5))
            return self.seen.get(name)

    def bytes_between(self, start: float, end: float) -> tuple[int, int]:
        """Bytes read in [start, end) and the bursts they came in."""
        with self.lock:
            inside = [(t, n) for t, n in self.chunks if start <= t < end]
        bursts = sum(
            1 for i, (t, _) in enumerate(inside) if i == 0 or t - inside[i - 1][0] > BURST_GAP_S
        )
        return sum(n for _, n in inside), bursts

    def last_match(self, name: str) -> bytes | None:
        with self.lock:
            return self.last.get(name)

    def screen_tail(self) -> str:
        with self.lock:
            return strip_ansi(bytes(self.tail)).decode("utf-8", "replace")


def parse_size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"size must be COLUMNSxROWS, not {text!r}")
    return int(match.group(1)), int(match.group(2))


def child_env(socket_dir: Path) -> dict[str, str]:
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir), TERM="xterm-256color")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    for name in ("NO_COLOR", "TEXTUAL", "TEXTUAL_DRIVER", "COLUMNS", "LINES"):
        env.pop(name, None)
    return env


def start_demo(gpus: int, env: dict[str, str]) -> tuple[subprocess.Popen[str], list[int]]:
    demo = subprocess.Popen(
        [*DEMO, "--gpus", str(gpus), "--scenario", "healthy"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert demo.stdout is not None
    lines: list[str] = []
    ready = threading.Event()

    def drain(stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            lines.append(line.rstrip("\n"))
            if "pids" in line:
                ready.set()
        ready.set()

    threading.Thread(target=drain, args=(demo.stdout,), daemon=True).start()
    if not ready.wait(DEMO_READY_TIMEOUT_S) or demo.poll() is not None:
        stop_demo(demo, [])
        raise SystemExit("the simulated trainers did not start:\n" + "\n".join(lines[-20:]))
    pids_line = next(line for line in lines if "pids" in line)
    match = re.search(r"pids ([\d ]+)", pids_line)
    pids = [int(p) for p in match.group(1).split()] if match else []
    return demo, pids


def stop_demo(demo: subprocess.Popen[str], trainer_pids: list[int]) -> None:
    if demo.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            demo.send_signal(signal.SIGINT)
        try:
            demo.wait(15)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
    # The trainers run in sessions of their own: should the demo have died without stopping
    # them, stop the ones it started (checked by command line, against pid reuse).
    for pid in trainer_pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if "memtop.sim.trainer" in " ".join(process.cmdline()):
                process.terminate()
                try:
                    process.wait(5)
                except psutil.TimeoutExpired:
                    process.kill()


def start_dashboard(
    interval: float, size: tuple[int, int], env: dict[str, str], profile: Path | None
) -> tuple[subprocess.Popen[bytes], int, float]:
    master, slave = os.openpty()
    columns, rows = size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    command = [sys.executable]
    if profile is not None:
        command += ["-m", "cProfile", "-o", str(profile)]
    command += ["-m", "memtop", "--interval", f"{interval:g}"]
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            command,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            close_fds=True,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)  # only the child holds it now: its exit ends the reader with EIO
    return process, master, started


def thread_cpu(proc: psutil.Process) -> dict[int, float]:
    """user+system CPU seconds of each thread of the process, by thread id."""
    with contextlib.suppress(psutil.Error):
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    return {}


def quit_dashboard(process: subprocess.Popen[bytes], master: int) -> int | None:
    if process.poll() is None:
        with contextlib.suppress(OSError):
            os.write(master, b"q")
        try:
            process.wait(QUIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print("the dashboard did not quit on 'q'; killing it", file=sys.stderr)
            process.kill()
            process.wait()
            return None
    return process.returncode


def print_profile(path: Path, top: int) -> None:
    import pstats

    if not path.exists():
        print(f"no profile was written to {path}", file=sys.stderr)
        return
    for key in ("cumulative", "tottime"):
        print(f"\n===== top {top} by {key} =====", file=sys.stderr)
        pstats.Stats(str(path), stream=sys.stderr).sort_stats(key).print_stats(top)


def run(args: argparse.Namespace) -> dict[str, object]:
    socket_dir = Path(tempfile.mkdtemp(prefix="mt-tui-"))
    socket_dir.chmod(0o700)
    env = child_env(socket_dir)
    demo: subprocess.Popen[str] | None = None
    trainer_pids: list[int] = []
    dashboard: subprocess.Popen[bytes] | None = None
    master = -1
    reader: PtyReader | None = None
    try:
        demo, trainer_pids = start_demo(args.gpus, env)
        print(
            f"demo: {len(trainer_pids)} simulated trainer(s) with agents on {args.gpus} "
            f"simulated GPU(s), pid {demo.pid}",
            flush=True,
        )
        time.sleep(AGENTS_SETTLE_S)

        last_gpu = args.gpus - 1
        markers = {
            "frame": re.compile(rb"memtop"),
            "data": re.compile(rb"GPU ?%d\b" % last_gpu),
            "agents": re.compile(rb"(\d+) agents?\b"),  # in the header
        }
        dashboard, master, spawned = start_dashboard(args.interval, args.size, env, args.profile)
        reader = PtyReader(master, markers)
        reader.start()
        proc = psutil.Process(dashboard.pid)

        frame_at = reader.wait_for("frame", FIRST_FRAME_TIMEOUT_S)
        if frame_at is None:
            raise SystemExit(
                "no first frame from the dashboard; its output ends with:\n"
                + reader.screen_tail()[-2000:]
            )
        data_at = reader.wait_for("data", FIRST_DATA_TIMEOUT_S)
        if data_at is None:
            print(f"warning: 'GPU {last_gpu}' never appeared on screen", file=sys.stderr)
        first_frame_s = frame_at - spawned
        first_data_s = data_at - spawned if data_at is not None else None
        rss_start_mb = proc.memory_info().rss / 2**20

        time.sleep(args.warmup)
        cpu0, threads0 = proc.cpu_times(), thread_cpu(proc)
        t0 = time.monotonic()
        rss_max = 0
        end = t0 + args.seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            rss_max = max(rss_max, proc.memory_info().rss)
        cpu1, threads1 = proc.cpu_times(), thread_cpu(proc)
        t1 = time.monotonic()
        rss = proc.memory_info().rss
        rss_max = max(rss_max, rss)
        num_threads = proc.num_threads()
        alive = dashboard.poll() is None

        wall = t1 - t0
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        main_cpu_s = threads1.get(proc.pid, 0.0) - threads0.get(proc.pid, 0.0)
        window_bytes, bursts = reader.bytes_between(t0, t1)
        agents_shown = reader.last_match("agents")
        exit_code = quit_dashboard(dashboard, master)
        reader.join(5)
    finally:
        if dashboard is not None and dashboard.poll() is None:
            dashboard.kill()
            dashboard.wait()
        if master >= 0:
            os.close(master)
        if demo is not None:
            stop_demo(demo, trainer_pids)
        shutil.rmtree(socket_dir, ignore_errors=True)

    if args.profile is not None:
        print_profile(args.profile, args.top)

    cpu_percent = 100 * cpu_s / wall
    tty_bytes_per_s = window_bytes / wall
    rss_mb = rss / 2**20
    return {
        "first_frame_s": round(first_frame_s, 3),
        "first_data_s": round(first_data_s, 3) if first_data_s is not None else None,
        "cpu_percent": round(cpu_percent, 3),
        "tty_bytes_per_s": round(tty_bytes_per_s, 1),
        "rss_mb": round(rss_mb, 1),
        "rss_max_mb": round(rss_max / 2**20, 1),
        "rss_at_first_data_mb": round(rss_start_mb, 1),
        "tty_bursts_per_s": round(bursts / wall, 2),
        "cpu_main_thread_percent": round(100 * main_cpu_s / wall, 3),
        "cpu_other_threads_percent": round(100 * (cpu_s - main_cpu_s) / wall, 3),
        "cpu_s": round(cpu_s, 3),
        "seconds": round(wall, 2),
        "warmup": args.warmup,
        "gpus": args.gpus,
        "agents": len(trainer_pids),
        "agents_on_screen": int(agents_shown) if agents_shown else None,
        "interval": args.interval,
        "size": f"{args.size[0]}x{args.size[1]}",
        "threads": num_threads,
        "alive_after_window": alive,
        "exit_code": exit_code,
        "profiled": args.profile is not None,
        "within_budget": {
            "cpu": cpu_percent < BUDGET_CPU_PCT,
            "tty_bytes": tty_bytes_per_s < BUDGET_TTY_BYTES_S,
            "first_frame": first_frame_s < BUDGET_FIRST_FRAME_S,
            "rss": rss_mb < BUDGET_RSS_MB,
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="CPU, terminal bytes, first frame, RSS of memtop")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window (s)")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs, one trainer each")
    parser.add_argument("--interval", type=float, default=1.0, help="dashboard refresh (s)")
    parser.add_argument("--size", type=parse_size, default=(120, 36), help="COLUMNSxROWS")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds after first data")
    parser.add_argument("--profile", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--top", type=int, default=25, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gpus < 1 or args.seconds <= 0 or args.interval <= 0 or args.warmup < 0:
        parser.error("--gpus must be >= 1, --seconds and --interval > 0, --warmup >= 0")

    result = run(args)
    ok = result["within_budget"]
    assert isinstance(ok, dict)

    def mark(key: str) -> str:
        return "ok" if ok[key] else "OVER BUDGET"

    print(
        f"dashboard: {result['gpus']} GPU(s), {result['agents']} agent(s) "
        f"({result['agents_on_screen']} on screen), every {args.interval:g} s, "
        f"{result['size']} terminal, window {result['seconds']} s after {args.warmup:g} s warm-up"
        + (" [under cProfile]" if args.profile else "")
    )
    print(
        f"first frame: {result['first_frame_s']:.3f} s (budget < {BUDGET_FIRST_FRAME_S} s) "
        f"{mark('first_frame')}; all GPUs on screen after {result['first_data_s']} s"
    )
    print(
        f"cpu: {result['cpu_percent']:.2f} % of one core (budget < {BUDGET_CPU_PCT:g} %) "
        f"{mark('cpu')}: main thread (UI) {result['cpu_main_thread_percent']:.2f} %, "
        f"other threads (sampler, Textual I/O) {result['cpu_other_threads_percent']:.2f} %"
    )
    print(
        f"terminal: {float(result['tty_bytes_per_s']) / 1000:.2f} KB/s in "  # type: ignore[arg-type]
        f"{result['tty_bursts_per_s']} bursts/s (budget < {BUDGET_TTY_BYTES_S // 1000} KB/s) "
        f"{mark('tty_bytes')}"
    )
    print(
        f"rss: {result['rss_mb']:.1f} MB at the end, max {result['rss_max_mb']:.1f} MB "
        f"(budget < {BUDGET_RSS_MB:g} MB) {mark('rss')}"
    )
    print(f"exit code after 'q': {result['exit_code']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
