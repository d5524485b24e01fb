"""Rules every test keeps (issue 21.22): no fixed path outside tmp_path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
# A string that is nothing but a path under /tmp, /var/tmp or /dev/shm ("/tmp/x"): a test
# that writes there fails when the path exists, and two runs collide.  Random names made by
# tempfile (dir="/tmp" only, for short socket paths) are not literals of this kind.
FIXED_PATH = re.compile(r"^/(tmp|var/tmp|dev/shm)/\S+$")


def test_no_test_names_a_fixed_path_outside_its_tmp_path() -> None:
    found = []
    for source in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and FIXED_PATH.match(text):
                found.append(f"{source.name}:{node.lineno}: {text}")
    assert not found, "fixed paths outside tmp_path:\n" + "\n".join(found)


def test_the_order_the_workers_take_the_modules_in_is_longest_first() -> None:
    # tests/conftest.py's scheduler: the table names modules that exist (a renamed module falls
    # back to its number of tests), and the longest is taken first.
    from helpers import module_seconds

    seconds = module_seconds.load()
    assert seconds, f"{module_seconds.TABLE} is missing or empty"
    stale = sorted(name for name in seconds if not (TESTS / name).is_file())
    assert not stale, f"modules in {module_seconds.TABLE.name} that no longer exist: {stale}"
    queue = {"tests/test_soak.py": 2, "tests/test_estimate.py": 72, "tests/test_unlisted.py": 10}
    order = sorted(queue, key=lambda m: -module_seconds.weight(m, queue[m], seconds))
    assert order == ["tests/test_soak.py", "tests/test_estimate.py", "tests/test_unlisted.py"]
    assert module_seconds.weight("tests/test_unlisted.py", 10, seconds) == pytest.approx(3.0)


def test_a_live_apps_notification_that_expired_before_a_wait_began_is_still_seen(
    tmp_path: Path,
) -> None:
    # The `-n 2` flake of the live terminate test: at load ~35 its key press returned ~5.7 s
    # after the app notified "sent SIGKILL", the notification had left the screen, and the
    # wait for it timed out with nothing shown.  A live_app keeps every notification it made.
    import asyncio

    from ui_helpers import live_app, notifications, wait_for

    app, sampler = live_app(tmp_path)

    async def main() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            app.notify("sent SIGKILL to pid 1 (python)", timeout=0.1)
            await pilot.pause(0.5)
            assert not app._notifications  # gone from the screen
            await wait_for(pilot, lambda: any("SIGKILL" in n for n in notifications(app)), 2)

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
