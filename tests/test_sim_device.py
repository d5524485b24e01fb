"""Simulated devices: the local device, the cross-process ledger and the GPU registry."""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtop.sim.allocator import SimulatedCachingAllocator, SimulatedOutOfMemoryError
from memtop.sim.device import (
    DeviceMemory,
    LocalDeviceMemory,
    SharedDeviceMemory,
    SimGpuRegistry,
    SimGpuSpec,
    pid_alive,
    read_ledger,
    simulated_gpu_specs,
)

MiB = 1024 * 1024
GiB = 1024 * MiB
REPO = Path(__file__).resolve().parent.parent

# A process that takes memory on a shared ledger, says so, and holds it until stdin closes.
HOLDER = """
import sys
from pathlib import Path
from memtop.sim.device import SharedDeviceMemory
ledger, total, overhead, chunk, tries = sys.argv[1:6]
m = SharedDeviceMemory(Path(ledger), int(total), overhead_bytes=int(overhead))
got = sum(m.try_reserve(int(chunk)) for _ in range(int(tries)))
print(got, flush=True)
sys.stdin.read()
"""


def spawn_holder(
    ledger: Path, total: int, overhead: int, chunk: int, tries: int = 1
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            str(ledger),
            str(total),
            str(overhead),
            str(chunk),
            str(tries),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid)
    return proc.pid


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """Another process holding 30 MiB (+2 MiB overhead) of a 100 MiB shared device."""
    ledger = tmp_path / "gpu0.ledger.json"
    proc = spawn_holder(ledger, 100 * MiB, 2 * MiB, 30 * MiB)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "1"
    yield ledger, proc
    if proc.poll() is None:
        finish(proc)


# --------------------------------------------------------------------------------------------
# LocalDeviceMemory


def test_local_device_accounts_reservations_and_overhead() -> None:
    dev = LocalDeviceMemory(100 * MiB, overhead_bytes=10 * MiB)
    assert isinstance(dev, DeviceMemory)
    assert dev.free_bytes() == 90 * MiB
    assert dev.try_reserve(60 * MiB)
    assert not dev.try_reserve(31 * MiB)  # 30 MiB left
    assert dev.try_reserve(30 * MiB)
    assert dev.free_bytes() == 0
    dev.release(60 * MiB)
    assert dev.free_bytes() == 60 * MiB
    assert dev.usage_by_pid() == {os.getpid(): 40 * MiB}
    with pytest.raises(ValueError):
        dev.release(31 * MiB)
    with pytest.raises(ValueError):
        dev.try_reserve(-1)
    with pytest.raises(ValueError):
        LocalDeviceMemory(0)


# --------------------------------------------------------------------------------------------
# SharedDeviceMemory


def test_two_processes_see_each_others_usage(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    ledger, proc = holder
    mine = SharedDeviceMemory(ledger, 100 * MiB, overhead_bytes=4 * MiB)
    assert mine.pid == os.getpid()
    assert mine.free_bytes() == 100 * MiB - 32 * MiB - 4 * MiB
    assert mine.usage_by_pid() == {proc.pid: 32 * MiB, os.getpid(): 4 * MiB}
    assert not mine.try_reserve(65 * MiB)
    assert mine.try_reserve(64 * MiB)
    assert mine.free_bytes() == 0
    assert read_ledger(ledger) == {proc.pid: 32 * MiB, os.getpid(): 68 * MiB}
    mine.release(64 * MiB)
    assert read_ledger(ledger)[os.getpid()] == 4 * MiB
    mine.close()
    assert read_ledger(ledger) == {proc.pid: 32 * MiB}
    # When the other process is gone, its memory is free again, as the driver would free it.
    finish(proc)
    other = SharedDeviceMemory(ledger, 100 * MiB, pid=os.getppid())
    assert other.free_bytes() == 100 * MiB
    assert other.usage_by_pid() == {os.getppid(): 0}


def test_dead_pids_are_ignored_and_pruned(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.json"
    gone = dead_pid()
    ledger.write_text(json.dumps({str(gone): 90 * MiB, "not-a-pid": 5, str(os.getppid()): "x"}))
    assert read_ledger(ledger) == {}
    assert read_ledger(ledger, live_only=False) == {gone: 90 * MiB}
    dev = SharedDeviceMemory(ledger, 100 * MiB)
    assert dev.free_bytes() == 100 * MiB
    assert dev.try_reserve(95 * MiB)
    on_disk = json.loads(ledger.read_text())
    assert on_disk == {str(os.getpid()): 95 * MiB}


def test_zombies_count_as_dead() -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pid_alive(pid)  # exited but not yet reaped
    finally:
        os.waitpid(pid, 0)
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    assert not pid_alive(-5)


def test_corrupt_or_missing_ledger_reads_as_empty(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.json"
    assert read_ledger(ledger) == {}
    assert read_ledger(tmp_path / "missing-dir" / "ledger.json") == {}
    ledger.write_bytes(b"\x00\xff{garbage")
    assert read_ledger(ledger) == {}
    ledger.write_text("[1, 2]")
    assert read_ledger(ledger) == {}
    dev = SharedDeviceMemory(ledger, 10 * MiB, overhead_bytes=1 * MiB)
    assert dev.free_bytes() == 9 * MiB
    assert read_ledger(ledger) == {os.getpid(): 1 * MiB}


def test_concurrent_processes_never_overcommit_the_device(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.json"
    procs = [spawn_holder(ledger, 100 * MiB, 0, 1 * MiB, tries=60) for _ in range(4)]
    try:
        got = []
        for p in procs:
            assert p.stdout is not None
            got.append(int(p.stdout.readline()))
        # 240 attempts for 100 slots: the flock makes every slot go exactly once.
        assert sum(got) == 100
        assert sum(read_ledger(ledger).values()) == 100 * MiB
        assert set(read_ledger(ledger)) == {p.pid for p in procs}
    finally:
        for p in procs:
            finish(p)
    assert read_ledger(ledger) == {}


def test_allocator_on_a_shared_device_names_the_other_processes_in_its_oom(
    holder: tuple[Path, subprocess.Popen[str]],
) -> None:
    ledger, proc = holder
    dev = SharedDeviceMemory(ledger, 100 * MiB, overhead_bytes=4 * MiB)
    a = SimulatedCachingAllocator(dev, device_index=0)
    a.malloc(40 * MiB)
    free, total = a.mem_get_info()
    assert (free, total) == (24 * MiB, 100 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        a.malloc(30 * MiB)
    msg = str(info.value)
    assert "GPU 0 has a total capacity of 100.00 MiB of which 24.00 MiB is free. " in msg
    assert f"Process {proc.pid} has 32.00 MiB memory in use. " in msg
    assert "Including non-PyTorch memory, this process has 44.00 MiB memory in use. " in msg
    assert a.memory_stats()["num_ooms"] == 1
    # Once the other process exits, the same request fits.
    finish(proc)
    a.malloc(30 * MiB)
    assert a.memory_reserved() == 70 * MiB
    assert read_ledger(ledger) == {os.getpid(): 74 * MiB}


# --------------------------------------------------------------------------------------------
# Registry


def test_simulated_gpu_specs_have_deterministic_nvml_style_uuids() -> None:
    specs = simulated_gpu_specs(4, seed="demo")
    assert [s.index for s in specs] == [0, 1, 2, 3]
    assert all(s.total_bytes == 80 * GiB for s in specs)
    assert all(s.name == "Simulated H100 80GB HBM3" for s in specs)
    pattern = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    assert all(pattern.match(s.uuid) for s in specs)
    assert len({s.uuid for s in specs}) == 4
    assert simulated_gpu_specs(4, seed="demo") == specs
    assert simulated_gpu_specs(4, seed="other")[0].uuid != specs[0].uuid
    assert simulated_gpu_specs(0) == []


def test_registry_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "sim" / "gpus"
    reg = SimGpuRegistry(root)
    assert reg.gpus() == []
    specs = simulated_gpu_specs(2, total_bytes=16 * GiB, name="Sim A100", seed="t")
    reg.create(specs)
    assert reg.gpus() == specs
    assert SimGpuRegistry(root).gpus() == specs  # another process's view
    assert reg.ledger_path(0).exists() and reg.ledger_path(1).exists()
    assert reg.usage_by_pid(1) == {}
    mem = reg.memory(1, overhead_bytes=500 * MiB)
    assert mem.total_bytes == 16 * GiB
    assert mem.try_reserve(1 * GiB)
    assert reg.usage_by_pid(1) == {os.getpid(): 1 * GiB + 500 * MiB}
    assert reg.usage_by_pid(0) == {}
    assert reg.usage_by_pid(7) == {}
    # Re-creating the registry keeps what live processes hold.
    reg.create(specs)
    assert reg.usage_by_pid(1) == {os.getpid(): 1 * GiB + 500 * MiB}
    with pytest.raises(KeyError):
        reg.memory(5)
    with pytest.raises(ValueError):
        reg.create([specs[0], specs[0]])


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00",
        b"[]",
        b'{"gpus": 3}',
        b'{"gpus": [{"index": "0", "uuid": "GPU-x", "name": "n", "total_bytes": 1}]}',
        b'{"gpus": [{"index": 0, "uuid": "GPU-x", "name": "n"}]}',
        b'{"gpus": [{"index": 0, "uuid": "GPU-x", "name": "n", "total_bytes": -1}]}',
        b'{"gpus": [{"index": 0, "uuid": "a", "name": "n", "total_bytes": 1},'
        b' {"index": 0, "uuid": "b", "name": "n", "total_bytes": 1}]}',
    ],
)
def test_registry_tolerates_a_corrupt_gpus_json(tmp_path: Path, content: bytes) -> None:
    reg = SimGpuRegistry(tmp_path)
    reg.gpus_path.write_bytes(content)
    assert reg.gpus() == []


def test_registry_file_format(tmp_path: Path) -> None:
    reg = SimGpuRegistry(tmp_path)
    reg.create([SimGpuSpec(index=3, uuid="GPU-abc", name="X", total_bytes=123)])
    doc = json.loads(reg.gpus_path.read_text())
    assert doc["gpus"] == [{"index": 3, "uuid": "GPU-abc", "name": "X", "total_bytes": 123}]
    # No temporary files are left behind by the atomic writes.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [
        "gpu3.ledger.json",
        "gpus.json",
    ]


def test_demo_log_is_private_and_a_planted_symlink_is_not_followed(
    socket_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memtop.sim.demo import Demo

    monkeypatch.setenv("MEMTOP_SOCKET_DIR", str(socket_dir))  # the state directory too
    target = tmp_path / "victim"
    target.write_text("keep\n")
    (socket_dir / "demo").mkdir(mode=0o700)
    log = socket_dir / "demo" / f"demo-{os.getpid()}.log"
    log.symlink_to(target)
    with Demo(1, "healthy", 0.05, socket_dir=socket_dir, log_messages=True) as demo:
        assert demo.wait_ready()  # the demo runs on without its log
    assert target.read_text() == "keep\n"
    assert "messages are lost" in str(demo.log_summary())
    # A real log: 0600, and removed when the trainers said nothing.
    log.unlink()
    with Demo(1, "healthy", 0.05, socket_dir=socket_dir, log_messages=True) as demo:
        assert demo.wait_ready()
        assert demo.log == log and stat.S_IMODE(log.stat().st_mode) == 0o600
    assert demo.log_summary() is None and not log.exists()


def test_a_trainers_model_and_optimizer_state_are_published_in_one_write_each(
    tmp_path: Path,
) -> None:
    # Each publish is a lock, a read, a temporary file and a rename (~0.3 ms of CPU): a model's
    # ~100 segments and its Adam state's ~200 were ~0.13 CPU-s of every simulated trainer's
    # start, one write per segment.  Now one write each, and the ledger says the same after.
    from memtop.sim.scenarios import Workload, model_for

    ledger = tmp_path / "ledger.json"
    memory = SharedDeviceMemory(ledger, 80 * GiB)
    allocator = SimulatedCachingAllocator(memory)
    seen = [os.stat(ledger).st_ino]  # every publish renames a new file over the ledger

    def reserve_and_note(nbytes: int, reserve=memory.try_reserve) -> bool:
        done = reserve(nbytes)
        seen.append(os.stat(ledger).st_ino)
        return done

    def writes() -> int:
        return sum(a != b for a, b in itertools.pairwise(seen))

    memory.try_reserve = reserve_and_note  # type: ignore[method-assign]
    workload = Workload("healthy", allocator, model_for("healthy", 80 * GiB), seed=0)
    assert len(allocator.memory_snapshot()) >= 97  # a segment per large parameter
    assert writes() == 0, f"the ledger was rewritten {writes()} times while the model was built"
    assert read_ledger(ledger) == {os.getpid(): allocator.memory_reserved()}
    assert os.stat(ledger).st_ino != seen[0]  # published once, at the end
    with memory.batch():
        assert memory.try_reserve(GiB)
        # Not published yet (a locked read here would wait for the batch: flock is per open).
        assert read_ledger(ledger, locked=False)[os.getpid()] == memory.used_bytes - GiB
        memory.release(GiB)
    seen[:] = [os.stat(ledger).st_ino]
    workload.step()  # the first step creates the optimizer state: two segments a parameter
    segments = len(allocator.memory_snapshot())
    assert segments > 300 and writes() < segments - 190, (segments, writes())
    assert read_ledger(ledger) == {os.getpid(): allocator.memory_reserved()}
    memory.close()
    assert read_ledger(ledger) == {}


def test_a_steps_new_segments_are_published_a_layer_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trainer's first step reserves ~200 segments (its activations and gradients): a ledger
    # write each was ~45 ms of CPU of every simulated trainer's start on this ext4 box, and an
    # OOM's retry released the cache a write a segment.  Now one write a layer, made before
    # the trainer may pause: at every pause the ledger says what the allocator holds, as
    # before, and a steady step (nothing reserved or released) takes no lock and writes nothing.
    from memtop.sim import device
    from memtop.sim.scenarios import Workload, model_for

    ledger = tmp_path / "ledger.json"
    overhead = 518 * MiB
    memory = SharedDeviceMemory(ledger, 80 * GiB, overhead_bytes=overhead)
    allocator = SimulatedCachingAllocator(memory)
    writes: list[str] = []
    locks: list[bool] = []
    write, flocked = device._write_atomically, device._flocked
    monkeypatch.setattr(device, "_write_atomically", lambda p, t: writes.append(t) or write(p, t))
    monkeypatch.setattr(
        device,
        "_flocked",
        lambda path, exclusive: locks.append(exclusive) or flocked(path, exclusive),
    )
    at_pauses: list[tuple[int, int]] = []

    def pause() -> None:
        seen = read_ledger(ledger, locked=False)[os.getpid()]
        at_pauses.append((seen, allocator.memory_reserved() + overhead))

    shape = model_for("healthy", 80 * GiB)
    workload = Workload("healthy", allocator, shape, seed=0, pace=pause)
    before = len(allocator.memory_snapshot())
    writes.clear()
    workload.step()
    new_segments = len(allocator.memory_snapshot()) - before
    assert new_segments > 150, new_segments
    # The old simulator: a write per new segment (199 here).
    assert len(writes) <= 2 * shape.layers + 1, (len(writes), new_segments)
    assert len(at_pauses) == 2 * shape.layers
    assert all(seen == held for seen, held in at_pauses), at_pauses
    assert read_ledger(ledger) == {os.getpid(): allocator.memory_reserved() + overhead}
    workload.step()
    workload.step()  # the cache has what a step asks from here on
    writes.clear()
    locks.clear()
    at_pauses.clear()
    for _ in range(3):
        workload.step()
    assert (writes, locks) == ([], [])
    assert all(seen == held for seen, held in at_pauses) and len(at_pauses) == 6 * shape.layers
    # The trainer's cadence (a pause every 4th layer): a write a pause, the ledger as the
    # allocator says at each.
    fresh = SharedDeviceMemory(tmp_path / "fresh.json", 80 * GiB, overhead_bytes=overhead)
    steady_allocator, allocator = allocator, SimulatedCachingAllocator(fresh)  # pause() reads these
    ledger = fresh.ledger_path
    trainer = Workload("healthy", allocator, shape, seed=0, pace=pause, layers_per_pause=4)
    writes.clear()
    at_pauses.clear()
    trainer.step()
    assert len(at_pauses) == 2 * shape.layers // 4 and len(writes) <= len(at_pauses) + 1
    assert all(seen == held for seen, held in at_pauses), at_pauses
    fresh.close()
    allocator, ledger = steady_allocator, memory.ledger_path
    # empty_cache (the agent's action, at a step boundary): its cudaFrees in one write.
    writes.clear()
    cached = len(allocator.memory_snapshot())
    assert allocator.empty_cache() > 0 and len(allocator.memory_snapshot()) < cached - 50
    assert len(writes) == 1, len(writes)  # the old simulator: a write per segment released
    assert read_ledger(ledger) == {os.getpid(): allocator.memory_reserved() + overhead}
    workload.step()  # and the cache is made again
    # The lock is taken at a batch's first reserve or release and let go at its publish: another
    # process reserves in between (here: another object of the ledger, which would wait forever
    # on a lock the batch kept).
    other = SharedDeviceMemory(ledger, 80 * GiB, pid=os.getppid())  # a live process
    with memory.batch():
        assert memory.try_reserve(GiB)
        memory.publish_batch()
        assert other.try_reserve(GiB)
        assert memory.try_reserve(GiB)
    assert read_ledger(ledger, live_only=False) == {
        os.getpid(): allocator.memory_reserved() + overhead + 2 * GiB,
        os.getppid(): GiB,
    }


def test_a_ledger_write_never_follows_a_planted_symlink_and_outlives_a_killed_writer(
    tmp_path: Path,
) -> None:
    import threading

    from memtop.sim import device

    ledger = tmp_path / "gpu0.ledger.json"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    temporary = tmp_path / f".{ledger.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    temporary.symlink_to(victim)  # a writer's temporary name, planted
    device._write_atomically(ledger, '{"1": 2}')
    assert victim.read_text() == "keep" and not temporary.exists()
    assert json.loads(ledger.read_text()) == {"1": 2}
    temporary.write_text("half a led")  # what a writer killed mid-write leaves
    device._write_atomically(ledger, '{"1": 3}')
    assert json.loads(ledger.read_text()) == {"1": 3} and not temporary.exists()
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600  # as mkstemp made it


def test_the_viewer_parses_a_ledger_again_only_when_its_bytes_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The demo's stand-in for NVML reads every GPU's ledger every second; a steady demo's
    # ledgers change a few times a minute.  The same bytes are the same ledger: parsed once.
    # What the reading says stays what the ledger and the processes say, read by read.
    from memtop.sim import device
    from memtop.sim.devices_view import SimulatedDeviceSource

    registry = SimGpuRegistry(tmp_path / f"sim-{os.getpid()}")
    registry.create(simulated_gpu_specs(2, total_bytes=16 * GiB, seed="t"))
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    registry.ledger_path(0).write_text(json.dumps({str(os.getpid()): GiB, str(other.pid): 2 * GiB}))
    registry.ledger_path(1).write_text(json.dumps({str(other.pid): 3 * GiB}))
    parsed: list[bytes | str] = []
    parse = device._parse_ledger
    monkeypatch.setattr(device, "_parse_ledger", lambda text: parsed.append(text) or parse(text))
    source = SimulatedDeviceSource(tmp_path)

    def usage() -> list[dict[int, int]]:
        return [{p.pid: p.used_bytes for p in d.processes} for d in source.read().devices]

    try:
        assert usage() == [{os.getpid(): GiB, other.pid: 2 * GiB}, {other.pid: 3 * GiB}]
        assert len(parsed) == 2
        for _ in range(3):
            assert usage() == [{os.getpid(): GiB, other.pid: 2 * GiB}, {other.pid: 3 * GiB}]
        assert len(parsed) == 2  # the old reader: 8 parses
        # A ledger written anew (another size, or the same size): read as it is now.
        registry.ledger_path(1).write_text(json.dumps({str(other.pid): 4 * GiB}))
        assert usage() == [{os.getpid(): GiB, other.pid: 2 * GiB}, {other.pid: 4 * GiB}]
        registry.ledger_path(1).write_text(json.dumps({str(other.pid): 5 * GiB}))
        assert usage() == [{os.getpid(): GiB, other.pid: 2 * GiB}, {other.pid: 5 * GiB}]
        assert len(parsed) == 4
        # A process that died leaves its entry in unchanged bytes: gone from the reading at once,
        # as NVML lists no dead process.
        other.kill()
        other.wait()
        assert usage() == [{os.getpid(): GiB}, {}]
        assert len(parsed) == 4
        # A ledger that disappears reads as empty, as before.
        registry.ledger_path(0).unlink()
        assert usage() == [{}, {}]
    finally:
        other.kill()
        other.wait()


def test_a_simulated_trainer_starts_without_memtops_records() -> None:
    """Each simulated trainer (hundreds a suite run, eight a demo) reads the scenario names at
    start: they are a Choice from memtop.base, not a reason to import memtop.model's ~80 records
    (~30 ms of CPU a start on this 2-core box, most of what the trainer's imports cost)."""
    probe = (
        "import memtop.sim.scenario_names as n; from memtop.model import Choice; "
        "assert issubclass(n.Scenario, Choice) and f'{n.Scenario.LEAK}' == 'leak'"
    )
    # The trainer's imports alone; then the scenarios are still memtop.model's Choice.
    before = "import sys, memtop.sim.trainer; print('memtop.model' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", before], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "memtop.sim.trainer imports memtop.model"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_empty_cache_from_another_thread_waits_for_a_steps_batch_without_deadlock(
    tmp_path: Path,
) -> None:
    # A trainer's step is one batch (the allocator's lock taken by each malloc inside it);
    # empty_cache from another thread (an agent's action run off the trainer's thread) takes
    # the batch before the allocator's lock, so it waits for the step and never crosses it.
    import threading

    from memtop.sim.scenarios import Workload, model_for

    memory = SharedDeviceMemory(tmp_path / "ledger.json", 80 * GiB)
    allocator = SimulatedCachingAllocator(memory)
    in_step = threading.Event()
    emptied = threading.Event()

    def pace() -> None:
        if not in_step.is_set():
            in_step.set()
            time.sleep(0.2)  # the other thread asks now, mid-step
            assert not emptied.is_set()  # it waits for the step's batch

    workload = Workload("healthy", allocator, model_for("healthy", 80 * GiB), pace=pace)
    worker = threading.Thread(
        target=lambda: (in_step.wait(), allocator.empty_cache(), emptied.set())
    )
    worker.start()
    workload.step()
    worker.join(timeout=10)
    assert emptied.is_set() and not worker.is_alive()
    assert read_ledger(memory.ledger_path) == {os.getpid(): allocator.memory_reserved()}
    memory.close()
