"""A real Prometheus scraping `memtop export` of two simulated hosts, and the fleet view reading
it back.

Two `memtop demo --no-ui` runs in their own socket directories stand in for two machines (a
leaking trainer on "Node-A", a healthy one on "node-b"); each has its `memtop export` on a port
of its own with a `--hostname` override; one Prometheus (Debian's package, started here on a
temporary config) scrapes both every second.  Skipped with a reason when the binary is missing;
`.ci/run` installs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="no prometheus binary (apt-get install -y prometheus; .ci/run installs it)",
    ),
    pytest.mark.timeout(120),
]

SCRAPE_S = 1.0
EXPORT_S = 0.5
STEP_A, STEP_B = 0.05, 0.2  # seconds per step of the leaking and of the healthy trainer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _memtop(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **popen,
    )


def _once(socket_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--socket-dir", str(socket_dir), "--once", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


@dataclass
class Host:
    name: str
    socket_dir: Path
    demo: subprocess.Popen[str]
    pids: list[int]
    exporter: subprocess.Popen[str]
    port: int


@dataclass
class Fleet:
    a: Host
    b: Host
    url: str
    prometheus: subprocess.Popen[bytes]

    def query(self, promql: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=5) as reply:
            data = json.load(reply)
        assert data["status"] == "success", data
        return data["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(promql)
            if result:
                return result
            time.sleep(0.25)
        raise AssertionError(f"Prometheus never had {promql}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _host(name: str, scenario: str, step: float, stack: contextlib.ExitStack) -> Iterator[Host]:
    directory = Path(tempfile.mkdtemp(prefix="mt-"))
    directory.chmod(0o700)
    stack.callback(shutil.rmtree, directory, True)
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(directory))
    demo = _memtop("demo", "--no-ui", "--scenario", scenario, "--step-time", str(step), env=env)
    stack.callback(_stop, demo)
    assert demo.stdout is not None
    banner = demo.stdout.readline()
    assert "simulated trainer" in banner, demo.stderr.read() if demo.stderr else ""
    pids = [int(p) for p in re.search(r"pids ([\d ]+)\.", banner).group(1).split()]  # type: ignore[union-attr]
    exporter = _memtop(
        "--socket-dir", str(directory), "export", "--listen", "127.0.0.1:0",
        "--hostname", name, "--interval", str(EXPORT_S), env=env,
    )  # fmt: skip
    stack.callback(_stop, exporter)
    assert exporter.stdout is not None
    line = exporter.stdout.readline()
    match = re.search(r"serving http://127\.0\.0\.1:(\d+)/metrics", line)
    assert match, line + (exporter.stderr.read() if exporter.stderr else "")
    yield Host(name.lower(), directory, demo, pids, exporter, int(match.group(1)))


def _prometheus(ports: list[int], stack: contextlib.ExitStack) -> tuple[str, subprocess.Popen]:
    """A Prometheus scraping the exporters on `ports` every SCRAPE_S, ready: its URL and
    process (stopped by `stack`)."""
    work = Path(tempfile.mkdtemp(prefix="prom-"))
    stack.callback(shutil.rmtree, work, True)
    port = _free_port()
    config = work / "prometheus.yml"
    targets = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_S:g}s\n  scrape_timeout: {SCRAPE_S:g}s\n"
        "scrape_configs:\n"
        "  - job_name: memtop\n"
        "    honor_labels: true\n"
        "    static_configs:\n"
        f"      - targets: [{targets}]\n"
    )
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    stack.callback(_stop, prometheus)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply,
        ):
            if reply.status == 200:
                break
        if prometheus.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"prometheus did not start: {prometheus.stderr.read()!r}")  # type: ignore[union-attr]
        time.sleep(0.2)
    return url, prometheus


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(_host("Node-A", "leak", STEP_A, stack))
        b = stack.enter_context(_host("node-b", "healthy", STEP_B, stack))
        url, prometheus = _prometheus([a.port, b.port], stack)
        yield Fleet(a, b, url, prometheus)


def _by_pid(result: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for series in result:
        out.setdefault(int(series["metric"]["pid"]), []).append(series)
    return out


# (These two before the fleet's tests: a module's fixture lives until the module ends, and the
# fleet's trainers, exporters and Prometheus would run through them.)
def test_fleet_errors_are_one_line():
    port = _free_port()  # nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--prometheus", f"http://127.0.0.1:{port}",
         "--once", "--json"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "cannot reach Prometheus" in out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--prometheus", "ftp://x", "--once"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 1 and "http(s)://HOST:PORT" in bad.stderr


@pytest.mark.slow
def test_two_hosts_with_the_same_pids_stay_apart_in_the_fleet():
    from memtop.engine.fleet import FleetSampler
    from memtop.model import host_of
    from memtop.sources.prometheus import PrometheusSource

    with contextlib.ExitStack() as stack:
        a = stack.enter_context(_host("node-a", "leak", STEP_A, stack))
        url, _ = _prometheus([a.port, _twin(a.port, "node-a", "node-c", stack)], stack)
        fleet = Fleet(a, a, url, _)
        fleet.wait_for('count(count by (hostname) (memtop_agent_info{state="connected"})) == 2')
        (pid,) = a.pids
        out = subprocess.run(
            [sys.executable, "-m", "memtop.cli", "--prometheus", url, "--once", "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        report = json.loads(out.stdout)
        assert [h["host"] for h in report["hosts"]] == ["node-a", "node-c"]
        assert [(x["host"], x["pid"]) for x in report["agents"]] == [
            ("node-a", pid),
            ("node-c", pid),
        ]
        # The dashboard's one store: each host's GPU with its own trainer, nothing hidden.
        sampler = FleetSampler(PrometheusSource(url), interval=1.0)
        sampler.sample_once()
        obs = sampler.observer().latest()
        assert not any("same pid" in problem for problem in obs.problems), obs.problems
        assert [g.host for g in obs.gpus] == ["node-a", "node-c"]
        for gpu in obs.gpus:
            assert [(host_of(d.pid), int(d.pid)) for d in gpu.agents] == [(gpu.host, pid)]
        assert [(host_of(e.pid), int(e.pid)) for e in obs.entries] == [
            ("node-a", pid),
            ("node-c", pid),
        ]


def test_prometheus_holds_the_leaking_trainers_allocator_numbers(fleet: Fleet):
    (leaker,) = fleet.a.pids
    result = fleet.wait_for(f'memtop_allocated_bytes{{hostname="node-a",pid="{leaker}"}}')
    labels = result[0]["metric"]
    assert labels["hostname"] == "node-a"  # lower case, as DCGM exporter's
    assert labels["UUID"].startswith("GPU-") and labels["gpu"] == "0"
    assert labels["modelName"].startswith("Simulated") and labels["job"] == "sim_train.py"
    assert float(result[0]["value"][1]) > 0
    # What rises under a leak: allocated right after each step, and torch's peak.  (The raw
    # allocated bytes swing by the activations within every step: a sawtooth 10 GiB high.)
    rising = f'{{hostname="node-a",pid="{leaker}"}}'
    first_baseline = float(fleet.wait_for(f"memtop_step_baseline_bytes{rising}")[0]["value"][1])
    first_peak = float(fleet.query(f"memtop_peak_bytes{rising}")[0]["value"][1])
    time.sleep(3 * SCRAPE_S)
    later_baseline = float(fleet.query(f"memtop_step_baseline_bytes{rising}")[0]["value"][1])
    later_peak = float(fleet.query(f"memtop_peak_bytes{rising}")[0]["value"][1])
    mib_per_s = 8 / STEP_A  # the leak scenario pins 8 MiB a step
    assert later_baseline - first_baseline > 0.3 * mib_per_s * 3 * SCRAPE_S * (1 << 20)
    assert later_peak > first_peak
    # Every allocated sample Prometheus stored sits at or above the first baseline less the
    # gradients (alive at the step boundary, freed by the next step's zero_grad): the
    # sawtooth climbs with it.
    gradients = fleet.wait_for(
        f'memtop_breakdown_bytes{{hostname="node-a",pid="{leaker}",part="gradients"}}'
    )
    floor = first_baseline - float(gradients[0]["value"][1])
    window = fleet.query(f"min_over_time(memtop_allocated_bytes{rising}[2s])")
    assert float(window[0]["value"][1]) >= 0.9 * floor
    # The verdict travels too: a leak of ~8 MiB a step, seen from Prometheus.
    detected = fleet.wait_for(f"memtop_leak_detected{rising} == 1", timeout=30)
    assert detected
    per_step = float(fleet.query(f"memtop_leak_bytes_per_step{rising}")[0]["value"][1])
    assert 6 * (1 << 20) < per_step < 10 * (1 << 20)
    # Counters are counters, and the healthy host is there beside it.
    assert fleet.query(f'memtop_steps_total{{hostname="node-b",pid="{fleet.b.pids[0]}"}}')
    rate = fleet.wait_for(f"rate(memtop_steps_total{rising}[5s]) > 0")
    assert 0.3 / STEP_A < float(rate[0]["value"][1]) < 2 / STEP_A


@pytest.mark.slow
@pytest.mark.skipif(PROMTOOL is None, reason="no promtool binary")
def test_promtool_checks_a_real_scrape(fleet: Fleet):
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.a.port}/metrics", timeout=5) as reply:
        scrape = reply.read().decode()
    assert "memtop_allocated_bytes{" in scrape and "_created" not in scrape
    snake = scrape.replace("UUID=", "uuid=").replace("modelName=", "model_name=")
    clean = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=snake, capture_output=True, text=True
    )
    assert clean.returncode == 0 and not (clean.stdout + clean.stderr).strip(), clean
    raw = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=scrape, capture_output=True, text=True
    )
    problems = [line for line in (raw.stdout + raw.stderr).splitlines() if line.strip()]
    # DCGM exporter's own label names (UUID, modelName) are camelCase; nothing else is flagged.
    assert all("snake_case" in line for line in problems), problems


@pytest.mark.slow
def test_fleet_once_json_shows_both_hosts_with_their_local_numbers(fleet: Fleet):
    fleet.wait_for('memtop_leak_detected{hostname="node-a"} == 1', timeout=30)
    fleet.wait_for('memtop_breakdown_bytes{hostname="node-b"}', timeout=30)
    before = {"node-a": _once(fleet.a.socket_dir), "node-b": _once(fleet.b.socket_dir)}
    out = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--prometheus", fleet.url, "--once", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    remote = json.loads(out.stdout)
    after = {"node-a": _once(fleet.a.socket_dir), "node-b": _once(fleet.b.socket_dir)}

    assert [h["host"] for h in remote["hosts"]] == ["node-a", "node-b"]
    assert {a["host"] for a in remote["agents"]} == {"node-a", "node-b"}
    # Prometheus's view lags the trainers by up to a scrape plus an export round.
    lag_s = SCRAPE_S + EXPORT_S + 1.0
    for host, step_s in (("node-a", STEP_A), ("node-b", STEP_B)):
        theirs = next(h for h in remote["hosts"] if h["host"] == host)
        local, local_after = before[host], after[host]
        assert theirs["actions"] == "local-only"
        assert [(d["uuid"], d["name"], d["total_bytes"]) for d in theirs["devices"]] == [
            (d["uuid"], d["name"], d["total_bytes"]) for d in local["devices"]
        ]
        assert [a["pid"] for a in theirs["agents"]] == [a["pid"] for a in local["agents"]]
        for agent, mine, mine_after in zip(
            theirs["agents"], local["agents"], after[host]["agents"], strict=True
        ):
            assert agent["argv"] == mine["argv"] and agent["state"] == "connected"
            (dev,) = agent["devices"]
            (was,) = mine["devices"]
            (now,) = mine_after["devices"]
            assert (dev["uuid"], dev["gpu"], dev["index"]) == (
                was["uuid"],
                was["gpu"],
                was["index"],
            )
            # Counters and monotone figures fall between the two local reports, give or take
            # the lag.
            steps_lag = lag_s / step_s
            assert was["step"] - steps_lag <= dev["step"] <= now["step"], (host, dev, was, now)
            assert (
                dev["num_ooms"] == was["num_ooms"]
                and dev["num_alloc_retries"] == was["num_alloc_retries"]
            )
            assert dev["total_bytes"] == was["total_bytes"]
            if host == "node-b":  # healthy: what the cache holds and the peak stand still
                assert dev["reserved_bytes"] == was["reserved_bytes"] == now["reserved_bytes"]
                assert dev["peak_bytes"] == was["peak_bytes"]
                assert dev["breakdown"] == was["breakdown"]
                assert not dev["leak"]["detected"]
            else:  # leaking 8 MiB a step: the peak grows by at most the lag's worth
                grown = 8 * (1 << 20) * (steps_lag + 2)
                assert was["peak_bytes"] - grown <= dev["peak_bytes"] <= now["peak_bytes"]
                said = {k: was["leak"].get(k) for k in ("reason", "basis", "samples")}
                assert was["leak"]["detected"], f"local --once at step {was['step']}: {said}"
                assert dev["leak"]["detected"], dev["leak"]
                assert dev["leak"]["bytes_per_step"] == pytest.approx(
                    was["leak"]["bytes_per_step"], rel=0.2
                )
            # Whatever the moment, allocated stays within what the cache holds.
            assert 0 < dev["allocated_bytes"] <= dev["reserved_bytes"]
        rules = lambda report: sorted((s["rule"], s["pid"]) for s in report["suggestions"])  # noqa: E731
        assert rules(theirs) == rules(local) or rules(theirs) == rules(local_after)


@pytest.mark.slow
def test_fleet_dashboard_groups_hosts_and_keeps_actions_local(fleet: Fleet):
    import asyncio

    from ui_helpers import notifications, wait_for

    from memtop.engine.fleet import FleetSampler
    from memtop.model import HostPid, host_of
    from memtop.sources.prometheus import PrometheusSource
    from memtop.ui.app import MemtopApp

    a_pids = [HostPid(p, "node-a") for p in fleet.a.pids]
    b_pids = [HostPid(p, "node-b") for p in fleet.b.pids]
    sampler = FleetSampler(PrometheusSource(fleet.url), interval=1.0)
    sampler.sample_once()  # as `memtop --prometheus URL` does: the first frame has the fleet
    app = MemtopApp(sampler.store, sampler, interval=1.0, host="fleet", observer=sampler.observer())

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(
                pilot,
                lambda: app.observation is not None and len(app.observation.live_agents) == 2,
            )
            obs = app.observation
            assert obs is not None
            # host -> GPU -> process: fleet-wide GPU numbers in host order, the host named.
            assert [g.name.split(":")[0] for g in obs.gpus] == ["node-a #0", "node-b #0"]
            assert [(host_of(e.pid), e.pid) for e in obs.entries] == [
                *(("node-a", p) for p in a_pids),
                *(("node-b", p) for p in b_pids),
            ]
            assert {obs.processes[p].user for p in a_pids} == {"node-a"}
            leak = obs.device(a_pids[0], 0)
            assert leak is not None and leak.diagnosis.leak.detected
            for key in ("c", "s"):
                await pilot.press(key)
                await wait_for(pilot, lambda: any("local-only" in n for n in notifications(app)))
                app.clear_notifications()
            # The detail screen draws the remote history (loaded from query_range at start).
            from memtop.ui.screens.detail import DetailScreen

            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen))
            await wait_for(
                pilot, lambda: app.screen.detail is not None and app.screen.detail.series
            )
            await pilot.press("escape")
            assert sampler.may_signal(b_pids[0]) == (
                f"pid {fleet.b.pids[0]} runs on node-b: the fleet view acts locally only "
                "(ssh node-b)"
            )

    try:
        asyncio.run(main())
    finally:
        sampler.stop()


def _twin(port: int, host: str, twin: str, stack: contextlib.ExitStack) -> int:
    """An exporter that serves what the one on `port` serves, as host `twin`: the same pids
    and GPU UUIDs on another host (two containers of one job, numbered alike)."""
    import http.server
    import threading

    class Twin(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                body = reply.read().replace(
                    f'hostname="{host}"'.encode(), f'hostname="{twin}"'.encode()
                )
                kind = reply.headers["Content-Type"]
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Twin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return int(server.server_address[1])


GRAFANA = Path(__file__).parent.parent / "contrib" / "grafana" / "memtop.json"


def _grafana_to_promql(expr: str) -> str:
    """The dashboard's variables as Grafana fills them with "All" selected."""
    for name, value in (("$hostname", ".*"), ("$job", ".*"), ("$__rate_interval", "5s"),
                        ("$__range", "1m")):  # fmt: skip
        expr = expr.replace(name, value)
    return expr


def test_grafana_dashboard_queries_run_on_prometheus(fleet: Fleet):
    board = json.loads(GRAFANA.read_text())
    assert board["uid"] and board["schemaVersion"] >= 36 and board["id"] is None
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:  # every panel on the data source variable, inside the 24 columns
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    fleet.wait_for('memtop_leak_detected{hostname="node-a"} == 1', timeout=30)
    fleet.wait_for("memtop_breakdown_bytes", timeout=30)
    empty = []
    for panel in panels:
        for t in panel["targets"]:
            result = fleet.query(_grafana_to_promql(t["expr"]))  # a bad query raises here
            if not result:
                empty.append(panel["title"])
    # With a leaking and a healthy trainer, only the OOM/retry counters may have nothing yet.
    assert set(empty) <= {"OOMs and allocator retries", "Soonest full"}, empty
    for var in board["templating"]["list"][1:]:
        metric, label = re.match(r"label_values\((.+), (\w+)\)", var["query"]["query"]).groups()  # type: ignore[union-attr]
        values = {r["metric"].get(label) for r in fleet.query(_grafana_to_promql(metric))}
        assert values - {None}, var["name"]


def test_zz_a_host_whose_exporter_stops_is_named_not_silently_dropped(fleet: Fleet):
    # Last in the module: it stops node-b's exporter.
    _stop(fleet.b.exporter)
    fleet.wait_for(f'up{{instance="127.0.0.1:{fleet.b.port}"}} == 0', timeout=15)
    out = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--prometheus", fleet.url, "--once", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    remote = json.loads(out.stdout)
    assert [h["host"] for h in remote["hosts"]] == ["node-a"]
    assert remote["problems"] == [
        f"node-b: its exporter at 127.0.0.1:{fleet.b.port} did not answer Prometheus's last "
        "scrape (up == 0)"
    ]
    text = subprocess.run(
        [sys.executable, "-m", "memtop.cli", "--prometheus", fleet.url, "--once"],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert text.startswith(f"memtop {remote['version']}: fleet of 1 host(s) in {fleet.url}")
    assert "! node-b: its exporter" in text and "on node-a" in text
    assert "Actions (cleanup, snapshot, kill) are local-only" in text


def test_every_metric_the_alerts_and_the_dashboard_query_is_in_a_real_scrape(fleet: Fleet):
    """A renamed metric fails here, not at night: contrib's alerting rules and Grafana dashboard
    query only names that a real `memtop export` serves (issue 33.4)."""
    from test_alerts import queried_metrics

    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.a.port}/metrics", timeout=10) as r:
        body = r.read().decode()
    served = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M):
        served.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    missing = queried_metrics() - served
    assert not missing, f"queried but not exported: {sorted(missing)}"
