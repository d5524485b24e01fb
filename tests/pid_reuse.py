"""A reused pid behind an agent socket (issue 36, item 5), for real: run as root inside a pid
namespace of its own (`unshare --pid --fork --mount-proc`), where /proc/sys/kernel/ns_last_pid
can hand a chosen pid to a new process without touching the host's pids.

    python tests/pid_reuse.py [--no-pidfd]

1. Process A binds `<A>.sock` and listens, forks B, which keeps the listener and answers as an
   honest agent that says it is pid A; A exits.  Then `sleep 1000` is started with pid A.
2. root's `memtop --once --json` reads the socket directory: what it says of pid A.
3. A viewer (Sampler) runs two rounds, and its kill path is asked to SIGTERM pid A.
4. A second agent, C, is verified while it serves its own socket; then it hands the socket on
   and exits, and `sleep` gets pid C: the kill path is asked to SIGTERM pid C.

`--no-pidfd`: the viewer runs as on a kernel older than 6.5 (no SO_PEERPIDFD).  Prints one JSON
object with what happened; the test (test_pid_reuse.py) judges it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hostile_agent import Hostile

from memtop.protocol import socket_path


def serve_as(listener: socket.socket, pid: int) -> None:
    """Answer on `listener` as an honest agent of pid `pid` (in the process that holds it)."""
    agent = Hostile(
        argparse.Namespace(kind="plain", as_pid=pid, uuid="GPU-reuse", total=80 << 30, log="")
    )
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=agent.serve, args=(conn,), daemon=True).start()


def handed_on_agent(directory: Path, serve_first: bool = False) -> tuple[int, int]:
    """Fork A, which listens on `<A>.sock`, hands the listener to a child B (which answers as
    pid A) and exits.  `serve_first`: A first serves itself until a byte arrives on the pipe
    whose write end is returned (a viewer verifies it meanwhile).  (A, that write end)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    a = os.fork()
    if a == 0:
        try:  # the child never returns into the caller's code
            os.close(ready_r)
            os.close(go_w)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # Named as a real agent names it (in a pid namespace: `<pid>.ns<inode>.sock`).
            listener.bind(str(socket_path(os.getpid(), directory)))
            listener.listen(16)
            me = os.getpid()
            if serve_first:
                threading.Thread(target=serve_as, args=(listener, me), daemon=True).start()
                os.write(ready_w, b"serving\n")
                os.read(go_r, 1)  # until the viewer has verified it
            if os.fork() == 0:
                serve_as(listener, me)
            if not serve_first:
                os.write(ready_w, b"handed on\n")
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    reader = os.fdopen(ready_r)
    if serve_first:
        assert reader.readline().strip() == "serving"
    else:
        assert reader.readline().strip() == "handed on"
        os.waitpid(a, 0)
    return a, go_w


def finish_handing_on(a: int, go: int) -> None:
    os.write(go, b"x")
    os.waitpid(a, 0)


def process_with_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """`sleep 1000` started with pid `pid` (free by now), or None when it could not be had."""
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(pid - 1))
        process = subprocess.Popen(["sleep", "1000"])
        if process.pid == pid:
            return process
        process.kill()
        process.wait()
    return None


class NoGpus:
    def read(self):  # type: ignore[no-untyped-def]
        from memtop.model import DriverReading

        return DriverReading(available=False, devices=(), error="no GPU here")

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-pidfd", action="store_true")
    args = parser.parse_args()
    from memtop.protocol import places

    if args.no_pidfd:
        places.SO_PEERPIDFD = 0x7FFF  # an option no kernel knows: ENOPROTOOPT, as before 6.5
    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool
    from memtop.sources.processes import read_process

    directory = Path(tempfile.mkdtemp(prefix="mtreuse-"))
    directory.chmod(0o700)
    out: dict[str, object] = {}
    sleepers: list[subprocess.Popen[bytes]] = []
    try:
        # 1. A hands its socket to B and exits; `sleep` gets pid A.
        a, _ = handed_on_agent(directory)
        # The socket was made well before the sleep starts (the start-time check's slack).
        time.sleep(2.5)
        sleeper = process_with_pid(a)
        if sleeper is None:
            print(json.dumps({"skip": f"pid {a} could not be handed to a new process"}))
            return
        sleepers.append(sleeper)
        env = {**os.environ, "MEMTOP_SOCKET_DIR": str(directory)}
        once = subprocess.run(
            [sys.executable, "-m", "memtop.cli", "--once", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd="/",
        )
        if not args.no_pidfd:
            rows = json.loads(once.stdout)["agents"] if once.returncode == 0 else []
            out["once"] = [
                {"pid": r["pid"], "state": r["state"], "error": r["error"]}
                for r in rows
                if r["pid"] == a
            ]
            out["once_stderr"] = once.stderr[-2000:]
        sampler = Sampler(Store(), NoGpus(), AgentPool(directory), interval=0.25)  # type: ignore[arg-type]
        try:
            sampler.sample_once()
            sampler.sample_once()
            expected = sampler.processes.lookup([a]).get(a)
            reply = sampler.signal(a, signal.SIGTERM, expected)
            out["kill_reused"] = {"error": reply.error, "message": reply.message}
            time.sleep(0.5)  # a signal sent would have ended it by now
            out["sleeper_alive_after_kill"] = sleeper.poll() is None
            out["problems"] = list(sampler.agents.problems)
            # 4. C is verified while it serves itself, then hands on and exits; `sleep` gets C.
            c, go_c = handed_on_agent(directory, serve_first=True)
            for _ in range(8):
                sampler.sample_once()
                if sampler.agents.verified(c):
                    break
                time.sleep(0.25)
            out["verified_c"] = sampler.agents.verified(c)
            finish_handing_on(c, go_c)
            time.sleep(2.5)
            sleeper_c = process_with_pid(c)
            if sleeper_c is None:
                out["skip_c"] = f"pid {c} could not be handed to a new process"
            else:
                sleepers.append(sleeper_c)
                # What the process now is, as a screen drawn after the reuse would show it: the
                # command and start checks pass; only the agent's verified start can tell.
                shown = read_process(c)
                reply = sampler.signal(c, signal.SIGTERM, shown)
                out["kill_handed_on"] = {"error": reply.error, "message": reply.message}
                time.sleep(0.5)
                out["sleeper_c_alive_after_kill"] = sleeper_c.poll() is None
        finally:
            sampler.stop()
    finally:
        for process in sleepers:
            process.kill()
            process.wait()
        # The agents' processes (B) end with this one: the kernel kills every process of a pid
        # namespace when its first process exits.
        for name in os.listdir(directory):
            os.unlink(directory / name)
        directory.rmdir()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
