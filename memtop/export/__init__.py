"""`memtop export`: the observation as Prometheus metrics.

`metrics` renders one `Observation` as metric families (a renderer, like `memtop.report`: no I/O,
no store queries); `server` runs the sampler, publishes one observation per round and serves
`/metrics` over HTTP(S) with optional basic auth.
"""
