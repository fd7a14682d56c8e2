"""The kill-and-corrupt loop (bench/kill_corrupt.py) as a test: random SIGKILLs of `restopo
train` and random byte flips in the newest checkpoint, resumed until done; every flip is
detected and every logged loss equals the uninterrupted run's. Minutes long: -m long. The
deterministic cases (each kind of damage, fallback, pruning) are in test_train_safety.py."""
import pytest

from file_modules import bench

kill_corrupt = bench("kill_corrupt")


@pytest.mark.long
@pytest.mark.parametrize("seed", [0, 1])
def test_kills_and_flips_resume_to_the_uninterrupted_losses(tmp_path, seed):
    result = kill_corrupt.run(kills=10, seed=seed, steps=45, flip_p=0.8, folder=tmp_path)
    assert result["kills"] >= 5 and result["flips"] >= 2, result
    assert result["flips_detected"] == result["flips"] and not result["undetected"], result
    assert result["losses_equal"], result
