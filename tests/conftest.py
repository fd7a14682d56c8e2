"""Shared test setup.

Triton kernels run on the CPU through Triton's interpreter here and in CI; the variable must
be set before triton is first imported in the process, so it is set at collection time.
"""
import os
import signal

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

# Property tests draw the same examples on every run, so a failure in CI is a failure anyone
# reproduces with the same command. To search new examples: --hypothesis-profile=explore
from hypothesis import settings  # noqa: E402

settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
settings.load_profile("repeatable")


@pytest.fixture(autouse=True)
def interactive_sigint():
    """Each test runs with the SIGINT handler an interactive Python has, whatever launched
    pytest: started in the background without job control (`bash .ci/run &`), a process
    inherits SIGINT ignored, which restopo leaves as the shell means it (a second Ctrl-C
    goes back to being ignored, main installs no handler of its own), so tests of Ctrl-C
    passed or failed by how pytest was started. A test of the ignored case sets it."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, found)
