"""Distributed layouts that divide memory (issue 10): stage-local pipelines, FSDP, both, and
sharded checkpoints, each held against one process.

- init: the same seed gives the same weights however the model is laid out;
- one step of pipeline 2x2 and 4x2, FSDP 2 and pipeline 2x1 x FSDP 2 (restopo.train.layoutcheck
  under torchrun): the loss and every parameter's gradient equal one process's (fp32);
- 10 steps as pipeline 2x2, resumed as FSDP 2 and as one process: the losses equal an
  uninterrupted single process;
- two "nodes" of one process each, joined by a c10d rendezvous on 127.0.0.1;
- layouts that cannot run: one line, said once, no torchrun traceback.
Multi-process tests use torchrun with gloo on 127.0.0.1, tiny models and a timeout each.
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from restopo.nn.init import materialize
from restopo.train import runspec

TINY = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny.restopo")
SMALL = ["--set", "model.width=32", "--set", "model.context=32", "--set", "train.batch=8",
         "--set", "train.warmup=2", "--set", "train.eval_every=5", "--set",
         "train.eval_batches=1", "--set", "train.log_every=1", "--no-progress",
         "--device", "cpu", "--backend", "eager"]


def small(**train):
    """SMALL with these train.KEY=VALUE settings in place of its own (a key given twice by
    --set is refused)."""
    out, args = [], list(SMALL)
    while args:
        a = args.pop(0)
        if a == "--set" and args[0].split("=")[0].removeprefix("train.") in train:
            args.pop(0)
            continue
        out.append(a)
    return [*out, *(x for k, v in train.items() for x in ("--set", f"train.{k}={v}"))]


def env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", RESTOPO_DIST_TIMEOUT="60", **extra)


def restopo(*argv, timeout=240, ok=True, **extra):
    proc = subprocess.run([sys.executable, "-m", "restopo", *map(str, argv)], env=env(**extra),
                          capture_output=True, text=True, timeout=timeout)
    if ok:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc


def losses(out) -> dict[int, float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


# -- initialisation -----------------------------------------------------------------------------
def test_init_does_not_depend_on_layout():
    """A unit made real alone (a pipeline rank's share) holds the weights it has in the
    whole model; a model of another topology has the same sublayers; the tied head follows
    the embedding wherever it is materialised."""
    spec = runspec.load(TINY, ("model.width=32",))
    whole = dict(runspec.build_model(spec, "eager").named_parameters())
    for share in (["sublayers.3", "aggregations.2"], ["head"], ["embed", "sublayers.0"]):
        model = runspec.build_model(spec, "eager", meta=True)
        held = materialize(model, model.restopo_init, share)
        real = {n: p for n, p in model.named_parameters() if not p.is_meta}
        assert real and all(n.split(".")[0] in {h.split(".")[0] for h in held} for n in real)
        for n, p in real.items():
            torch.testing.assert_close(p, whole[n], rtol=0, atol=0)
        if "head" in share:
            assert model.head.lm_head.weight is model.embed.weight
    other = runspec.build_model(runspec.load(TINY, ("model.width=32", "residual=rezero")),
                                "eager")
    for n, p in other.named_parameters():
        if not n.startswith("aggregations."):
            torch.testing.assert_close(p, whole[n], rtol=0, atol=0)
    # another seed, other weights
    reseeded = runspec.build_model(spec, "eager", seed=spec.train.seed + 1)
    assert not torch.equal(reseeded.sublayers[1].up.weight, whole["sublayers.1.up.weight"])


# -- one step against one process -------------------------------------------------------------
CASES = {
    "pipeline 2x2": (2, ["--pipeline", "2x2"]),
    "pipeline 4x2": (4, ["--pipeline", "4x2", "--set", "model.depth=4"]),
    "fsdp 2": (2, ["--data", "fsdp"]),
    # the default lowering hands each sublayer's PreNorm gain to phase 2: read outside the
    # sublayer's unit, so it must stay whole
    "fsdp 2, prenorm fused into phase 2": (2, ["--data", "fsdp", "--backend", "auto"]),
    "pipeline 2x1 x fsdp 2": (4, ["--pipeline", "2x1", "--data", "fsdp"]),
    # scalars FSDP cannot shard (ReZero), an untied head (units of their own), and two
    # accumulation steps (gradients reduced once, on the last)
    "fsdp 2, rezero, untied, accum 2": (2, ["--data", "fsdp", "--set", "residual=rezero",
                                            "--set", "model.tie_embeddings=false", "--set",
                                            "train.accum=2"]),
    # activation recompute (issue 11): regions run again in backward in every layout
    "ddp 2, recompute block, full attnres": (2, ["--set", "train.recompute=block", "--set",
                                                 "residual=full_attnres"]),
    "fsdp 2, recompute sublayer": (2, ["--data", "fsdp", "--set", "train.recompute=sublayer"]),
    "fsdp 2, recompute block, prenorm fused": (2, ["--data", "fsdp", "--backend", "auto",
                                                   "--set", "train.recompute=block"]),
    "pipeline 2x1 x fsdp 2, recompute sublayer": (4, ["--pipeline", "2x1", "--data", "fsdp",
                                                      "--set", "train.recompute=sublayer"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_step_equals_one_process(case, tmp_path):
    n, args = CASES[case]
    out = tmp_path / "row.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", "-m", "restopo.train.layoutcheck", *args, "--out", str(out)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    row = json.loads(out.read_text())
    print(row)
    assert row["loss_err"] <= 1e-5
    assert row["grad_err"] <= 1e-5
    assert row["params_checked"] == row["params_total"]
    assert (row["recomputed"] > 0) == ("recompute" in case)


# -- resume across layouts ------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_across_layouts(tmp_path):
    """10 steps as pipeline 2x2 (a sharded checkpoint at step 10), then 10 more as FSDP 2
    and, from a copy, as one process: every loss equals an uninterrupted one-process run."""
    stopped = resumes_exactly(tmp_path, ["--set", "train.save_every=10", *SMALL], 10, 20,
                              first=["--pipeline", "2x2", "--nproc", 2],
                              then=["--data", "fsdp", "--nproc", 2])
    assert (stopped / "ckpt" / "step_000010" / "index.json").is_file()


@pytest.mark.slow
def test_fsdp_resumes_exactly_after_an_evaluation_at_the_save_step(tmp_path):
    """FSDP 2 evaluates at step 3 and saves there, then resumes (as FSDP 2, and from a copy
    as one process) to 6: every loss equals an uninterrupted one-process run. (FSDP2 keeps
    the root unit whole after a forward with no backward; the saved shards were then whole
    tensors and the resumed run drifted from step 5: 4.735983 against 4.765119.)"""
    resumes_exactly(tmp_path, small(save_every=3, eval_every=3), 3, 6,
                    first=["--data", "fsdp", "--nproc", 2], then=["--data", "fsdp", "--nproc", 2])


def resumes_exactly(tmp_path, run, stop: int, total: int, first, then):
    """`stop` steps laid out as `first`, then resumed to `total` as `then` and, from a copy,
    as one process: every loss equals an uninterrupted one-process run of `total` steps (a
    constant schedule, so that the first part's lr is the whole run's). Returns the folder
    of the first part as it was when it stopped (the copy, after its own resume)."""
    import shutil

    run = [*run, "--set", "train.schedule=constant"]
    single, split, alone = tmp_path / "single", tmp_path / "split", tmp_path / "alone"
    restopo("train", TINY, *run, "--steps", total, "--out", single)
    restopo("train", TINY, *run, "--steps", stop, "--out", split, *first)
    assert sorted(losses(split)) == list(range(1, stop + 1))  # it stopped: resumes follow
    shutil.copytree(split, alone)
    restopo("train", TINY, *run, "--steps", total, "--out", split, "--resume", *then)
    restopo("train", TINY, *run, "--steps", total, "--out", alone, "--resume")
    want = losses(single)
    for out in (split, alone):
        got = losses(out)
        assert sorted(got) == list(range(1, total + 1))
        for step in range(1, total + 1):
            assert got[step] == pytest.approx(want[step], abs=1e-5), (out.name, step)
    return alone


# -- two nodes --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_by_c10d_rendezvous(tmp_path):
    """`restopo train` under torchrun --nnodes 2 with a c10d rendezvous endpoint: two
    "nodes" of one process each on the loopback address run a 2-stage pipeline and follow
    the one-process losses."""
    single, out = tmp_path / "single", tmp_path / "two"
    args = ["--steps", 4, *SMALL]
    restopo("train", TINY, *args, "--out", single)
    port = _free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
         f"restopo-test-{port}", "--max-restarts", "0", "-m", "restopo", "train", TINY,
         *map(str, args), "--out", str(out), "--pipeline", "2x1"],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)]
    try:
        outs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(e[-3000:] for _, e in outs)
    assert "pipeline 2x1 (2 processes)" in "".join(e for _, e in outs)
    want, got = losses(single), losses(out)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=1e-5)


# -- layouts that cannot run ------------------------------------------------------------------
def _one_line(proc, *words):
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode != 0
    assert len(errors) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in errors[0], errors[0]
    for noise in ("Traceback", "ChildFailedError", "--resume"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("args,words", [
    # 8 sublayers, 16 rows: 3 stages leave 16 rows that 3 microbatches cannot split
    (["--pipeline", "3x2", "--nproc", "3"], ["3 microbatches", "multiple of 3"]),
    (["--pipeline", "8x2", "--nproc", "8"], ["16 chunks", "8 sublayers"]),
    (["--pipeline", "2x1", "--nproc", "3"], ["multiple of 2 processes", "--nproc 2"]),
    (["--set", "parallel.data=fsdp", "--nproc", "3"],
     ["train.batch (16)", "3 FSDP processes", "e.g. 18"]),
    (["--pipeline", "2x1", "--nproc", "2", "--recompute", "block"],
     ["train.recompute=block", "train.recompute=sublayer with a pipeline"]),
])
def test_bad_layout_is_one_line_before_any_process(args, words, tmp_path):
    proc = restopo("train", TINY, "--steps", 2, "--no-progress", "--out", tmp_path / "r",
                   *args, ok=False, timeout=60)
    _one_line(proc, *words)
    assert not (tmp_path / "r" / "ckpt").exists()


def test_bad_dist_timeout_is_one_line(tmp_path, monkeypatch):
    """$RESTOPO_DIST_TIMEOUT that is not a number of seconds: refused before any process
    starts, and by each worker's setup (under plain torchrun), in one line; it was a
    ValueError traceback from every worker."""
    from restopo.train.dist import setup

    for bad in ("abc", "0", "-5", "inf"):
        proc = subprocess.run([sys.executable, "-m", "restopo", "train", TINY, "--steps", "2",
                               "--no-progress", "--out", str(tmp_path / "r"), "--nproc", "2"],
                              env=dict(env(), RESTOPO_DIST_TIMEOUT=bad), capture_output=True,
                              text=True, timeout=60)
        _one_line(proc, "$RESTOPO_DIST_TIMEOUT", repr(bad))
        assert not (tmp_path / "r" / "ckpt").exists()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RESTOPO_DIST_TIMEOUT", "abc")
    with pytest.raises(RuntimeError, match=r"RESTOPO_DIST_TIMEOUT must be .* got 'abc'"):
        setup("cpu")


@pytest.mark.slow
def test_bad_layout_under_torchrun_is_said_once(tmp_path):
    """Under plain torchrun every worker meets the mistake; rank 0 says it, once."""
    cmd = [sys.executable, "-m", "restopo.train.torchrun", "--standalone",
           "--nproc-per-node=2", "-m", "restopo", "train", TINY, "--steps", "2",
           "--no-progress", "--out", str(tmp_path / "r"), "--pipeline", "3x1"]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    _one_line(proc, "--pipeline 3x1", "multiple of 3 processes")


@pytest.mark.slow
def test_checkpoint_that_does_not_fit_is_one_line(tmp_path):
    """A sharded checkpoint resumed by a spec whose tensors differ: one line from rank 0
    naming what differs (the model field, found before any tensor is read)."""
    spec = tmp_path / "t.restopo"
    text = open(TINY).read().replace("width: 64", "width: 32").replace("steps: 600",
                                                                         "steps: 2")
    spec.write_text(text)
    out = tmp_path / "run"
    base = ["--set", "train.save_every=2", *SMALL[2:], "--out", out,
            "--set", "parallel.data=fsdp", "--nproc", 2]
    restopo("train", spec, *base)
    spec.write_text(text.replace("width: 32", "width: 48"))
    proc = restopo("train", spec, *base, "--resume", ok=False)
    line = _one_line(proc, "weights do not fit this run's model", "width 32 there, 48 here")
    print(line)


# -- layoutcheck reads its flags as train does ------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["--set", "model.width=48", "--set", "train.recompute=block"],
    ["--data", "fsdp", "--set", "parallel.data=fsdp"],
    ["--set", "model.widht=48"],                                      # unknown key
    ["--set", "model.width=abc"],                                     # a value of another kind
    ["--set", "model.width=48", "--set", "model. width=64"],          # one key twice
    ["--set", "residual.blocks=2", "--set", "residual.block_size=4"],  # one setting twice
    ["--data", "fsdp", "--set", "parallel.data=ddp"],                  # flag and --set disagree
    ["--data", "fsdpp"],                                              # not a data engine
])
def test_layoutcheck_reads_set_and_data_as_train_does(argv, capsys):
    """layoutcheck's --set and --data give the spec `restopo train` gives (the same one
    parsing of overrides), or the same error: it had kept the last of a key given twice, and
    --data xyz was a --set the person never wrote."""
    from restopo.cli import build_parser
    from restopo.commands.train import _overrides, _Stop
    from restopo.spec import SpecError, parse_spec
    from restopo.train import layoutcheck

    def outcome(parse, overrides):
        try:
            args = parse()
        except SystemExit as e:  # argparse's usage error: its message, less the prog name
            return "usage", e.code, capsys.readouterr().err.splitlines()[-1].split("error: ")[1]
        try:
            spec = parse_spec(layoutcheck.SPEC, path="<layoutcheck>", overrides=overrides(args))
        except (ValueError, _Stop) as e:
            return "refused", str(e)
        except SpecError as e:
            return "spec", e.render()
        return "ok", spec

    train = outcome(lambda: build_parser().parse_args(["train", "x.restopo", *argv]),
                    _overrides)
    check = outcome(lambda: layoutcheck.parse_args(argv), layoutcheck.overrides)
    assert check == train


def test_layoutcheck_says_a_spec_mistake_in_one_line(capsys):
    """A bad --set is the rendered spec error restopo train prints, not a traceback."""
    from restopo.train import layoutcheck

    assert layoutcheck.main(["--set", "model.widht=48"]) == 1
    err = capsys.readouterr().err
    assert "<--set 1>:1:13: error: unknown key 'widht' in model" in err and "Traceback" not in err
