"""AMD GPUs: the amdsmi device source, run through the real `amdsmi` package (the `test` extra
installs it) against the stand-in libamd_smi.so built from that package's own ctypes
definitions (tests/amd_standin.py), and the join of trainers on ROCm by PCI bus id.

Whatever loads amdsmi runs in a child process (`memtop --once` or a snippet): the package binds
its library once per process, and the rest of the suite must keep seeing a machine without it.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from amd_standin import STATE_ENV, Gpu, State, build, mi300x

from memtop import protocol
from memtop.base import children
from memtop.model import SOURCE_AMDSMI, DeviceReading, DriverReading, GpuProcess
from memtop.sources import amdsmi as amd_source
from memtop.sources.amdsmi import NO_LIBRARY, NOT_INSTALLED, AmdSmiSource
from memtop.sources.driver_libraries import DEV_DIR_ENV

GiB = 1 << 30

# A machine with ROCm installed: amdsmi finds the real library through the linker whatever
# ROCM_PATH says, and the tests of a machine without it cannot run there.
ROCM_INSTALLED = (
    ctypes.util.find_library("amd_smi") is not None or Path("/opt/rocm/lib/libamd_smi.so").exists()
)
without_rocm = pytest.mark.skipif(ROCM_INSTALLED, reason="ROCm is installed on this machine")


@pytest.fixture(scope="session")
def rocm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROCM_PATH of the stand-in (built once per test session)."""
    return build(tmp_path_factory.mktemp("rocm"))


def _env(rocm: Path | None, state: Path | None, socket_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ROCM_HOME", STATE_ENV)}
    env["ROCM_PATH"] = str(rocm) if rocm is not None else "/nonexistent-rocm"
    if rocm is not None:
        # As root, memtop loads libamd_smi.so only where /dev/kfd exists: the stand-in's box
        # has none, so the test says where its "device node" is (driver_libraries, tests only).
        dev = rocm / "dev"
        dev.mkdir(exist_ok=True)
        (dev / "kfd").touch()
        env[DEV_DIR_ENV] = str(dev)
    env["MEMTOP_SOCKET_DIR"] = str(socket_dir)
    if state is not None:
        env[STATE_ENV] = str(state)
    env.update(extra)
    return env


def once(rocm: Path | None, state: Path | None, socket_dir: Path, *, json_out: bool = True) -> Any:
    """`memtop --once [--json]` on a machine whose ROCm is the stand-in (no NVIDIA driver)."""
    command = [sys.executable, "-m", "memtop", "--socket-dir", str(socket_dir), "--once"]
    done = subprocess.run(
        [*command, "--json"] if json_out else command,
        env=_env(rocm, state, socket_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout) if json_out else done.stdout


# ONE_ROUND: the snippets here sample one round, and a round waits for the driver only so long
# (1.2 s the first): on a loaded box the first read (amdsmi's import and the library's load, on
# the sampler's device thread) took longer, the round went on without it, and the view said "no
# devices" (under 4 workers at load 15; the trainers shared by the ROCm tests were blamed for it
# once).  Their round waits for the driver: the figures asserted are the same.


# --------------------------------------------------------------------- the real package


def test_once_json_lists_the_amd_gpus_and_their_processes(
    rocm: Path, tmp_path: Path, socket_dir: Path
) -> None:
    state = State(gpus=mi300x(2), processes=[(0, 4242, 5 * GiB), (1, 4243, 7 * GiB)])
    report = once(rocm, state.write(tmp_path / "state"), socket_dir)

    assert report["nvml"] == {
        "available": True,
        "source": "amdsmi",
        "error": None,
        "driver_version": "6.12.12",
    }
    first, second = report["devices"]
    assert first["name"] == "AMD Instinct MI300X"
    assert first["uuid"] == "0cff74a1-0000-1000-8000-000000000000"
    assert first["pci_bus_id"] == "0000:0c:00.0"
    assert second["pci_bus_id"] == "0000:22:00.0"
    assert first["total_bytes"] == 192 * GiB
    assert first["used_bytes"] == 8 * GiB and first["free_bytes"] == 184 * GiB
    assert first["utilization_percent"] == 40
    assert first["temperature_c"] == 50  # the hotspot sensor: an MI300X has no edge one
    assert first["source"] == "amdsmi" and first["error"] is None
    # (`workload`: what the process is, when known: a server's request; none here)
    assert first["processes"] == [
        {"pid": 4242, "used_bytes": 5 * GiB, "kind": "compute", "workload": None}
    ]
    assert second["processes"] == [
        {"pid": 4243, "used_bytes": 7 * GiB, "kind": "compute", "workload": None}
    ]


def test_a_gpu_lost_is_one_line_and_the_other_gpu_reads_on(
    rocm: Path, tmp_path: Path, socket_dir: Path
) -> None:
    gpus = mi300x(2)
    gpus[1].lost = True
    state = State(gpus=gpus, processes=[(0, 4242, 5 * GiB)]).write(tmp_path / "state")
    report = once(rocm, state, socket_dir)

    healthy, lost = report["devices"]
    assert lost["error"] == "GPU not found (fallen off the bus or removed?)"
    assert lost["used_bytes"] is None and lost["total_bytes"] is None
    assert healthy["error"] is None and healthy["used_bytes"] == 8 * GiB
    assert healthy["processes"][0]["pid"] == 4242
    assert "GPU not found (fallen off the bus or removed?)" in once(
        rocm, state, socket_dir, json_out=False
    )


def test_no_permission_to_list_processes_is_one_line_and_the_gpu_reads_on(
    rocm: Path, tmp_path: Path, socket_dir: Path
) -> None:
    gpus = mi300x(1)
    gpus[0].deny_processes = True
    state = State(gpus=gpus, processes=[(0, 4242, 5 * GiB)]).write(tmp_path / "state")
    (device,) = once(rocm, state, socket_dir)["devices"]

    assert device["error"] == "no permission to list processes"
    assert device["processes"] == []
    assert device["used_bytes"] == 8 * GiB and device["utilization_percent"] == 40


@pytest.mark.parametrize(
    ("status", "line"),
    [
        (10, "amdsmi: insufficient permissions (the user needs the render and video groups)"),
        (34, "amdsmi: driver not loaded (the amdgpu kernel module is not running)"),
    ],
)
def test_amdsmi_refusing_to_start_is_one_line(
    rocm: Path, tmp_path: Path, socket_dir: Path, status: int, line: str
) -> None:
    state = State(gpus=mi300x(1), init_status=status).write(tmp_path / "state")
    report = once(rocm, state, socket_dir)

    # The library is there (an AMD box): amdsmi's reason is the one shown, not NVML's.
    assert report["nvml"] == {
        "available": False,
        "source": "amdsmi",
        "error": line,
        "driver_version": None,
    }
    assert report["devices"] == []
    text = once(rocm, state, socket_dir, json_out=False)
    assert f"devices: {line}\n" in text


@without_rocm
def test_without_rocm_memtop_behaves_as_before(tmp_path: Path, socket_dir: Path) -> None:
    """amdsmi installed, libamd_smi.so nowhere: the package's own complaint (two lines on
    stdout) stays out of the JSON, and the report is NVML's, as before AMD support."""
    report = once(None, None, socket_dir)
    assert report["nvml"]["source"] == "nvml"
    assert report["nvml"]["error"].startswith("NVML not available")
    assert report["devices"] == []


def test_the_stand_in_is_built_from_the_package_definitions(rocm: Path, tmp_path: Path) -> None:
    """The real package, loading the stand-in, answers through its own interface."""
    state = State(gpus=mi300x(1), processes=[(0, 77, 3 * GiB)]).write(tmp_path / "state")
    snippet = (
        "import amdsmi, json\n"
        "amdsmi.amdsmi_init()\n"
        "(h,) = amdsmi.amdsmi_get_processor_handles()\n"
        "print(json.dumps([amdsmi.amdsmi_get_gpu_device_bdf(h),\n"
        "  amdsmi.amdsmi_get_gpu_asic_info(h)['market_name'],\n"
        "  amdsmi.amdsmi_get_gpu_process_list(h)[0]['memory_usage']['vram_mem'],\n"
        "  amdsmi.amdsmi_get_power_info(h)['current_socket_power']]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", snippet],
        env=_env(rocm, state, tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["0000:0c:00.0", "AMD Instinct MI300X", 3 * GiB, 350]


# ------------------------------------------------------------ the source, on a fake lib


class FakeAmdError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.err_code = code


class _Enum:
    def __init__(self, **values: int) -> None:
        self.__dict__.update(values)


class FakeAmdSmi:
    """The amdsmi functions memtop calls, answering from plain attributes."""

    AmdSmiInitFlags = _Enum(INIT_AMD_GPUS=2)
    AmdSmiMemoryType = _Enum(VRAM=0)
    AmdSmiTemperatureType = _Enum(EDGE=0, HOTSPOT=1)
    AmdSmiTemperatureMetric = _Enum(CURRENT=0)

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = gpus
        self.lost: set[int] = set()
        self.init_error: int | None = None
        self.power: dict[str, Any] = {"current_socket_power": "N/A", "average_socket_power": 300}
        self.inits = 0

    def amdsmi_init(self, flags: int) -> None:
        if self.init_error is not None:
            raise FakeAmdError(self.init_error)
        self.inits += 1

    def amdsmi_shut_down(self) -> None:
        pass

    def amdsmi_get_processor_handles(self) -> list[int]:
        return list(range(self.gpus))

    def _check(self, handle: int) -> None:
        if handle in self.lost:
            raise FakeAmdError(31)

    def amdsmi_get_gpu_device_uuid(self, handle: int) -> str:
        self._check(handle)
        return f"uuid-{handle}"

    def amdsmi_get_gpu_device_bdf(self, handle: int) -> str:
        self._check(handle)
        return f"0000:{0x10 + handle:02x}:00.0"

    def amdsmi_get_gpu_asic_info(self, handle: int) -> dict[str, Any]:
        self._check(handle)
        return {"market_name": "AMD Radeon PRO W7900"}

    def amdsmi_get_gpu_memory_total(self, handle: int, kind: int) -> int:
        self._check(handle)
        return 48 * GiB

    def amdsmi_get_gpu_memory_usage(self, handle: int, kind: int) -> int:
        self._check(handle)
        return 2 * GiB

    def amdsmi_get_gpu_process_list(self, handle: int) -> list[dict[str, Any]]:
        self._check(handle)
        return [{"pid": 100 + handle, "memory_usage": {"vram_mem": GiB}}]

    def amdsmi_get_gpu_activity(self, handle: int) -> dict[str, Any]:
        self._check(handle)
        return {"gfx_activity": "N/A", "umc_activity": 12, "mm_activity": "N/A"}

    def amdsmi_get_temp_metric(self, handle: int, sensor: int, metric: int) -> int:
        self._check(handle)
        if sensor == 1:
            raise FakeAmdError(2)  # no hotspot sensor on this board: the edge one
        return 61

    def amdsmi_get_power_info(self, handle: int) -> dict[str, Any]:
        self._check(handle)
        return self.power

    def amdsmi_get_gpu_driver_info(self, handle: int) -> dict[str, Any]:
        return {"driver_version": "6.10.5"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_not_available_figures_are_none_and_fallbacks_are_used() -> None:
    source = AmdSmiSource(FakeAmdSmi(1))
    reading = source.read()
    (device,) = reading.devices
    assert reading.available and reading.source == SOURCE_AMDSMI
    assert reading.driver_version == "6.10.5"
    assert device.utilization_percent is None  # "N/A"
    assert device.memory_utilization_percent == 12
    assert device.temperature_c == 61  # the edge sensor, the hotspot one being absent
    assert device.power_watts == 300.0  # the average, the current one being N/A
    assert device.processes == (GpuProcess(100, GiB),)
    assert device.pci_bus_id == "0000:10:00.0"
    assert device.error is None


def test_a_lost_gpu_is_asked_again_only_after_the_retry_interval() -> None:
    lib, clock = FakeAmdSmi(2), Clock()
    source = AmdSmiSource(lib, clock=clock, retry_interval=10)
    source.read()
    lib.lost.add(1)
    lost = source.read().devices[1]
    assert lost.error == "GPU not found (fallen off the bus or removed?)"
    assert lost.name == "AMD Radeon PRO W7900" and lost.pci_bus_id == "0000:11:00.0"
    lib.lost.clear()
    clock.now += 5
    assert source.read().devices[1].error == lost.error  # not asked yet
    clock.now += 6
    back = source.read().devices[1]
    assert back.error is None and back.used_bytes == 2 * GiB


def test_init_failure_is_retried_at_the_retry_pace() -> None:
    lib, clock = FakeAmdSmi(1), Clock()
    lib.init_error = 10
    source = AmdSmiSource(lib, clock=clock, retry_interval=10)
    assert source.read().error == amd_source._MESSAGES[10]
    lib.init_error = None
    clock.now += 5
    assert not source.read().available
    clock.now += 6
    assert source.read().available and lib.inits == 1


def test_a_missing_package_is_one_line_and_not_looked_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked = []

    def find_spec(name: str) -> None:
        looked.append(name)

    monkeypatch.setattr(amd_source.importlib.util, "find_spec", find_spec)
    source = AmdSmiSource(retry_interval=0)
    assert source.read().error == NOT_INSTALLED
    assert source.read().error == NOT_INSTALLED
    assert looked == ["amdsmi"] and not source.library_found


@without_rocm
def test_a_missing_library_keeps_amdsmis_complaint_off_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ROCM_PATH", "/nonexistent-rocm")
    monkeypatch.delenv("ROCM_HOME", raising=False)
    reading = AmdSmiSource().read()
    assert reading.error == NO_LIBRARY
    assert capsys.readouterr().out == ""
    assert "amdsmi" not in sys.modules  # nothing half-imported stays behind


def test_read_never_raises() -> None:
    class Broken(FakeAmdSmi):
        def amdsmi_get_gpu_memory_total(self, handle: int, kind: int) -> int:
            raise RuntimeError("boom\nsecond line")

    device = AmdSmiSource(Broken(1)).read().devices[0]
    assert device.error is not None and "\n" not in device.error
    assert device.used_bytes == 2 * GiB


# ------------------------------------------------------------------ choosing the drivers


class Fixed:
    def __init__(self, reading: DriverReading, found: bool = True) -> None:
        self.reading = reading
        self.library_found = found
        self.source = reading.source

    def read(self) -> DriverReading:
        return self.reading

    def close(self) -> None:
        pass


def _gpu(index: int, source: str) -> DeviceReading:
    return DeviceReading(index, f"{source}-{index}", "GPU", 1, 0, source=source)


def _sources(nvidia: DriverReading, amd: DriverReading, amd_found: bool = True) -> Any:
    from memtop.sim.devices_view import SimulatedDeviceSource
    from memtop.sources.devices import CombinedDeviceSource

    simulated = SimulatedDeviceSource(Path("/nonexistent-socket-dir"))
    return CombinedDeviceSource([Fixed(nvidia), Fixed(amd, amd_found)], simulated)


NO_NVML = DriverReading(False, error="NVML not available: no driver")


def test_a_mixed_box_shows_both_vendors_amd_numbered_after_nvidia() -> None:
    nvidia = DriverReading(True, (_gpu(0, "nvml"), _gpu(1, "nvml")), driver_version="580")
    amd = DriverReading(True, (_gpu(0, "amdsmi"),), driver_version="6.12", source="amdsmi")
    reading = _sources(nvidia, amd).read()
    assert reading.source == "nvml+amdsmi"
    assert [(d.index, d.uuid) for d in reading.devices] == [
        (0, "nvml-0"),
        (1, "nvml-1"),
        (2, "amdsmi-0"),
    ]
    assert reading.driver_version == "580 / 6.12"


def test_an_amd_box_reads_amdsmi_and_says_its_error() -> None:
    amd = DriverReading(True, (_gpu(0, "amdsmi"),), source="amdsmi")
    assert _sources(NO_NVML, amd).read() is amd
    failing = DriverReading(False, error="amdsmi: insufficient permissions", source="amdsmi")
    assert _sources(NO_NVML, failing).read() is failing


def test_without_any_driver_library_the_error_is_nvmls_as_before() -> None:
    missing = DriverReading(False, error=NO_LIBRARY, source="amdsmi")
    assert _sources(NO_NVML, missing, amd_found=False).read() is NO_NVML


# ------------------------------------------------------------------ the wire and the join


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML
        ("0000:c1:00.0", "0000:c1:00.0"),  # amdsmi
        ("c1:00.0", "0000:c1:00.0"),
        ("0001:0a:1f.3", "0001:0a:1f.3"),
        ("not a bus id", None),
        ("0000:c1:00.9", None),
        (42, None),
    ],
)
def test_canonical_pci_bus_id(text: object, canonical: str | None) -> None:
    assert protocol.canonical_pci_bus_id(text) == canonical


def _hello(**device: Any) -> dict[str, Any]:
    return {
        "protocol": 1,
        "pid": 1,
        "argv": [],
        "python": "3.11",
        "torch": "2.13.0+rocm7.0",
        "allocator_conf": "",
        "devices": [{"index": 0, "uuid": "GPU-x", "name": "MI300X", "total_bytes": 1, **device}],
        "hip": "7.0.51831",
    }


def test_hello_carries_the_pci_bus_id_and_hip() -> None:
    hello = protocol.parse_hello(_hello(pci_bus_id="0000:C1:00.0"))
    assert hello.devices[0].pci_bus_id == "0000:c1:00.0"
    assert hello.extra["hip"] == "7.0.51831"
    # Anything else in its place is ignored, not a reason to refuse the agent.
    assert protocol.parse_hello(_hello(pci_bus_id=["x"])).devices[0].pci_bus_id is None
    assert protocol.parse_hello(_hello()).devices[0].pci_bus_id is None


def test_the_torch_probe_reads_the_pci_address_from_the_device_properties() -> None:
    pytest.importorskip("torch")
    from memtop.agent.backends.cuda import _pci_bus_id

    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0xC1, 0

    assert _pci_bus_id(Props()) == "0000:c1:00.0"
    assert _pci_bus_id(object()) is None  # an older torch without them


def test_physical_gpu_follows_rocr_then_hip_visible_devices() -> None:
    from memtop.sim.trainer import physical_gpu

    assert physical_gpu(0, "amd", {"HIP_VISIBLE_DEVICES": "2,0,1"}) == 2
    assert (
        physical_gpu(1, "amd", {"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "2,0"}) == 4
    )
    assert (
        physical_gpu(0, "amd", {"ROCR_VISIBLE_DEVICES": "4,5,6", "HIP_VISIBLE_DEVICES": "2"}) == 6
    )
    assert physical_gpu(3, "amd", {"HIP_VISIBLE_DEVICES": "0"}) is None
    assert physical_gpu(1, "nvidia", {"HIP_VISIBLE_DEVICES": "0"}) == 1


def test_the_hello_of_a_trainer_on_rocm_says_hip_and_its_pci_bus_ids(socket_dir: Path) -> None:
    from memtop.agent.probe import ProbeDevice
    from memtop.agent.server import Agent
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.probe import SimulatedGpu, SimulatedProbe
    from memtop.sources.agents import AgentClient

    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    rocm = ProbeDevice(0, "GPU-5d8e", "MI300X", 8 * GiB, "0000:c1:00.0")
    cuda = ProbeDevice(1, "GPU-1", "H100", 8 * GiB)  # no PCI numbers: no field
    gpus = [SimulatedGpu(rocm, allocator), SimulatedGpu(cuda, allocator)]
    server = Agent(SimulatedProbe(gpus, hip="7.0.51831"), socket_dir)
    server.start()
    try:
        with AgentClient(server.pid, server.directory, timeout=5.0) as client:
            hello = client.connect()
            raw = client.request("hello")
    finally:
        server.stop()
    assert hello.extra["hip"] == "7.0.51831"
    assert [d.pci_bus_id for d in hello.devices] == ["0000:c1:00.0", None]
    assert "pci_bus_id" not in raw["devices"][1]


# ------------------------------------------------------------------ what the user reads


def test_the_expandable_segments_fix_is_spelt_for_rocm_on_rocm() -> None:

    from test_suggestions import device, frag, gpu, told

    from memtop.diagnosis import suggestions as rules

    cuda = device(fragmentation=frag(0.4, 4 * GiB))
    (on_cuda,) = rules.expandable_segments(gpu(cuda))
    (on_rocm,) = rules.expandable_segments(gpu(told(cuda, hip="7.0.51831")))
    assert on_cuda.fix == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert on_rocm.fix == "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True"
    assert "expandable_segments not supported on this platform" in on_rocm.detail
    assert "ROCm" not in on_cuda.detail


def test_the_oom_fix_is_spelt_for_rocm_on_rocm() -> None:
    from test_oom import _marks, _report

    from memtop.oom.diagnose import diagnose

    flat = _marks([10 * GiB] * 20, [30 * GiB] * 20)
    report = _report(
        recent=flat,
        allocated_bytes=int(72.8 * GiB),
        reserved_bytes=78 * GiB,
        largest_free_block_bytes=int(1.4 * GiB),
        free_bytes=int(1.5 * GiB),
        hip="7.0.51831",
    )
    assert diagnose(report)["fix"] == "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True"


@pytest.mark.parametrize("how", ["owner", "mode"])
def test_an_amdsmi_package_another_user_controls_is_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """`python -m memtop` run as root in a directory others write to: their `amdsmi` there
    comes first on sys.path, and must not run."""
    import importlib

    package = tmp_path / "amdsmi"
    package.mkdir()
    marker = tmp_path / "imported"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    if how == "mode":
        (package / "__init__.py").chmod(0o666)
    elif os.getuid() == 0:
        os.chown(package / "__init__.py", 12345, 12345)
    else:
        pytest.skip("giving a file to another user needs root")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    reading = AmdSmiSource().read()
    assert reading.error is not None and reading.error.startswith("amdsmi not loaded: ")
    assert ("belongs to uid 12345" if how == "owner" else "is writable by others") in reading.error
    assert not marker.exists()


def test_the_dashboard_shows_a_lost_amd_gpu_in_one_line_and_the_rest_reads_on(
    socket_dir: Path,
) -> None:
    """The real dashboard, under its pilot, over the amdsmi source (a fake lib in this process:
    the real package binds its library once per process): GPU 1 lost, GPU 0 on screen."""
    import asyncio

    from ui_helpers import screen_text, wait_for

    from memtop.engine.sampler import Sampler
    from memtop.engine.store import Store
    from memtop.sources.agents import AgentPool
    from memtop.ui.app import MemtopApp

    lib = FakeAmdSmi(2)
    lib.lost.add(1)
    store = Store()
    sampler = Sampler(store, AmdSmiSource(lib), AgentPool(socket_dir), interval=0.25)
    sampler.start()
    app = MemtopApp(store, sampler, interval=0.25)
    shown: list[str] = []

    async def main() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: "W7900" in screen_text(app.export_screenshot()))
            await pilot.pause(0.5)
            shown.append(screen_text(app.export_screenshot()))

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
    (text,) = shown
    assert text.count("GPU not found (fallen off the bus or removed?)") == 1, text
    assert "ROCm amdgpu 6.10.5" in text, text
    assert "AMD Radeon PRO W7900" in text  # GPU 0's card
    assert re.search(r"│\s+100 .* 0 +1\.0G ", text), text  # its process, charged 1 GiB


@pytest.mark.slow
@without_rocm
def test_demo_vendor_amd_shows_amd_gpus_joined_by_pci_bus_id(socket_dir: Path) -> None:
    """`memtop demo --vendor amd` on a machine without ROCm: simulated MI300Xs, trainers on
    ROCm (HIP UUIDs), joined by PCI bus id in `--once --json` and labelled as AMD's exporter
    does in `memtop export`'s metrics."""

    env = _env(None, None, socket_dir)
    command = ["demo", "--vendor", "amd", "--gpus", "2", "--scenario", "healthy", "--no-ui"]
    demo = subprocess.Popen(
        [sys.executable, "-m", "memtop", "--socket-dir", str(socket_dir), *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stdout is not None
        started = demo.stdout.readline()
        assert "2 simulated trainer(s) (healthy) on 2 simulated GPU(s)" in started, started
        report = once(None, None, socket_dir)
        snippet = (
            "import sys\n"
            "from memtop.cli import _make_sampler, build_parser\n"
            "from memtop.export.metrics import render\n"
            "from memtop.export.text import exposition\n"
            "from memtop.engine.observation import Observer\n"
            "sampler = _make_sampler(build_parser().parse_args(['--socket-dir', sys.argv[1]]))\n"
            "sampler.sample_once(budget=30)\n"  # see ONE_ROUND
            "sys.stdout.write(exposition(render(Observer(sampler.store).latest())).decode())\n"
            "sampler.stop()\n"
        )
        metrics = subprocess.run(
            [sys.executable, "-c", snippet, str(socket_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    finally:
        children.stop(demo, timeout=30)
    assert report["nvml"]["source"] == "sim"
    gpus = report["devices"]
    assert [g["name"] for g in gpus] == ["Simulated AMD Instinct MI300X"] * 2
    assert [g["pci_bus_id"] for g in gpus] == ["0000:0c:00.0", "0000:22:00.0"]
    assert report["problems"] == []
    for agent in report["agents"]:
        (device,) = agent["devices"]
        assert agent["hip"] == "7.0.51831"
        assert device["uuid"] == gpus[device["gpu"]]["uuid"]  # HIP's UUID, joined by bus id
        assert device["non_pytorch_bytes"] is not None
    used = [m for m in metrics.splitlines() if m.startswith("memtop_gpu_memory_used_bytes{")]
    assert len(used) == 2 and all('gpu_id="' in m and "card_model=" in m for m in used)


def test_the_allocator_options_of_a_rocm_trainer_include_the_hip_name() -> None:
    from memtop.agent.probe import allocator_conf_from_env

    hip = {"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True"}
    assert allocator_conf_from_env(hip) == "expandable_segments:True"
    # torch reads the HIP name only when the others are unset.
    both = {**hip, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    assert allocator_conf_from_env(both) == "max_split_size_mb:64"
    assert allocator_conf_from_env({}) == ""


def test_nvml_gives_the_pci_bus_id_too_so_the_join_has_its_second_key_on_nvidia() -> None:
    from fake_nvml import FakeDevice, FakeNvml

    from memtop.sources.nvml import NvmlSource

    fake = FakeNvml([FakeDevice(bus_id="00000000:3B:00.0"), FakeDevice(bus_id=None)])
    first, second = NvmlSource(fake).read().devices
    assert first.pci_bus_id == "0000:3b:00.0"
    assert second.pci_bus_id is None and second.error is None  # not supported: silently
    assert NvmlSource(fake).read().devices[0].pci_bus_id == "0000:3b:00.0"


def test_an_unexpected_amdsmi_error_is_one_inert_line():
    # The library's (or a stand-in's) own words reach root's status line: control characters
    # and lone surrogates made inert, as NVML's are (memtop.sources.driver_text, one home).
    class Odd(Exception):
        pass

    line = amd_source.amdsmi_error_line(Odd("gone\x1b]0;owned\x07 caf\udce9\n  again"))
    assert "\x1b" not in line and "\x07" not in line and "\n" not in line
    line.encode("utf-8")  # strict
    assert line.startswith("amdsmi: unexpected Odd: gone") and line.endswith("again")


# --------------------------------------------------------------------- trainers on ROCm
# (last in the module: see rocm_trainers)


@dataclass(frozen=True)
class RocmTrainers:
    demo: Any  # memtop.sim.demo.Demo
    state: Path  # the stand-in's state file: the GPUs as the trainers left them
    shuffled: list[int]  # the physical GPU of each trainer
    socket_dir: Path  # where their agents listen


@pytest.fixture(scope="module")
def rocm_trainers(rocm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RocmTrainers]:
    """Three simulated trainers on ROCm under a shuffled HIP_VISIBLE_DEVICES, their GPUs in the
    stand-in's state.  Started once for the tests that only read them (three trainers cost
    ~2 CPU-s to start and, at 0.05 s a step, ~0.2 CPU-s each second they live: they step at
    0.5 s, for their readers ask what they hold, not how fast they step).  A module's fixture
    ends with the module, not with its last user: the tests that use it are the module's last
    ones, so the trainers live only while those run."""
    from memtop.sim.demo import Demo

    shuffled = [2, 0, 1]  # trainer k's cuda:k is physical GPU shuffled[k]
    # Short (AF_UNIX paths are limited to 108 bytes) and private, as the socket_dir fixture's.
    socket_dir = Path(tempfile.mkdtemp(prefix="mt-"))
    socket_dir.chmod(0o700)
    demo = Demo(
        3,
        "healthy",
        0.5,
        socket_dir=socket_dir,
        extra_env={"HIP_VISIBLE_DEVICES": ",".join(map(str, shuffled))},
        vendor="amd",
    )
    demo.start()
    try:
        assert demo.wait_ready(), f"trainers failed: {demo.failed()}"
        from memtop.sim.device import SimGpuRegistry

        assert demo.registry is not None
        registry = SimGpuRegistry(demo.registry)
        specs = registry.gpus()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            usage = [registry.usage_by_pid(spec.index) for spec in specs]
            if all(usage):
                break
            time.sleep(0.1)
        state = State(
            gpus=[
                Gpu(
                    total=spec.total_bytes,
                    used=sum(usage[spec.index].values()),
                    bdf=spec.pci_bus_id or "",
                    uuid=spec.uuid,
                    name=spec.name,
                )
                for spec in specs
            ],
            processes=[
                (spec.index, pid, used) for spec in specs for pid, used in usage[spec.index].items()
            ],
        )
        state_file = state.write(tmp_path_factory.mktemp("rocm-trainers") / "state")
        yield RocmTrainers(demo, state_file, shuffled, socket_dir)
    finally:
        demo.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_trainers_on_rocm_join_their_gpus_by_pci_bus_id_under_a_shuffled_hip_visible_devices(
    rocm: Path, rocm_trainers: RocmTrainers
) -> None:
    demo, state, shuffled = rocm_trainers.demo, rocm_trainers.state, rocm_trainers.shuffled
    socket_dir = rocm_trainers.socket_dir
    report = once(rocm, state, socket_dir)

    assert report["nvml"]["source"] == "amdsmi"  # the stand-in, not the demo's registry
    assert report["problems"] == []
    devices = {d["index"]: d for d in report["devices"]}
    trainers = [p.pid for p in demo.processes]
    agents = {a["pid"]: a for a in report["agents"]}
    assert sorted(agents) == sorted(trainers)
    for k, pid in enumerate(trainers):
        agent = agents[pid]
        assert agent["state"] == "connected"
        assert agent["hip"] == "7.0.51831"
        (device,) = agent["devices"]
        gpu = devices[shuffled[k]]
        # The trainer's cuda:k is the driver's GPU shuffled[k]: by PCI bus id, for the UUID
        # its torch reports is HIP's, not amdsmi's.
        assert device["index"] == k
        assert device["gpu"] == shuffled[k]
        assert device["uuid"] == gpu["uuid"]
        assert [p["pid"] for p in gpu["processes"]] == [pid]
        # The driver's charge joined with the allocator's numbers (None: not joined).
        assert device["non_pytorch_bytes"] is not None


@pytest.mark.slow
def test_the_table_and_the_header_say_rocm(rocm: Path, rocm_trainers: RocmTrainers) -> None:
    """The dashboard's view-model over a `--once` of trainers on ROCm: the process rows and
    the detail title say ROCm, the header names the AMD driver."""
    state, socket_dir = rocm_trainers.state, rocm_trainers.socket_dir
    snippet = (
        "import json, sys\n"
        "from memtop.cli import _make_sampler, build_parser\n"
        "from memtop.engine.observation import Observer\n"
        "from memtop.ui import view\n"
        "from memtop.ui.screens.detail import _title\n"
        "from memtop.ui.widgets.process_table import _command\n"
        "args = build_parser().parse_args(['--socket-dir', sys.argv[1]])\n"
        "sampler = _make_sampler(args)\n"
        "sampler.sample_once(budget=30)\n"  # see ONE_ROUND
        "dash = view.build(Observer(sampler.store).latest())\n"
        "sampler.stop()\n"
        "rows = [r for r in dash.processes if r.has_agent]\n"
        "print(json.dumps([dash.source, [_command(r, False) for r in rows],\n"
        "  [_title(r).plain for r in rows]]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", snippet, str(socket_dir)],
        env=_env(rocm, state, socket_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    source, commands, titles = json.loads(done.stdout)
    assert source == "ROCm amdgpu 6.12.12"
    assert len(commands) == 3
    assert all(c.startswith("ROCm sim_train.py") for c in commands), commands
    assert all("· ROCm (HIP 7.0.51831)" in t for t in titles), titles


def test_the_exporter_labels_amd_gpus_as_amds_device_metrics_exporter_does(
    rocm: Path, rocm_trainers: RocmTrainers
) -> None:
    """gpu_id, gpu_uuid and card_model (ROCm/device-metrics-exporter's GPUMetricLabel) on the
    GPU and per-process series, beside memtop's DCGM-style labels."""
    state, shuffled = rocm_trainers.state, rocm_trainers.shuffled
    socket_dir = rocm_trainers.socket_dir
    snippet = (
        "import sys\n"
        "from memtop.cli import _make_sampler, build_parser\n"
        "from memtop.export.metrics import render\n"
        "from memtop.export.text import exposition\n"
        "from memtop.engine.observation import Observer\n"
        "args = build_parser().parse_args(['--socket-dir', sys.argv[1]])\n"
        "sampler = _make_sampler(args)\n"
        "sampler.sample_once(budget=30)\n"  # see ONE_ROUND
        "sys.stdout.write(exposition(render(Observer(sampler.store).latest())).decode())\n"
        "sampler.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", snippet, str(socket_dir)],
        env=_env(rocm, state, socket_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    used = [line for line in lines if line.startswith("memtop_gpu_memory_used_bytes{")]
    assert len(used) == 3
    model = 'card_model="Simulated AMD Instinct MI300X"'
    for n, line in enumerate(used):
        assert f'gpu="{n}"' in line and f'gpu_id="{n}"' in line and model in line
        uuid = line.split('UUID="')[1].split('"')[0]
        assert f'gpu_uuid="{uuid}"' in line
    reserved = [line for line in lines if line.startswith("memtop_reserved_bytes{")]
    assert sorted(line.split('gpu_id="')[1][0] for line in reserved) == sorted(
        str(g) for g in shuffled
    )
