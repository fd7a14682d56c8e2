"""Fused C kernels for depth attention on the CPU, with the signatures of the eager backend.

On the CPU a plain-torch aggregation is many small passes over d-sized tensors: one
multiply-add per (source, output) pair forward, a dot product and another multiply-add
backward, each reading its tensors from memory again, and a dozen small ops for a phase-2
merge and its PreNorm. Here each call is one pass over the tokens that reads every source
row once (kernels.c): phase 1 over a block's completed sources for all its queries, phase
2 fused with the next sublayer's RMSNorm (`phase2_norm`), and depth attention (phase 1
with one query), forward and backward.

- Covered: float32 and float64 tensors on the CPU, static queries, the softmax gate, with
  or without the key RMSNorm, any number of depth heads; with autograd through autograd
  Functions (functions.py), without it (decoding, evaluation) by one call that keeps
  nothing. Anything else (bf16, the sigmoid gate, input-dependent queries, torch.compile,
  which traces the eager forms) goes to the eager backend: the same results, unfused.
  (The kernels as torch custom ops under compile, commit 388eec1, measured no faster than
  inductor's code for the eager forms: compiled Block AttnRes at width 512 1.064 against
  1.066x standard, Full 1.266 against 1.169.)
  Depth attention fed shared logits (Full AttnRes's readers in training,
  restopo.nn.shared_sources) is a softmax and weighted sum over them, one pass a source
  forward and one backward, which adds into the source's shared gradient buffer.
- `available()` -> (bool, reason). The kernels are built with the machine's C compiler on
  first use (build.py, about a second, kept in restopo's cache); without one, `auto` runs
  the eager backend and says why once.

Phase 1 returns its state normalised, as the eager backend's does: (h1, lse, S Nones),
each a tuple of S tensors. Tests: tests/test_cpu_backend.py (gradcheck in float64, the
eager backend and a hand loop as references); benchmark: bench/overhead.py --backend cpu.
"""
from __future__ import annotations

import torch

from ..eager import depth as _eager
from ..eager import unstacked as _unstacked
from . import build
from .bound import Phase1Call, Phase2Call
from .functions import (AttendGiven, Phase1, Phase2, phase1_nograd, phase2_nograd,
                        softmax_given, weighted_sum_nograd)

__all__ = ["available", "bind_phase1", "bind_phase2", "depth_attention", "depth_weights",
           "phase1", "phase2", "phase2_norm"]

def unfused(*, gate: str, heads: int, input_dependent: bool) -> str | None:
    """What of an attend point's options these kernels do not cover (it then runs on the
    eager reference), or None. Any number of depth heads is covered."""
    if input_dependent:
        return "input-dependent queries"
    return f"the {gate} gate" if gate != "softmax" else None


def available(device=None) -> tuple[bool, str]:
    """(True, '') when the kernels can run (on `device`), else (False, why not)."""
    if device is not None and torch.device(device).type != "cpu":
        return False, f"the cpu backend runs on the CPU, not {torch.device(device).type}"
    if build.library() is None:
        return False, build.why() or "the C kernels are not built"
    return True, ""


def _takes(*tensors: torch.Tensor | None) -> bool:
    """True when the kernels take these tensors: on the CPU, float32 or float64, one dtype,
    and not under torch.compile (which cannot trace a foreign call)."""
    ts = [t for t in tensors if t is not None]
    dtype = ts[0].dtype
    return (not torch.compiler.is_compiling() and dtype in (torch.float32, torch.float64)
            and all(t.device.type == "cpu" and t.dtype == dtype for t in ts)
            and build.library() is not None)


def _recording(*tensors: torch.Tensor | None) -> bool:
    """True when autograd records a call on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _sources(sources) -> list[torch.Tensor]:
    return list(sources.unbind(0) if isinstance(sources, torch.Tensor) else sources)


def depth_attention(sources, query: torch.Tensor, key_norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-6, *, key_norm: bool = True, gate: str = "softmax",
                    heads: int = 1, logits=None) -> torch.Tensor:
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i: phase 1 with one query, or, given each
    source's `logits` ([*batch, H] or [1, *batch, H] each: restopo.nn.shared_sources makes
    them once for all of a source's readers, as in Full AttnRes), the softmax and weighted
    sum over them."""
    src = _sources(sources)
    if (unfused(gate=gate, heads=heads, input_dependent=query.dim() != 1)
            or len({v.shape for v in src}) != 1
            or not _takes(query, key_norm_weight, *src, *(logits or ()))):
        if logits is not None:  # the eager backend takes [*batch, H], not a split's piece
            logits = [z.squeeze(0) if z.dim() > src[0].dim() else z for z in logits]
        return _eager.depth_attention(sources, query, key_norm_weight, eps, key_norm=key_norm,
                                      gate=gate, heads=heads, logits=logits)
    _eager._check_heads(src[0].shape[-1], heads)
    if logits is not None:
        return _attend(heads, logits, src)
    q = _eager.gained(query, key_norm_weight, key_norm)[None]
    if not _recording(query, key_norm_weight, *src):
        return phase1_nograd(q, float(eps), bool(key_norm), heads, src)[0][0]
    return Phase1.apply(q, float(eps), bool(key_norm), heads, *src)[0]


def _attend(heads: int, logits, src: list[torch.Tensor]) -> torch.Tensor:
    """Depth attention over `src` given their logits, one [*batch, H] tensor a source (or
    [1, *batch, H], a split's piece): the kernels' softmax and weighted sum (the logits'
    shapes checked by softmax_given)."""
    if not _recording(*logits, *src):
        return weighted_sum_nograd(softmax_given(logits, src, heads, None, False)[0], src)
    return AttendGiven.apply(heads, None, False, *logits, *src)[0]


def phase1(completed, queries: torch.Tensor, key_norm_weights: torch.Tensor | None = None,
           eps: float = 1e-6, *, key_norm: bool = True, heads: int = 1, logits=None):
    """(h1, lse, S Nones), each a tuple over the S queries [S, d]: phase 1's normalised
    state over the completed blocks (see the eager backend's phase1). Given each block's
    `logits` (a group of Full AttnRes readers, restopo.nn.shared_sources; [S, *batch, H]
    or its S columns), their softmax and the kernel's S weighted sums in one pass over the
    blocks, one autograd node (functions.AttendGiven)."""
    src = _sources(completed)
    rows = None if logits is None else [_unstacked.block_logits(zs) for zs in logits]
    if (len({v.shape for v in src}) != 1
            or not _takes(queries, key_norm_weights, *src, *(rows or ()))):
        return _eager.phase1(completed, queries, key_norm_weights, eps, key_norm=key_norm,
                             heads=heads, logits=logits)
    _eager._check_heads(src[0].shape[-1], heads)
    S = queries.shape[0]
    if rows is not None:  # each source's S rows, made once for all their readers
        if not _recording(*rows, *src):
            alpha, lse = softmax_given(rows, src, heads, S, True)
            return weighted_sum_nograd(alpha, src, S), lse, (None,) * S
        out = AttendGiven.apply(heads, S, True, *rows, *src)
        return out[:S], out[S:], (None,) * S
    q = _eager.gained(queries, key_norm_weights, key_norm)
    if not _recording(queries, key_norm_weights, *src):
        h1, lse = phase1_nograd(q, float(eps), bool(key_norm), heads, src)
        return h1, lse, (None,) * S
    out = Phase1.apply(q, float(eps), bool(key_norm), heads, *src)
    return out[:S], out[S:], (None,) * S


def _merge(o1, m1, s1, partial, query, key_norm_weight, eps, key_norm, norm_weight,
           norm_eps, keep_h):
    """(h, y) through the fused kernel, or None where it does not apply."""
    h1, lse = _unstacked.normalised(o1, m1, s1)
    tensors = (h1, lse, partial, query, key_norm_weight, norm_weight)
    if (partial is None or partial.shape != h1.shape or lse.dim() != h1.dim()
            or h1.shape[-1] % lse.shape[-1] or not _takes(*tensors)):
        return None
    q = _eager.gained(query, key_norm_weight, key_norm)
    args = (float(eps), bool(key_norm), norm_eps, keep_h)
    if not _recording(*tensors):
        return phase2_nograd(h1, lse, partial, q, norm_weight, *args)
    return Phase2.apply(h1, lse, partial, q, norm_weight, *args)


def phase2(o1: torch.Tensor, m1: torch.Tensor, s1, partial: torch.Tensor | None,
           query: torch.Tensor, key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           *, key_norm: bool = True) -> torch.Tensor:
    """Phase 2: the block's pre-update partial merged into phase 1's state."""
    got = _merge(o1, m1, s1, partial, query, key_norm_weight, eps, key_norm, None, None, True)
    if got is None:
        return _eager.phase2(o1, m1, s1, partial, query, key_norm_weight, eps,
                             key_norm=key_norm)
    return got[0]


def phase2_norm(o1: torch.Tensor, m1: torch.Tensor, s1, partial: torch.Tensor | None,
                query: torch.Tensor, key_norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, *, norm_weight: torch.Tensor | None = None,
                norm_eps: float | None = None, key_norm: bool = True, keep_h: bool = True):
    """Phase 2 and the next sublayer's PreNorm in one pass: (h or None, RMSNorm(h) * gain)."""
    norm_eps = eps if norm_eps is None else norm_eps
    got = _merge(o1, m1, s1, partial, query, key_norm_weight, eps, key_norm, norm_weight,
                 float(norm_eps), keep_h)
    if got is not None:
        return got
    return _eager.phase2_norm(o1, m1, s1, partial, query, key_norm_weight, eps,
                              norm_weight=norm_weight, norm_eps=norm_eps, key_norm=key_norm,
                              keep_h=keep_h)


def depth_weights(sources, query, key_norm_weight=None, eps: float = 1e-6, *,
                  key_norm: bool = True, gate: str = "softmax", heads: int = 1):
    """For diagnostics: the eager reference's weights."""
    return _eager.depth_weights(sources, query, key_norm_weight, eps, key_norm=key_norm,
                                gate=gate, heads=heads)


def bind_phase1(gained: torch.Tensor, eps: float, *, key_norm: bool, heads: int, general,
                single: bool = False, norm_weight: torch.Tensor | None = None,
                norm_eps: float | None = None):
    """phase1 (or, `single`, depth attention with one query [1, d]) with the queries (their
    key-norm gains folded in, restopo.ops.bind_phase1) and settings bound, for calls
    autograd does not record (bound.py); `general(completed)` where the kernel does not
    take the sources, or here where it takes no such queries. With `norm_eps`, also the
    first query's PreNorm (restopo.ops.bind_phase1)."""
    if (not _takes(gained, norm_weight) or gained.dim() != 2 or gained.shape[-1] % heads
            or (norm_weight is not None and norm_weight.shape != gained.shape[-1:])):
        return general
    return Phase1Call(gained, eps, key_norm, heads, general, single, norm_weight, norm_eps)


def bind_phase2(gained: torch.Tensor, eps: float, *, norm_weight: torch.Tensor | None,
                norm_eps: float | None, key_norm: bool, keep_h: bool, general):
    """phase2 (norm_eps None) or phase2_norm with the query (its gain folded in) and
    settings bound, for calls autograd does not record (bound.py); `general(o1, m1, s1,
    partial)` elsewhere."""
    if not _takes(gained, norm_weight) or gained.dim() != 1:
        return general
    return Phase2Call(gained, eps, key_norm, norm_weight, norm_eps, keep_h, general)
