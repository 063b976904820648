"""hold_malloc sets glibc's thresholds (in a child process: the test runner's own malloc is left alone)."""

from __future__ import annotations

import subprocess
import sys


def test_hold_malloc_sets_the_thresholds_on_glibc():
    code = "from realrl.base.malloc import hold_malloc; print(hold_malloc())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out
