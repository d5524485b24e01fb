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
    "memtop.engine.sampler",
)


@pytest.mark.parametrize(
    "module",
    [
        "memtop.engine.store",
        "memtop.engine.observation",
        "memtop.engine.feed",
        "memtop.ui.view",
        "memtop.present.report",
    ],
)
def test_the_view_model_loads_no_transport(module: str) -> None:
    # On 873fb27 `import memtop.engine.store` loaded socket, selectors, psutil and the agent pool
    # (store.py imported sources.agents and sources.processes for two records).
    code = f"import sys, {module}\nprint(' '.join(m for m in {IO_MODULES!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"{module} loads {done.stdout.strip()}"


def test_the_architecture_page_draws_the_layers_contract() -> None:
    # docs/architecture.md is the living picture: its layers are the contract's, in its order.
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())
    (layers,) = [
        c["layers"]
        for c in config["tool"]["importlinter"]["contracts"]
        if c.get("type") == "layers"
    ]
    page = (root / "docs" / "architecture.md").read_text()
    block = page.split("## The layers", 1)[1].split("```", 2)[1]
    # Each drawn line's left column: the modules of one layer (a continuation line has none).
    drawn = [
        {m.removeprefix("memtop.") for m in re.findall(r"[\w.]+", line.split("  ")[0])}
        for line in block.splitlines()
        if line.strip()
    ]
    row = 0
    for layer in layers:
        names = {m.strip().removeprefix("memtop.") for m in layer.split("|")}
        while row < len(drawn) and not names & drawn[row]:
            row += 1
        assert row < len(drawn), f"docs/architecture.md does not draw {layer} (or out of order)"
        assert names == drawn[row], f"{layer}: the page draws {sorted(drawn[row])}"
        row += 1
