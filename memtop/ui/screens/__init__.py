"""The screens the apps push (detail, GPU, help, questions).

May import: the rest of `memtop.ui` (view, widgets, actions) and what `memtop.ui` may.
"""
