"""`memtop --once`: one observation (devices, processes, agents, diagnosis) as JSON or text.

Only a renderer: the join and the diagnosis are done once in `memtop.engine.observation`.

The JSON shape is a contract (DESIGN §7): fields may be added, never renamed or dropped.  An
agent device's figures are the rows of `memtop.figures.metric_table` (the exporter's too).
"""

from __future__ import annotations

import os
import time
from typing import Any

from memtop._version import __version__
from memtop.diagnosis.workload import ENGINE_NAMES
from memtop.engine.observation import GpuObservation, Observation
from memtop.figures import metric_table
from memtop.figures.units import format_bytes
from memtop.model import Accounting, AgentView

BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "other", "fp32_parameter_bytes")


def build(observation: Observation) -> dict[str, Any]:
    """The --once --json object: one observation, serialised."""
    obs = observation
    return {
        "version": __version__,
        "time": obs.time,
        "host": obs.host,
        "nvml": {
            "available": obs.nvml_available,
            "source": obs.nvml_source,
            "error": obs.nvml_error,
            "driver_version": obs.driver_version,
        },
        "devices": [_device(gpu, obs) for gpu in obs.gpus],
        "agents": [_agent(agent, obs) for agent in obs.agents],
        "suggestions": [s.as_dict() for s in obs.suggestions],
        "problems": list(obs.problems),
        "events": list(obs.events),
        # Each action memtop performed, per device, with the windows before and after it.
        "actions": [e.as_json() for agent in obs.agents for e in obs.effects_of(agent.pid)],
    }


def _device(gpu: GpuObservation, obs: Observation) -> dict[str, Any]:
    # What each listed process is, where known (DESIGN §13: a server's engine and share).
    workloads = {
        e.pid: e.workload.as_dict() for e in obs.entries if e.uuid == gpu.uuid and e.workload
    }
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        # The driver's figures: the rows of memtop.figures.metric_table.GPU_METRICS.
        **{row.json: row.read(gpu.reading) for row in metric_table.GPU_METRICS if row.json},
        "source": gpu.source,
        "error": gpu.error,
        "pci_bus_id": gpu.pci_bus_id,
        "processes": [
            {
                "pid": p.pid,
                "used_bytes": p.used_bytes,
                "kind": p.kind,
                "workload": workloads.get(p.pid),
            }
            for p in gpu.processes
        ],
        # The sum of the true peaks of the PyTorch processes on it (each its own moment).
        "peak_sum_bytes": gpu.peak_sum_bytes if gpu.agents else None,
        # A MIG instance: parent_index, gpu_instance_id, compute_instance_id, profile (DESIGN
        # §13); null for a whole GPU.  A GPU in MIG mode lists no process: its instances do.
        "mig": gpu.mig.as_dict() if gpu.mig is not None else None,
        "mig_mode": gpu.reading.mig_mode,
        # Who holds the used bytes: parts that sum exactly to used_bytes (DESIGN §13).
        "accounting": _accounting(gpu.accounting),
    }


def _accounting(accounting: Accounting | None) -> dict[str, Any] | None:
    if accounting is None:
        return None
    return {
        "used_bytes": accounting.used_bytes,
        "parts": [
            {
                "part": part.name,
                "label": part.label,
                "bytes": part.bytes,
                "pids": list(part.pids),
                "note": part.note or None,
                "processes": [
                    {
                        "pid": p.pid,
                        "used_bytes": p.bytes,
                        "why": p.why or None,
                        "attachable": p.attachable,
                        "container": p.container,
                        "user": p.user,
                        # A gone pid: the live processes holding the GPU's device files,
                        # `kin` (its process group or session) first: what to stop.
                        "holders": [
                            {
                                "pid": h.pid,
                                "command": h.command,
                                "files": list(h.files),
                                "kin": h.kin,
                            }
                            for h in p.holders
                        ],
                    }
                    for p in part.processes
                ],
            }
            for part in accounting.parts
        ],
    }


def _agent(agent: AgentView, obs: Observation) -> dict[str, Any]:
    hello = agent.hello
    now = obs.time
    diagnosed = obs.devices_of(agent)
    devices = []
    for dev in diagnosed:
        found = dev.diagnosis
        breakdown = found.breakdown
        devices.append(
            {
                "index": dev.index,
                "uuid": dev.uuid,
                "name": dev.name,
                "gpu": dev.gpu,
                # Every figure of the metric table that the report carries.
                **{
                    row.json: row.json_value(dev)
                    for row in metric_table.DEVICE_METRICS
                    if row.json is not None
                },
                "step": agent.step,
                "leak": found.leak.as_dict(),
                "pressure": found.pressure.as_dict(),
                "breakdown": (
                    {k: breakdown[k] for k in BREAKDOWN_KEYS if k in breakdown}
                    if breakdown
                    else None
                ),
                # What the process is on this device: trainer, server (engine, the share it
                # asked for and the setting that sets it), … (DESIGN §13).
                "workload": found.workload.as_dict() if found.workload else None,
                # When it was measured: the step after which, and how long before this report
                # (the agent measures it every 10 s or so; it is served until the next).
                "breakdown_step": found.breakdown_step,
                "breakdown_age_s": (
                    None
                    if found.breakdown_time is None
                    else round(max(0.0, now - found.breakdown_time), 1)
                ),
            }
        )
    workload = next((d.diagnosis.workload for d in diagnosed if d.diagnosis.workload), None)
    return {
        "pid": agent.pid,
        "state": agent.status.value,
        "error": agent.error,
        "argv": list(agent.argv),
        "python": hello.python if hello else None,
        "torch": hello.torch if hello else None,
        "hip": agent.hip,  # the ROCm build's HIP version; null on CUDA
        "allocator_conf": hello.allocator_conf if hello else None,
        # In force now (`memtop tune` changes it); null where the agent does not say.
        "allocator_settings": agent.allocator_settings,
        "step": agent.step,
        # `trainer`, `server`, `preallocator` or `process` (no steps yet), and the engine;
        # each device's `workload` has the share (null before its first sample).
        "kind": workload.kind.value if workload else None,
        "engine": workload.engine if workload else None,
        "devices": devices,
        "job": job.as_json() if (job := agent.job) is not None else None,
        # Its own host memory, where the agent reports it: RSS now, its peak, and for a process
        # that uses no CUDA device, the leak verdict on its RSS after each step.
        "host": _host(agent, obs),
        # Live memory by the user's line, per device (stack recording on; DESIGN §12).
        "sites": [
            {"device": dev.index, **trend.as_dict()}
            for dev in diagnosed
            for trend in dev.diagnosis.sites
        ],
    }


def _host(agent: AgentView, obs: Observation) -> dict[str, Any] | None:
    memory = agent.host_memory
    if memory is None:
        return None
    verdict = obs.diagnosis.hosts.get(agent.pid)
    return {
        "rss_bytes": memory.rss_bytes,
        "peak_rss_bytes": memory.peak_rss_bytes,
        "total_bytes": memory.total_bytes,
        "leak": verdict.leak.as_dict() if verdict is not None else None,
    }


# ------------------------------------------------------------------------------------ text


def _accounting_lines(accounting: dict[str, Any] | None) -> list[str]:
    """A device's used bytes by who holds them, the parts that hold any (one line each, and a
    line for each process memtop can say something of)."""
    if not accounting:
        return []
    lines = []
    for part in accounting["parts"]:
        if not part["bytes"] and not part["pids"]:
            continue
        pids = ",".join(map(str, part["pids"][:8])) + ("…" if len(part["pids"]) > 8 else "")
        lines.append(
            f"       {format_bytes(part['bytes']):>10}  {part['label']}"
            + (f"  (pid {pids})" if pids else "")
        )
        for p in part["processes"]:
            if p["why"]:
                lines.append(f"                   pid {p['pid']}: {p['why']}")
    return lines


def _command(argv: list[str]) -> str:
    text = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv))
    return text if len(text) <= 60 else text[:57] + "..."


def _label(dev: dict[str, Any]) -> str:
    """ "vLLM · 0.92 of GPU  " before a server's command; "" for a trainer."""
    workload = dev.get("workload") or {}
    share, engine = workload.get("budget_share"), workload.get("engine")
    if share is None:
        return ""
    name = ENGINE_NAMES.get(engine or "", "preallocated")
    of = "of free GPU" if workload.get("budget_basis") == "free" else "of GPU"
    return f"{name} · {share:.2f} {of}  "


BREAKDOWN_NAMES = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("other", "other"),
)


def _smoothed(dev: dict[str, Any]) -> float:
    smoothed = dev.get("fragmentation_smoothed")
    return float(smoothed if smoothed is not None else dev["fragmentation"])


def render_text(report: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(report["time"]))
    lines = [f"memtop {report['version']} on {report['host']}  {stamp}"]
    nvml = report["nvml"]
    devices = report["devices"]
    agents = report["agents"]
    if not nvml["available"] and nvml["error"]:
        lines.append(f"devices: {nvml['error']}")
    for problem in report.get("problems", []):
        lines.append(f"! {problem}")
    hidden = report.get("filtered_out")  # `--user nobody`: what the filter hid, in a line
    if not devices and not agents and hidden:
        lines += ["", f"Nothing matches: {hidden}."]
        return "\n".join(lines) + "\n"
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
        mig = d.get("mig")
        number = f"{d['index']}:{mig['gpu_instance_id']}" if mig else str(d["index"])
        # An instance sits under its GPU's row, which names the model: its profile says it.
        name = f"  MIG {mig['profile']}" if mig else d["name"]
        lines.append(
            f"{number:<4} {name[:28]:<28} {format_bytes(used):>10} "
            f"{format_bytes(total):>10} {share:>5}  {d['source']}"
            + (f"  ! {d['error']}" if d.get("error") else "")
        )
        for p in d["processes"]:
            lines.append(f"       pid {p['pid']:<8} {format_bytes(p['used_bytes']):>10}")
        lines += _accounting_lines(d.get("accounting"))
    lines.append("")
    if not agents and hidden:
        lines.append(f"No memtop agent matches: {hidden}.")
    elif not agents:
        lines.append("No memtop agents found (start a trainer with `memtop run train.py`).")
    else:
        lines.append(
            f"{'pid':<8} {'GPU':<4} {'step':>7} {'allocated':>10} {'reserved':>10} {'peak':>10} "
            f"{'frag~':>5} {'retries':>7} {'ooms':>4}  command"
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
                    f"{a['pid']:<8} {dev.get('gpu', dev['index']):<4} {step:>7} "
                    f"{format_bytes(dev['allocated_bytes']):>10} "
                    f"{format_bytes(dev['reserved_bytes']):>10} "
                    f"{format_bytes(dev['peak_bytes']):>10} "
                    f"{_smoothed(dev):>5.2f} {dev['num_alloc_retries']:>7} "
                    f"{dev['num_ooms']:>4}  {_label(dev)}{_command(a['argv'])}"
                    + ("" if a["state"] == "connected" else f"  [{a['state']}]")
                )
                parts = dev.get("breakdown")
                if parts:
                    age, step = dev.get("breakdown_age_s"), dev.get("breakdown_step")
                    when = ("an unknown step" if step is None else f"step {step}") + (
                        f", {age:.0f} s ago" if age is not None else ""
                    )
                    lines.append(
                        f"         breakdown at {when}: "
                        + ", ".join(
                            f"{name} {format_bytes(parts[key])}"
                            for key, name in BREAKDOWN_NAMES
                            if key in parts
                        )
                    )
        if any(a["devices"] for a in agents):
            # One fragmentation figure on the page: the one the suggestions judge.
            lines.append(
                "frag~: the median of the recent fragmentation samples, as the suggestions judge it"
            )
    if report["suggestions"]:
        lines.append("")
        for s in report["suggestions"]:
            lines.append(f"[{s['severity']}] pid {s['pid']} GPU {s['device']}: {s['title']}")
            lines.append(f"    {s['evidence']}")
            if s.get("detail"):  # what to do, in prose (a leak's usual culprits)
                lines.append(f"    what to do: {s['detail']}")
            if s.get("fix"):
                lines.append(f"    fix: {s['fix']}")
    return "\n".join(lines) + "\n"
