"""`memtop export`: the observation as Prometheus metrics.

`metrics` renders one `Observation` as metric families (a renderer, like `memtop.present.report`:
no I/O,
no store queries); `server` runs the sampler, publishes one observation per round and serves
`/metrics` over HTTP(S) with optional basic auth.

May import: `memtop.engine` (the observation and the feed; `export.metrics` renders an observation
and queries no store), `memtop.diagnosis`, `memtop.figures`, `memtop.model`, `memtop.base`.
Imported by the commands.
"""
