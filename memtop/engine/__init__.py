"""The engine: one round from the sources to an observation, and the feeds that replay it.

Holds the sampler (the one thread that does a round's I/O: device sources, the agent pool, the
process directory), the store (one generation per round, the per-process histories), the
observation (one immutable snapshot a round: figures joined with their diagnosis), the `Feed`
protocol the apps see (`feed`), the replay feed (`playback`), the filters (`scope`), the fleet's
reader (`fleet`) and its grouping of ranks into jobs (`job_groups`), and the one action that
starts an agent inside a running process (`attach`, gdb or `sys.remote_exec`).

May import: `memtop.diagnosis`, `memtop.sources`, `memtop.protocol`, `memtop.figures`,
`memtop.model`, `memtop.base`.  The store, the observation, the feed, the scope and the job groups
load no transport (a contract): records come from `memtop.model` only.  Imported by the
presenters (`memtop.ui`, `memtop.present`, `memtop.export`) and the commands.
"""
