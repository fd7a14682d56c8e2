"""Multi-stream residual modules: Hyper-Connections (static and dynamic), mHC and mHC-lite
(../shared/hyper.md; its section 11 lists restopo's conventions, held by the tests).

Each token carries n streams X in R^{n x d} ([..., n, d], the stream axis before the
channels), starting as n copies of the embedding (`expand_streams`). The module of
aggregation l makes the coefficients from X_l, pre and post in R^n and R in R^{n x n}, and
reads the sublayer's input; after the sublayer `write_streams` updates the streams:

    h_l     = sum_i pre_i X_i                 (the sublayer keeps its own PreNorm)
    X_{l+1} = R X_l + post (x) v_l            (X_new[j] = sum_i R[j,i] X[i] + post_j v_l)

`forward(x)` returns (h, post, R); the head's module (`StreamSum`) sums the streams.
R is applied as written, so each variant states which transpose of its paper's matrix it
is: SHC/DHC R = A_r^T [HC Eq.2-5], mHC R = comb^T [DSV4 hc_post], mHC-lite R = sum_k a_k P_k.

Precision: coefficients (and Sinkhorn, and their backward, recomputed from the logits) are
computed in float32 (float64
for a float64 model) with autocast off, whatever the model's dtype; the parameters stay
float32 when the model is cast to bf16 or fp16 (`_Float32Params`), as DeepSeek stores its
hc_* weights [hyper.md section 7]. The
streams are mixed in their own dtype, with autocast off so that a float32 residual state is
not rounded to bf16 by a matmul.

Init (hyper.md section 11): SHC/DHC as the HC paper (B = 1, A_m = e_{k mod n} for the k-th
sublayer, 0-based, A_r = I, dynamic weights 0, s_alpha = s_beta = 0.01), exactly PreNorm at
step 0 (no sqrt(n) output rescale: it would break that). mHC and mHC-lite: alpha = 0.01,
b_pre = b_post = 0 (pre = 1/2, post = 1 on every stream), b_res = 0 for mHC (Sinkhorn of
equal logits: uniform mixing) and the identity-favouring -8 off the identity for mHC-lite,
phi xavier-uniform: the small random phi is what breaks the symmetry of the n identical
streams (with phi = 0 they would get identical gradients forever and mHC would stay PreNorm).
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import nn

SINKHORN_EPS = 1e-6   # in every Sinkhorn denominator and on mHC's pre [DSV4 hc_eps]
RMS_EPS = 1e-6        # mHC's RMS over the flattened n*d state [hyper.md section 8]
LN_EPS = 1e-5         # DHC's LayerNorm [HC Alg.2]
ALPHA_INIT = 0.01     # s_alpha, s_beta (HC) and alpha_pre, alpha_post, alpha_res (mHC)
LITE_OFF_IDENTITY = -8.0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The coefficients' dtype: float32, or float64 for a float64 state."""
    return torch.promote_types(x.dtype, torch.float32)


def _no_autocast(x: torch.Tensor):
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def expand_streams(v0: torch.Tensor, n: int) -> torch.Tensor:
    """X_1: n copies of the embedding, [..., d] -> [..., n, d] (a view)."""
    return v0.unsqueeze(-2).expand(*v0.shape[:-1], n, v0.shape[-1])


def read_streams(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """h = sum_i pre_i X_i: x [..., n, d], pre [..., n] (or [n]). A product and a sum over
    the n streams, not a matmul: per token that is a [1, n] x [n, d] product, which a
    batched matmul (and its backward, an outer product per token) does several times slower
    on the CPU than the elementwise ops do. A half-precision state is read in float32 and
    rounded once, as a matmul accumulates."""
    with _no_autocast(x):
        if x.dtype in (torch.float16, torch.bfloat16):
            return (pre.float().unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)
        return (pre.to(x.dtype).unsqueeze(-1) * x).sum(-2)


def write_streams(x: torch.Tensor, v: torch.Tensor, post: torch.Tensor,
                  res: torch.Tensor) -> torch.Tensor:
    """X_new = R X + post (x) v: x [..., n, d], v [..., d], post [..., n], R [..., n, n]."""
    with _no_autocast(x):
        return (torch.matmul(res.to(x.dtype), x)
                + post.to(x.dtype).unsqueeze(-1) * v.to(x.dtype).unsqueeze(-2))


def sinkhorn(logits: torch.Tensor, iters: int, eps: float = SINKHORN_EPS) -> torch.Tensor:
    """DeepSeek's order [hyper.md sections 4, 8]: row softmax + eps, a column
    normalisation, then iters - 1 times (rows, columns), eps in every denominator. The last
    step normalises columns, so columns sum to 1 up to eps and rows approximately; mHC
    applies the transpose, R = comb^T, whose rows (the forward gain) are then the exact ones.

    The backward is the gradient of the unrolled iterations, recomputed from the logits
    (`_RecomputedSinkhorn`, as mHC's kernel and Megatron do) instead of keeping 2 * iters
    intermediate n x n matrices per token for it."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RecomputedSinkhorn.apply(logits, iters, eps)
    return unrolled_sinkhorn(logits, iters, eps)


def _matrices_first(x: torch.Tensor) -> torch.Tensor:
    """[..., n, n] -> [n, n, ...] (a view; softmax then lays it out so)."""
    return x.movedim((-2, -1), (0, 1))


def _matrices_last(x: torch.Tensor) -> torch.Tensor:
    return x.movedim((0, 1), (-2, -1))


def _axes(iters: int) -> list[int]:
    """The normalisations in order, in the [n, n, ...] layout: columns (axis 0), then
    `iters - 1` times rows (axis 1) and columns."""
    return [0] + [1, 0] * (iters - 1)


def unrolled_sinkhorn(logits: torch.Tensor, iters: int, eps: float = SINKHORN_EPS):
    """The iterations themselves (plain autograd would keep every intermediate), with the
    n x n matrices in front of the tokens ([n, n, ...], rows axis 1, columns axis 0): each
    normalisation then adds n whole planes, where over the last two axes it reduced runs
    of n numbers token by token, 7x slower on the CPU at n = 4 (bench/aggregation.py's mHC
    spent most of its time there). Returned in the [..., n, n] layout (one copy of n * n
    numbers per token: a batched matmul of matrices laid out token-last copies them one
    token at a time)."""
    m = torch.softmax(_matrices_first(logits), dim=1) + eps
    keep = torch.is_grad_enabled() and logits.requires_grad  # autograd's reference form
    for axis in _axes(iters):
        if keep:
            m = m / (m.sum(axis, keepdim=True) + eps)
        else:  # in place: nothing is kept for a backward
            m.div_(m.sum(axis, keepdim=True).add_(eps))
    return _matrices_last(m).contiguous()


class _RecomputedSinkhorn(torch.autograd.Function):
    """Forward without a graph, only the logits saved; backward runs the iterations again,
    keeping each normalisation's output and denominator, and goes back through them:
    out = m / d with d = sum(m) + eps along an axis gives dm = (g - sum(g out)) / d, and the
    softmax dz = p (g - sum(g p)). The exact gradient of the unrolled iterations (tested
    against autograd), in fewer operations than autograd's."""

    @staticmethod
    def forward(ctx, logits, iters, eps):
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps
        return unrolled_sinkhorn(logits, iters, eps)

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        p = torch.softmax(_matrices_first(logits), dim=1)  # as unrolled_sinkhorn lays it out
        m, steps = p + ctx.eps, []
        for axis in _axes(ctx.iters):
            d = m.sum(axis, keepdim=True).add_(ctx.eps)
            m = m / d
            steps.append((m, d, axis))
        g = _matrices_first(grad).contiguous()  # in m's layout: the ops below stay dense
        for out, d, axis in reversed(steps):
            g = torch.sub(g, (g * out).sum(axis, keepdim=True)).div_(d)
        return _matrices_last(p * (g - (g * p).sum(1, keepdim=True))).contiguous(), None, None


class _Float32Params(nn.Module):
    """Keeps its parameters and buffers at least float32 when the model is cast to a
    half-precision dtype."""

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for t in itertools.chain(self.parameters(), self.buffers()):
            if t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16):
                t.data = t.data.float()
                if t.grad is not None:
                    t.grad = t.grad.float()
        return out


class _MultiStream(_Float32Params):
    """forward(x [..., n, d]) -> (h [..., d], post, R): the read and the write's
    coefficients; subclasses define `coefficients(x) -> (pre, post, R)` in float32."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.n, self.d = n, d

    def coefficients(self, x: torch.Tensor):
        raise NotImplementedError

    def forward(self, x: torch.Tensor):
        with _no_autocast(x):
            pre, post, res = self.coefficients(x)
        return read_streams(x, pre), post, res

    def extra_repr(self) -> str:
        return f"streams={self.n}, d={self.d}"


class HyperConnection(_MultiStream):
    """Hyper-Connections [HC]: static (SHC) coefficients A_m (read, `alpha_m`), A_r
    (stream mixing, `alpha_r`, row-major n x n) and B (write, `beta`); with `dynamic`
    (DHC) each gains a tanh term from that stream's own LayerNorm-ed d-vector:
        A_m(X) = A_m + s_alpha tanh(LN(X) W_m)    A_r(X) = A_r + s_alpha tanh(LN(X) W_r)
        B(X)   = B + s_beta tanh(LN(X) W_b)       (row i of A_r(X) from stream i)
    with pre = A_m, post = B and R = A_r^T. The static coefficients are 1-D parameters,
    so the optimizer's weight decay (matrices only) leaves them alone, as HC trains them;
    the dynamic projections W = [W_m | W_r] (`dynamic_alpha`, d x (n+1)) and W_b
    (`dynamic_beta`, d x 1) are matrices and decay."""

    def __init__(self, n: int, d: int, index: int, dynamic: bool = False):
        super().__init__(n, d)
        self.dynamic = dynamic
        self.alpha_m = nn.Parameter(F.one_hot(torch.tensor((index - 1) % n), n).float())
        self.alpha_r = nn.Parameter(torch.eye(n).flatten())
        self.beta = nn.Parameter(torch.ones(n))
        if dynamic:
            self.norm = nn.LayerNorm(d, eps=LN_EPS)
            self.dynamic_alpha = nn.Parameter(torch.zeros(d, n + 1))
            self.dynamic_beta = nn.Parameter(torch.zeros(d, 1))
            self.s_alpha = nn.Parameter(torch.tensor(ALPHA_INIT))
            self.s_beta = nn.Parameter(torch.tensor(ALPHA_INIT))

    def coefficients(self, x: torch.Tensor):
        n, ct = self.n, compute_dtype(x)
        a_m, a_r, b = self.alpha_m.to(ct), self.alpha_r.to(ct).view(n, n), self.beta.to(ct)
        if self.dynamic:
            hb = F.layer_norm(x.to(ct), (self.d,), self.norm.weight.to(ct),
                              self.norm.bias.to(ct), LN_EPS)                    # [..., n, d]
            alpha = torch.tanh(hb @ self.dynamic_alpha.to(ct)) * self.s_alpha.to(ct)
            a_m = a_m + alpha[..., 0]                                           # [..., n]
            a_r = a_r + alpha[..., 1:]                                          # [..., n, n]
            b = b + torch.tanh(hb @ self.dynamic_beta.to(ct)).squeeze(-1) * self.s_beta.to(ct)
        return a_m, b, a_r.transpose(-1, -2)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", dynamic={self.dynamic}"


class _Manifold(_MultiStream):
    """mHC's coefficient map over the flattened state [mHC Eq.7-8, DSV4]: with
    x = vec(X) in R^{nd} and r = RMS(x), logits z = alpha_k (x phi)/r + b (the bias after the
    division, no tanh, the RMSNorm gain folded into phi); slots [pre | post | res]."""

    def __init__(self, n: int, d: int, k: int, res_bias: torch.Tensor):
        super().__init__(n, d)
        self.phi = nn.Parameter(torch.empty(n * d, 2 * n + k))
        nn.init.xavier_uniform_(self.phi)
        self.bias = nn.Parameter(torch.cat([torch.zeros(2 * n), res_bias.flatten()]))
        self.alpha = nn.Parameter(torch.full((3,), ALPHA_INIT))  # pre, post, res

    def logits(self, x: torch.Tensor):
        n, ct = self.n, compute_dtype(x)
        flat = x.to(ct).flatten(-2)                                     # [..., n*d]
        r = torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        z = (flat @ self.phi.to(ct)) / r
        a_pre, a_post, a_res = self.alpha.to(ct)
        b = self.bias.to(ct)
        return (a_pre * z[..., :n] + b[:n], a_post * z[..., n:2 * n] + b[n:2 * n],
                a_res * z[..., 2 * n:] + b[2 * n:])


class ManifoldHyperConnection(_Manifold):
    """mHC [mHC section 4; DSV4]: pre = sigmoid + eps, post = 2 sigmoid, and the mixing
    comb = Sinkhorn(res logits as n x n), applied transposed: R = comb^T."""

    def __init__(self, n: int, d: int, sinkhorn_iters: int = 20):
        super().__init__(n, d, n * n, torch.zeros(n, n))
        self.sinkhorn_iters = sinkhorn_iters
        self.sinkhorn_eps = SINKHORN_EPS

    def coefficients(self, x: torch.Tensor):
        zp, zq, zr = self.logits(x)
        comb = sinkhorn(zr.unflatten(-1, (self.n, self.n)), self.sinkhorn_iters,
                        self.sinkhorn_eps)
        return torch.sigmoid(zp) + SINKHORN_EPS, 2 * torch.sigmoid(zq), comb.transpose(-1, -2)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sinkhorn={self.sinkhorn_iters}"


def permutation_matrices(n: int) -> torch.Tensor:
    """All n! permutation matrices [n!, n, n], the identity first."""
    perms = list(itertools.permutations(range(n)))
    return torch.stack([torch.eye(n)[list(p)] for p in perms])


class LiteHyperConnection(_Manifold):
    """mHC-lite [FFTYYY/mhc-lite]: pre = sigmoid, post = 2 sigmoid, and R = sum_k a_k P_k,
    a = softmax of n! logits over the permutation matrices P_k (P_0 = I): exactly doubly
    stochastic, no Sinkhorn. b_res starts at 0 on P_0 and -8 elsewhere."""

    def __init__(self, n: int, d: int):
        perms = permutation_matrices(n)
        res_bias = torch.full((len(perms),), LITE_OFF_IDENTITY)
        res_bias[0] = 0.0
        super().__init__(n, d, len(perms), res_bias)
        self.register_buffer("perms", perms, persistent=False)

    def coefficients(self, x: torch.Tensor):
        zp, zq, zr = self.logits(x)
        a = torch.softmax(zr, dim=-1)
        return torch.sigmoid(zp), 2 * torch.sigmoid(zq), \
            torch.einsum("...k,kij->...ij", a, self.perms.to(a.dtype))


class StreamSum(nn.Module):
    """The head's point: the sum of the streams (HC's collapse; the final norm removes the
    factor n while the streams are still alike)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-2)


class StreamExpand(nn.Module):
    """X_1 = n copies of v_0 (a module so that the generated code reads
    `streams1 = self.expand_streams(embedding)`)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, v0: torch.Tensor) -> torch.Tensor:
        return expand_streams(v0, self.n)

    def extra_repr(self) -> str:
        return f"streams={self.n}"


class StreamWrite(nn.Module):
    """X_{l+1} = R X_l + post (x) v_l from the read's (h, post, R) (a module so that the
    generated code reads `streams2 = self.write_streams(streams1, sublayer1, mix1)`)."""

    def forward(self, x: torch.Tensor, v: torch.Tensor, mix) -> torch.Tensor:
        _, post, res = mix
        return write_streams(x, v, post, res)


def make_stream_module(method: str, n: int, d: int, index: int, head: bool,
                       dynamic: bool = False, sinkhorn_iters: int | None = None) -> nn.Module:
    """The module of a multi-stream aggregation point (index l; the head's sums)."""
    if head:
        return StreamSum()
    if method == "hyper_connections":
        return HyperConnection(n, d, index, dynamic)
    if method == "mhc":
        return ManifoldHyperConnection(n, d, sinkhorn_iters or 20)
    if method == "mhc_lite":
        return LiteHyperConnection(n, d)
    raise ValueError(f"unknown multi-stream method {method!r}")
