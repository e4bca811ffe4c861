/* The decoder's small float32 ops on the CPU, fused: RMSNorm (with the residual add), SiLU-and-mul,
 * and paged decode attention (one query token per request, read straight from the block pool).
 *
 * Why: at one decode token a step the default model spends more time dispatching torch ops than
 * computing them (F.rms_norm on 576 floats is ~10 us, a scaled_dot_product_attention call ~28 us,
 * plus the block gathers and views around it); each of these is one call here, a few us. The
 * numbers are the same computation as the torch path (tests/engine/kernels/test_cpu_ops.py):
 * RMSNorm normalizes in float32 then scales; softmax subtracts the max; exp is a degree-6
 * polynomial on a range-reduced argument (relative error ~2e-7, float32 rounding). Built and loaded like cpu_quant_matmul.c (engine/kernels/cpu_build.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* s[i] = exp(s[i]) for i < n: 2^(x log2 e) = 2^k 2^f, f in [-0.5, 0.5], 2^f by a degree-6
 * polynomial, 2^k put into the exponent bits. Written with AVX2 intrinsics (gcc does not
 * vectorize the bit cast in a plain loop); libm's expf for the tail and on other CPUs. */
static void exp_inplace(float *s, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 lo = _mm256_set1_ps(-126.0f), hi = _mm256_set1_ps(126.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 y = _mm256_mul_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(1.44269504088896341f));
        y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
        const __m256 k = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 f = _mm256_sub_ps(y, k);
        __m256 p = _mm256_set1_ps(1.5403530e-4f);
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
        const __m256i e = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        _mm256_storeu_ps(s + i, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    }
#endif
    for (; i < n; i++) s[i] = expf(s[i]);
}

/* out = norm(x (+ residual)) * w over rows of width n; with residual, sum_out = x + residual. */
void ns_rms_norm(const float *x, const float *residual, const float *w, int64_t rows, int64_t n,
                 float eps, float *out, float *sum_out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        const float *src = xr;
        if (residual) {
            float *s = sum_out + r * n;
            const float *res = residual + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) s[i] = xr[i] + res[i];
            src = s;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = src[i] * inv * w[i];
    }
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o,
                         int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = -g[i];
    exp_inplace(o, n);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + o[i]) * u[i];
}

/* gate_up [rows, 2n] -> out [rows, n] = silu(gate) * up */
void ns_silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
}

#if defined(__AVX512F__)
/* One (request, KV head) of decode attention with AVX512, for G query heads of D = 16 DV floats
 * (G and DV constants, so that the queries and the output accumulators stay in registers).
 * Scores: each key's row loaded once for the G queries; the G dot products reduced across the
 * vector at the end of each key. Then the same softmax as the portable code, then the output,
 * each value row loaded once for the G heads. Bit-for-bit it differs from the portable code
 * only in the order of float32 sums (tests compare within 1e-5). */
static inline __attribute__((always_inline)) void decode_head_avx512(
    const int G, const int DV, const float *qh, const float *k_pool, const float *v_pool,
    const int64_t *table, int64_t len, int shift, int64_t bs, int64_t hkv, int64_t h,
    float scale, float *scores, float *oh) {
    const int64_t d = 16 * DV;
    __m512 qv[8][8];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++) qv[g][j] = _mm512_loadu_ps(qh + g * d + 16 * j);
    for (int64_t t = 0; t < len; t++) {
        const float *k = k_pool + ((table[t >> shift] * bs + (t & (bs - 1))) * hkv + h) * d;
        __m512 kv[8];
        for (int j = 0; j < DV; j++) kv[j] = _mm512_loadu_ps(k + 16 * j);
        for (int g = 0; g < G; g++) {
            __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
            for (int j = 1; j < DV; j++) acc = _mm512_fmadd_ps(qv[g][j], kv[j], acc);
            scores[g * len + t] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *sc = scores + g * len, mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) mx = sc[t] > mx ? sc[t] : mx;
        for (int64_t t = 0; t < len; t++) sc[t] -= mx;
        exp_inplace(sc, len);
        for (int64_t t = 0; t < len; t++) sum += sc[t];
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) sc[t] *= inv;
    }
    __m512 ov[8][8];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++) ov[g][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const float *v = v_pool + ((table[t >> shift] * bs + (t & (bs - 1))) * hkv + h) * d;
        __m512 vv[8];
        for (int j = 0; j < DV; j++) vv[j] = _mm512_loadu_ps(v + 16 * j);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * len + t]);
            for (int j = 0; j < DV; j++) ov[g][j] = _mm512_fmadd_ps(p, vv[j], ov[g][j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < DV; j++) _mm512_storeu_ps(oh + g * d + 16 * j, ov[g][j]);
}

/* The specialized code for this (G, D), or 0 where there is none (then the portable loops). */
static int decode_head_fast(int64_t group, int64_t d, const float *qh, const float *k_pool,
                            const float *v_pool, const int64_t *table, int64_t len, int shift,
                            int64_t bs, int64_t hkv, int64_t h, float scale, float *scores,
                            float *oh) {
#define CASE(G, DV)                                                                           \
    case (G) * 16 + (DV):                                                                     \
        decode_head_avx512(G, DV, qh, k_pool, v_pool, table, len, shift, bs, hkv, h, scale,   \
                           scores, oh);                                                       \
        return 1
    if (d != 64 && d != 128) return 0;
    switch (group * 16 + d / 16) {
        CASE(1, 4); CASE(2, 4); CASE(3, 4); CASE(4, 4); CASE(5, 4); CASE(6, 4); CASE(7, 4);
        CASE(8, 4);
        CASE(1, 8); CASE(2, 8); CASE(3, 8); CASE(4, 8); CASE(5, 8); CASE(6, 8); CASE(7, 8);
        CASE(8, 8);
    default:
        return 0;
    }
#undef CASE
}
#endif

/* Decode attention: q [reqs, Hq, D] (one token each) over the request's first seq_lens[r] keys,
 * which live in pool blocks block_tables[r, t / bs] at offset t % bs; the pools are
 * [blocks, bs, Hkv, D]. A KV head serves Hq / Hkv query heads (GQA). out [reqs, Hq, D]. */
void ns_paged_decode(const float *q, int64_t reqs, int64_t hq, int64_t hkv, int64_t d,
                     const float *k_pool, const float *v_pool, int64_t bs,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                     float scale, float *out, int nthreads) {
    const int64_t group = hq / hkv;
    int shift = 0;
    while (((int64_t)1 << shift) < bs) shift++;
#pragma omp parallel num_threads(nthreads) if (reqs * hkv > 1)
    {
        int64_t cap = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < reqs * hkv; task++) {
            const int64_t r = task / hkv, h = task % hkv, len = seq_lens[r];
            if (len * group > cap) {
                free(scores);
                cap = len * group;
                scores = (float *)malloc((size_t)cap * sizeof(float));
            }
            const int64_t *table = block_tables + r * max_blocks;
            const float *qh = q + (r * hq + h * group) * d;
#if defined(__AVX512F__)
            if (decode_head_fast(group, d, qh, k_pool, v_pool, table, len, shift, bs, hkv, h,
                                 scale, scores, out + (r * hq + h * group) * d))
                continue;
#endif
            for (int64_t t = 0; t < len; t++) {
                /* the key's row: block table[t / bs], offset t % bs (bs is a power of two) */
                const float *k = k_pool + ((table[t >> shift] * bs + (t & (bs - 1))) * hkv + h) * d;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * d;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < d; i++) dot += qg[i] * k[i];
                    scores[g * len + t] = dot * scale;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *s = scores + g * len, mx = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) mx = s[t] > mx ? s[t] : mx;
#pragma omp simd
                for (int64_t t = 0; t < len; t++) s[t] -= mx;
                exp_inplace(s, len);
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; t++) sum += s[t];
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t t = 0; t < len; t++) s[t] *= inv;
            }
            float *oh = out + (r * hq + h * group) * d;
            memset(oh, 0, (size_t)(group * d) * sizeof(float));
            for (int64_t t = 0; t < len; t++) {
                const float *v = v_pool + ((table[t >> shift] * bs + (t & (bs - 1))) * hkv + h) * d;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * len + t];
                    float *og = oh + g * d;
#pragma omp simd
                    for (int64_t i = 0; i < d; i++) og[i] += p * v[i];
                }
            }
        }
        free(scores);
    }
}
