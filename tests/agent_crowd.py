"""Many honest agents at once, each a process of its own with its own pid: for the tests of how
many agents a viewer reads, and at what cost (issue 36, item 3).

    python tests/agent_crowd.py COUNT DIRECTORY [DIRECTORY ...]

Forks COUNT agents per DIRECTORY; each binds `<its pid>.sock` there and answers `hello` and
`sample` as a plain trainer would (tests/hostile_agent.py, kind `plain`).  Prints "ready" once
every socket is there, and takes its agents with it when it is terminated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

from hostile_agent import Hostile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("count", type=int)
    parser.add_argument("directories", nargs="+")
    args = parser.parse_args()
    children: list[int] = []
    for directory in args.directories:
        for _ in range(args.count):
            pid = os.fork()
            if pid == 0:
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the agent's "ready"
                agent = argparse.Namespace(
                    kind="plain", as_pid=0, uuid="GPU-crowd", total=80 << 30, log=""
                )
                try:
                    Hostile(agent).run(directory)
                finally:
                    os._exit(0)
            children.append(pid)

    def stop(*_: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    expected = {
        os.path.join(directory, f"{pid}.sock")
        for directory, start in zip(
            args.directories, range(0, len(children), args.count), strict=True
        )
        for pid in children[start : start + args.count]
    }
    deadline = time.monotonic() + 60
    while not all(os.path.exists(path) for path in expected):
        if time.monotonic() > deadline:
            stop()
        time.sleep(0.05)
    print("ready", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
