"""Functional entry points for the depth-aggregation ops, with backend dispatch.

Same signatures as the eager backend's ops plus `backend=`:
  eager   plain torch (the reference)
  triton  fused GPU kernels
  cpu     fused C kernels for the CPU (built with the machine's C compiler on first use)
  auto    triton when the tensors are on CUDA and the triton backend imports; on the CPU
          the cpu backend when its kernels build (else eager, and it says why once);
          eager under torch.compile on either (inductor fuses the eager forms; picked_for)
Each backend is found by name in the registry (`get_backend`, restopo.registry), which loads
it on first use; `register_backend` replaces one.

Shapes: `sources` [n, *batch, d] or a sequence of n [*batch, d] tensors, `query` [d] (or
[*batch, d] for an input-dependent query, which the fused kernels do not take: such calls
run eagerly on every backend). A sequence reaches either backend as it is: neither stacks
it (the fused kernels read the sources through a table of their addresses).

`bind_phase1`, `bind_depth_attention` and `bind_phase2` return those calls with everything
but the per-token tensors bound, for calls autograd does not record (decoding, evaluation),
kept by the aggregation modules while their parameters are unchanged: on the cpu backend a
bound call is its kernel with its constants (backends/cpu/bound.py).
"""
from __future__ import annotations

import os
import warnings

import torch

from .registry import get_backend, register_backend  # noqa: F401  (the public entry)

BACKENDS = ("auto", "eager", "triton", "cpu")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def triton_unavailable_reason(device=None) -> str | None:
    """Why the triton backend cannot run on `device` (None: on this machine at all, i.e.
    neither on CUDA nor in triton's CPU interpreter), or None when it can."""
    try:
        mod = _triton_module()
    except ImportError as e:
        return f"the triton backend does not import ({e}); install 'restopo[triton]'"
    if device is not None:
        ok, why = mod.available(device)
        return None if ok else why
    ok_cuda, why = mod.available("cuda")
    if ok_cuda or mod.available("cpu")[0]:
        return None
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device and TRITON_INTERPRET is not set to 1"
    return why


def _triton_module():
    return get_backend("triton")


def _eager():
    return get_backend("eager")


def _cpu_module():
    return get_backend("cpu")


_cpu_said = False


def _cpu_ok() -> bool:
    """Whether `auto` may run the cpu backend here: its kernels build. Said once when not."""
    global _cpu_said
    try:
        ok, why = _cpu_module().available()
    except ImportError as e:
        ok, why = False, str(e)
    if not ok and not _cpu_said:
        _cpu_said = True
        warnings.warn(f"restopo: the fused CPU kernels are unavailable ({why}); depth "
                      "attention runs on the eager backend (same results, slower)",
                      stacklevel=3)
    return ok


def load_backends(backend: str) -> None:
    """Load now the backends calls with `backend=` will reach: the first lookup of one reads
    entry points, which torch.compile cannot trace (a graph break in the first aggregation
    of a compiled model, and its backend's autograd Functions then run frame by frame)."""
    _eager()
    if backend == "triton" or (backend == "auto" and torch.cuda.is_available()):
        try:
            _triton_module()
        except ImportError:  # auto then runs eagerly; triton says why when it is called
            pass


def require_backend(backend: str, device=None) -> None:
    """Raise a RuntimeError naming why when `backend` cannot run here (on `device`)."""
    check_backend(backend)
    if backend == "triton":
        why = triton_unavailable_reason(device)
        if why is not None:
            raise RuntimeError(f"backend 'triton' cannot run: {why}")
    if backend == "cpu":
        ok, why = _cpu_module().available(device)
        if not ok:
            raise RuntimeError(f"backend 'cpu' cannot run: {why}")


def picked(backend: str, tensor: torch.Tensor) -> str:
    """The backend (eager or triton) a call with `backend=` on `tensor` runs on."""
    return _pick(backend, tensor)


def _pick(backend: str, tensor: torch.Tensor) -> str:
    """The backend one call runs on."""
    return picked_for(backend, tensor.device, tensor.dtype, torch.compiler.is_compiling())


def picked_for(backend: str, device: torch.device, dtype: torch.dtype,
               compiling: bool = False) -> str:
    """The backend a call with `backend=` on tensors of `dtype` on `device` runs on, traced
    by torch.compile (`compiling`) or not; before any such tensor exists (regional
    compilation decides by it which regions to compile, restopo.train.compile)."""
    if backend == "eager":
        return "eager"
    if backend in ("triton", "cpu"):
        require_backend(backend, device)
        return backend
    check_backend(backend)
    # Traced (torch.compile), auto leaves the aggregations to inductor on every device: the
    # fused kernels are opaque custom ops there, each call paying the dispatcher and an
    # autotuned launch on the host (about 1.1 ms for a phase-2 forward and backward on an
    # H200's host), which made compiled Block AttnRes at width 512 step 4.4x standard
    # against 2.9x eager on an H200 (bench/overhead.py --device cuda); at d 2048, where the
    # kernels' own time dominates, inductor's code for the eager two-phase came within 5% of
    # them (bench/triton_depth.py). backend="triton" still traces the custom ops.
    if (device.type == "cuda" and not compiling
            and triton_unavailable_reason(device) is None):
        return "triton"
    if (device.type == "cpu" and not compiling
            and dtype in (torch.float32, torch.float64) and _cpu_ok()):
        return "cpu"
    return "eager"


def unfused_points(g, picked: str) -> dict[str, int]:
    """The attend points of IR `g` that run on the eager reference though the run picked
    the fused backend `picked` (triton or cpu): {what its kernels do not cover: how many
    points}. Empty for eager, and where every point is covered."""
    if picked not in ("triton", "cpu"):
        return {}
    covers = get_backend(picked).unfused
    out: dict[str, int] = {}
    for a in g.aggregations():
        if a.method == "attend":
            why = covers(gate=a.gate, heads=a.heads, input_dependent=a.query != "static")
            if why is not None:
                out[why] = out.get(why, 0) + 1
    return out


def cpu_kernels(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an uncompiled call with `backend=` on tensors of `dtype` on `device` runs
    the cpu backend's fused C kernels (for the calls they cover: static queries, the
    softmax gate). Never raises: off the CPU (CUDA, a meta-built model) it is False."""
    device = torch.device(device)
    return (device.type == "cpu" and dtype in (torch.float32, torch.float64)
            and picked_for(backend, device, dtype) == "cpu")


def _first(sources) -> torch.Tensor:
    return sources if isinstance(sources, torch.Tensor) else sources[0]


def _check_sources(sources, what: str) -> None:
    """Refuse sources that are not n tensors of one shape [*batch, d], d >= 1, by their
    shapes, before a backend indexes into them (each failed in its own way: an IndexError,
    a reshape or matmul error, or a kernel's)."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2 or sources.shape[-1] == 0:
            raise ValueError(f"{what} must be [n, *batch, d] with d >= 1; got shape "
                             f"{tuple(sources.shape)}")
        return
    first = sources[0].shape
    if first and first[-1] and all(v.shape == first for v in sources):
        return  # the common case, cheaply: it runs at every aggregation of a forward
    shapes = ", ".join(str(s) for s in dict.fromkeys(tuple(v.shape) for v in sources))
    raise ValueError(f"{what} must be tensors of one shape [*batch, d] with d >= 1; got "
                     f"{shapes}")


def depth_attention(sources: torch.Tensor, query: torch.Tensor,
                    key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                    key_norm: bool = True, gate: str = "softmax", heads: int = 1,
                    backend: str = "eager", logits=None) -> torch.Tensor:
    """h = sum_i alpha_i v_i, alpha = softmax_i(query . RMSNorm(v_i)) (or sigmoid); [*batch, d].

    `sources` is [n, *batch, d], or a sequence of n [*batch, d] tensors: then no backend
    keeps a stacked copy for backward. `logits`: each source's logit [*batch, heads],
    already made (restopo.nn.shared_sources); the eager backend uses them with a sequence of
    sources, the fused kernels make their own."""
    if len(sources) == 0:  # a softmax over nothing: every backend refuses, none returns 0
        raise ValueError("depth attention needs at least one source; got none")
    _check_sources(sources, "sources")
    if logits is not None and gate == "softmax" and len(logits) == 1 and len(sources) == 1:
        # a softmax over one logit is 1 exactly: the source itself (a grouped Full AttnRes
        # reader that reads nothing besides its group's phase 1, restopo.nn.shared_sources;
        # the logit, already made, gets no gradient from it either way)
        return sources[0]
    # Per-token (input-dependent) queries have no fused kernel: they run eagerly.
    picked = _pick(backend, _first(sources)) if query.dim() == 1 else "eager"
    if picked == "triton":
        return _triton_module().depth_attention(sources, query, key_norm_weight, eps,
                                                key_norm=key_norm, gate=gate, heads=heads)
    return _host(picked).depth_attention(sources, query, key_norm_weight, eps, key_norm=key_norm,
                                    gate=gate, heads=heads, **_given(logits))


def phase1(completed: torch.Tensor, queries: torch.Tensor,
           key_norm_weights: torch.Tensor | None = None, eps: float = 1e-6, *,
           key_norm: bool = True, heads: int = 1, backend: str = "eager", logits=None):
    """Phase 1 for one block: (o1 [S, *batch, d], m1 [S, *batch, heads], s1 [S, *batch, heads]).
    `completed` is [n, *batch, d] or a sequence of n [*batch, d] tensors. The fused backend
    returns o1 as a tuple of S tensors (o1[s] is the same either way). `logits`: each
    block's [S, *batch, heads] against the queries (or its S columns [*batch, heads]),
    already made (as in depth_attention).
    The eager backend returns the normalised form instead: o1 / s1, m1 + log s1, and s1
    as S Nones (s1[s] is None). phase2 takes both forms."""
    if len(completed) == 0:
        raise ValueError("phase 1 needs at least one completed block; got none (a block's "
                         "first sublayer with nothing before it has no phase 1)")
    _check_sources(completed, "completed blocks")
    picked = _pick(backend, _first(completed))
    if picked == "triton":
        return _triton_module().phase1(completed, queries, key_norm_weights, eps,
                                       key_norm=key_norm, heads=heads)
    return _host(picked).phase1(completed, queries, key_norm_weights, eps, key_norm=key_norm,
                           heads=heads, **_given(logits))


def _host(picked: str):
    """The backend a host-side (not triton) pick runs: cpu or eager, same signatures."""
    return _cpu_module() if picked == "cpu" else _eager()


def _given(logits) -> dict:
    """`logits=` only when there are some: a registered backend need not take it."""
    return {} if logits is None else {"logits": logits}


def gathered(source: torch.Tensor) -> torch.Tensor:
    """A view of `source` whose gradient from the eager backend's weighted sums is added up
    in place, once for all its readers (for restopo.nn.shared_sources)."""
    return _eager().gathered(source)


def logits_against(source: torch.Tensor, gained_queries: torch.Tensor, eps: float = 1e-6, *,
                   key_norm: bool = True, heads: int = 1) -> torch.Tensor:
    """[R, *batch, heads]: the depth-attention logits of one source [*batch, d] against R
    static queries [R, d] with their key-norm gains folded in (eager: one matmul)."""
    return _eager().logits_against(source, gained_queries, eps, key_norm=key_norm, heads=heads)


def phase2(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor, partial: torch.Tensor | None,
           query: torch.Tensor, key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           *, key_norm: bool = True, backend: str = "eager") -> torch.Tensor:
    """Phase 2: merge the pre-update partial into phase 1's result by online softmax."""
    picked = _pick(backend, o1)
    if picked == "triton":
        return _triton_module().phase2(o1, m1, s1, partial, query, key_norm_weight, eps,
                                       key_norm=key_norm)
    return _host(picked).phase2(o1, m1, s1, partial, query, key_norm_weight, eps, key_norm=key_norm)


def phase2_norm(o1: torch.Tensor, m1: torch.Tensor, s1: torch.Tensor,
                partial: torch.Tensor | None, query: torch.Tensor,
                key_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                norm_weight: torch.Tensor | None = None, norm_eps: float | None = None,
                key_norm: bool = True, keep_h: bool = True, backend: str = "eager"):
    """Phase 2 and the next sublayer's PreNorm: (h, rms_norm(h, norm_weight, norm_eps)),
    or (None, y) with keep_h=False. The fused backends compute both in one kernel; the
    eager one is phase2 followed by the norm, exactly what the unfused sublayer computes."""
    picked = _pick(backend, o1)
    module = _triton_module() if picked == "triton" else _host(picked)
    return module.phase2_norm(o1, m1, s1, partial, query, key_norm_weight, eps,
                              norm_weight=norm_weight, norm_eps=norm_eps, key_norm=key_norm,
                              keep_h=keep_h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension times `weight` (None: no gain), as F.rms_norm:
    the sublayers' PreNorm and the final norm (restopo.nn.norm.RMSNorm). The eager
    backend's, whose CPU backward is written out (F.rms_norm's is several times slower
    there); F.rms_norm wherever that would not pay (CUDA, torch.compile, no autograd)."""
    return _eager().rms_norm(x, weight, eps)


def depth_weights(sources, query: torch.Tensor, key_norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, *, key_norm: bool = True, gate: str = "softmax",
                  heads: int = 1) -> torch.Tensor:
    """alpha [n, *batch, heads]: the weight `depth_attention` gives each source (per head).
    For diagnostics: always the eager reference, whatever the backend."""
    return _eager().depth_weights(sources, query, key_norm_weight, eps, key_norm=key_norm,
                                  gate=gate, heads=heads)


def bind_phase1(queries: torch.Tensor, key_norm_weights: torch.Tensor | None = None,
                eps: float = 1e-6, *, key_norm: bool = True, heads: int = 1,
                backend: str = "eager", norm_weight: torch.Tensor | None = None,
                norm_eps: float | None = None):
    """phase1 with everything but the completed sources bound: f(completed) ==
    phase1(completed, queries, ...), for calls autograd does not record (decoding,
    evaluation), made once while the parameters are unchanged (restopo.nn.aggregate). On
    the cpu backend the kernel and its constants are bound (backends/cpu/bound.py): a
    call is a few checks, the outputs' allocation and the kernel; elsewhere it is phase1.
    With `norm_eps`, the state has a fourth item, (y0, norm_weight, norm_eps): the first
    query's output's RMSNorm with gain `norm_weight`, which is phase2_norm's y for it with
    no partial (a block's first sublayer's PreNorm, made in the same kernel call)."""
    gained = fold_gain(queries, key_norm_weights, key_norm)

    def general(completed):
        state = phase1(completed, gained, None, eps, key_norm=key_norm, heads=heads,
                       backend=backend)
        if norm_eps is None:
            return state
        o1, m1, s1 = (x[0] for x in state)
        y0 = phase2_norm(o1, m1, s1, None, gained[0], None, eps, norm_weight=norm_weight,
                         norm_eps=norm_eps, key_norm=key_norm, keep_h=False,
                         backend=backend)[1]
        return (*state, (y0, norm_weight, norm_eps))
    return _bind(backend, queries, "bind_phase1", general, gained, eps, key_norm=key_norm,
                 heads=heads, norm_weight=norm_weight, norm_eps=norm_eps)


def bind_depth_attention(query: torch.Tensor, key_norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-6, *, key_norm: bool = True, heads: int = 1,
                         backend: str = "eager"):
    """depth_attention (softmax gate, static query [d]) with everything but the sources
    bound, as bind_phase1: f(sources) == depth_attention(sources, query, ...)."""
    gained = fold_gain(query, key_norm_weight, key_norm)

    def general(sources):
        return depth_attention(sources, gained, None, eps, key_norm=key_norm, heads=heads,
                               backend=backend)
    return _bind(backend, query, "bind_phase1", general, gained[None], eps,
                 key_norm=key_norm, heads=heads, single=True)


def bind_phase2(query: torch.Tensor, key_norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, *, norm_weight: torch.Tensor | None = None,
                norm_eps: float | None = None, key_norm: bool = True, keep_h: bool = True,
                backend: str = "eager"):
    """phase2 (norm_eps None) or phase2_norm with everything but phase 1's state and the
    partial bound, as bind_phase1: f(o1, m1, s1, partial) == phase2(o1, m1, s1, partial,
    query, ...), or phase2_norm's (h, y)."""
    gained = fold_gain(query, key_norm_weight, key_norm)

    def general(o1, m1, s1, partial):
        if norm_eps is None:
            return phase2(o1, m1, s1, partial, gained, None, eps, key_norm=key_norm,
                          backend=backend)
        return phase2_norm(o1, m1, s1, partial, gained, None, eps, norm_weight=norm_weight,
                           norm_eps=norm_eps, key_norm=key_norm, keep_h=keep_h,
                           backend=backend)
    return _bind(backend, query, "bind_phase2", general, gained, eps, norm_weight=norm_weight,
                 norm_eps=norm_eps, key_norm=key_norm, keep_h=keep_h)


def fold_gain(query: torch.Tensor, gain: torch.Tensor | None,
              key_norm: bool) -> torch.Tensor:
    """The query with its key-norm gain folded in (the eager backend's `gained`: in at
    least fp32), once at bind time rather than at every call."""
    return _eager().gained(query, gain, key_norm)


def _bind(backend: str, like: torch.Tensor, name: str, general, *args, **kwargs):
    """The cpu backend's bound call where `backend` picks it for tensors like `like` (the
    bound parameters; a call whose tensors turn out otherwise takes `general`), else
    `general` itself."""
    if backend in ("auto", "cpu") and like.device.type == "cpu" and _pick(backend, like) == "cpu":
        return getattr(_cpu_module(), name)(*args, general=general, **kwargs)
    return general
