"""The RMSNorm epsilon of every norm restopo builds (sublayer PreNorms, the final norm, the
key norms and the input-dependent query's norm of depth attention).

Why so small. With zero-initialised pseudo-queries an AttnRes aggregation is the *mean* of
its sources, which differs from the standard residual's *sum* only by the factor 1/n that the
next RMSNorm removes: so at step 0 Full and Block AttnRes (and DenseFormer, and the
softmax-scalar ablation) must compute exactly the standard model. That holds only while eps
is negligible against the normalised vector's mean square. Embeddings start at std 0.02
(mean square 4e-4), and the mean of n sources has about 1/n^2 of that: at 33 sources it is
3.7e-7, *below* the usual 1e-6, so such an epsilon shrinks the deep sublayers' inputs, the
more the deeper, and AttnRes starts as a different (worse) model than the standard one
(measured: Full AttnRes logits 0.58 of the logit scale away from standard's at 32 sublayers).

Why not smaller. The gradient must stay finite for an all-zero row too. torch's RMSNorm
backward (nn.RMSNorm, F.rms_norm: the sublayer PreNorms, the final norm, the input-dependent
query's and Highway's norms) forms rstd^3 = (mean(x^2) + eps)^-1.5, which overflows float32
(3.4e38) at a zero row once eps < 2e-26: an earlier 1e-30 gave NaN gradients there, in fp32
and bf16 alike. 1e-24 leaves rstd^3 = 1e36 at a zero row, a factor of 300 below overflow,
and keeps the norm scale-invariant to 1e-10 for any mean square down to 1e-14 (far below
any activation a model produces at init: 4e-10 at 33 sources of an embedding at std 1e-3).

In every dtype the forward maps an all-zero row to 0 (0 * rsqrt(eps)), never 0/0: eps is a
normal float32 number and every norm path computes its mean square in at least float32
(F.rms_norm and restopo's eager and Triton kernels upcast bf16 and fp16), so it neither
underflows nor meets denormals there. The backward at an exactly zero row is finite in fp32
and bf16; in pure fp16 (max 65504) no epsilon small enough for the equality above keeps
1/sqrt(eps) finite, so a pure-fp16 model's gradient at such a row overflows (train in bf16 or
with fp32 weights under autocast). tests/test_init_equivalence.py holds each property.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops

NORM_EPS = 1e-24


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameters, state_dict and maths) whose training step on the CPU
    runs restopo.ops.rms_norm: its backward written out, where torch's forms it from
    autograd's ops at several times the cost (the PreNorm of every sublayer, in every
    topology, and the final norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.eps is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        return ops.rms_norm(x, self.weight, self.eps)
