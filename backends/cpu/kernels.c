/* restopo's fused CPU kernels for Block AttnRes's two phases (and depth attention, which is
 * phase 1 with one query). A template: build.py instantiates it for float and double by
 * defining REAL and NAME(x) before each copy.
 *
 * Every tensor is row-major and contiguous: M tokens of d channels, cut into H depth heads
 * of c = d / H channels. One token's work is independent of every other's, so tokens are
 * split over threads; each token's sources are read once per pass (a row of d numbers
 * stays in L1 while its logits, weights and outputs are made), where plain torch ops pass
 * over every (source, output) pair separately. Reductions over tokens (the gradients of
 * the queries and the norm gain) go to one double-precision row per thread, added in
 * thread order at the end: the same threads give the same bits.
 *
 * Phase 1 returns its state normalised, as the eager backend does: h1 = sum_i a_i v_i with
 * a = softmax_i(z_i), and lse = log sum_i exp(z_i). It keeps its logits (n S H numbers a
 * token) and the sources' rstd for the backward, which makes the weights from them; nothing
 * d-sized is kept beyond the sources.
 */

/* EXP, LOG, SQRT: the functions of REAL's precision (build.py defines them with REAL, and
 * FLOAT32 to 1 for float) */

#if FLOAT32
/* e^x for float in a form the compiler vectorises (libm's expf is one call a number, and
 * phase 1 takes n S H of them a token each way: a quarter of its forward at n = 8, S = 4;
 * with this, at M = 2048, d = 64, forward 1.27 -> 1.09 ms and backward 1.9 -> 1.7 ms).
 * x = k ln2 + r with |r| <= ln2/2 (ln2 in two parts, so k ln2 is exact to float), e^r by
 * its Taylor series to r^7 (truncation under 1e-8 relative there, below float's rounding),
 * times 2^k put in the exponent bits. Below -87 it gives 0 (where expf would go subnormal:
 * a softmax weight of nothing; e^-87 there gave a logit at -inf a weight, and its source,
 * at 1e37, a share, where eager's is 0), above 88 inf (a sigmoid of -inf is 0); NaN stays. */
static inline float NAME(exp_vec)(float x) {
    float y = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = rintf(y * 1.44269504088896341f);
    float r = (y - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int bits = ((int)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x != x ? x : (x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : p * scale));
}
#define EXP_VEC(x) NAME(exp_vec)(x)
#else
#define EXP_VEC(x) EXP(x)  /* double (the tests' gradchecks): libm's */
#endif

/* e[k] = e^(e[k]) in place, k < count */
static inline void NAME(exp_all)(REAL *e, long count) {
#pragma omp simd
    for (long k = 0; k < count; k++) e[k] = EXP_VEC(e[k]);
}

/* A register's worth of REAL, and four of them: the span of one output row that phase 1
 * and wsum_fwd sum over every source in registers, reading each source's span once, where
 * adding source by source into the output row reads and writes that row once per source.
 * A 512-bit register where the processor has them (-march=native): a row of 64 floats is
 * then one span, half the loads and multiply-adds (wsum_fwd at n = 25, S = 6, M = 2048,
 * d = 64: 1.09 -> 0.87 ms; its backward 3.2 -> 2.9 ms). */
#ifdef __AVX512F__
#define VEC_BYTES 64
#else
#define VEC_BYTES 32
#endif
typedef REAL NAME(vec) __attribute__((vector_size(VEC_BYTES)));
#define SPAN (4 * (long)(VEC_BYTES / sizeof(REAL)))

static inline NAME(vec) NAME(load)(const REAL *p) {
    NAME(vec) v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* o[0, SPAN) = the four registers v0..v3 */
static inline void NAME(store_span)(REAL *o, NAME(vec) v0, NAME(vec) v1, NAME(vec) v2,
                                    NAME(vec) v3) {
    const long L = SPAN / 4;
    memcpy(o, &v0, sizeof v0);
    memcpy(o + L, &v1, sizeof v1);
    memcpy(o + 2 * L, &v2, sizeof v2);
    memcpy(o + 3 * L, &v3, sizeof v3);
}

/* NAME(vec) x0, x1, x2, x3: the span at ptr, in four registers */
#define LOAD_SPAN(x, ptr)                                                                   \
    NAME(vec) x##0 = NAME(load)(ptr), x##1 = NAME(load)((ptr) + SPAN / 4),                 \
              x##2 = NAME(load)((ptr) + SPAN / 2), x##3 = NAME(load)((ptr) + 3 * SPAN / 4)
/* the dot of two spans held in registers x0..x3 and y0..y3: a register tree, then hsum */
#define SPAN_DOT(x, y) NAME(hsum)((x##0 * y##0 + x##1 * y##1) + (x##2 * y##2 + x##3 * y##3))

/* the sum of a register's lanes: its halves added down to 128 bits, then the last two or
 * four lanes pairwise (a tree, where a loop over the lanes would be a chain of adds) */
typedef REAL NAME(v128) __attribute__((vector_size(16)));
#if VEC_BYTES == 64
typedef REAL NAME(v256) __attribute__((vector_size(32)));
#endif
static inline REAL NAME(hsum)(NAME(vec) v) {
#if VEC_BYTES == 64
    NAME(v256) lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    lo += hi;
#else
    NAME(vec) lo = v;
#endif
    NAME(v128) x, y;
    memcpy(&x, &lo, sizeof x);
    memcpy(&y, (const char *)&lo + sizeof x, sizeof y);
    x += y;
#if FLOAT32
    return (x[0] + x[2]) + (x[1] + x[3]);
#else
    return x[0] + x[1];
#endif
}

/* a . b for a row of whole spans longer than one (d = 512): four registers of partial sums,
 * one lane tree at the end. The eight-lane `dot` below is one chain of dependent adds, an
 * add's latency per eight numbers: 64 in a row at d = 512 (phase 1's key norm). */
static inline REAL NAME(dot_spans)(const REAL *a, const REAL *b, long n) {
    const long L = SPAN / 4;
    NAME(vec) s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (long k = 0; k < n; k += SPAN) {
        s0 += NAME(load)(a + k) * NAME(load)(b + k);
        s1 += NAME(load)(a + k + L) * NAME(load)(b + k + L);
        s2 += NAME(load)(a + k + 2 * L) * NAME(load)(b + k + 2 * L);
        s3 += NAME(load)(a + k + 3 * L) * NAME(load)(b + k + 3 * L);
    }
    return NAME(hsum)((s0 + s1) + (s2 + s3));
}

/* a . b in eight lanes, added pairwise at the end (a plain reduction loop ends in sixteen
 * dependent scalar adds that keep the order of a vector's lanes, several times the cost of
 * the multiplies for the short rows here, c = 64) */
static inline REAL NAME(dot)(const REAL *a, const REAL *b, long n) {
    REAL acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    long k = 0;
    for (; k + 8 <= n; k += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[k + j] * b[k + j];
    for (int j = 0; k < n; k++, j++) acc[j & 7] += a[k] * b[k];
    for (int j = 0; j < 4; j++) acc[j] += acc[j + 4];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

/* a . b over a row of n numbers (a token's whole row, or a head's slice of it, the whole
 * row with one depth head): by spans where it is several (dot_spans), else `dot`. The
 * branch lives here, not in `dot`, and this is inlined by force: gcc -O2 otherwise left
 * either as a call, which cost phase 2's backward at d = 64 about a tenth. */
static inline __attribute__((always_inline)) REAL NAME(row_dot)(const REAL *a, const REAL *b,
                                                                 long n) {
    return n > SPAN && n % SPAN == 0 ? NAME(dot_spans)(a, b, n) : NAME(dot)(a, b, n);
}

/* 1 / RMS of a row of d numbers whose squares sum to ss */
static inline REAL NAME(inv_rms)(REAL ss, long d, double eps) {
    return 1 / SQRT(ss / (REAL)d + (REAL)eps);
}

/* o = a v (set) or o += a v (else) over n numbers. `restrict`: o is never v, which is
 * what lets the compiler vectorise it (without, it measured scalar and 2.5x slower) */
static inline void NAME(axpy)(REAL *restrict o, REAL a, const REAL *restrict v, long n,
                              int set) {
    if (set) {
#pragma omp simd
        for (long k = 0; k < n; k++) o[k] = a * v[k];
    } else {
#pragma omp simd
        for (long k = 0; k < n; k++) o[k] += a * v[k];
    }
}

/* out[s * stride + h] = x_s . v over head h for S rows x_s = x + s * xs (c == SPAN: a head
 * is one span), v's spans loaded once for all S, each dot summed by a register tree */
static inline void NAME(span_dots)(const REAL *v, const REAL *x, long xs, long S, long H,
                                   REAL *out, long stride) {
    for (long h = 0; h < H; h++) {
        const REAL *vh = v + h * SPAN;
        LOAD_SPAN(v, vh);
        for (long s = 0; s < S; s++) {
            LOAD_SPAN(x, x + s * xs + h * SPAN);
            out[s * stride + h] = SPAN_DOT(x, v);
        }
    }
}

/* o[0, SPAN) = sum_i a[i * stride] src[i][at, at + SPAN), in registers */
static inline void NAME(span_sum)(REAL *o, const REAL *const *src, long n, long at,
                                  const REAL *a, long stride) {
    const long L = SPAN / 4;
    NAME(vec) o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
    for (long i = 0; i < n; i++) {
        const REAL *v = src[i] + at;
        REAL al = a[i * stride];
        o0 += al * NAME(load)(v);
        o1 += al * NAME(load)(v + L);
        o2 += al * NAME(load)(v + 2 * L);
        o3 += al * NAME(load)(v + 3 * L);
    }
    NAME(store_span)(o, o0, o1, o2, o3);
}

/* 1 / RMS(v) (1 without key norm) */
static inline REAL NAME(rstd)(const REAL *v, long d, double eps, int key_norm) {
    return key_norm ? NAME(inv_rms)(NAME(row_dot)(v, v, d), d, eps) : 1;
}

/* y = h rstd(h) g, a sublayer's PreNorm of one row (g may be NULL: no gain); its rstd */
static inline REAL NAME(prenorm)(const REAL *h, const REAL *g, long d, double eps, REAL *y) {
    REAL r = NAME(inv_rms)(NAME(row_dot)(h, h, d), d, eps);
    if (g) {
#pragma omp simd
        for (long k = 0; k < d; k++) y[k] = h[k] * r * g[k];
    } else {
#pragma omp simd
        for (long k = 0; k < d; k++) y[k] = h[k] * r;
    }
    return r;
}

/* The square sum of v and its dots with the S queries, z[s*H + h] over head h (the row
 * stays in L1 across them). Sweeping the row once for four queries at a time, in five
 * chains, measured slower (2.0 against 1.3 ms for phase 1 at n = 8, S = 4, M = 2048). */
static inline void NAME(row_dots)(const REAL *v, const REAL *q, long S, long d, long H,
                                  REAL *z, REAL *ss) {
    long c = d / H;
    *ss = NAME(row_dot)(v, v, d);
    if (c == SPAN) {
        NAME(span_dots)(v, q, d, S, H, z, H);
        return;
    }
    for (long s = 0; s < S; s++)
        for (long h = 0; h < H; h++) z[s * H + h] = NAME(row_dot)(q + s * d + h * c, v + h * c, c);
}

/* Tokens a tile: each source's rows of a tile are one contiguous run (8 KiB at d = 64 in
 * float), read source by source. Token by token, a Full AttnRes reader would stream from
 * as many places as it has sources, more than the hardware prefetcher follows: three
 * times slower, measured at 33 sources. */
#define TILE 32

/* Phase 1 forward: h1[s] (S pointers to [M, d]) and lse[s] (S pointers to [M, H]); the
 * logits zs [M, n, S*H] and rstds rs [M, n] are kept for the backward (both NULL: not
 * kept, without autograd). y0 not NULL (without autograd): also the first member's
 * PreNorm, y0 = h1[0] rstd(h1[0]) g0 (g0 may be NULL: no gain), as phase2_fwd writes y,
 * since that member has no partial to merge (one call less per block in decoding). */
void NAME(phase1_fwd)(long n, const REAL *const *src, long S, long M, long d, long H,
                      const REAL *q, double eps, int key_norm, REAL *const *h1,
                      REAL *const *lse, REAL *zs, REAL *rs, const REAL *g0, double norm_eps,
                      REAL *y0, int threads) {
    long c = d / H, SH = S * H, tiles = (M + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads)
    {
        REAL *a = (REAL *)malloc(sizeof(REAL) * (2 * TILE * n * SH + TILE * SH));
        REAL *zl = a + TILE * n * SH;  /* this tile's logits when zs is NULL */
        REAL *mx = zl + TILE * n * SH;  /* and their max over sources */
#pragma omp for schedule(static)
        for (long tile = 0; tile < tiles; tile++) {
            long t0 = tile * TILE, tn = M - t0 < TILE ? M - t0 : TILE;
            REAL *zt = zs ? zs + t0 * n * SH : zl;  /* [tn, n, SH] */
            for (long i = 0; i < n; i++)  /* logits, source by source */
                for (long u = 0; u < tn; u++) {
                    long t = t0 + u;
                    REAL *z = zt + (u * n + i) * SH, ss;
                    NAME(row_dots)(src[i] + t * d, q, S, d, H, z, &ss);
                    REAL r = key_norm ? NAME(inv_rms)(ss, d, eps) : 1;
                    if (rs) rs[t * n + i] = r;
                    for (long sh = 0; sh < SH; sh++) z[sh] *= r;
                }
            /* softmax over sources: the logits less their max, their exps in one
             * vectorised sweep over the tile, then the sums */
            for (long u = 0; u < tn; u++) {
                const REAL *z = zt + u * n * SH;
                REAL *at = a + u * n * SH;
                for (long sh = 0; sh < SH; sh++) {
                    REAL m = z[sh];
                    for (long i = 1; i < n; i++) m = z[i * SH + sh] > m ? z[i * SH + sh] : m;
                    mx[u * SH + sh] = m;
                    for (long i = 0; i < n; i++) at[i * SH + sh] = z[i * SH + sh] - m;
                }
            }
            NAME(exp_all)(a, tn * n * SH);
            for (long u = 0; u < tn; u++) {
                long t = t0 + u;
                REAL *at = a + u * n * SH;
                for (long sh = 0; sh < SH; sh++) {
                    REAL sum = 0;
                    for (long i = 0; i < n; i++) sum += at[i * SH + sh];
                    REAL inv = 1 / sum;
                    for (long i = 0; i < n; i++) at[i * SH + sh] *= inv;
                    lse[sh / H][t * H + sh % H] = mx[u * SH + sh] + LOG(sum);
                }
            }
            if (c % SPAN == 0) {  /* the weighted sums, each output span in registers */
                for (long u = 0; u < tn; u++)
                    for (long s = 0; s < S; s++)
                        for (long k = 0; k < d; k += SPAN)
                            NAME(span_sum)(h1[s] + (t0 + u) * d + k, src, n, (t0 + u) * d + k,
                                           a + u * n * SH + s * H + k / c, SH);
            } else {
                for (long i = 0; i < n; i++)  /* the weighted sums, source by source */
                    for (long u = 0; u < tn; u++) {
                        long t = t0 + u;
                        const REAL *at = a + (u * n + i) * SH;
                        for (long s = 0; s < S; s++)
                            for (long h = 0; h < H; h++) {
                                REAL *o = h1[s] + t * d + h * c, al = at[s * H + h];
                                const REAL *v = src[i] + t * d + h * c;
                                if (i == 0) {
#pragma omp simd
                                    for (long k = 0; k < c; k++) o[k] = al * v[k];
                                } else {
#pragma omp simd
                                    for (long k = 0; k < c; k++) o[k] += al * v[k];
                                }
                            }
                    }
            }
            if (y0)
                for (long t = t0; t < t0 + tn; t++)
                    NAME(prenorm)(h1[0] + t * d, g0, d, norm_eps, y0 + t * d);
        }
        free(a);
    }
}

/* Phase 1 backward, from the forward's logits zs and rstds rs. gh1[s] ([M, d]) and glse[s]
 * ([M, H]) may be NULL (no gradient). dsrc[i] ([M, d], NULL: not wanted) is written, or
 * added to where add[i]. dq ([S, d]) is written: the gradient of the (gained) queries,
 * summed in REAL over a tile, then in double. */
void NAME(phase1_bwd)(long n, const REAL *const *src, long S, long M, long d, long H,
                      const REAL *q, int key_norm, const REAL *zs, const REAL *rs,
                      const REAL *const *lse, const REAL *const *gh1,
                      const REAL *const *glse, REAL *const *dsrc, const int *add, REAL *dq,
                      int threads) {
    long c = d / H, SH = S * H, tiles = (M + TILE - 1) / TILE;
    int nt = threads < 1 ? 1 : threads;
    double *dq_part = (double *)calloc((size_t)nt * S * d, sizeof(double));
#pragma omp parallel num_threads(nt)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        double *dqa = dq_part + (size_t)me * S * d;
        REAL *a = (REAL *)malloc(sizeof(REAL) * (2 * TILE * n * SH + d + S * d));
        REAL *dz = a + TILE * n * SH, *row = dz + TILE * n * SH, *dqc = row + d;
#pragma omp for schedule(static)
        for (long tile = 0; tile < tiles; tile++) {
            long t0 = tile * TILE, tn = M - t0 < TILE ? M - t0 : TILE;
            memset(dqc, 0, sizeof(REAL) * S * d);
            for (long u = 0; u < tn; u++)  /* the weights: exps in one vectorised sweep */
                for (long i = 0; i < n; i++) {
                    long t = t0 + u, at = (u * n + i) * SH;
                    const REAL *z = zs + (t * n + i) * SH;
                    for (long s = 0; s < S; s++)
                        for (long h = 0; h < H; h++)
                            a[at + s * H + h] = z[s * H + h] - lse[s][t * H + h];
                }
            NAME(exp_all)(a, tn * n * SH);
            for (long i = 0; i < n; i++)  /* g_s . v_i, source by source */
                for (long u = 0; u < tn; u++) {
                    long t = t0 + u, at = (u * n + i) * SH;
                    const REAL *v = src[i] + t * d;
                    if (c == SPAN) {  /* a head is one span: each dot by a register tree */
                        for (long s = 0; s < S; s++)
                            if (gh1[s]) {
                                NAME(span_dots)(v, gh1[s] + t * d, 0, 1, H, dz + at + s * H, 1);
                            } else {
                                for (long h = 0; h < H; h++) dz[at + s * H + h] = 0;
                            }
                        continue;
                    }
                    for (long s = 0; s < S; s++)
                        for (long h = 0; h < H; h++)
                            dz[at + s * H + h] = gh1[s] ? NAME(row_dot)(gh1[s] + t * d + h * c,
                                                                    v + h * c, c) : 0;
                }
            for (long u = 0; u < tn; u++) {  /* softmax's and logsumexp's backward */
                long t = t0 + u;
                REAL *au = a + u * n * SH, *du = dz + u * n * SH;
                for (long sh = 0; sh < SH; sh++) {
                    REAL gl = glse[sh / H] ? glse[sh / H][t * H + sh % H] : 0, sum = 0;
                    for (long i = 0; i < n; i++) sum += au[i * SH + sh] * du[i * SH + sh];
                    for (long i = 0; i < n; i++)
                        du[i * SH + sh] = au[i * SH + sh] * (du[i * SH + sh] - sum + gl);
                }
            }
            for (long i = 0; i < n; i++)  /* each source's gradient, source by source */
                for (long u = 0; u < tn; u++) {
                    long t = t0 + u, at = (u * n + i) * SH;
                    const REAL *z = zs + (t * n + i) * SH, *v = src[i] + t * d;
                    REAL r = rs[t * n + i], coef = 0;
                    if (key_norm) {  /* z = rstd u: d z / d v through rstd is -z rstd^2 v / d */
                        for (long sh = 0; sh < SH; sh++) coef += dz[at + sh] * z[sh];
                        coef *= -r * r / (REAL)d;
                    }
                    if (c % SPAN == 0) {  /* the row's spans made in registers */
                        const long L = SPAN / 4;
                        REAL *out = dsrc[i] ? dsrc[i] + t * d : NULL;
                        for (long k = 0; k < d; k += SPAN) {
                            long h = k / c;
                            LOAD_SPAN(v, v + k);
                            NAME(vec) o0 = coef * v0, o1 = coef * v1, o2 = coef * v2,
                                      o3 = coef * v3;
                            for (long s = 0; s < S; s++) {
                                REAL al = a[at + s * H + h], g_dz = dz[at + s * H + h] * r;
                                const REAL *qk = q + s * d + k;
                                REAL *dqk = dqc + s * d + k;
                                if (gh1[s]) {
                                    const REAL *gk = gh1[s] + t * d + k;
                                    o0 += al * NAME(load)(gk);
                                    o1 += al * NAME(load)(gk + L);
                                    o2 += al * NAME(load)(gk + 2 * L);
                                    o3 += al * NAME(load)(gk + 3 * L);
                                }
                                o0 += g_dz * NAME(load)(qk);
                                o1 += g_dz * NAME(load)(qk + L);
                                o2 += g_dz * NAME(load)(qk + 2 * L);
                                o3 += g_dz * NAME(load)(qk + 3 * L);
                                NAME(vec) q0 = NAME(load)(dqk) + g_dz * v0,
                                          q1 = NAME(load)(dqk + L) + g_dz * v1,
                                          q2 = NAME(load)(dqk + 2 * L) + g_dz * v2,
                                          q3 = NAME(load)(dqk + 3 * L) + g_dz * v3;
                                NAME(store_span)(dqk, q0, q1, q2, q3);
                            }
                            if (!out) continue;
                            if (add[i]) {
                                o0 += NAME(load)(out + k);
                                o1 += NAME(load)(out + k + L);
                                o2 += NAME(load)(out + k + 2 * L);
                                o3 += NAME(load)(out + k + 3 * L);
                            }
                            NAME(store_span)(out + k, o0, o1, o2, o3);
                        }
                        continue;
                    }
#pragma omp simd
                    for (long k = 0; k < d; k++) row[k] = coef * v[k];
                    for (long s = 0; s < S; s++)
                        for (long h = 0; h < H; h++) {
                            REAL al = a[at + s * H + h], g_dz = dz[at + s * H + h] * r;
                            const REAL *qh = q + s * d + h * c, *vh = v + h * c;
                            REAL *rh = row + h * c, *dqh = dqc + s * d + h * c;
                            if (gh1[s]) {
                                const REAL *gh = gh1[s] + t * d + h * c;
#pragma omp simd
                                for (long k = 0; k < c; k++) {
                                    rh[k] += al * gh[k] + g_dz * qh[k];
                                    dqh[k] += g_dz * vh[k];
                                }
                            } else {
#pragma omp simd
                                for (long k = 0; k < c; k++) {
                                    rh[k] += g_dz * qh[k];
                                    dqh[k] += g_dz * vh[k];
                                }
                            }
                        }
                    if (!dsrc[i]) continue;
                    REAL *out = dsrc[i] + t * d;
                    if (add[i]) {
#pragma omp simd
                        for (long k = 0; k < d; k++) out[k] += row[k];
                    } else {
                        memcpy(out, row, sizeof(REAL) * d);
                    }
                }
            for (long k = 0; k < S * d; k++) dqa[k] += (double)dqc[k];
        }
        free(a);
    }
    for (long k = 0; k < S * d; k++) {
        double sum = 0;
        for (int p = 0; p < nt; p++) sum += dq_part[(size_t)p * S * d + k];
        dq[k] = (REAL)sum;
    }
    free(dq_part);
}

/* Positions (token, head) a chunk of the given softmax: its rows of every logit column and
 * of alpha stay in L1 across the passes over them. */
#define CHUNK 256

/* The softmax over n sources of given logits, S of them (a group of readers' columns,
 * source-major: z[i * S + s], each [M, H], a piece of its source's shared logits):
 * alpha [n, S, M, H] and, where lse is not NULL, lse[s] ([M, H]) = log sum_i e^z. One
 * pass over the columns where torch's stack, softmax and logsumexp (over a non-last dim)
 * made five. */
void NAME(given_softmax)(long n, long S, const REAL *const *z, long M, long H, REAL *alpha,
                         REAL *const *lse, int threads) {
    long MH = M * H, chunks = (MH + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long chunk = 0; chunk < chunks; chunk++) {
        long p0 = chunk * CHUNK, np = MH - p0 < CHUNK ? MH - p0 : CHUNK;
        REAL mx[CHUNK], sum[CHUNK];
        for (long s = 0; s < S; s++) {
            memcpy(mx, z[s] + p0, sizeof(REAL) * np);
            for (long i = 1; i < n; i++) {
                const REAL *zi = z[i * S + s] + p0;
                for (long p = 0; p < np; p++) mx[p] = zi[p] > mx[p] ? zi[p] : mx[p];
            }
            memset(sum, 0, sizeof(REAL) * np);
            for (long i = 0; i < n; i++) {
                const REAL *zi = z[i * S + s] + p0;
                REAL *a = alpha + (i * S + s) * MH + p0;
#pragma omp simd
                for (long p = 0; p < np; p++) a[p] = zi[p] - mx[p];
                NAME(exp_all)(a, np);
#pragma omp simd
                for (long p = 0; p < np; p++) sum[p] += a[p];
            }
            if (lse)
                for (long p = 0; p < np; p++) lse[s][p0 + p] = mx[p] + LOG(sum[p]);
#pragma omp simd
            for (long p = 0; p < np; p++) sum[p] = 1 / sum[p];
            for (long i = 0; i < n; i++) {
                REAL *a = alpha + (i * S + s) * MH + p0;
#pragma omp simd
                for (long p = 0; p < np; p++) a[p] *= sum[p];
            }
        }
    }
}

/* given_softmax's backward: dz = alpha (dalpha - sum_i alpha_i dalpha_i + glse) per (s,
 * position), from alpha's gradient dalpha (both [n, S, M, H]) and lse's glse[s] ([M, H];
 * the array or an entry NULL: none); dz ([n, S, M, H]) may be dalpha itself. */
void NAME(given_softmax_bwd)(long n, long S, const REAL *alpha, const REAL *dalpha,
                             const REAL *const *glse, long M, long H, REAL *dz,
                             int threads) {
    long MH = M * H, chunks = (MH + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long chunk = 0; chunk < chunks; chunk++) {
        long p0 = chunk * CHUNK, np = MH - p0 < CHUNK ? MH - p0 : CHUNK;
        REAL dot[CHUNK];
        for (long s = 0; s < S; s++) {
            const REAL *gl = glse ? glse[s] : NULL;
            if (gl) {
                for (long p = 0; p < np; p++) dot[p] = -gl[p0 + p];
            } else {
                memset(dot, 0, sizeof(REAL) * np);
            }
            for (long i = 0; i < n; i++) {
                const REAL *a = alpha + (i * S + s) * MH + p0, *g = dalpha + (i * S + s) * MH + p0;
#pragma omp simd
                for (long p = 0; p < np; p++) dot[p] += a[p] * g[p];
            }
            for (long i = 0; i < n; i++) {
                long at = (i * S + s) * MH + p0;
                const REAL *a = alpha + at, *g = dalpha + at;
                REAL *o = dz + at;
#pragma omp simd
                for (long p = 0; p < np; p++) o[p] = a[p] * (g[p] - dot[p]);
            }
        }
    }
}
#undef CHUNK

/* The weighted sums over sources, out_s = sum_i alpha_{i,s} v_i per head for S outputs,
 * with alpha [n, S, M, H] given: Full AttnRes's readers, whose logits are made once per
 * source for all its readers (restopo.nn.shared_sources) and whose softmax given_softmax
 * makes in vectorised passes over a chunk of positions (a scalar exp per source, token and
 * head inside this loop cost more than the whole sum); S > 1 for a group of readers over
 * the sources they all read (its phase 1).
 * Against torch's multiply-adds it reads each source once for all S outputs and writes
 * each output once, their tiles in L2. A tile is 256 KiB of output rows: each source's
 * rows of it are one long run for the prefetcher (at 32 tokens a tile, 8 KiB runs from 33
 * sources measured 1.46x standard against 1.36x for Full AttnRes). */
static inline long NAME(wsum_tile)(long d, long S) {
    long rows = 262144 / ((long)sizeof(REAL) * d * S);
    return rows < 32 ? 32 : rows;
}

void NAME(wsum_fwd)(long n, const REAL *const *src, long S, const REAL *alpha, long M,
                    long d, long H, REAL *const *out, int threads) {
    long c = d / H, rows = NAME(wsum_tile)(d, S), tiles = (M + rows - 1) / rows;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long tile = 0; tile < tiles; tile++) {
        long t0 = tile * rows, t1 = M - t0 < rows ? M : t0 + rows;
        if (c % SPAN == 0) {  /* spans within one head: each output span in registers */
            for (long t = t0; t < t1; t++)
                for (long s = 0; s < S; s++)
                    for (long k = 0; k < d; k += SPAN)
                        NAME(span_sum)(out[s] + t * d + k, src, n, t * d + k,
                                       alpha + (s * M + t) * H + k / c, S * M * H);
            continue;
        }
        for (long i = 0; i < n; i++)
            for (long t = t0; t < t1; t++) {
                const REAL *v = src[i] + t * d;
                for (long s = 0; s < S; s++) {
                    const REAL *a = alpha + ((i * S + s) * M + t) * H;
                    REAL *o = out[s] + t * d;
                    for (long h = 0; h < H; h++)
                        NAME(axpy)(o + h * c, a[h], v + h * c, c, i == 0);
                }
            }
    }
}
/* One token's row of one source in wsum_bwd where a head is one span (c == SPAN): for each
 * head, the row's span v and its gradient's span stay in registers while each output's
 * gradient span is loaded once for both its dot with v (alpha's gradient) and its term of
 * v's gradient. `a` and `da` point at (s = 0, head 0) of this token, `step` apart per s;
 * dv NULL: v's gradient not wanted, written (add 0) or added to. */
static inline void NAME(span_bwd)(const REAL *v, REAL *dv, int add, const REAL *const *g,
                                  long at, const REAL *a, REAL *da, long step, long S,
                                  long H) {
    const long L = SPAN / 4;
    for (long h = 0; h < H; h++) {
        const REAL *vh = v + h * SPAN;
        LOAD_SPAN(v, vh);
        NAME(vec) o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
        if (dv && add) {
            o0 = NAME(load)(dv + h * SPAN);
            o1 = NAME(load)(dv + h * SPAN + L);
            o2 = NAME(load)(dv + h * SPAN + 2 * L);
            o3 = NAME(load)(dv + h * SPAN + 3 * L);
        }
        for (long s = 0; s < S; s++) {
            if (!g[s]) {
                da[s * step + h] = 0;
                continue;
            }
            const REAL *gs = g[s] + at + h * SPAN;
            LOAD_SPAN(g, gs);
            da[s * step + h] = SPAN_DOT(g, v);
            REAL al = a[s * step + h];
            o0 += al * g0;
            o1 += al * g1;
            o2 += al * g2;
            o3 += al * g3;
        }
        if (dv) NAME(store_span)(dv + h * SPAN, o0, o1, o2, o3);
    }
}

/* wsum_fwd's backward: from the outputs' gradients g[s] ([M, d]; NULL: none), alpha's
 * (dalpha [n, S, M, H], the dots g_s . v_i per head) and each source's (dsrc[i] [M, d],
 * NULL: not wanted), written or added to where add[i], in one pass over each source while
 * the gradients' tiles stay in L2. */
void NAME(wsum_bwd)(long n, const REAL *const *src, long S, const REAL *alpha, long M,
                    long d, long H, const REAL *const *g, REAL *dalpha, REAL *const *dsrc,
                    const int *add, int threads) {
    long c = d / H, rows = NAME(wsum_tile)(d, S), tiles = (M + rows - 1) / rows;
    const long L = SPAN / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long tile = 0; tile < tiles; tile++) {
        long t0 = tile * rows, t1 = M - t0 < rows ? M : t0 + rows;
        for (long i = 0; i < n; i++)
            for (long t = t0; t < t1; t++) {
                const REAL *v = src[i] + t * d;
                if (c == SPAN) {  /* a head is one span: its dots and its row in registers */
                    NAME(span_bwd)(v, dsrc[i] ? dsrc[i] + t * d : NULL, add[i], g, t * d,
                                   alpha + (i * S * M + t) * H, dalpha + (i * S * M + t) * H,
                                   M * H, S, H);
                    continue;
                }
                for (long s = 0; s < S; s++)
                    for (long h = 0; h < H; h++)
                        dalpha[((i * S + s) * M + t) * H + h] =
                            g[s] ? NAME(row_dot)(g[s] + t * d + h * c, v + h * c, c) : 0;
                REAL *dv = dsrc[i] ? dsrc[i] + t * d : NULL;
                if (!dv) continue;
                if (c % SPAN == 0) {  /* the S terms of each span summed in registers */
                    for (long k = 0; k < d; k += SPAN) {
                        long h = k / c;
                        NAME(vec) o0 = {0}, o1 = {0}, o2 = {0}, o3 = {0};
                        if (add[i]) {
                            o0 = NAME(load)(dv + k);
                            o1 = NAME(load)(dv + k + L);
                            o2 = NAME(load)(dv + k + 2 * L);
                            o3 = NAME(load)(dv + k + 3 * L);
                        }
                        for (long s = 0; s < S; s++) {
                            if (!g[s]) continue;
                            const REAL *gt = g[s] + t * d + k;
                            REAL a = alpha[((i * S + s) * M + t) * H + h];
                            o0 += a * NAME(load)(gt);
                            o1 += a * NAME(load)(gt + L);
                            o2 += a * NAME(load)(gt + 2 * L);
                            o3 += a * NAME(load)(gt + 3 * L);
                        }
                        NAME(store_span)(dv + k, o0, o1, o2, o3);
                    }
                    continue;
                }
                int set = !add[i];  /* the row is written by its first term */
                for (long s = 0; s < S; s++) {
                    if (!g[s]) continue;
                    const REAL *a = alpha + ((i * S + s) * M + t) * H;
                    for (long h = 0; h < H; h++)
                        NAME(axpy)(dv + h * c, a[h], g[s] + t * d + h * c, c, set);
                    set = 0;
                }
                if (set) memset(dv, 0, sizeof(REAL) * d);
            }
    }
}

/* phase2_fwd's tokens [t0, t1) where a row is one span (d == SPAN, one depth head, as
 * phase2_bwd_span): p, h1 and h in registers, each dot a register tree. */
static void NAME(phase2_fwd_span)(long t0, long t1, const REAL *h1, const REAL *lse,
                                  const REAL *p, const REAL *q, double eps, int key_norm,
                                  const REAL *g, double norm_eps, REAL *out_h, REAL *out_y,
                                  REAL *w, REAL *rstd2) {
    const long L = SPAN / 4;
    LOAD_SPAN(q, q);
    for (long t = t0; t < t1; t++) {
        const REAL *pt = p + t * SPAN, *ht = h1 + t * SPAN;
        LOAD_SPAN(p, pt);
        LOAD_SPAN(a, ht);
        REAL r = key_norm ? NAME(inv_rms)(SPAN_DOT(p, p), SPAN, eps) : 1;
        REAL z2 = r * SPAN_DOT(q, p) - lse[t];
        REAL wt = 1 / (1 + EXP_VEC(-z2)), ut = 1 - wt;
        if (w) w[t] = wt;
        NAME(vec) x0 = ut * a0 + wt * p0, x1 = ut * a1 + wt * p1, x2 = ut * a2 + wt * p2,
                  x3 = ut * a3 + wt * p3;  /* h = (1 - w) h1 + w p: see phase2_fwd */
        if (out_h) NAME(store_span)(out_h + t * SPAN, x0, x1, x2, x3);
        if (!out_y) continue;
        REAL r2 = NAME(inv_rms)(SPAN_DOT(x, x), SPAN, norm_eps);
        if (rstd2) rstd2[t] = r2;
        x0 *= r2, x1 *= r2, x2 *= r2, x3 *= r2;  /* y = h rstd g, in prenorm's order */
        if (g) {
            x0 *= NAME(load)(g), x1 *= NAME(load)(g + L), x2 *= NAME(load)(g + 2 * L),
            x3 *= NAME(load)(g + 3 * L);
        }
        NAME(store_span)(out_y + t * SPAN, x0, x1, x2, x3);
    }
}

/* Phase 2, fused with the next sublayer's PreNorm: for each token,
 *   w = sigmoid(rstd(p) (q . p) - lse) per head,  h = (1 - w) h1 + w p,
 *   y = h rstd(h) g  (norm_eps >= 0; g may be NULL: no gain).
 * h is formed as that convex sum, exact at w = 0 and 1 like torch.lerp, which eager runs:
 * h1 + w (p - h1) lost the partial's digits next to a large h1 (p 500 against h1 1e25 at
 * w = 1 gave h = 0), and lerp's own form branches on w (a third slower here).
 * h is written where out_h is not NULL, y where out_y is not NULL; w [M, H] and the norm's
 * rstd2 [M] are kept for the backward. */
void NAME(phase2_fwd)(long M, long d, long H, const REAL *h1, const REAL *lse, const REAL *p,
                      const REAL *q, double eps, int key_norm, const REAL *g, double norm_eps,
                      REAL *out_h, REAL *out_y, REAL *w, REAL *rstd2, int threads) {
    /* w and rstd2 may be NULL (not kept, without autograd) */
    long c = d / H;
#pragma omp parallel num_threads(threads)
    {
        REAL *hrow = (REAL *)malloc(sizeof(REAL) * d);
        long tiles = (M + TILE - 1) / TILE;
        if (d == SPAN && H == 1) {
#pragma omp for schedule(static)
            for (long tile = 0; tile < tiles; tile++)
                NAME(phase2_fwd_span)(tile * TILE, M - tile * TILE < TILE ? M : (tile + 1) * TILE,
                                      h1, lse, p, q, eps, key_norm, g, norm_eps, out_h, out_y,
                                      w, rstd2);
        } else
#pragma omp for schedule(static)
        for (long t = 0; t < M; t++) {
            const REAL *pt = p + t * d, *ht = h1 + t * d;
            REAL r = NAME(rstd)(pt, d, eps, key_norm);
            for (long h = 0; h < H; h++) {
                REAL z2 = r * NAME(row_dot)(q + h * c, pt + h * c, c) - lse[t * H + h];
                REAL wh = 1 / (1 + EXP_VEC(-z2)), uh = 1 - wh;
                if (w) w[t * H + h] = wh;
#pragma omp simd
                for (long k = h * c; k < (h + 1) * c; k++) hrow[k] = uh * ht[k] + wh * pt[k];
            }
            if (out_h) memcpy(out_h + t * d, hrow, sizeof(REAL) * d);
            if (out_y) {
                REAL r2 = NAME(prenorm)(hrow, g, d, norm_eps, out_y + t * d);
                if (rstd2) rstd2[t] = r2;
            }
        }
        free(hrow);
    }
}

/* phase2_bwd's tokens [t0, t1) where a row is one span (d == SPAN: width 64 in float with
 * one depth head, on AVX-512): each row's p, h1, h and gradients stay in registers, the
 * four dots of a token (|p|^2, q . p, the norm's, w's) each a register tree, and dq and dg
 * summed in registers over the tokens, added to dqa and dga at the end. The general loop
 * wrote h and its gradient to a scratch row and read them back, and summed each dot in one
 * chain. */
static void NAME(phase2_bwd_span)(long t0, long t1, const REAL *h1, const REAL *p,
                                  const REAL *q, double eps, int key_norm, const REAL *g,
                                  const REAL *w, const REAL *rstd2, const REAL *gy,
                                  const REAL *gh, REAL *dh1, REAL *dp, REAL *dlse, REAL *dqa,
                                  REAL *dga) {
    const long L = SPAN / 4;
    const NAME(vec) zero = {0};
    LOAD_SPAN(q, q);
    NAME(vec) dq0 = zero, dq1 = zero, dq2 = zero, dq3 = zero;
    NAME(vec) dg0 = zero, dg1 = zero, dg2 = zero, dg3 = zero;
    for (long t = t0; t < t1; t++) {
        const REAL *pt = p + t * SPAN, *ht = h1 + t * SPAN;
        LOAD_SPAN(p, pt);
        LOAD_SPAN(a, ht);
        NAME(vec) e0 = p0 - a0, e1 = p1 - a1, e2 = p2 - a2, e3 = p3 - a3;
        REAL wt = w[t], ut = 1 - wt;  /* h as the forward made it */
        NAME(vec) x0 = ut * a0 + wt * p0, x1 = ut * a1 + wt * p1, x2 = ut * a2 + wt * p2,
                  x3 = ut * a3 + wt * p3;
        REAL r = key_norm ? NAME(inv_rms)(SPAN_DOT(p, p), SPAN, eps) : 1;
        REAL z2 = r * SPAN_DOT(q, p);
        NAME(vec) G0 = zero, G1 = zero, G2 = zero, G3 = zero;  /* the gradient of h */
        if (gh) {
            const REAL *gt = gh + t * SPAN;
            G0 = NAME(load)(gt), G1 = NAME(load)(gt + L), G2 = NAME(load)(gt + 2 * L),
            G3 = NAME(load)(gt + 3 * L);
        }
        if (gy) {  /* the norm's backward: r2 (gy g - (gy g . h) r2^2 h / d) */
            const REAL *yt = gy + t * SPAN;
            LOAD_SPAN(y, yt);
            REAL r2 = rstd2[t];
            if (g) {
                NAME(vec) yg0 = y0 * NAME(load)(g), yg1 = y1 * NAME(load)(g + L),
                          yg2 = y2 * NAME(load)(g + 2 * L), yg3 = y3 * NAME(load)(g + 3 * L);
                dg0 += r2 * y0 * x0, dg1 += r2 * y1 * x1, dg2 += r2 * y2 * x2,
                dg3 += r2 * y3 * x3;
                y0 = yg0, y1 = yg1, y2 = yg2, y3 = yg3;
            }
            REAL cf = -SPAN_DOT(y, x) * r2 * r2 / (REAL)SPAN;
            G0 += r2 * (y0 + cf * x0), G1 += r2 * (y1 + cf * x1), G2 += r2 * (y2 + cf * x2),
            G3 += r2 * (y3 + cf * x3);
        }
        REAL dz2 = SPAN_DOT(G, e) * wt * (1 - wt);
        dlse[t] = -dz2;
        REAL coef = key_norm ? -dz2 * z2 * r * r / (REAL)SPAN : 0, du = dz2 * r;
        NAME(store_span)(dh1 + t * SPAN, (1 - wt) * G0, (1 - wt) * G1, (1 - wt) * G2,
                         (1 - wt) * G3);
        NAME(store_span)(dp + t * SPAN, wt * G0 + du * q0 + coef * p0,
                         wt * G1 + du * q1 + coef * p1, wt * G2 + du * q2 + coef * p2,
                         wt * G3 + du * q3 + coef * p3);
        dq0 += du * p0, dq1 += du * p1, dq2 += du * p2, dq3 += du * p3;
    }
    NAME(store_span)(dqa, NAME(load)(dqa) + dq0, NAME(load)(dqa + L) + dq1,
                     NAME(load)(dqa + 2 * L) + dq2, NAME(load)(dqa + 3 * L) + dq3);
    NAME(store_span)(dga, NAME(load)(dga) + dg0, NAME(load)(dga + L) + dg1,
                     NAME(load)(dga + 2 * L) + dg2, NAME(load)(dga + 3 * L) + dg3);
}

/* Phase 2's backward. gy (the norm's output gradient) and gh (h's own) may be NULL. Writes
 * dh1, dp ([M, d]), dlse ([M, H]), dq ([d]) and dg ([d], where g and dg are not NULL). */
void NAME(phase2_bwd)(long M, long d, long H, const REAL *h1, const REAL *lse, const REAL *p,
                      const REAL *q, double eps, int key_norm, const REAL *g,
                      const REAL *w, const REAL *rstd2, const REAL *gy, const REAL *gh,
                      REAL *dh1, REAL *dp, REAL *dlse, REAL *dq, REAL *dg, int threads) {
    long c = d / H;
    int nt = threads < 1 ? 1 : threads;
    double *part = (double *)calloc((size_t)nt * 2 * d, sizeof(double));
#pragma omp parallel num_threads(nt)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        double *dqp = part + (size_t)me * 2 * d, *dgp = dqp + d;
        REAL *hrow = (REAL *)malloc(sizeof(REAL) * (4 * d + 2 * H));
        REAL *grow = hrow + d, *z2 = grow + d, *dz2 = z2 + H;
        /* dq and dg summed in REAL over a tile of tokens, then in double (as phase1_bwd's
         * dq): a double sum a token converted and added 2 d numbers every token (the
         * kernel alone at M = 2048, d = 64: 0.177 -> 0.145 ms) */
        REAL *dqa = dz2 + H, *dga = dqa + d;
        long tiles = (M + TILE - 1) / TILE;
#pragma omp for schedule(static)
        for (long tile = 0; tile < tiles; tile++) {
            long tend = M - tile * TILE < TILE ? M : (tile + 1) * TILE;
            memset(dqa, 0, sizeof(REAL) * 2 * d);
            if (d == SPAN && H == 1)
                NAME(phase2_bwd_span)(tile * TILE, tend, h1, p, q, eps, key_norm, g, w, rstd2,
                                      gy, gh, dh1, dp, dlse, dqa, dga);
            else for (long t = tile * TILE; t < tend; t++) {
                const REAL *pt = p + t * d, *ht = h1 + t * d, *wt = w + t * H;
                REAL r = NAME(rstd)(pt, d, eps, key_norm);
                for (long h = 0; h < H; h++) {
                    z2[h] = r * NAME(row_dot)(q + h * c, pt + h * c, c);
                    REAL wh = wt[h], uh = 1 - wh;  /* h as the forward made it */
#pragma omp simd
                    for (long k = h * c; k < (h + 1) * c; k++) hrow[k] = uh * ht[k] + wh * pt[k];
                }
                /* the gradient of h: its own, plus the norm's backward */
                if (gh) memcpy(grow, gh + t * d, sizeof(REAL) * d);
                else memset(grow, 0, sizeof(REAL) * d);
                if (gy) {
                    const REAL *gyt = gy + t * d;
                    REAL r2 = rstd2[t], dot = 0;
                    if (g) {
#pragma omp simd reduction(+ : dot)
                        for (long k = 0; k < d; k++) dot += gyt[k] * g[k] * hrow[k];
                    } else {
                        dot = NAME(row_dot)(gyt, hrow, d);
                    }
                    REAL cf = -dot * r2 * r2 / (REAL)d;  /* rstd^2 here, the last rstd below */
                    if (g) {
#pragma omp simd
                        for (long k = 0; k < d; k++) {
                            grow[k] += r2 * (gyt[k] * g[k] + cf * hrow[k]);
                            dga[k] += gyt[k] * hrow[k] * r2;
                        }
                    } else {
#pragma omp simd
                        for (long k = 0; k < d; k++) grow[k] += r2 * (gyt[k] + cf * hrow[k]);
                    }
                }
                REAL coef = 0;
                for (long h = 0; h < H; h++) {
                    REAL wh = wt[h];
                    REAL dw = 0;
#pragma omp simd reduction(+ : dw)
                    for (long k = h * c; k < (h + 1) * c; k++) dw += grow[k] * (pt[k] - ht[k]);
                    dz2[h] = dw * wh * (1 - wh);
                    dlse[t * H + h] = -dz2[h];
                    coef += dz2[h] * z2[h];
                }
                coef = key_norm ? -coef * r * r / (REAL)d : 0;
                REAL *dh1t = dh1 + t * d, *dpt = dp + t * d;
                for (long h = 0; h < H; h++) {
                    REAL wh = wt[h], du = dz2[h] * r;
                    REAL *dqh = dqa + h * c;
#pragma omp simd
                    for (long k = h * c; k < (h + 1) * c; k++) {
                        dh1t[k] = grow[k] * (1 - wh);
                        dpt[k] = grow[k] * wh + du * q[k] + coef * pt[k];
                        dqh[k - h * c] += du * pt[k];
                    }
                }
            }
            for (long k = 0; k < d; k++) {
                dqp[k] += (double)dqa[k];
                dgp[k] += (double)dga[k];
            }
        }
        free(hrow);
    }
    for (long k = 0; k < d; k++) {
        double sq = 0, sg = 0;
        for (int p2 = 0; p2 < nt; p2++) {
            sq += part[(size_t)p2 * 2 * d + k];
            sg += part[(size_t)p2 * 2 * d + d + k];
        }
        dq[k] = (REAL)sq;
        if (dg && g) dg[k] = (REAL)sg;
    }
    free(part);
}
#undef TILE
#undef SPAN
#undef VEC_BYTES
#undef LOAD_SPAN
#undef SPAN_DOT
