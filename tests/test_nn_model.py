"""restopo's reference transformer: the compiled `standard` model is a plain PreNorm GPT."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from restopo import topology as T
from restopo.api import build_model
from restopo.nn.norm import NORM_EPS
from restopo.nn.sublayers import swiglu_hidden


def cfg(**kw):
    base = dict(vocab=41, width=32, depth=3, heads=4, mlp="swiglu", mlp_ratio=4, context=12)
    base.update(kw)
    return SimpleNamespace(**base)


class GPT(nn.Module):
    """A hand-written PreNorm GPT: x = x + attn(norm(x)); x = x + mlp(norm(x))."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        d = c.width
        hidden = swiglu_hidden(d, c.mlp_ratio) if c.mlp == "swiglu" else c.mlp_ratio * d
        self.wte = nn.Embedding(c.vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(c.depth):
            self.layers.append(nn.ModuleDict(dict(
                ln1=nn.RMSNorm(d, eps=NORM_EPS), qkv=nn.Linear(d, 3 * d, bias=False),
                proj=nn.Linear(d, d, bias=False), ln2=nn.RMSNorm(d, eps=NORM_EPS),
                up=nn.Linear(d, hidden * (2 if c.mlp == "swiglu" else 1), bias=False),
                down=nn.Linear(hidden, d, bias=False))))
        self.ln_f = nn.RMSNorm(d, eps=NORM_EPS)
        self.lm_head = nn.Linear(d, c.vocab, bias=False)

    def rotate(self, x):  # x [B, H, T, hd]: positions t rotate channel pairs (i, i + hd/2)
        T_, hd = x.shape[2], x.shape[3]
        pos = torch.arange(T_, dtype=torch.float64)[:, None]
        freq = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = (pos * freq).to(x.dtype)
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)

    def attn(self, p, x):
        B, T_, d = x.shape
        H = self.c.heads
        q, k, v = p["qkv"](x).split(d, dim=-1)
        q, k, v = (t.view(B, T_, H, d // H).transpose(1, 2) for t in (q, k, v))
        q, k = self.rotate(q), self.rotate(k)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // H)
        att = att.masked_fill(torch.ones(T_, T_, dtype=torch.bool).triu(1), float("-inf"))
        y = att.softmax(-1) @ v
        return p["proj"](y.transpose(1, 2).reshape(B, T_, d))

    def mlp(self, p, x):
        x = p["up"](x)
        if self.c.mlp == "swiglu":
            a, b = x.chunk(2, -1)
            return p["down"](F.silu(a) * b)
        return p["down"](F.gelu(x))

    def forward(self, idx):
        x = self.wte(idx)
        for p in self.layers:
            x = x + self.attn(p, p["ln1"](x))
            x = x + self.mlp(p, p["ln2"](x))
        return self.lm_head(self.ln_f(x))


def copy_into_gpt(model, gpt):
    with torch.no_grad():
        gpt.wte.weight.copy_(model.embed.weight)
        for i, p in enumerate(gpt.layers):
            a, m = model.sublayers[2 * i], model.sublayers[2 * i + 1]
            p["ln1"].weight.copy_(a.norm.weight)
            p["qkv"].weight.copy_(a.qkv.weight)
            p["proj"].weight.copy_(a.proj.weight)
            p["ln2"].weight.copy_(m.norm.weight)
            p["up"].weight.copy_(m.up.weight)
            p["down"].weight.copy_(m.down.weight)
            for n in (p["ln1"], p["ln2"]):  # non-trivial norm gains
                n.weight.mul_(1.5)
            a.norm.weight.mul_(1.5)
            m.norm.weight.mul_(1.5)
        gpt.ln_f.weight.copy_(model.head.norm.weight)
        gpt.lm_head.weight.copy_(model.head.lm_head.weight)


@pytest.mark.parametrize("mlp,tie", [("swiglu", True), ("gelu", False)])
def test_standard_equals_hand_written_prenorm_gpt(mlp, tie):
    torch.manual_seed(0)
    c = cfg(mlp=mlp, tie_embeddings=tie)
    model = build_model(c, T.standard(T.sublayer_kinds(c.depth))).double()
    gpt = GPT(c).double()
    copy_into_gpt(model, gpt)
    idx = torch.randint(0, c.vocab, (2, 9))
    torch.testing.assert_close(model(idx), gpt(idx), rtol=1e-10, atol=1e-10)


def test_tied_and_untied_head():
    tied = build_model(cfg(), T.standard(T.sublayer_kinds(3)))
    assert tied.head.lm_head.weight is tied.embed.weight
    untied = build_model(cfg(tie_embeddings=False), T.standard(T.sublayer_kinds(3)))
    assert untied.head.lm_head.weight is not untied.embed.weight


def test_init_scales():
    torch.manual_seed(0)
    c = cfg(width=256, depth=8, heads=4)
    model = build_model(c, T.full_attnres(T.sublayer_kinds(8)))
    assert abs(model.sublayers[0].qkv.weight.std().item() - 0.02) < 0.002
    want = 0.02 / math.sqrt(2 * 8)
    assert abs(model.sublayers[0].proj.weight.std().item() - want) < 0.1 * want
    assert abs(model.sublayers[1].down.weight.std().item() - want) < 0.1 * want
    assert torch.all(model.sublayers[0].norm.weight == 1)
    assert all(torch.all(a.pseudo_query == 0) for a in model.aggregations)


def test_swiglu_hidden_size():
    assert swiglu_hidden(32, 4) == 88          # 2/3 * 128 = 85.3 -> 88
    assert swiglu_hidden(768, 4) % 8 == 0


def test_sequence_longer_than_context_is_a_clear_error():
    model = build_model(cfg(context=8), T.standard(T.sublayer_kinds(3)))
    model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="longer than the model's context 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_bad_dimensions_are_clear_errors():
    with pytest.raises(ValueError, match="heads must divide the width"):
        build_model(cfg(heads=5), T.standard(T.sublayer_kinds(3)))
    with pytest.raises(ValueError, match="mlp must be"):
        build_model(cfg(mlp="relu"), T.standard(T.sublayer_kinds(3)))


def test_a_float64_model_has_float64_rotary_tables():
    """Moved to float64, the rotary tables are made again from float64 angles (they were
    float32's values cast up, 3e-8 off, which a float64 comparison between topologies
    then read as a difference); moved back, they are float32's own again, bit for bit."""
    from restopo.nn.sublayers import Rotary
    rot = Rotary(head_dim=8, context=50)
    first = rot.cos.clone(), rot.sin.clone()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.outer(torch.arange(50, dtype=torch.float64), inv_freq).repeat(1, 2)
    rot.double()
    assert rot.cos.dtype == torch.float64
    assert torch.equal(rot.cos, angles.cos()) and torch.equal(rot.sin, angles.sin())
    assert (first[1].double() - angles.sin()).abs().max() > 1e-9  # what it was before
    rot.float()
    assert torch.equal(rot.cos, first[0]) and torch.equal(rot.sin, first[1])
    model = build_model(cfg(), T.full_attnres(T.sublayer_kinds(3))).double()
    tables = [m for m in model.modules() if isinstance(m, Rotary)]
    assert tables and all(torch.equal(m.sin, angles[:12].sin()) for m in tables)
