"""restopo.rewire on the model shapes researchers write, each built here (no downloads): it
rewires, and its standard topology gives the original model's output (float32), or it is
refused saying why and what to do."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from restopo.fx.rewire import RewireError, rewire

from models import attnres_loop as loop
from models.nanogpt import GPT, GPTConfig
from models.rewired import randomise

V, D, HEADS, CONTEXT = 64, 32, 4, 16


def tokens(T=10, seed=1):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def same(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ GPT-2 with Conv1D

class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: a linear layer with its weight stored [in, out]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = Conv1D(3 * D, D), Conv1D(D, D)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        # GPT-2's causal mask, a buffer sliced to the sequence
        self.register_buffer("bias", torch.tril(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool))
                             .view(1, 1, CONTEXT, CONTEXT), persistent=False)

    def _split(self, x):
        return x.view(x.size()[:-1] + (HEADS, D // HEADS)).permute(0, 2, 1, 3)

    def forward(self, x):
        q, k, v = map(self._split, self.c_attn(x).split(D, dim=2))
        w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(v.size(-1))
        T = q.size(-2)
        w = torch.where(self.bias[:, :, :T, :T], w, torch.finfo(w.dtype).min)
        w = self.attn_dropout(F.softmax(w, dim=-1))
        y = torch.matmul(w, v).permute(0, 2, 1, 3).contiguous()
        return self.resid_dropout(self.c_proj(y.view(y.size()[:-2] + (D,))))


class GPT2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * D, D), Conv1D(D, 4 * D)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(D), GPT2Attention()
        self.ln_2, self.mlp = nn.LayerNorm(D), GPT2MLP()

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.ln_1(hidden_states))
        hidden_states = hidden_states + residual
        residual = hidden_states
        return residual + self.mlp(self.ln_2(hidden_states))


class GPT2(nn.Module):
    """GPT-2 as Hugging Face writes it, Conv1D and all; its LM head tied to wte."""

    def __init__(self, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(CONTEXT, D)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(GPT2Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, labels=None):
        position_ids = torch.arange(input_ids.size(-1), device=input_ids.device)[None]
        h = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        return loss, logits


# ------------------------------------------------------------------ Llama

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) \
            * self.weight


def apply_rotary(x, freqs_cis):
    """Meta's rotary: pairs of features as complex numbers, turned by freqs_cis [T, hd/2]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis, mask):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, HEADS, D // HEADS) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, hidden=64):
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, hidden, bias=False), nn.Linear(D, hidden, bias=False)
        self.w2 = nn.Linear(hidden, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(D), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(D), FeedForward()

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Meta's Llama layout: a complex rotary table and a mask made in forward, both passed to
    every layer as arguments."""

    def __init__(self, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList(LlamaBlock() for _ in range(layers))
        self.norm, self.output = RMSNorm(D), nn.Linear(D, V, bias=False)
        hd = D // HEADS
        freqs = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(CONTEXT).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:T]
        mask = torch.full((T, T), float("-inf"), device=tokens.device).triu(1)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()


class RotaryEmbedding(nn.Module):
    """Hugging Face's way: the table made in forward, on the device of the hidden state."""

    def __init__(self):
        super().__init__()
        hd = D // HEADS
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)),
                             persistent=False)

    def forward(self, x, position_ids):
        angles = torch.outer(position_ids.float(), self.inv_freq)
        return torch.polar(torch.ones_like(angles), angles).to(x.device)


class RotaryModuleLlama(Llama):
    """Its rotary table made from the embedding output, as rotary_emb(h, position_ids)."""

    def __init__(self, layers=2):
        super().__init__(layers)
        self.rotary_emb = RotaryEmbedding()

    def forward(self, tokens):
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.rotary_emb(h, torch.arange(T, device=h.device))
        mask = torch.full((T, T), float("-inf"), dtype=h.dtype, device=h.device).triu(1)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()


# ------------------------------------------------------------------ parallel blocks

class ParallelBlock(nn.Module):
    """GPT-J: x + attn(ln(x)) + mlp(ln(x)), one norm; GPT-NeoX: attn(ln_1(x)) +
    mlp(ln_2(x)) + x, two."""

    def __init__(self, neox):
        super().__init__()
        self.neox = neox
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.mlp = FeedForward()

    def forward(self, x, freqs_cis, mask):
        if self.neox:
            return self.attn(self.ln_1(x), freqs_cis, mask) + self.mlp(self.ln_2(x)) + x
        return x + self.attn(self.ln_1(x), freqs_cis, mask) + self.mlp(self.ln_1(x))


class ParallelLM(Llama):
    def __init__(self, layers=2, neox=False):
        super().__init__(layers)
        self.layers = nn.ModuleList(ParallelBlock(neox) for _ in range(layers))


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("make", [
    lambda: GPT(GPTConfig(n_layer=2, bias=False)),   # nanoGPT, LayerNorm without a bias
    lambda: GPT(GPTConfig(n_layer=2, dropout=0.2)),  # nanoGPT with dropout
    GPT2, Llama, RotaryModuleLlama,
], ids=["nanogpt_no_bias", "nanogpt_dropout", "gpt2_conv1d", "llama", "llama_rotary_module"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_the_standard_topology_gives_the_original_models_output(make, training):
    """Rewired with the standard residual, each model gives its own output, in eval mode
    and, its dropout drawn in the same order from the same seed, in training. A rotary table
    made from the embedding output's device (rotary_emb(h, ...)) was taken for part of the
    first attention, and the second's read of it refused as a read from inside that one."""
    torch.manual_seed(0)
    m = make().train(training)
    r = rewire(m, "residual standard\n")
    idx = tokens()
    args = (idx, idx) if isinstance(m, (GPT, GPT2)) else (idx,)
    torch.manual_seed(5)
    want = m(*args)
    torch.manual_seed(5)
    got = r(*args)
    for a, b in zip(*((x,) if torch.is_tensor(x) else x for x in (got, want))):
        same(a, b)
    assert m.training == training


def test_a_tied_lm_head_stays_tied_and_trains_as_one_weight():
    torch.manual_seed(0)
    m = GPT2()
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    assert r.model.lm_head.weight is r.model.wte.weight
    names = [n for n, p in r.named_parameters() if p is m.wte.weight]
    assert len(names) == 1  # one Parameter, once in parameters(): an optimizer steps it once
    idx = tokens()
    r(idx, idx)[0].backward()
    assert m.wte.weight.grad is not None and m.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("final_norm", [True, False])
def test_a_head_without_a_final_norm_is_warned_not_to_start_as_the_original(final_norm):
    """A mean-start topology equals the standard model at step 0 only behind a norm; without
    a final norm the head read the mean of its sources, not their sum, and the rewired model
    started as another, without a word."""
    import warnings
    from restopo.fx.rewire import RewireWarning
    torch.manual_seed(0)
    m = GPT2().eval()
    if not final_norm:
        m.ln_f = nn.Identity()
    idx = tokens()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        r = rewire(m, "residual full_attnres\n", norm_eps=1e-24)
    said = [str(w.message) for w in said if issubclass(w.category, RewireWarning)]
    starts_as_original = torch.allclose(r(idx), m(idx), rtol=1e-4, atol=1e-4)
    assert starts_as_original == final_norm
    assert said == ([] if final_norm else [
        "GPT2's head reads the residual stream without a final norm: full_attnres's head "
        "aggregation starts as the mean of its sources, not their sum, which only a norm makes "
        "the same, so the rewired model does not start as the original (README: 'Starting as "
        "the standard model'); give the model a final norm before its head for that"])


@pytest.mark.parametrize("neox", [False, True], ids=["gptj", "neox"])
@pytest.mark.parametrize("layers", [1, 2])
def test_a_parallel_block_is_refused_as_one(neox, layers):
    with pytest.raises(RewireError, match=r"parallel"):
        rewire(ParallelLM(layers, neox), "residual full_attnres\n")


class WeightedAddBlock(GPT2Block):
    """A sublayer added with torch.add's alpha=, or into a stream scaled by a number."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "alpha":
            x = torch.add(x, self.attn(self.ln_1(x)), alpha=0.5)
        else:
            x = 0.9 * x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@pytest.mark.parametrize("how, said", [
    ("alpha", r"`add_\d+` adds a sublayer with alpha=0\.5 \(torch\.add\(x, f, alpha=a\)\), "
              r"which rewire does not take apart: write it x \+ a \* f\(\.\.\.\)"),
    ("scaled", r"`add_\d+` adds a sublayer to the stream scaled by `mul(_\d+)?` "
               r"\(x = a \* x \+ f\(norm\(x\)\)\)")], ids=["alpha", "scaled"])
@pytest.mark.parametrize("layers", [1, 2])
def test_a_weighted_residual_add_is_refused_as_one(how, said, layers):
    """torch.add(x, f, alpha=0.5) and 0.9 * x + f(norm(x)) were refused as parallel
    sublayers or as no residual adds at all."""
    m = GPT2(layers)
    m.h = nn.ModuleList(WeightedAddBlock(how) for _ in range(layers))
    with pytest.raises(RewireError, match=r"^GPT2: " + said):
        rewire(m, "residual standard\n")


def test_a_scaled_embedding_and_a_scaled_sublayer_are_rewired():
    """Scales that are not on the stream: the embedding's (Gemma's) is the front's, a
    sublayer's (x + 0.5 * f(norm(x))) the sublayer's; the standard topology is the model."""
    class Scaled(GPT2):
        def forward(self, input_ids, labels=None):
            h = self.wte(input_ids) * D ** 0.5
            for b in self.h:
                h = h + 0.5 * b.attn(b.ln_1(h))
                h = h + b.mlp(b.ln_2(h)) / 2
            return self.lm_head(self.ln_f(h))
    torch.manual_seed(0)
    m = Scaled().eval()
    idx = tokens()
    assert torch.equal(rewire(m, "residual standard\n")(idx), m(idx))


class Mixer(GPT2Attention):
    """An attention whose class name does not say so."""


def test_sublayers_whose_class_says_nothing_are_known_by_their_attribute_name():
    """An MLP written as nn.Sequential (self.mlp = nn.Sequential(...)), or an attention in a
    class named otherwise (self.attn = Mixer()), was refused: 'holds neither an attention nor
    an MLP module (recognised by class name ...)'."""
    from restopo.fx.rewire import recover
    torch.manual_seed(0)
    m = GPT2()
    for b in m.h:
        b.attn = Mixer()
        b.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
    m.eval()
    assert recover(m).kinds == ("attn", "mlp") * 2
    idx = tokens()
    assert torch.equal(rewire(m, "residual standard\n")(idx), m(idx))


class TorchEncoderLM(nn.Module):
    """torch's own PreNorm layers: nn.TransformerEncoderLayer(norm_first=True), causal."""

    def __init__(self, stacked):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        def layer():
            return nn.TransformerEncoderLayer(D, HEADS, 4 * D, 0.0, batch_first=True,
                                              norm_first=True)
        self.stacked = stacked
        self.layers = (nn.TransformerEncoder(layer(), 2, enable_nested_tensor=False) if stacked
                       else nn.ModuleList(layer() for _ in range(2)))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, idx):
        T = idx.shape[1]
        x, mask = self.tok(idx), nn.Transformer.generate_square_subsequent_mask(T)
        if self.stacked:
            x = self.layers(x, mask=mask, is_causal=True)
        else:
            for layer in self.layers:
                x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


@pytest.mark.parametrize("stacked", [True, False], ids=["encoder", "layers"])
def test_torchs_transformer_layers_are_refused_saying_what_to_write(stacked):
    """fx calls every torch.nn module whole, so the residual adds inside torch's layers
    were not seen: refused as a model with 'no residual adds'."""
    where = r"`layers`, a torch\.nn\.TransformerEncoder," if stacked else \
        r"`layers\.0`, a torch\.nn\.TransformerEncoderLayer,"
    with pytest.raises(RewireError, match=r"^TorchEncoderLM: its layers are inside " + where
                       + r" which torch\.fx calls whole .*write the layers as your own module"):
        rewire(TorchEncoderLM(stacked), "residual standard\n")


def pieces(m, idx):
    """v_0, the sublayers and the head of a GPT2 or Llama here, taken by hand."""
    T = idx.shape[1]
    if isinstance(m, GPT2):
        v0 = m.drop(m.wte(idx) + m.wpe(torch.arange(T))[None])
        subs = [f for b in m.h for f in (lambda h, b=b: b.attn(b.ln_1(h)),
                                         lambda h, b=b: b.mlp(b.ln_2(h)))]
        return v0, subs, lambda h: m.lm_head(m.ln_f(h))
    freqs, mask = m.freqs_cis[:T], torch.full((T, T), float("-inf")).triu(1)
    subs = [f for b in m.layers for f in (
        lambda h, b=b: b.attention(b.attention_norm(h), freqs, mask),
        lambda h, b=b: b.feed_forward(b.ffn_norm(h)))]
    return m.tok_embeddings(idx), subs, lambda h: m.output(m.norm(h)).float()


@pytest.mark.parametrize("make", [GPT2, Llama], ids=["gpt2_conv1d", "llama"])
def test_block_attnres_equals_the_naive_loop(make):
    """Block AttnRes with random queries over the model's own pieces, as attnres.md writes
    it (tests/models/attnres_loop.py), in float64."""
    torch.manual_seed(0)
    m = make(layers=2).double().eval()
    r = rewire(m, "residual block_attnres(blocks: 2)\n")
    queries, gains = randomise(r)
    idx = tokens()
    v0, subs, head = pieces(m, idx)
    with torch.no_grad():
        want = loop.run(v0, subs, head, loop.layer_blocks(2, 2), loop.attend, queries, gains)
        got = r(idx)
    same(got[0] if isinstance(got, tuple) else got, want)


class OffsetBlock(LlamaBlock):
    def forward(self, x, freqs_cis, mask, start_pos):
        freqs_cis = freqs_cis[start_pos:start_pos + x.size(1)]
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class OffsetLlama(Llama):
    """Its forward takes the position of the first token, and its blocks too, as Meta's take
    start_pos."""

    def __init__(self, layers=2):
        super().__init__(layers)
        self.layers = nn.ModuleList(OffsetBlock() for _ in range(layers))

    def forward(self, tokens, start_pos):
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        mask = torch.full((T, T), float("-inf")).triu(1)
        for layer in self.layers:
            h = layer(h, self.freqs_cis, mask, start_pos)
        return self.output(self.norm(h))


class DefaultOffsetLlama(OffsetLlama):
    def forward(self, tokens, start_pos=0):
        return super().forward(tokens, start_pos)


def test_a_forward_that_requires_a_second_argument_is_told_to_give_it_a_default():
    """rewire calls the model with token ids alone: it failed with a bare TypeError 'missing
    a required argument: start_pos'."""
    torch.manual_seed(0)
    with pytest.raises(RewireError, match=r"OffsetLlama\.forward requires start_pos besides "
                                          r"the token ids: .*so give it a default$"):
        rewire(OffsetLlama(), "residual standard\n")
    m = DefaultOffsetLlama()
    idx = tokens()
    r = rewire(m, "residual standard\n")
    same(r(idx), m(idx))
    # the number is a constant of the trace: another is refused saying what rewires it (the
    # hint was 'a tensor where it passes None'); test_a_tensor_default_argument_is_rewired
    with pytest.raises(RewireError, match=r"called with start_pos=5 \(the default call has "
                       r"start_pos=0\).*same arguments in every call \(start_pos a tensor, its "
                       r"default too, not a Python number\)$"):
        r(idx[:, :3], 5)


class TensorOffsetLlama(OffsetLlama):
    def forward(self, tokens, start_pos=torch.tensor(0)):
        return super().forward(tokens, start_pos)


def test_a_tensor_default_argument_is_rewired():
    """A tensor as an argument's default failed in the traced front's code ("NameError: name
    '_tensor_constant0' is not defined"); a tensor, unlike a number, is not fixed in the
    trace, so every start_pos runs through one set of sublayers."""
    torch.manual_seed(0)
    m = TensorOffsetLlama()
    r = rewire(m, "residual standard\n")
    idx = tokens()
    same(r(idx), m(idx))
    same(r(idx[:, :3], torch.tensor(5)), m(idx[:, :3], torch.tensor(5)))


class MetaMaskLlama(Llama):
    """Meta's reference Llama builds its mask only `if seqlen > 1:`, matched to the
    embedding's dtype with type_as(h), and keeps its rotary table as a plain attribute."""

    def __init__(self, branch=False, plain=False):
        super().__init__()
        self.branch = branch
        if plain:
            freqs_cis = self.freqs_cis
            del self.freqs_cis
            self.freqs_cis = freqs_cis

    def forward(self, tokens):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        mask = None
        if not self.branch or seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=1).type_as(h)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()


def test_a_mask_matched_to_the_embeddings_dtype_is_rewired():
    """`mask.type_as(h)` reads only h's dtype, as h.dtype does, but was taken for a read of
    the stream by the first attention: refused as not PreNorm."""
    torch.manual_seed(0)
    m = MetaMaskLlama()
    idx = tokens()
    assert torch.equal(rewire(m, "residual standard\n")(idx), m(idx))


def test_meta_llamas_branch_and_plain_tensor_are_refused_saying_where_and_what_to_do():
    """fx's own words said neither the line nor what to write instead: 'symbolically traced
    variables cannot be used as inputs to control flow', 'slice indices must be integers'."""
    with pytest.raises(RewireError, match=r"could not trace MetaMaskLlama\.forward: at "
                       r".*test_rewire_shapes\.py:\d+: `if not self\.branch or seqlen > 1:` "
                       r"branches on a traced value .*write it without the branch"):
        rewire(MetaMaskLlama(branch=True), "residual standard\n")
    with pytest.raises(RewireError, match=r"`freqs_cis = self\.freqs_cis\[:seqlen\]`\): slice "
                       r".*self\.freqs_cis is a tensor kept as a plain attribute.*"
                       r"register_buffer"):
        rewire(MetaMaskLlama(plain=True), "residual standard\n")


class DeviceMovingLlama(Llama):
    """Meta's Llama moves its rotary table in forward: self.freqs_cis = ....to(h.device)."""

    def forward(self, tokens):
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        mask = torch.full((T, T), float("-inf")).triu(1)
        for layer in self.layers:
            h = layer(h, self.freqs_cis[:T], mask)
        return self.output(self.norm(h))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_an_assignment_in_the_forward_is_refused_and_leaves_the_model_whole(training):
    """The trace assigned its own placeholder (an fx Proxy) to the model's buffer: rewire
    failed with a bare KeyError or an error in the model's own forward, and the model was
    left broken. The buffer is now put back, and the assignment refused by name."""
    torch.manual_seed(0)
    m = DeviceMovingLlama().train(training)
    table = m.freqs_cis
    with pytest.raises(RewireError, match=r"^DeviceMovingLlama\.forward assigns `freqs_cis` a "
                       r"value it computes .*keep it in a local variable"):
        rewire(m, "residual standard\n")
    assert m.freqs_cis is table
    m.eval()(tokens())  # runs as before


class OffsetGPT2(GPT2):
    """GPT-2 whose positions start at a Python number (a decoding position)."""

    def forward(self, input_ids, past_length=0):
        T = input_ids.size(-1)
        position_ids = torch.arange(past_length, past_length + T, device=input_ids.device)
        h = self.drop(self.wte(input_ids) + self.wpe(position_ids[None]))
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def test_a_number_that_takes_a_new_value_every_call_is_said_once():
    """A number read only before the blocks (a decoding position) is a constant of each
    trace: a loop that passed a new one every call traced every call and kept each trace,
    silently. It rewires and gives the model's output for each value; once the traces
    reach a few, rewire says which argument makes them and what to pass instead, once."""
    import restopo.fx.patterns as patterns
    import warnings
    torch.manual_seed(0)
    m = OffsetGPT2().eval()
    r = rewire(m, "residual standard\n")
    idx = tokens(T=2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for pos in range(patterns.TRACES_SAID + 3):
            same(r(idx, pos), m(idx, pos))
    said = [str(w.message) for w in said if "call patterns" in str(w.message)]
    assert len(said) == 1, said
    assert f"traced for {patterns.TRACES_SAID} call patterns, which differ in past_length" \
        in said[0] and "pass past_length as a tensor" in said[0], said[0]
