"""The widgets the screens are made of (tables, charts, the suggestions pane).

May import: `memtop.ui.view`, `memtop.ui.render` and what `memtop.ui` may; no screen.
"""
