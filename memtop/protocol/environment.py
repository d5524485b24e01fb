"""The few variables of a trainer's environment that cross the wire (`hello`'s
`engine_environment`) or that the viewer reads from /proc/PID/environ: standard library only,
loaded by the agent and by the process reader alike."""

from __future__ import annotations

# The environment variables that set how much of a GPU an inference engine or JAX takes at
# start (memtop.diagnosis.workload reads them): an agent sends these, and only these, of its
# process's environment in `hello` (`engine_environment`), and the viewer reads the same names
# from /proc/PID/environ of a process without an agent where it may.  Nothing else of an
# environment is kept: it holds tokens and passwords.
ENGINE_ENVIRONMENT: tuple[str, ...] = (
    "XLA_PYTHON_CLIENT_MEM_FRACTION",  # JAX: the share preallocated (default 0.75)
    "XLA_CLIENT_MEM_FRACTION",  # JAX's newer name for it
    "XLA_PYTHON_CLIENT_PREALLOCATE",  # JAX: "false" turns preallocation off
    "XLA_PYTHON_CLIENT_ALLOCATOR",  # JAX: "platform" allocates on demand
    "CUDA_MEMORY_FRACTION",  # TGI's shards: --cuda-memory-fraction, as the launcher passes it
)
