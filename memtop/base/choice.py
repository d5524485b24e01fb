"""Choice: a closed set of words (a str enum), the base of every one memtop names.

A leaf, so that what needs only the words (the simulator's scenario names, which each simulated
trainer and the CLI's parser read at start) does not import memtop.model's records with them;
memtop.model re-exports it.
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A closed set of words (a str enum): its members compare, hash and serialise (JSON, the
    wire, recordings) as the plain strings they stand for, and print as them too.  `StrEnum`
    would do, but memtop runs on Python 3.10."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
