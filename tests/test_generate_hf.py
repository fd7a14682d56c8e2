"""Rewired Hugging Face models keep generate(): their own KV cache, masks and positions,
held against generating without a cache and against a hand loop of full forwards."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import restopo  # noqa: E402
from restopo.fx.rewire import rewire  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def llama(layers=3):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, **TINY)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                  n_head=4)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def rewired(model, topology):
    r = rewire(model, f"residual {topology}\n")
    with torch.no_grad():  # a trained-looking depth attention, not the uniform start
        for a in restopo.aggregations(r):
            if hasattr(a, "pseudo_query"):
                a.pseudo_query.normal_(generator=torch.Generator().manual_seed(2))
            elif hasattr(a, "n"):  # multi-stream coefficients away from their PreNorm start
                for p in a.parameters():
                    p.add_(2.0 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2),
                                             dtype=p.dtype))
    return r


def hand_greedy(r, idx, mask, n):
    for _ in range(n):
        with torch.no_grad():
            nxt = r(idx, attention_mask=mask).logits[:, -1].argmax(-1)
        idx = torch.cat([idx, nxt[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return idx


@pytest.mark.parametrize("make, topology", [
    (llama, "block_attnres(blocks: 2)"),
    (llama, "full_attnres"),
    (gpt2, "block_attnres(blocks: 2)"),
    (llama, "mhc(streams: 4)"),                   # the n-stream state through HF's cache
    (llama, "hyper_connections(streams: 2, dynamic: true)"),
])
def test_cached_generate_equals_uncached(make, topology):
    m = make()
    r = rewired(m, topology)
    idx = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(idx)
    mask[0, :2] = 0  # left padding: the mask and the positions must follow
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False,
              return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    cached = r.generate(idx, use_cache=True, **kw)
    plain = r.generate(idx, use_cache=False, **kw)
    assert torch.equal(cached.sequences, plain.sequences)
    for a, b in zip(cached.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert torch.equal(cached.sequences, hand_greedy(r, idx, mask, 8))
    # the rewiring is in effect: the original model continues differently
    original = m.generate(idx, **{**kw, "return_dict_in_generate": False})
    assert not torch.equal(original, cached.sequences)
    assert "forward" not in vars(m)  # the original's forward is back to its class's


def test_standard_rewiring_generates_what_the_original_does():
    m = llama(2)
    r = rewire(m, "residual standard\n")
    idx = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(r.generate(idx, **kw), m.generate(idx, **kw))
