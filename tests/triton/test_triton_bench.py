"""bench/triton_depth.py: without a GPU it says so and exits 0. (Its --dry-run, every case
and arm on tiny shapes under the interpreter, runs inside bench/gpu_check.sh's dry run:
test_gpu_check_dry_run.py.)"""
import pytest
import torch
from file_modules import bench


def _bench():
    return bench("triton_depth")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_gpu_it_says_so(capsys):
    assert _bench().main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_peers_that_do_not_import_say_why():
    arms = _bench().peer_arms(1e-30)
    assert [name for name, _, _ in arms] == ["peer fast-attnres", "peer fla-core",
                                            "peer flash-attn-res"]
    for name, fn, why in arms:
        assert (fn is None) == (why is not None), name
