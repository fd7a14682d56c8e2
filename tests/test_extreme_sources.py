"""Sources at the edges of their dtype's range (huge: a mean square that overflows; subnormal;
zero; a +-inf or NaN element) give every backend the reference's results, float32 and
float64: outputs and every gradient of depth attention, phase 1 and phase 2 with the next
PreNorm (tests/extreme_sources.py). triton runs in its interpreter."""
import os

import pytest
import torch

import extreme_sources
from restopo.registry import get_backend


def _usable(backend: str) -> bool:
    if backend == "triton":
        from restopo.backends.triton import available
        return available("cpu")[0]
    return backend == "eager" or get_backend(backend).available()[0]


# the triton interpreter (numpy) warns of the overflows these cases are made of
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", list(extreme_sources.CASES))
@pytest.mark.parametrize("backend", ["eager", "cpu", "triton"])
def test_extreme_sources_give_the_reference_results(backend, case, dtype, monkeypatch):
    if not _usable(backend):
        pytest.skip(f"the {backend} backend cannot run here")
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    extreme_sources.assert_as_reference(backend, case, dtype)
