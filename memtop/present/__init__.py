"""The presenters beside the TUI and the exporter: what memtop writes for a person or a tool.

`report` builds `--once`'s text and JSON from an observation; `html_report` and `fleet_report`
write the self-contained pages of `memtop report` and the fleet; `compare` judges two runs
against their own noise; `alerts` runs `--on-alert`'s command once per episode.

May import: `memtop.engine` (observation and feeds only, never the sampler's I/O for a frame),
`memtop.diagnosis`, `memtop.figures`, `memtop.model`, `memtop.base`.  Imported by the commands.
"""
