"""The host CPU % and resident set of the processes in view (the table's CPU% and RSS): read
every USAGE_EVERY_S from one /proc/PID/stat read a process, as psutil reported them."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from memtop.sources import processes


def test_cpu_and_rss_come_from_one_read_of_proc_and_agree_with_psutil(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Read only once it runs its loop: between fork and exec /proc shows the forking parent's
    # name, no command line and a resident set of 0 (seen under load).
    busy = subprocess.Popen(
        [sys.executable, "-c", "print('running', flush=True)\nwhile True: pass"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert busy.stdout is not None and busy.stdout.readline() == "running\n"
    made: list[int] = []
    real = psutil.Process

    class Counted(psutil.Process):
        def __init__(self, pid: int | None = None) -> None:
            made.append(pid or 0)
            super().__init__(pid)

    try:
        monkeypatch.setattr(processes, "USAGE_EVERY_S", 0.0)
        monkeypatch.setattr(processes.psutil, "Process", Counted)
        processes.read_process(busy.pid)  # who it is: what psutil is still asked
        who = len(made)
        directory = processes.ProcessDirectory()
        first = directory.lookup([busy.pid])[busy.pid]
        assert first.visible and first.cpu_percent is None and first.rss  # the baseline
        time.sleep(0.6)
        second = directory.lookup([busy.pid])[busy.pid]
        # One psutil.Process for who it is (read_process), none for its usage (the old reader
        # kept a handle per process for cpu_percent and memory_info: two reads and its layers).
        assert len(made) == 2 * who
        assert second.cpu_percent is not None and 5.0 <= second.cpu_percent <= 105.0
        rss = real(busy.pid).memory_info().rss
        assert second.rss is not None and abs(second.rss - rss) <= max(rss // 10, 1 << 20)
        # A process gone keeps what was read of it last.
        busy.kill()
        busy.wait()
        assert directory.lookup([busy.pid])[busy.pid].rss == second.rss
    finally:
        busy.kill()
        busy.wait()
        busy.stdout.close()
