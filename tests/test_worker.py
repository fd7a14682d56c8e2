"""restopo.worker.leave: how a torchrun worker ends."""
import os
import subprocess
import sys

import pytest

SCRIPT = """
import atexit, logging, sys
from restopo.worker import leave
atexit.register(lambda: print("teardown ran", file=sys.stderr))
logging.basicConfig(stream=sys.stderr)
logging.getLogger("x").warning("logged")
sys.stdout.write("said, unflushed")  # no newline: still in the buffer when leave() runs
print("error line", file=sys.stderr)
leave(int(sys.argv[1]))
print("after leave", file=sys.stderr)
raise SystemExit(9)
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_worker_leaves_with_its_status_and_everything_it_said(code):
    env = dict(os.environ, RANK="0", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(code)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code
    assert proc.stdout == "said, unflushed"
    assert "logged" in proc.stderr and "error line" in proc.stderr
    # the interpreter's teardown (where torch's C++ teardown may abort) is skipped
    assert "teardown ran" not in proc.stderr and "after leave" not in proc.stderr


def test_outside_torchrun_leave_returns_and_the_process_ends_as_usual():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "3"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9
    assert "after leave" in proc.stderr and "teardown ran" in proc.stderr
