"""The fleet view without a Prometheus: the exporter's text, parsed as Prometheus would store it,
read back by the fleet source into an observation that reports as the original did."""

from __future__ import annotations

import re

import pytest
from helpers.observations import frozen_observation
from prometheus_client.parser import text_string_to_metric_families
from ui_frozen import TRAINERS

from memtop.engine.fleet import FleetSampler, host_observation, short_host
from memtop.export.metrics import render
from memtop.export.text import exposition
from memtop.model import HostPid, host_of
from memtop.present import report
from memtop.sources.prometheus import FleetReading, PrometheusError, PrometheusSource, hosts_of
from memtop.ui import view


def _as_prometheus_has_it(text: str, instance: str = "10.0.0.7:9482") -> list:
    """Instant-vector rows: labels with __name__ (as /api/v1/query returns them), value; empty
    labels dropped, as Prometheus drops them, and the scrape's own job/instance added."""
    rows = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if v != ""}
            if "job" in labels:  # honor_labels: false (Prometheus's default)
                labels["exported_job"] = labels.pop("job")
            rows.append(
                (
                    {**labels, "__name__": sample.name, "job": "memtop", "instance": instance},
                    sample.value,
                )
            )
    return rows


@pytest.fixture(scope="module")
def original():
    return frozen_observation()


def test_a_host_reads_back_as_its_own_report(original):
    text = exposition(render(original, host="GPU-Box")).decode()
    (host,) = hosts_of(_as_prometheus_has_it(text))
    assert host.host == "gpu-box" and host.instance == "10.0.0.7:9482"
    assert host.jobs == {t.pid: "train.py" for t in TRAINERS}
    back = report.build(host_observation(host))
    local = report.build(original)
    assert [d["uuid"] for d in back["devices"]] == [d["uuid"] for d in local["devices"]]
    for mine, theirs in zip(local["devices"], back["devices"], strict=True):
        for key in ("index", "name", "total_bytes", "used_bytes", "free_bytes", "source"):
            assert mine[key] == theirs[key], key
        assert mine["processes"] == theirs["processes"]
    assert [a["pid"] for a in back["agents"]] == [a["pid"] for a in local["agents"]]
    for mine, theirs in zip(local["agents"], back["agents"], strict=True):
        assert (mine["argv"], mine["state"], mine["step"]) == (
            theirs["argv"],
            theirs["state"],
            theirs["step"],
        )
        for was, now in zip(mine["devices"], theirs["devices"], strict=True):
            for key in (
                "index", "uuid", "gpu", "allocated_bytes", "reserved_bytes", "peak_bytes",
                "cached_bytes", "inactive_split_bytes", "fragmentation", "num_alloc_retries",
                "num_ooms", "free_bytes", "total_bytes", "non_pytorch_bytes", "baseline_bytes",
                "fragmentation_smoothed", "external_fragmentation", "stranded_bytes",
                "largest_cached_request_bytes", "breakdown",
            ):  # fmt: skip
                assert was[key] == now[key], key
            for key in ("detected", "bytes_per_step", "bytes_per_second", "steps_to_full",
                        "seconds_to_full", "basis", "samples", "since"):  # fmt: skip
                assert was["leak"][key] == pytest.approx(now["leak"][key], abs=1), key
    # Judged again from the same facts, the rules say the same things.
    assert [(s["rule"], s["pid"], s["title"]) for s in back["suggestions"]] == [
        (s["rule"], s["pid"], s["title"]) for s in local["suggestions"]
    ]


class _Fixed:
    """A Prometheus that always answers with the same hosts."""

    url = "http://prometheus:9090"

    def __init__(self, hosts) -> None:
        self.hosts = tuple(hosts)

    def read(self) -> FleetReading:
        return FleetReading(0.0, self.hosts)

    def history(self, *args, **kwargs):
        return {}

    def close(self) -> None:
        pass


def _twin_hosts():
    """Two hosts whose trainers have the same pids and whose GPUs the same UUIDs (two
    containers, two simulated hosts); node-b's third trainer has exited."""
    first = exposition(render(frozen_observation(), host="node-a")).decode()
    second = exposition(render(frozen_observation(exited=TRAINERS[2].pid), host="node-b")).decode()
    return hosts_of(_as_prometheus_has_it(first) + _as_prometheus_has_it(second, "b:9482"))


def test_two_hosts_stay_apart():
    hosts = _twin_hosts()
    assert [h.host for h in hosts] == ["node-a", "node-b"]
    states = {p.pid: p.state.value for p in hosts[1].polls}
    assert states[TRAINERS[2].pid] == "exited"


def test_a_fleet_read_is_one_generation():
    """Every host of one Prometheus read is published together (issue 22.1): the dashboard
    never shows node-a of this read beside node-b of the last."""
    sampler = FleetSampler(_Fixed(_twin_hosts()), interval=60.0)  # type: ignore[arg-type]
    for _ in range(2):  # the first read loads the history too
        before = sampler.store.generation
        sampler.sample_once()
        assert sampler.store.generation == before + 1


def test_the_fleet_keys_every_process_by_host_and_pid():
    hosts = _twin_hosts()
    sampler = FleetSampler(_Fixed(hosts), interval=1.0)  # type: ignore[arg-type]
    sampler.sample_once()
    assert not any("same pid" in p for p in sampler.store.problems())
    obs = sampler.observer().latest()
    # Each host's GPUs, each with its own host's processes and nobody else's.
    assert [g.index for g in obs.gpus] == [0, 1, 2, 3]
    assert [g.host for g in obs.gpus] == ["node-a", "node-a", "node-b", "node-b"]
    assert obs.gpus[2].name.startswith("node-b #0: ")
    for gpu in obs.gpus:
        assert {host_of(d.pid) for d in gpu.agents} <= {gpu.host}
        assert {host_of(p.pid) for p in gpu.processes} <= {gpu.host}
    # Both hosts' trainers, each once, under its own host (the same pid on both).
    pids = [t.pid for t in TRAINERS]
    live = {(host_of(a.pid), int(a.pid)) for a in obs.live_agents}
    assert live == {("node-a", p) for p in pids} | {("node-b", p) for p in pids[:2]}
    assert obs.agent(HostPid(pids[2], "node-b")).status.value == "exited"  # type: ignore[union-attr]
    assert obs.agent(HostPid(pids[2], "node-a")).live  # type: ignore[union-attr]
    # Each host's verdicts stay with its own devices.
    for agent in obs.live_agents:
        for dev in obs.devices_of(agent):
            assert dev.diagnosis.leak.reason.endswith(f"on {host_of(agent.pid)}")
    rows = view.build(obs)
    assert len({r.key for r in rows.processes}) == len(rows.processes)
    assert len({s.key for s in rows.suggestions}) == len(rows.suggestions)
    assert sampler.may_signal(HostPid(pids[0], "node-b")) == (
        f"pid {pids[0]} runs on node-b: the fleet view acts locally only (ssh node-b)"
    )
    # A host that leaves takes only its own processes with it.
    sampler.source = _Fixed(hosts[:1])  # type: ignore[assignment]
    sampler.sample_once()
    obs = sampler.observer().latest()
    assert {host_of(a.pid) for a in obs.live_agents} == {"node-a"}
    assert len(obs.live_agents) == len(pids)


def test_at_80_columns_every_gpu_and_process_line_names_its_host():
    import asyncio

    from ui_helpers import screen_text, wait_for

    from memtop.ui.app import MemtopApp

    sampler = FleetSampler(_Fixed(_twin_hosts()), interval=60.0)  # type: ignore[arg-type]
    sampler.sample_once()
    app = MemtopApp(
        sampler.store, sampler, interval=60.0, host="fleet", observer=sampler.observer()
    )  # type: ignore[arg-type]
    shown: list[str] = []

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.dashboard is not None and app.dashboard.processes)
            await pilot.pause(0.3)
            shown.extend(screen_text(app.export_screenshot()).splitlines())

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    text = "\n".join(shown)
    cards = [line for line in shown if re.search(r"\bGPU\d ", line)]
    assert len(cards) == 4, text
    assert [bool(re.search(r"GPU[01] node-a ", c)) for c in cards[:2]] == [True, True], text
    assert [bool(re.search(r"GPU[23] node-b ", c)) for c in cards[2:]] == [True, True], text
    pids = {str(t.pid) for t in TRAINERS}
    rows = [line for line in shown if line.split()[:1] and line.split()[0] in pids]
    assert len(rows) >= 5, text  # three trainers on node-a, two live and one exited on node-b
    assert all(re.search(r"node-[ab]: ", row) for row in rows), text
    assert "agent 4201 on node-b exited" in text


def test_short_hosts_keep_their_distinctive_end():
    assert short_host("gpu-node-01.cluster.local") == "…node-01"
    assert short_host("node-b") == "node-b"


def test_bad_urls_and_unreachable_servers_are_one_line():
    with pytest.raises(PrometheusError, match="http"):
        PrometheusSource("localhost:9090")
    source = PrometheusSource("http://user:pa%40ss@127.0.0.1:9")
    assert source.url == "http://127.0.0.1:9"
    assert source.headers["Authorization"] == "Basic dXNlcjpwYUBzcw=="
    with pytest.raises(PrometheusError, match="cannot reach Prometheus"):
        source.read()


@pytest.mark.slow
def test_an_exporters_url_is_read_as_that_one_host(tmp_path):
    """`memtop --prometheus` given `memtop export`'s own URL (port 9482), not Prometheus's:
    the exporter has no query API (HTTP 404); its /metrics is read as Prometheus would have
    stored it, one host without history (it said only "HTTP 404: Not Found")."""
    import contextlib
    import json
    import subprocess
    import sys

    from test_prometheus import STEP_A, _host

    with contextlib.ExitStack() as stack:
        host = stack.enter_context(_host("Node-E", "leak", STEP_A, stack))
        (pid,) = host.pids
        base = f"http://127.0.0.1:{host.port}"
        for url in (base, f"{base}/metrics"):
            out = subprocess.run(
                [sys.executable, "-m", "memtop.cli", "--prometheus", url, "--once", "--json"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
            assert [h["host"] for h in report["hosts"]] == ["node-e"]
            assert [(a["host"], a["pid"], a["state"]) for a in report["agents"]] == [
                ("node-e", pid, "connected")
            ]
        # The dashboard's sampler reads it the same way, and says where actions run.
        source = PrometheusSource(base)
        sampler = FleetSampler(source, interval=1.0)
        sampler.sample_once()
        obs = sampler.observer().latest()
        assert source.exporter and not obs.problems
        assert [(host_of(a.pid), int(a.pid)) for a in obs.live_agents] == [("node-e", pid)]
        # Neither Prometheus nor an exporter: one line that says where to point.
        out = subprocess.run(
            [sys.executable, "-m", "memtop.cli", "--prometheus", f"{base}/nothing", "--once"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
        assert "point --prometheus at Prometheus" in out.stderr


def _in_job(hosts, jobs):
    """`hosts` with some trainers put into Slurm jobs, as their hellos would say it (read back
    from the exporter's `hpc_job` label): jobs maps (host, pid) -> (job id, rank)."""
    import dataclasses

    out = []
    for host in hosts:
        polls = []
        for poll in host.polls:
            job = jobs.get((host.host, poll.pid))
            if job is not None and poll.hello is not None:
                extra = {
                    **poll.hello.extra,
                    "scheduler": {"kind": "slurm", "job_id": job[0]},
                    "rank": job[1],
                    # WORLD_SIZE, as the fleet reads it back from `memtop_agent_info`.
                    "rendezvous": {"master_addr": "node-a", "master_port": 29500, "world_size": 4},
                }
                poll = dataclasses.replace(poll, hello=dataclasses.replace(poll.hello, extra=extra))
            polls.append(poll)
        out.append(dataclasses.replace(host, polls=tuple(polls)))
    return out


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_the_dashboard_groups_one_jobs_ranks_across_hosts(size):
    """Issue 25.3 in the fleet dashboard: a Slurm job with a rank on each host is one header
    line (its label, 2 of 4 ranks on 2 hosts) with both ranks under it, each naming its host;
    another job stays apart under its own header; a trainer in no job is in neither."""
    import asyncio

    from ui_helpers import screen_text, wait_for

    from memtop.ui.app import MemtopApp

    a, b, c = (t.pid for t in TRAINERS)
    hosts = _in_job(
        _twin_hosts(),
        {
            ("node-a", a): ("4242", 0),
            ("node-b", a): ("4242", 1),
            ("node-a", b): ("5151", 1),
            ("node-b", b): ("5151", 0),
        },
    )
    sampler = FleetSampler(_Fixed(hosts), interval=60.0)  # type: ignore[arg-type]
    sampler.sample_once()
    app = MemtopApp(
        sampler.store, sampler, interval=60.0, host="fleet", observer=sampler.observer()
    )  # type: ignore[arg-type]
    shown: list[str] = []

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await wait_for(pilot, lambda: app.dashboard is not None and app.dashboard.processes)
            app.table.focus()
            await pilot.pause(0.3)
            shown.extend(screen_text(app.export_screenshot()).splitlines())
            lines.extend(app.table.lines)

    lines: list = []
    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    text = "\n".join(shown)
    headers = [i for i, line in enumerate(shown) if "▾ slurm" in line]
    assert len(headers) == 2, text
    first, second = (shown[i] for i in headers)
    assert re.search(r"▾ slurm 4242\s+2 of 4 ranks on 2 hosts", first), text
    assert re.search(r"▾ slurm 5151\s+2 of 4 ranks on 2 hosts", second), text

    def rows_under(header: int) -> list[str]:
        return shown[header + 1 : header + 3]

    # Each job's ranks right under its header, in rank order, each naming its host (in the
    # command at 80 columns, in the USER column at 120).
    job_a = rows_under(headers[0])
    assert [line.replace("│", " ").split()[0] for line in job_a] == [str(a), str(a)], text
    assert re.search(r"node-a\b.* r0 train", job_a[0]) and re.search(
        r"node-b\b.* r1 train", job_a[1]
    ), text
    job_b = rows_under(headers[1])
    assert [line.replace("│", " ").split()[0] for line in job_b] == [str(b), str(b)], text
    assert re.search(r"node-b\b.* r0 train", job_b[0]) and re.search(
        r"node-a\b.* r1 train", job_b[1]
    ), text
    assert "r0 on node-b leaks +8.0M" in second, text  # the rank that leaks, and where
    # The trainer in no job is under neither header: its rows follow the jobs' on their own.
    assert all(str(c) not in line for line in shown[: headers[1] + 3]), text
    # (At 80×24 they are below the fold: the table's own lines say where they went.)
    kinds = [type(line).__name__ for line in lines]
    assert kinds[:6] == ["JobLine", "ProcessRow", "ProcessRow"] * 2, kinds
    assert "JobLine" not in kinds[6:] and any(int(getattr(x, "pid", 0)) == c for x in lines[6:])
