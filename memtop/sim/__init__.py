"""Simulated backend: caching allocator, devices, probe, scenarios and trainer process."""
