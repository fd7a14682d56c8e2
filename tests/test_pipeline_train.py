"""`restopo train SPEC --pipeline 2x2` under torchrun follows the single-process loss curve
and leaves a sharded checkpoint (one share per stage) that a single process loads and
resumes from, and that `restopo export` consolidates into one file."""
import json
import os
import subprocess
import sys

import pytest

SPEC = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny.restopo")
ARGS = ["--set", "model.width=32", "--set", "model.context=32", "--set", "train.batch=8",
        "--set", "train.warmup=2", "--set", "train.eval_every=3", "--set",
        "train.eval_batches=2", "--set", "train.save_every=6", "--set", "train.log_every=1",
        "--steps", "6", "--no-progress", "--device", "cpu", "--backend", "eager"]


def restopo(*argv, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "restopo", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_pipelined_training_matches_one_process(tmp_path):
    from safetensors.torch import load_file

    single, piped = str(tmp_path / "single"), str(tmp_path / "piped")
    restopo("train", SPEC, *ARGS, "--out", single)
    restopo("train", SPEC, *ARGS, "--out", piped, "--pipeline", "2x2", "--nproc", "2")
    a, b = metrics(single), metrics(piped)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b):
        print(x["step"], x["loss"], y["loss"], x["val_loss"], y["val_loss"])
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5)
        assert (x["val_loss"] is None) == (y["val_loss"] is None)
        if x["val_loss"] is not None:
            assert y["val_loss"] == pytest.approx(x["val_loss"], abs=1e-5)
    # the pipelined checkpoint: one share per stage, consolidated by restopo export into
    # every weight of the model (as the single process's, the tied head included)
    step = os.path.join(piped, "ckpt", "step_000006")
    assert sorted(f for f in os.listdir(step) if f.startswith("shard-")) == [
        "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    exported = str(tmp_path / "piped.safetensors")
    restopo("export", piped, "-o", exported)
    wa = load_file(os.path.join(single, "ckpt", "step_000006", "model.safetensors"))
    wb = load_file(exported)
    assert set(wa) <= set(wb) and set(wb) - set(wa) == {"head.lm_head.weight"}
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    # a single process loads it as its own: the model and AdamW over the whole model
    import torch
    from restopo.train.checkpoint import load_checkpoint
    from restopo.train.loop import TrainConfig, make_optimizer
    from restopo.train.runspec import model_from_meta

    loaded = []
    for out in (single, piped):
        step_dir = os.path.join(out, "ckpt", "step_000006")
        spec, model, _ = model_from_meta(step_dir)
        opt = make_optimizer(model, TrainConfig.from_spec(spec.train, spec.model.context),
                             torch.device("cpu"))
        state, _ = load_checkpoint(step_dir, model, opt)
        assert state["step"] == 6
        loaded.append((model, opt))
    (ma, oa), (mb, ob) = loaded
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        torch.testing.assert_close(pb, pa, atol=1e-4, rtol=0)
        sa, sb = oa.state[pa], ob.state[pb]
        assert sb["step"].item() == sa["step"].item() == 6
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], atol=1e-5, rtol=0)


def test_pipeline_option_errors_are_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "restopo", "train", SPEC, *ARGS, "--out",
                           str(tmp_path / "x"), "--pipeline", "2x2"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "needs a multiple of 2 processes" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_train_accum_in_a_pipeline_is_said_to_be_set_aside(tmp_path):
    """A pipeline's microbatches split each step's rows; train.accum was read by nothing,
    without a word (and the loop checked it against the processes, not the replicas, and
    refused a batch that splits: 8 rows, 4 processes as 2 stages x 2 replicas, accum 8)."""
    proc = restopo("train", SPEC, *ARGS[:-7], *ARGS[-5:], "--steps", "2", "--set", "train.accum=8",
                   "--out", str(tmp_path / "p"), "--pipeline", "2x1", "--nproc", "2")
    assert "note: train.accum (8) is set aside in a pipeline: its 2 microbatches split each " \
           "step's rows instead" in proc.stderr
    assert [r["step"] for r in metrics(tmp_path / "p")] == [1, 2]
