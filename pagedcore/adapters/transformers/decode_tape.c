/* A decode step's decoder layers as one C call (decode_tape.py): a tape of operations, each a call of the same C
 * function with the same arguments the direct layers' Python would make (the norm and the rotary embedding with the
 * KV store of direct_kernel.c, the linears of row_kernel.c, the attention of plugins/decode_kernel.c, reached through
 * their function pointers), and the two elementwise steps the Python leaves to torch, written as torch's CPU kernels
 * compute them for contiguous float32 tensors (so the same bits; decode_tape.py checks them against torch):
 *
 * add:      out = a + b (one IEEE addition per element).
 * silu_mul: out = silu(g) * u, silu as ATen's silu kernel: x / (1 + exp(-x)), sixteen elements a step through
 *           Sleef_expf8_u10 (torch's own, found in libtorch_cpu and passed in), the elements past the last sixteen
 *           of each chunk through libm's expf (ATen's scalar loop); the chunks are the ones at::parallel_for gives
 *           its threads (`chunk` elements each: decode_tape.py works them out), since each starts its own loop.
 *
 * Built with -ffp-contract=off and without -ffast-math: no operation is fused or reordered.
 *
 * A record is RECORD int64 slots: the operation, then its arguments in the callee's order (a float's bits in the low
 * 32 bits of its slot). run_tape returns 0, or 1 + the index of the record whose callee refused its arguments.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define RECORD 24

enum { OP_NORM = 1, OP_LINEAR = 2, OP_ROPE = 3, OP_ATTEND = 4, OP_ADD = 5, OP_SILU_MUL = 6 };

typedef int (*norm_fn)(const float *, const float *, float, float *, float *, int64_t, int64_t, int64_t);
typedef int (*linear_fn)(const float *, const float *, const float *, float *, long, long, long, long, long, long,
                         int);
typedef void (*rope_fn)(const float *, int64_t, const float *, int64_t, const float *, int64_t, const float *,
                        const float *, float *, float *, float *, const int64_t *, int64_t, int64_t, int64_t, int64_t,
                        int64_t);
typedef void (*attend_fn)(const float *, const float *, const float *, const int32_t *, int64_t, const int64_t *,
                          const int64_t *, const int64_t *, const int64_t *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float *, float *, int64_t, int);
typedef __m256 (*vexp_fn)(__m256);

static float as_float(int64_t slot) {
    uint32_t bits = (uint32_t)(slot & 0xffffffff);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define P(i) ((void *)(intptr_t)r[i])

void add(const float *a, const float *b, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

__attribute__((target("avx2"))) static void silu_chunk(const float *g, const float *u, float *out, int64_t n,
                                                        vexp_fn vexp) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(g + i), b = _mm256_loadu_ps(g + i + 8);
        const __m256 sa = _mm256_div_ps(a, _mm256_add_ps(one, vexp(_mm256_xor_ps(a, sign))));
        const __m256 sb = _mm256_div_ps(b, _mm256_add_ps(one, vexp(_mm256_xor_ps(b, sign))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sa, _mm256_loadu_ps(u + i)));
        _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(sb, _mm256_loadu_ps(u + i + 8)));
    }
    for (; i < n; i++) {
        const float x = g[i];
        out[i] = (x / (1.0f + expf(-x))) * u[i];
    }
}

void silu_mul(const float *g, const float *u, float *out, int64_t n, int64_t chunk, void *exp8) {
    if (chunk < 1) chunk = n;
    for (int64_t begin = 0; begin < n; begin += chunk) {
        const int64_t size = n - begin < chunk ? n - begin : chunk;
        silu_chunk(g + begin, u + begin, out + begin, size, (vexp_fn)exp8);
    }
}

int64_t run_tape(const int64_t *tape, int64_t records) {
    for (int64_t k = 0; k < records; k++) {
        const int64_t *r = tape + k * RECORD;
        switch (r[0]) {
        case OP_NORM:
            if (((norm_fn)P(1))(P(2), P(3), as_float(r[4]), P(5), NULL, r[6], r[7], r[8])) return k + 1;
            break;
        case OP_LINEAR:
            if (((linear_fn)P(1))(P(2), P(3), P(4), P(5), r[6], r[7], r[8], r[9], r[10], r[11], (int)r[12]))
                return k + 1;
            break;
        case OP_ROPE:
            ((rope_fn)P(1))(P(2), r[3], P(4), r[5], P(6), r[7], P(8), P(9), P(10), P(11), P(12), P(13), r[14], r[15],
                            r[16], r[17], r[18]);
            break;
        case OP_ATTEND:
            ((attend_fn)P(1))(P(2), P(3), P(4), P(5), r[6], P(7), P(8), P(9), P(10), P(11), r[12], r[13], r[14], r[15],
                              r[16], r[17], as_float(r[18]), P(19), P(20), r[21], (int)r[22]);
            break;
        case OP_ADD:
            add(P(1), P(2), P(3), r[4]);
            break;
        case OP_SILU_MUL:
            silu_mul(P(1), P(2), P(3), r[4], r[5], P(6));
            break;
        default:
            return k + 1;
        }
    }
    return 0;
}
