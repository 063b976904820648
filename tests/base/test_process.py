"""realrl/base/process.py's `exit_process`: how a worker or server process ends."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import atexit, logging, sys
from realrl.base.process import exit_process

log = logging.getLogger("child")
log.addHandler(logging.FileHandler(sys.argv[1]))
log.warning("logged before the exit")
atexit.register(lambda: open(sys.argv[2], "w").write("atexit ran"))
sys.stdout.write("buffered line")  # no newline, no flush: the exit flushes it
exit_process(3)
print("never")
"""


def test_exit_process_runs_the_exit_handlers_flushes_and_keeps_the_code(tmp_path):
    log, mark = tmp_path / "child.log", tmp_path / "atexit"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(log), str(mark)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered line"
    assert mark.read_text() == "atexit ran"
    assert "logged before the exit" in log.read_text()
