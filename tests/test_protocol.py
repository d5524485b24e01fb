"""Framing, schema checks and the socket directory rules of the agent protocol."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys

import pytest

from memtop import protocol


def test_frame_round_trip_over_a_socket_pair():
    a, b = socket.socketpair()
    with a, b:
        protocol.send_message(a, {"id": 1, "cmd": "hello", "text": "héllo"})
        assert protocol.recv_message(b) == {"id": 1, "cmd": "hello", "text": "héllo"}


def test_frame_is_length_prefixed_big_endian_json():
    frame = protocol.encode_frame({"id": 7, "cmd": "sample"})
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert json.loads(frame[4:]) == {"id": 7, "cmd": "sample"}


def test_decoder_reassembles_frames_split_at_every_byte():
    frames = protocol.encode_frame({"id": 1, "cmd": "a"}) + protocol.encode_frame({"id": 2})
    decoder = protocol.FrameDecoder()
    messages = []
    for i in range(len(frames)):
        messages.extend(decoder.feed(frames[i : i + 1]))
    assert messages == [{"id": 1, "cmd": "a"}, {"id": 2}]
    assert decoder.pending_bytes == 0


def test_decoder_refuses_oversize_frame_before_reading_it():
    decoder = protocol.FrameDecoder()
    with pytest.raises(protocol.ProtocolError) as info:
        list(decoder.feed(struct.pack(">I", protocol.MAX_FRAME_BYTES + 1)))
    assert info.value.code == protocol.E_FRAME_TOO_LARGE


def test_encoder_refuses_oversize_message():
    with pytest.raises(protocol.ProtocolError):
        protocol.encode_frame({"blob": "x" * (protocol.MAX_FRAME_BYTES + 1)})


@pytest.mark.parametrize("body", [b"\xff\xfe", b"not json", b"[1, 2]", b'"a string"', b"", b"NaN"])
def test_decoder_rejects_bodies_that_are_not_json_objects(body):
    decoder = protocol.FrameDecoder()
    with pytest.raises(protocol.ProtocolError) as info:
        list(decoder.feed(struct.pack(">I", len(body)) + body))
    assert info.value.code == protocol.E_BAD_FRAME


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"cmd": "hello"}, protocol.E_BAD_REQUEST),
        ({"id": True, "cmd": "hello"}, protocol.E_BAD_REQUEST),
        ({"id": 1.5, "cmd": "hello"}, protocol.E_BAD_REQUEST),
        ({"id": 1}, protocol.E_BAD_REQUEST),
        ({"id": 1, "cmd": 3}, protocol.E_BAD_REQUEST),
        ({"id": 1, "cmd": "exec"}, protocol.E_UNKNOWN_COMMAND),
        ({"id": 1, "cmd": "__import__"}, protocol.E_UNKNOWN_COMMAND),
        ({"id": 1, "cmd": "sample", "args": [1]}, protocol.E_BAD_REQUEST),
    ],
)
def test_bad_requests_are_named(message, code):
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.parse_request(message, protocol.COMMANDS)
    assert info.value.code == code


def test_good_request_parses():
    request = protocol.parse_request(
        {"id": "a", "cmd": "snapshot", "args": {"path": "/x"}}, protocol.COMMANDS
    )
    assert (request.id, request.cmd, dict(request.args)) == ("a", "snapshot", {"path": "/x"})


HELLO = {
    "protocol": 1,
    "pid": 42,
    "argv": ["train.py", "--lr", "3e-4"],
    "python": "3.11.7",
    "torch": "2.13.0",
    "allocator_conf": "expandable_segments:True",
    "devices": [{"index": 0, "uuid": "GPU-abc", "name": "H100", "total_bytes": 80 << 30}],
    "rank": 3,
}


def test_hello_schema_parses_and_keeps_extra_fields():
    hello = protocol.parse_hello(HELLO)
    assert hello.pid == 42 and hello.devices[0].uuid == "GPU-abc"
    assert hello.extra == {"rank": 3}


@pytest.mark.parametrize(
    "field", ["protocol", "pid", "argv", "python", "allocator_conf", "devices"]
)
def test_hello_missing_required_field_is_refused(field):
    broken = {k: v for k, v in HELLO.items() if k != field}
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_hello(broken)


def test_hello_device_of_wrong_type_is_refused():
    broken = dict(HELLO, devices=[{"index": "0", "uuid": "x", "name": "y", "total_bytes": 1}])
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_hello(broken)


def test_sample_schema_parses_marks_and_metrics():
    stats = {
        "allocated_bytes.all.current": 300,
        "reserved_bytes.all.current": 1000,
        "reserved_bytes.large_pool.current": 800,
        "inactive_split_bytes.large_pool.current": 200,
        "num_alloc_retries": 2,
    }
    sample = protocol.parse_sample(
        {
            "time": 1.5,
            "step": 10,
            "devices": [{"index": 0, "stats": stats, "free_bytes": 5, "total_bytes": 10}],
            "step_marks": [{"step": 10, "time": 1.0, "allocated_bytes": {"0": 300}}],
        }
    )
    device = sample.devices[0]
    assert (device.allocated, device.reserved, device.cached) == (300, 1000, 700)
    assert device.fragmentation == pytest.approx(0.25)
    assert device.num_alloc_retries == 2
    assert sample.step_marks[0].allocated == {0: 300}


def test_mark_columns_carry_the_same_marks_as_rows():
    rows = [
        {"step": 1, "time": 1.0, "allocated_bytes": {"0": 10}, "peak_bytes": {"0": 12}},
        {"step": 2, "time": 2.5, "allocated_bytes": {"0": 11, "1": 7}, "peak_bytes": {"0": 12}},
        {"step": 3, "time": 3, "allocated_bytes": {}},
    ]
    columns = protocol.mark_columns(rows)
    assert columns["step"] == [1, 2, 3] and columns["allocated_bytes"]["1"] == [None, 7, None]
    # Through JSON, as on the wire.
    wire = json.loads(json.dumps({"step_mark_columns": columns}))
    base = {"time": 4.0, "step": 3, "devices": [], "step_marks": []}
    by_columns = protocol.parse_sample({**base, **wire}).step_marks
    by_rows = protocol.parse_sample({**base, "step_marks": rows}).step_marks
    assert by_columns == by_rows
    assert [m.allocated for m in by_columns] == [{0: 10}, {0: 11, 1: 7}, {}]
    # No marks (a trainer between steps, or one that never steps): still a readable reply.
    empty = json.loads(json.dumps({"step_mark_columns": protocol.mark_columns([])}))
    assert protocol.parse_sample({**base, **empty}).step_marks == ()


def _kept_bytes(make):  # type: ignore[no-untyped-def]
    """What `make()`'s result holds in memory (tracemalloc), with the result."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = make()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, result
    finally:
        tracemalloc.stop()


def test_a_first_samples_thousand_marks_are_kept_compact():
    # A first sample carries up to 1024 marks per agent, all the agents' held at once in the
    # dashboard's first round: a record, a mapping and numbers of its own for each was ~300
    # bytes a mark (3.3 MB for 11 agents), ~130 bytes with the mappings shared; as columns of
    # machine numbers (model.StepMarks) 8 bytes a figure.
    rows = [
        {
            "step": n,
            "time": 1000.0 + n / 8,
            "allocated_bytes": {"0": 15_478_137_856 + (2**20 if n >= 1000 else 0)},
            "host_rss_bytes": 30_273_536,
            "host_heap_free_bytes": 612_336 if n % 8 == 0 else None,
        }
        for n in range(1024)
    ]
    wire = json.dumps({"step_mark_columns": protocol.mark_columns(rows)})
    base = {"time": 2000.0, "step": 1024, "devices": [], "step_marks": []}
    protocol.parse_sample({**base, **json.loads(wire)})  # (what a first parse imports)
    kept, sample = _kept_bytes(lambda: protocol.parse_sample({**base, **json.loads(wire)}))
    marks = sample.step_marks
    assert marks == protocol.parse_sample({**base, "step_marks": rows}).step_marks
    assert marks[999].allocated == {0: 15478137856} and marks[1000].allocated[0] == 15479186432
    assert (marks[0].host_heap_free, marks[1].host_heap_free) == (612_336, None)
    # 412 KB with a mapping and numbers for each, 132 KB with the mappings shared; 5 columns
    # of 1024 numbers are 40 KB.
    assert kept < 48 * 1024, kept


@pytest.mark.parametrize(
    "columns",
    [
        [],
        {"step": [1, 2], "time": [1.0], "allocated_bytes": {}},  # lengths differ
        {"step": [1], "time": [True], "allocated_bytes": {}},
        {"step": [1], "time": [1.0], "allocated_bytes": {}, "host_rss_bytes": [-1]},
        {"step": [1], "time": [1.0], "allocated_bytes": {}, "host_heap_free_bytes": [True]},
        {"step": [1], "time": [1.0], "allocated_bytes": {"0": [1, 2]}},
        {"step": [1], "time": [float("nan")], "allocated_bytes": {}},
        {"step": [True], "time": [1.0], "allocated_bytes": {}},
        {"step": [1], "time": [1.0], "allocated_bytes": {"x": [1]}},
        {"step": [1], "time": [1.0], "allocated_bytes": {"0": [-5]}},
        {"step": [1], "time": [1.0], "allocated_bytes": {"0": ["5"]}},
        {"step": [1], "time": [1.0], "allocated_bytes": {"0": [5.0]}},
        {"step": [1, 2], "time": [1.0, 2.0], "allocated_bytes": {"0": [None, -1]}},
        # Beyond int64 (the columns' numbers): no step or byte count is; an agent saying so
        # lies, as one saying -5 does.
        {"step": [1], "time": [1.0], "allocated_bytes": {"0": [2**63]}},
        {"step": [2**63], "time": [1.0], "allocated_bytes": {}},
        {"step": [1], "time": [1e400], "allocated_bytes": {}},
        {"step": [1], "time": [None], "allocated_bytes": {}},
        {"step": [1] * 9000, "time": [1.0] * 9000, "allocated_bytes": {}},  # over MAX_MARKS
        {"time": [1.0], "allocated_bytes": {}},
    ],
)
def test_bad_mark_columns_are_refused(columns):
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_sample({"time": 1.0, "step": 1, "devices": [], "step_mark_columns": columns})


def test_a_samples_stats_are_its_finite_numbers_by_clean_names():
    from memtop.protocol import schema

    stats = {
        "allocated_bytes.all.current": 5,
        "reserved_bytes.all.current": 7.9,
        "num_ooms": True,  # not a number here
        "name\x1b[2J": 3,  # a name is cleaned before any terminal sees it
        "huge": 10**400,  # beyond a double (and int64): no count is (it raised OverflowError)
        "large": 2**62,
        "text": "12",
        "nothing": None,
        "infinite": float("inf"),
    }
    device = {"index": 0, "stats": stats, "free_bytes": 1, "total_bytes": 2}
    for _ in range(2):  # the second time from the names already cleaned
        sample = protocol.parse_sample({"time": 1.0, "step": None, "devices": [device]})
        assert sample.devices[0].stats == {
            "allocated_bytes.all.current": 5,
            "reserved_bytes.all.current": 7,
            "name?[2J": 3,
            "large": 2**62,
        }
    # An agent minting new names every second never grows the names kept past their bound.
    for n in range(3):
        minted = {f"stat{n}.{i}": i for i in range(1000)}
        device = {"index": 0, "stats": minted, "free_bytes": 1, "total_bytes": 2}
        protocol.parse_sample({"time": 1.0, "step": None, "devices": [device] * 4})
    assert len(schema._STAT_NAMES) <= schema._STAT_NAMES_KEPT


def test_sample_with_bool_step_is_refused():
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_sample({"time": 1.0, "step": True, "devices": []})


# ------------------------------------------------------------------------- socket directory


def test_socket_dir_is_created_private(tmp_path):
    directory = protocol.ensure_socket_dir(tmp_path / "memtop")
    assert os.stat(directory).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o720])
def test_group_or_world_writable_socket_dir_is_refused(tmp_path, mode):
    directory = tmp_path / "memtop"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(protocol.UnsafeSocketDir, match="writable"):
        protocol.ensure_socket_dir(directory)


def test_symlinked_socket_dir_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "memtop"
    link.symlink_to(real)
    with pytest.raises(protocol.UnsafeSocketDir, match="symlink"):
        protocol.ensure_socket_dir(link)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_socket_dir_owned_by_another_user_is_refused(tmp_path):
    directory = tmp_path / "memtop"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(protocol.UnsafeSocketDir, match="owned by uid 65534"):
        protocol.ensure_socket_dir(directory)


def test_socket_dir_prefers_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMTOP_SOCKET_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert protocol.socket_dir() == tmp_path / "memtop"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert protocol.socket_dir().name == f"memtop-{os.getuid()}"


def test_stale_sockets_of_dead_pids_are_removed(tmp_path):
    directory = protocol.ensure_socket_dir(tmp_path / "memtop")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(dead.stdout)
    (directory / f"{dead_pid}.sock").touch()
    (directory / f"{os.getpid()}.sock").touch()
    (directory / "notes.txt").touch()
    assert protocol.list_agent_sockets(directory) == [os.getpid()]
    assert not (directory / f"{dead_pid}.sock").exists()
    assert (directory / "notes.txt").exists()


def test_connect_errors_are_one_line(tmp_path):
    directory = protocol.ensure_socket_dir(tmp_path / "memtop")
    with pytest.raises(OSError) as info:
        protocol.connect(999999, directory)
    message = protocol.describe_connect_error(999999, info.value)
    assert "999999" in message and "\n" not in message


def test_every_command_has_one_agent_handler_and_one_viewer_parser():
    from memtop.agent.handlers import HANDLERS

    assert set(HANDLERS) == set(protocol.COMMANDS) == set(protocol.REPLY_PARSERS)


def test_what_the_reply_builders_write_the_schema_reads():
    from memtop.protocol import replies

    device = replies.hello_device(
        index=0, uuid="GPU-1", name="H100", total_bytes=80 << 30, pci_bus_id="0000:3b:00.0"
    )
    hello = protocol.parse_hello(
        replies.hello_result(
            pid=42,
            argv=["train.py"],
            python="3.11.9",
            torch="2.13.0",
            allocator_conf="",
            devices=[device],
            hip=None,
            agent_version="0.1",
            started=1.0,
            step=None,
            cwd="/",
            agent_thread_id=None,
            rank=None,
            local_rank=None,
            world_size=None,
            scheduler=None,
            rendezvous=None,
        )
    )
    assert (hello.pid, hello.devices[0].pci_bus_id) == (42, "0000:3b:00.0")
    marks = [{"step": 1, "time": 2.0, "allocated_bytes": {"0": 10}}]
    for columns in (False, True):
        sample = protocol.parse_sample(
            json.loads(
                json.dumps(
                    replies.sample_result(
                        time=3.0,
                        step=1,
                        devices=[
                            replies.sample_device(
                                index=0,
                                uuid="GPU-1",
                                name="H100",
                                stats={"allocated_bytes.all.current": 10},
                                free_bytes=5,
                                total_bytes=20,
                                free_measured_at=None,
                            )
                        ],
                        step_marks=marks,
                        columns=columns,
                        last_step_time=2.0,
                        phase=None,
                        phase_since=None,
                        oom=None,
                        agent=replies.agent_costs(
                            boundary_costs={},
                            connections=1,
                            refused_requests=0,
                            agent_cpu_s=None,
                            governed_s=0.0,
                        ),
                    )
                )
            )
        )
        assert [(m.step, m.allocated) for m in sample.step_marks] == [(1, {0: 10})]
        assert sample.devices[0].free_bytes == 5
    cleanup = protocol.parse_cleanup(
        replies.cleanup_result(
            before={0: 30},
            after={0: 10},
            gc_collected=3,
            after_step=7,
            thread="MainThread",
            thread_ident=1,
            took_s=0.1,
        )
    )
    assert (cleanup.released_bytes, cleanup.after_step, cleanup.at_step_boundary) == (
        {0: 20},
        7,
        True,
    )
    breakdown = protocol.parse_breakdown(
        replies.breakdown_result(
            time=1.0, step=2, measured="after_step", took_s=0.01, devices={0: {"parameters": 8}}
        )
    )
    assert breakdown.devices == {0: {"parameters": 8}} and not breakdown.pending
    assert protocol.parse_breakdown(replies.breakdown_pending()).pending
    assert protocol.parse_snapshot(replies.snapshot_summary_pending()).pending
    written = protocol.parse_snapshot(
        replies.snapshot_file_result(path="/runs/s.pickle", size=9, devices={"0": {"segments": 1}})
    )
    assert (written.path, written.bytes, written.devices) == (
        "/runs/s.pickle",
        9,
        {0: {"segments": 1}},
    )
    assert protocol.parse_reset_peak(replies.reset_peak_result([0, 1])).devices == (0, 1)


def test_the_agent_and_the_protocol_parts_it_loads_are_standard_library_only():
    # The agent runs inside the trainer: whatever it imports, the trainer pays for (and a
    # third-party module there could clash with the trainer's own).
    code = (
        "import sys\n"
        "import memtop.agent.server\n"
        "names = {k.split('.')[0] for k in sys.modules if not k.startswith('_')}\n"
        "print(sorted(names - set(sys.stdlib_module_names) - {'memtop'}))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(protocol.__file__))))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_agent_loads_no_viewer_side_of_the_protocol():
    """Inside the trainer the agent imports the protocol's standard-library parts; the package's
    re-exports of the viewer's parsers load on first use, not with it (issue 22.5)."""
    import subprocess
    import sys

    code = (
        "import sys, memtop.agent.server, memtop.agent.handlers, memtop.agent.oom, "
        "memtop.agent.sites; from memtop import protocol; "
        "print(sorted(m for m in ('memtop.protocol.schema', 'memtop.model') if m in sys.modules)); "
        "protocol.parse_reply; print('memtop.protocol.schema' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True"]


def test_a_string_past_max_text_is_found_wherever_it_starts():
    # inert_json looks for a quote in each aligned block of (MAX_TEXT + 1) // 2 bytes, which a
    # run of MAX_TEXT + 1 bytes holds wherever it starts: every start over two blocks, for a
    # string of MAX_TEXT characters (clean) and one more (cut).  Blocks of 2050 bytes (planted)
    # miss the long string at start 2035.
    from memtop.protocol.text import MAX_TEXT, inert_json

    for start in range(MAX_TEXT + 1):  # the first string, of `start` characters, is clean
        for more in (0, 1):
            body = b'{"p": "' + b"y" * start + b'", "a": "' + b"x" * (MAX_TEXT + more) + b'"}'
            assert inert_json(body) is (more == 0), (start, more)


@pytest.mark.parametrize(
    "body, inert",
    [
        (b'{"id": 3, "result": {"name": "H100", "argv": ["train.py", "--lr=1e-3"]}}', True),
        (b'{"a": "\\u001b[2J"}', False),  # an escape may spell any character: a control
        (b'{"a": "x\\ny"}', False),
        (b'{"a": "\\u202eevil"}', False),  # a bidi override
        (b'{"a": "\\ud83d\\ude00"}', False),  # surrogates: walked (a pair, or a lone one)
        (b'{"a": "\\udc80"}', False),
        # Escapes of printable characters spell clean text: an OOM report's advice (`→`),
        # a quote, a backslash (and what follows it is text: not an escape)
        (b'{"advice": "move one job \\u2192 stop it", "caf\\u00e9": 1}', True),
        (b'{"a": "x\\"y", "b": "\\\\u001b", "c": "\\/"}', True),
        ('{"a": "café"}'.encode(), False),  # not ASCII
        (b'{"a": "del\x7f"}', False),  # a raw control byte
        (b'{"a": "' + b"x" * 5000 + b'"}', False),  # a string past MAX_TEXT is cut
        (b'{"a": "\\u2192' + b"x" * 5000 + b'"}', False),
        # Past MAX_TEXT bytes in all, every string within it (an agent with eight GPUs)
        (b'{"a": [' + b",".join([b'"' + b"x" * 100 + b'"'] * 60) + b"]}", True),
        # Numbers past MAX_TEXT bytes without a quote: walked, as a string that long would be
        (b'{"a": [' + b",".join([b"1"] * 3000) + b'], "b": "x"}', False),
    ],
)
def test_a_frame_that_needs_no_cleaning_is_known_by_its_bytes(body, inert):
    from memtop.protocol.text import clean_value, inert_json

    assert inert_json(body) is inert
    if inert:
        message = json.loads(body)
        assert clean_value(message) is message
    # The decoder hands each frame's bytes over with it, as each is yielded.
    decoder = protocol.FrameDecoder()
    plain = b'{"id": 1}'
    frames = b"".join(len(b).to_bytes(4, "big") + b for b in (plain, body, plain))
    seen = [(message, inert_json(decoder.last_body)) for message in decoder.feed(frames)]
    assert [flag for _, flag in seen] == [True, inert, True]
