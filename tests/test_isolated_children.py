"""Every Python memtop starts runs memtop's code, not the code of the folder it was started in
(issue 36, item 1).

`python -m` puts the current directory first on the import path.  Root ran `memtop demo` in a
folder another user could write (`mkdir -m1777 /tmp/s`), where that user had made `memtop/`:
the simulated trainers imported it, as root.  Here a folder holds a planted `memtop/` package,
`json.py` and `sitecustomize.py` (and, for `memtop run`, a module for every name of the standard
library), each writing a line to a marker file when imported; memtop is started there the way
its console script starts it (its own folder first, not the current one).  The marker must stay
empty, and the children must still import the memtop this process runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_users import LocalUser, local_user, needs_root

import memtop
from memtop.base import children
from memtop.base.untrusted import root_may_not_load

ROOT = Path(__file__).resolve().parent.parent
PLANT = """\
import os
with open({marker!r}, "a") as handle:
    handle.write(f"{name} euid={{os.geteuid()}} pid={{os.getpid()}}\\n")
"""
# `memtop` as its console script starts it: the script's folder (bin/) first on the import path,
# not the current directory.  Under -I with this memtop's folder put back, as bin/ holds none.
AS_INSTALLED = (
    "import sys; sys.path.insert(0, {root!r}); from memtop.cli import main; sys.exit(main())"
)


def memtop_command(*args: str) -> list[str]:
    return [sys.executable, "-I", "-c", AS_INSTALLED.format(root=str(ROOT)), *args]


def plant(folder: Path, marker: Path, names: list[str]) -> list[Path]:
    """A module per name in `folder` (and a `memtop/` package) that marks its import."""
    made = []
    (folder / "memtop").mkdir()
    made.append(folder / "memtop")
    made.append(folder / "memtop" / "__init__.py")
    made[-1].write_text(PLANT.format(marker=str(marker), name="memtop/"))
    for name in names:
        path = folder / f"{name}.py"
        path.write_text(PLANT.format(marker=str(marker), name=f"{name}.py"))
        made.append(path)
    return made


def marks(marker: Path) -> list[str]:
    try:
        return marker.read_text().splitlines()
    except FileNotFoundError:
        return []


def test_a_child_python_imports_this_memtop_not_the_current_folders(tmp_path: Path) -> None:
    here = tmp_path / "here"
    here.mkdir()
    marker = tmp_path / "marker"
    plant(here, marker, ["json", "sitecustomize"])
    # A dependency on PYTHONPATH (its folder is this user's own) is still found.
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "where_things_are.py").write_text(
        "import json, memtop\nprint(memtop.__file__)\nprint(json.__file__)\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{deps}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        children.python_command("where_things_are", environ=env),
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    memtop_file, json_file = done.stdout.split("\n")[:2]
    assert memtop_file == memtop.__file__
    assert not json_file.startswith(str(here))
    assert marks(marker) == []


def test_memtop_run_imports_nothing_of_the_programs_folder_for_itself(tmp_path: Path) -> None:
    """The program's folder (a script's, or the current one for -m) comes first on the import
    path for the program, as with python; memtop's own agent was imported from there too (json,
    socket, selectors, pickle, ...).  A module for every name of the standard library waits in
    that folder; the program imports nothing."""
    folder = tmp_path / "prog"
    folder.mkdir()
    marker = tmp_path / "marker"
    plant(folder, marker, sorted(n for n in sys.stdlib_module_names if not n.startswith("_")))
    (folder / "program.py").write_text("print('program ran')\n")
    env = dict(os.environ, MEMTOP_SOCKET_DIR=str(tmp_path / "sockets"))
    for args in (["run", "program.py"], ["run", "-m", "program"]):
        done = subprocess.run(
            memtop_command(*args), cwd=folder, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert "program ran" in done.stdout
        assert "agent listening" in done.stderr
        assert marks(marker) == [], args


def test_a_folder_root_may_load_code_from(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o755)
    if os.geteuid() == 0:
        assert root_may_not_load(private) is None
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    assert "may be written by users other than root" in (root_may_not_load(shared) or "")
    # Below a sticky folder anyone may write, what root made is root's.
    if os.geteuid() == 0:
        inner = shared / "inner"
        inner.mkdir(mode=0o755)
        assert root_may_not_load(inner) is None
        assert "cannot be checked" in (root_may_not_load(shared / "nothing") or "")


@pytest.fixture
def shared_folder() -> Iterator[tuple[LocalUser, Path]]:
    """/tmp/…/s, mode 1777 as in the audit, made by root; another local user plants in it."""
    work = Path(tempfile.mkdtemp(prefix="mtiso-", dir="/tmp"))
    work.chmod(0o755)
    folder = work / "s"
    folder.mkdir()
    folder.chmod(0o1777)
    try:
        with local_user("mtiso") as user:
            yield user, folder
    finally:
        shutil.rmtree(work, ignore_errors=True)


@needs_root
@pytest.mark.slow
def test_root_demo_in_another_users_folder_runs_none_of_their_code(
    shared_folder: tuple[LocalUser, Path], tmp_path: Path
) -> None:
    user, folder = shared_folder
    marker = folder.parent / "marker"
    marker.touch()
    marker.chmod(0o666)  # the planted code, running as anyone, may write it
    # The other user's own folder on PYTHONPATH too (a `sudo -E` kept it): not honoured.
    theirs = folder / "theirs"
    theirs.mkdir()
    for path in [
        *plant(folder, marker, ["json", "sitecustomize"]),
        theirs,
        *plant(theirs, marker, ["sitecustomize", "selectors"]),
    ]:
        os.chown(path, user.uid, user.gid)
    sockets = tmp_path / "sockets"
    env = dict(
        os.environ,
        MEMTOP_SOCKET_DIR=str(sockets),
        PYTHONPATH=f"{theirs}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    demo, banner = children.start_until_first_line(
        memtop_command("demo", "--no-ui", "--scenario", "healthy"),
        env=env,
        cwd=folder,
        stderr=subprocess.PIPE,
    )
    try:
        assert banner.startswith("memtop demo: 1 simulated trainer"), (
            banner,
            marks(marker),
        )
    finally:
        children.stop(demo, timeout=20)
    assert marks(marker) == []


def test_memtop_starts_python_only_through_the_isolated_command() -> None:
    """One home: a `[sys.executable, "-m", …]` elsewhere in memtop would put the current
    directory first on the child's import path again."""
    import re

    pattern = re.compile(r"sys\.executable\s*,\s*\n?\s*\"-[mc]\"")
    found = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "memtop").rglob("*.py")
        if path.name != "children.py" and pattern.search(path.read_text())
    ]
    assert found == []


def test_memtop_run_in_a_child_keeps_the_pythonpath_for_the_program(tmp_path: Path) -> None:
    """`memtop run` replaces the first import path entry (the launcher's) with the program's
    folder: in a child started by python_command that entry is not one of PYTHONPATH's."""
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "their_dependency.py").write_text("WHERE = 'deps'\n")
    (tmp_path / "program.py").write_text("import their_dependency\nprint(their_dependency.WHERE)\n")
    env = dict(
        os.environ,
        PYTHONPATH=f"{deps}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        MEMTOP_SOCKET_DIR=str(tmp_path / "sockets"),
    )
    done = subprocess.run(
        children.python_command("memtop", "run", "program.py", environ=env),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "deps"
