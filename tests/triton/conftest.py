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
        path = str(item.fspath).replace(os.sep, "/")
        # test_triton_device.py is the GPU check (TRITON_INTERPRET unset): it skips itself
        if "tests/triton/" in path and not path.endswith("/test_triton_device.py"):
            item.add_marker(skip)
