"""A trainer that prints the agent's raw replies, for tests/test_probe_wire.py.

`python probe_wire_trainer.py sim|torch SOCKET_DIR`: starts the agent the way a trainer does
(`memtop.start_agent()`: the simulated probe, or the default lazy torch probe over a CPU torch),
steps on its own (main) thread, and from a second thread asks hello, sample, breakdown and
reset_peak over a raw AF_UNIX socket, printing each reply frame's bytes as one line of JSON text.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time

kind, socket_dir = sys.argv[1], sys.argv[2]
os.environ["MEMTOP_SOCKET_DIR"] = socket_dir

import memtop  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30

if kind == "sim":
    from memtop.agent.probe import Breakdown, ProbeDevice
    from memtop.sim.allocator import SimulatedCachingAllocator
    from memtop.sim.device import LocalDeviceMemory
    from memtop.sim.probe import SimulatedGpu, SimulatedProbe

    allocator = SimulatedCachingAllocator(LocalDeviceMemory(8 * GiB), 0)
    device = ProbeDevice(
        0, "GPU-00000000-0000-0000-0000-0000000000d1", "Sim GPU", 8 * GiB, "0000:17:00.0"
    )
    held = [allocator.malloc(n * MiB) for n in (3, 5, 40, 7)]
    allocator.free(held.pop(1))

    def parts() -> dict[int, Breakdown]:
        return {0: Breakdown(4 * MiB, 4 * MiB, 8 * MiB, allocator.memory_allocated())}

    probe = SimulatedProbe(
        [SimulatedGpu(device, allocator)], allocator_conf="max_split_size_mb:128", breakdown=parts
    )
    agent = memtop.start_agent(probe=probe, argv=["train.py"])

    def step() -> None:
        memtop.step()

else:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    agent = memtop.start_agent(argv=["train.py"])

    def step() -> None:
        loss = model(torch.ones(4, 8)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


assert agent is not None
replies: list[bytes] = []


def ask() -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(str(agent.path))

    def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    for number, (cmd, args) in enumerate(
        [
            ("hello", {}),
            ("sample", {}),
            ("breakdown", {"wait_s": 10.0}),
            ("reset_peak", {}),
            ("sample", {"max_marks": 2}),
        ]
    ):
        body = json.dumps({"id": number + 1, "cmd": cmd, "args": args}).encode()
        sock.sendall(struct.pack(">I", len(body)) + body)
        (size,) = struct.unpack(">I", read(4))
        replies.append(read(size))
        time.sleep(0.3)  # a few steps between requests
    sock.close()


asker = threading.Thread(target=ask)
for _ in range(5):
    step()
asker.start()
while asker.is_alive():
    step()
    time.sleep(0.01)
for raw in replies:
    print(raw.decode())
memtop.agent.stop_agent()
