"""What one agent can make the viewer keep and the exporter print (issue 36, item 8): a
4,000-character argv[1] was the `job` label of every series (a 4.6 MB scrape), and an agent
minting 1,000 new sites per reply cost the exporter ~50 MB and ~0.1 s of CPU a round.  Real
hostile agents (tests/hostile_agent.py), the real `memtop export` and the real sampler."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from memtop.engine.sampler import Sampler
from memtop.engine.store import SITES_KEPT, SITES_PER_DEVICE, Store
from memtop.export.server import Exporter
from memtop.export.text import LABEL_VALUE_CHARS
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource

pytestmark = pytest.mark.slow

HOSTILE = str(Path(__file__).with_name("hostile_agent.py"))


def start_hostile(kind: str, directory: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, HOSTILE, kind, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


@pytest.fixture
def hostile(request: pytest.FixtureRequest, socket_dir: Path) -> Iterator[subprocess.Popen[str]]:
    process = start_hostile(request.param, socket_dir)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("hostile", ["longargv"], indirect=True)
def test_a_long_argv_makes_a_short_job_label(hostile, socket_dir: Path) -> None:  # type: ignore[no-untyped-def]
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "export", "--listen", "127.0.0.1:0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline()
        url = re.search(r"(http://\S+/metrics)", line)
        assert url is not None, line
        with urllib.request.urlopen(url.group(1), timeout=10) as reply:
            body = reply.read().decode()
    finally:
        exporter.send_signal(signal.SIGTERM)
        exporter.communicate(timeout=15)
    samples = [s for f in text_string_to_metric_families(body) for s in f.samples]
    mine = [s for s in samples if s.labels.get("pid") == str(hostile.pid)]
    assert mine, "the agent is not exported"
    jobs = {s.labels["job"] for s in mine if "job" in s.labels}
    assert len(jobs) == 1
    (job,) = jobs
    assert job.startswith("jjjj") and job.endswith("…") and len(job) == LABEL_VALUE_CHARS
    longest = max(len(v) for s in samples for v in s.labels.values())
    assert longest <= LABEL_VALUE_CHARS
    assert len(body) < 60_000, len(body)  # was 4.6 MB


@pytest.mark.parametrize("hostile", ["sites"], indirect=True)
def test_an_agent_minting_sites_keeps_a_bounded_few(hostile, socket_dir: Path) -> None:  # type: ignore[no-untyped-def]
    store = Store()
    pool = AgentPool(socket_dir)
    sampler = Sampler(store, DefaultDeviceSource(socket_dir, simulated_only=True), pool)
    pool.low_rate["sites"] = 0.01  # a `sites` reply every round: 1,000 new sites each
    exporter = Exporter(sampler)
    try:
        for _ in range(12):
            exporter.round()
    finally:
        sampler.stop()
    agent = store.agent(hostile.pid)
    assert agent is not None and agent.sites, "no sites reading kept"
    named = {usage.site for reading in agent.sites for usage in reading.sites}
    assert len(named) <= SITES_KEPT, len(named)  # was 12,000
    newest = agent.sites[-1]
    # The newest reading is the agent's, cut to its largest: the largest site served first.
    assert len(newest.sites) == SITES_PER_DEVICE
    assert max(u.bytes for u in newest.sites) == 1000 * 4096
    assert min(u.bytes for u in newest.sites) == (1000 - SITES_PER_DEVICE + 1) * 4096
    assert newest.step == max(r.step or 0 for r in agent.sites)
    # ... and the exporter's top sites are the newest reading's largest.
    body = exporter.collector.body().decode()
    sites = [line for line in body.splitlines() if line.startswith("memtop_site_bytes{")]
    assert sites and f"minted_{newest.step}_999.py:1000" in sites[0], sites[:1]
