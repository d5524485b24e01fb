"""MIG, end to end (issue 31, item 1): the real nvidia-ml-py over the stand-in libnvidia-ml.so.1
of tests/nvml_standin.c, a GPU in MIG mode with three instances, and real trainers (memtop's
simulated ones, whose hello gives the UUID as torch does: bare) joined with them, as root and
as another local user (whom the driver refuses the parent GPU's process list).

The trainers, as torch sees a MIG slice:
- A gives its instance's own UUID, bare (cuDeviceGetUuid_v2): joined with instance 1 by the
  UUID compared without its `MIG-` prefix (the agent once made it `GPU-…`: joined with nothing);
- B gives its parent GPU's UUID (older paths): joined with the one instance that lists its pid
  and has its size, instance 3, not instance 2 of the same size nor the whole GPU;
- C gives a UUID the driver does not list but the parent's PCI address: joined with nothing,
  never by that address (every instance shares it: that fallback joined all of them with GPU 0).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from local_users import LocalUser, local_user, needs_root
from nvml_standin import (
    GiB,
    Gpu,
    Mig,
    State,
    build,
    env,
    gpu_uuid,
    mig_uuid,
    pci_bus_id,
)

from memtop.sim.device import SimGpuRegistry, SimGpuSpec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SITE_PACKAGES = next(p for p in sys.path if p.endswith("site-packages"))
A100 = "NVIDIA A100-SXM4-80GB"


@pytest.fixture(scope="module")
def library() -> Iterator[Path]:
    """The stand-in, in a folder every user can read."""
    folder = Path(tempfile.mkdtemp(prefix="mt-nvml-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield build(folder / "lib")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Box:
    work: Path
    sockets: Path
    state: Path
    pids: dict[str, int] = field(default_factory=dict)
    user: LocalUser | None = None

    def environment(self, library: Path) -> dict[str, str]:
        base = {
            "PATH": "/usr/bin:/bin",
            # A user cannot reach root's interpreter (under /root): the system's, with the
            # venv's packages and this worktree.
            "PYTHONPATH": f"{ROOT}:{SITE_PACKAGES}",
            "MEMTOP_SOCKET_DIR": str(self.sockets),
            "HOME": str(self.work),
        }
        return env(library, self.state, base)

    @property
    def python(self) -> str:
        return "/usr/bin/python3" if self.user is not None else sys.executable

    def run(self, library: Path, *args: str) -> subprocess.CompletedProcess[str]:
        user = self.user
        return subprocess.run(
            [self.python, "-m", "memtop", "--socket-dir", str(self.sockets), *args],
            env=self.environment(library),
            cwd=str(self.work),
            capture_output=True,
            text=True,
            timeout=90,
            **({"user": user.uid, "group": user.gid, "extra_groups": []} if user else {}),
        )

    def once(self, library: Path, *args: str) -> dict[str, Any]:
        done = self.run(library, "--once", "--json", *args)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]


# The trainers' devices (what their torch reports) and what they stand for.
SPECS = {
    "A": SimGpuSpec(0, mig_uuid(0, 1)[4:], f"{A100} MIG 3g.40gb", 40 * GiB, pci_bus_id(0)),
    "B": SimGpuSpec(1, gpu_uuid(0)[4:], f"{A100} MIG 2g.20gb", 20 * GiB, pci_bus_id(0)),
    "C": SimGpuSpec(2, "0badc0de-0000-4000-8000-000000000000", "?", 20 * GiB, pci_bus_id(0)),
}


def _box(library: Path, user: LocalUser | None) -> Iterator[Box]:
    work = Path(tempfile.mkdtemp(prefix="mt-mig-", dir="/tmp"))
    work.chmod(0o755)
    sockets = work / "sockets"
    sockets.mkdir(mode=0o700)
    registry = work / "registry"
    SimGpuRegistry(registry).create(list(SPECS.values()))
    box = Box(work, sockets, work / "state", user=user)
    if user is not None:
        for path in (work, sockets, registry, *registry.iterdir()):
            os.chown(path, user.uid, user.gid)
    State(gpus=[Gpu()]).write(box.state)
    trainers = []
    try:
        # A step every 0.5 s: the tests ask how each trainer is joined with its instance, never
        # for a step; six trainers living through the module at 0.1 s were most of its CPU.
        for name, spec in SPECS.items():
            command = [
                box.python, "-m", "memtop.sim.trainer", "--registry", str(registry),
                "--gpu", str(spec.index), "--scenario", "healthy", "--step-time", "0.5",
                "--scale", "0.1",
            ]  # fmt: skip
            trainers.append(
                subprocess.Popen(
                    command,
                    env=box.environment(library),
                    cwd=str(work),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    **({"user": user.uid, "group": user.gid, "extra_groups": []} if user else {}),
                )
            )
            box.pids[name] = trainers[-1].pid
        a, b, c = (box.pids[n] for n in "ABC")
        # GPU 0 in MIG mode: instance 1 (3g.40gb) runs A; instances 2 and 3 are alike (2g.20gb),
        # and 3 runs B.  C runs on instance 2 under another pid namespace: listed by a pid
        # memtop cannot match (the driver gives the host's pid; here, one that is not C's).
        State(
            gpus=[Gpu(used=40 * GiB)],
            migs=[
                Mig(0, 1, total=40 * GiB, used=9 * GiB, profile="3g.40gb"),
                Mig(0, 2, total=20 * GiB, used=3 * GiB, profile="2g.20gb"),
                Mig(0, 3, total=20 * GiB, used=5 * GiB, profile="2g.20gb"),
            ],
            mig_processes=[
                (0, 1, 0, a, 8 * GiB),
                (0, 2, 0, 999_999, 2 * GiB),
                (0, 3, 0, b, 4 * GiB),
            ],
        ).write(box.state)
        _wait_connected(box, library, {a, b, c})
        yield box
    finally:
        for trainer in trainers:
            trainer.terminate()
        for trainer in trainers:
            try:
                trainer.wait(timeout=10)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()
        shutil.rmtree(work, ignore_errors=True)


def _wait_connected(box: Box, library: Path, pids: set[int]) -> None:
    deadline = time.monotonic() + 60
    report: dict[str, Any] = {}
    while time.monotonic() < deadline:
        report = box.once(library)
        connected = {
            a["pid"] for a in report["agents"] if a["state"] == "connected" and a["devices"]
        }
        if pids <= connected:
            return
        time.sleep(0.5)
    raise AssertionError(f"trainers not connected: {json.dumps(report['agents'])[:2000]}")


@pytest.fixture(scope="module")
def as_root(library: Path) -> Iterator[Box]:
    yield from _box(library, None)


@pytest.fixture(scope="module")
def as_a_user(library: Path) -> Iterator[Box]:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root (and useradd) to create a second local user")
    with local_user("mtmig") as user:
        yield from _box(library, user)


def _check_mig_box(report: dict[str, Any], pids: dict[str, int]) -> None:
    assert report["nvml"]["available"] and report["nvml"]["error"] is None
    parent, *instances = report["devices"][:4]
    # The GPU, then each instance under it: a device of its own.
    assert parent["uuid"] == gpu_uuid(0) and parent["mig"] is None and parent["mig_mode"]
    assert parent["processes"] == []  # its instances list them (a user is refused the parent's)
    assert parent["error"] is None
    assert [d["mig"] for d in instances] == [
        {"parent_index": 0, "gpu_instance_id": i, "compute_instance_id": 0, "profile": p}
        for i, p in ((1, "3g.40gb"), (2, "2g.20gb"), (3, "2g.20gb"))
    ]
    assert [d["uuid"] for d in instances] == [mig_uuid(0, i) for i in (1, 2, 3)]
    assert [d["index"] for d in instances] == [0, 0, 0]
    assert [d["total_bytes"] for d in instances] == [40 * GiB, 20 * GiB, 20 * GiB]
    assert [d["used_bytes"] for d in instances] == [9 * GiB, 3 * GiB, 5 * GiB]
    assert [d["pci_bus_id"] for d in instances] == [None, None, None]
    assert [[p["pid"] for p in d["processes"]] for d in instances] == [
        [pids["A"]],
        [999_999],
        [pids["B"]],
    ]
    agents = {a["pid"]: a for a in report["agents"]}
    (a,) = agents[pids["A"]]["devices"]
    (b,) = agents[pids["B"]]["devices"]
    (c,) = agents[pids["C"]]["devices"]
    # A: its instance's bare UUID; the driver's charge joined with it (8 GiB).
    assert a["uuid"] == mig_uuid(0, 1) and a["gpu"] == 0
    assert a["non_pytorch_bytes"] is not None
    # B: its parent's UUID, settled by the instance listing its pid with its size.
    assert b["uuid"] == mig_uuid(0, 3) and b["gpu"] == 0
    assert b["non_pytorch_bytes"] is not None
    # C: unknown UUID, the parent's PCI address: joined with no driver device.
    assert c["uuid"] == SPECS["C"].uuid
    assert c["non_pytorch_bytes"] is None
    by_uuid = {d["uuid"]: d for d in report["devices"]}
    assert by_uuid[SPECS["C"].uuid]["source"] == "agent"
    # The GPU in MIG mode carries no trainer of its own.
    assert parent["peak_sum_bytes"] is None


@needs_root
def test_mig_instances_are_devices_with_their_trainers_joined_as_root(
    library: Path, as_root: Box
) -> None:
    _check_mig_box(as_root.once(library), as_root.pids)


@needs_root
def test_mig_instances_are_devices_with_their_trainers_joined_as_a_user(
    library: Path, as_a_user: Box
) -> None:
    report = as_a_user.once(library)
    _check_mig_box(report, as_a_user.pids)
    # The user's memtop, not root's, read it (the driver refused it the parent's list).
    assert report["agents"] and all(a["state"] == "connected" for a in report["agents"])


@needs_root
def test_only_takes_a_mig_instance(library: Path, as_root: Box) -> None:
    report = as_root.once(library, "--only", "0:3")
    assert [d["uuid"] for d in report["devices"]] == [mig_uuid(0, 3)]
    assert [a["pid"] for a in report["agents"]] == [as_root.pids["B"]]
    text = as_root.run(library, "--once", "--only", "0:1")
    assert text.returncode == 0, text.stderr
    assert "0:1    MIG 3g.40gb" in text.stdout
    assert "MIG 2g.20gb" not in text.stdout
    missing = as_root.run(library, "--once", "--only", "0:9")
    assert "--only: GPU 0 has no MIG instance 9 (it has 1, 2, 3)" in missing.stdout + missing.stderr
    wrong = as_root.run(library, "--once", "--only", "0:x")
    assert wrong.returncode == 2 and "MIG instances like 0:1" in wrong.stderr


# The exporter's text of one round, in a child (pynvml binds the stand-in once per process).
SCRAPE = """
import sys
from pathlib import Path
from memtop.export.metrics import render
from memtop.export.text import exposition
from memtop.engine.observation import Observer
from memtop.engine.sampler import Sampler
from memtop.sources.agents import AgentPool
from memtop.sources.devices import DefaultDeviceSource
from memtop.engine.store import Store
store = Store()
sockets = Path(sys.argv[1])
sampler = Sampler(store, DefaultDeviceSource(sockets), AgentPool(sockets))
sampler.sample_once()
sampler.sample_once()
print(exposition(render(Observer(store).latest())).decode())
"""


@needs_root
def test_the_exporter_labels_mig_instances_as_dcgm_does(library: Path, as_root: Box) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRAPE, str(as_root.sockets)],
        env=as_root.environment(library),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    used = [line for line in done.stdout.splitlines() if line.startswith("memtop_gpu_memory_used")]
    instance = next(line for line in used if mig_uuid(0, 3) in line)
    assert 'GPU_I_ID="3"' in instance and 'GPU_I_PROFILE="2g.20gb"' in instance
    assert 'gpu="0"' in instance
    whole = next(line for line in used if f'UUID="{gpu_uuid(0)}"' in line)
    assert 'GPU_I_ID=""' in whole and 'GPU_I_PROFILE=""' in whole


# ------------------------------------------------------------------ without a driver library


def _mig_reading() -> Any:
    from memtop.model import DeviceReading, DriverReading, GpuProcess, MigInfo

    parent = DeviceReading(
        0, gpu_uuid(0), A100, 80 * GiB, 40 * GiB, pci_bus_id="0000:18:00.0", mig_mode=True
    )
    instances = [
        DeviceReading(
            0,
            mig_uuid(0, gi),
            f"{A100} MIG {profile}",
            size * GiB,
            used * GiB,
            processes=(GpuProcess(4100 + gi, (used - 1) * GiB),),
            mig=MigInfo(0, gi, 0, profile),
        )
        for gi, profile, size, used in ((1, "3g.40gb", 40, 9), (2, "2g.20gb", 20, 3))
    ]
    return DriverReading(True, (parent, *instances), driver_version="580.159.04")


def test_the_dashboard_shows_each_mig_instance_on_a_row_under_its_gpu() -> None:
    import asyncio

    from ui_helpers import screen_text, wait_for

    from memtop.engine.store import Store
    from memtop.ui.app import MemtopApp

    store = Store()
    store.update_driver(_mig_reading(), 1_790_000_000.0)
    app = MemtopApp(store, None, clock=lambda: 1_790_000_001.0, host="box", my_uid=0)

    async def run() -> list[str]:
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_for(pilot, lambda: len(app.query("FooterKey")) > 0)
            await pilot.pause(0.2)
            return screen_text(app.export_screenshot()).splitlines()

    lines = asyncio.run(run())
    gpu = next(i for i, line in enumerate(lines) if f"GPU 0  {A100}" in line)
    first = next(i for i, line in enumerate(lines) if "GPU 0 · MIG 3g.40gb #1" in line)
    second = next(i for i, line in enumerate(lines) if "GPU 0 · MIG 2g.20gb #2" in line)
    assert gpu < first < second
    # The process table names the instance its process runs on as `--only` takes it.
    rows = [line for line in lines if "4101" in line or "4102" in line]
    assert any(" 0:1 " in line for line in rows if "4101" in line), rows
    assert any(" 0:2 " in line for line in rows if "4102" in line), rows


def test_the_torch_probe_keeps_the_uuid_torch_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch gives a MIG instance's UUID bare; the probe once made it `GPU-<uuid>`, a UUID no
    driver lists."""
    torch = pytest.importorskip("torch")
    from memtop.agent.torch_probe import TorchProbe

    class Props:
        uuid = mig_uuid(0, 1)[4:]
        name = f"{A100} MIG 3g.40gb"
        total_memory = 40 * GiB
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x18, 0

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda index: True, raising=False)
    (device,) = TorchProbe().devices()
    assert device.uuid == Props.uuid


def test_uuids_compare_without_their_prefix() -> None:
    from memtop.model import bare_uuid

    assert bare_uuid("GPU-AB12") == bare_uuid("ab12") == bare_uuid("MIG-ab12") == "ab12"
    assert bare_uuid("MIG-GPU-ab12/1/0") == "ab12/1/0"  # the old form of a MIG device's
    assert bare_uuid(None) == ""


def test_a_recording_keeps_the_mig_instances() -> None:
    """A recorded MIG box replays as it was (the reader took `mig` for a wrong type and
    dropped the whole reading)."""
    import dataclasses

    from memtop.sources.recording import decode_reading

    reading = _mig_reading()
    assert decode_reading(json.loads(json.dumps(dataclasses.asdict(reading)))) == reading


@needs_root
def test_the_agent_finds_its_mig_instance_for_an_oom_report(library: Path, as_root: Box) -> None:
    """The agent's OOM report reads the driver's per-process split by the UUID torch gave, bare
    (NVML wants it prefixed: `MIG-` for an instance)."""
    code = (
        "import json, sys\n"
        "from memtop.agent.driver_usage import read_driver_usage\n"
        "print(json.dumps(read_driver_usage(sys.argv[1])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, mig_uuid(0, 3)[4:]],
        env=as_root.environment(library),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    usage = json.loads(done.stdout)
    assert usage is not None and usage["processes"] == {str(as_root.pids["B"]): 4 * GiB}


def test_a_profile_the_name_does_not_say_comes_from_the_attributes(
    library: Path, tmp_path: Path
) -> None:
    """nvmlDeviceGetAttributes (slices and memory) names the profile where the device's name
    does not end with it; a GPU not in MIG mode has no instance and lists its processes."""
    state = State(
        gpus=[Gpu(), Gpu(name="NVIDIA H100 80GB HBM3")],
        migs=[Mig(0, 5, total=20 * GiB, used=GiB, name="NVIDIA A100-SXM4-80GB")],
        processes=[(1, 4242, 3 * GiB)],
    ).write(tmp_path / "state")
    code = (
        "import json\n"
        "from memtop.sources.nvml import NvmlSource\n"
        "reading = NvmlSource().read()\n"
        "print(json.dumps([[d.uuid, d.mig and d.mig.as_dict(), d.mig_mode,\n"
        "  [p.pid for p in d.processes], d.error] for d in reading.devices]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env(library, state),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [
        [gpu_uuid(0), None, True, [], None],
        [
            mig_uuid(0, 5),
            {
                "parent_index": 0,
                "gpu_instance_id": 5,
                "compute_instance_id": 0,
                "profile": "1g.20gb",
            },
            False,
            [],
            None,
        ],
        [gpu_uuid(1), None, False, [4242], None],
    ]


def test_estimate_fits_this_machines_mig_instances_not_their_gpu(
    library: Path, tmp_path: Path
) -> None:
    """`memtop estimate` on a MIG box weighs the instances a trainer can get, not the GPU in
    MIG mode that runs nothing itself (it listed the whole 80 GiB GPU as a target)."""
    state = State(
        gpus=[Gpu(used=30 * GiB)],
        migs=[
            Mig(0, 1, total=40 * GiB, used=2 * GiB, profile="3g.40gb"),
            Mig(0, 2, total=20 * GiB, used=GiB, profile="2g.20gb"),
        ],
    ).write(tmp_path / "state")
    done = subprocess.run(
        [sys.executable, "-m", "memtop", "estimate", "--preset", "llama-7b", "--json"],
        env=env(library, state, {**os.environ, "MEMTOP_SOCKET_DIR": str(tmp_path / "none")}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    targets = json.loads(done.stdout)["targets"]
    assert [t["total_bytes"] for t in targets] == [40 * GiB, 20 * GiB]
