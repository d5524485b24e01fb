"""The Textual apps (live and replay), their screens and widgets, the view-model (`ui.view`: from
an observation to rows and lines) and the key table (`ui.actions`).

May import: `memtop.engine.feed` and the observation (never the store, a source or the sampler:
contracts), `memtop.diagnosis`, `memtop.figures`, `memtop.model`, `memtop.base`; no I/O of its
own (a contract names the two exceptions). Imported by the commands.
"""
