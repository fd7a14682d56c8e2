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

1e-30 keeps the norm exactly scale-invariant for any mean square down to about 1e-20 (well
past any activation a model produces) and still guards the one case epsilon is for: an
all-zero row gives 0 (0 * rsqrt(1e-30)), never 0/0. It is a normal float32 number, and every
norm path computes its mean square in at least float32 (F.rms_norm and restopo's eager and
Triton kernels upcast bf16 and fp16), so it neither underflows nor meets denormals there.
tests/test_init_equivalence.py holds both properties.

The known limit is in the backward. torch's RMSNorm backward (nn.RMSNorm, F.rms_norm: the
sublayer PreNorms, the final norm, the input-dependent query's and Highway's norms) forms
rstd^3, which overflows float32 once mean(x^2) + eps < about 2e-26: at an exactly zero row
its gradient is NaN (inf for a row of RMS below about 1e-13), in fp32, bf16 and fp16
alike (measured with torch 2.13); float64 gives the exact 1/sqrt(eps) = 1e15.
Depth attention's key norm has its own backward (backends/eager/unstacked.py, _Rstd:
rstd^2 v first) and stays finite in fp32 and bf16; pure fp16 overflows there too (1e15).
Rows that small are not expected in training (at step 0 every norm input mixes in the
embedding with positive weights), so this is a documented limit, not a guard; an epsilon of
1e-20 would keep rstd^3 finite in fp32 at the cost of scale-invariance below ~1e-10.
"""
NORM_EPS = 1e-30
