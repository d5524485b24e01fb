"""Rules every test keeps (issue 21.22): no fixed path outside tmp_path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
