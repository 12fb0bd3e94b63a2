/* Elementwise steps of a Llama-family decoder layer for the direct layers (direct_layers.py), each the same IEEE
 * float32 operations in the same order as transformers' torch ops, so the results are those ops' bits: built with
 * -ffp-contract=off (no fused multiply-add) and without -ffast-math. No reduction is done here: the norm's variance
 * (a sum, whose order torch chooses) stays torch's.
 *
 * rms_scale:  LlamaRMSNorm.forward after its variance: out = weight * (x * (1 / sqrt(variance + eps))).
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
