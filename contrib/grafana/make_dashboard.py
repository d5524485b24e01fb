"""Writes memtop.json, the Grafana dashboard on `memtop export`'s metrics (import it as it is:
Dashboards -> New -> Import -> upload the file, pick a Prometheus data source).

Edit the panels here, then `python contrib/grafana/make_dashboard.py`; tests/test_prometheus.py
runs every query of the file against a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'hostname=~"$hostname", job=~"$job"'  # every per-process series
HOST_SEL = 'hostname=~"$hostname"'
SUGGESTIONS = f"sum by (hostname, severity, rule) (memtop_suggestions{{{HOST_SEL}}})"
_ids = iter(range(1, 100))


def increase(counter: str) -> str:
    return f"sum by (hostname, pid, job) (increase({counter}{{{SEL}}}[$__rate_interval]))"


def target(expr: str, legend: str = "", *, instant: bool = False, ref: str = "A") -> dict:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t.update(instant=True, range=False, format="table")
    return t


def stat(title: str, expr: str, x: int, unit: str = "none", *, steps=None, text="") -> dict:
    return {
        "type": "stat",
        "id": next(_ids),
        "title": title,
        "description": text,
        "datasource": DS,
        "gridPos": {"h": 4, "w": 4, "x": x, "y": 0},
        "targets": [target(expr, instant=False)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "color": {"mode": "thresholds"},
                "thresholds": {
                    "mode": "absolute",
                    "steps": steps or [{"color": "green", "value": None}],
                },
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "none",
            "textMode": "auto",
        },
    }


def series(title: str, targets: list[dict], pos: tuple[int, int, int, int], unit: str,
           *, text: str = "", stack: bool = False, bars: bool = False,
           overrides: list | None = None, thresholds=None) -> dict:  # fmt: skip
    x, y, w, h = pos
    custom: dict[str, Any] = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 30 if stack or bars else 8,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "line+area"}
    return {
        "type": "timeseries",
        "id": next(_ids),
        "title": title,
        "description": text,
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "targets": [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": custom,
                "color": {"mode": "palette-classic"},
                "thresholds": {
                    "mode": "absolute",
                    "steps": thresholds or [{"color": "green", "value": None}],
                },
            },
            "overrides": overrides or [],
        },
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def dashed(pattern: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": pattern},
        "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.fillOpacity", "value": 0},
        ],
    }


def variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": 0,
    }


def dashboard() -> dict:
    red_over = lambda n: [{"color": "green", "value": None}, {"color": "red", "value": n}]  # noqa: E731
    per_proc = "{{hostname}} pid {{pid}} ({{job}}) GPU {{gpu}}"
    per_gpu = "{{hostname}} GPU {{gpu}}"
    panels = [
        stat("Trainers watched", f'count(memtop_agent_info{{{SEL}, state="connected"}})', 0,
             text="PyTorch processes with a memtop agent, across the selected hosts."),
        stat("Leaks detected", f"sum(memtop_leak_detected{{{SEL}}}) or vector(0)", 4,
             steps=red_over(1), text="Devices whose per-step baseline grows significantly."),
        stat("Soonest full", f"min(memtop_time_to_full_seconds{{{SEL}}})", 8, "s",
             steps=[{"color": "red", "value": None}, {"color": "orange", "value": 600},
                    {"color": "green", "value": 3600}],
             text="Time until a leaking trainer fills its GPU at the leak's rate."),
        stat("OOMs in range", f"sum(increase(memtop_ooms_total{{{SEL}}}[$__range])) or vector(0)",
             12, steps=red_over(1)),
        stat("Allocator retries in range",
             f"sum(increase(memtop_alloc_retries_total{{{SEL}}}[$__range])) or vector(0)", 16,
             steps=[{"color": "green", "value": None}, {"color": "orange", "value": 1}]),
        stat("Critical suggestions",
             f'sum(memtop_suggestions{{{HOST_SEL}, severity=~"critical|emergency"}}) or vector(0)',
             20, steps=red_over(1)),
        series(
            "Allocated vs reserved, by job",
            [target(f"sum by (job) (memtop_allocated_bytes{{{SEL}}})", "{{job}} allocated"),
             target(f"sum by (job) (memtop_reserved_bytes{{{SEL}}})", "{{job}} reserved")],
            (0, 4, 12, 9), "bytes", overrides=[dashed(".* reserved")],
            text="Allocated: live tensors. Reserved: what PyTorch's caching allocator holds from "
                 "the driver (allocated + cached). A wide gap is cache another process cannot use.",
        ),
        series(
            "GPU memory used / total, by host",
            [target(f"memtop_gpu_memory_used_bytes{{{HOST_SEL}}}", f"{per_gpu} used"),
             target(f"memtop_gpu_memory_total_bytes{{{HOST_SEL}}}", f"{per_gpu} total")],
            (12, 4, 12, 9), "bytes", overrides=[dashed(".* total")],
            text="What the driver (NVML) sees, as DCGM_FI_DEV_FB_USED does (joinable on "
                 "hostname, UUID, gpu).",
        ),
        series(
            "Leak rate (bytes per second)",
            [target(f"memtop_leak_bytes_per_second{{{SEL}}}", per_proc)],
            (0, 13, 12, 8), "Bps",
            text="Trend of allocated bytes right after each step (Theil-Sen). Shown for every "
                 "trainer; memtop_leak_detected says which trends are called leaks.",
        ),
        series(
            "Leak per step",
            [target(f"memtop_leak_bytes_per_step{{{SEL}}}", per_proc)],
            (12, 13, 12, 8), "bytes",
        ),
        series(
            "OOMs and allocator retries",
            [target(increase("memtop_ooms_total"), "OOM {{hostname}} pid {{pid}}"),
             target(increase("memtop_alloc_retries_total"), "retry {{hostname}} pid {{pid}}")],
            (0, 21, 12, 8), "none", bars=True,
            text="Retries: the allocator freed its cache and tried cudaMalloc again (slow). "
                 "OOMs: torch.cuda.OutOfMemoryError raised.",
        ),
        series(
            "Fragmentation (large pool)",
            [target(f"memtop_fragmentation_smoothed_ratio{{{SEL}}}", per_proc)],
            (12, 21, 12, 8), "percentunit",
            thresholds=[{"color": "transparent", "value": None}, {"color": "orange", "value": 0.2},
                        {"color": "red", "value": 0.3}],
            text="Inactive split bytes over reserved bytes of the large pool (median of recent "
                 "samples). High: try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
        ),
        series(
            "Memory by role",
            [target(f"sum by (part) (memtop_breakdown_bytes{{{SEL}}})", "{{part}}")],
            (0, 29, 12, 8), "bytes", stack=True,
            text="Parameters, gradients, optimizer state and the rest (activations) of allocated "
                 "memory, measured inside the trainers at a step boundary.",
        ),
        series(
            "Outside PyTorch (CUDA context, NCCL, workspaces)",
            [target(f"memtop_non_pytorch_bytes{{{SEL}}}", per_proc)],
            (12, 29, 12, 8), "bytes",
        ),
        {
            "type": "table",
            "id": next(_ids),
            "title": "Suggestions now",
            "description": "Open `memtop` on the host (or `memtop --prometheus URL`) for the "
                           "evidence and the fix of each.",
            "datasource": DS,
            "gridPos": {"h": 8, "w": 24, "x": 0, "y": 37},
            "targets": [target(SUGGESTIONS, instant=True)],
            "transformations": [
                {"id": "organize", "options": {"excludeByName": {"Time": True},
                                               "renameByName": {"Value": "count"}}},
            ],
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"showHeader": True, "sortBy": [{"displayName": "severity", "desc": True}]},
        },
    ]  # fmt: skip
    return {
        "title": "memtop: GPU memory of PyTorch trainers",
        "uid": "memtop-gpu-memory",
        "description": "The caching allocator's view of every trainer that `memtop export` "
        "watches: allocated vs reserved, leaks, OOMs, fragmentation, suggestions.",
        "tags": ["memtop", "gpu", "pytorch"],
        "editable": True,
        "graphTooltip": 1,
        "id": None,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                },
                variable(
                    "hostname", "Host", "label_values(memtop_observation_time_seconds, hostname)"
                ),
                variable(
                    "job", "Job", 'label_values(memtop_agent_info{hostname=~"$hostname"}, job)'
                ),
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("memtop.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(out)
