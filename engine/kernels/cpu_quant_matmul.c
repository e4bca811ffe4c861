/* Quantized matmuls on the CPU, y[M, N] = x[M, K] @ W^T, with W held as int4 or int8 codes.
 *
 * The scheme is llama.cpp's (ggml_vec_dot_q4_1_q8_1, ggml_vec_dot_q8_0_q8_0): the activations are
 * quantized to int8 in blocks of 32 (one float scale per block), and each block's dot product is
 * an integer one, u8 x s8 -> s32 with AVX512-VNNI's vpdpbusd (AVX2: vpmaddubsw + vpmaddwd), then
 * scaled once per block. That reads the weights at their stored size and spends a few
 * instructions per 32 weights, where dequantizing to floats and multiplying (torch's
 * _weight_int4pack_mm_for_cpu) spends several times that and stops well short of the memory
 * bandwidth at one row.
 *
 * Layouts:
 *   int4: row-tiled (below, ns_int4_tiled_matmul), made from the stored codes once by
 *         engine/quant/int4.py (tile_codes); w = scale q + low per group of 32, 64 or 128.
 *   int8: the engine's stored layout (engine/quant/int8.py), read in place: codes int8 [N, K],
 *         scale float32 [N, K/group], group 16, or a multiple of 32. The signed x signed
 *         product uses the sign trick: |w| (u8) times x with w's sign (s8).
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
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float db = amax / 127.0f;
        const float inv = db > 0.0f ? 1.0f / db : 0.0f;
        int8_t *qb = q + b * QK;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)lrintf(xb[i] * inv);
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

static int quantize_acts(const float *x, int64_t M, int64_t K, Acts *a,
                         int nthreads) {
    const int64_t nb = K / QK;
    a->q = (int8_t *)malloc((size_t)(M * K));
    a->d = (float *)malloc((size_t)(M * nb) * sizeof(float));
    a->s = (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!a->q || !a->d || !a->s) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, a->q + m * K, a->d + m * nb, a->s + m * nb);
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

int ns_int8_matmul(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale,
                   int64_t group, int64_t N, float *y, int nthreads) {
    if (K % QK || K % group || !(group == 16 || group % QK == 0)) return -2;
    Acts a;
    if (quantize_acts(x, M, K, &a, nthreads)) {
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

/* ---- int4, row-tiled ----
 *
 * The stored layout above puts one weight row's block in 16 bytes, so each block's integer dot
 * product ends in a horizontal sum, a dozen instructions for 32 weights. Tiled, 16 weight rows
 * share a block's 256 bytes: byte (j, r, k) of tile t, block b holds row 16t + r's inputs
 * 32b + 4j + k (low nibble) and 32b + 16 + 4j + k (high nibble), j, k < 4. One 64-byte load
 * then holds 4 inputs of each of 16 rows, one 32-bit lane a row, and vpdpbusd against the
 * 4 activations broadcast from memory adds each row's dot product into its own lane: 8 of them
 * a block, no horizontal sums, and the activation scale applied once a block for 16 rows. This
 * is the repacking llama.cpp does for Q4_0 on AVX512 and ARM (ggml-cpu "repack"). Scales and
 * lows are [tiles, K / group, 16] (float16 or float32), rows past N are zero padding.
 * Made by engine/quant/int4.py (tile_codes).
 */
#define TR 16  /* weight rows a tile */
#define TMB 4  /* activation rows sharing each unpacked block */

static inline void load16(const void *p, int64_t i, int f16, float *out) {
    for (int r = 0; r < TR; r++) out[r] = load_scale(p, i + r, f16);
}

/* y rows [m0, m0 + mb) x tile t: the portable code (and the reference for the vector ones) */
static void int4_tile16_scalar(const Acts *a, int64_t m0, int mb, int64_t K, const uint8_t *tile,
                               const void *scale, const void *low, int f16, int64_t group,
                               int64_t t, int64_t N, float *y) {
    const int64_t nb = K / QK, ng = K / group, per = group / QK;
    for (int mi = 0; mi < mb; mi++) {
        const int64_t m = m0 + mi;
        float acc[TR] = {0}, ws[TR], wl[TR];
        for (int64_t g = 0; g < ng; g++) {
            load16(scale, (t * ng + g) * TR, f16, ws);
            load16(low, (t * ng + g) * TR, f16, wl);
            float accg[TR] = {0}, sg = 0.0f;
            for (int64_t j = 0; j < per; j++) {
                const int64_t b = g * per + j;
                const uint8_t *blk = tile + b * (TR * 16);
                const int8_t *xq = a->q + m * K + b * QK;
                for (int r = 0; r < TR; r++) {
                    int isum = 0;
                    for (int c = 0; c < 4; c++)
                        for (int k = 0; k < 4; k++) {
                            const uint8_t byte = blk[(c * TR + r) * 4 + k];
                            isum += (byte & 15) * xq[4 * c + k] + (byte >> 4) * xq[16 + 4 * c + k];
                        }
                    accg[r] += (float)isum * a->d[m * nb + b];
                }
                sg += a->s[m * nb + b];
            }
            for (int r = 0; r < TR; r++) acc[r] += accg[r] * ws[r] + wl[r] * sg;
        }
        for (int r = 0; r < TR && t * TR + r < N; r++) y[m * N + t * TR + r] = acc[r];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline __m512 load16_ps(const void *p, int64_t i, int f16) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) void int4_tile16_avx512(
    const Acts *a, int64_t m0, const int mb, int64_t K, const uint8_t *tile, const void *scale,
    const void *low, const int f16, int64_t group, int64_t t, int64_t N, float *y) {
    const int64_t nb = K / QK, ng = K / group, per = group / QK;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[TMB];
    for (int mi = 0; mi < mb; mi++) acc[mi] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 accg[TMB];
        float sg[TMB];
        for (int mi = 0; mi < mb; mi++) {
            accg[mi] = _mm512_setzero_ps();
            sg[mi] = 0.0f;
        }
        for (int64_t j = 0; j < per; j++) {
            const int64_t b = g * per + j;
            const uint8_t *blk = tile + b * (TR * 16);
            __m512i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                const __m512i p = _mm512_loadu_si512((const void *)(blk + c * 64));
                lo[c] = _mm512_and_si512(p, mask);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
            }
            for (int mi = 0; mi < mb; mi++) {
                const int64_t m = m0 + mi;
                const int32_t *xd = (const int32_t *)(a->q + m * K + b * QK);
                __m512i isum = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    isum = _mm512_dpbusd_epi32(isum, lo[c], _mm512_set1_epi32(xd[c]));
                    isum = _mm512_dpbusd_epi32(isum, hi[c], _mm512_set1_epi32(xd[4 + c]));
                }
                accg[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                           _mm512_set1_ps(a->d[m * nb + b]), accg[mi]);
                sg[mi] += a->s[m * nb + b];
            }
        }
        const __m512 ws = load16_ps(scale, (t * ng + g) * TR, f16);
        const __m512 wl = load16_ps(low, (t * ng + g) * TR, f16);
        for (int mi = 0; mi < mb; mi++)
            acc[mi] = _mm512_fmadd_ps(wl, _mm512_set1_ps(sg[mi]),
                                      _mm512_fmadd_ps(accg[mi], ws, acc[mi]));
    }
    const int64_t left = N - t * TR;
    const __mmask16 keep = left >= TR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (int mi = 0; mi < mb; mi++) _mm512_mask_storeu_ps(y + (m0 + mi) * N + t * TR, keep, acc[mi]);
}
#endif

#if defined(__AVX2__)
/* The same with 256-bit vectors: each 64-byte chunk is two halves, rows 0-7 and rows 8-15. */
static inline __attribute__((always_inline)) void int4_tile16_avx2(
    const Acts *a, int64_t m0, const int mb, int64_t K, const uint8_t *tile, const void *scale,
    const void *low, const int f16, int64_t group, int64_t t, int64_t N, float *y) {
    const int64_t nb = K / QK, ng = K / group, per = group / QK;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[TMB][2];
    for (int mi = 0; mi < mb; mi++) acc[mi][0] = acc[mi][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 accg[TMB][2];
        float sg[TMB];
        for (int mi = 0; mi < mb; mi++) {
            accg[mi][0] = accg[mi][1] = _mm256_setzero_ps();
            sg[mi] = 0.0f;
        }
        for (int64_t j = 0; j < per; j++) {
            const int64_t b = g * per + j;
            const uint8_t *blk = tile + b * (TR * 16);
            for (int half = 0; half < 2; half++) {
                __m256i lo[4], hi[4];
                for (int c = 0; c < 4; c++) {
                    const __m256i p = _mm256_loadu_si256((const __m256i *)(blk + c * 64 + half * 32));
                    lo[c] = _mm256_and_si256(p, mask);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
                }
                for (int mi = 0; mi < mb; mi++) {
                    const int64_t m = m0 + mi;
                    const int32_t *xd = (const int32_t *)(a->q + m * K + b * QK);
                    __m256i isum = _mm256_setzero_si256();
                    for (int c = 0; c < 4; c++) {
                        isum = _mm256_add_epi32(isum, dot_u8s8(lo[c], _mm256_set1_epi32(xd[c])));
                        isum = _mm256_add_epi32(isum,
                                                dot_u8s8(hi[c], _mm256_set1_epi32(xd[4 + c])));
                    }
                    accg[mi][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                                     _mm256_set1_ps(a->d[m * nb + b]),
                                                     accg[mi][half]);
                }
            }
            for (int mi = 0; mi < mb; mi++) sg[mi] += a->s[(m0 + mi) * nb + b];
        }
        for (int half = 0; half < 2; half++) {
            float wsv[8], wlv[8];
            for (int r = 0; r < 8; r++) {
                wsv[r] = load_scale(scale, (t * ng + g) * TR + half * 8 + r, f16);
                wlv[r] = load_scale(low, (t * ng + g) * TR + half * 8 + r, f16);
            }
            const __m256 ws = _mm256_loadu_ps(wsv), wl = _mm256_loadu_ps(wlv);
            for (int mi = 0; mi < mb; mi++)
                acc[mi][half] = _mm256_fmadd_ps(wl, _mm256_set1_ps(sg[mi]),
                                                _mm256_fmadd_ps(accg[mi][half], ws, acc[mi][half]));
        }
    }
    const int64_t left = N - t * TR;
    for (int mi = 0; mi < mb; mi++) {
        float *yr = y + (m0 + mi) * N + t * TR;
        if (left >= TR) {
            _mm256_storeu_ps(yr, acc[mi][0]);
            _mm256_storeu_ps(yr + 8, acc[mi][1]);
        } else {
            float tmp[TR];
            _mm256_storeu_ps(tmp, acc[mi][0]);
            _mm256_storeu_ps(tmp + 8, acc[mi][1]);
            memcpy(yr, tmp, (size_t)left * sizeof(float));
        }
    }
}
#endif

int ns_int4_tiled_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes,
                         const void *scale, const void *low, int scale_f16, int64_t group,
                         int64_t N, float *y, int nthreads) {
    if (K % QK || group % QK || K % group) return -2;
    Acts a;
    if (quantize_acts(x, M, K, &a, nthreads)) {
        free_acts(&a);
        return -1;
    }
    const int64_t tiles = (N + TR - 1) / TR, tile_bytes = (K / QK) * TR * 16;
    /* contiguous runs of tiles per thread: each streams one sequential stretch of the weights */
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = codes + t * tile_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += TMB) {
            const int mb = (int)(M - m0 < TMB ? M - m0 : TMB);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TILE16 int4_tile16_avx512
#elif defined(__AVX2__)
#define TILE16 int4_tile16_avx2
#endif
#if defined(TILE16)
            /* constant row counts and scale type, so the accumulators live in registers */
#define CALL(MB)                                                                              \
    if (scale_f16) TILE16(&a, m0, MB, K, tile, scale, low, 1, group, t, N, y);                 \
    else TILE16(&a, m0, MB, K, tile, scale, low, 0, group, t, N, y)
            switch (mb) {
            case 4: CALL(4); break;
            case 3: CALL(3); break;
            case 2: CALL(2); break;
            default: CALL(1); break;
            }
#undef CALL
#undef TILE16
#else
            int4_tile16_scalar(&a, m0, mb, K, tile, scale, low, scale_f16, group, t, N, y);
#endif
        }
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
