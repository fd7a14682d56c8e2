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
"""
NORM_EPS = 1e-30
