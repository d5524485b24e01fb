"""Hostile agents for the viewer's tests: small socket servers that speak the wire protocol badly
on purpose.  Run as a process of its own:

    python tests/hostile_agent.py KIND DIRECTORY [--as-pid PID] [--uuid U] [--total N] [--log F]

It binds `<pid>.sock` in DIRECTORY (its own pid, or `--as-pid`), prints "ready" and serves until
killed.  KIND is one of:

  deep       a `sample` reply nested 5000 levels deep (well under the 1 MiB frame cap)
  wrongid    answers every request with an endless stream of frames carrying other ids
  silent     accepts and reads, never answers
  slow       answers correctly, 0.3 s late every time
  impersonate  serves `<--as-pid>.sock` and says it is that pid, with 79 GiB and 99 OOMs
  liar       says allocated > reserved > the device's total, and counters going backwards
  escape     an honest agent whose argv carries terminal escape sequences
  counter    a plain listener that only counts connections (into --log): a symlink target
  plain      an honest agent (tests/agent_crowd.py runs many)
  slurm      an honest agent that claims rank 2 of Slurm job 9 (another user's job)
  markup     an agent with Rich/Textual markup in every string it sends (MARKUP): argv, device
             name, Slurm job, an OOM report's cause, detail, fix and stack, error messages
  hugehost   an honest GPU agent whose `host_memory` says 2^62 bytes resident on a 1-byte machine
  bighost    ... whose `host_memory` claims a machine of 2^62 bytes (larger than this one)
  longargv   an honest agent whose argv[1] is 4,000 characters (the exporter's `job` label)
  sites      an honest agent that records stacks and mints 1,000 new sites (long paths and
             lines of code) in every `sites` reply

Every connection accepted is appended to `--log` (one line each) so a test can prove that the
viewer never connected (or never sent a byte).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time

HEADER = struct.Struct(">I")
GiB = 1 << 30

ESCAPE_ARGV = [
    "train.py",
    "\x1b]0;pwned-title\x07",  # window title
    "\x1b[2J\x1b[H",  # clear screen
    "\x1b]52;c;ZWNobyBwd25lZA==\x07",  # OSC 52 clipboard write
    "\u202eevil",  # right-to-left override
    "\x9b31m",  # C1 CSI
]


LONG_ARGV_CHARS = 4000
SITES_PER_REPLY = 1000


def frame(obj: object) -> bytes:
    body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
    return HEADER.pack(len(body)) + body


def read_frame(conn: socket.socket) -> dict | None:
    header = b""
    while len(header) < 4:
        chunk = conn.recv(4 - len(header))
        if not chunk:
            return None
        header += chunk
    (length,) = HEADER.unpack(header)
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body)


def stats(allocated: int, reserved: int, ooms: int = 0, retries: int = 0) -> dict[str, int]:
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": allocated,
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.large_pool.current": reserved,
        "inactive_split_bytes.all.current": 0,
        "inactive_split_bytes.large_pool.current": 0,
        "num_alloc_retries": retries,
        "num_ooms": ooms,
    }


# Closing a tag never opened: Rich and Textual raise MarkupError where they parse it as markup.
MARKUP = "try again [/x] later [@click=app.quit]quit[/] [bold]"
MARKUP_SETTING = "PYTORCH_CUDA_ALLOC_CONF=" + MARKUP.replace(" ", "")


class Hostile:
    def __init__(self, args: argparse.Namespace) -> None:
        self.kind = args.kind
        self.pid = args.as_pid or os.getpid()
        self.uuid = args.uuid
        self.total = args.total
        self.log = args.log
        self.samples = 0
        self.lock = threading.Lock()

    def hello(self) -> dict:
        argv = ESCAPE_ARGV if self.kind == "escape" else [f"hostile-{self.kind}.py"]
        if self.kind == "markup":
            argv = ["train.py", MARKUP]
        if self.kind == "longargv":
            argv = ["python3", "/srv/" + "j" * LONG_ARGV_CHARS, "--lr", "1e-4"]
        hello = {
            "protocol": 1,
            "pid": self.pid,
            "argv": argv,
            "python": "3.11",
            "torch": "2.13",
            "allocator_conf": "",
            "devices": [
                {"index": 0, "uuid": self.uuid, "name": "Sim GPU", "total_bytes": self.total}
            ],
        }
        if self.kind == "markup":
            hello["devices"][0]["name"] = f"Sim GPU {MARKUP}"
            hello["scheduler"] = {"kind": "slurm", "job_id": "4242", "job_name": MARKUP}
            hello["allocator_conf"] = MARKUP
        if self.kind == "slurm":  # claims rank 2 of Slurm job 9, whoever runs that job
            hello["scheduler"] = {"kind": "slurm", "job_id": "9", "proc_id": 2}
            hello["rank"] = 2
        return hello

    def sample(self) -> dict:
        with self.lock:
            self.samples += 1
            n = self.samples
        if self.kind == "impersonate":
            device = {
                "index": 0,
                "stats": stats(79 * GiB, 79 * GiB, ooms=99),
                "free_bytes": 0,
                "total_bytes": self.total,
            }
        elif self.kind == "liar":
            device = {
                "index": 0,
                "stats": stats(10 * self.total, 5 * self.total, ooms=max(0, 99 - n)),
                "free_bytes": 0,
                "total_bytes": self.total,
            }
        else:
            device = {
                "index": 0,
                "stats": stats(GiB, 2 * GiB),
                "free_bytes": self.total - 3 * GiB,
                "total_bytes": self.total,
            }
        reply = {"time": time.time(), "step": n, "devices": [device], "step_marks": []}
        if self.kind == "markup":  # an OOM, with the agent's own words for why and what to do
            device["stats"] = stats(GiB, 2 * GiB, ooms=1)
            reply["oom"] = {"ooms": 1, "reports": 1, "last": markup_oom_report(self.pid)}
        if self.kind == "liar":  # a resident set above its own high-water mark
            reply["host_memory"] = {"rss_bytes": 2 * GiB, "peak_rss_bytes": GiB}
        elif self.kind == "hugehost":
            reply["host_memory"] = {"rss_bytes": 2**62, "peak_rss_bytes": 2**62, "total_bytes": 1}
        elif self.kind == "bighost":
            reply["host_memory"] = {"rss_bytes": GiB, "peak_rss_bytes": GiB, "total_bytes": 2**62}
        return reply

    def sites(self) -> dict:
        """1,000 sites never seen before, each with a long path and line of code."""
        with self.lock:
            self.samples += 1
            n = self.samples
        minted = [
            {
                "device": 0,
                "site": {
                    "file": f"/work/{'d' * 450}/minted_{n}_{i}.py",
                    "line": i + 1,
                    "function": f"f{'u' * 80}_{i}",
                    "text": f"x_{n}_{i} = torch.empty({'9' * 200})",
                },
                "bytes": (i + 1) * 4096,
                "blocks": 1,
                "old_blocks": 0,
            }
            for i in range(SITES_PER_REPLY)
        ]
        return {"enabled": True, "wanted": True, "supported": True, "time": time.time(),
                "step": n, "sites": minted, "blocks": SITES_PER_REPLY, "took_s": 0.001}  # fmt: skip

    def serve(self, conn: socket.socket) -> None:
        try:
            while True:
                request = read_frame(conn)
                if request is None:
                    return
                rid, cmd = request.get("id"), request.get("cmd")
                if self.kind == "silent":
                    continue
                if self.kind == "wrongid":
                    n = 0
                    while True:
                        n += 1
                        conn.sendall(frame({"id": f"not-{rid}-{n}", "result": {}}))
                        time.sleep(0.001)
                if self.kind == "slow":
                    time.sleep(0.3)
                if cmd == "hello":
                    result = self.hello()
                elif cmd == "sample":
                    if self.kind == "deep":
                        depth = 5000
                        conn.sendall(
                            frame(b'{"id":%d,"result":' % rid + b"[" * depth + b"]" * depth + b"}")
                        )
                        continue
                    result = self.sample()
                elif (
                    cmd == "sites"
                    and self.kind == "markup"
                    and "stacks" not in (request.get("args") or {})
                ):
                    result = markup_sites()
                elif cmd == "sites" and self.kind == "sites":
                    result = self.sites()
                elif cmd == "snapshot" and self.kind in ("escape", "slow"):
                    # Claims success without writing anything.
                    result = {"path": (request.get("args") or {}).get("path"), "devices": {}}
                else:
                    message = MARKUP if self.kind == "markup" else "no"
                    conn.sendall(
                        frame({"id": rid, "error": {"code": "unavailable", "message": message}})
                    )
                    continue
                conn.sendall(frame({"id": rid, "result": result}))
        except OSError:
            return
        finally:
            conn.close()

    def run(self, directory: str) -> None:
        path = os.path.join(directory, f"{self.pid}.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(64)
        print("ready", flush=True)
        while True:
            conn, _ = listener.accept()
            if self.log:
                with open(self.log, "a") as fh:
                    fh.write("connect\n")
            if self.kind == "counter":
                conn.settimeout(0.5)
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if data and self.log:
                    with open(self.log, "a") as fh:
                        fh.write(f"bytes {len(data)}\n")
                conn.close()
                continue
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()


def markup_oom_report(pid: int) -> dict:
    return {
        "time": time.time(),
        "pid": pid,
        "step": MARKUP,
        "phase": MARKUP,
        "device": 0,
        "path": f"/tmp/{MARKUP}.json",
        "stack": [{"file": f"/srv/{MARKUP}.py", "line": 1, "function": MARKUP, "text": MARKUP}],
        # A setting (no blank in it: memtop copies it, as the agent's) with markup in it.
        "diagnosis": {"cause": MARKUP, "detail": MARKUP, "fix": MARKUP_SETTING},
    }


def markup_sites() -> dict:
    site = {"file": f"/srv/{MARKUP}.py", "line": 7, "function": MARKUP, "text": MARKUP}
    entry = {"device": 0, "site": site, "bytes": GiB, "blocks": 3, "old_blocks": 3}
    return {
        "enabled": True,
        "wanted": True,
        "supported": True,
        "sites": [entry],
        "time": time.time(),
        "step": 1,
        "blocks": 3,
        "took_s": 0.001,
        "rounds": 1,
        "rounds_abandoned": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind")
    parser.add_argument("directory")
    parser.add_argument("--as-pid", type=int, default=0)
    parser.add_argument("--uuid", default="GPU-00000000-0000-0000-0000-000000000000")
    parser.add_argument("--total", type=int, default=80 * GiB)
    parser.add_argument("--log", default="")
    args = parser.parse_args()
    Hostile(args).run(args.directory)


if __name__ == "__main__":
    sys.exit(main())
