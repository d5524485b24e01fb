"""memtop's one median (memtop.figures.median) gives what `statistics.median` gave, and the
dashboard no longer imports `statistics` for it (issue 35 item 8: the dashboard's RSS)."""

from __future__ import annotations

import random
import statistics
import subprocess
import sys

import pytest

from memtop.figures.median import median


def test_the_median_is_the_standard_librarys_on_random_data() -> None:
    rng = random.Random(35)
    for _ in range(2000):
        count = rng.randint(1, 12)
        kind = rng.choice(("int", "float", "mixed", "ties"))
        if kind == "int":
            data: list[float] = [rng.randint(-(2**40), 2**40) for _ in range(count)]
        elif kind == "float":
            data = [rng.uniform(-1e12, 1e12) for _ in range(count)]
        elif kind == "ties":
            data = [rng.choice((0.1, 0.2, 0.3, 7)) for _ in range(count)]
        else:
            data = [rng.choice((rng.randint(-9, 9), rng.random())) for _ in range(count)]
        expected = statistics.median(data)
        got = median(data)
        # The same value and the same type (an even count of ints is a float's mean).
        assert (got, type(got)) == (expected, type(expected)), data
        assert median(iter(data)) == expected  # a generator, as the diagnosis passes one


def test_the_even_middle_is_the_mean_of_the_two() -> None:
    assert median([1, 3]) == 2.0 and isinstance(median([1, 3]), float)
    assert median([4, 1, 3, 2]) == 2.5
    assert median([0.1, 0.2]) == statistics.median([0.1, 0.2])  # (a + b) / 2, not a + (b - a) / 2
    assert median([5]) == 5 and isinstance(median([5]), int)


def test_no_median_of_nothing() -> None:
    with pytest.raises(ValueError):
        median([])


def test_the_dashboard_does_not_import_statistics() -> None:
    # `statistics` (with its own C half) came in with the diagnosis for one function; the GPU
    # screen's chart (opened later) had it too.
    code = (
        "from memtop.ui.start import import_asyncio_without_tls\n"
        "import_asyncio_without_tls()\n"
        "import memtop.commands.watch, memtop.engine.sampler, memtop.sources.devices\n"
        "import memtop.engine.observation, memtop.ui.app, memtop.ui.splash, memtop.ui.view\n"
        "import memtop.engine.job_groups, memtop.ui.screens.gpu, memtop.ui.stacked\n"
        "import sys; print(' '.join(m for m in ('statistics', '_statistics') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
