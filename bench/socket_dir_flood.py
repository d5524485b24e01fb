"""What 10,000 empty `/tmp/memtop-<n>` directories of one user cost root's memtop (issue 36,
item 4): the exporter's CPU over a window, and how many lines `--once` prints.

Runs as root only (root's discovery is what reads every user's directory), in a private mount
namespace with a /tmp of its own (`unshare --mount`): the box's real /tmp is not touched, and
nobody else's memtop sees the flood.

    python bench/socket_dir_flood.py [--dirs 10000] [--owner 4242] [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

INSIDE = "MEMTOP_FLOOD_INSIDE"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood(count: int, owner: int) -> None:
    for n in range(1, count + 1):
        path = f"/tmp/memtop-{n}"
        os.mkdir(path, 0o700)
        os.chown(path, owner, owner)


def measure(args: argparse.Namespace) -> None:
    flood(args.dirs, args.owner)
    env = {k: v for k, v in os.environ.items() if k not in ("MEMTOP_SOCKET_DIR",)}
    env.pop("XDG_RUNTIME_DIR", None)
    once_started = time.monotonic()
    once = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--once"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    once_s = time.monotonic() - once_started
    lines = (once.stdout + once.stderr).count("\n")
    ignored = [line for line in (once.stdout + once.stderr).splitlines() if "memtop-" in line]
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "export", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        assert exporter.stdout is not None
        exporter.stdout.readline()  # "serving": the first round is done
        time.sleep(2.0)  # settle: the first rounds' scans
        before, started = cpu_seconds(exporter.pid), time.monotonic()
        time.sleep(args.seconds)
        used, wall = cpu_seconds(exporter.pid) - before, time.monotonic() - started
    finally:
        exporter.terminate()
        exporter.wait()
    print(f"{args.dirs} empty directories of uid {args.owner} in /tmp")
    print(f"  --once: {once_s:.1f} s, {lines} lines, {len(ignored)} naming a /tmp/memtop-*")
    for line in ignored[:3]:
        print(f"    {line[:160]}")
    print(f"  export: {100 * used / wall:.1f} % of a core over {wall:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirs", type=int, default=10_000)
    parser.add_argument("--owner", type=int, default=4242)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    if os.environ.get(INSIDE):
        measure(args)
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        sys.exit("socket_dir_flood: needs root and unshare (root's discovery is measured)")
    script = 'mount -t tmpfs -o mode=1777 tmpfs /tmp && exec "$0" "$@"'
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable,
         *sys.argv],
        env={**os.environ, INSIDE: "1"},
        check=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
