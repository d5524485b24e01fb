"""The figures' names and arithmetic: what each figure is called, and how it is counted.

`metric_table` is the table of every per-device (agent) and per-GPU (driver) figure: its field,
its name in `--once --json`, its Prometheus family and help; the report, the exporter and the
fleet's reader all read it, so a new figure is one row.  `units` formats and parses bytes and
rates; `segments` is the allocator's segment arithmetic (stranded bytes, largest free block);
`median` is memtop's one median (statistics.median's value, without importing statistics).

Imports nothing of memtop outside this package (`segments` reads `units`): everything may import
it, the agent inside a trainer too.
"""
