"""The fleet view without a Prometheus: the exporter's text, parsed as Prometheus would store it,
read back by the fleet source into an observation that reports as the original did."""

from __future__ import annotations

import pytest
from helpers.observations import frozen_observation
from prometheus_client.parser import text_string_to_metric_families
from ui_frozen import TRAINERS

from memtop import report
from memtop.export.metrics import render
from memtop.export.text import exposition
from memtop.fleet import FleetSampler, host_observation, short_host
from memtop.sources.prometheus import FleetReading, PrometheusError, PrometheusSource, hosts_of


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


def test_two_hosts_stay_apart():
    first = exposition(render(frozen_observation(), host="node-a")).decode()
    second = exposition(render(frozen_observation(exited=TRAINERS[2].pid), host="node-b")).decode()
    hosts = hosts_of(_as_prometheus_has_it(first) + _as_prometheus_has_it(second, "b:9482"))
    assert [h.host for h in hosts] == ["node-a", "node-b"]
    states = {p.pid: p.state.value for p in hosts[1].polls}
    assert states[TRAINERS[2].pid] == "exited"

    class Source:
        url = "http://prometheus:9090"

        def read(self) -> FleetReading:
            return FleetReading(0.0, tuple(hosts))

        def history(self, *args, **kwargs):
            return {}

    sampler = FleetSampler(Source(), interval=1.0)  # type: ignore[arg-type]
    sampler.sample_once()
    # The same pids on both hosts: one table keyed by pid shows the first and says so.
    assert any("hidden" in p and "node-a has the same pid" in p for p in sampler.store.problems())
    obs = sampler.observer().latest()
    assert [g.index for g in obs.gpus] == [0, 1, 2, 3]
    assert obs.gpus[2].name.startswith("node-b #0: ")


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
