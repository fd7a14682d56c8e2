"""restopo.rewire on a Hugging Face GPT2LMHeadModel built from a tiny config, in float64."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import restopo  # noqa: E402
from restopo.fx.rewire import RewireError, rewire  # noqa: E402

from models import attnres_loop as loop
from models.rewired import hf_losses  # noqa: E402


def gpt2(layers=3, seed=0, **extra):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=layers, n_head=4,
                                  n_positions=64, **extra)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def tokens(T=10, seed=1):
    return torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(seed))


def gpt2_pieces(m, idx):
    t = m.transformer
    T = idx.shape[1]
    v0 = t.drop(t.wte(idx) + t.wpe(torch.arange(T)[None]))
    mask = torch.full((T, T), float("-inf"), dtype=v0.dtype).triu(1)[None, None]
    subs = []
    for b in t.h:
        subs.append(lambda h, b=b: b.attn(b.ln_1(h), attention_mask=mask)[0])
        subs.append(lambda h, b=b: b.mlp(b.ln_2(h)))
    return v0, subs, lambda h: m.lm_head(t.ln_f(h))


def test_standard_spec_leaves_the_output_unchanged():
    m = gpt2()
    r = rewire(m, "residual standard\n")
    idx = tokens()
    out, want = r(idx, labels=idx), m(idx, labels=idx)
    assert type(out) is type(want)
    torch.testing.assert_close(out.logits, want.logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=1e-12)
    mask = torch.ones_like(idx)
    mask[1, :4] = 0
    types = torch.randint(0, 128, idx.shape, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(r(idx, attention_mask=mask, token_type_ids=types).logits,
                               m(idx, attention_mask=mask, token_type_ids=types).logits,
                               rtol=0, atol=1e-12)


def test_random_queries_equal_the_naive_loop():
    m = gpt2()
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for a in restopo.aggregations(r):
            a.pseudo_query.copy_(torch.randn(32, generator=g, dtype=torch.float64))
    idx = tokens()
    v0, subs, head = gpt2_pieces(m, idx)
    aggs = restopo.aggregations(r)
    want = loop.run(v0, subs, head, loop.layer_blocks(3, 2), loop.attend,
                    [a.pseudo_query for a in aggs], [a.key_norm.weight for a in aggs])
    torch.testing.assert_close(r(idx).logits, want, rtol=0, atol=1e-10)


def test_kv_cache_decoding_matches_the_full_forward():
    m = gpt2()
    r = rewire(m, "residual full_attnres\n")
    idx = tokens(T=8)
    full = r(idx, use_cache=False).logits
    out = r(idx[:, :6], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    step = r(idx[:, 6:7], cache=cache, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], full[:, 6], rtol=0, atol=1e-10)


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    losses = hf_losses(r, tokens(T=16))
    assert losses[-1] < losses[0] - 0.5, losses


def test_cross_attention_is_refused():
    with pytest.raises(RewireError, match="cross-attention"):
        rewire(gpt2(add_cross_attention=True), "residual full_attnres\n")
