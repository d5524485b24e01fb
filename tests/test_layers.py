"""Issue 35: the store and everything above it import records from memtop.model only, so the
view-model loads no socket, selector, psutil or agent pool (the import contracts say it for the
code; this says it for what a process actually loads)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What the view-model must not drag in: the agents' transport and the host's process reader.
IO_MODULES = (
    "socket",
    "selectors",
    "psutil",
    "subprocess",
    "memtop.protocol",
    "memtop.sources",
    "memtop.sampler",
)


@pytest.mark.parametrize(
    "module",
    ["memtop.store", "memtop.observation", "memtop.feed", "memtop.ui.view", "memtop.report"],
)
def test_the_view_model_loads_no_transport(module: str) -> None:
    # On 873fb27 `import memtop.store` loaded socket, selectors, psutil and the agent pool
    # (store.py imported sources.agents and sources.processes for two records).
    code = f"import sys, {module}\nprint(' '.join(m for m in {IO_MODULES!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"{module} loads {done.stdout.strip()}"
