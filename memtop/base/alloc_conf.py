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

from collections.abc import Callable, Mapping

from memtop.base.records import record

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


@record(frozen=True)
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


# --------------------------------------------------------------------------------------------
# Changing the options of a running trainer (`memtop tune`, DESIGN §13).
#
# torch's setter (torch._C._accelerator_setAllocatorSettings) parses the string it is given as a
# whole and resets every key the string leaves out, so a change is always the whole string in
# force with the changed keys replaced: `with_options`.  Only the keys torch honours in a
# running process, and whose values memtop can check before the trainer sees them, are tunable.

# torch's kLargeBuffer (20 MiB): max_split_size_mb must exceed it ("CachingAllocator option
# max_split_size_mb too small, must be > 20").
MAX_SPLIT_SIZE_MIN_MB = 20


def _tune_boolean(value: str) -> str | None:
    return value if boolean(value) is not None else None


def _tune_threshold(value: str) -> str | None:
    # torch: "garbage_collect_threshold too small/big, set it 0.0~1.0", both ends excluded.
    try:
        number = float(value)
    except ValueError:
        return None
    return value if 0.0 < number < 1.0 else None


def _tune_split(value: str) -> str | None:
    if not value.isdigit():
        return None
    return str(int(value)) if int(value) > MAX_SPLIT_SIZE_MIN_MB else None


# key → (its check: the value as torch takes it, None when torch would refuse it; the values,
# in words)
TUNABLE: Mapping[str, tuple[Callable[[str], str | None], str]] = {
    "expandable_segments": (_tune_boolean, "True or False"),
    "garbage_collection_threshold": (_tune_threshold, "a number between 0 and 1 (exclusive)"),
    "max_split_size_mb": (_tune_split, f"a whole number of MiB above {MAX_SPLIT_SIZE_MIN_MB}"),
}


class BadSetting(ValueError):
    """A key memtop does not change in a running trainer, or a value torch would refuse; the
    message is one line for the user."""


def checked_setting(key: str, value: object) -> str:
    """`value` of tunable `key` as torch's parser takes it (a Python bool becomes True/False);
    BadSetting otherwise."""
    if key not in TUNABLE:
        raise BadSetting(
            f"{key!r} cannot be changed in a running trainer (only {', '.join(TUNABLE)})"
        )
    check, words = TUNABLE[key]
    text = str(value) if isinstance(value, bool | int | float) else value
    found = check(text.strip()) if isinstance(text, str) else None
    if found is None:
        raise BadSetting(f"{key} takes {words}, not {value!r}")
    return found


def format_options(found: Mapping[str, str]) -> str:
    """{key: value} back into the `key:value,key:value` form torch parses (list values keep
    their brackets)."""
    return ",".join(f"{key}:{value}" for key, value in found.items())


def with_options(conf: str | None, changes: Mapping[str, str]) -> str:
    """The whole option string `conf` with `changes` set (each key replaced where it was, added
    at the end otherwise): what to hand torch's setter so the user's other keys survive."""
    found = options(conf or "")
    found.update(changes)
    return format_options(found)


# ROCm: torch's ROCm builds grow expandable segments only from torch 2.11 (pytorch#177974, the
# reland of #173330), gated on the HIP version; 2.11's gate (TORCH_HIP_VERSION < 702) also shut
# out HIP 7.0 and 7.1 (pytorch#179930).  An older build warns "expandable_segments not supported
# on this platform" and ignores the option: memtop refuses rather than report a change that
# did not happen.  Conservative: torch >= 2.11 and HIP >= 7.2.
ROCM_EXPANDABLE_MIN_TORCH = (2, 11)
ROCM_EXPANDABLE_MIN_HIP = (7, 2)


def _version(text: str | None) -> tuple[int, int] | None:
    parts = (text or "").split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def rocm_expandable_refusal(torch_version: str | None, hip_version: str | None) -> str | None:
    """Why a ROCm build of torch would ignore expandable_segments:True (None: it honours them,
    or this is no ROCm build)."""
    if not hip_version:
        return None
    torch_at = _version(torch_version)
    hip_at = _version(hip_version)
    if (
        torch_at is None
        or hip_at is None
        or torch_at < ROCM_EXPANDABLE_MIN_TORCH
        or hip_at < ROCM_EXPANDABLE_MIN_HIP
    ):
        return (
            f"this ROCm build (torch {torch_version or '?'}, HIP {hip_version}) has no expandable "
            "segments (they need torch >= 2.11 on HIP >= 7.2): torch would ignore the change"
        )
    return None
