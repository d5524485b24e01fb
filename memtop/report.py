"""`memtop --once`: one report of devices, processes, agents and diagnosis, as JSON or text.

The JSON shape is a contract (DESIGN §7): fields may be added, never renamed or dropped.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from memtop._version import __version__
from memtop.diagnosis import Diagnoser, Diagnosis
from memtop.model import SOURCE_AGENT, NvmlReading
from memtop.store import AgentView, Store
from memtop.units import format_bytes


def build(store: Store, diagnosis: Diagnosis | None = None) -> dict[str, Any]:
    """The --once --json object, from whatever the sampler has put in the store."""
    reading = store.nvml() or NvmlReading(available=False, error="devices not read")
    agents = store.agents()
    diagnosis = diagnosis or Diagnoser().diagnose(store)
    devices = _devices(reading, agents)
    used_by: dict[tuple[str, int], int | None] = {}
    for device in devices:
        for process in device["processes"]:
            used_by[(device["uuid"], process["pid"])] = process["used_bytes"]
    return {
        "version": __version__,
        "time": time.time(),
        "host": socket.gethostname(),
        "nvml": {
            "available": reading.available,
            "source": reading.source,
            "error": reading.error,
            "driver_version": reading.driver_version,
        },
        "devices": devices,
        "agents": [_agent(agent, used_by, diagnosis) for agent in agents],
        "suggestions": [s.as_dict() for s in diagnosis.suggestions],
        "problems": store.problems(),
        "events": [message for _, message in list(store.events)[-20:]],
    }


def _devices(reading: NvmlReading, agents: list[AgentView]) -> list[dict[str, Any]]:
    if reading.available:
        return [
            {
                "index": d.index,
                "uuid": d.uuid,
                "name": d.name,
                "total_bytes": d.total_bytes,
                "used_bytes": d.used_bytes,
                "free_bytes": d.free_bytes,
                "utilization_percent": d.utilization_percent,
                "temperature_c": d.temperature_c,
                "source": d.source,
                "error": d.error,
                "processes": [
                    {"pid": p.pid, "used_bytes": p.used_bytes, "kind": p.kind} for p in d.processes
                ],
            }
            for d in reading.devices
        ]
    # Without a driver view, the agents' own mem_get_info is the best account of each device.
    by_uuid: dict[str, dict[str, Any]] = {}
    for agent in agents:
        for dev in agent.devices:
            key = dev.uuid or f"{agent.pid}:{dev.index}"
            entry = by_uuid.setdefault(
                key,
                {
                    "index": dev.index,
                    "uuid": dev.uuid,
                    "name": dev.name,
                    "total_bytes": dev.latest.total_bytes,
                    "used_bytes": dev.latest.total_bytes - dev.latest.free_bytes,
                    "free_bytes": dev.latest.free_bytes,
                    "utilization_percent": None,
                    "temperature_c": None,
                    "source": SOURCE_AGENT,
                    "error": None,
                    "processes": [],
                },
            )
            entry["processes"].append({"pid": agent.pid, "used_bytes": None, "kind": "compute"})
    return sorted(by_uuid.values(), key=lambda d: (d["index"], d["uuid"]))


def _agent(
    agent: AgentView, used_by: dict[tuple[str, int], int | None], diagnosis: Diagnosis
) -> dict[str, Any]:
    hello = agent.hello
    devices = []
    for dev in agent.devices:
        latest = dev.latest
        nvml_used = used_by.get((dev.uuid, agent.pid))
        breakdown = (agent.breakdown or {}).get(dev.index)
        found = diagnosis.device(agent.pid, dev.index)
        frag = found.fragmentation if found else None
        devices.append(
            {
                "index": dev.index,
                "uuid": dev.uuid,
                "name": dev.name,
                "allocated_bytes": latest.allocated,
                "reserved_bytes": latest.reserved,
                "peak_bytes": dev.peak_bytes,
                "torch_peak_bytes": latest.torch_peak,
                "cached_bytes": latest.cached,
                "inactive_split_bytes": latest.inactive_split,
                "fragmentation": round(latest.fragmentation, 4),
                "num_alloc_retries": latest.num_alloc_retries,
                "num_ooms": latest.num_ooms,
                "step": agent.step,
                "free_bytes": latest.free_bytes,
                "total_bytes": latest.total_bytes,
                "non_pytorch_bytes": (
                    max(0, nvml_used - latest.reserved) if nvml_used is not None else None
                ),
                "leak": found.leak.as_dict() if found else None,
                "fragmentation_smoothed": round(frag.gauge_smoothed, 4) if frag else None,
                "external_fragmentation": (
                    round(frag.external, 4) if frag and frag.external is not None else None
                ),
                "internal_fragmentation_bytes": frag.internal_bytes if frag else None,
                "pressure": found.pressure.as_dict() if found else None,
                "baseline_bytes": found.baseline_bytes if found else None,
                "breakdown": (
                    {
                        k: breakdown[k]
                        for k in (
                            "parameters",
                            "gradients",
                            "optimizer_state",
                            "other",
                            "fp32_parameter_bytes",
                        )
                        if k in breakdown
                    }
                    if breakdown
                    else None
                ),
            }
        )
    return {
        "pid": agent.pid,
        "state": agent.state,
        "error": agent.error,
        "argv": list(hello.argv) if hello else [],
        "python": hello.python if hello else None,
        "torch": hello.torch if hello else None,
        "allocator_conf": hello.allocator_conf if hello else None,
        "step": agent.step,
        "devices": devices,
    }


# ------------------------------------------------------------------------------------ text


def _command(argv: list[str]) -> str:
    text = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv))
    return text if len(text) <= 60 else text[:57] + "..."


def render_text(report: dict[str, Any]) -> str:
    lines = [f"memtop {report['version']} on {report['host']}  {time.strftime('%H:%M:%S')}"]
    nvml = report["nvml"]
    devices = report["devices"]
    agents = report["agents"]
    if not nvml["available"] and nvml["error"]:
        lines.append(f"devices: {nvml['error']}")
    for problem in report.get("problems", []):
        lines.append(f"! {problem}")
    if not devices and not agents:
        lines.append("")
        lines.append("No GPUs and no memtop agents found.")
        lines.append(
            "  Attach to a trainer:  memtop run train.py   (or memtop.start_agent() in it)"
        )
        lines.append("  Try it without a GPU: memtop demo")
        return "\n".join(lines) + "\n"
    lines.append("")
    if devices:
        lines.append(f"{'GPU':<4} {'name':<28} {'used':>10} {'total':>10} {'use%':>5}  source")
    for d in devices:
        total, used = d["total_bytes"], d["used_bytes"]
        share = f"{100 * used / total:4.0f}%" if total and used is not None else "  n/a"
        lines.append(
            f"{d['index']:<4} {d['name'][:28]:<28} {format_bytes(used):>10} "
            f"{format_bytes(total):>10} {share:>5}  {d['source']}"
            + (f"  ! {d['error']}" if d.get("error") else "")
        )
        for p in d["processes"]:
            lines.append(f"       pid {p['pid']:<8} {format_bytes(p['used_bytes']):>10}")
    lines.append("")
    if not agents:
        lines.append("No memtop agents found (start a trainer with `memtop run train.py`).")
    else:
        lines.append(
            f"{'pid':<8} {'GPU':<4} {'step':>7} {'allocated':>10} {'reserved':>10} {'peak':>10} "
            f"{'frag':>5} {'retries':>7} {'ooms':>4}  command"
        )
        for a in agents:
            if not a["devices"]:
                state = a["state"] if a["state"] != "connected" else "no CUDA device in use"
                step = "-" if a["step"] is None else str(a["step"])
                lines.append(f"{a['pid']:<8} {'-':<4} {step:>7}  ({state})  {_command(a['argv'])}")
                if a["error"]:
                    lines.append(f"         ! {a['error']}")
            for dev in a["devices"]:
                step = "-" if dev["step"] is None else str(dev["step"])
                lines.append(
                    f"{a['pid']:<8} {dev['index']:<4} {step:>7} "
                    f"{format_bytes(dev['allocated_bytes']):>10} "
                    f"{format_bytes(dev['reserved_bytes']):>10} "
                    f"{format_bytes(dev['peak_bytes']):>10} "
                    f"{dev['fragmentation']:>5.2f} {dev['num_alloc_retries']:>7} "
                    f"{dev['num_ooms']:>4}  {_command(a['argv'])}"
                    + ("" if a["state"] == "connected" else f"  [{a['state']}]")
                )
    if report["suggestions"]:
        lines.append("")
        for s in report["suggestions"]:
            lines.append(f"[{s['severity']}] pid {s['pid']} GPU {s['device']}: {s['title']}")
            lines.append(f"    {s['evidence']}")
            if s.get("fix"):
                lines.append(f"    fix: {s['fix']}")
    return "\n".join(lines) + "\n"
