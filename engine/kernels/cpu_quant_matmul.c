/* Quantized matmuls on the CPU, y[M, N] = x[M, K] @ W^T, with W held as int4 or int8 codes.
 *
 * The scheme is llama.cpp's (ggml_vec_dot_q4_1_q8_1, ggml_vec_dot_q8_0_q8_0): the activations are
 * quantized to int8 in blocks of 32 (one float scale per block), and each block's dot product is
 * an integer one, u8 x s8 -> s32 with AVX512-VNNI's vpdpbusd (AVX2: vpmaddubsw + vpmaddwd), then
 * scaled once per block. That reads the weights at their stored size and spends about a dozen
 * instructions per 32 weights, where dequantizing to floats and multiplying (torch's
 * _weight_int4pack_mm_for_cpu) spends several times that and stops well short of the memory
 * bandwidth at one row.
 *
 * Layouts are the engine's stored ones (engine/quant/int4.py, int8.py), read in place:
 *   int4: codes uint8 [N, K/2], inputs 2j and 2j+1 in the low and high nibble of byte j;
 *         scale and low [N, K/group] (float32, or float16 where that is exact), w = scale q + low.
 *         A block's 16 bytes unpack to [low nibbles | high nibbles] = inputs [0, 2, .., 30 |
 *         1, 3, .., 31], so the activations are quantized in that order (interleave = 1).
 *   int8: codes int8 [N, K], scale float32 [N, K/group], group 16, or a multiple of 32. The
 *         signed x signed product uses the sign trick: |w| (u8) times x with w's sign (s8).
 *
 * Rows of W are split across OpenMP threads (the same libgomp torch runs on, so one pool), and
 * up to four activation rows share each unpacked weight block. Built at first use by
 * engine/kernels/cpu_quant.py with -march=native; the scalar code is the reference and the
 * fallback for other CPUs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define MT 4 /* activation rows per pass over a weight row */

/* One row of activations quantized: q[K] int8, per block d (scale) and s (d * sum q). */
static void quantize_row(const float *x, int64_t K, int interleave, int8_t *q, float *d,
                         float *s) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float db = amax / 127.0f;
        const float inv = db > 0.0f ? 1.0f / db : 0.0f;
        int8_t *qb = q + b * QK;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            /* interleave: evens first, then odds (the int4 block's unpacked order) */
            const int src = interleave ? (i < 16 ? 2 * i : 2 * (i - 16) + 1) : i;
            const int v = (int)lrintf(xb[src] * inv);
            qb[i] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
}

typedef struct {
    int8_t *q;
    float *d;
    float *s;
} Acts;

static int quantize_acts(const float *x, int64_t M, int64_t K, int interleave, Acts *a,
                         int nthreads) {
    const int64_t nb = K / QK;
    a->q = (int8_t *)malloc((size_t)(M * K));
    a->d = (float *)malloc((size_t)(M * nb) * sizeof(float));
    a->s = (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!a->q || !a->d || !a->s) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, interleave, a->q + m * K, a->d + m * nb, a->s + m * nb);
    return 0;
}

static void free_acts(Acts *a) {
    free(a->q);
    free(a->d);
    free(a->s);
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while (!(m & 1024));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline float load_scale(const void *p, int64_t i, int f16) {
    return f16 ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX2__)
/* sum over 4 adjacent bytes of u8 a times s8 b, as 8 int32 lanes */
static inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* int4: rows [r0, r1) of y for activation rows [m0, m0 + mt) */
static void int4_rows(const Acts *a, int64_t m0, int mt, int64_t K, const uint8_t *codes,
                      const void *scale, const void *low, int f16, int64_t group, int64_t N,
                      int64_t r0, int64_t r1, float *y) {
    const int64_t nb = K / QK, ng = K / group, per = group / QK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = codes + r * (K / 2);
#if defined(__AVX2__)
        __m256 acc[MT];
        float accm[MT];
        for (int t = 0; t < mt; t++) {
            acc[t] = _mm256_setzero_ps();
            accm[t] = 0.0f;
        }
        const __m128i mask = _mm_set1_epi8(0x0F);
        for (int64_t g = 0; g < ng; g++) {
            const float ws = load_scale(scale, r * ng + g, f16);
            const float wl = load_scale(low, r * ng + g, f16);
            for (int64_t j = 0; j < per; j++) {
                const int64_t b = g * per + j;
                const __m128i p = _mm_loadu_si128((const __m128i *)(wr + b * 16));
                const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), mask),
                                                   _mm_and_si128(p, mask));
                for (int t = 0; t < mt; t++) {
                    const int64_t m = m0 + t;
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + m * K + b * QK));
                    const __m256 f = _mm256_cvtepi32_ps(dot_u8s8(w, xq));
                    acc[t] = _mm256_fmadd_ps(f, _mm256_set1_ps(ws * a->d[m * nb + b]), acc[t]);
                    accm[t] += wl * a->s[m * nb + b];
                }
            }
        }
        for (int t = 0; t < mt; t++) y[(m0 + t) * N + r] = hsum(acc[t]) + accm[t];
#else
        for (int t = 0; t < mt; t++) {
            const int64_t m = m0 + t;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t g = b / per;
                const int8_t *xq = a->q + m * K + b * QK;
                int isum = 0;
                for (int i = 0; i < 16; i++) {
                    const uint8_t byte = wr[b * 16 + i];
                    isum += (byte & 15) * xq[i] + (byte >> 4) * xq[16 + i];
                }
                sum += load_scale(scale, r * ng + g, f16) * a->d[m * nb + b] * (float)isum +
                       load_scale(low, r * ng + g, f16) * a->s[m * nb + b];
            }
            y[m * N + r] = sum;
        }
#endif
    }
}

/* int8: rows [r0, r1) of y for activation rows [m0, m0 + mt) */
static void int8_rows(const Acts *a, int64_t m0, int mt, int64_t K, const int8_t *q,
                      const float *scale, int64_t group, int64_t N, int64_t r0, int64_t r1,
                      float *y) {
    const int64_t nb = K / QK, ng = K / group;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *wr = q + r * K;
        const float *sr = scale + r * ng;
#if defined(__AVX2__)
        __m256 acc[MT];
        for (int t = 0; t < mt; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            /* lanes 0-3 hold inputs 0-15 of the block, lanes 4-7 inputs 16-31 */
            const float s0 = sr[(b * QK) / group], s1 = sr[(b * QK + 16) / group];
            const __m256 ws = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wr + b * QK));
            const __m256i wabs = _mm256_sign_epi8(w, w);
            for (int t = 0; t < mt; t++) {
                const int64_t m = m0 + t;
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + m * K + b * QK));
                const __m256 f = _mm256_cvtepi32_ps(dot_u8s8(wabs, _mm256_sign_epi8(xq, w)));
                acc[t] = _mm256_fmadd_ps(
                    f, _mm256_mul_ps(ws, _mm256_set1_ps(a->d[m * nb + b])), acc[t]);
            }
        }
        for (int t = 0; t < mt; t++) y[(m0 + t) * N + r] = hsum(acc[t]);
#else
        for (int t = 0; t < mt; t++) {
            const int64_t m = m0 + t;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *xq = a->q + m * K + b * QK;
                for (int h = 0; h < 2; h++) {
                    int isum = 0;
                    for (int i = 16 * h; i < 16 * h + 16; i++) isum += wr[b * QK + i] * xq[i];
                    sum += sr[(b * QK + 16 * h) / group] * a->d[m * nb + b] * (float)isum;
                }
            }
            y[m * N + r] = sum;
        }
#endif
    }
}

#if defined(__AVX2__)
/* The AVX2 inner loops, tiles of RB weight rows x mb activation rows: RB * mb independent
 * accumulators (one chain per row would wait on each multiply-add's latency), and each weight
 * block is unpacked once for mb activation rows. Inlined with constant mb and f16, so the small
 * arrays below live in registers. */
#define RB 4

static inline __attribute__((always_inline)) void int4_tile(
    const Acts *a, int64_t m0, const int mb, int64_t K, const uint8_t *codes, const void *scale,
    const void *low, const int f16, int64_t group, int64_t N, int64_t r0, float *y) {
    const int64_t nb = K / QK, ng = K / group, per = group / QK;
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 acc[RB][2];
    float accm[RB][2];
    for (int i = 0; i < RB; i++)
        for (int t = 0; t < mb; t++) {
            acc[i][t] = _mm256_setzero_ps();
            accm[i][t] = 0.0f;
        }
    for (int64_t g = 0; g < ng; g++) {
        float ws[RB], wl[RB];
        for (int i = 0; i < RB; i++) {
            ws[i] = load_scale(scale, (r0 + i) * ng + g, f16);
            wl[i] = load_scale(low, (r0 + i) * ng + g, f16);
        }
        for (int64_t j = 0; j < per; j++) {
            const int64_t b = g * per + j;
            __m256i w[RB];
            for (int i = 0; i < RB; i++) {
                const __m128i p =
                    _mm_loadu_si128((const __m128i *)(codes + (r0 + i) * (K / 2) + b * 16));
                w[i] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), mask),
                                        _mm_and_si128(p, mask));
            }
            for (int t = 0; t < mb; t++) {
                const int64_t m = m0 + t;
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + m * K + b * QK));
                const float d = a->d[m * nb + b], s = a->s[m * nb + b];
                for (int i = 0; i < RB; i++) {
                    const __m256 f = _mm256_cvtepi32_ps(dot_u8s8(w[i], xq));
                    acc[i][t] = _mm256_fmadd_ps(f, _mm256_set1_ps(ws[i] * d), acc[i][t]);
                    accm[i][t] += wl[i] * s;
                }
            }
        }
    }
    for (int i = 0; i < RB; i++)
        for (int t = 0; t < mb; t++) y[(m0 + t) * N + r0 + i] = hsum(acc[i][t]) + accm[i][t];
}

static inline __attribute__((always_inline)) void int8_tile(
    const Acts *a, int64_t m0, const int mb, int64_t K, const int8_t *q, const float *scale,
    int64_t group, int64_t N, int64_t r0, float *y) {
    const int64_t nb = K / QK, ng = K / group;
    __m256 acc[RB][2];
    for (int i = 0; i < RB; i++)
        for (int t = 0; t < mb; t++) acc[i][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i wabs[RB], w[RB];
        __m256 ws[RB];
        for (int i = 0; i < RB; i++) {
            /* lanes 0-3 hold inputs 0-15 of the block, lanes 4-7 inputs 16-31 */
            const float *sr = scale + (r0 + i) * ng;
            const float s0 = sr[(b * QK) / group], s1 = sr[(b * QK + 16) / group];
            ws[i] = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
            w[i] = _mm256_loadu_si256((const __m256i *)(q + (r0 + i) * K + b * QK));
            wabs[i] = _mm256_sign_epi8(w[i], w[i]);
        }
        for (int t = 0; t < mb; t++) {
            const int64_t m = m0 + t;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + m * K + b * QK));
            const __m256 d = _mm256_set1_ps(a->d[m * nb + b]);
            for (int i = 0; i < RB; i++) {
                const __m256 f = _mm256_cvtepi32_ps(dot_u8s8(wabs[i], _mm256_sign_epi8(xq, w[i])));
                acc[i][t] = _mm256_fmadd_ps(f, _mm256_mul_ps(ws[i], d), acc[i][t]);
            }
        }
    }
    for (int i = 0; i < RB; i++)
        for (int t = 0; t < mb; t++) y[(m0 + t) * N + r0 + i] = hsum(acc[i][t]);
}
#endif

/* Rows of W in chunks, each chunk over all activation rows: a chunk's weights stay in cache
 * while the activations stream past them. */
#define ROW_CHUNK 16

/* Asks for bytes [p, p + n) ahead of use. A tile's few hundred bytes per row take ~10 ns of
 * arithmetic, less than a trip to memory: without this the kernel streams a model larger than
 * the last-level cache at a third of the read bandwidth, waiting on each row in turn. */
static inline void prefetch(const void *p, int64_t n) {
#if defined(__AVX2__)
    for (int64_t off = 0; off < n; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
#else
    (void)p;
    (void)n;
#endif
}

static void int4_chunk(const Acts *a, int64_t M, int64_t K, const uint8_t *codes,
                       const void *scale, const void *low, int f16, int64_t group, int64_t N,
                       int64_t r0, int64_t r1, float *y) {
    int64_t r = r0;
#if defined(__AVX2__)
    const int64_t sbytes = (K / group) * (f16 ? 2 : 4);
    for (; r + RB <= r1; r += RB) {
        if (r + 2 * RB <= N) { /* the next tile's rows */
            prefetch(codes + (r + RB) * (K / 2), RB * (K / 2));
            prefetch((const char *)scale + (r + RB) * sbytes, RB * sbytes);
            prefetch((const char *)low + (r + RB) * sbytes, RB * sbytes);
        }
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2) {
            if (f16) int4_tile(a, m0, 2, K, codes, scale, low, 1, group, N, r, y);
            else int4_tile(a, m0, 2, K, codes, scale, low, 0, group, N, r, y);
        }
        if (m0 < M) {
            if (f16) int4_tile(a, m0, 1, K, codes, scale, low, 1, group, N, r, y);
            else int4_tile(a, m0, 1, K, codes, scale, low, 0, group, N, r, y);
        }
    }
#endif
    for (int64_t m0 = 0; m0 < M && r < r1; m0 += MT) {
        const int mt = (int)(M - m0 < MT ? M - m0 : MT);
        int4_rows(a, m0, mt, K, codes, scale, low, f16, group, N, r, r1, y);
    }
}

static void int8_chunk(const Acts *a, int64_t M, int64_t K, const int8_t *q, const float *scale,
                       int64_t group, int64_t N, int64_t r0, int64_t r1, float *y) {
    int64_t r = r0;
#if defined(__AVX2__)
    for (; r + RB <= r1; r += RB) {
        if (r + 2 * RB <= N) { /* the next tile's rows */
            prefetch(q + (r + RB) * K, RB * K);
            prefetch(scale + (r + RB) * (K / group), RB * (K / group) * 4);
        }
        int64_t m0 = 0;
        for (; m0 + 2 <= M; m0 += 2) int8_tile(a, m0, 2, K, q, scale, group, N, r, y);
        if (m0 < M) int8_tile(a, m0, 1, K, q, scale, group, N, r, y);
    }
#endif
    for (int64_t m0 = 0; m0 < M && r < r1; m0 += MT) {
        const int mt = (int)(M - m0 < MT ? M - m0 : MT);
        int8_rows(a, m0, mt, K, q, scale, group, N, r, r1, y);
    }
}

int ns_int4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes, const void *scale,
                   const void *low, int scale_f16, int64_t group, int64_t N, float *y,
                   int nthreads) {
    if (K % QK || group % QK || K % group) return -2;
    Acts a;
    if (quantize_acts(x, M, K, 1, &a, nthreads)) {
        free_acts(&a);
        return -1;
    }
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < N ? r0 + ROW_CHUNK : N;
        int4_chunk(&a, M, K, codes, scale, low, scale_f16, group, N, r0, r1, y);
    }
    free_acts(&a);
    return 0;
}

int ns_int8_matmul(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale,
                   int64_t group, int64_t N, float *y, int nthreads) {
    if (K % QK || K % group || !(group == 16 || group % QK == 0)) return -2;
    Acts a;
    if (quantize_acts(x, M, K, 0, &a, nthreads)) {
        free_acts(&a);
        return -1;
    }
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < N ? r0 + ROW_CHUNK : N;
        int8_chunk(&a, M, K, q, scale, group, N, r0, r1, y);
    }
    free_acts(&a);
    return 0;
}

/* Which inner product this build uses, for logs and benchmark reports. */
const char *ns_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVXVNNI__)
    return "avx-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}
