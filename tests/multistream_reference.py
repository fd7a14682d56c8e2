"""A naive per-sublayer loop for the multi-stream residuals, written from the pseudocode of
../shared/hyper.md section 8 (and sections 2-5 for the parameter shapes and inits), not from
restopo's modules: float64, numpy-style formulas on torch tensors.

It borrows from the compiled model only what is not residual wiring (embed, context,
sublayers, head) and the values of the coefficient parameters, by aggregation index,
through `params_of` (the one place that knows restopo's parameter names).
"""
from __future__ import annotations

import itertools
import math

import torch

SK_EPS = 1e-6      # every Sinkhorn denominator and mHC's pre (DSV4 hc_eps)
RMS_EPS = 1e-6     # mHC's flattened RMS (section 8's mhc_logits)
LN_EPS = 1e-5      # DHC's LayerNorm (section 8's ln)


def sig(z):
    return 1 / (1 + torch.exp(-z))


def ln(x, weight, bias):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + LN_EPS) * weight + bias


def shc(P, X):
    """Static HC: pre = A_m, post = B, R = A_r^T, the same for every token."""
    T = X.shape[0]
    return (P["Am"].expand(T, -1), P["B"].expand(T, -1), P["Ar"].T.expand(T, -1, -1))


def dhc(P, X):
    """Dynamic HC: per stream, from that stream's own LayerNorm-ed d-vector, tanh terms with
    s_alpha shared by A_m and A_r."""
    Hb = ln(X, P["ln_w"], P["ln_b"])
    Am = P["Am"] + P["s_a"] * torch.tanh(Hb @ P["Wm"])           # (T, n)
    Ar = P["Ar"] + P["s_a"] * torch.tanh(Hb @ P["Wr"])           # (T, n, n), row i: stream i
    B = P["B"] + P["s_b"] * torch.tanh(Hb @ P["Wb"])             # (T, n)
    return Am, B, Ar.transpose(1, 2)


def sinkhorn_comb(Z, iters, eps=SK_EPS):
    M = torch.exp(Z - Z.max(-1, keepdim=True).values)
    M = M / M.sum(-1, keepdim=True) + eps
    M = M / (M.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        M = M / (M.sum(-1, keepdim=True) + eps)
        M = M / (M.sum(-2, keepdim=True) + eps)
    return M


def mhc_logits(P, X):
    T, n, d = X.shape
    x = X.reshape(T, n * d)
    z = (x @ P["phi"]) / torch.sqrt((x * x).mean(-1, keepdim=True) + RMS_EPS)
    return (P["a_pre"] * z[:, :n] + P["b_pre"], P["a_post"] * z[:, n:2 * n] + P["b_post"],
            P["a_res"] * z[:, 2 * n:] + P["b_res"])


def mhc(P, X, iters, eps=SK_EPS):
    n = X.shape[1]
    zp, zq, zr = mhc_logits(P, X)
    return sig(zp) + SK_EPS, 2 * sig(zq), sinkhorn_comb(zr.reshape(-1, n, n), iters, eps) \
        .transpose(1, 2)


def permutations(n):
    """(n!, n, n), the identity first."""
    mats = []
    for p in itertools.permutations(range(n)):
        m = torch.zeros(n, n, dtype=torch.float64)
        for i, j in enumerate(p):
            m[i, j] = 1.0
        mats.append(m)
    return torch.stack(mats)


def mhc_lite(P, X):
    zp, zq, zr = mhc_logits(P, X)
    a = torch.exp(zr - zr.max(-1, keepdim=True).values)
    a = a / a.sum(-1, keepdim=True)
    return sig(zp), 2 * sig(zq), torch.einsum("tk,kij->tij", a, permutations(X.shape[1]))


def params_of(module, method: str, n: int) -> dict:
    """The coefficient parameters of one restopo module, under the note's names (float64)."""
    get = {k: v.detach().double() for k, v in module.named_parameters()}
    if method in ("shc", "dhc"):
        P = {"Am": get["alpha_m"], "Ar": get["alpha_r"].view(n, n), "B": get["beta"]}
        if method == "dhc":
            W = get["dynamic_alpha"]
            P.update(Wm=W[:, 0], Wr=W[:, 1:], Wb=get["dynamic_beta"][:, 0],
                     s_a=get["s_alpha"], s_b=get["s_beta"], ln_w=get["norm.weight"],
                     ln_b=get["norm.bias"])
        return P
    b, a = get["bias"], get["alpha"]
    return {"phi": get["phi"], "a_pre": a[0], "a_post": a[1], "a_res": a[2],
            "b_pre": b[:n], "b_post": b[n:2 * n], "b_res": b[2 * n:]}


def coefficient_fn(method: str, iters: int = 20, eps: float = SK_EPS):
    return {"shc": shc, "dhc": dhc, "mhc_lite": mhc_lite,
            "mhc": lambda P, X: mhc(P, X, iters, eps)}[method]


@torch.no_grad()
def forward(model, idx: torch.Tensor, method: str, n: int, iters: int = 20,
            eps: float = SK_EPS, coeffs=None) -> torch.Tensor:
    """Logits of the multi-stream loop: n copies of the embedding; per sublayer
    pre, post, R = coeffs(X); y = F(read) with F's own PreNorm; X = R X + post y; the head's
    final norm on the sum of the streams. Tokens are flattened to (T, n, d) rows."""
    coeffs = coeffs or coefficient_fn(method, iters, eps)
    emb = model.embed(idx)
    B, T, d = emb.shape
    ctx = model.context(idx, emb) if model.context is not None else ()
    X = emb.reshape(B * T, 1, d).repeat(1, n, 1)
    for l, f in enumerate(model.sublayers, start=1):
        P = params_of(model.aggregations[l - 1], method, n)
        pre, post, R = coeffs(P, X)
        u = torch.einsum("tn,tnd->td", pre, X)
        y = f(u.reshape(B, T, d), *ctx).reshape(B * T, d)
        X = torch.einsum("tij,tjd->tid", R, X) + post[..., None] * y[:, None]
    return model.head(X.sum(1).reshape(B, T, d))


def n_permutations(n: int) -> int:
    return math.factorial(n)
