"""What the memtop process reads: the driver (NVML) and the agents inside trainers."""
