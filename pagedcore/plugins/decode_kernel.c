/* Decode attention straight from the paged pool (float32, AVX2 + FMA): one query per sequence, its visible keys
   the positions first .. first + length - 1, read where they lie through the sequence's block table. Nothing is
   gathered, padded or masked. One task per (sequence, KV head): the KV head's query heads (its group) read each key
   and value row once; scores, a softmax per query head, then the values weighted. Built and loaded by
   decode_kernel.py; the threads are torch's OpenMP runtime's. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>

/* e^x for 8 lanes (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n); x <= 0 here (scores less
   their maximum), so only the low clamp matters: below -87.3 the result is 0 or a denormal, as expf's. A NaN stays
   NaN (max_ps returns its second operand when one is NaN), so a NaN score makes the row's output NaN, as SDPA's. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365447504f);
    x = _mm256_max_ps(lo, x);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* q . k over D (a multiple of 8) as 8 lanes: two chains of FMAs, added */
static inline __m256 dot8(const float *q, const float *k, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(k + c + 8), a1);
    }
    if (c < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), a0);
    return _mm256_add_ps(a0, a1);
}

/* the cache lines of a block's `rows` rows of `width` floats, `stride` floats apart */
static inline void prefetch_rows(const float *row, int64_t rows, int64_t stride, int64_t width) {
    for (int64_t r = 0; r < rows; r++, row += stride)
        for (int64_t c = 0; c < width; c += 16) _mm_prefetch((const char *)(row + c), _MM_HINT_T0);
}

/* the sums of four 8-lane vectors, in one 4-lane vector */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* One (sequence, KV head): the scores s[g * stride + j] of its G query heads q (G x D, row after row) against the
   keys, a softmax per query head, then out (G x DV, row after row) = the weighted values. */
static void attend(const float *q, const float *kc, const float *vc, const int32_t *table, int64_t first,
                   int64_t length, int64_t dropped, int64_t bs, int64_t k_stride, int64_t v_stride, int64_t G,
                   int64_t D, int64_t DV, float scale, float *s, int64_t stride, float *out) {
    const __m128 scale4 = _mm_set1_ps(scale);
    for (int64_t p = first, j = 0; p < first + length;) { /* block by block: one table read per block */
        const int64_t block = p / bs, offset = p - block * bs;
        const int64_t count = bs - offset < first + length - p ? bs - offset : first + length - p;
        const float *kb = kc + ((int64_t)table[block - dropped] * bs + offset) * k_stride;
        if (p + count < first + length) /* the next block's rows: on their way while this block is read */
            prefetch_rows(kc + (int64_t)table[block + 1 - dropped] * bs * k_stride, bs, k_stride, D);
        int64_t t = 0;
        if (G % 4 == 0) /* two keys x four query heads at a time: each q chunk loaded once for two keys */
            for (; t + 2 <= count; t += 2) {
                const float *ka = kb + t * k_stride, *kb2 = ka + k_stride;
                for (int64_t g = 0; g < G; g += 4) {
                    __m256 a[4], b[4];
                    for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < D; c += 8) {
                        const __m256 x = _mm256_loadu_ps(ka + c), y = _mm256_loadu_ps(kb2 + c);
                        for (int i = 0; i < 4; i++) {
                            const __m256 qq = _mm256_loadu_ps(q + (g + i) * D + c);
                            a[i] = _mm256_fmadd_ps(qq, x, a[i]);
                            b[i] = _mm256_fmadd_ps(qq, y, b[i]);
                        }
                    }
                    float four[8];
                    _mm_storeu_ps(four, _mm_mul_ps(hsum4x8(a[0], a[1], a[2], a[3]), scale4));
                    _mm_storeu_ps(four + 4, _mm_mul_ps(hsum4x8(b[0], b[1], b[2], b[3]), scale4));
                    for (int i = 0; i < 4; i++) {
                        s[(g + i) * stride + j + t] = four[i];
                        s[(g + i) * stride + j + t + 1] = four[4 + i];
                    }
                }
            }
        for (; t < count; t++) {
            const float *k = kb + t * k_stride;
            int64_t g = 0;
            for (; g + 4 <= G; g += 4) { /* four query heads: one reduction for their four sums */
                float four[4];
                _mm_storeu_ps(four, _mm_mul_ps(hsum4x8(dot8(q + g * D, k, D), dot8(q + (g + 1) * D, k, D),
                                                       dot8(q + (g + 2) * D, k, D), dot8(q + (g + 3) * D, k, D)),
                                               scale4));
                for (int i = 0; i < 4; i++) s[(g + i) * stride + j + t] = four[i];
            }
            for (; g < G; g++) s[g * stride + j + t] = hsum8(dot8(q + g * D, k, D)) * scale;
        }
        p += count;
        j += count;
    }
    float inv[64];
    for (int64_t g = 0; g < G; g++) { /* each query head's softmax numerators, in place, and 1 / their sum */
        float *sg = s + g * stride;
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= length; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sg + j));
        float top = -INFINITY;
        float lanes[8];
        _mm256_storeu_ps(lanes, top8);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
        for (; j < length; j++) top = sg[j] > top ? sg[j] : top;
        const __m256 m = _mm256_set1_ps(top);
        __m256 sum8 = _mm256_setzero_ps();
        for (j = 0; j + 8 <= length; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), m));
            _mm256_storeu_ps(sg + j, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum8(sum8);
        for (; j < length; j++) {
            sg[j] = expf(sg[j] - top);
            sum += sg[j];
        }
        inv[g] = 1.0f / sum;
        for (int64_t c = 0; c < DV; c += 8) _mm256_storeu_ps(out + g * DV + c, _mm256_setzero_ps());
    }
    /* the values, block by block: a block's rows stay in L1 while every query head adds them in, 64 output columns
       at a time in registers */
    for (int64_t p = first, j = 0; p < first + length;) {
        const int64_t block = p / bs, offset = p - block * bs;
        const int64_t count = bs - offset < first + length - p ? bs - offset : first + length - p;
        const float *vb = vc + ((int64_t)table[block - dropped] * bs + offset) * v_stride;
        if (p + count < first + length)
            prefetch_rows(vc + (int64_t)table[block + 1 - dropped] * bs * v_stride, bs, v_stride, DV);
        for (int64_t g = 0; g < G; g++) {
            const float *w = s + g * stride + j;
            for (int64_t c0 = 0; c0 < DV; c0 += 64) {
                float *o = out + g * DV + c0;
                const int64_t n = DV - c0 >= 64 ? 8 : (DV - c0) / 8;
                __m256 acc[8];
                if (n == 8) {
                    for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(o + 8 * c);
                    for (int64_t t = 0; t < count; t++) {
                        const __m256 wt = _mm256_set1_ps(w[t]);
                        const float *v = vb + t * v_stride + c0;
                        for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 8 * c), acc[c]);
                    }
                    for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + 8 * c, acc[c]);
                } else {
                    for (int64_t c = 0; c < n; c++) acc[c] = _mm256_loadu_ps(o + 8 * c);
                    for (int64_t t = 0; t < count; t++) {
                        const __m256 wt = _mm256_set1_ps(w[t]);
                        const float *v = vb + t * v_stride + c0;
                        for (int64_t c = 0; c < n; c++) acc[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 8 * c), acc[c]);
                    }
                    for (int64_t c = 0; c < n; c++) _mm256_storeu_ps(o + 8 * c, acc[c]);
                }
            }
        }
        p += count;
        j += count;
    }
    for (int64_t g = 0; g < G; g++) {
        const __m256 scale_g = _mm256_set1_ps(inv[g]);
        float *o = out + g * DV;
        for (int64_t c = 0; c < DV; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(scale_g, _mm256_loadu_ps(o + c)));
    }
}

/* n sequences: sequence i's query is row rows[i] of q (tokens x q_heads x D), its output row rows[i] of out
   (tokens x q_heads x DV); its keys first[i] .. first[i] + length[i] - 1 through block table tables + table_row[i] *
   width (the first dropped[i] logical blocks not in the table). The pools kc / vc: (blocks, bs, kv_heads, D / DV),
   contiguous. scratch: threads x G x max_length floats. */
void paged_decode(const float *q, const float *kc, const float *vc, const int32_t *tables, int64_t width,
                  const int64_t *rows, const int64_t *table_row, const int64_t *first, const int64_t *length,
                  const int64_t *dropped, int64_t n, int64_t q_heads, int64_t kv_heads, int64_t D, int64_t DV,
                  int64_t bs, float scale, float *out, float *scratch, int64_t max_length, int threads) {
    const int64_t G = q_heads / kv_heads;
    /* A pool row holds every KV head side by side: one thread takes a sequence's heads together (a grab of kv_heads
       tasks), so it reads whole rows; split between threads, each thread's reads pulled in the other heads' half of
       each line pair too (16 rows: 1.05-1.11x a decode step). With fewer sequences than threads, one head a grab. */
    const int64_t chunk = n >= threads ? kv_heads : 1;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads)
    for (int64_t task = 0; task < n * kv_heads; task++) {
        const int64_t i = task / kv_heads, h = task % kv_heads;
        float *s = scratch + (int64_t)omp_get_thread_num() * G * max_length;
        attend(q + (rows[i] * q_heads + h * G) * D, kc + h * D, vc + h * DV, tables + table_row[i] * width, first[i],
               length[i], dropped[i], bs, kv_heads * D, kv_heads * DV, G, D, DV, scale, s, max_length,
               out + (rows[i] * q_heads + h * G) * DV);
    }
}
