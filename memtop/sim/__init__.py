"""Simulated backend: caching allocator, devices, probe, scenarios and trainer process.

May import: `memtop.agent` (the simulated trainers run a real agent), `memtop.protocol`,
`memtop.figures`, `memtop.model`, `memtop.base`. The viewer's sources load it only for the demo (a
contract).
"""
