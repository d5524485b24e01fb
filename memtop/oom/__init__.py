"""`memtop oom`: the OOM reports agents left on this machine, newest first, each with a
diagnosis.  reports.py reads them (the only I/O), diagnose.py explains one (pure), render.py
prints.

May import: `memtop.protocol`, `memtop.figures`, `memtop.model`, `memtop.base`. Imported by the
agent (it writes reports) and the viewer (it reads them).
"""
