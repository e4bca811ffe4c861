/* A whole decode step of a Llama-family decoder in one call: every layer's norms, int4
 * projections, rotary, K/V write and paged attention, for a batch of requests that each add one
 * token, with float32 activations and float32 K/V pools.
 *
 * Why: at one token a step the default model's arithmetic is ~70 MB of int4 weights streamed
 * once, about 3 ms on two cores, but the same step from Python is some 40 torch and ctypes calls
 * a layer, 1,200 a step, and their dispatch costs more than the arithmetic (docs/PERFORMANCE.md,
 * "batch-1 decode on the CPU"). Here the step is one call, and the only work between the
 * kernels is the kernels'. It is the same computation as engine/models/llama.py on the same
 * kernels (ns_int4_tiled_matmul, ns_rms_norm, ns_silu_mul, ns_paged_decode), so the two agree
 * to float32 rounding (tests/engine/kernels/test_cpu_decode.py); prompts, mixed steps and every
 * other configuration stay on the Python path (engine/kernels/cpu_decode.py says which).
 */
#include "cpu_ops.c"
#include "cpu_quant_matmul.c"

typedef struct {
    const uint8_t *tiles; /* tile_codes' layout (engine/quant/int4.py) */
    const void *scale, *low;
    int64_t n, k, group;
    int64_t f16; /* scale and low are float16 (else float32) */
} NsInt4;

typedef struct {
    const float *input_norm, *post_norm;
    const float *qkv_bias; /* or NULL */
    NsInt4 qkv, o, gate_up, down;
    float *k_pool, *v_pool; /* [blocks, block_size, Hkv, D] */
} NsLayer;

typedef struct {
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size;
    float eps, attn_scale;
    const NsLayer *layers;
    const float *final_norm;
    const float *cos_sin; /* [max_positions, 2, D]: cos, then sin with rotate-half's sign */
} NsModel;

static int int4_apply(const NsInt4 *w, const float *x, int64_t rows, float *y, int nthreads) {
    return ns_int4_tiled_matmul(x, rows, w->k, w->tiles, w->scale, w->low, (int)w->f16, w->group,
                                w->n, y, nthreads);
}

/* x [heads, D] rotated in place at one position (neox / rotate-half layout, as
 * engine/models/rotary.py: x cos + roll(x, D / 2) sin, multiply then add) */
static void rotate(float *x, int64_t heads, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    float tmp[512];
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * d;
        memcpy(tmp, xh, (size_t)d * sizeof(float));
        for (int64_t i = 0; i < d; i++) {
            const float rolled = tmp[i < half ? i + half : i - half] * sin[i];
            xh[i] = tmp[i] * cos[i] + rolled;
        }
    }
}

/* hidden [R, H]: the step's token embeddings in; the final norm's output out. positions, slots
 * [R]; block_tables [R, max_blocks]; seq_lens [R] (context after this token). 0, -1 (no memory)
 * or -2 (a shape the kernels do not take). */
int ns_llama_decode(const NsModel *m, int64_t R, float *hidden, const int64_t *positions,
                    const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
                    const int64_t *seq_lens, int nthreads) {
    const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t hq = m->num_heads, hkv = m->num_kv_heads, qkv_n = (hq + 2 * hkv) * D;
    if (D > 512 || D % 2) return -2;
    const int64_t width = qkv_n > 2 * I ? qkv_n : 2 * I;
    float *x = malloc((size_t)(R * H) * sizeof(float));     /* the residual stream */
    float *h = malloc((size_t)(R * H) * sizeof(float));     /* its norm */
    float *wide = malloc((size_t)(R * width) * sizeof(float)); /* qkv, gate|up */
    float *q = malloc((size_t)(R * hq * D) * sizeof(float));
    float *att = malloc((size_t)(R * (hq * D > I ? hq * D : I)) * sizeof(float));
    float *delta = malloc((size_t)(R * H) * sizeof(float));
    int rc = (x && h && wide && q && att && delta) ? 0 : -1;
    if (!rc) memcpy(x, hidden, (size_t)(R * H) * sizeof(float));
    for (int64_t l = 0; l < m->num_layers && !rc; l++) {
        const NsLayer *L = m->layers + l;
        ns_rms_norm(x, NULL, L->input_norm, R, H, m->eps, h, NULL, nthreads);
        if ((rc = int4_apply(&L->qkv, h, R, wide, nthreads))) break;
        for (int64_t r = 0; r < R; r++) {
            float *row = wide + r * qkv_n;
            if (L->qkv_bias)
                for (int64_t i = 0; i < qkv_n; i++) row[i] += L->qkv_bias[i];
            const float *cs = m->cos_sin + positions[r] * 2 * D;
            rotate(row, hq + hkv, D, cs, cs + D); /* q and k heads are adjacent */
            memcpy(q + r * hq * D, row, (size_t)(hq * D) * sizeof(float));
            const int64_t at = slots[r] * hkv * D;
            memcpy(L->k_pool + at, row + hq * D, (size_t)(hkv * D) * sizeof(float));
            memcpy(L->v_pool + at, row + (hq + hkv) * D, (size_t)(hkv * D) * sizeof(float));
        }
        ns_paged_decode(q, R, hq, hkv, D, L->k_pool, L->v_pool, m->block_size, block_tables,
                        max_blocks, seq_lens, m->attn_scale, att, nthreads);
        if ((rc = int4_apply(&L->o, att, R, delta, nthreads))) break;
        /* x + delta, then its norm: add_rms_norm's order, so the sums are the same floats */
        ns_rms_norm(delta, x, L->post_norm, R, H, m->eps, h, x, nthreads);
        if ((rc = int4_apply(&L->gate_up, h, R, wide, nthreads))) break;
        ns_silu_mul(wide, R, I, att, nthreads);
        if ((rc = int4_apply(&L->down, att, R, delta, nthreads))) break;
        for (int64_t i = 0; i < R * H; i++) x[i] = delta[i] + x[i];
    }
    if (!rc) ns_rms_norm(x, NULL, m->final_norm, R, H, m->eps, hidden, NULL, nthreads);
    free(x);
    free(h);
    free(wide);
    free(q);
    free(att);
    free(delta);
    return rc;
}
