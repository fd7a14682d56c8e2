"""Shared test setup.

Triton kernels run on the CPU through Triton's interpreter here and in CI; the variable must
be set before triton is first imported in the process, so it is set at collection time.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "2")
