"""bench/kernels.py: its logic runs end to end on tiny shapes (--dry-run), and without a GPU
it says so and exits 0."""
import importlib.util
import os

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kernels.py")


def _bench():
    spec = importlib.util.spec_from_file_location("restopo_bench_kernels", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_gpu_it_says_so(capsys):
    assert _bench().main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_dry_run(capsys):
    assert _bench().main(["--dry-run", "--widths", "96"]) == 0
    out = capsys.readouterr().out
    for what in ("copy bandwidth", "fused triton (single read)", "fused triton (two-phase)",
                 "eager, S single aggregations", "fused phase2+norm, fwd+bwd",
                 "compile(add + rms_norm), fwd"):
        assert what in out, what
