"""What the dashboard's start leaves out of the process (issue 35: the dashboard's RSS beside
nvitop's).

glibc gives each thread that allocates an arena of its own (up to 8 per core), and memory freed
in one is not reused by another: the sampler, the device reader, the agents' workers, the
action pool and Textual's input thread each kept their own part-empty arena, ~3 MB in all.
Their Python work is serialised by the GIL anyway, so `one_malloc_arena` asks glibc for one
arena before those threads start.

Textual runs on asyncio, and asyncio imports `ssl` for its TLS transports: OpenSSL's libraries,
~4 MB of resident memory and ~10 ms of the start, for connections the dashboard's event loop
never opens (the agents' sockets are the sampler's, plain AF_UNIX; a Prometheus URL is read with
urllib on the feed's thread).  `import_asyncio_without_tls` imports asyncio with `ssl` out of
reach, so asyncio takes the path it has for a Python built without it; `ssl` itself stays
importable afterwards for whatever asks for it (urllib, http.client: their TLS is unchanged).
"""

from __future__ import annotations

import ctypes
import importlib
import sys

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def import_asyncio_without_tls() -> bool:
    """Import asyncio without its TLS support, unless asyncio or ssl is imported already (then
    nothing changes); whether it was imported so."""
    if "asyncio" in sys.modules or "ssl" in sys.modules:
        return False
    sys.modules["ssl"] = None  # type: ignore[assignment]  # `import ssl` raises ImportError
    try:
        importlib.import_module("asyncio")
    finally:
        if "ssl" in sys.modules and sys.modules["ssl"] is None:
            del sys.modules["ssl"]
    return True


def one_malloc_arena() -> bool:
    """One malloc arena for every thread of this process, where the C library is glibc (with
    another, nothing changes); whether it took.  Call before the threads start."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_ARENA_MAX, 1))
