"""The deployment files in contrib/ (issue 25.6): the Kubernetes manifests parse and name the
port, paths and labels the README does; the systemd unit's ExecStart runs."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONTRIB = ROOT / "contrib"
README = (ROOT / "README.md").read_text()


# ------------------------------------------------------------------ a YAML subset, strictly read
# PyYAML is not a dependency: the manifests keep to block mappings and sequences of plain or
# double-quoted scalars, and this reader refuses anything else (tabs, flow style, anchors,
# multi-line strings, bad indentation), so a manifest it accepts is YAML with this meaning.


def _scalar(text: str) -> Any:
    if text.startswith('"'):
        if not (len(text) >= 2 and text.endswith('"')) or '"' in text[1:-1]:
            raise ValueError(f"bad quoted scalar {text!r}")
        return text[1:-1]
    if any(c in text for c in "{}[]&*!|>'\"%@`") or text.startswith("- "):
        raise ValueError(f"outside the subset: {text!r}")
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def _lines(document: str) -> list[tuple[int, str]]:
    out = []
    for raw in document.splitlines():
        if "\t" in raw:
            raise ValueError("tab in YAML")
        stripped = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if stripped.strip():
            out.append((len(stripped) - len(stripped.lstrip(" ")), stripped.strip()))
    return out


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        items = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("-"):
            rest = lines[i][1][1:].strip()
            if not rest:
                value, i = _block(lines, i + 1, lines[i + 1][0])
            elif re.match(r"^[A-Za-z0-9_.\-/]+:( |$)", rest):
                # "- key: value" opens a mapping indented two more
                lines[i] = (indent + 2, rest)
                value, i = _block(lines, i, indent + 2)
            else:
                value, i = _scalar(rest), i + 1
            items.append(value)
        return items, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("- "):
        match = re.match(r"^([A-Za-z0-9_.\-/]+):(?: (.*))?$", lines[i][1])
        if match is None:
            raise ValueError(f"not a mapping entry: {lines[i][1]!r}")
        key, rest = match.group(1), (match.group(2) or "").strip()
        if key in mapping:
            raise ValueError(f"duplicate key {key}")
        if rest:
            mapping[key], i = _scalar(rest), i + 1
        else:
            nested = lines[i + 1][0] if i + 1 < len(lines) else -1
            if nested < indent or (nested == indent and not lines[i + 1][1].startswith("- ")):
                raise ValueError(f"{key}: empty value")
            mapping[key], i = _block(lines, i + 1, nested)
    if i < len(lines) and lines[i][0] > indent:
        raise ValueError(f"bad indentation at {lines[i][1]!r}")
    return mapping, i


def load_all(text: str) -> list[Any]:
    documents = []
    for document in re.split(r"^---$", text, flags=re.MULTILINE):
        lines = _lines(document)
        if not lines:
            continue
        value, end = _block(lines, 0, lines[0][0])
        if end != len(lines):
            raise ValueError(f"trailing content at {lines[end][1]!r}")
        documents.append(value)
    return documents


def test_the_subset_reader_refuses_what_it_does_not_understand() -> None:
    assert load_all('a:\n  b: 1\n  c:\n    - x\n    - y: "2"\n') == [
        {"a": {"b": 1, "c": ["x", {"y": "2"}]}}
    ]
    for bad in ("a: [1, 2]\n", "a:\n\tb: 1\n", "a: 1\na: 2\n", "a:\n  b: 1\n c: 2\n", "a: &x 1\n"):
        with pytest.raises(ValueError):
            load_all(bad)


# ------------------------------------------------------------------ Kubernetes


def manifests() -> dict[str, dict[str, Any]]:
    documents = load_all((CONTRIB / "kubernetes" / "memtop-exporter.yaml").read_text())
    return {doc["kind"]: doc for doc in documents}


def test_daemonset_service_and_servicemonitor_agree_with_each_other_and_the_readme() -> None:
    found = manifests()
    assert set(found) == {"DaemonSet", "Service", "ServiceMonitor"}
    daemonset, service, monitor = found["DaemonSet"], found["Service"], found["ServiceMonitor"]
    assert daemonset["apiVersion"] == "apps/v1"
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    pod = daemonset["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["selector"] == labels
    assert monitor["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]
    spec = pod["spec"]
    assert spec["hostPID"] is True
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "resources" not in container or "nvidia.com/gpu" not in str(container["resources"])
    (port,) = container["ports"]
    (service_port,) = service["spec"]["ports"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] == port["name"] == "metrics"
    assert service_port["targetPort"] == "metrics" and endpoint["honorLabels"] is True
    assert service_port["port"] == port["containerPort"]
    listen = container["args"][container["args"].index("--listen") + 1]
    assert listen == f"0.0.0.0:{port['containerPort']}"
    (mount,) = container["volumeMounts"]
    (volume,) = spec["volumes"]
    assert mount["name"] == volume["name"]
    assert env["MEMTOP_SOCKET_DIR"] == mount["mountPath"] == volume["hostPath"]["path"]
    # The README names the same port, paths and labels.
    section = README[README.index("**Deploying it.**") :]
    section = section[: section.index("**Which job.**")]
    flat = " ".join(section.split())
    assert f"port `metrics` {port['containerPort']}" in flat
    assert f"`{volume['hostPath']['path']}` as a host path" in flat
    assert f"`MEMTOP_SOCKET_DIR={env['MEMTOP_SOCKET_DIR']}`" in flat
    ((key, value),) = labels.items()
    assert f"`{key}: {value}`" in flat
    assert "`hostPID: true`" in flat and '`nvidia.com/gpu.present: "true"`' in flat
    # The exporter accepts the container's arguments (its --help lists each flag).
    usage = subprocess.run(
        [sys.executable, "-m", "memtop", "export", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert all(flag in usage for flag in container["args"] if flag.startswith("--"))


# ------------------------------------------------------------------ systemd


def test_systemd_unit_execstart_runs(socket_dir: Path) -> None:
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(CONTRIB / "systemd" / "memtop-export.service")
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).name == "memtop" and argv[1] == "export"
    # The same command line, on a free port (the unit's own may be taken on a test box).
    args = argv[1:]
    args[args.index("--listen") + 1] = "127.0.0.1:0"
    assert unit["Service"]["ExecStart"].endswith("--listen 127.0.0.1:9482")
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtop", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, MEMTOP_SOCKET_DIR=str(socket_dir)),
    )
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline()
        port = re.search(r"serving http://127\.0\.0\.1:(\d+)/metrics", line)
        assert port, line
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10) as r:
            assert b"memtop_observation_time_seconds" in r.read()
    finally:
        # KillSignal=SIGTERM: it stops cleanly within TimeoutStopSec.
        exporter.send_signal(getattr(signal, unit["Service"]["KillSignal"]))
        assert exporter.wait(int(unit["Service"]["TimeoutStopSec"])) == 0


def test_slurm_note_names_the_unit_and_the_label() -> None:
    note = (CONTRIB / "slurm" / "README.md").read_text()
    assert "contrib/systemd/memtop-export.service" in note
    assert (CONTRIB / "systemd" / "memtop-export.service").exists()
    assert "`hpc_job`" in note and "TaskProlog" in note


def test_the_alert_unit_runs_a_command_line_memtop_accepts(tmp_path: Path) -> None:
    from memtop.commands.parser import build_parser

    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(CONTRIB / "systemd" / "memtop-alert.service")
    argv = shlex.split(unit["Service"]["ExecStart"])
    args = build_parser().parse_args(argv[1:])
    assert Path(argv[0]).name == "memtop" and args.command is None and not args.once
    assert args.on_alert == "/usr/local/bin/memtop-on-alert" and args.alert_severity == "critical"
    # the report each round goes nowhere; the one line per run goes to the journal
    assert unit["Service"]["StandardOutput"] == "null"
    assert unit["Service"]["StandardError"] == "journal"
    # The example hook reads a payload as memtop sends it (its curl aside).
    hook = (CONTRIB / "systemd" / "memtop-on-alert.example").read_text()
    script = hook.split("curl")[0] + 'printf "%s\\n" "$text"\n'
    payload = (
        '{"host": "gpu-7", "time": 1, "argv": ["train.py"], "suggestion": {"severity": '
        '"critical", "pid": 42, "device": 0, "title": "Leak: +8.0 MiB per step", "detail": "",'
        ' "rule": "leak", "evidence": "", "fix": null, "effect_bytes": null}}'
    )
    done = subprocess.run(["sh", "-c", script], input=payload, capture_output=True, text=True)
    assert done.stdout.strip() == "gpu-7: Leak: +8.0 MiB per step (pid 42, GPU 0)", done.stderr
