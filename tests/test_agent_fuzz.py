"""Thousands of random and malformed frames against the agent of a stepping trainer process.

The agent must answer or hang up, never die, and the trainer must keep stepping throughout.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from memtop import protocol
from memtop.agent import server as agent_server
from memtop.sim.demo import Demo
from memtop.sources.agents import AgentClient, AgentError, AgentUnreachable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="mtf-"))
    directory.chmod(0o700)
    # 2 500 connections in a row are a client that churns: the agent's governor would refuse
    # most of them (issue 27) and each would be sent again; this trainer lets them all in.
    # It steps at the demo's pace (0.1 s): its steps are the fuzzing's background and only
    # need to go on; at 0.02 s they were most of the module's CPU (~13 of ~22 CPU-s).
    demo = Demo(
        gpus=1,
        scenario="healthy",
        step_time=0.1,
        socket_dir=directory,
        extra_env={"MEMTOP_AGENT_TEST_LIMITS": "connect_exempt_burst=1e9"},
    )
    demo.start()
    assert demo.wait_ready(30)
    yield demo.processes[0].pid, directory
    demo.stop()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)

requests = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(
            st.integers(), st.text(max_size=5), st.none(), st.booleans(), st.lists(st.integers())
        ),
        "cmd": st.one_of(
            st.sampled_from(["hello", "sample", "breakdown", "reset_peak", "cleanup", "nope"]),
            st.text(max_size=10),
            st.integers(),
        ),
        "args": st.one_of(
            st.dictionaries(st.text(max_size=5), json_values, max_size=3), json_values
        ),
    },
)


def framed(message: object) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body


payloads = st.one_of(
    requests.map(framed),
    json_values.map(framed),
    st.binary(max_size=64),  # raw garbage, including headers of absurd lengths
    st.binary(min_size=1, max_size=40).map(lambda b: struct.pack(">I", len(b)) + b),
    st.integers(min_value=0, max_value=2**32 - 1).map(lambda n: struct.pack(">I", n)),
    requests.map(lambda m: framed(m)[: max(1, len(framed(m)) // 2)]),  # truncated
)


# How long one frame may take to be served: the governor refuses a churning client for at most
# twice its longest pause, and a loaded box is slow; past this the agent is not serving.
SERVED_WITHIN_S = 2 * agent_server.GOVERN_MAX_PAUSE_S + 24


def exchange(path: Path, payload: bytes) -> bool:
    """Send `payload` on a fresh connection and read until the agent hangs up: whether it was
    served.  Thousands of connections in a row are a client that churns: the agent's governor
    refuses some of them (issue 27) or accepts them late; those are sent again, so every
    payload reaches it."""
    deadline = time.monotonic() + SERVED_WITHIN_S
    while not _delivered(path, payload):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _delivered(path: Path, payload: bytes) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    received = b""
    try:
        sock.connect(str(path))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return False  # not accepted in time: the agent was not accepting
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        sock.close()
    return b"opens connections faster" not in received


# The frames are drawn 25 to an example, distinct within it: hypothesis's engine costs ~4 ms of
# CPU an example besides the draws, so 2 500 examples of one frame were ~10 CPU-s for ~2 300
# distinct frames; 120 examples of 25 are ~4 CPU-s for ~2 400 distinct frames of the same kinds
# (each of `payloads`' branches, and each command name, hundreds or dozens of times; measured
# with a classifier over the drawn frames).  A frame sent already is not sent again: the same
# bytes on a fresh connection prove nothing new, and each is a round trip through a loaded box.
SENT: set[bytes] = set()
# The frames sent before the first one not served (the culprit is among them); once one was
# not, every frame is sent, so that hypothesis replaying the failing batch sees it fail again.
LAST: deque[bytes] = deque(maxlen=5)
FAILED = [False]


@pytest.mark.timeout(600)
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    # No shrinking: a frame that hurt the agent leaves the module's trainer hurt, and every
    # smaller batch tried would fail on that alone; LAST names the frames instead.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(batch=st.lists(payloads, min_size=25, max_size=25, unique=True))
def test_random_frames_never_hurt_the_agent_or_the_trainer(trainer, batch):
    pid, directory = trainer
    for payload in batch:
        if payload in SENT and not FAILED[0]:
            continue
        SENT.add(payload)
        try:
            served = exchange(protocol.socket_path(pid, directory), payload)
        except OSError:  # refused, or its socket gone: the agent or the trainer died
            FAILED[0] = True
            raise
        if not served:
            FAILED[0] = True
            raise AssertionError(
                f"not served within {SERVED_WITHIN_S:.0f} s: {payload!r}, after {list(LAST)!r}"
            )
        LAST.append(payload)


def test_after_the_fuzzing_the_agent_serves_and_the_trainer_steps(trainer):
    pid, directory = trainer
    with AgentClient(pid, directory, timeout=5) as client:
        # 2 500 connections in a row are a client that churns: the agent refuses this uid's new
        # connections until its governor's pause is over (issue 27), then serves again.
        deadline = time.monotonic() + 2 * agent_server.GOVERN_MAX_PAUSE_S + 5
        while True:
            try:
                client.connect()
                break
            except (AgentError, AgentUnreachable):
                if time.monotonic() > deadline:
                    raise
                client.close()
                time.sleep(0.2)
        first = client.sample()
        # The trainer steps every 0.1 s; on a box running two suites it can be starved for a
        # while, so wait (bounded) for a step rather than judge one half-second.
        moved_by = time.monotonic() + 15
        while True:
            time.sleep(0.5)
            second = client.sample()
            if (second.step or 0) > (first.step or 0) or time.monotonic() > moved_by:
                break
    assert first.step is not None and second.step is not None
    assert second.step > first.step
    assert second.devices[0].allocated > 0
