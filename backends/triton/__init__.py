"""Fused Triton kernels for depth attention, with the signatures of backends/eager/depth.py.

- `depth_attention`: one aggregation, each source read once (online softmax over sources).
- `phase1` / `phase2`: the two-phase computation of Block AttnRes; `phase2_norm` also returns
  the next sublayer's RMSNorm of the result, computed in the same pass (the lowering hands
  it the sublayer's norm gain, and the sublayer skips its own norm).
- `available(device)` -> (bool, reason): CUDA with triton, or CPU under TRITON_INTERPRET=1.

Sources are a sequence of [*batch, d] tensors (or a stacked [n, *batch, d] tensor, read as
its n views): the kernels read them through a table of addresses, never a stacked copy
(sources.py), and autograd keeps nothing d-sized per call that was not alive anyway.

The kernels cover heads=1 with the softmax gate, with or without the key RMSNorm. Other
options (depth heads > 1, the sigmoid gate) are computed by the eager reference instead:
same results, unfused. Inputs may be fp32, fp16, bf16 (accumulated in fp32) or fp64
(accumulated in fp64, for gradcheck), and sources may mix two of them (as under bf16
autocast: an fp32 embedding, bf16 outputs); results take the promoted dtype. Phase 1
returns o1 as S separate tensors (indexable by slot, like the eager backend's stacked
one) and m1 and s1 in the accumulation dtype (fp32 for half inputs, like
flash-attention's logsumexp), not in the input dtype; it returns the state normalised, as
the eager backend does: o1 = h1 (the softmax's weighted sum), m1 = its log-sum-exp, s1 = 1.

Layout: runtime.py (availability, launching and autotuning, tiles), sources.py (the table of
source addresses), single.py (single-read kernels), twophase.py (phase 1 / phase 2
kernels), custom_ops.py (torch.library custom ops with fake implementations and autograd:
what torch.compile traces), functions.py (the same as autograd.Functions: what eager calls run).
Tests: `pytest tests/triton` (interpreter on CPU, including an offline sm_90 compile of
every kernel); benchmark: `python bench/triton_depth.py` on a GPU; `bench/gpu_check.sh`
runs the whole GPU check.
"""
from __future__ import annotations

import torch

from ..eager import depth as _eager
from . import runtime
from .runtime import available, tiles
from .sources import as_list

__all__ = ["available", "depth_attention", "phase1", "phase2", "phase2_norm", "tiles"]

_ops = None
_functions = None


def _load_ops():
    """The kernels' entry points for this call: the custom ops where dynamo traces (under
    torch.compile and torch.export), their autograd.Functions otherwise (functions.py: the
    same kernels without the dispatcher's per-call cost). Registers the custom ops on first
    use (needs triton importable)."""
    global _ops, _functions
    if _ops is None:
        if runtime.triton is None:
            raise RuntimeError(f"restopo triton backend unavailable: {available()[1]}")
        from . import custom_ops, functions
        _ops, _functions = custom_ops, functions
    return _ops if torch.compiler.is_compiling() else _functions


def unfused(*, gate: str, heads: int, input_dependent: bool) -> str | None:
    """What of an attend point's options these kernels do not cover (it then runs on the
    eager reference), or None."""
    if input_dependent:
        return "input-dependent queries"
    if gate != "softmax":
        return f"the {gate} gate"
    return "depth heads" if heads != 1 else None


def _too_wide(sources) -> bool:
    """Rows of `sources` (a tensor, or a sequence of them) past triton's largest tile
    (runtime.MAX_BLOCK channels): the single-read and phase-2 kernels hold a whole row, so
    such rows are left to the eager code."""
    if isinstance(sources, torch.Tensor):
        return sources.shape[-1] > runtime.MAX_BLOCK
    return len(sources) > 0 and sources[0].shape[-1] > runtime.MAX_BLOCK


def _check_input(name: str, q: torch.Tensor | None, shape: tuple[int, ...] | None,
                 device: torch.device) -> None:
    """q's shape (None: any) and device: a kernel reads q by its address, so on another
    device than the sources it read another device's memory, or failed inside triton."""
    if q is None:
        return
    if shape is not None and tuple(q.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(q.shape)}, expected {shape}")
    if q.device != device:
        raise ValueError(f"{name} is on {q.device}, the other inputs on {device}: move it there")


def depth_attention(sources, query: torch.Tensor,
                    key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                    key_norm: bool = True, gate: str = "softmax", heads: int = 1) -> torch.Tensor:
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i over n sources (a sequence of [*batch, d]
    tensors or a stacked [n, *batch, d]) -> [*batch, d]."""
    # not fused: the eager reference computes these
    if unfused(gate=gate, heads=heads, input_dependent=False) or _too_wide(sources):
        return _eager.depth_attention(sources, query, key_norm_weight, eps, key_norm=key_norm,
                                      gate=gate, heads=heads)
    sources = as_list(sources)
    d = sources[0].shape[-1]
    _check_input("query", query, (d,), sources[0].device)
    _check_input("key_norm_weight", key_norm_weight, (d,), sources[0].device)
    h, _ = _load_ops().depth_attention_op(sources, query, key_norm_weight, float(eps),
                                          bool(key_norm))
    return h


def phase1(completed, queries: torch.Tensor,
           key_norm_weights: torch.Tensor | None = None, eps: float = 1e-6, *,
           key_norm: bool = True, heads: int = 1):
    """(o1, m1 [S, *batch, 1], s1 [S, *batch, 1]) of the S queries [S, d] over the n
    completed blocks (a sequence of [*batch, d] or a stacked [n, *batch, d]); o1 is a tuple
    of S tensors [*batch, d] (o1[s] as with the eager backend's stacked o1); m1 and s1 in
    the accumulation dtype. The state is normalised: o1 = h1, m1 = lse, s1 = 1."""
    if heads != 1:
        return _eager.phase1(completed, queries, key_norm_weights, eps, key_norm=key_norm,
                             heads=heads)
    completed = as_list(completed)
    if queries.dim() != 2 or len(queries) == 0:
        raise ValueError(f"queries must be [S >= 1, d], got shape {tuple(queries.shape)}")
    device = completed[0].device
    _check_input("queries", queries, (queries.shape[0], completed[0].shape[-1]), device)
    _check_input("key_norm_weights", key_norm_weights, tuple(queries.shape), device)
    o1, m1, s1, _ = _load_ops().phase1_op(completed, queries, key_norm_weights, float(eps),
                                          bool(key_norm))
    return tuple(o1), m1, s1


def _heads_of(o1, m1, s1) -> int:
    """Depth heads of phase 1's result (m1 and s1 are [*batch, heads]); checks the shapes."""
    heads = m1.shape[-1] if m1.dim() == o1.dim() else 0
    if (heads < 1 or o1.shape[-1] % heads or tuple(m1.shape[:-1]) != tuple(o1.shape[:-1])
            or m1.shape != s1.shape):
        raise ValueError(f"m1 and s1 must be {tuple(o1.shape[:-1]) + (1,)} (or [..., heads]) "
                         f"for o1 of shape {tuple(o1.shape)}; got {tuple(m1.shape)} and "
                         f"{tuple(s1.shape)}")
    return heads


def _phase2(o1, m1, s1, partial, query, key_norm_weight, eps, norm_weight, norm_eps,
            key_norm, with_norm, with_h=True):
    d = o1.shape[-1]
    if partial is not None and partial.shape != o1.shape:
        raise ValueError(f"partial has shape {tuple(partial.shape)}, expected {tuple(o1.shape)}")
    for name, t, shape in (("m1", m1, None), ("s1", s1, None), ("partial", partial, None),
                           ("query", query, (d,)), ("key_norm_weight", key_norm_weight, (d,)),
                           ("norm_weight", norm_weight, (d,))):
        _check_input(name, t, shape, o1.device)
    return _load_ops().phase2_op(o1, m1, s1, partial, query, key_norm_weight, norm_weight,
                                 float(eps), float(norm_eps), bool(key_norm), with_norm,
                                 with_h or not with_norm)


def phase2(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor, partial: torch.Tensor | None,
           query: torch.Tensor, key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           *, key_norm: bool = True) -> torch.Tensor:
    """Merge the block's partial sum (before this sublayer's output is added) into phase 1's
    (o1, m1, s1) of this sublayer's query; h = o1 / s1 when partial is None."""
    # eager phase 1's form, depth heads > 1, or rows too wide for one tile
    if s1 is None or _heads_of(o1, m1, s1) != 1 or _too_wide(o1):
        return _eager.phase2(o1, m1, s1, partial, query, key_norm_weight, eps,
                             key_norm=key_norm)
    h, _ = _phase2(o1, m1, s1, partial, query, key_norm_weight, eps, None, eps, key_norm, False)
    return h


def phase2_norm(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor,
                partial: torch.Tensor | None, query: torch.Tensor,
                key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                norm_weight: torch.Tensor | None = None, norm_eps: float | None = None,
                key_norm: bool = True, keep_h: bool = True):
    """phase2 fused with the next sublayer's PreNorm: (h, rms_norm(h) * norm_weight).
    norm_eps defaults to eps. keep_h=False returns (None, y) and writes only y (a model
    whose sublayer reads y needs nothing else of h: the backward recomputes it)."""
    norm_eps = eps if norm_eps is None else norm_eps
    if s1 is None or _heads_of(o1, m1, s1) != 1 or _too_wide(o1):  # as in phase2
        return _eager.phase2_norm(o1, m1, s1, partial, query, key_norm_weight, eps,
                                  norm_weight=norm_weight, norm_eps=norm_eps,
                                  key_norm=key_norm, keep_h=keep_h)
    h, y = _phase2(o1, m1, s1, partial, query, key_norm_weight, eps, norm_weight, norm_eps,
                   key_norm, True, keep_h)
    return (h if keep_h else None), y
