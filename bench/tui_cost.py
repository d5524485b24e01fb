"""memtop's dashboard and nvitop side by side in one run, on the same stand-in GPUs (issues 12
and 35; the goals: memtop's CPU and bytes to the terminal ≤ 1.0× nvitop's, first data ≤ 0.2 s,
full frame ≤ 0.4 s, RSS ≤ 45 MB).

    .venv/bin/python bench/tui_cost.py [--seconds 30] [--pairs 3] [--gpus 8] [--size 120x36]
        [--scenarios healthy,mixed] [--quick] [--record DIR]
    (needs `pip install nvitop` for the comparison; --tools memtop measures memtop alone)

The stand-in GPUs, once per scenario:
- `memtop demo --no-ui --gpus N --scenario S` runs N simulated GPUs in a private socket
  directory (MEMTOP_SOCKET_DIR). `healthy`: one quiet trainer (and its real agent) on each GPU.
  `mixed`: what users look at, a screen with suggestions: one rank of a DDP job on each GPU,
  a leaking trainer beside rank 0, a fragmenting one beside the last rank and one under
  pressure beside rank 1 (11 agents on 8 GPUs).
  memtop reads them as it does in `memtop demo`: the simulated GPUs and their agents.
- `../shared/tools/fakenvml` (a libnvidia-ml.so.1 stand-in, built here with its build.sh) serves
  nvitop the same GPUs: a mirror thread writes its state file twice a second from the demo's
  registry (each GPU's used bytes, its trainer's pid and used bytes, its utilisation), so both
  tools show the same devices, the same processes and the same changing numbers.

Each tool runs in a pseudo-terminal of the given size at its default refresh (memtop 1 s,
nvitop 2 s), stdin/stdout/stderr on the pty slave; a reader thread drains the master.
- first_frame_s: from spawning to the first output that paints the tool's header ("memtop" /
  "NVITOP" on screen, escape sequences stripped). memtop paints its header row before Textual is
  imported, and the first sampling round's figures as soon as they are known (memtop.ui.splash),
  so it also reports first_data_s (until "GPU 7" is on screen, usually before Textual's frame)
  and full_frame_s, until the first frame of the whole dashboard laid out right: the process
  table's header with its USER column ("USER" on screen), which only the table laid out for its
  width draws (full_frame_marker).  Textual's first frame came before it and was not that
  frame: the view was built before the widgets were laid out, the table's rows for no width (no
  USER, CPU%, RSS or TIME column) and the suggestions worded for none (a column of "…"), laid
  out again a frame or more later; "Processes" on screen (the table's border title), the
  earlier marker, counted that wrong frame.  textual_frame_s is still reported: until
  "Processes" on screen, Textual's first frame, right or not (equal to full_frame_s, give or
  take a read of the pty, when the first frame is the right one).  For nvitop all of them are
  one time.
- The floor, a control in the same run (bench/textual_floor.py; --no-floor skips it): a Textual
  app with one line of text and nothing of memtop's, started once a pair until its first frame.
  No Textual dashboard draws sooner on the same box, so the summary also gives memtop's full
  frame and start_cpu_s (its process's CPU, all threads, by the full frame) less the floor's:
  what memtop's own start adds, a figure that moves less with the box than the absolute goal.
- The runs begin --settle s (30) after the demo: its first half minute (the leak detector
  gathering samples, suggestions coming and re-ranking, sparklines filling) would otherwise be
  charged to whichever tool goes first.
- After --warmup s, a window of --seconds: the tool's user+system CPU over the wall time, the
  bytes read from the pty in the window, and its RSS at the end.  Then "q".
- The tools take turns, --pairs times, the order alternating (m n, n m, m n …), so drift in the
  machine's load (the box is shared) falls on both; medians are compared, and every run printed
  with the load average at its start (judge the ratios more than the absolute figures).
- --quick: 1 pair of 10 s windows after 2 s of warm-up, for iterating; not for the figures.
- memtop's modules are compiled to bytecode first, as an installed memtop's are (pip compiles
  them; nvitop's are): a checkout never run, or run with PYTHONDONTWRITEBYTECODE (this box's
  shells set it), compiled ~100 modules at every start, ~0.15 s of CPU counted as the start's.
- --record DIR: each run's terminal output kept as DIR/SCENARIO-TOOL-N.tty (the measured window
  marked); bench/tty_where.py says where the bytes went, row by row and column by column.

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from memtop.base import children  # noqa: E402
from memtop.sim.scenario_names import DEMO_SCENARIOS  # noqa: E402

GOAL_CPU_RATIO = 1.0  # memtop's CPU / nvitop's
GOAL_TTY_RATIO = 1.0  # memtop's bytes to the terminal / nvitop's
GOAL_FIRST_DATA_S = 0.2  # every GPU's figures on screen
GOAL_FULL_FRAME_S = 0.4  # Textual's first frame
GOAL_RSS_MB = 45.0
SCENARIOS = ("healthy", "mixed")
# The stand-in's sources: beside the checkout (../shared/tools/fakenvml), or two levels up from
# a worktree (/work/wt/NAME -> /work/shared), or where FAKENVML_DIR says.
FAKENVML = next(
    (
        path
        for path in (
            *([Path(os.environ["FAKENVML_DIR"])] if os.environ.get("FAKENVML_DIR") else []),
            ROOT.parent / "shared" / "tools" / "fakenvml",
            ROOT.parent.parent / "shared" / "tools" / "fakenvml",
        )
        if (path / "build.sh").is_file()
    ),
    ROOT.parent / "shared" / "tools" / "fakenvml",
)
MIRROR_HZ = 2.0

DEMO_READY_TIMEOUT_S = 60.0
# The demo's first half minute is a start of its own: the leak detector gathers samples, the
# suggestions come and re-rank, every sparkline fills.  Whichever tool is measured first would be
# charged with it (memtop, in the first pair), so the runs begin after it (--settle).
SETTLE_S = 30.0
FIRST_FRAME_TIMEOUT_S = 30.0
FIRST_DATA_TIMEOUT_S = 30.0
QUIT_TIMEOUT_S = 10.0
TAIL_BYTES = 64 * 1024
BURST_GAP_S = 0.01  # chunks closer than this belong to one burst of output (about one frame)
DEMO = children.python_command("memtop", "demo", "--no-ui")

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
        self.recording: list[tuple[float, bytes]] | None = None  # (time, data) with --record
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
                if self.recording is not None:
                    self.recording.append((now, data))
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


# memtop's layout is compact under 100 columns or 30 rows (memtop.ui.app.COMPACT_WIDTH and
# COMPACT_HEIGHT; not imported here: it imports Textual).
COMPACT_SIZE = (100, 30)


def full_frame_marker(size: tuple[int, int]) -> re.Pattern[bytes]:
    """What only memtop's whole dashboard laid out right has on screen at a terminal `size`: the
    process table's header with its USER column.  Every layout that is not compact shows USER
    (the last column a narrow table drops, below 94 cells of content); a table laid out for a
    width it does not have (0, before Textual's first layout) has none.  A compact layout never
    shows USER: there, the table's border title ("Processes"), which any frame of it shows.
    The word alone, not the header's run of labels: a frame after the first goes out as the cells
    that changed (memtop.ui.cell_diff), and a header laid out again keeps its "PID" cells."""
    if size[0] >= COMPACT_SIZE[0] and size[1] >= COMPACT_SIZE[1]:
        return re.compile(rb"\bUSER\b")
    return re.compile(rb"Processes")


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


def start_demo(
    gpus: int, scenario: str, env: dict[str, str]
) -> tuple[subprocess.Popen[str], list[int]]:
    demo = subprocess.Popen(
        [*DEMO, "--gpus", str(gpus), "--scenario", scenario],
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
    children.stop(demo, signal.SIGINT, timeout=15)
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


def compile_bytecode(package: Path) -> None:
    """`package`'s modules compiled to __pycache__ now, whatever PYTHONDONTWRITEBYTECODE says: the
    dashboard measured then starts as an installed one does, from bytecode."""
    import compileall

    compileall.compile_dir(str(package), quiet=1)


def build_fakenvml(out: Path) -> Path:
    subprocess.run(
        ["bash", str(FAKENVML / "build.sh"), str(out)], check=True, capture_output=True, text=True
    )
    return out


class Mirror(threading.Thread):
    """Writes fakenvml's state file from the demo's simulated GPUs, MIRROR_HZ times a second."""

    def __init__(self, socket_dir: Path, state: Path) -> None:
        super().__init__(daemon=True)
        from memtop.sim.devices_view import SimulatedDeviceSource

        self.source = SimulatedDeviceSource(socket_dir)
        self.state = state
        self.stop = threading.Event()
        self.write()

    def write(self) -> None:
        reading = self.source.read()
        lines = []
        for d in reading.devices:
            util = d.utilization_percent or 0
            lines.append(f"gpu {d.index} {d.total_bytes} {d.used_bytes or 0} {util} {d.name}")
            for p in d.processes:
                lines.append(f"proc {d.index} {p.pid} {p.used_bytes or 0}")
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.state)

    def run(self) -> None:
        while not self.stop.wait(1 / MIRROR_HZ):
            with contextlib.suppress(OSError):
                self.write()


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


def measure(
    tool: str,
    args: argparse.Namespace,
    env: dict[str, str],
    last_gpu: int,
    record: Path | None = None,
) -> dict[str, object]:
    """One run of one tool in a pty: first frame, then CPU, terminal bytes and RSS over the
    window; with `record`, everything it wrote, to that file (save_recording)."""
    if tool == "memtop":
        command = children.python_command("memtop")
        if args.memtop_interval is not None:
            command += ["--interval", str(args.memtop_interval)]
        markers = {
            "frame": re.compile(rb"memtop"),
            "textual": re.compile(rb"Processes"),  # Textual's first frame, right or not
            "full": full_frame_marker(args.size),  # the first one laid out right
            "data": re.compile(rb"GPU ?%d\b" % last_gpu),
        }
    else:
        command = children.python_command("nvitop")
        markers = {k: re.compile(rb"NVITOP") for k in ("frame", "textual", "full", "data")}
    load = round(os.getloadavg()[0], 2)
    spawned = time.monotonic()
    process, master = children.start_in_terminal(command, args.size, env)
    reader = PtyReader(master, markers)
    if record is not None:
        reader.recording = []
    reader.start()
    try:
        proc = psutil.Process(process.pid)
        frame_at = reader.wait_for("frame", FIRST_FRAME_TIMEOUT_S)
        if frame_at is None:
            raise SystemExit(
                f"no first frame from {tool}; its output ends with:\n"
                + reader.screen_tail()[-2000:]
            )
        full_at = reader.wait_for("full", FIRST_DATA_TIMEOUT_S)
        start_cpu = proc.cpu_times()  # all threads' CPU by the full frame (read just after it)
        textual_at = reader.wait_for("textual", FIRST_DATA_TIMEOUT_S)
        data_at = reader.wait_for("data", FIRST_DATA_TIMEOUT_S)
        time.sleep(args.warmup)
        cpu0 = proc.cpu_times()
        t0 = time.monotonic()
        time.sleep(args.seconds)
        cpu1 = proc.cpu_times()
        t1 = time.monotonic()
        rss = proc.memory_info().rss
        window_bytes, bursts = reader.bytes_between(t0, t1)
        if record is not None:
            with reader.lock:
                save_recording(record, args.size, t0, t1, list(reader.recording or ()))
        exit_code = quit_dashboard(process, master)
        reader.join(5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
    wall = t1 - t0
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "first_frame_s": round(frame_at - spawned, 3),
        "full_frame_s": round(full_at - spawned, 3) if full_at is not None else None,
        "textual_frame_s": round(textual_at - spawned, 3) if textual_at is not None else None,
        "first_data_s": round(data_at - spawned, 3) if data_at is not None else None,
        "start_cpu_s": round(start_cpu.user + start_cpu.system, 3),
        "cpu_percent": round(100 * cpu_s / wall, 3),
        "tty_bytes_per_s": round(window_bytes / wall, 1),
        "tty_bursts_per_s": round(bursts / wall, 2),
        "rss_mb": round(rss / 2**20, 1),
        "seconds": round(wall, 2),
        "load_1min": load,
        "exit_code": exit_code,
    }


def measure_floor(args: argparse.Namespace, env: dict[str, str]) -> dict[str, object]:
    """One start of the control (bench/textual_floor.py, a Textual app with nothing of
    memtop's) until its first frame: its wall time and its CPU by then."""
    load = round(os.getloadavg()[0], 2)
    spawned = time.monotonic()
    process, master = children.start_in_terminal(
        [sys.executable, str(Path(__file__).with_name("textual_floor.py"))], args.size, env
    )
    reader = PtyReader(master, {"frame": re.compile(rb"textual floor USER")})
    reader.start()
    try:
        frame_at = reader.wait_for("frame", FIRST_FRAME_TIMEOUT_S)
        cpu = psutil.Process(process.pid).cpu_times()
        if frame_at is None:
            raise SystemExit("no first frame from the bare Textual app:\n" + reader.screen_tail())
    finally:
        process.kill()
        process.wait()
        os.close(master)
    return {
        "first_frame_s": round(frame_at - spawned, 3),
        "start_cpu_s": round(cpu.user + cpu.system, 3),
        "load_1min": load,
    }


RECORD_MAGIC = b"memtop-tty-1\n"


def save_recording(
    path: Path, size: tuple[int, int], start: float, end: float, chunks: list[tuple[float, bytes]]
) -> None:
    """What a tool wrote to its terminal, chunk by chunk, for bench/tty_where.py: a header
    line (JSON: the size and the measured window, in seconds from the first chunk), then each
    chunk as its time (float64) and length (uint32), then its bytes."""
    origin = chunks[0][0] if chunks else start
    header = {"columns": size[0], "rows": size[1], "start": start - origin, "end": end - origin}
    with path.open("wb") as out:
        out.write(RECORD_MAGIC + json.dumps(header).encode() + b"\n")
        for at, data in chunks:
            out.write(struct.pack("<dI", at - origin, len(data)) + data)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def run(args: argparse.Namespace, scenario: str) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="mt-tui-"))
    workdir.chmod(0o700)
    socket_dir = workdir / "s"
    socket_dir.mkdir(mode=0o700)
    env = child_env(socket_dir)
    demo: subprocess.Popen[str] | None = None
    trainer_pids: list[int] = []
    mirror: Mirror | None = None
    runs: dict[str, list[dict[str, object]]] = {tool: [] for tool in args.tools}
    floors: list[dict[str, object]] = []
    try:
        demo, trainer_pids = start_demo(args.gpus, scenario, env)
        print(
            f"demo {scenario}: {len(trainer_pids)} simulated trainer(s) with agents on "
            f"{args.gpus} simulated GPU(s), pid {demo.pid}",
            flush=True,
        )
        time.sleep(args.settle)
        nvitop_env = dict(env)
        if "nvitop" in args.tools:
            lib = build_fakenvml(workdir / "fakenvml")
            state = workdir / "fakenvml.state"
            sys.path.insert(0, str(ROOT))
            mirror = Mirror(socket_dir, state)
            mirror.start()
            nvitop_env.update(
                LD_LIBRARY_PATH=os.pathsep.join(
                    filter(None, [str(lib), env.get("LD_LIBRARY_PATH")])
                ),
                FAKE_NVML_STATE=str(state),
            )
        for pair in range(args.pairs):
            if args.floor:
                floors.append(measure_floor(args, env))
                print(
                    f"  run {pair + 1} floor : a bare Textual app's first frame "
                    f"{floors[-1]['first_frame_s']:.3f} s, cpu by then "
                    f"{floors[-1]['start_cpu_s']} s, load {floors[-1]['load_1min']}",
                    flush=True,
                )
            order = list(args.tools) if pair % 2 == 0 else list(reversed(args.tools))
            for tool in order:
                record = args.record / f"{scenario}-{tool}-{pair + 1}.tty" if args.record else None
                one = measure(
                    tool, args, nvitop_env if tool == "nvitop" else env, args.gpus - 1, record
                )
                runs[tool].append(one)
                print(
                    f"  run {pair + 1} {tool:<6}: first frame {one['first_frame_s']:.3f} s "
                    f"(full {one['full_frame_s']} s, Textual's first "
                    f"{one['textual_frame_s']} s, data {one['first_data_s']} s), "
                    f"cpu {one['cpu_percent']:.2f} %, "
                    f"{float(one['tty_bytes_per_s']) / 1000:.2f} KB/s, "  # type: ignore[arg-type]
                    f"rss {one['rss_mb']} MB, load {one['load_1min']}",
                    flush=True,
                )
    finally:
        if mirror is not None:
            mirror.stop.set()
        if demo is not None:
            stop_demo(demo, trainer_pids)
        shutil.rmtree(workdir, ignore_errors=True)

    keys = (
        "first_frame_s",
        "first_data_s",
        "full_frame_s",
        "textual_frame_s",
        "start_cpu_s",
        "cpu_percent",
        "tty_bytes_per_s",
        "rss_mb",
        "load_1min",
    )
    medians = {
        tool: {
            k: median([float(r[k]) for r in rs if r.get(k) is not None])  # type: ignore[arg-type]
            for k in keys
            if any(r.get(k) is not None for r in rs)
        }
        for tool, rs in (*runs.items(), *((("floor", floors),) if floors else ()))
    }
    result: dict[str, object] = {
        "scenario": scenario,
        "gpus": args.gpus,
        "agents": len(trainer_pids),
        "size": f"{args.size[0]}x{args.size[1]}",
        "memtop_interval_s": args.memtop_interval or 1.0,
        "seconds": args.seconds,
        "pairs": args.pairs,
        "runs": runs,
        "floor_runs": floors,
        "median": medians,
    }
    m = medians.get("memtop")
    if m is not None:
        goals: dict[str, bool] = {
            "first_data": m.get("first_data_s", float("inf")) <= GOAL_FIRST_DATA_S,
            "full_frame": m.get("full_frame_s", float("inf")) <= GOAL_FULL_FRAME_S,
            "rss": m["rss_mb"] <= GOAL_RSS_MB,
        }
        n = medians.get("nvitop")
        if n is not None:
            ratios = {
                k: round(m[k] / n[k], 2) if n[k] else None
                for k in ("cpu_percent", "tty_bytes_per_s", "first_frame_s", "rss_mb")
            }
            result["ratios"] = ratios
            cpu_ratio, tty_ratio = ratios["cpu_percent"], ratios["tty_bytes_per_s"]
            goals["cpu"] = cpu_ratio is not None and cpu_ratio <= GOAL_CPU_RATIO
            goals["tty_bytes"] = tty_ratio is not None and tty_ratio <= GOAL_TTY_RATIO
        result["goals_met"] = goals
    return result


def print_summary(args: argparse.Namespace, result: dict[str, object]) -> None:
    medians = result["median"]
    assert isinstance(medians, dict)
    print(
        f"\n{result['scenario']}: {result['gpus']} GPU(s), {result['agents']} agent(s), "
        f"{result['size']} terminal, "
        f"{args.seconds:g} s windows, {args.pairs} interleaved run(s) each; medians:"
    )
    print(
        f"{'':14}"
        + "".join(f"{tool:>12}" for tool in medians)
        + ("       ratio" if "ratios" in result else "")
    )
    ratios = result.get("ratios") or {}
    assert isinstance(ratios, dict)
    for key, label, unit in (
        ("cpu_percent", "cpu", "%"),
        ("tty_bytes_per_s", "terminal", "B/s"),
        ("first_frame_s", "first frame", "s"),
        ("first_data_s", "first data", "s"),
        ("full_frame_s", "full frame", "s"),
        ("textual_frame_s", "Textual", "s"),
        ("start_cpu_s", "start cpu", "s"),
        ("rss_mb", "rss", "MB"),
    ):
        row = f"{label + ' (' + unit + ')':<14}" + "".join(
            f"{'-':>12}"
            if key not in medians[tool]
            else f"{medians[tool][key]:>12.3f}"
            if key != "tty_bytes_per_s"
            else f"{medians[tool][key]:>12.0f}"
            for tool in medians
        )
        if key in ratios:
            row += f"{ratios[key]:>11}×"
        print(row)
    floor, own = medians.get("floor"), medians.get("memtop")
    if floor and own and "full_frame_s" in own:
        print(
            f"memtop's full frame less a bare Textual app's first frame (the floor, same box, "
            f"same run): {own['full_frame_s'] - floor['first_frame_s']:.3f} s, "
            f"cpu {own['start_cpu_s'] - floor['start_cpu_s']:.3f} s"
        )
    goals = result.get("goals_met") or {}
    assert isinstance(goals, dict)
    print(
        "goals (memtop cpu and terminal <= 1.0x nvitop, first data <= 0.2 s, full frame <= 0.4 s,"
        " rss <= 45 MB): " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in goals.items())
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="memtop's dashboard cost beside nvitop's")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window (s)")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved runs of each tool")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs, one trainer each")
    parser.add_argument("--size", type=parse_size, default=(120, 36), help="COLUMNSxROWS")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds after first frame")
    parser.add_argument(
        "--memtop-interval",
        type=float,
        default=None,
        help="memtop's refresh in s (default: its own, 1 s; 2 compares at nvitop's refresh)",
    )
    parser.add_argument(
        "--tools", default="memtop,nvitop", help="comma-separated: memtop, nvitop (default both)"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated demo scenarios, each measured in turn (default healthy,mixed)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        help=f"seconds between the demo's start and the first run (default {SETTLE_S:g})",
    )
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="save each run's terminal output to DIR/SCENARIO-TOOL-N.tty (see bench/tty_where.py)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 pair of 10 s windows, 2 s warm-up (iterating)"
    )
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the control: a bare Textual app's first frame, once a pair (the floor of any "
        "Textual dashboard's start on this box)",
    )
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.pairs, args.warmup = 10.0, 1, 2.0
    args.tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if not set(args.tools) <= {"memtop", "nvitop"} or not args.tools:
        parser.error("--tools takes memtop and/or nvitop")
    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not set(args.scenarios) <= set(DEMO_SCENARIOS) or not args.scenarios:
        parser.error(f"--scenarios takes some of {', '.join(DEMO_SCENARIOS)}")
    if args.gpus < 1 or args.seconds <= 0 or args.pairs < 1 or args.warmup < 0:
        parser.error("--gpus and --pairs must be >= 1, --seconds > 0, --warmup >= 0")
    if "nvitop" in args.tools and importlib.util.find_spec("nvitop") is None:
        parser.error("nvitop is not installed here: pip install nvitop (or --tools memtop)")

    compile_bytecode(ROOT / "memtop")
    results = {scenario: run(args, scenario) for scenario in args.scenarios}
    for result in results.values():
        print_summary(args, result)
    last = results[args.scenarios[-1]]
    # The last line: one JSON object, each scenario's figures under "scenarios" and the last
    # one's also at the top level (as before there were scenarios).
    print(json.dumps({**last, "scenarios": results}))
    return 0


if __name__ == "__main__":
    # Stopped by `timeout` (SIGTERM) or a closed terminal, it stops its demo, the trainers and
    # the dashboard it started (each in a session of its own: no signal reaches them by itself).
    sys.exit(children.run_stopping_children(main))
