"""The training loop: schedule, optimizer groups, falling loss, exact resume, metrics, plot."""
import json
import math

import numpy as np
import pytest
import torch

from restopo.api import build_model
from restopo.spec.objects import ModelSpec
from restopo.topology import block_attnres
from restopo.train.data import Corpus, open_corpus
from restopo.train.loop import TrainConfig, TrainingError, lr_at, param_groups, train

TINY = ModelSpec(vocab=256, width=32, depth=2, heads=4, context=32)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return build_model(TINY, block_attnres(TINY.kinds, blocks=2), backend="eager")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models train fastest on one thread (and the test machine's cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return open_corpus("builtin:stdlib", cache_dir=tmp_path_factory.mktemp("cache"),
                       progress=False)


def cfg(**kw):
    base = dict(steps=30, batch=8, context=32, lr=3e-3, warmup=5, eval_every=10,
                eval_batches=2, save_every=10, log_every=1, seed=0)
    return TrainConfig(**{**base, **kw})


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_schedule_warmup_cosine_constant():
    c = cfg(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, c) for s in range(100)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])  # linear warmup
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))               # cosine decays
    mid = 10 + (100 - 10 - 1) / 2
    assert lr_at(int(mid), c) == pytest.approx(0.55, abs=0.02)
    assert cfg(steps=100, warmup=0, lr=0.5, schedule="constant").min_lr is None
    assert [lr_at(s, cfg(steps=50, warmup=0, lr=0.5, schedule="constant"))
            for s in (0, 25, 49)] == [0.5] * 3
    assert lr_at(99, cfg(steps=100, warmup=10, lr=1.0)) == pytest.approx(0.1)  # lr / 10


def test_weight_decay_on_matrices_only():
    model = tiny_model()
    decay, keep = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in keep["params"])
    queries = {id(m.pseudo_query) for m in model.modules() if hasattr(m, "pseudo_query")}
    assert queries and queries <= {id(p) for p in keep["params"]}
    n = sum(p.numel() for g in (decay, keep) for p in g["params"])
    assert n == sum(p.numel() for p in model.parameters())  # tied weights counted once


def test_loss_falls_and_files_are_written(tmp_path, corpus):
    out = tmp_path / "run"
    summary = train(tiny_model(), corpus, cfg(), out, progress=False, meta={"spec_text": "s"})
    recs = records(out)
    assert [r["step"] for r in recs] == list(range(1, 31))
    first, last = np.mean([r["loss"] for r in recs[:3]]), np.mean([r["loss"] for r in recs[-3:]])
    assert first == pytest.approx(math.log(256), abs=0.3)  # zero-init mean mixing: ~uniform
    assert last < first - 1.0
    vals = [r["val_loss"] for r in recs if r["val_loss"] is not None]
    assert len(vals) == 3 and vals[-1] < vals[0]
    assert set(recs[1]) == {"step", "loss", "val_loss", "lr", "tokens_per_s", "elapsed"}
    assert set(recs[0]) == set(recs[1]) - {"tokens_per_s"}  # the first step's is no step's
    assert (out / "loss.png").stat().st_size > 1000
    assert summary["checkpoint"].endswith("step_000030") and summary["val_loss"] == vals[-1]
    meta = json.loads((out / "ckpt" / "step_000030" / "meta.json").read_text())
    assert meta["spec_text"] == "s" and meta["step"] == 30


class Stop(Exception):
    pass


def _stopping(model, after_calls):
    """The model raises on its `after_calls`-th forward in training mode (a crash)."""
    calls = {"n": 0}
    forward = model.forward

    def wrapped(idx):
        if model.training:
            calls["n"] += 1
            if calls["n"] > after_calls:
                raise Stop
        return forward(idx)

    model.forward = wrapped
    return model


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_gives_exactly_the_uninterrupted_losses(tmp_path, corpus, accum):
    c = cfg(steps=12, save_every=4, eval_every=4, accum=accum)
    full = tmp_path / "full"
    train(tiny_model(), corpus, c, full, progress=False)
    part = tmp_path / "part"
    with pytest.raises(Stop):  # dies during step 7; the last checkpoint is step 4
        train(_stopping(tiny_model(), 6 * accum), corpus, c, part, progress=False)
    from restopo.train.checkpoint import latest_checkpoint

    resume = latest_checkpoint(part / "ckpt")
    assert resume.name == "step_000004"
    # a fresh model with other initial weights: everything must come from the checkpoint
    train(tiny_model(seed=123), corpus, c, part, progress=False, resume_from=resume)
    a, b = records(full), records(part)
    assert [r["step"] for r in b] == list(range(1, 13))  # steps 5-6 logged before the crash
    for ra, rb in zip(a, b):                             # were replaced, not duplicated
        assert rb["loss"] == ra["loss"] and rb["val_loss"] == ra["val_loss"]
        assert rb["lr"] == ra["lr"]


def test_resume_trains_on_with_this_runs_weight_decay(tmp_path, corpus):
    """A resume with another train.weight_decay kept the checkpoint's (load_state_dict
    brings back the saved group settings) while the run said it used the new one. One step
    from one checkpoint with weight decay 0 and W: AdamW's decay is decoupled, so the
    matrices end lr * W * their checkpoint weights apart, and the vectors equal."""
    from restopo.train.checkpoint import load_checkpoint

    c = cfg(steps=2, save_every=2, eval_every=0, schedule="constant", warmup=0)
    train(tiny_model(), corpus, c, tmp_path / "run", progress=False)
    ckpt = tmp_path / "run" / "ckpt" / "step_000002"
    saved = tiny_model(seed=1)
    load_checkpoint(ckpt, saved)
    after = {}
    for wd in (0.0, 0.5):
        model = tiny_model(seed=1)
        train(model, corpus, cfg(**{**c.__dict__, "steps": 3, "weight_decay": wd}),
              tmp_path / f"wd{wd}", progress=False, resume_from=ckpt)
        after[wd] = dict(model.named_parameters())
    for name, p in saved.named_parameters():
        apart = (after[0.5][name] - after[0.0][name]).detach()
        want = -c.lr * 0.5 * p.detach() if p.ndim >= 2 else torch.zeros_like(p)
        torch.testing.assert_close(apart, want, rtol=1e-3, atol=1e-9, msg=name)


def test_evaluation_goes_forward_in_the_pieces_a_training_step_does(tmp_path, corpus):
    """With accum, a step's rows go forward in pieces (what lets a model fit in memory),
    but evaluation put a whole batch through at once: a run that fit only thanks to
    accumulation ran out of memory at its first evaluation. Its loss is still the mean over
    every row of the validation batches."""
    import torch.nn.functional as F

    from restopo.train.data import fixed_batches

    model = tiny_model()
    rows = []
    model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    c = cfg(steps=2, batch=8, accum=4, eval_every=2, eval_batches=2, save_every=0)
    train(model, corpus, c, tmp_path, progress=False)
    assert set(rows) == {2} and len(rows) == 2 * 4 + 2 * 4  # training, then evaluation
    model.eval()
    with torch.no_grad():  # the final weights: step 2's evaluation comes after its update
        want = np.mean([F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                        for x, y in fixed_batches(corpus.val, c.context, c.batch, 2)])
    assert records(tmp_path)[-1]["val_loss"] == pytest.approx(want, rel=1e-6)


def test_a_run_stopped_at_once_says_where_resume_goes_on(tmp_path, corpus):
    """A second Ctrl-C stops mid-step: the run ended with a bare 'interrupted', not saying
    whether anything was saved (the first Ctrl-C's stop names its checkpoint)."""
    def interrupted(model, after_calls):
        model = _stopping(model, after_calls)
        forward = model.forward

        def wrapped(idx):
            try:
                return forward(idx)
            except Stop:
                raise KeyboardInterrupt from None
        model.forward = wrapped
        return model

    with pytest.raises(KeyboardInterrupt) as e:  # in step 7: step 4 is saved
        train(interrupted(tiny_model(), 6), corpus, cfg(save_every=4), tmp_path / "a",
              progress=False)
    assert str(e.value) == ("stopped at once; --resume continues from its newest "
                            f"checkpoint {tmp_path / 'a' / 'ckpt' / 'step_000004'}")
    with pytest.raises(KeyboardInterrupt) as e:
        train(interrupted(tiny_model(), 2), corpus, cfg(save_every=4), tmp_path / "b",
              progress=False)
    assert "before the run's first checkpoint" in str(e.value) and "--overwrite" in str(e.value)


def nan_head_model():
    """A tiny model whose loss is NaN from the first step."""
    model = tiny_model()
    with torch.no_grad():
        model.get_submodule("head").apply(
            lambda m: m.weight.fill_(float("nan")) if hasattr(m, "weight") else None)
    return model


def test_diverging_loss_is_a_clear_error(tmp_path, corpus):
    model = nan_head_model()
    with pytest.raises(TrainingError, match="loss became nan at step 1 .no checkpoint was "
                                            "saved.; lower train.lr"):
        train(model, corpus, cfg(steps=3), tmp_path, progress=False)
    # recorded, so that compare can say the run diverged rather than call it unfinished
    assert records(tmp_path)[-1]["step"] == 1 and records(tmp_path)[-1]["diverged"] == "nan"
    assert (tmp_path / "loss.png").stat().st_size > 1000  # the curve up to there, drawn


def test_a_loss_diverged_between_log_lines_saves_no_checkpoint_of_it(tmp_path, corpus):
    """The loss was read only where a line was logged: a loss gone NaN at step 3, logged
    every 10 steps, trained on to step 10, and the checkpoints of steps 4, 6 and 8 (all NaN
    weights, train.keep deleting the good ones) were written over the run's last good
    one. The run now stops at the first save or line after it, named, with step 2 kept."""
    from safetensors.torch import load_file

    from restopo.train.checkpoint import latest_checkpoint

    model = tiny_model()
    nans = {"n": 0}

    def poison(module, args, output):  # the head's output NaN from the third step on
        nans["n"] += module.training
        return output * float("nan") if nans["n"] >= 3 else output
    model.get_submodule("head").register_forward_hook(poison)
    with pytest.raises(TrainingError, match=r"loss became nan at step 3 \(checkpoints stop "
                                            r"at step 2, before it\); lower train.lr"):
        train(model, corpus, cfg(steps=12, save_every=2, log_every=10, eval_every=0, keep=1),
              tmp_path, progress=False)
    assert latest_checkpoint(tmp_path / "ckpt").name == "step_000002"
    weights = load_file(tmp_path / "ckpt" / "step_000002" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert records(tmp_path)[-1] == {**records(tmp_path)[-1], "step": 3, "diverged": "nan"}


def test_the_loss_is_read_once_at_a_step_that_logs_and_saves(tmp_path, corpus, monkeypatch):
    """A step that both logged a line and saved read the device's loss flags twice (a wait
    for the device each, and under torchrun an exchange): once per such step is enough."""
    import restopo.train.loop as loop
    reads, read = [], loop.read_diverged
    monkeypatch.setattr(loop, "read_diverged", lambda *a: reads.append(1) or read(*a))
    c = cfg(steps=6, log_every=2, save_every=3, eval_every=0)
    logs = {d for d in range(1, c.steps + 1) if d % c.log_every == 0 or d in (1, c.steps)}
    saves = {d for d in range(1, c.steps + 1) if d % c.save_every == 0 or d == c.steps}
    train(tiny_model(), corpus, c, tmp_path, progress=False)
    assert logs & saves and len(reads) == len(logs | saves)


def test_weights_gone_nan_at_a_step_whose_loss_was_finite_are_not_saved(tmp_path, corpus):
    """Gradients that overflowed at step 4 (its loss finite) made NaN weights (clipping an
    infinite norm), which step 4's checkpoint saved over step 2's (train.keep 1): the loss
    check saw NaN only at step 5. The weights are now checked before each save."""
    from safetensors.torch import load_file

    from restopo.experiments.runs import read_run
    from restopo.train.checkpoint import latest_checkpoint

    model = tiny_model()
    calls = {"n": 0}

    def overflow(grad):  # one weight's gradient infinite at the fourth step
        calls["n"] += 1
        return grad * math.inf if calls["n"] == 4 else grad
    next(model.parameters()).register_hook(overflow)
    c = cfg(steps=12, save_every=2, log_every=10, eval_every=0, keep=1)
    with pytest.raises(TrainingError, match=r"the weights became nan by step 4 \(checkpoints "
                                            r"stop at step 2, before it\); the gradients "
                                            r"overflowed though the loss was finite: lower "
                                            rf"train.lr \(now {c.lr:g}\)"):
        train(model, corpus, c, tmp_path, progress=False)
    assert all(math.isfinite(r["loss"]) for r in records(tmp_path) if "loss" in r)
    assert latest_checkpoint(tmp_path / "ckpt").name == "step_000002"
    weights = load_file(tmp_path / "ckpt" / "step_000002" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert read_run(tmp_path).progress == "diverged at step 4: weights nan"


def test_a_plot_that_fails_does_not_hide_why_the_run_stopped(tmp_path, corpus, monkeypatch,
                                                             capsys):
    import restopo.train.loop as loop
    monkeypatch.setattr(loop, "plot_losses", lambda *a, **k: 1 / 0)
    model = nan_head_model()
    with pytest.raises(TrainingError, match="loss became nan"):
        train(model, corpus, cfg(steps=3), tmp_path, progress=False)
    assert "loss.png was not redrawn (ZeroDivisionError" in capsys.readouterr().err


def test_batch_must_split_over_accumulation(tmp_path):
    data = Corpus(np.arange(1000, dtype=np.uint16) % 256, np.arange(200, dtype=np.uint16),
                  256, "t")
    from restopo.train.data import DataError

    with pytest.raises(DataError, match="must split evenly over 1 data replica x 4 "
                                        "accumulation steps$"):
        train(tiny_model(), data, cfg(batch=6, accum=4), tmp_path, progress=False)


def test_a_layout_whose_batch_does_not_split_says_it_in_words():
    """The layout said 'over 2 process(es) x 4 accumulation step(s)' (and the loop, above,
    'data replica(s)'); each count now comes with its noun in the number it has."""
    from restopo.spec import parse_spec
    from restopo.train.layout import Layout, LayoutError, check_layout
    spec = parse_spec("model { vocab: 256; width: 32; depth: 2; heads: 4; context: 16 }\n"
                      "residual standard\ntrain { batch: 4; accum: 4 }\n")
    with pytest.raises(LayoutError, match="must split evenly over 2 processes x 4 "
                                          "accumulation steps;"):
        check_layout(spec, Layout(2))


def test_tensorboard_gets_the_same_scalars_when_installed(tmp_path, corpus, monkeypatch):
    import sys
    import types

    written = []

    class FakeWriter:
        def __init__(self, logdir, purge_step=None):
            written.append(("dir", logdir))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append(("closed",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=FakeWriter))
    train(tiny_model(), corpus, cfg(steps=3, eval_every=3, save_every=3), tmp_path,
          progress=False)
    assert written[0] == ("dir", str(tmp_path / "tensorboard")) and written[-1] == ("closed",)
    losses = {step: v for tag, v, step in (w for w in written if w[0] == "loss")}
    assert losses == {r["step"]: r["loss"] for r in records(tmp_path)}
    assert ("val_loss", records(tmp_path)[-1]["val_loss"], 3) in written


def test_tensorboard_forgets_the_steps_a_resume_trains_again(tmp_path, corpus, monkeypatch):
    """metrics.jsonl drops the steps after the checkpoint a run resumes from, and a new run
    deletes it; TensorBoard kept both (a resume's steps drawn twice, an --overwrite's curve
    over the old run's). Its writer is told to purge them, and a new run's folder goes."""
    import sys
    import types

    purges = []

    class FakeWriter:
        def __init__(self, logdir, purge_step=None):
            purges.append(purge_step)
            (tmp_path / "tensorboard").mkdir(exist_ok=True)
            (tmp_path / "tensorboard" / f"events.{len(purges)}").write_text("")

        def add_scalar(self, tag, value, step):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=FakeWriter))
    c = cfg(steps=4, save_every=2, eval_every=0)
    train(tiny_model(), corpus, c, tmp_path, progress=False)
    train(tiny_model(), corpus, c, tmp_path, progress=False,
          resume_from=tmp_path / "ckpt" / "step_000002")
    assert purges == [None, 3]  # steps 3 and 4 ran again
    assert {p.name for p in (tmp_path / "tensorboard").iterdir()} == {"events.1", "events.2"}
    train(tiny_model(), corpus, c, tmp_path, progress=False)  # a new run (--overwrite)
    assert [p.name for p in (tmp_path / "tensorboard").iterdir()] == ["events.3"]


def test_a_compile_failing_after_a_stop_was_asked_is_that_stop(tmp_path):
    """Ctrl-C reaches the C++ compiler torch.compile runs in the first step (one process
    group): its failure came out as a 110-line compiler traceback, exit 1, right after the
    run had said it would stop. Once a stop is asked, a compile failure is the stop."""
    from restopo.train.interrupt import Stop
    from restopo.train.loop import StoppedEarly, _compile_stopped

    CompileFailed = type("CppCompileError", (RuntimeError,), {"__module__": "torch._inductor.exc"})
    stop = Stop()
    with pytest.raises(CompileFailed):  # no stop asked: the compiler's error as it is
        with _compile_stopped(stop, StoppedEarly(0, None, tmp_path)):
            raise CompileFailed("g++ failed")
    stop.asked = True
    with pytest.raises(StoppedEarly) as e:
        with _compile_stopped(stop, StoppedEarly(0, None, tmp_path)):
            raise CompileFailed("g++ failed")
    assert "stopped after step 0, before its first checkpoint" in str(e.value)
    with pytest.raises(ValueError):  # another failure is not taken for the stop
        with _compile_stopped(stop, StoppedEarly(0, None, tmp_path)):
            raise ValueError("a bug")


def test_the_divergence_record_holds_no_graph_of_a_loss():
    """first_diverged keeps [step, loss] on the device across steps: a step's loss that
    still held its graph (a stepper that returned it undetached) would chain every step's
    graph, and its activations, to the record."""
    from restopo.train.loop import first_diverged
    w = torch.ones((), requires_grad=True)
    seen = torch.zeros(2, dtype=torch.float64).unbind()
    for step, value in enumerate([2.0, float("nan"), 3.0], start=1):
        seen = first_diverged(seen, w * value, step)
    assert all(t.grad_fn is None and not t.requires_grad for t in seen)
    assert seen[0].item() == 2 and seen[1].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_divergence_record_keeps_the_first_loss_not_finite_in_six_ops(dtype):
    """first_diverged runs at every step: it keeps the step and value (nan, inf or -inf) of
    the first loss that is not finite, as a plain loop over the losses finds them, with six
    small ops on the device and no read of the loss (it had 13)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from restopo.train.loop import first_diverged

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, op, types, args=(), kwargs=None):
            self.names.append(op.__name__)
            return op(*args, **(kwargs or {}))

    inf, nan = float("inf"), float("nan")
    for losses in ([1.5, 3e38], [2.0, -inf, nan, 1.0], [nan, inf], [0.0, inf, -inf], [-2.0]):
        losses = [torch.tensor(value, dtype=dtype) for value in losses]
        seen, ops = torch.zeros(2, dtype=torch.float64).unbind(), Ops()
        for step, loss in enumerate(losses, start=1):
            with ops:
                seen = first_diverged(seen, loss, step)
        want = next(((step, loss.item()) for step, loss in enumerate(losses, start=1)
                     if not math.isfinite(loss.item())), (0, 0.0))
        at, value = torch.stack(seen).tolist()
        assert (at, str(value)) == (want[0], str(want[1]))  # str: nan == nan
        assert len(ops.names) <= 6 * len(losses) and "_local_scalar_dense" not in ops.names
