"""A process killed during a sharded save (after each file it writes, between two ranks'
shards included) leaves the previous checkpoint whole and loadable, and `--resume`
completes the run with the losses of an uninterrupted one.

The kill is a SIGKILL the writing process sends itself right after the named file
(RESTOPO_CRASH_AFTER=step_000004/FILE, restopo.train.checkpoint): deterministic, at every
point of the commit protocol. A 2-stage pipeline on 2 processes (gloo on 127.0.0.1), tiny
model; the default run tries two points, `-m long` all of them.
"""
import json
import os
import subprocess
import sys

import pytest

from restopo.train.checkpoint import find_resumable, load_checkpoint
from restopo.train.runspec import model_from_meta

TINY = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny.restopo")
ARGS = ["--set", "model.width=32", "--set", "model.context=32", "--set", "train.batch=8",
        "--set", "train.warmup=2", "--set", "train.eval_every=0", "--set",
        "train.save_every=2", "--set", "train.log_every=1", "--steps", "6", "--no-progress",
        "--device", "cpu", "--backend", "eager", "--pipeline", "2x1", "--nproc", "2"]
SHARES = ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
POINTS = [*SHARES, "state.safetensors", "meta.json", "index.json", "manifest.json", "rename",
          "latest"]


def restopo(*argv, **env):
    return subprocess.run([sys.executable, "-m", "restopo", *argv],
                          env=dict(os.environ, OMP_NUM_THREADS="1", RESTOPO_DIST_TIMEOUT="60",
                                   **env),
                          capture_output=True, text=True, timeout=300)


def losses(out) -> dict[int, float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("whole") / "run")
    proc = restopo("train", TINY, *ARGS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(out)


def kill_and_resume(point, tmp_path, want):
    out = str(tmp_path / "run")
    proc = restopo("train", TINY, *ARGS, "--out", out,
                   RESTOPO_CRASH_AFTER=f"step_000004/{point}")
    assert proc.returncode != 0, f"the run survived a kill after {point}"
    # what --resume will use verifies and loads into a single-process model
    found, skipped = find_resumable(os.path.join(out, "ckpt"))
    assert not skipped
    committed = point in ("rename", "latest")  # the folder was in place before the kill
    assert found.name == ("step_000004" if committed else "step_000002"), point
    _, model, _ = model_from_meta(found)
    load_checkpoint(found, model)
    proc = restopo("train", TINY, *ARGS, "--out", out, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(out)
    assert sorted(got) == list(range(1, 7))
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=1e-5), (point, step)
    leftovers = [n for n in os.listdir(os.path.join(out, "ckpt")) if n.startswith(".")]
    assert not leftovers, leftovers


@pytest.mark.slow
@pytest.mark.parametrize("point", [SHARES[0], "rename"])
def test_kill_during_sharded_save(point, tmp_path, uninterrupted):
    kill_and_resume(point, tmp_path, uninterrupted)


@pytest.mark.long
@pytest.mark.parametrize("point", POINTS)
def test_kill_after_every_file_of_a_sharded_save(point, tmp_path, uninterrupted):
    kill_and_resume(point, tmp_path, uninterrupted)
