"""Soak: real torch trainers under `memtop run`, hammered by viewers, beside a control group.

    .venv/bin/python bench/soak.py [--trainers 4] [--viewers 4] [--seconds 300] [--device cpu|cuda]
                                   [--hostile N]

What it runs, all at once for `--seconds`:
- N trainers under `memtop run` (the agent inside), and N control trainers without an agent.
  Each is a real training loop (an MLP, AdamW, `zero_grad(set_to_none=True)`, one torch
  thread) with PYTHONFAULTHANDLER=1, so a crash leaves its C stack on stderr.  On CPU the agent
  is told to count CPU tensors in its breakdown (MEMTOP_BREAKDOWN_DEVICE=cpu), so the walk over
  the optimizer's tensors that once crashed trainers really runs.
- M viewer processes (they never import torch, like memtop): each keeps one connection to every
  agent and sends `sample` at 10 Hz, and between samples `breakdown`, `snapshot` (to a file),
  `cleanup`, `reset_peak`, `sites` (stacks on, with its history) and `tune` (expandable
  segments switched, the cache emptied) as fast as the agent allows
  (it answers `rate_limited` when not).

What it prints, JSON last:
- trainer crashes (a non-zero exit, a signal or a faulthandler dump): must be 0;
- step rate of the agent group over the control group (mean steps/s): must be >= 0.99;
- every breakdown checked against the truth the trainer knows: gradients equal the trainable
  parameters' bytes, and parameters + gradients + optimizer state + other == allocated;
- replies by kind and error code, the agent threads' CPU time as a share of their trainer's,
  trainer threads and fds at the start and the end (must stay flat).

`--hostile N` adds N hostile client processes (same uid, as an attacker on the box would be):
each connects to every agent in turn, sends one 64 KiB frame nested ~32 000 deep, reads what
comes back and reconnects at once, for the whole run.  The agent must reject those frames in
bounded time and govern the churn across connections, so the trainers keep their step rate.

`--inject-race` adds, in the agent group, a thread that walks the optimizer's tensors in a loop,
as the agent's breakdown once did on its own thread (shared/gpu/race.py): the soak must report
crashes then.  That is how we know it can see one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from memtop.base import children  # noqa: E402

SAMPLE_HZ = 10.0
CRASH_MARKERS = ("Fatal Python error", "Segmentation fault", "Aborted", "INTERNAL ASSERT")


# ---------------------------------------------------------------------------------- trainer


def trainer_main(seconds: float, device: str, inject_race: bool, width: int) -> int:
    """A training loop; prints one JSON line with its step count, parameter bytes and rate."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(os.getpid())
    layers: list[Any] = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    for p in model[0].parameters():
        p.requires_grad_(False)  # frozen layers: gradients must equal the *trainable* bytes
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    if inject_race:
        from memtop.agent.torch_probe import count_optimizer_memory

        def walker() -> None:
            while True:
                count_optimizer_memory([optimizer], device)
                time.sleep(0.0005)

        threading.Thread(target=walker, daemon=True).start()
    batch = torch.randn(64, width, device=device)
    steps = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch).square().mean()
        loss.backward()
        optimizer.step()
        steps += 1
    elapsed = time.perf_counter() - started
    if device == "cuda":
        torch.cuda.synchronize()
    truth = {
        "steps": steps,
        "seconds": elapsed,
        "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    print(json.dumps(truth), flush=True)
    return 0


# ---------------------------------------------------------------------------------- viewer


def viewer_main(pids: list[int], directory: Path, seconds: float, out_dir: Path) -> int:
    """Hammer every agent; print one JSON line of counts and breakdowns seen."""
    from memtop.sources.agents import (
        SAMPLE_MAX_MARKS,
        AgentClient,
        AgentError,
        AgentUnreachable,
    )

    counts: Counter[str] = Counter()
    breakdowns: dict[int, list[dict[str, Any]]] = {pid: [] for pid in pids}
    # Two connections per agent from two threads, as a dashboard plus a script would be:
    # samples at 10 Hz on one, the hammering on the other.  The agent meters each connection
    # on its own, and pauses the heavy ones first when its CPU bound is reached.
    clients: dict[tuple[int, str], AgentClient] = {}
    deadline = time.monotonic() + seconds
    extra = ("breakdown", "snapshot", "cleanup", "reset_peak", "sites", "tune")
    lock = threading.Lock()

    def ask(pid: int, role: str, cmd: str, args: dict[str, Any]) -> dict[str, Any] | None:
        client = clients.get((pid, role))
        if client is None:
            client = AgentClient(pid, directory, timeout=5.0)
            try:
                client.connect()
            except (AgentUnreachable, AgentError) as exc:
                with lock:
                    counts[f"connect:{type(exc).__name__}"] += 1
                return None
            clients[(pid, role)] = client
        try:
            result = client.request(cmd, args or None, timeout=10.0)
        except AgentError as exc:
            with lock:
                counts[f"{cmd}:{exc.code}"] += 1
            return None
        except AgentUnreachable:
            with lock:
                counts[f"{cmd}:unreachable"] += 1
            client.close()
            clients.pop((pid, role), None)
            return None
        with lock:
            counts[f"{cmd}:ok"] += 1
        return result if isinstance(result, dict) else {}

    # Every trainer exited (crashed: the --inject-race run's at its first steps): nothing is left
    # to hammer, and the rest of the window went on connect attempts every 2 ms to sockets
    # nobody serves (the race soak's viewer: ~5 s of a busy core).
    everyone_gone = threading.Event()

    def sampler() -> None:
        next_sample = time.monotonic()
        while time.monotonic() < deadline and not everyone_gone.is_set():
            for pid in pids:
                # As the dashboard asks (max_marks: the window it reads).
                ask(
                    pid,
                    "sample",
                    "sample",
                    {"max_marks": SAMPLE_MAX_MARKS, "mark_layout": "columns"},
                )
            next_sample = max(next_sample + 1.0 / SAMPLE_HZ, time.monotonic() - 1.0)
            time.sleep(max(0.0, next_sample - time.monotonic()))

    sampling = threading.Thread(target=sampler, daemon=True)
    sampling.start()
    turn = 0
    next_look = time.monotonic()
    while time.monotonic() < deadline:
        if time.monotonic() >= next_look:
            if all(map(_exited, pids)):
                everyone_gone.set()
                break
            next_look = time.monotonic() + 0.2
        for pid in pids:
            cmd = extra[turn % len(extra)]
            args: dict[str, Any] = {}
            if cmd == "snapshot":
                args = {"path": str(out_dir / f"snap-{pid}.pickle"), "overwrite": True}
            if cmd == "cleanup":
                args = {"wait_s": 2.0}
            if cmd == "tune":
                # The allocator's settings switched at a step boundary, the cache emptied too
                # (`memtop tune PID expandable_segments=… --empty-cache`).
                on = (turn // len(extra)) % 2 == 0
                args = {"set": {"expandable_segments": on}, "empty_cache": True, "wait_s": 2.0}
            if cmd == "sites":
                # Stack recording asked on, as the dashboard's key does, and every time the
                # kept rounds too (the heaviest `sites` reply: a connection's first).
                args = {"stacks": True, "history": True}
            result = ask(pid, "hammer", cmd, args)
            fresh = (
                cmd == "breakdown"
                and result
                and result.get("devices")
                and not result.get("pending")
            )
            if fresh and (not breakdowns[pid] or breakdowns[pid][-1]["time"] != result["time"]):
                breakdowns[pid].append(result)
        turn += 1
        time.sleep(0.002)  # as fast as allowed, without spinning a core on rate_limited
    sampling.join(timeout=15)
    for client in clients.values():
        client.close()
    print(json.dumps({"counts": counts, "breakdowns": breakdowns}), flush=True)
    return 0


def _exited(pid: int) -> bool:
    """The process has exited: gone, or a zombie its parent (the soak) has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------------------------- hostile


def hostile_frame(size: int = 64 << 10) -> bytes:
    """A frame as large as the agent reads (64 KiB), a request whose args nest as deep as fits:
    the costliest shape for a depth check that builds or peels (issue 27, finding 4)."""
    head, tail = b'{"id":1,"cmd":"sample","args":', b"}"
    depth = (size - len(head) - len(tail)) // 2
    body = head + b"[" * depth + b"]" * depth + tail
    return len(body).to_bytes(4, "big") + body


def hostile_main(pids: list[int], directory: Path, seconds: float) -> int:
    """Reconnect to every agent in a loop, one deep 64 KiB frame per connection; print counts."""
    import socket

    from memtop import protocol

    frame = hostile_frame()
    counts: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for pid in pids:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(2.0)
            try:
                sock.connect(str(directory / f"{pid}.sock"))
                counts["connects"] += 1
                with contextlib.suppress(OSError):  # refused unread: the agent hung up
                    sock.sendall(frame)
                reply = protocol.recv_message(sock)
                error = reply.get("error") or {}
                counts[f"reply:{error.get('code', 'result')}"] += 1
            except (OSError, protocol.ProtocolError, protocol.ConnectionClosed) as exc:
                counts[f"failed:{type(exc).__name__}"] += 1
            finally:
                sock.close()
    print(json.dumps({"counts": counts}), flush=True)
    return 0


# ---------------------------------------------------------------------------------- driver


def _proc_counts(pid: int) -> tuple[int, int] | None:
    try:
        return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _cpu_ticks(path: str) -> int:
    try:
        with open(path) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def _agent_threads(pid: int) -> list[int]:
    """The agent's threads: every thread of the trainer but its main one."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    except OSError:
        return []


def _more_fds(pid: int, before: tuple[int, int] | None) -> bool:
    now = _proc_counts(pid)
    return now is not None and before is not None and now[1] > before[1]


def _agent_thread_id(pid: int, sockets: Path) -> int | None:
    """The agent thread's native id from its `hello` (None from an agent that does not say)."""
    from memtop.sources.agents import AgentClient

    try:
        with AgentClient(pid, directory=sockets, timeout=5) as client:
            client.connect()
            tid = client.request("hello", timeout=5).get("agent_thread_id")
    except Exception:
        return None
    return tid if isinstance(tid, int) and tid > 0 else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="mt-soak-"))
    sockets = work / "s"
    sockets.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["MEMTOP_SOCKET_DIR"] = str(sockets)
    if args.device == "cpu":
        env["MEMTOP_BREAKDOWN_DEVICE"] = "cpu"
    me = [sys.executable, str(Path(__file__).resolve())]
    trainer_args = ["--trainer", "--seconds", str(args.seconds), "--device", args.device]
    trainer_args += ["--width", str(args.width)]
    if args.inject_race:
        trainer_args.append("--inject-race")
    agents: list[subprocess.Popen[str]] = []
    controls: list[subprocess.Popen[str]] = []
    viewers: list[subprocess.Popen[str]] = []
    try:
        return _soak(args, work, sockets, env, me, trainer_args, agents, controls, viewers)
    finally:  # interrupted (Ctrl-C, `timeout`): nothing it started runs on
        children.stop_all([*viewers, *agents, *controls], signal.SIGTERM)
        shutil.rmtree(work, ignore_errors=True)


def _soak(
    args: argparse.Namespace,
    work: Path,
    sockets: Path,
    env: dict[str, str],
    me: list[str],
    trainer_args: list[str],
    agents: list[subprocess.Popen[str]],
    controls: list[subprocess.Popen[str]],
    viewers: list[subprocess.Popen[str]],
) -> dict[str, Any]:
    for _ in range(args.trainers):
        command = children.python_command("memtop", "run", str(Path(__file__).resolve()))
        agents.append(_spawn(command + trainer_args, env, work))
        if not args.no_control:
            controls.append(_spawn(me + trainer_args, env, work))
    pids = [p.pid for p in agents]
    deadline = time.monotonic() + 60
    while not all((sockets / f"{pid}.sock").exists() for pid in pids):
        if time.monotonic() > deadline or any(p.poll() is not None for p in agents):
            break
        time.sleep(0.05)
    # The window starts once every trainer steps: under `memtop run` the agent listens before
    # the program has imported torch (seconds; tens of them on a loaded box), and viewers
    # started then spent their window on a trainer that had not begun (two suites at once saw
    # no breakdown in 12 s), its descriptors counted in the middle of torch's import.
    _wait_stepping(agents, sockets, deadline)
    before = {pid: _proc_counts(pid) for pid in pids}
    agent_tids = {pid: _agent_thread_id(pid, sockets) for pid in pids}
    # That connection is closed; the agent closes its end when it reads the EOF, which a loaded
    # box may not have done yet: the fd counts start once it has (at most 3 s), so the soak's
    # own look at the agents is not counted as a descriptor the viewers cost.
    settle = time.monotonic() + 3.0
    while time.monotonic() < settle and any(
        (now := _proc_counts(pid)) is not None
        and (old := before[pid]) is not None
        and now[1] > old[1]
        for pid in pids
    ):
        time.sleep(0.05)
    start_counts = {pid: _proc_counts(pid) for pid in pids}
    viewer_command = [*me, "--viewer", "--seconds", str(args.seconds - 2), "--socket-dir"]
    viewer_command += [str(sockets), "--out", str(work), "--pids", ",".join(map(str, pids))]
    viewers.extend(_spawn(viewer_command, env, work) for _ in range(args.viewers))
    hostile_command = [*me, "--hostile-client", "--seconds", str(args.seconds - 2)]
    hostile_command += ["--socket-dir", str(sockets), "--pids", ",".join(map(str, pids))]
    hostiles = [_spawn(hostile_command, env, work) for _ in range(args.hostile)]
    viewers.extend(hostiles)  # stopped with the viewers when the soak is interrupted
    # Thread and fd counts, and agent CPU, sampled while the soak runs.
    end_counts: dict[int, tuple[int, int] | None] = {}
    max_counts: dict[int, tuple[int, int]] = {}
    agent_ticks: dict[int, dict[int, int]] = {pid: {} for pid in pids}
    while any(p.poll() is None for p in agents + controls):
        for pid in pids:
            counts = _proc_counts(pid)
            if counts is not None:
                end_counts[pid] = counts
                old = max_counts.get(pid, (0, 0))
                max_counts[pid] = (max(old[0], counts[0]), max(old[1], counts[1]))
                # The agent's own thread, as its hello names it: on CUDA a trainer has threads
                # of its own (autograd's device thread, the driver's), which counted as the
                # agent's here once (37 % "agent CPU" on an H200).  Every non-main thread where
                # an agent does not say which is its own.
                tid_named = agent_tids.get(pid)
                for tid in [tid_named] if tid_named else _agent_threads(pid):
                    ticks = _cpu_ticks(f"/proc/{pid}/task/{tid}/stat")
                    if ticks:
                        agent_ticks[pid][tid] = ticks
                total = _cpu_ticks(f"/proc/{pid}/stat")
                if total:
                    agent_ticks[pid][0] = total
        time.sleep(0.5)
    results = {"agent": [_finish(p) for p in agents], "control": [_finish(p) for p in controls]}
    viewer_out = [_finish(p, timeout=30) for p in viewers if p not in hostiles]
    hostile_out = [_finish(p, timeout=30) for p in hostiles]
    report = _report(args, results, viewer_out, start_counts, end_counts, max_counts, agent_ticks)
    hostile_counts: Counter[str] = Counter()
    for out in hostile_out:
        hostile_counts.update(out.get("counts", {}))
    report["hostile"] = args.hostile
    report["hostile_counts"] = dict(hostile_counts)
    return report


def _wait_stepping(agents: list[subprocess.Popen[str]], sockets: Path, deadline: float) -> None:
    """Until each agent's sample names a step (its trainer's first optimizer step is done), its
    trainer has exited, or `deadline` (monotonic) has passed."""
    from memtop.sources.agents import AgentClient

    for process in agents:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with AgentClient(process.pid, directory=sockets, timeout=5) as client:
                    client.connect()
                    while client.sample().step is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                    break
            except Exception:  # not listening yet, or gone: looked at again
                time.sleep(0.1)


def _spawn(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    parsed: dict[str, Any] = {}
    for line in reversed(out.strip().splitlines()):
        try:
            parsed = json.loads(line)
            break
        except ValueError:
            continue
    crashed = proc.returncode != 0 or any(marker in err for marker in CRASH_MARKERS)
    why = ""
    if crashed:
        code = proc.returncode
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        why += ": " + " | ".join(err.strip().splitlines()[-3:])[:300]
    return {"pid": proc.pid, "crashed": crashed, "why": why, **parsed}


def _report(
    args: argparse.Namespace,
    results: dict[str, list[dict[str, Any]]],
    viewers: list[dict[str, Any]],
    start_counts: dict[int, tuple[int, int] | None],
    end_counts: dict[int, tuple[int, int] | None],
    max_counts: dict[int, tuple[int, int]],
    agent_ticks: dict[int, dict[int, int]],
) -> dict[str, Any]:
    def rate(group: str) -> float:
        rates = [r["steps"] / r["seconds"] for r in results[group] if "steps" in r]
        return statistics.fmean(rates) if rates else 0.0

    crashes = [r for group in results.values() for r in group if r["crashed"]]
    counts: Counter[str] = Counter()
    bad_breakdowns = []
    checked = 0
    by_pid = {r["pid"]: r for r in results["agent"]}
    for viewer in viewers:
        counts.update(viewer.get("counts", {}))
        for pid_text, seen in viewer.get("breakdowns", {}).items():
            truth = by_pid.get(int(pid_text), {})
            for breakdown in seen:
                for parts in breakdown["devices"].values():
                    checked += 1
                    total = (
                        parts["parameters"]
                        + parts["gradients"]
                        + parts["optimizer_state"]
                        + parts["other"]
                    )
                    # The optimizer holds only the trainable parameters: frozen ones are
                    # "other" to it.  Gradients exist exactly for the trainable ones.
                    ok = parts["gradients"] == truth.get("trainable_bytes") and (
                        parts["parameters"] == truth.get("trainable_bytes")
                    )
                    if args.device == "cuda":
                        ok = ok and total == parts["allocated"]
                    if not ok:
                        bad_breakdowns.append(parts)
    shares = []
    for ticks in agent_ticks.values():
        total = ticks.pop(0, 0)
        if total:
            shares.append(sum(ticks.values()) / total)
    control_rate, agent_rate = rate("control"), rate("agent")
    ratio = agent_rate / control_rate if control_rate else None  # None: no control group
    errors = {k: v for k, v in counts.items() if not k.endswith(":ok")}
    return {
        "device": args.device,
        "trainers": args.trainers,
        "viewers": args.viewers,
        "seconds": args.seconds,
        "inject_race": args.inject_race,
        "crashes": len(crashes),
        "crash_reasons": [c["why"] for c in crashes][:8],
        "viewer_failures": [v["why"] for v in viewers if v["crashed"]][:4],
        "step_rate_agent": round(agent_rate, 2),
        "step_rate_control": round(control_rate, 2),
        "step_rate_ratio": None if ratio is None else round(ratio, 4),
        "replies_ok": {k: v for k, v in counts.items() if k.endswith(":ok")},
        "replies_refused": errors,
        "breakdowns_checked": checked,
        "breakdowns_wrong": len(bad_breakdowns),
        "breakdown_wrong_example": bad_breakdowns[:1],
        "agent_cpu_share_pct": round(100 * statistics.fmean(shares), 3) if shares else None,
        "threads_fds_start": [list(v) if v else None for v in start_counts.values()],
        "threads_fds_end": [list(v) if v else None for v in end_counts.values()],
        "threads_fds_max": [list(v) for v in max_counts.values()],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--viewers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=300.0)
    # No default here: finding one imports torch, and the viewers and hostile clients (which,
    # like memtop, never import torch) parsed it too, at ~1.5 CPU-s each.
    parser.add_argument("--device", help="cuda or cpu (default: cuda where torch sees one)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--inject-race", action="store_true")
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="no control group: crashes, breakdowns and threads only, no step-rate ratio "
        "(the suite's short soak; half the trainers' CPU)",
    )
    parser.add_argument(
        "--hostile",
        type=int,
        default=0,
        help="hostile clients: reconnect and send 64 KiB deeply nested frames, all run long",
    )
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--viewer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hostile-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pids", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None and not (args.viewer or args.hostile_client):
        args.device = "cuda" if _cuda_here() else "cpu"
    if args.trainer:
        return trainer_main(args.seconds, args.device, args.inject_race, args.width)
    if args.hostile_client:
        pids = [int(p) for p in args.pids.split(",") if p]
        return hostile_main(pids, args.socket_dir, args.seconds)
    if args.viewer:
        pids = [int(p) for p in args.pids.split(",") if p]
        return viewer_main(pids, args.socket_dir, args.seconds, args.out)
    report = run(args)
    print(f"trainer crashes      {report['crashes']}  {report['crash_reasons'][:2]}")
    if report["viewer_failures"]:
        print(f"viewer failures      {report['viewer_failures']}")
    print(
        f"step rate            {report['step_rate_agent']}/s with agents, "
        f"{report['step_rate_control']}/s without: ratio {report['step_rate_ratio']}"
    )
    print(
        f"breakdowns checked   {report['breakdowns_checked']}, wrong {report['breakdowns_wrong']}"
    )
    print(f"replies ok           {report['replies_ok']}")
    print(f"replies refused      {report['replies_refused']}")
    if report["hostile"]:
        print(f"hostile clients      {report['hostile']}: {report['hostile_counts']}")
    print(f"agent CPU share      {report['agent_cpu_share_pct']} % of its trainer's CPU")
    print(
        f"threads, fds         start {report['threads_fds_start']} "
        f"max {report['threads_fds_max']} end {report['threads_fds_end']}"
    )
    print(json.dumps(report))
    return 0


def _cuda_here() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


if __name__ == "__main__":
    # Ctrl-C, SIGTERM (`timeout`) and SIGHUP unwind main: what it started is stopped.
    sys.exit(children.run_stopping_children(main))
