"""`memtop run`: run a Python program in this process, like `python script.py` / `python -m`,
with the agent started first.

It behaves as `python` would, for a user who types `memtop run` where they typed `python`:
- `sys.path[0]` is the script's folder, or the current directory for `-m` (not memtop's bin/);
- torch is not imported on the program's behalf: the agent starts with a probe that waits for
  the program's own `import torch` (memtop.agent.lazy_probe);
- a missing script exits 2 with python's message, `-m nosuchmod` and a folder without
  `__main__.py` print python's one line and exit 1;
- an uncaught exception prints the program's traceback without memtop's and runpy's frames, and
  exits 1; a missing torch adds one line saying where memtop belongs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import runpy
import sys
import traceback
import zipfile

from memtop.agent import start_agent

EXIT_NO_FILE = 2  # python's own code for "can't open file"

_MEMTOP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LaunchError(Exception):
    """Python's own one-line complaint about the target, with its exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def run_program(target: str, args: list[str], as_module: bool) -> int:
    """Start the agent, then run `target` as __main__; return the exit status python would.

    SystemExit raised by the program propagates, as from python.
    """
    _import_the_agent()
    if as_module:
        check_module(target)
        sys.path[0:1] = [os.getcwd()]
    else:
        check_path(target)
        # Like `python script.py`: the script's directory replaces the launcher's on sys.path.
        sys.path[0:1] = [os.path.dirname(os.path.abspath(target))]
    _environment_for_children()
    # The program's own argv, so that `hello` (and the process table) names the program.
    sys.argv = [target, *args]
    start_agent(quiet=False)
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        print_user_traceback(exc)
        return 130  # as a shell reports a program that SIGINT ended
    except BaseException as exc:
        print_user_traceback(exc)
        return 1
    return 0


def _import_the_agent() -> None:
    """Import what the agent runs on (memtop's modules and the standard library's) while the
    import path is still memtop's own: from here on its first entry is the program's folder
    (or, for -m, the current directory), where a `json.py` or `socket.py` is the program's
    business, not memtop's.  Root running `memtop run` in a folder another user can write
    imported that user's `json.py` for the agent, as root, before the program started."""
    import pkgutil  # noqa: F401  (runpy.run_path imports it when it hands over)

    # backends: its registry imports (importlib) here too; the backend modules themselves are
    # memtop's submodules, found through its own package path whenever torch arrives.
    from memtop.agent import auto_cleanup, backends, lazy_probe, server  # noqa: F401


def _environment_for_children() -> None:
    # Python programs this one launches (torchrun's ranks, say) start an agent too, once they
    # import torch: see memtop/agent/autostart/sitecustomize.py.
    os.environ["MEMTOP_AGENT"] = "1"
    autostart = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autostart")
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{autostart}{os.pathsep}{path}" if path else autostart


def check_path(target: str) -> None:
    """Python's checks of `python PATH`, before anything runs."""
    absolute = os.path.abspath(target)
    if not os.path.exists(target):
        raise LaunchError(
            f"can't open file {absolute!r}: [Errno 2] No such file or directory", EXIT_NO_FILE
        )
    if os.path.isdir(target):
        if not os.path.exists(os.path.join(target, "__main__.py")):
            raise LaunchError(f"can't find '__main__' module in {absolute!r}")
    elif zipfile.is_zipfile(target):
        with zipfile.ZipFile(target) as archive:
            if "__main__.py" not in archive.namelist():
                raise LaunchError(f"can't find '__main__' module in {absolute!r}")


def check_module(name: str) -> None:
    """Python's checks of `python -m NAME`: the module (or a package's __main__) must exist."""
    sys.path[0:1] = [os.getcwd()]  # where `python -m` looks first
    spec = _find_spec(name)
    if spec is None:
        raise LaunchError(f"No module named {name}")
    if spec.submodule_search_locations is not None and _find_spec(f"{name}.__main__") is None:
        raise LaunchError(
            f"No module named {name}.__main__; {name!r} is a package and cannot be directly "
            "executed"
        )


def _find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise LaunchError(
            f"Error while finding module specification for {name!r} ({type(exc).__name__}: {exc})"
        ) from None


def _ours(filename: str) -> bool:
    if filename.startswith("<frozen runpy") or filename.startswith("<frozen importlib"):
        return True
    if os.path.basename(filename) == "runpy.py":
        return True
    return os.path.abspath(filename).startswith(_MEMTOP_DIR + os.sep)


def print_user_traceback(exc: BaseException) -> None:
    """The traceback python would print for the program: memtop's and runpy's frames cut."""
    tb = exc.__traceback__
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc.with_traceback(tb), tb)
    sys.stderr.write("".join(lines))
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
        sys.stderr.write(
            f"memtop: `memtop run` runs the program with memtop's own Python ({sys.executable}),"
            " which has no torch: install memtop into the trainer's environment"
            " (`python -m pip install memtop-gpu` there) and run that memtop\n"
        )
    sys.stderr.flush()
