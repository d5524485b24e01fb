"""Inference servers and preallocators (issue 31, item 2; DESIGN §13 "Servers"): named, and
judged by the share they asked for instead of a trainer's usage thresholds.

The recognition is checked on the command lines and environments the engines really run with;
the judgement on real simulated servers (the `server` and `server-overrun` scenarios: real
processes with the real agent on real sockets), through the sampler, `--once --json` and the
dashboard's view model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memtop.diagnosis import Diagnoser
from memtop.diagnosis.suggestions import RULES, Severity, suggest
from memtop.diagnosis.workload import WorkloadKind, recognise
from memtop.engine.observation import Observer
from memtop.engine.sampler import Sampler
from memtop.engine.store import Store
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource
from memtop.ui import view

GiB = 1 << 30

# ------------------------------------------------------------------ recognition


@pytest.mark.parametrize(
    ("argv", "engine", "share", "setting"),
    [
        (["vllm", "serve", "m", "--gpu-memory-utilization", "0.8"], "vllm", 0.8, "0.8"),
        # A console script runs as `python /usr/bin/vllm …`; `=` and `_` spellings too.
        (["/usr/bin/python3", "/usr/bin/vllm", "serve", "m", "--gpu_memory_utilization=0.7"],
         "vllm", 0.7, "0.7"),
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], "vllm", 0.9,
         "default 0.9"),
        (["python3", "-m", "sglang.launch_server", "--model-path", "m",
          "--mem-fraction-static", "0.85"], "sglang", 0.85, "--mem-fraction-static 0.85"),
        (["text-generation-launcher", "--model-id", "m", "--cuda-memory-fraction", "0.5"],
         "tgi", 0.5, "--cuda-memory-fraction 0.5"),
        (["trtllm-serve", "m", "--kv_cache_free_gpu_memory_fraction", "0.6"], "tensorrt-llm",
         0.6, "0.6"),
    ],
)  # fmt: skip
def test_engines_are_recognised_with_the_share_they_asked_for(argv, engine, share, setting):
    found = recognise(argv)
    assert found is not None
    assert (found.kind, found.engine, found.budget_share) == (WorkloadKind.SERVER, engine, share)
    assert setting in (found.setting or "")


def test_an_engine_process_that_renamed_itself_is_known_by_its_launcher():
    # vLLM's engine core sets its process title and keeps no flags: its launcher has them.
    found = recognise(
        ["VLLM::EngineCore"], {}, ["python3", "/usr/bin/vllm", "serve", "m",
                                   "--gpu-memory-utilization", "0.95"]
    )  # fmt: skip
    assert found is not None and found.engine == "vllm" and found.budget_share == 0.95
    assert found.label == "vLLM · 0.95 of GPU"


def test_environment_sets_tgi_and_jax_shares():
    tgi = recognise(["text-generation-server", "serve", "m"], {"CUDA_MEMORY_FRACTION": "0.4"})
    assert tgi is not None and tgi.budget_share == 0.4 and tgi.setting == "CUDA_MEMORY_FRACTION=0.4"
    jax = recognise(["python", "train.py"], {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"})
    assert jax is not None and (jax.kind, jax.engine, jax.budget_share) == (
        WorkloadKind.PREALLOCATOR,
        "jax",
        0.5,
    )
    off = recognise(["python", "train.py"], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert off is not None and off.engine == "jax" and off.budget_share is None


def test_a_trainer_mentioning_an_engine_in_its_arguments_is_not_a_server():
    assert recognise(["python", "train.py", "--data", "vllm.json", "--out", "sglang"]) is None
    assert recognise(["python", "train.py"], {"PATH": "/usr/bin"}) is None


def test_what_a_command_line_is_is_worked_out_once_and_answered_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The observation asks about every agent and every process on a GPU each round, about the
    # same command lines round after round (issue 35 item 8: the dashboard's own CPU): the
    # answer is worked out once per command line, launcher and environment, and it is the same
    # answer, whichever sequence type the command line comes in.
    from memtop.diagnosis import workload

    worked_out: list[tuple[object, ...]] = []
    real = workload._recognise

    def counted(argv, environ, launcher_argv):  # type: ignore[no-untyped-def]
        worked_out.append((tuple(argv), dict(environ or {}), tuple(launcher_argv)))
        return real(argv, environ, launcher_argv)

    monkeypatch.setattr(workload, "_recognise", counted)
    monkeypatch.setattr(workload, "_recognised", {})
    argv = [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--gpu-memory-utilization",
        "0.8",
    ]
    first = recognise(argv, {}, ())
    for _ in range(5):
        assert recognise(tuple(argv), None, []) == first
    assert first is not None and first.budget_share == 0.8
    assert len(worked_out) == 1
    # What it reads changes the answer: another environment, another launcher, asked afresh.
    tgi = ["text-generation-server", "serve", "m"]
    assert recognise(tgi, {"CUDA_MEMORY_FRACTION": "0.4"}).budget_share == 0.4  # type: ignore[union-attr]
    assert recognise(tgi, {"CUDA_MEMORY_FRACTION": "0.6"}).budget_share == 0.6  # type: ignore[union-attr]
    assert (
        recognise(
            ["VLLM::EngineCore"], {}, ["vllm", "serve", "--gpu-memory-utilization", "0.9"]
        ).budget_share
        == 0.9
    )  # type: ignore[union-attr]
    assert len(worked_out) == 4
    # A value that cannot be a key (a hello's environment is the agent's JSON) is read afresh.
    assert recognise(["python", "train.py"], {"PATH": ["/usr/bin"]}) is None  # type: ignore[dict-item]
    assert len(worked_out) == 5
    # The table is capped, not grown without bound by command lines that come and go.
    monkeypatch.setattr(workload, "RECOGNISED_ENTRIES", 3)
    for i in range(10):
        recognise(["python", f"job{i}.py"])
    assert len(workload._recognised) <= 3


# ------------------------------------------------------------------ real simulated servers


class Watch:
    def __init__(self, directory: Path) -> None:
        self.store = Store()
        self.sampler = Sampler(
            self.store, DefaultDeviceSource(directory, simulated_only=True), AgentPool(directory)
        )
        self.observer = Observer(self.store, Diagnoser(leak_refresh_s=0.0))

    def until(self, seconds: float, done, interval: float = 0.1):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + seconds
        while True:
            self.sampler.sample_once()
            observation = self.observer.latest()
            if done(observation) or time.monotonic() > deadline:
                return observation
            time.sleep(interval)


def _usage(observation):  # type: ignore[no-untyped-def]
    """The GPU's usage verdict judged this round.  One its rule no longer fires is kept a while
    (memtop.diagnosis.stability's dwell) and says "no longer so": after a round where the
    server's agent missed its deadline (hung, under load), the GPU's verdict without it
    ("GPU 0 memory at 99.9 %") stays beside the server's own, under another key."""
    current = [
        s
        for s in observation.suggestions
        if s.rule == "usage" and not s.evidence.endswith("no longer so")
    ]
    assert len(current) <= 1, [s.title for s in current]
    return current[0] if current else None


def _answered(observation) -> bool:  # type: ignore[no-untyped-def]
    """Every agent answered this round: a hung agent's last devices are still listed, but the
    GPU is judged without it (its numbers are not this round's)."""
    agents = observation.agents
    return bool(agents) and all(a.live and a.devices for a in agents)


def _server(socket_dir: Path, scenario: str) -> Demo:
    demo = Demo(gpus=1, scenario=scenario, step_time=0.05, socket_dir=socket_dir)
    demo.start()
    assert demo.wait_ready(30)
    return demo


def test_a_vllm_like_server_flat_at_its_share_is_info_naming_its_flag(socket_dir: Path):
    demo = _server(socket_dir, "server")
    watch = Watch(socket_dir)
    try:
        observation = watch.until(30, lambda o: _usage(o) is not None and _answered(o))
        usage = _usage(observation)
        assert usage is not None, [s.title for s in observation.suggestions]
        assert usage.severity == Severity.INFO, (usage.title, usage.detail)
        assert "--gpu-memory-utilization" in usage.detail
        assert "vLLM" in usage.title and "92.0 %" in usage.title
        # Not a trainer: none of a training loop's tips.
        rules = {s.rule for s in observation.suggestions}
        assert not rules & {"8bit_optimizer", "bigger_batch", "gradient_checkpointing"}
        (gpu_facts,) = observation.diagnosis.gpus
        (device,) = gpu_facts.agents
        assert device.workload is not None and device.workload.kind == WorkloadKind.SERVER
        # An optimizer-sized breakdown does not make a server a trainer.
        loaded = dataclasses.replace(device, breakdown={"optimizer_state": 30 * GiB})
        tips = suggest([dataclasses.replace(gpu_facts, agents=(loaded,))], RULES)
        assert not {s.rule for s in tips} & {"8bit_optimizer", "bigger_batch"}

        # The dashboard's table says what it is and what it reserved on purpose.
        dashboard = view.build(observation)
        (row,) = [r for r in dashboard.processes if r.pid == device.pid]
        assert row.command.startswith("vLLM · 0.92 of GPU"), row.command
        (item,) = [i for i in dashboard.suggestions if i.rule == "usage"]
        assert item.severity == Severity.INFO

        # The exporter: the process's kind and engine, its share and the setting that sets it.
        from memtop.export.metrics import render

        families = {f.name: f for f in render(observation)}
        (share,) = families["memtop_process_budget_share"].samples
        assert share.value == 0.92 and share.labels["pid"] == str(device.pid)
        assert share.labels["setting"] == "--gpu-memory-utilization 0.92"
        (kind,) = families["memtop_process_workload_info"].samples
        assert (kind.labels["kind"], kind.labels["engine"]) == ("server", "vllm")

        # --once --json: the same verdict, and the process's kind, engine, share and setting.
        out = subprocess.run(
            [sys.executable, "-m", "memtop", "--once", "--json", "--socket-dir", str(socket_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
        )
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        (agent,) = data["agents"]
        assert (agent["kind"], agent["engine"]) == ("server", "vllm")
        workload = agent["devices"][0]["workload"]
        assert workload["budget_share"] == 0.92
        assert workload["setting"] == "--gpu-memory-utilization 0.92"
        (usage_json,) = [s for s in data["suggestions"] if s["rule"] == "usage"]
        assert usage_json["severity"] == "info"
        assert "--gpu-memory-utilization" in usage_json["detail"]
    finally:
        watch.sampler.stop()
        demo.stop()


def test_the_same_server_past_its_share_with_retries_is_critical(socket_dir: Path):
    demo = _server(socket_dir, "server-overrun")
    watch = Watch(socket_dir)
    try:

        def past(o) -> bool:  # type: ignore[no-untyped-def]
            # A round its server answered: under load its agent can miss a round's deadline,
            # and the GPU is then judged without it ("GPU 0 memory at 99.9 %", the flake CI
            # saw) while its last devices, retries and all, are still listed.
            usage = _usage(o)
            devices = [d for a in o.agents for d in o.devices_of(a)]
            return (
                usage is not None
                and _answered(o)
                and devices[0].sample.num_alloc_retries > 0
                and Severity(usage.severity).rank >= Severity.CRITICAL.rank
            )

        observation = watch.until(60, past)
        assert past(observation), [(a.pid, a.state, a.error) for a in observation.agents]
        usage = _usage(observation)
        assert usage is not None
        assert Severity(usage.severity).rank >= Severity.CRITICAL.rank, (usage.title, usage.detail)
        assert "past its request" in usage.title
        assert "larger batch" not in usage.detail
    finally:
        watch.sampler.stop()
        demo.stop()
