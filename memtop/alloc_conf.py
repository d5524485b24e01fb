"""The caching allocator's options (`PYTORCH_CUDA_ALLOC_CONF` and its siblings) as torch reads
them: one reader for the simulator, the suggestions and the OOM diagnosis.

torch is the reference (c10/core/AllocatorConfig.h's ConfigTokenizer and parseArgs,
c10/cuda/CUDAAllocatorConfig.cpp, torch 2.9 and later; the older CUDA-only parser agreed on
every point below):

- `,` `:` `[` `]` are tokens of their own and whitespace is dropped anywhere, so
  " expandable_segments : True " is expandable_segments:True, and a list value
  (`roundup_power2_divisions:[256:1,>:4]`) holds commas of its own;
- keys and values are case sensitive: a boolean is `True` or `False`, nothing else
  (`expandable_segments:true` or `:1` raises ValueError "Expected 'True' or 'False'" at the
  trainer's first allocation), and `EXPANDABLE_SEGMENTS` is no key torch knows (a CUDA build
  refuses it: "Unrecognized key");
- `backend` is `native` or `cudaMallocAsync` (ROCm builds take `hipMallocAsync` too);
- a key given twice: the last one counts.

Old readers here disagreed: the suggestions took `expandable_segments:1` and `:true` for on,
the OOM diagnosis `:true` but not `:1` (and ignored a later `:False`), the simulator `true` but
not `1`.  Nothing here imports the rest of memtop: the simulator, the viewer and the OOM
reader all use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ASYNC_BACKENDS = ("cudaMallocAsync", "hipMallocAsync")  # they replace the caching allocator
_SEPARATORS = ",:[]"


def tokenize(conf: str) -> list[str]:
    """torch's ConfigTokenizer: separators are tokens of their own, whitespace goes."""
    tokens: list[str] = []
    word: list[str] = []
    for ch in conf:
        if ch in _SEPARATORS:
            if word:
                tokens.append("".join(word))
                word = []
            tokens.append(ch)
        elif not ch.isspace():
            word.append(ch)
    if word:
        tokens.append("".join(word))
    return tokens


def boolean(value: str) -> bool | None:
    """A boolean option's value as torch takes it: `True` or `False`; None for anything else
    (torch refuses it)."""
    return {"True": True, "False": False}.get(value)


def options(conf: str) -> dict[str, str]:
    """`key:value,key:[a:b,c:d]` as {key: value}, in the order given, a list value as its text
    ("[a:b,c:d]"); the last value of a key given twice counts.  A piece torch could not read
    (a key without `:` and a value) is passed over, not refused: memtop reads what a running
    trainer has, it does not judge it."""
    tokens = tokenize(conf or "")
    found: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in _SEPARATORS:  # a stray separator
            i += 1
            continue
        if tokens[i + 1 : i + 2] != [":"] or i + 2 >= len(tokens) or tokens[i + 2] in ",:]":
            i = _past_next_comma(tokens, i)
            continue
        i += 2
        if tokens[i] == "[":
            start = i
            while i < len(tokens) and tokens[i] != "]":
                i += 1
            found[key] = "".join(tokens[start : i + 1])
        else:
            found[key] = tokens[i]
        i = _past_next_comma(tokens, i + 1)  # past the `,` (or whatever torch would refuse)
    return found


def _past_next_comma(tokens: list[str], i: int) -> int:
    """The index after the next `,` outside brackets from `i` (or the end)."""
    depth = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "[":
            depth += 1
        elif token == "]":
            depth = max(0, depth - 1)
        elif token == "," and depth == 0:
            break
    return i


@dataclass(frozen=True)
class AllocConf:
    """One trainer's allocator options, as torch reads them."""

    text: str
    options: Mapping[str, str]

    @property
    def expandable_segments(self) -> bool:
        """Whether torch grows expandable segments: only `expandable_segments:True` does."""
        return boolean(self.options.get("expandable_segments", "False")) is True

    @property
    def async_backend(self) -> bool:
        """cudaMallocAsync (hipMallocAsync) replaces the caching allocator: its segment options
        do not apply."""
        return self.options.get("backend") in ASYNC_BACKENDS


def parse(conf: str | None) -> AllocConf:
    """A trainer's `PYTORCH_*ALLOC_CONF` text as torch reads it (never raises)."""
    text = conf or ""
    return AllocConf(text, options(text))
