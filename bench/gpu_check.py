"""Everything that needs CUDA, in one command and one table (issue 31, item 8).

    python bench/gpu_check.py [--soak-seconds 150] [--out DIR]

Whoever is lent a GPU runs this first and puts its table in the closing note.  It runs, each as
its own subprocess with a time limit so one hang cannot eat the lease:

- `env`: torch's and the driver's versions, the GPU, whether MIG is on (and its instances);
- `gpu tests`: every test marked `gpu` (probe figures against torch, a snapshot memory_viz
  loads, cleanup through the agent, the breakdown against the architecture, a real OOM's
  report and line, a real leak named by its line);
- `soak`: `bench/soak.py --device cuda` with hammering viewers and one hostile client: crashes
  (must be 0), the step-rate ratio against the no-agent control (must be >= 0.95 with a
  hostile client), wrong breakdowns (must be 0);
- `step hook`: `bench/agent_overhead.py --device cuda`: the hook's µs per step, the agent
  thread's CPU, the bound on the slowdown;
- `commands`: `bench/agent_commands.py --device cuda`: what each protocol command costs the
  trainer;
- `stacks`: stack recording on a real CUDA trainer: the step with recording off and on, the
  cost per allocation, and one grouping round (ms, blocks walked);
- `floor reading`: `bench/floor_cost.py --device cuda`: one floor reading of the agent thread
  (memtop/agent/floor.py: `memory_allocated`, which takes the allocator's mutex) in µs, and a
  trainer's step time with readings at 10 Hz (as the agent takes them) and at 1 kHz;
- `once`: a CUDA trainer under `memtop run`, then `memtop --once --json` with the real NVML:
  the agent joined to the driver's GPU, and the agent's reserved equal to torch's own reading.

The last line is one JSON object with every section's figures; a section that failed says why
in its row and the script exits 1.  Needs only `python -m memtop` importable (PYTHONPATH) and a
CUDA build of torch; nothing is fetched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def run(
    command: list[str], timeout: float, env: dict[str, str] | None = None, log: Path | None = None
) -> tuple[int, str, float]:
    started = time.monotonic()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        out += f"\n(timed out after {timeout:.0f} s)"
    if log is not None:
        log.write_text(out)
    return rc, out, time.monotonic() - started


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


ENV_SCRIPT = textwrap.dedent(
    """
    import json, torch
    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    try:
        import pynvml as n
        n.nvmlInit()
        out["driver"] = n.nvmlSystemGetDriverVersion()
        h = n.nvmlDeviceGetHandleByIndex(0)
        try:
            current, pending = n.nvmlDeviceGetMigMode(h)
            out["mig_mode"] = current
        except n.NVMLError as exc:
            out["mig_mode"] = f"n/a ({exc})"
        instances = []
        if out.get("mig_mode") == 1:
            for i in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
                except n.NVMLError:
                    continue
                instances.append(n.nvmlDeviceGetUUID(m))
        out["mig_instances"] = instances
        out["nvml_uuid"] = n.nvmlDeviceGetUUID(h)
    except Exception as exc:
        out["nvml"] = repr(exc)
    props = torch.cuda.get_device_properties(0)
    out["torch_uuid"] = str(getattr(props, "uuid", ""))
    print(json.dumps(out))
    """
)

STACKS_SCRIPT = textwrap.dedent(
    """
    import json, statistics, time, torch
    from torch import nn
    from memtop.agent.sites import SiteTracker
    from memtop.agent.torch_probe import TorchProbe

    torch.manual_seed(0)
    width, layers = 1024, 12
    layer = lambda: nn.TransformerEncoderLayer(width, 16, 4 * width, batch_first=True)
    blocks = [layer() for _ in range(layers)]
    model = nn.Sequential(*blocks).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 256, width, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def timed(n):
        times = []
        for _ in range(n):
            torch.cuda.synchronize(); t = time.perf_counter()
            step()
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
        return times

    for _ in range(5):
        step()
    probe = TorchProbe()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    step(); torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    off, on = [], []
    tracker = SiteTracker(probe, wanted=False)
    for _ in range(3):  # off, on alternated so drift cancels
        off += timed(15)
        assert probe.record_history(True)
        timed(2)  # the first steps after the switch allocate new blocks with frames
        on += timed(15)
        probe.record_history(False)
    probe.record_history(True)
    timed(3)
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        tracker._round(time.monotonic(), 0, started)
        rounds.append(tracker.last_round_s)
    latest = tracker.latest or {}
    probe.record_history(False)
    off_ms = statistics.median(off) * 1e3
    on_ms = statistics.median(on) * 1e3
    print(json.dumps({
        "step_off_ms": round(off_ms, 3), "step_on_ms": round(on_ms, 3),
        "slowdown_pct": round(100 * (on_ms / off_ms - 1), 2),
        "allocations_per_step": allocs,
        "us_per_allocation": round((on_ms - off_ms) * 1e3 / max(allocs, 1), 3),
        "round_ms_median": round(statistics.median(rounds) * 1e3, 3),
        "round_blocks": latest.get("blocks"),
        "round_sites": len(latest.get("sites", [])),
    }))
    """
)

ONCE_TRAINER = textwrap.dedent(
    """
    import json, sys, time, torch
    from torch import nn
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    held = []
    deadline = time.monotonic() + float(sys.argv[1])
    step = 0
    while time.monotonic() < deadline:
        loss = model(torch.randn(64, 2048, device="cuda")).square().mean()
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        held.append(torch.empty(4 << 20, dtype=torch.uint8, device="cuda"))  # a 4 MiB/step leak
        step += 1
        torch.cuda.synchronize()
        with open(sys.argv[2], "w") as fh:
            json.dump({"step": step, "reserved": torch.cuda.memory_reserved(),
                       "allocated": torch.cuda.memory_allocated()}, fh)
        time.sleep(0.05)
    """
)


def section_once(tmp: Path, timeout: float) -> dict[str, Any]:
    """A real CUDA trainer under `memtop run`, read by `memtop --once --json` over real NVML."""
    script = tmp / "once_trainer.py"
    script.write_text(ONCE_TRAINER)
    truth = tmp / "truth.json"
    sockets = tmp / "sockets"
    sockets.mkdir(mode=0o700)
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(sockets), PYTHONUNBUFFERED="1")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "memtop", "run", str(script), "40", str(truth)],
        env=env,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(25)
        rc, out, _ = run([sys.executable, "-m", "memtop", "--once", "--json"], timeout, env=env)
        told = json.loads(truth.read_text()) if truth.exists() else {}
        report = json.loads(out[out.index("{") :]) if "{" in out else {}
    finally:
        trainer.terminate()
        trainer.wait(30)
    agents = [a for a in report.get("agents", []) if a.get("pid") == trainer.pid]
    devices = report.get("devices", [])
    charged = [
        p.get("used_bytes")
        for d in devices
        for p in d.get("processes", [])
        if p.get("pid") == trainer.pid
    ]
    mine = agents[0]["devices"] if agents and agents[0].get("devices") else []
    result: dict[str, Any] = {
        "rc": rc,
        "devices": [(d.get("name"), d.get("source"), d.get("uuid")) for d in devices],
        "agent_joined": bool(mine and mine[0].get("gpu") is not None),
        "suggestions": [str(s)[:160] for s in report.get("suggestions", [])][:4],
        "problems": report.get("problems", [])[:4],
    }
    if mine:
        reserved = mine[0].get("reserved_bytes")
        result["memtop_reserved_mib"] = reserved and round(reserved / 2**20, 1)
        result["memtop_leak"] = mine[0].get("leak")
    if charged and charged[0] is not None:
        result["driver_charged_mib"] = round(charged[0] / 2**20, 1)
    if told:
        result["torch_reserved_mib"] = round(told["reserved"] / 2**20, 1)
        result["torch_step"] = told["step"]
    if rc != 0 or not mine:
        result["error"] = out[-800:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak-seconds", type=float, default=150.0)
    parser.add_argument("--out", type=Path, help="keep each section's full log here")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="memtop-gpu-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="memtop-gpu-check-tmp-"))
    py = sys.executable
    results: dict[str, Any] = {}
    rows: list[tuple[str, str, str]] = []

    def section(name: str, command: list[str], timeout: float, parse: Any) -> None:
        if name in skip:
            rows.append((name, "skipped", ""))
            return
        rc, out, took = run(command, timeout, log=out_dir / f"{name.replace(' ', '_')}.log")
        try:
            figures, verdict = parse(rc, out)
        except Exception as exc:  # a section's parse must not end the check
            figures, verdict = {"error": repr(exc), "tail": out[-600:]}, "FAIL"
        figures["took_s"] = round(took, 1)
        results[name] = figures
        rows.append((name, verdict, json.dumps(figures)[:400]))
        print(f"[{name}] {verdict} in {took:.0f} s", flush=True)

    def parse_json(rc: int, out: str) -> tuple[dict[str, Any], str]:
        value = last_json(out)
        if value is None:
            return {"rc": rc, "tail": out[-600:]}, "FAIL"
        return value, "ok" if rc == 0 else f"rc {rc}"

    def parse_tests(rc: int, out: str) -> tuple[dict[str, Any], str]:
        tail = [line for line in out.strip().splitlines() if line.strip()][-1:]
        failed = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return {"summary": tail[0] if tail else "", "failed": failed}, ("ok" if rc == 0 else "FAIL")

    def parse_soak(rc: int, out: str) -> tuple[dict[str, Any], str]:
        value = last_json(out) or {"tail": out[-600:]}
        return value, "ok" if rc == 0 else "FAIL"

    section("env", [py, "-c", ENV_SCRIPT], 90, parse_json)
    section(
        "gpu tests",
        [
            py,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "-rs",
            "--timeout",
            "200",
            "tests/test_torch_probe.py",
            "tests/test_sites.py",
            "tests/test_oom.py",
        ],
        240,
        parse_tests,
    )
    section(
        "soak",
        [
            py,
            str(BENCH / "soak.py"),
            "--device",
            "cuda",
            "--seconds",
            str(args.soak_seconds),
            "--trainers",
            "4",
            "--viewers",
            "4",
            "--hostile",
            "1",
        ],
        args.soak_seconds + 120,
        parse_soak,
    )
    section(
        "step hook",
        [py, str(BENCH / "agent_overhead.py"), "--device", "cuda", "--seconds", "24"],
        90,
        parse_json,
    )
    section(
        "commands",
        [py, str(BENCH / "agent_commands.py"), "--device", "cuda"],
        120,
        parse_json,
    )
    section("stacks", [py, "-c", STACKS_SCRIPT], 150, parse_json)
    # The agent's floor readings (a process without steps, watched): one reading's µs, and a
    # trainer's step with readings at 10 Hz and 1 kHz (the allocator's mutex, shared with it).
    section(
        "floor reading",
        [py, str(BENCH / "floor_cost.py"), "--device", "cuda", "--reads", "3000", "--steps", "150"],
        90,
        parse_json,
    )
    if "once" not in skip:
        started = time.monotonic()
        try:
            figures = section_once(tmp, 60)
        except Exception as exc:
            figures = {"error": repr(exc)}
        figures["took_s"] = round(time.monotonic() - started, 1)
        verdict = "ok" if figures.get("agent_joined") and "error" not in figures else "FAIL"
        results["once"] = figures
        rows.append(("once", verdict, json.dumps(figures)[:400]))

    print()
    print(f"{'section':<10} {'verdict':<8} figures")
    for name, verdict, figures in rows:
        print(f"{name:<10} {verdict:<8} {figures}")
    print(json.dumps(results))
    return 0 if all(verdict in ("ok", "skipped") for _, verdict, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
