"""`memtop export`: the frozen observation as metrics, the HTTP server, auth, TLS, the CLI."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.observations import HOST, frozen_observation
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ui_frozen import TRAINERS, UUIDS

from memtop.base.jobs import DCGM_LABELS as JOB_LABELS
from memtop.export.metrics import ObservationCollector, job_name, render
from memtop.export.server import Exporter, ExportError, WebConfig, load_web_config, parse_listen
from memtop.export.text import exposition

DCGM_LABELS = {"hostname", "UUID", "gpu", "modelName"}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def observation():
    return frozen_observation()


@pytest.fixture(scope="module")
def scrape(observation) -> str:
    collector = ObservationCollector(host="GPU-Box")
    collector.observe(observation)
    return collector.body().decode()


def test_names_units_and_labels_follow_the_conventions(scrape: str):
    samples = _samples(scrape)
    names = {name for name, _ in samples}
    assert all(n.startswith("memtop_") for n in names)
    assert not any(n.endswith("_created") for n in names)
    for counter in ("memtop_alloc_retries_total", "memtop_ooms_total", "memtop_steps_total"):
        assert counter in names
        assert f"# TYPE {counter} counter" in scrape
    for name in names:  # sizes in bytes, times in seconds, shares as ratios
        assert not any(unit in name for unit in ("mib", "gib", "_mb", "percent", "_ms")), name
    allocated = {
        dict(k)["pid"]: v for (n, k), v in samples.items() if n == "memtop_allocated_bytes"
    }
    assert set(allocated) == {str(t.pid) for t in TRAINERS}
    for (name, labels), _ in samples.items():
        if name == "memtop_allocated_bytes":
            keys = dict(labels)
            # with DCGM's job labels (issue 25): hpc_job, pod, namespace, container
            assert DCGM_LABELS | {"pid", "rank", "job", *JOB_LABELS} == set(keys)
            assert keys["hostname"] == "gpu-box"  # lower case, as DCGM's
            assert keys["UUID"] in UUIDS and keys["gpu"] in ("0", "1")
            assert keys["modelName"] == "NVIDIA H100 80GB HBM3"
            assert keys["job"] == "train.py"


def test_values_are_the_observations(observation, scrape: str):
    samples = _samples(scrape)
    for agent in observation.agents:
        for dev in observation.devices_of(agent):
            key = {
                "hostname": "gpu-box",
                "UUID": dev.uuid,
                "gpu": str(dev.gpu),
                "modelName": dev.name,
                "pid": str(agent.pid),
                "rank": "",
                "job": "train.py",
                **dict.fromkeys(JOB_LABELS, ""),  # no scheduler: empty, as DCGM leaves them
            }
            labels = tuple(sorted(key.items()))
            assert samples[("memtop_allocated_bytes", labels)] == dev.allocated_bytes
            assert samples[("memtop_reserved_bytes", labels)] == dev.reserved_bytes
            assert samples[("memtop_peak_bytes", labels)] == dev.peak_bytes
            assert samples[("memtop_fragmentation_ratio", labels)] == pytest.approx(
                dev.sample.fragmentation
            )
            leak = dev.diagnosis.leak
            if leak.bytes_per_step is not None:
                assert samples[("memtop_leak_bytes_per_step", labels)] == pytest.approx(
                    leak.bytes_per_step
                )
            parts = {
                dict(k)["part"]: v
                for (n, k), v in samples.items()
                if n == "memtop_breakdown_bytes" and dict(k)["pid"] == str(agent.pid)
            }
            assert parts["optimizer_state"] == dev.diagnosis.breakdown["optimizer_state"]
    leaking = next(t for t in TRAINERS if t.kind == "leak")
    detected = {dict(k)["pid"]: v for (n, k), v in samples.items() if n == "memtop_leak_detected"}
    assert detected[str(leaking.pid)] == 1
    assert detected[str(TRAINERS[0].pid)] == 0
    counts = {
        (dict(k)["severity"], dict(k)["rule"]): v
        for (n, k), v in samples.items()
        if n == "memtop_suggestions"
    }
    assert sum(counts.values()) == len(observation.suggestions) > 0
    gpu_used = {
        dict(k)["UUID"]: v for (n, k), v in samples.items() if n == "memtop_gpu_memory_used_bytes"
    }
    for gpu in observation.gpus:
        if gpu.used_bytes is not None:
            assert gpu_used[gpu.uuid] == gpu.used_bytes


def test_fast_text_parses_to_the_same_samples_as_prometheus_client(observation, scrape: str):
    collector = ObservationCollector(host="GPU-Box")
    collector.observe(observation)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    assert _samples(generate_latest(registry).decode()) == _samples(scrape)
    # Awkward label values are escaped the same way.
    families = render(observation, host="h", job='a "quoted"\\job\nname')
    registry = CollectorRegistry(auto_describe=False)

    class Fixed:
        def collect(self):
            return iter(families)

    registry.register(Fixed())  # type: ignore[arg-type]
    assert _samples(exposition(families).decode()) == _samples(generate_latest(registry).decode())


def test_exited_agents_keep_their_info_but_no_present_numbers():
    observation = frozen_observation(exited=TRAINERS[1].pid)
    text = exposition(render(observation, host=HOST)).decode()
    pid = str(TRAINERS[1].pid)
    info = [
        line for line in text.splitlines() if line.startswith("memtop_agent_info") and pid in line
    ]
    assert len(info) == 1 and 'state="exited"' in info[0]
    assert not any(
        line.startswith("memtop_allocated_bytes") and f'pid="{pid}"' in line
        for line in text.splitlines()
    )


def test_job_name_of_a_command():
    assert job_name(["python", "train.py", "--lr=1"]) == "train.py"
    assert job_name(["python3.12", "-m", "pkg.train"]) == "pkg.train"
    assert job_name(["/usr/bin/torchrun", "--nproc=8", "train.py"]) == "torchrun"
    assert job_name(["/home/a/train.py"]) == "train.py"
    assert job_name([]) == ""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_finds_nothing_but_dcgms_own_label_names(scrape: str):
    snake = scrape.replace("UUID=", "uuid=").replace("modelName=", "model_name=")
    clean = subprocess.run(
        ["promtool", "check", "metrics"], input=snake, capture_output=True, text=True
    )
    assert clean.returncode == 0 and not clean.stdout.strip() and not clean.stderr.strip(), clean
    # DCGM exporter's labels are camelCase; promtool's style lint is all it says about them.
    raw = subprocess.run(
        ["promtool", "check", "metrics"], input=scrape, capture_output=True, text=True
    )
    problems = [line for line in (raw.stdout + raw.stderr).splitlines() if line.strip()]
    assert problems and all("snake_case" in line for line in problems)


# ---------------------------------------------------------------------------- the server


def _get(url: str, **headers: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers)
    context = ssl._create_unverified_context() if url.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class _NoSampler:
    def __init__(self, store) -> None:
        self.store = store


def _exporter(observation, web_config: WebConfig | None = None) -> Exporter:
    from helpers.observations import frozen_observer

    observer = frozen_observer()
    exporter = Exporter(_NoSampler(observer.store), "127.0.0.1:0", web_config=web_config)  # type: ignore[arg-type]
    exporter.collector.observe(observation)
    return exporter


def test_http_serves_metrics_and_nothing_else(observation):
    exporter = _exporter(observation)
    exporter.collector._observation = None  # before the first sampling round
    host, port = exporter.start_http()
    try:
        assert _get(f"http://{host}:{port}/metrics")[0] == 503  # up=0, not an empty success
        exporter.collector.observe(observation)
        status, body = _get(f"http://{host}:{port}/metrics")
        assert status == 200 and b"memtop_allocated_bytes{" in body
        assert _get(f"http://{host}:{port}/nope")[0] == 404
    finally:
        exporter.stop()


def test_basic_auth_and_tls(observation, tmp_path: Path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    digest = hashlib.sha256(b"s3cret").hexdigest()
    config_path = tmp_path / "web.json"
    config_path.write_text(
        json.dumps(
            {
                "tls": {"cert_file": str(cert), "key_file": str(key)},
                "basic_auth": {"prometheus": f"sha256:{digest}"},
            }
        )
    )
    exporter = _exporter(observation, load_web_config(config_path))
    host, port = exporter.start_http()
    url = f"https://{host}:{port}/metrics"
    good = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()
    bad = "Basic " + base64.b64encode(b"prometheus:guess").decode()
    try:
        assert _get(url)[0] == 401
        assert _get(url, Authorization=bad)[0] == 401
        status, body = _get(url, Authorization=good)
        assert status == 200 and b"memtop_reserved_bytes" in body
        with pytest.raises(OSError):  # plain HTTP on the TLS port gets nothing
            urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read()
    finally:
        exporter.stop()


@pytest.mark.parametrize(
    "config, message",
    [
        ("{", "not JSON"),
        ("[" * 60_000, "nests deeper than 64 levels"),  # was a RecursionError traceback
        (" " * (65 << 10), "larger than 64 KiB"),
        ('{"tls": {"cert_file": "a"}}', "both cert_file and key_file"),
        ('{"basic_auth": {"u": "plain"}}', "sha256:<64 hex>"),
        ('{"users": {}}', "only 'tls' and 'basic_auth'"),
    ],
)
def test_bad_web_configs_say_what_is_wrong(tmp_path: Path, config: str, message: str):
    path = tmp_path / "web.json"
    path.write_text(config)
    with pytest.raises(ExportError, match=message.replace("(", r"\(")):
        load_web_config(path)


def test_listen_addresses():
    assert parse_listen("127.0.0.1:9482") == ("127.0.0.1", 9482)
    assert parse_listen(":9000") == ("127.0.0.1", 9000)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    for bad in ("9482", "host:", "host:99999", "host:port"):
        with pytest.raises(ExportError):
            parse_listen(bad)


# ---------------------------------------------------------------------------- the command


def _export_cli(*args: str, socket_dir: Path) -> subprocess.Popen[str]:
    import os
    import sys

    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir))
    return subprocess.Popen(
        [sys.executable, "-m", "memtop.cli", "export", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def test_export_command_serves_warns_beyond_loopback_and_stops_on_sigterm(socket_dir: Path):
    import re
    import signal

    exposed = _export_cli("--listen", "0.0.0.0:0", "--hostname", "Box-1", socket_dir=socket_dir)
    try:
        assert exposed.stdout is not None and exposed.stderr is not None
        line = exposed.stdout.readline()
        port = int(re.search(r"serving http://0\.0\.0\.0:(\d+)/metrics", line).group(1))  # type: ignore[union-attr]
        warning = exposed.stderr.readline()
        assert "warning: 0.0.0.0 is not loopback" in warning and "--web-config" in warning
        status, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and b'memtop_observation_time_seconds{hostname="box-1"}' in body
    finally:
        exposed.send_signal(signal.SIGTERM)
        assert exposed.wait(15) == 0


@pytest.mark.slow
def test_export_command_errors_are_one_line(socket_dir: Path, tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (("--listen", "nowhere"), "--listen wants HOST:PORT"),
            (("--listen", f"127.0.0.1:{port}"), "cannot listen on 127.0.0.1"),
            (("--web-config", str(tmp_path / "missing.json")), "cannot read the web config"),
        ]
        for args, message in cases:
            process = _export_cli(*args, socket_dir=socket_dir)
            out, err = process.communicate(timeout=30)
            assert process.returncode == 1, (args, out, err)
            assert err.count("\n") == 1 and message in err, err
