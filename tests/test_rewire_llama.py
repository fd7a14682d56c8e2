"""restopo.rewire on Hugging Face Llama-family causal LMs built from tiny configs (no
download), in float64."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import restopo  # noqa: E402
from restopo.fx.rewire import RewireError, rewire  # noqa: E402
from restopo.spec import SpecError  # noqa: E402

from models import attnres_loop as loop
from models.rewired import hf_losses, randomise  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def llama(layers=2, seed=0, **extra):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, **TINY, **extra)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def tokens(T=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, T), generator=g)


def test_standard_spec_leaves_the_output_unchanged():
    m = llama()
    r = rewire(m, "residual standard\n")
    idx = tokens()
    out, want = r(idx, labels=idx), m(idx, labels=idx)
    assert type(out) is type(want)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=1e-12)
    # padding mask, and only the last position's logits
    mask = torch.ones_like(idx)
    mask[0, :3] = 0
    torch.testing.assert_close(r(idx, attention_mask=mask).logits,
                               m(idx, attention_mask=mask).logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(r(idx, logits_to_keep=1).logits,
                               m(idx, logits_to_keep=1).logits, rtol=0, atol=1e-12)
    assert inspect.signature(r) == inspect.signature(m.forward)


def test_one_sequence_without_a_batch_is_refused_as_a_compiled_model_refuses_it():
    """Token ids [T] (no batch) failed inside a rewired model's traced front, or its
    generate(), with an IndexError (the original HF model fails too); restopo.compile's
    model refuses them with a ValueError naming [batch, T]: the rewired one now does too."""
    compiled = restopo.compile("model t { vocab: 128; width: 16; depth: 1; heads: 2; "
                               "context: 16 }\nresidual full_attnres\n", backend="eager")
    rewired = rewire(llama(), "residual full_attnres\n", norm_eps=1e-24)
    ids = tokens()
    for model in (compiled, rewired):
        with pytest.raises(ValueError) as refused:
            model(ids[0])
        assert "token ids [batch, T]; got shape (10,) (one sequence: ids[None])" in str(
            refused.value)
        model(ids[0][None])  # as it says: a batch of one runs
    with pytest.raises(ValueError, match=r"token ids \[batch, T\]; got shape \(10,\)"):
        rewired.generate(ids[0], max_new_tokens=2)  # Hugging Face's: an IndexError too
    out = rewired(input_ids=ids[0][None])
    torch.testing.assert_close(out.logits[0], rewired(ids).logits[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family, config", [
    ("Qwen2ForCausalLM", "Qwen2Config"),
    ("Qwen3ForCausalLM", "Qwen3Config"),
    ("MistralForCausalLM", "MistralConfig"),
])
def test_other_llama_family_members(family, config):
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(num_hidden_layers=2, **TINY)
    m = getattr(transformers, family)(cfg).double().eval()
    idx = tokens()
    torch.testing.assert_close(rewire(m, "residual standard\n")(idx).logits, m(idx).logits,
                               rtol=0, atol=1e-12)
    r = rewire(m, "residual full_attnres\n")
    assert r(idx, labels=idx).loss.isfinite()


@pytest.mark.parametrize("spec, blocks", [
    ("residual full_attnres\n", lambda: loop.full_blocks(6)),
    ("residual block_attnres(blocks: 2)\n", lambda: loop.layer_blocks(3, 2)),
])
def test_zero_queries_take_the_mean_of_the_sources(spec, blocks):
    m = llama(layers=3)
    idx = tokens()
    r = rewire(m, spec)
    v0, subs, head = loop.llama_pieces(m, idx)
    want = loop.run(v0, subs, head, blocks(), loop.mean)
    torch.testing.assert_close(r(idx).logits, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("spec, blocks", [
    ("residual full_attnres\n", lambda: loop.full_blocks(6)),
    ("residual block_attnres(blocks: 2)\n", lambda: loop.layer_blocks(3, 2)),
    ("residual block_attnres(blocks: 3)\n", lambda: loop.layer_blocks(3, 3)),
])
def test_random_queries_equal_the_naive_loop(spec, blocks):
    m = llama(layers=3)
    idx = tokens()
    r = rewire(m, spec)
    queries, gains = randomise(r)
    v0, subs, head = loop.llama_pieces(m, idx)
    want = loop.run(v0, subs, head, blocks(), loop.attend, queries, gains)
    torch.testing.assert_close(r(idx).logits, want, rtol=0, atol=1e-10)


def test_kv_cache_decoding_matches_the_full_forward():
    """Depth attention never mixes positions, so the sequence KV cache works unchanged."""
    m = llama()
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    randomise(r)
    idx = tokens(T=8)
    full = r(idx, use_cache=False).logits
    out = r(idx[:, :6], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert cache is not None and cache.get_seq_length() == 6
    step = r(idx[:, 6:7], cache=cache, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], full[:, 6], rtol=0, atol=1e-10)


def test_original_weights_are_kept():
    m = llama()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = {id(p) for p in m.parameters()}
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    assert params <= {id(p) for p in r.parameters()}
    for k, v in r.model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert set(r.model.state_dict()) == set(before)


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, **TINY)
    m = transformers.LlamaForCausalLM(cfg)
    r = rewire(m, "residual full_attnres\n")
    losses = hf_losses(r, tokens(T=16))
    assert losses[-1] < losses[0] - 0.5, losses
    assert any(a.pseudo_query.abs().sum() > 0 for a in restopo.aggregations(r))


def test_gradient_checkpointing_is_kept_as_recompute_of_each_sublayer(monkeypatch):
    """rewire calls a layer's self_attn and mlp itself, past the decoder layer that runs
    under checkpoint: with gradient checkpointing on, the rewired model kept every
    activation. Its sublayers now recompute while the model's switch is on, before or after
    rewire; the gradients are those of no checkpointing."""
    m = llama().train()
    ac = "activation" if hasattr(m, "activation_checkpointing_enable") else "gradient"
    getattr(m, f"{ac}_checkpointing_enable")()  # transformers 5 renamed it
    r = rewire(m, "residual block_attnres(blocks: 2)\n", norm_eps=1e-24)
    randomise(r)
    calls, forward = [], type(m.model.layers[0].mlp).forward
    monkeypatch.setattr(type(m.model.layers[0].mlp), "forward",
                        lambda self, x: calls.append(1) or forward(self, x))
    idx = tokens()

    def grads(recomputed):
        calls.clear()
        m.zero_grad()
        r(idx, labels=idx).loss.backward()
        assert len(calls) == 2 * (1 + recomputed)  # two MLPs, run again in backward or not
        return [p.grad.clone() for p in m.parameters()]
    on = grads(True)
    getattr(m, f"{ac}_checkpointing_disable")()
    off = grads(False)
    getattr(m, f"{ac}_checkpointing_enable")()
    grads(True)
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    r.eval()
    assert r.generate(idx, max_new_tokens=3, do_sample=False).shape == (2, 13)


def test_each_sublayer_follows_its_layers_checkpointing_without_walking_the_model(
        monkeypatch):
    """Each sublayer asked the model's is_activation_checkpointing, which walks every module
    (2 walks a layer each forward: 50 ms at 32 layers), and one layer checkpointed alone made
    every sublayer recompute. Each now reads its own decoder layer's switch, as the layer."""
    m = llama(layers=3).train()
    ac = "activation" if hasattr(m, "activation_checkpointing_enable") else "gradient"
    getattr(m, f"{ac}_checkpointing_enable")()
    if hasattr(m.model.layers[0], "gradient_checkpointing"):  # transformers 5: per layer
        m.model.layers[0].gradient_checkpointing = False
    r = rewire(m, "residual standard\n")
    calls, forward = [], type(m.model.layers[0].mlp).forward
    monkeypatch.setattr(type(m.model.layers[0].mlp), "forward",
                        lambda self, x: calls.append(self) or forward(self, x))
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(m), name):
            monkeypatch.setattr(type(m), name, property(lambda self: pytest.fail("walked")))
    idx = tokens()
    m(idx, labels=idx).loss.backward()
    want, calls[:] = list(calls), []
    r(idx, labels=idx).loss.backward()
    assert sorted(map(id, calls)) == sorted(map(id, want))  # the same MLPs run again


def test_generate_checks_the_prompt_once_not_every_step(monkeypatch):
    """Each of generate's one-token steps read its ids back through the rewired forward's
    vocabulary check (a wait for the GPU on CUDA), as restopo's own decoder no longer does;
    the prompt is checked once, and a forward still checks its ids."""
    import restopo.fx.rewire
    r = rewire(llama(), "residual block_attnres(blocks: 2)\n")
    checked, check = [], restopo.fx.rewire.check_token_ids
    monkeypatch.setattr(restopo.fx.rewire, "check_token_ids",
                        lambda ids, vocab: checked.append(ids) or check(ids, vocab))
    idx = tokens()
    assert r.generate(idx, max_new_tokens=4, do_sample=False).shape == (2, 14)
    assert len(checked) == 1
    with pytest.raises(ValueError, match="token id 128, outside the model's vocabulary"):
        r.generate(torch.cat([idx, torch.full((2, 1), 128)], dim=1), max_new_tokens=2)
    with pytest.raises(ValueError, match="token id 128, outside the model's vocabulary"):
        r(torch.full((2, 1), 128))


def test_training_with_gradient_checkpointing_makes_no_cache_as_the_original():
    """The original turns use_cache off when checkpointing in training; the rewired model
    made a cache, and its recomputed attentions appended their keys to it again."""
    m = llama().train()
    ac = "activation" if hasattr(m, "activation_checkpointing_enable") else "gradient"
    getattr(m, f"{ac}_checkpointing_enable")()
    r = rewire(m, "residual standard\n")
    idx = tokens()
    want, out = m(idx, labels=idx), r(idx, labels=idx)
    assert want.past_key_values is None and out.past_key_values is None
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=1e-12)
    with torch.no_grad():  # no backward, nothing recomputed: decoding keeps its cache
        assert r(idx, use_cache=True).past_key_values.get_seq_length() == idx.shape[1]
        assert m(idx, use_cache=True).past_key_values.get_seq_length() == idx.shape[1]


def test_blocks_larger_than_the_model_is_a_spec_error():
    with pytest.raises(SpecError):
        rewire(llama(), "residual block_attnres(blocks: 3)\n")


def test_unknown_family_is_refused():
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64)
    with pytest.raises(RewireError, match="GPTNeoXForCausalLM .*family rewire does not know"):
        rewire(transformers.GPTNeoXForCausalLM(cfg), "residual full_attnres\n")


class SandwichLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """A layer with the Llama names but another wiring: the MLP norm after the MLP."""

    def forward(self, hidden_states, **kwargs):
        h = super().forward(hidden_states, **kwargs)
        return h + 0.5 * self.post_attention_layernorm(h)


def test_a_layer_that_departs_from_the_layout_is_caught_by_the_self_check():
    m = llama()
    m.model.layers[1].__class__ = SandwichLayer
    with pytest.raises(RewireError, match="do not reproduce the model's output"):
        rewire(m, "residual full_attnres\n")


def test_deepcopy_copies_the_pieces_with_the_model():
    import copy
    m = llama()
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    idx = tokens()
    before = r(idx).logits
    c = copy.deepcopy(r)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    torch.testing.assert_close(c(idx).logits, before, rtol=0, atol=0)


def test_a_deepcopys_sublayers_follow_the_copys_checkpointing_not_the_originals(monkeypatch):
    """Each sublayer reads whether to recompute from the model it was rewired from: a copy's
    must read the copy's switches and mode, not the original's."""
    import copy
    m = llama().train()
    ac = "activation" if hasattr(m, "activation_checkpointing_enable") else "gradient"
    c = copy.deepcopy(rewire(m, "residual standard\n"))
    getattr(m, f"{ac}_checkpointing_enable")()  # the original's alone
    calls, forward = [], type(m.model.layers[0].mlp).forward
    monkeypatch.setattr(type(m.model.layers[0].mlp), "forward",
                        lambda self, x: calls.append(1) or forward(self, x))
    idx = tokens()
    c(idx, labels=idx).loss.backward()
    assert len(calls) == 2  # two MLPs, not run again in backward
    getattr(c.model, f"{ac}_checkpointing_enable")()
    calls.clear()
    c(idx, labels=idx).loss.backward()
    assert len(calls) == 4


def test_a_norm_epsilon_that_is_not_negligible_is_warned_of_and_can_be_set():
    """Llama's norms use epsilon 1e-6: rewired to Full AttnRes, whose zero queries start as
    the mean of the sources, the step-0 model was silently not the original (2.5e-2 on the
    logits here). rewire warns of it; norm_eps=1e-24 sets the norms' epsilon and the
    step-0 model is the original's standard residual again (to the float32 that Llama's
    RMSNorm computes in). A standard residual is a sum: no warning."""
    import warnings

    from restopo.fx.rewire import RewireWarning, norm_eps
    idx = tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewireWarning)
        standard = rewire(llama(layers=4), "residual standard\n")(idx).logits
    with pytest.warns(RewireWarning, match="epsilon up to 1e-06: full_attnres"):
        full = rewire(llama(layers=4), "residual full_attnres\n")(idx).logits
    assert (full - standard).abs().max() > 1e-3  # what the warning is about
    model = llama(layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewireWarning)
        fixed = rewire(model, "residual full_attnres\n", norm_eps=1e-24)
    assert set(norm_eps(model).values()) == {1e-24}
    with pytest.raises(RewireError, match="norm_eps takes a number, e.g. norm_eps=1e-24; "
                       "got '1e-24'"):  # was a bare TypeError from '>='
        rewire(llama(layers=4), "residual full_attnres\n", norm_eps="1e-24")
    same_eps = rewire(llama(layers=4), "residual standard\n", norm_eps=1e-24)(idx).logits
    torch.testing.assert_close(fixed(idx).logits, same_eps, rtol=0, atol=1e-6)
