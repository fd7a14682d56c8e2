"""`restopo train` with a multi-stream residual: two DDP processes follow one process with
the same global batch, and a 2x2 pipeline (the n-stream state crossing every cut) follows
the single process too. The 300-step run of examples/mhc.restopo is marked long."""
import json
import os
import subprocess
import sys

import pytest

from test_train_processes import env  # noqa: F401  (the fixture: one process env, corpus ready)

SPEC = """\
model t { vocab: 256; width: 32; depth: 2; heads: 4; context: 32 }
residual mhc(streams: 2)
train {
  data: builtin:stdlib
  steps: 5; batch: 8; lr: 3e-3; warmup: 2
  eval_every: 5; eval_batches: 1; save_every: 5; log_every: 1
}
"""
ROOT = os.path.join(os.path.dirname(__file__), "..")


def train(env, *argv, timeout=240):
    proc = subprocess.run([sys.executable, "-m", "restopo", "train", *map(str, argv),
                           "--no-progress", "--device", "cpu", "--backend", "eager"],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("how", (["--nproc", "2"], ["--nproc", "2", "--pipeline", "2x2"]),
                         ids=("ddp", "pipeline"))
def test_processes_follow_one_process(tmp_path, env, how):
    spec = tmp_path / "m.restopo"
    spec.write_text(SPEC)
    one, many = tmp_path / "one", tmp_path / "many"
    train(env, spec, "--out", one)
    train(env, spec, "--out", many, *how)
    a, b = losses(one), losses(many)
    assert len(a) == len(b) == 5
    assert b == pytest.approx(a, rel=1e-4, abs=1e-4)


@pytest.mark.long
def test_mhc_example_learns_like_the_standard_residual(tmp_path, env):
    """300 steps of examples/mhc.restopo and examples/standard.restopo: mHC's loss falls as
    the standard residual's does (ends within 0.1 nats of it and far below the start)."""
    final = {}
    for name in ("standard", "mhc"):
        out = tmp_path / name
        train(env, os.path.join(ROOT, "examples", f"{name}.restopo"), "--out", out,
              "--steps", 300, timeout=3600)
        loss = losses(out)
        final[name] = sum(loss[-10:]) / 10
        assert final[name] < loss[0] - 2.0, (name, loss[0], final[name])
    assert abs(final["mhc"] - final["standard"]) < 0.1, final
