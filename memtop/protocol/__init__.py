"""The agent socket protocol (DESIGN §6), in its parts:

- memtop.protocol.commands: the closed command set, one record per command;
- memtop.protocol.framing: frames (4-byte big-endian length + one UTF-8 JSON object), the request
  envelope, error codes;
- memtop.protocol.schema: each command's reply as the viewer reads it, typed (memtop.model);
- memtop.protocol.replies: each command's reply as the agent builds it;
- memtop.protocol.places: the socket directory, pids, peer credentials, connecting;
- memtop.protocol.discovery: which users' socket directories root reads;
- memtop.protocol.text: a peer's text made inert (the device sources import only this);
- memtop.protocol.namespaces, nesting: pid namespaces in socket names, the nesting scan.

Both sides use them, so a third-party agent (a JAX one, a test double) only has to match what is
written there.  Nothing here imports torch or touches the GPU.  This package re-exports every
public name, so `protocol.parse_reply`, `protocol.socket_dir`... keep working; new code imports
the part it needs.

May import: `memtop.model`, `memtop.figures`, `memtop.base`; the parts the agent loads are standard
library only (a contract).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memtop.protocol import namespaces, nesting
from memtop.protocol.discovery import Discovery, SocketDirs
from memtop.protocol.framing import (
    E_BAD_FRAME,
    E_BAD_REQUEST,
    E_FAILED,
    E_FRAME_TOO_LARGE,
    E_RATE_LIMITED,
    E_UNAVAILABLE,
    E_UNKNOWN_COMMAND,
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ConnectionClosed,
    FrameDecoder,
    ProtocolError,
    Request,
    check_depth,
    decode_body,
    encode_frame,
    parse_request,
    recv_message,
    send_message,
)
from memtop.protocol.places import (
    PeerRefused,
    UnsafeSocketDir,
    check_peer,
    check_socket_dir,
    check_socket_entry,
    connect,
    connect_agent,
    connect_agent_process,
    describe_connect_error,
    discover,
    discovery_dirs,
    ensure_private_dir,
    ensure_socket_dir,
    list_agent_sockets,
    oom_dir,
    peer_allowed,
    peer_credentials,
    pid_alive,
    pid_exists,
    pid_owner,
    socket_dir,
    socket_path,
    socket_pid,
    state_dir,
    unmapped_here,
    user_name,
)
from memtop.protocol.procfs import process_start_ticks
from memtop.protocol.replies import SAMPLE_STAT_KEYS, error_reply, mark_columns
from memtop.protocol.text import (
    MAX_TEXT,
    canonical_pci_bus_id,
    clean_text,
    clean_value,
    decimal,
    pci_bus_id_of,
)

if TYPE_CHECKING:
    from memtop.protocol.schema import (
        MAX_ARGV,
        MAX_DEVICES,
        MAX_MARKS,
        MAX_SITES,
        MAX_STATS,
        REPLY_PARSERS,
        parse_breakdown,
        parse_cleanup,
        parse_hello,
        parse_reply,
        parse_reset_peak,
        parse_sample,
        parse_sites,
        parse_snapshot,
        parse_tune,
    )

    COMMANDS: frozenset[str]

# The viewer's parsers (memtop.protocol.schema, and memtop.model under it) load on first use:
# the agent imports this package's standard-library parts inside the trainer and must not pay
# for, or carry, the viewer's side (the import contracts see only explicit imports).
_SCHEMA_NAMES = frozenset(
    (
        "MAX_ARGV",
        "MAX_DEVICES",
        "MAX_MARKS",
        "MAX_SITES",
        "MAX_STATS",
        "REPLY_PARSERS",
        "parse_breakdown",
        "parse_cleanup",
        "parse_hello",
        "parse_reply",
        "parse_reset_peak",
        "parse_sample",
        "parse_sites",
        "parse_snapshot",
        "parse_tune",
    )
)


def __getattr__(name: str) -> Any:
    if name == "COMMANDS":
        # The commands the viewer speaks: one per reply parser (the agent serves its own
        # table, memtop.agent.handlers.HANDLERS; a test keeps the two the same).
        from memtop.protocol.schema import REPLY_PARSERS

        value: Any = frozenset(REPLY_PARSERS)
    elif name in _SCHEMA_NAMES:
        from memtop.protocol import schema

        value = getattr(schema, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "COMMANDS",
    "E_BAD_FRAME",
    "E_BAD_REQUEST",
    "E_FAILED",
    "E_FRAME_TOO_LARGE",
    "E_RATE_LIMITED",
    "E_UNAVAILABLE",
    "E_UNKNOWN_COMMAND",
    "MAX_ARGV",
    "MAX_DEPTH",
    "MAX_DEVICES",
    "MAX_FRAME_BYTES",
    "MAX_MARKS",
    "MAX_SITES",
    "MAX_STATS",
    "MAX_TEXT",
    "PROTOCOL_VERSION",
    "REPLY_PARSERS",
    "SAMPLE_STAT_KEYS",
    "ConnectionClosed",
    "Discovery",
    "FrameDecoder",
    "PeerRefused",
    "ProtocolError",
    "Request",
    "SocketDirs",
    "UnsafeSocketDir",
    "canonical_pci_bus_id",
    "check_depth",
    "check_peer",
    "check_socket_dir",
    "check_socket_entry",
    "clean_text",
    "clean_value",
    "connect",
    "connect_agent",
    "connect_agent_process",
    "decimal",
    "decode_body",
    "describe_connect_error",
    "discover",
    "discovery_dirs",
    "encode_frame",
    "ensure_private_dir",
    "ensure_socket_dir",
    "error_reply",
    "list_agent_sockets",
    "mark_columns",
    "namespaces",
    "nesting",
    "oom_dir",
    "parse_breakdown",
    "parse_cleanup",
    "parse_hello",
    "parse_reply",
    "parse_request",
    "parse_reset_peak",
    "parse_sample",
    "parse_sites",
    "parse_snapshot",
    "parse_tune",
    "pci_bus_id_of",
    "peer_allowed",
    "peer_credentials",
    "pid_alive",
    "pid_exists",
    "pid_owner",
    "process_start_ticks",
    "recv_message",
    "send_message",
    "socket_dir",
    "socket_path",
    "socket_pid",
    "state_dir",
    "unmapped_here",
    "user_name",
]
