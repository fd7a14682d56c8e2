"""restopo.rewire on a nanoGPT-style GPT (tests/models/nanogpt.py), in float64."""
import inspect

import pytest
import torch

import restopo
from restopo.fx.rewire import RewireError, rewire
from restopo.spec import SpecError

from models import attnres_loop as loop
from models.rewired import gpt_losses, randomise
from models.nanogpt import GPT, GPTConfig, NoResidualGPT, PostNormGPT


def gpt(n_layer=2, cls=GPT, seed=0):
    torch.manual_seed(seed)
    return cls(GPTConfig(n_layer=n_layer)).double()


def tokens(T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, T), generator=g), torch.randint(0, 128, (2, T), generator=g)


def test_standard_spec_leaves_logits_and_loss_unchanged():
    m = gpt()
    idx, targets = tokens()
    r = rewire(m, "residual standard\n")
    logits, loss = r(idx)
    want_logits, want_loss = m(idx)
    assert loss is None and want_loss is None
    assert logits.shape == (2, 1, 128)  # nanoGPT's inference shortcut is kept
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-12)
    logits, loss = r(idx, targets)
    want_logits, want_loss = m(idx, targets=targets)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)


def test_one_sequence_without_a_batch_is_refused_naming_the_shape():
    """A rewired nanoGPT failed on token ids [T] with an IndexError in its traced front; it
    refuses them as restopo.compile's model does (restopo.nn.sublayers.check_batched)."""
    idx, _ = tokens()
    r = rewire(gpt(), "residual standard\n")
    with pytest.raises(ValueError, match=r"token ids \[batch, T\]; got shape \(12,\)"):
        r(idx[0])
    assert r(idx[:1])[0].shape == (1, 1, 128)


def test_token_ids_outside_the_vocabulary_are_named():
    """They failed with an IndexError inside the traced front's embedding; now refused as
    restopo.compile's model refuses them (restopo.nn.sublayers.token_ids_in)."""
    idx, _ = tokens()
    r = rewire(gpt(), "residual standard\n")
    for bad in (128, -1):
        with pytest.raises(ValueError, match=f"token id {bad}, outside the model's "
                                             f"vocabulary 0..127"):
            r(torch.cat([idx, torch.tensor([[bad], [0]])], dim=1))


def test_same_call_signature_and_output_type():
    m = gpt()
    r = rewire(m, "residual full_attnres\n")
    assert inspect.signature(r) == inspect.signature(m.forward)
    idx, targets = tokens()
    out = r(idx, targets=targets)
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0].shape == (2, 12, 128) and out[1].dim() == 0


@pytest.mark.parametrize("spec, blocks", [
    ("residual full_attnres\n", lambda: loop.full_blocks(6)),
    ("residual block_attnres(blocks: 2)\n", lambda: loop.layer_blocks(3, 2)),  # 2 does not divide 3
    ("residual block_attnres(blocks: 1)\n", lambda: loop.layer_blocks(3, 1)),
    ("residual block_attnres(blocks: 3)\n", lambda: loop.layer_blocks(3, 3)),
])
def test_zero_queries_take_the_mean_of_the_sources(spec, blocks):
    m = gpt(n_layer=3)
    idx, targets = tokens()
    r = rewire(m, spec)
    assert all(torch.all(a.pseudo_query == 0) for a in restopo.aggregations(r))
    v0, subs, head = loop.nanogpt_pieces(m, idx)
    want = loop.run(v0, subs, head, blocks(), loop.mean)
    logits, _ = r(idx, targets)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("spec, blocks", [
    ("residual full_attnres\n", lambda: loop.full_blocks(6)),
    ("residual block_attnres(blocks: 2)\n", lambda: loop.layer_blocks(3, 2)),
    ("residual block_attnres(block_size: 4)\n", lambda: [[1, 2, 3, 4], [5, 6]]),
])
@pytest.mark.parametrize("two_phase", [True, False])
def test_random_queries_equal_the_naive_loop(spec, blocks, two_phase):
    m = gpt(n_layer=3)
    idx, targets = tokens()
    r = rewire(m, spec, two_phase=two_phase)
    queries, gains = randomise(r)
    v0, subs, head = loop.nanogpt_pieces(m, idx)
    want = loop.run(v0, subs, head, blocks(), loop.attend, queries, gains)
    logits, loss = r(idx, targets)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-10)
    assert not torch.allclose(want, loop.run(v0, subs, head, blocks(), loop.mean))


def test_gradients_reach_original_weights_and_pseudo_queries():
    m = gpt()
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    randomise(r)
    idx, targets = tokens()
    r(idx, targets)[1].backward()
    for name, p in r.model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    ir = r.body.restopo_ir
    for l, agg in enumerate(restopo.aggregations(r), start=1):
        if len(ir.aggregation(l).sources) > 1:  # one source: softmax weight 1, no grad
            assert agg.pseudo_query.grad.abs().sum() > 0, l
            assert agg.key_norm.weight.grad.abs().sum() > 0, l


def test_original_weights_are_kept():
    m = gpt()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = {id(p) for p in m.parameters()}
    r = rewire(m, "residual full_attnres\n")
    # the same Parameter objects, registered once, under the original names
    assert params <= {id(p) for p in r.parameters()}
    assert set(m.state_dict()) == set(before)
    for k, v in r.model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    sd = r.state_dict()
    assert {k[len("model."):] for k in sd if k.startswith("model.")} == set(before)
    new = [k for k in sd if not k.startswith("model.")]
    assert new and all(k.startswith("body.aggregations.") for k in new)
    # the rewired model's state round-trips into a fresh rewired copy
    r2 = rewire(gpt(seed=5), "residual full_attnres\n")
    r2.load_state_dict(sd)
    idx, targets = tokens()
    torch.testing.assert_close(r2(idx, targets)[1], r(idx, targets)[1], rtol=0, atol=0)


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2))
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    losses = gpt_losses(r, *tokens(T=16))
    assert losses[-1] < losses[0] - 0.5, losses
    # the pseudo-queries left zero: the depth attention is being learnt
    assert any(a.pseudo_query.abs().sum() > 0 for a in restopo.aggregations(r))


def test_dropout_follows_train_and_eval():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, dropout=0.5)).double()
    r = rewire(m, "residual full_attnres\n")
    idx, targets = tokens()
    r.eval()
    assert not m.training
    torch.testing.assert_close(r(idx, targets)[1], r(idx, targets)[1], rtol=0, atol=0)
    r.train()
    assert m.training
    assert r(idx, targets)[1] != r(idx, targets)[1]


def test_aggregations_are_exposed():
    m = gpt()
    r = restopo.rewire(m, "residual full_attnres\n")
    aggs = restopo.aggregations(r)
    assert len(aggs) == 5  # 4 sublayers and the head
    assert all(a.pseudo_query.shape == (32,) for a in aggs)
    assert r.kinds == ("attn", "mlp", "attn", "mlp")
    assert "transformer.h.0.ln_1 + transformer.h.0.attn" in repr(r)


def test_spec_model_section_does_not_override_the_model():
    """Only the residual section is read; a model section that says other sizes is warned
    of (it was dropped without a word), one that fits is not."""
    import warnings

    from restopo.fx.rewire import RewireWarning
    m = gpt()
    spec = ("model other { vocab: 999; width: 64; depth: 7; heads: 2; mlp: gelu(4x); "
            "context: 16 }\n"
            "residual block_attnres(blocks: 2)\n")
    width = m.config.n_embd
    with pytest.warns(RewireWarning, match=rf"not this model \(width 64 there, {width} in the "
                      r"model; sublayers 14 there, 4 in the model\)"):
        r = rewire(m, spec)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", RewireWarning)
        rewire(gpt(), spec.replace("width: 64; depth: 7", f"width: {width}; depth: 2"))
    assert not [w for w in seen if "model section" in str(w.message)]
    assert len(restopo.aggregations(r)) == 5
    idx, targets = tokens()
    assert r(idx, targets)[0].shape == (2, 12, 128)


def test_blocks_larger_than_the_model_is_a_spec_error():
    with pytest.raises(SpecError) as e:
        rewire(gpt(), "residual block_attnres(blocks: 3)\n")
    assert e.value.line == 1 and "blocks" in str(e.value)


def test_post_norm_model_is_refused():
    with pytest.raises(RewireError, match="post-norm"):
        rewire(gpt(cls=PostNormGPT), "residual full_attnres\n")


def test_model_without_residual_adds_is_refused():
    with pytest.raises(RewireError, match="no residual adds"):
        rewire(gpt(cls=NoResidualGPT), "residual full_attnres\n")


class BranchyGPT(GPT):
    """Control flow on a tensor value: torch.fx cannot follow it."""

    def forward(self, idx, targets=None):
        if idx.sum() > 0:
            return super().forward(idx, targets)
        return super().forward(idx + 1, targets)


def test_untraceable_model_gets_a_clear_error():
    with pytest.raises(RewireError, match="torch.fx could not trace BranchyGPT.forward"):
        rewire(gpt(cls=BranchyGPT), "residual full_attnres\n")


def test_not_a_module_is_refused():
    with pytest.raises(RewireError, match="torch.nn.Module"):
        rewire(lambda idx: idx, "residual full_attnres\n")


def test_deepcopy_copies_the_pieces_with_the_model():
    import copy
    m = gpt()
    r = rewire(m, "residual full_attnres\n")
    randomise(r)
    idx, targets = tokens()
    before = r(idx, targets)
    c = copy.deepcopy(r)
    assert not {id(p) for p in c.parameters()} & {id(p) for p in r.parameters()}
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    after = c(idx, targets)  # the copy runs on its own weights, not the changed original
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(c(idx)[0], before[0][:, -1:], rtol=0, atol=1e-12)  # new pattern


EXAMPLES = sorted((__import__("pathlib").Path(__file__).parents[1] / "examples").glob("*.restopo"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_spec_rewires_nanogpt(path):
    """The examples are written for restopo's own model; their model and train sections
    are not read, only the residual one."""
    m = gpt(n_layer=4)
    r = rewire(m, path)
    idx, targets = tokens()
    logits, loss = r(idx, targets)
    assert logits.shape == (2, 12, 128) and loss.isfinite()
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_denseformer_starts_as_the_standard_residual():
    """DenseFormer's per-source scalars start at one: the plain sum, the original model."""
    m = gpt()
    r = rewire(m, "residual denseformer\n")
    idx, targets = tokens()
    torch.testing.assert_close(r(idx, targets)[0], m(idx, targets)[0], rtol=0, atol=1e-12)


def test_triton_backend_matches_eager():
    """The fused kernels (Triton's interpreter on CPU) run the rewired stream too."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2))
    fused = rewire(m, "residual block_attnres(blocks: 2)\n", backend="triton")
    eager = rewire(m, "residual block_attnres(blocks: 2)\n", backend="eager")
    with torch.no_grad():
        for a, b in zip(restopo.aggregations(fused), restopo.aggregations(eager)):
            a.pseudo_query.normal_()
            b.pseudo_query.copy_(a.pseudo_query)
    idx, targets = tokens(T=8)
    (lf, loss_f), (le, loss_e) = fused(idx, targets), eager(idx, targets)
    torch.testing.assert_close(lf, le, rtol=1e-5, atol=1e-5)
    loss_f.backward()
    loss_e.backward()
    for a, b in zip(restopo.aggregations(fused), restopo.aggregations(eager)):
        torch.testing.assert_close(a.pseudo_query.grad, b.pseudo_query.grad, rtol=1e-4, atol=1e-6)


def test_an_epsilon_written_in_the_norms_code_is_warned_of_and_named():
    """nanoGPT's LayerNorm writes `F.layer_norm(..., 1e-5)` in its forward: no attribute
    to read, so a mean-start rewire said nothing of it, and norm_eps= said only 'in their
    code'. The epsilon is read from a trace of the norm's forward."""
    import warnings

    from restopo.fx.rewire import RewireWarning, coded_norm_eps
    m = gpt()
    assert set(coded_norm_eps(m).values()) == {1e-5} and len(coded_norm_eps(m)) == 5
    with pytest.warns(RewireWarning, match=r"epsilon up to 1e-05: full_attnres.*"
                                           r"LayerNorm\.forward calls torch\.nn\.functional\."
                                           r"layer_norm with eps=1e-05: pass eps=1e-24"):
        rewire(m, "residual full_attnres\n")
    with warnings.catch_warnings():  # a sum is not affected by the epsilon
        warnings.simplefilter("error", RewireWarning)
        rewire(m, "residual standard\n")
    with pytest.raises(RewireError, match=r"keep their epsilon \(1e-05\) in their code "
                                          r"\(LayerNorm\.forward\)"):
        rewire(m, "residual full_attnres\n", norm_eps=1e-24)
    # torch's own LayerNorm keeps it in an attribute, read there and not traced
    assert coded_norm_eps(torch.nn.Sequential(torch.nn.LayerNorm(4, eps=1e-3))) == {}
