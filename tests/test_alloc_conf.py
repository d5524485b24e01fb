"""One reader of the allocator's options (memtop.base.alloc_conf), answering as torch does.

Before it, the suggestions, the OOM diagnosis and the simulator each parsed the text their own
way and disagreed on the spellings below.  torch's answer (c10/core/AllocatorConfig.h's
ConfigTokenizer::toBool takes `True` or `False` only; keys are case sensitive; whitespace is
dropped; the last of a repeated key counts) is checked against torch itself where it is
installed.
"""

from __future__ import annotations

import pytest

from memtop.base import alloc_conf
from memtop.diagnosis.facts import has_expandable_segments, uses_async_backend
from memtop.oom.diagnose import diagnose
from memtop.sim.allocator import AllocatorConfig

# conf -> are expandable segments on, as torch reads it, and what torch refuses in it: a value
# (ValueError "Expected 'True' or 'False'" at the trainer's first allocation), a key it does not
# know (a CUDA build refuses it: "Unrecognized key"), or nothing.  The comment says what the
# old readers answered (suggestions / OOM diagnosis / simulator) where one of them was wrong.
EXPANDABLE = [
    ("expandable_segments:True", True, None),
    ("expandable_segments:False", False, None),
    ("", False, None),
    (" expandable_segments : True ", True, None),
    ("max_split_size_mb:128, expandable_segments:True", True, None),
    ("roundup_power2_divisions:[256:1,>:4],expandable_segments:True", True, None),
    ("expandable_segments:1", False, "value"),  # was on / off / refused
    ("expandable_segments:true", False, "value"),  # was on / on / on
    ("expandable_segments:TRUE", False, "value"),  # was on / on / refused
    ("EXPANDABLE_SEGMENTS:True", False, "key"),  # was on / on / refused
    # The last of a repeated key counts.
    ("expandable_segments:True,expandable_segments:False", False, None),  # OOM said on
    # A word that only contains the option is not the option.
    ("no_expandable_segments:True", False, "key"),  # OOM said on
]
CONFS = [(conf, expected) for conf, expected, _ in EXPANDABLE]

# conf -> does an asynchronous backend replace the caching allocator.
ASYNC = [
    ("backend:cudaMallocAsync", True),
    ("backend:hipMallocAsync", True),  # ROCm's spelling: suggestions said no
    ("backend:native", False),
    ("backend:CUDAMALLOCASYNC", False),  # torch knows no such backend: suggestions said yes
    ("expandable_segments:True", False),
]


@pytest.mark.parametrize(("conf", "expected"), CONFS)
def test_expandable_segments_as_torch_reads_them(conf: str, expected: bool):
    assert alloc_conf.parse(conf).expandable_segments is expected
    assert has_expandable_segments(conf) is expected  # what the suggestions judge


@pytest.mark.parametrize(("conf", "expected"), ASYNC)
def test_the_async_backend_as_torch_reads_it(conf: str, expected: bool):
    assert alloc_conf.parse(conf).async_backend is expected
    assert uses_async_backend(conf) is expected


@pytest.mark.parametrize(("conf", "expected"), CONFS)
def test_the_oom_diagnosis_reads_it_the_same_way(conf: str, expected: bool):
    report = {
        "requested_bytes": 600 << 20,
        "free_bytes": 100 << 20,
        "total_bytes": 80 << 30,
        "allocated_bytes": 70 << 30,
        "reserved_bytes": 79 << 30,
        "largest_free_block_bytes": 200 << 20,
        "allocator_conf": conf,
    }
    verdict = diagnose(report)
    assert verdict["cause"] == "fragmentation"
    assert verdict["fix"].startswith("already on expandable segments") is expected


@pytest.mark.parametrize(("conf", "expected", "refused"), EXPANDABLE)
def test_the_simulator_refuses_what_torch_refuses(conf: str, expected: bool, refused: str | None):
    if refused is None:
        assert AllocatorConfig.parse(conf).expandable_segments is expected
    else:
        with pytest.raises(ValueError):
            AllocatorConfig.parse(conf)


def test_options_keep_their_order_and_list_values():
    assert alloc_conf.options(" max_split_size_mb : 64 ,roundup_power2_divisions:[256:1,>:4]") == {
        "max_split_size_mb": "64",
        "roundup_power2_divisions": "[256:1,>:4]",
    }
    # What torch could not read is passed over, never an exception: memtop reads what a
    # trainer has.
    assert alloc_conf.options("junk,:,a:b:c,expandable_segments:True,[") == {
        "a": "b",
        "expandable_segments": "True",
    }


@pytest.mark.parametrize(("conf", "expected", "refused"), EXPANDABLE)
def test_the_table_is_torchs_answer(conf: str, expected: bool, refused: str | None):
    """torch's own parser (a CPU build reads the options too, but skips keys it does not know
    where a CUDA build refuses them) takes or refuses each spelling as the table says."""
    torch = pytest.importorskip("torch")
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        pytest.skip("this torch cannot parse allocator options without a GPU")
    try:
        if refused == "value":
            with pytest.raises(ValueError, match="Expected 'True' or 'False'"):
                setter(conf)
        else:
            setter(conf)
    finally:
        setter("expandable_segments:False")  # torch's defaults again
