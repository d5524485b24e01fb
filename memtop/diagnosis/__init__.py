"""Diagnosis: from what the sampler stored to answers (DESIGN §4–5).

`Diagnoser.diagnose(store)` returns one `Diagnosis`: per agent device the leak estimate,
fragmentation, pressure and breakdown, per GPU the facts the rules judge, and the suggestions.
The `--once --json` report and the dashboard both render these same objects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memtop.diagnosis.facts import DeviceDiagnosis, GpuFacts
from memtop.diagnosis.fragmentation import (
    GAUGE_SAMPLES,
    PRESSURE_WINDOW_S,
    fragmentation,
    pressure,
)
from memtop.diagnosis.leak import MAX_MARKS, LeakEstimate, detect
from memtop.diagnosis.suggestions import Suggestion, suggest
from memtop.model import NvmlReading
from memtop.sources.agents import CONNECTED
from memtop.store import AgentDeviceView, AgentView, Store

__all__ = [
    "DeviceDiagnosis",
    "Diagnoser",
    "Diagnosis",
    "GpuFacts",
    "LeakEstimate",
    "Suggestion",
]

# The leak test costs a few ms per device; a dashboard refreshing every second re-judges each
# device at most this often (a trend over minutes does not change in a second).
LEAK_REFRESH_S = 5.0


@dataclass(frozen=True)
class Diagnosis:
    time: float
    devices: dict[tuple[int, int], DeviceDiagnosis]  # by (pid, device index)
    gpus: tuple[GpuFacts, ...]
    suggestions: tuple[Suggestion, ...]

    def device(self, pid: int, index: int) -> DeviceDiagnosis | None:
        return self.devices.get((pid, index))

    def suggestions_for(self, pid: int | None = None) -> list[Suggestion]:
        return [s for s in self.suggestions if pid is None or s.pid == pid]


@dataclass
class Diagnoser:
    """Keeps the last leak estimate per device so repeated diagnoses stay cheap."""

    leak_refresh_s: float = LEAK_REFRESH_S
    _leaks: dict[tuple[int, int], tuple[float, LeakEstimate]] = field(default_factory=dict)

    def diagnose(self, store: Store, now: float | None = None) -> Diagnosis:
        now = time.time() if now is None else now
        devices: dict[tuple[int, int], DeviceDiagnosis] = {}
        agents = store.agents()
        for agent in agents:
            for dev in agent.devices:
                devices[(agent.pid, dev.index)] = self._device(store, agent, dev, now)
        self._leaks = {k: v for k, v in self._leaks.items() if k in devices}
        live = {agent.pid for agent in agents if agent.state == CONNECTED}
        gpus = _gpus(store.nvml(), [d for key, d in devices.items() if key[0] in live])
        return Diagnosis(now, devices, tuple(gpus), tuple(suggest(gpus)))

    def _device(
        self, store: Store, agent: AgentView, dev: AgentDeviceView, now: float
    ) -> DeviceDiagnosis:
        latest = dev.latest
        key = (agent.pid, dev.index)
        # Only the rows each measure needs: the gauge's median and the pressure window, read every
        # time; the whole allocated history only when the leak verdict is due again (a dashboard
        # diagnoses every second, and an hour of history is 3600 rows per device).
        newest_sample = agent.last_sample_time if agent.last_sample_time is not None else now
        recent = store.history(
            agent.pid,
            dev.index,
            since=newest_sample - PRESSURE_WINDOW_S,
            columns=("time", "num_alloc_retries", "num_ooms"),
        )
        gauge = store.history(agent.pid, dev.index, last=GAUGE_SAMPLES, columns=("fragmentation",))
        # The baseline is the newest step mark.
        newest = store.step_marks(agent.pid, dev.index, last=1, columns=("allocated",)).get(
            "allocated", []
        )
        cached = self._leaks.get(key)
        if cached is not None and 0 <= now - cached[0] < self.leak_refresh_s:
            leak = cached[1]
        else:
            marks = store.step_marks(agent.pid, dev.index, last=MAX_MARKS)
            history = store.history(agent.pid, dev.index, columns=("time", "allocated"))
            leak = detect(
                marks.get("step", []),
                marks.get("time", []),
                marks.get("allocated", []),
                history.get("time", []),
                history.get("allocated", []),
                headroom_bytes=latest.free_bytes + latest.cached,
            )
            self._leaks[key] = (now, leak)
        summaries = agent.snapshot_summary or {}
        snapshot_age = now - agent.snapshot_time if agent.snapshot_time is not None else None
        return DeviceDiagnosis(
            pid=agent.pid,
            index=dev.index,
            uuid=dev.uuid,
            allocated_bytes=latest.allocated,
            reserved_bytes=latest.reserved,
            cached_bytes=latest.cached,
            peak_bytes=max(dev.peak_bytes, latest.torch_peak),
            baseline_bytes=int(newest[-1]) if newest else None,
            free_bytes=latest.free_bytes,
            total_bytes=latest.total_bytes,
            leak=leak,
            fragmentation=fragmentation(
                latest, gauge.get("fragmentation", []), summaries.get(dev.index), snapshot_age
            ),
            pressure=pressure(
                latest,
                recent.get("time", []),
                recent.get("num_alloc_retries", []),
                recent.get("num_ooms", []),
            ),
            breakdown=(agent.breakdown or {}).get(dev.index),
            allocator_conf=agent.hello.allocator_conf if agent.hello else "",
        )


def _gpus(reading: NvmlReading | None, devices: list[DeviceDiagnosis]) -> list[GpuFacts]:
    """One GpuFacts per physical GPU: the driver's view when there is one, joined with the agent
    devices on it by UUID (never by index: CUDA_VISIBLE_DEVICES renumbers)."""
    by_uuid: dict[str, list[DeviceDiagnosis]] = {}
    for device in devices:
        by_uuid.setdefault(device.uuid or f"pid{device.pid}:{device.index}", []).append(device)
    gpus = []
    if reading is not None and reading.available:
        for d in reading.devices:
            on_it = by_uuid.pop(d.uuid, [])
            gpus.append(
                GpuFacts(
                    uuid=d.uuid,
                    index=d.index,
                    name=d.name,
                    total_bytes=d.total_bytes or (on_it[0].total_bytes if on_it else 0),
                    used_bytes=d.used_bytes,
                    processes=tuple((p.pid, p.used_bytes) for p in d.processes),
                    agents=tuple(on_it),
                )
            )
    # GPUs only agents know about (no NVML): their own mem_get_info is the device's account.
    for uuid, on_it in by_uuid.items():
        first = on_it[0]
        gpus.append(
            GpuFacts(
                uuid=uuid,
                index=first.index,
                name="",
                total_bytes=first.total_bytes,
                used_bytes=first.total_bytes - first.free_bytes,
                processes=(),
                agents=tuple(on_it),
            )
        )
    return gpus
