"""What the memtop process reads: the driver (NVML) and the agents inside trainers.

May import: `memtop.sim` (the demo's stand-in for NVML only), `memtop.agent`'s launcher,
`memtop.protocol`, `memtop.oom`, `memtop.figures`, `memtop.model`, `memtop.base`. Imported by the
engine's sampler and the commands.
"""
