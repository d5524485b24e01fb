"""The memtop process must never import torch (start-up time and memory budget)."""

from __future__ import annotations

import subprocess
import sys


def test_import_memtop_cli_does_not_import_torch():
    code = (
        "import sys, memtop, memtop.cli, memtop.engine.sampler, memtop.present.report\n"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_a_once_report_does_not_import_torch(tmp_path):
    code = (
        "import sys, os, io, contextlib\n"
        "from memtop import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['--once', '--json'])\n"
        "print('torch' in sys.modules)\n"
    )
    env = {"MEMTOP_SOCKET_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
