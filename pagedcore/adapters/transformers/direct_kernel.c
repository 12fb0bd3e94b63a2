/* Elementwise steps of a Llama-family decoder layer for the direct layers (direct_layers.py), each the same IEEE
 * float32 operations in the same order as transformers' torch ops, so the results are those ops' bits: built with
 * -ffp-contract=off (no fused multiply-add) and without -ffast-math.
 *
 * rms_scale:  LlamaRMSNorm.forward after its variance: out = weight * (x * (1 / sqrt(variance + eps))).
 * rms_norm:   the whole of LlamaRMSNorm.forward: the variance x.pow(2).mean(-1) summed in the order torch's CPU sum
 *             kernel sums a contiguous float32 row (ATen's SumKernel.cpp: `lanes`-wide vectors into four accumulators
 *             in its cascade of levels, the four added in order, the scalar tail from zero, then each lane in order;
 *             a row shorter than one vector as four scalar accumulators, its tail into the first),
 *             divided by n, then rms_scale's steps. direct_layers.py uses it only for a row width whose bits it found
 *             equal to torch's own (DirectKernel.rms_norm), else torch's variance and rms_scale.
 * rope_store: apply_rotary_pos_emb on each query and key head (x * cos + rotate_half(x) * sin, rotate_half(x) =
 *             cat(-x2, x1)), the rotated queries to `q_out`, the rotated keys and the values straight into the
 *             pool's slots (PackedCache.update's write_kv).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void rms_scale(const float *x, const float *variance, const float *weight, float eps, float *out, int64_t rows,
               int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float scale = 1.0f / sqrtf(variance[r] + eps);
        const float *xr = x + r * n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            o[i] = weight[i] * (xr[i] * scale);
        }
    }
}

#define MAX_LANES 16

static int64_t ceil_log2(int64_t x) { /* ATen's utils::CeilLog2 */
    if (x <= 2) return 1;
    return 64 - __builtin_clzll((unsigned long long)(x - 1));
}

/* sum of x[i] * x[i] over a contiguous row of n floats, as ATen's vectorized_inner_sum -> row_sum (ilp 4) ->
   multi_row_sum (4 levels) adds the products torch's pow(2) rounded, with vectors of `lanes` floats */
static float torch_sum_squares(const float *x, int64_t n, int64_t lanes) {
    float acc[4][4][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    const int64_t vectors = n / lanes, size = vectors / 4;
    int64_t power = ceil_log2(size) / 4;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < 4; k++) {
                const float *v = x + (i * 4 + k) * lanes;
                for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += v[l] * v[l];
            }
        for (int64_t j = 1; j < 4; j++) {
            for (int64_t k = 0; k < 4; k++)
                for (int64_t l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int64_t k = 0; k < 4; k++) {
            const float *v = x + (i * 4 + k) * lanes;
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += v[l] * v[l];
        }
    for (int64_t j = 1; j < 4; j++)
        for (int64_t k = 0; k < 4; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = size * 4; v < vectors; v++) /* vectors past the last group of four: into the first */
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += x[v * lanes + l] * x[v * lanes + l];
    for (int64_t k = 1; k < 4; k++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; t++) total += x[t] * x[t];
    for (int64_t l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* returns -1 (nothing written) for lanes it does not take */
int rms_norm(const float *x, const float *weight, float eps, float *out, float *variance, int64_t rows, int64_t n,
             int64_t lanes) {
    if (lanes < 1 || lanes > MAX_LANES || n < 1) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        /* ATen sums a row shorter than one vector with scalars, ilp 4: the same steps with one lane */
        const float var = torch_sum_squares(xr, n, n >= lanes ? lanes : 1) / (float)n;
        if (variance) variance[r] = var;
        const float scale = 1.0f / sqrtf(var + eps);
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            o[i] = weight[i] * (xr[i] * scale);
        }
    }
    return 0;
}

static void rope_one(const float *x, const float *cos_, const float *sin_, float *out, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i] * cos_[i];
        const float b = (-x[i + half]) * sin_[i];
        out[i] = a + b;
    }
    for (int64_t i = half; i < d; i++) {
        const float a = x[i] * cos_[i];
        const float b = x[i - half] * sin_[i];
        out[i] = a + b;
    }
}

void rope_store(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                const float *cos_, const float *sin_, float *q_out, float *key_cache, float *value_cache,
                const int64_t *slots, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t d, int64_t dv) {
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_ + r * d, *s = sin_ + r * d;
        for (int64_t h = 0; h < q_heads; h++) {
            rope_one(q + r * q_stride + h * d, c, s, q_out + (r * q_heads + h) * d, d);
        }
        const int64_t slot = slots[r];
        for (int64_t h = 0; h < kv_heads; h++) {
            rope_one(k + r * k_stride + h * d, c, s, key_cache + (slot * kv_heads + h) * d, d);
        }
        memcpy(value_cache + slot * kv_heads * dv, v + r * v_stride, (size_t)(kv_heads * dv) * sizeof(float));
    }
}
