"""Triton kernel tests: they run in triton's interpreter on CPU tensors.

The backend picks the interpreter at launch time from TRITON_INTERPRET, so this works even
when another test module imported triton first.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from restopo.backends.triton import available  # noqa: E402


def pytest_collection_modifyitems(config, items):
    ok, why = available("cpu")
    if ok:
        return
    skip = pytest.mark.skip(reason=f"triton backend cannot run here: {why}")
    for item in items:
        if "tests/triton/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
