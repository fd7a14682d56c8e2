"""Shared test setup.

Triton kernels run on the CPU through Triton's interpreter here and in CI; the variable must
be set before triton is first imported in the process, so it is set at collection time.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")

# Property tests draw the same examples on every run, so a failure in CI is a failure anyone
# reproduces with the same command. To search new examples: --hypothesis-profile=explore
from hypothesis import settings  # noqa: E402

settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
settings.load_profile("repeatable")
