"""The conformance check (`python -m memtop.protocol.check PID`) against memtop's own agent, a
hostile double, and nothing at all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from stepping import Stepper

from memtop import protocol
from memtop.agent.probe import ProbeDevice
from memtop.agent.server import Agent
from memtop.protocol import check as protocol_check
from memtop.sim.allocator import SimulatedCachingAllocator
from memtop.sim.device import LocalDeviceMemory
from memtop.sim.probe import SimulatedGpu, SimulatedProbe

GiB = 1 << 30
HOSTILE = Path(__file__).with_name("hostile_agent.py")


@pytest.fixture
def agent(socket_dir: Path) -> Iterator[Agent]:
    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    allocator.malloc(300 << 20)
    probe = SimulatedProbe([SimulatedGpu(ProbeDevice(0, "GPU-c", "Sim", 8 * GiB), allocator)])
    running = Agent(probe, socket_dir)
    running.start()
    yield running
    running.stop()


def _check(pid: int, directory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = protocol_check.main([str(pid), "--socket-dir", str(directory), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_memtops_own_agent_passes_every_check(agent: Agent, capsys):
    with Stepper(agent):
        code, report = _check(agent.pid, agent.directory, capsys)
    assert code == 0, report
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "peer credentials",
        "hello",
        "sample",
        "sample options",
        "breakdown",
        "snapshot",
        "sites",
        "sites history",
        "unknown command",
        "bad arguments",
        "malformed frame",
        "serves after all of it",
    ]
    assert all(c["ok"] for c in report["checks"])
    # The agent's host memory (Linux) is checked with the rest of its sample.
    sample = next(c for c in report["checks"] if c["name"] == "sample")
    assert sample["detail"].endswith("host memory"), sample


@pytest.mark.parametrize(
    ("kind", "failing", "why"),
    [
        ("liar", "sample", "allocated"),  # allocated > reserved > the device's total
        ("liar", "sample", "rss_bytes above its peak_rss_bytes"),  # host memory that lies
        ("slow", "sample", "lacks stats"),  # a sample without keys memtop reads
    ],
)
def test_a_double_that_breaks_the_schema_fails_by_name(socket_dir, capsys, kind, failing, why):
    double = subprocess.Popen(
        [sys.executable, str(HOSTILE), kind, str(socket_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert double.stdout is not None and double.stdout.readline().strip() == "ready"
        code, report = _check(double.pid, socket_dir, capsys)
    finally:
        double.kill()
        double.wait()
    assert code == 1
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["ok"]}
    assert why in failed[failing], failed
    # It answers an unknown command with "unavailable", not the protocol's code.
    assert "unknown command" in failed


def test_it_runs_as_a_module_against_a_live_agent(agent: Agent):
    # As another implementation's author would run it: a separate process, the text report.
    with Stepper(agent):
        done = subprocess.run(
            [sys.executable, "-m", "memtop.protocol.check", str(agent.pid),
             "--socket-dir", str(agent.directory)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12 of 12 checks passed" in done.stdout
    assert re.search(r"PASS  sample options +columns", done.stdout), done.stdout


def test_no_agent_is_one_line_and_exit_2(socket_dir, capsys):
    code = protocol_check.main(["999999", "--socket-dir", str(socket_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "999999" in err


def test_every_reply_parser_refuses_what_breaks_the_schema():
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_breakdown({"devices": {"0": {"parameters": -5}}})
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_breakdown({"devices": {"gpu0": {"parameters": 5}}})
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_snapshot({"devices": [1, 2]})
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_cleanup({"released_bytes": {"0": -1}})
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_reset_peak({"devices": ["0"]})
    site = {"file": "t.py", "line": 3, "function": "f", "text": "x = y"}
    good = {"device": 0, "site": site, "bytes": 10, "blocks": 2, "old_blocks": 1}
    assert protocol.parse_sites({"enabled": True, "sites": [good]}).sites[0].site.line == 3
    for bad in (
        {"old_blocks": 3},
        {"bytes": -1},
        {"site": {**site, "line": "3"}},
        {"device": True},
    ):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_sites({"enabled": True, "sites": [{**good, **bad}]})
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_sites({"enabled": "yes", "sites": []})
    # An agent's text is made inert like every string it sends.
    hostile = {**good, "site": {**site, "text": "x\x1b[2J = 1"}}
    assert (
        protocol.parse_sites({"enabled": True, "sites": [hostile]}).sites[0].site.text
        == "x?[2J = 1"
    )
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_reply("sample", [])  # type: ignore[arg-type]
    cleanup = protocol.parse_cleanup(
        {"released_bytes": {"0": 5}, "reserved_before": {"0": 9}, "reserved_after": {"0": 4},
         "gc_collected": 3, "at_step_boundary": True, "after_step": 7, "took_s": 0.01}
    )  # fmt: skip
    assert cleanup.released_bytes == {0: 5} and cleanup.after_step == 7
    breakdown = protocol.parse_breakdown({"time": 1.0, "step": 2, "devices": {"0": {"other": 4}}})
    assert breakdown.devices == {0: {"other": 4}} and not breakdown.pending
