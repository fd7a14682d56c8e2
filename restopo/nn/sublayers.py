"""restopo's reference transformer sublayers: each is f_l(h) = op(RMSNorm(h)), the raw
output v_l without any residual added (the residual stream is the lowering's job).

`normed=True` hands a sublayer RMSNorm(h) (with its own `norm`'s gain and eps) already
computed: the lowering does that where the aggregation before it can compute the norm in
the same pass (phase 2 of Block AttnRes on the fused backend), and the sublayer skips it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norm import NORM_EPS, RMSNorm
from ..sizes import mlp_hidden, swiglu_hidden  # noqa: F401  (also for the standalone writer)


def check_batched(idx: torch.Tensor) -> None:
    """Token ids come as [batch, T]: one sequence [T] is refused, not read as a batch of T
    sequences of one token (or an IndexError deep inside a model)."""
    if idx.dim() != 2:
        raise ValueError(f"the model takes token ids [batch, T]; got shape "
                         f"{tuple(idx.shape)} (one sequence: ids[None])")


def token_ids_in(idx: torch.Tensor, vocab: int) -> None:
    """Token ids outside the vocabulary are named (a ValueError), not an IndexError inside
    the embedding, or a CUDA device assert that spoils the process. Reads the ids back: on
    CUDA a wait for the GPU."""
    if idx.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(idx)).tolist()  # one read back, not two
    if low < 0 or high >= vocab:
        raise ValueError(f"token id {low if low < 0 else high}, outside the model's "
                         f"vocabulary 0..{vocab - 1}")


# token_ids_in as an op, opaque to torch.compile (the check traced would break the graph
# at reading the ids) and kept in its graphs although it returns nothing
_token_ids_op = torch.library.custom_op("restopo::token_ids_in", token_ids_in,
                                        mutates_args=())
_token_ids_op.register_fake(lambda idx, vocab: None)
torch.fx.node.has_side_effect(torch.ops.restopo.token_ids_in.default)


def check_token_ids(idx: torch.Tensor, vocab: int) -> None:
    """token_ids_in, in a model's forward, eager or compiled, where reading the ids costs
    nothing: on the CPU, or where autograd does not record (inference, evaluation). A CUDA
    training step's forward would wait for the GPU at its start; training data are checked
    once, when the corpus opens (restopo.train.data)."""
    if idx.device.type == "cpu" or not torch.is_grad_enabled():
        torch.ops.restopo.token_ids_in(idx, vocab)


class TokenEmbedding(nn.Embedding):
    """nn.Embedding (the same parameter and state_dict) that refuses token ids outside
    its vocabulary in words (check_token_ids)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        check_token_ids(idx, self.num_embeddings)
        return super().forward(idx)


class Rotary(nn.Module):
    """The Parts `context`: rotary cos/sin for the sequence length of `idx`.

    Tables are precomputed for `context` positions (buffers, not saved in state_dict),
    from float64 angles, in float32; a module moved to float64 makes them again in float64
    (`_apply`), since float32's rounding (3e-8) cast up would stay in a float64 model.
    Rotation pairs channel i with channel i + head_dim/2 (the rotate-half convention).
    """

    def __init__(self, head_dim: int, context: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head size; got {head_dim} "
                             f"(choose width and heads with an even width/heads)")
        self.context, self.head_dim, self.base = context, head_dim, base
        cos, sin = self._tables(torch.float32)  # on the default device (meta: no data)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, dtype: torch.dtype, device: torch.device | None = None):
        """cos, sin [context, head_dim] in `dtype`, from angles made in float64."""
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
        inv_freq = 1.0 / self.base ** (half / self.head_dim)
        positions = torch.arange(self.context, dtype=torch.float64, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.dtype == torch.float64 and self.cos.device.type != "meta":
            self.cos, self.sin = self._tables(torch.float64, self.cos.device)
        return self

    def forward(self, idx: torch.Tensor, v0: torch.Tensor):
        check_batched(idx)
        T = idx.shape[1]
        if T > self.context:
            raise ValueError(f"sequence length {T} is longer than the model's context "
                             f"{self.context}; crop the input or raise model.context")
        return self._in(self.cos[:T], self.sin[:T], v0.dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin [T, head_dim] of the given positions (decoding: the offset ones)."""
        return self._in(self.cos.index_select(0, positions),
                        self.sin.index_select(0, positions), dtype)

    @staticmethod
    def _in(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        """The tables in `dtype`, with no conversion when they already are (a no-op .to
        is still a dispatch under inference mode)."""
        return (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, head_dim] by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """The keys and values one attention sublayer has seen, preallocated for `length`
    positions ([batch, heads, length, head_dim] each).

    `positions` ([T] long, shared by every layer's cache: the tokens of the current step)
    and `end` (how many positions are filled after this step; None: attend over all
    `length`, masked, so shapes stay fixed under torch.compile) are set by the decoder.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, length: int, *,
                 dtype: torch.dtype, device, step):
        shape = (batch, heads, length, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.step = step  # the decoder's shared step state: .positions and .end

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """Store this step's k, v [B, heads, T, hd]; the keys, values and the causal mask
        [T, S] (key position <= query position) to attend with."""
        positions, end = self.step.positions, self.step.end
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
        keys, values = (self.k, self.v) if end is None else (self.k[:, :, :end],
                                                              self.v[:, :, :end])
        key_pos = torch.arange(keys.shape[2], device=keys.device)
        return keys, values, key_pos <= positions[:, None]


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions; PreNorm inside. With a
    `cache` (KVCache, decoding) the step's keys and values are stored there and the queries
    attend over every position seen so far."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        if d % heads:
            raise ValueError(f"heads must divide the width: width {d}, heads {heads}")
        self.heads = heads
        self.norm = RMSNorm(d, eps=NORM_EPS)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None, *, normed: bool = False) -> torch.Tensor:
        B, T, d = h.shape
        x = h if normed else self.norm(h)
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v, mask = cache.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    """Feed-forward sublayer, `swiglu` (silu(W1 x) * W3 x) or `gelu`; PreNorm inside.
    `*context` is accepted and ignored so every sublayer has one call signature."""

    def __init__(self, d: int, kind: str = "swiglu", ratio: float = 4.0):
        super().__init__()
        if kind not in ("swiglu", "gelu"):
            raise ValueError(f"mlp must be 'swiglu' or 'gelu'; got {kind!r}")
        self.kind = kind
        self.norm = RMSNorm(d, eps=NORM_EPS)
        hidden = mlp_hidden(d, kind, ratio)
        self.up = nn.Linear(d, 2 * hidden if kind == "swiglu" else hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, h: torch.Tensor, *context: torch.Tensor, normed: bool = False
                ) -> torch.Tensor:
        x = self.up(h if normed else self.norm(h))
        if self.kind == "swiglu":
            gate, value = x.chunk(2, dim=-1)
            x = F.silu(gate) * value
        else:
            x = F.gelu(x)
        return self.down(x)


class Head(nn.Module):
    """Final RMSNorm and LM head: h_{L+1} -> logits."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm = RMSNorm(d, eps=NORM_EPS)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))
