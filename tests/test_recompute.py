"""Activation recompute (train.recompute, restopo.fx.recompute; issue 11).

- every topology, both modes: the loss and every gradient equal recompute=none (fp64 to
  1e-12, fp32 to 1e-6), with the regions really run again in backward;
- the bytes a forward leaves alive for backward (restopo.nn.activations.held_bytes) fall:
  sublayer < none and block <= sublayer, figures printed;
- a training run with recompute gives the losses of one without, and resumes exactly;
- the spec key and its mistakes; the model's state_dict and code are unchanged by it.
"""
import os
from types import SimpleNamespace

import pytest
import torch

from restopo import topology as T
from restopo.api import build_model
from restopo.fx import recompute
from restopo.nn.activations import held_bytes
from test_lower_fp64 import randomise, topologies

VOCAB = 37
TINY = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny.restopo")


def cfg(depth=3, width=32, context=16):
    return SimpleNamespace(vocab=VOCAB, width=width, depth=depth, heads=2, mlp="swiglu",
                           mlp_ratio=2, context=context)


def multistream(depth):
    k = T.sublayer_kinds(depth)
    yield "hc4", T.hyper_connections(k, 4)
    yield "hc4_dynamic", T.hyper_connections(k, 4, dynamic=True)
    yield "mhc4", T.mhc(k, 4)
    yield "mhc_lite3", T.mhc_lite(k, 3)


CASES = list(topologies(3)) + list(multistream(3))


def model(topo, mode, *, dtype=torch.float64, backend="eager", depth=3, seed=0, **size):
    torch.manual_seed(seed)
    m = randomise(build_model(cfg(depth, **size), topo, backend=backend).to(dtype), seed)
    return recompute.apply(m, mode)


def loss_and_grads(m, idx):
    loss = m(idx).logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


def count_recomputed(m) -> list:
    """Sublayer forwards that run in backward (a region's recomputation)."""
    seen = []
    for s in m.sublayers:
        s.register_forward_pre_hook(
            lambda *_: seen.append(1) if torch._C._current_graph_task_id() >= 0 else None)
    return seen


@pytest.mark.parametrize("mode", ["sublayer", "block"])
@pytest.mark.parametrize("name,topo", CASES, ids=[c[0] for c in CASES])
def test_recompute_equals_none_fp64(name, topo, mode):
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    want_loss, want = loss_and_grads(model(topo, "none"), idx)
    m = model(topo, mode)
    again = count_recomputed(m)
    loss, got = loss_and_grads(m, idx)
    assert again, "nothing was recomputed in backward"
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    assert got.keys() == want.keys()
    for n in want:
        assert (got[n] is None) == (want[n] is None), n
        if want[n] is not None:
            torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-12, msg=n)


FP32 = ["standard", "full", "block2", "denseformer", "rezero", "mhc4"]


@pytest.mark.parametrize("backend", ["eager", "auto"])
@pytest.mark.parametrize("mode", ["sublayer", "block"])
@pytest.mark.parametrize("name", FP32)
def test_recompute_equals_none_fp32(name, mode, backend):
    """float32, and the lowering `restopo train` uses (auto: the PreNorm fused into phase 2)."""
    topo = dict(CASES)[name]
    idx = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    want_loss, want = loss_and_grads(model(topo, "none", dtype=torch.float32,
                                           backend=backend), idx)
    loss, got = loss_and_grads(model(topo, mode, dtype=torch.float32, backend=backend), idx)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    for n in want:
        if want[n] is not None:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["full", "block2", "full_input_dependent"])
def test_recompute_under_saved_tensor_hooks(name):
    """A forward under the caller's saved_tensors_hooks (a memory probe such as
    bench/overhead.py's): checkpoint then hands the region's recomputation other tensor
    objects for the same inputs, and the logits made outside it must still be found."""
    topo = dict(CASES)[name]
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    want_loss, want = loss_and_grads(model(topo, "none"), idx)
    m = model(topo, "block")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = m(idx).logsumexp(-1).mean()
    loss.backward()
    torch.testing.assert_close(loss.detach(), want_loss, rtol=0, atol=1e-12)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-12, atol=1e-12, msg=n)


HELD = ["standard", "full", "block2", "denseformer", "rezero", "highway", "hc4_dynamic",
        "mhc4"]


@pytest.mark.parametrize("name", HELD)
def test_held_bytes_fall(name):
    """width 32, depth 4, context 16, batch 4: what the forward leaves for backward."""
    topo = dict(list(topologies(4)) + list(multistream(4)))[name]
    idx = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    held = {}
    for mode in recompute.MODES:
        m = model(topo, mode, dtype=torch.float32, depth=4)
        held[mode], loss = held_bytes(lambda: m(idx).logsumexp(-1).mean())
        loss.backward()
    print(f"{name}: held KiB " + ", ".join(f"{k} {v / 1024:.1f}" for k, v in held.items())
          + f" (sublayer/none {held['sublayer'] / held['none']:.3f}, "
          f"block/none {held['block'] / held['none']:.3f})")
    assert held["sublayer"] < held["none"]
    assert held["block"] <= held["sublayer"]


def test_held_bytes_counts_what_backward_keeps():
    """The measure itself, on ops whose saved tensors are known: exp saves its output
    (kept), a sum saves nothing."""
    x = torch.randn(1000, requires_grad=True)
    kept, out = held_bytes(lambda: x.exp().exp().sum())
    assert kept == 2 * 4000 + 4  # two exp outputs, the scalar result
    assert held_bytes(lambda: (x * 2).sum())[0] == 4


@pytest.mark.parametrize("name,mode", [("full", "block"), ("full", "sublayer"),
                                       ("denseformer", "block"), ("denseformer", "sublayer")])
def test_every_source_is_kept_once(name, mode):
    """Full-width wiring: every point reads all earlier outputs, and each is kept once: the
    bytes kept grow by a few d-sized values per sublayer, the same at every depth (a copy per
    read, as DenseFormer's stacked sum kept before, grows with depth: O(L^2)). Width 128, so
    that AttnRes's own per-(point, source) logits, [B, T] each, stay small beside a value."""
    make = {"full": T.full_attnres, "denseformer": T.denseformer}[name]
    idx = torch.randint(0, VOCAB, (4, 16))
    held = []
    for depth in (2, 4, 8):
        m = model(make(T.sublayer_kinds(depth)), mode, dtype=torch.float32, depth=depth,
                  width=128)
        got, loss = held_bytes(lambda: m(idx).logsumexp(-1).mean())
        held.append(got)
    value = 4 * 16 * 128 * 4  # one [B, T, d] float32 tensor
    # depth 2 -> 4 adds 4 sublayers, 4 -> 8 adds 8
    per_sublayer = [(held[1] - held[0]) / 4, (held[2] - held[1]) / 8]
    print(f"{name}, {mode}: held bytes at depth 2, 4, 8: {held}; per added sublayer "
          f"{per_sublayer} (one value: {value})")
    assert all(value <= p < 3 * value for p in per_sublayer), (held, per_sublayer)
    assert per_sublayer[1] < 1.25 * per_sublayer[0]


def test_state_dict_and_names_unchanged():
    topo = dict(CASES)["block2"]
    plain = model(topo, "none", backend="auto")
    for mode in ("sublayer", "block"):
        m = model(topo, mode, backend="auto")
        assert list(m.state_dict()) == list(plain.state_dict())
        assert [n for n, _ in m.named_parameters()] == [n for n, _ in plain.named_parameters()]
        m.load_state_dict(plain.state_dict())  # strict, both ways
        plain.load_state_dict(m.state_dict())
    assert "regions" in model(topo, "block").code


def test_apply_refuses_what_it_cannot_do():
    m = model(dict(CASES)["standard"], "sublayer")
    with pytest.raises(ValueError, match="already recomputes"):
        recompute.apply(m, "block")
    with pytest.raises(ValueError, match="none, sublayer, block"):
        recompute.apply(m, "layer")
    with pytest.raises(ValueError, match="not built by restopo"):
        recompute.apply(torch.nn.Linear(2, 2), "block")


def test_regions_are_transformer_layers():
    assert recompute.layer_of(T.sublayer_kinds(3)) == [0, 0, 1, 1, 2, 2]
    assert recompute.layer_of(("mlp", "attn", "mlp", "mlp", "attn")) == [0, 1, 1, 1, 2]


# -- training -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from restopo.train.data import open_corpus

    return open_corpus("builtin:stdlib", cache_dir=tmp_path_factory.mktemp("cache"),
                       progress=False)


def test_training_with_recompute_resumes_exactly(tmp_path, corpus):
    """Block recompute: the losses of a run without recompute (fp32, 1e-6); stopped during
    step 7 and resumed from step 4, exactly the uninterrupted losses."""
    from test_train_loop import Stop, _stopping, cfg as train_cfg, records, tiny_model

    from restopo.train.checkpoint import latest_checkpoint
    from restopo.train.loop import train

    torch.set_num_threads(1)
    c = train_cfg(steps=8, save_every=4, eval_every=4)
    plain, full, part = tmp_path / "plain", tmp_path / "full", tmp_path / "part"
    train(tiny_model(), corpus, c, plain, progress=False)
    train(recompute.apply(tiny_model(), "block"), corpus, c, full, progress=False)
    with pytest.raises(Stop):
        train(_stopping(recompute.apply(tiny_model(), "block"), 6), corpus, c, part,
              progress=False)
    resume = latest_checkpoint(part / "ckpt")
    assert resume.name == "step_000004"
    train(recompute.apply(tiny_model(seed=123), "block"), corpus, c, part, progress=False,
          resume_from=resume)
    a, b, p = records(full), records(part), records(plain)
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb, rp in zip(a, b, p):
        assert rb["loss"] == ra["loss"] and rb.get("val_loss") == ra.get("val_loss")
        assert ra["loss"] == pytest.approx(rp["loss"], abs=1e-6)


# -- the spec key ---------------------------------------------------------------------------
def test_spec_key_and_its_mistakes():
    from restopo.spec import SpecError, load_spec

    tiny = TINY
    assert load_spec(tiny).train.recompute == "none"
    assert load_spec(tiny, overrides=("train.recompute=block",)).train.recompute == "block"
    with pytest.raises(SpecError) as e:
        load_spec(tiny, overrides=("train.recompute=blocks",))
    assert "unknown recompute 'blocks'" in str(e.value) and "did you mean 'block'" in str(e.value)


def test_cli_flag_is_the_override():
    from restopo.cli import build_parser
    from restopo.commands.train import _overrides, _worker_argv

    args = build_parser().parse_args(["train", TINY, "--recompute", "sublayer"])
    assert _overrides(args) == ("train.recompute=sublayer",)
    assert "--recompute" in _worker_argv(args)  # torchrun workers get it too


def test_recompute_bench_quick(capsys):
    """bench/recompute.py runs (CI-size smoke) and prints a row per topology and mode."""
    from file_modules import bench as load_bench

    bench = load_bench("recompute")
    assert bench.main(["--quick", "--iters", "1", "--only", "standard,full"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["standard"], ["full"])]
    assert [r[:2] for r in rows] == [[t, m] for t in ("standard", "full")
                                     for m in ("none", "sublayer", "block")]
    for r in rows:
        held_ratio = float(r[3])
        assert held_ratio == 1.0 if r[1] == "none" else held_ratio < 1.0
