/* The few-row linear kernel of row_kernel.py: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), each output summed in one of
   the two orders MKL's sgemm sums in, so the bits are F.linear's where row_kernel.py's check finds them equal:
   - rows 0..lanes_from-1 in blocks of kc columns (one FMA chain per block from zero, in column order; the block sums
     added in order to the bias, or to the first block's sum without one);
   - rows lanes_from..M-1 in four lanes (LANES): each product rounded, added into four lanes by column mod 4 (in
     column order, from zero), the lanes summed (0 + 2) + (1 + 3), then the bias added; with head 4, the first four
     products all go to lane 0, in order (MKL's one-row product on an AMD Zen 4);
   - or, with head 16 (LANES16, MKL's sgemm at 2-15 rows on an Intel Xeon with AVX-512), in sixteen lanes: one FMA
     chain per lane from zero over the columns k = lane (mod 16), in column order; the lanes in four groups of four
     added in order ((0-3 + 4-7) + 8-11) + 12-15, the four sums (0 + 1) + (2 + 3), then the bias; K a multiple of 16;
   - or, with head 17 (ONE_ROW16, MKL's one-row product there), column 0's product starts lane 0, columns 1 .. K - 16
     go to sixteen FMA chains (lane (k - 1) mod 16), the lanes halved to one ((i + i+8), (i + i+4), (i + i+2),
     0 + 1); that sum starts lane 0 of eight, columns K - 15 .. K - 8 are FMA'd into the eight lanes, then columns
     K - 7 .. K - 1 added as rounded products into lanes 0-6, the eight lanes halved to one, then the bias.
   - or, with head 32 (BLAS), not summed here: the BLAS's own sgemm called as F.linear calls it (blas_linear()).
   AVX2 + FMA (the blocked rows in AVX-512F where row_kernel_set_wide() turned it on and N is a multiple of 32);
   N, K and kc multiples of 8 (kc unused where lanes_from is 0); x, w, bias and y contiguous.
   Also the head screen's int8 product (byte_linear(), at the end). */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifndef PREFETCH
#define PREFETCH 1
#endif
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4 /* lanes4(): the next four weight rows */
#endif
#ifndef PREFETCH_BYTES8
#define PREFETCH_BYTES8 16384 /* lanes8(): the weight rows this many bytes on (8 rows at K = 512, 2 at 1536) */
#endif
#define INLINE inline __attribute__((always_inline)) /* each row count's copy unrolled, its sums in registers */

/* r[i] = row i of an 8 x 8 tile -> r[j] = column j */
static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* outputs n0..n0+7 of rows 0..M-1 (M <= 8, a constant once inlined); once: no lanes rows read these weight rows
   after it, so they are prefetched past the caches (as lanes8()'s) */
static INLINE void panel(const float *x, const float *w, const float *bias, float *y, const int M, long N, long K,
                         long kc, long n0, const int once) {
    __m256 out[8], acc[8], t[8];
    for (int m = 0; m < M; m++) out[m] = _mm256_setzero_ps();  /* K >= 8: the first block sets it */
    for (long k0 = 0; k0 < K; k0 += kc) {
        long k1 = k0 + kc < K ? k0 + kc : K;
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (long k = k0; k < k1; k += 8) {
            for (int i = 0; i < 8; i++) t[i] = _mm256_loadu_ps(w + (n0 + i) * K + k);
            if (PREFETCH && n0 + 8 * (PREFETCH + 1) <= N && k % 16 == 0)  /* the next panel's rows, a panel ahead */
                for (int i = 0; i < 8; i++) {
                    const char *line = (const char *)(w + (n0 + 8 * PREFETCH + i) * K + k);
                    if (once)
                        _mm_prefetch(line, _MM_HINT_NTA);
                    else
                        _mm_prefetch(line, _MM_HINT_T0);
                }
            transpose8(t);
            for (int j = 0; j < 8; j++)
                for (int m = 0; m < M; m++)
                    acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + k + j), t[j], acc[m]);
        }
        for (int m = 0; m < M; m++) {
            if (k0 > 0)
                out[m] = _mm256_add_ps(out[m], acc[m]);
            else
                out[m] = bias ? _mm256_add_ps(_mm256_loadu_ps(bias + n0), acc[m]) : acc[m];
        }
    }
    for (int m = 0; m < M; m++) _mm256_storeu_ps(y + m * N + n0, out[m]);
}

/* rows 0..R-1 (R <= 8, a constant once inlined) of outputs n0..n0+7 over one block's turned tile buf (column k of
   the block at buf[k - k0]): each output's chain for the block, added to y (to the bias, or stored, for the first) */
static INLINE void chains(const __m256 *buf, const float *x, const float *bias, float *y, const int R, long N, long K,
                          long k0, long k1, long n0) {
    __m256 acc[8];
    for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();
    for (long k = k0; k < k1; k++) {
        const __m256 t = buf[k - k0];
        for (int m = 0; m < R; m++) acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * K + k), t, acc[m]);
    }
    for (int m = 0; m < R; m++) {
        __m256 out = acc[m];
        if (k0 > 0)
            out = _mm256_add_ps(_mm256_loadu_ps(y + m * N + n0), acc[m]);
        else if (bias)
            out = _mm256_add_ps(_mm256_loadu_ps(bias + n0), acc[m]);
        _mm256_storeu_ps(y + m * N + n0, out);
    }
}

/* the weight's rows n0..n0+7, columns k0..k1-1, turned: column k at buf[k - k0] */
static inline void turn_tile(const float *w, long K, long n0, long k0, long k1, __m256 *buf) {
    __m256 t[8];
    for (long k = k0; k < k1; k += 8) {
        for (int i = 0; i < 8; i++) t[i] = _mm256_loadu_ps(w + (n0 + i) * K + k);
        transpose8(t);
        for (int j = 0; j < 8; j++) buf[k - k0 + j] = t[j];
    }
}

/* outputs n0..n0+7 of all M rows: per block the weight's 8 x kc tile turned once into buf, then each group of up to
   8 rows chains over it (the weight read and turned once whatever M) */
static void panel_rows(const float *x, const float *w, const float *bias, float *y, long M, long N, long K, long kc,
                       long n0, __m256 *buf) {
    for (long k0 = 0; k0 < K; k0 += kc) {
        long k1 = k0 + kc < K ? k0 + kc : K;
        turn_tile(w, K, n0, k0, k1, buf);
        for (long m0 = 0; m0 < M; m0 += 8) {
            const float *xs = x + m0 * K;
            float *ys = y + m0 * N;
            switch (M - m0 < 8 ? (int)(M - m0) : 8) {
            case 1: chains(buf, xs, bias, ys, 1, N, K, k0, k1, n0); break;
            case 2: chains(buf, xs, bias, ys, 2, N, K, k0, k1, n0); break;
            case 3: chains(buf, xs, bias, ys, 3, N, K, k0, k1, n0); break;
            case 4: chains(buf, xs, bias, ys, 4, N, K, k0, k1, n0); break;
            case 5: chains(buf, xs, bias, ys, 5, N, K, k0, k1, n0); break;
            case 6: chains(buf, xs, bias, ys, 6, N, K, k0, k1, n0); break;
            case 7: chains(buf, xs, bias, ys, 7, N, K, k0, k1, n0); break;
            default: chains(buf, xs, bias, ys, 8, N, K, k0, k1, n0); break;
            }
        }
    }
}

/* as chains(), for two panels at once (outputs n0..n0+15, tiles a and b) and R <= 6 rows: 12 chains share each
   row's broadcast, so the FMAs, not the loads, set the pace */
static INLINE void chains2(const __m256 *a, const __m256 *b, const float *x, const float *bias, float *y, const int R,
                           long N, long K, long k0, long k1, long n0) {
    __m256 acc[6], acd[6];
    for (int m = 0; m < R; m++) acc[m] = acd[m] = _mm256_setzero_ps();
    for (long k = k0; k < k1; k++) {
        const __m256 ta = a[k - k0], tb = b[k - k0];
        for (int m = 0; m < R; m++) {
            const __m256 v = _mm256_broadcast_ss(x + m * K + k);
            acc[m] = _mm256_fmadd_ps(v, ta, acc[m]);
            acd[m] = _mm256_fmadd_ps(v, tb, acd[m]);
        }
    }
    for (int m = 0; m < R; m++) {
        __m256 lo = acc[m], hi = acd[m];
        if (k0 > 0) {
            lo = _mm256_add_ps(_mm256_loadu_ps(y + m * N + n0), acc[m]);
            hi = _mm256_add_ps(_mm256_loadu_ps(y + m * N + n0 + 8), acd[m]);
        } else if (bias) {
            lo = _mm256_add_ps(_mm256_loadu_ps(bias + n0), acc[m]);
            hi = _mm256_add_ps(_mm256_loadu_ps(bias + n0 + 8), acd[m]);
        }
        _mm256_storeu_ps(y + m * N + n0, lo);
        _mm256_storeu_ps(y + m * N + n0 + 8, hi);
    }
}

/* outputs n0..n0+15 of all M rows (as panel_rows, two tiles a block, rows in groups of 6) */
static void panel_pair(const float *x, const float *w, const float *bias, float *y, long M, long N, long K, long kc,
                       long n0, __m256 *buf) {
    const long width = kc < K ? kc : K;
    for (long k0 = 0; k0 < K; k0 += kc) {
        long k1 = k0 + kc < K ? k0 + kc : K;
        turn_tile(w, K, n0, k0, k1, buf);
        turn_tile(w, K, n0 + 8, k0, k1, buf + width);
        for (long m0 = 0; m0 < M; m0 += 6) {
            const float *xs = x + m0 * K;
            float *ys = y + m0 * N;
            switch (M - m0 < 6 ? (int)(M - m0) : 6) {
            case 1: chains2(buf, buf + width, xs, bias, ys, 1, N, K, k0, k1, n0); break;
            case 2: chains2(buf, buf + width, xs, bias, ys, 2, N, K, k0, k1, n0); break;
            case 3: chains2(buf, buf + width, xs, bias, ys, 3, N, K, k0, k1, n0); break;
            case 4: chains2(buf, buf + width, xs, bias, ys, 4, N, K, k0, k1, n0); break;
            case 5: chains2(buf, buf + width, xs, bias, ys, 5, N, K, k0, k1, n0); break;
            default: chains2(buf, buf + width, xs, bias, ys, 6, N, K, k0, k1, n0); break;
            }
        }
    }
}

/* The blocked rows in 512-bit vectors (where the CPU has AVX-512F: row_kernel_set_wide()): the same sums as
   panel_pair(), each output's chain per block from zero in column order and the block sums added in order, only
   sixteen outputs to a vector and 32 outputs (four panels) at a time, so each chain's arithmetic is the same and so
   are the bits. On an AMD Zen 5, whose FMA units are 512 bits wide, that is twice the FMAs a cycle. */
#define WIDE_TARGET __attribute__((target("avx512f,avx2,fma")))
#define WIDE_INLINE inline __attribute__((always_inline, target("avx512f,avx2,fma")))
#define WIDE_ROWS 12 /* rows a group at most: 24 chains, two tiles and a broadcast in the 32 registers */

static int wide = 0; /* whether row_kernel_linear() takes the 512-bit path (row_kernel_set_wide()) */

/* asks for the 512-bit path (on: 1) or the 256-bit one (0); the path taken: 1 only where the CPU has AVX-512F */
int row_kernel_set_wide(int on) {
    __builtin_cpu_init();
    wide = on && __builtin_cpu_supports("avx512f");
    return wide;
}

/* the weight's rows n0..n0+31, columns k0..k1-1, turned: column k's 32 values at buf + 32 (k - k0) */
static WIDE_INLINE void turn_tile32(const float *w, long K, long n0, long k0, long k1, float *buf) {
    __m256 t[8];
    for (long k = k0; k < k1; k += 8)
        for (int q = 0; q < 4; q++) {
            for (int i = 0; i < 8; i++) t[i] = _mm256_loadu_ps(w + (n0 + 8 * q + i) * K + k);
            transpose8(t);
            for (int j = 0; j < 8; j++) _mm256_store_ps(buf + 32 * (k - k0 + j) + 8 * q, t[j]);
        }
}

/* rows 0..R-1 (R <= WIDE_ROWS, a constant once inlined) of outputs n0..n0+31 over one block's turned tile buf:
   each output's chain for the block, added to y (to the bias, or stored, for the first), as chains2() */
static WIDE_INLINE void chains32(const float *buf, const float *x, const float *bias, float *y, const int R, long N,
                                 long K, long k0, long k1, long n0) {
    __m512 lo[WIDE_ROWS], hi[WIDE_ROWS];
    for (int m = 0; m < R; m++) lo[m] = hi[m] = _mm512_setzero_ps();
    for (long k = k0; k < k1; k++) {
        const __m512 ta = _mm512_load_ps(buf + 32 * (k - k0)), tb = _mm512_load_ps(buf + 32 * (k - k0) + 16);
        for (int m = 0; m < R; m++) {
            const __m512 v = _mm512_set1_ps(x[m * K + k]);
            lo[m] = _mm512_fmadd_ps(v, ta, lo[m]);
            hi[m] = _mm512_fmadd_ps(v, tb, hi[m]);
        }
    }
    for (int m = 0; m < R; m++) {
        __m512 a = lo[m], b = hi[m];
        if (k0 > 0) {
            a = _mm512_add_ps(_mm512_loadu_ps(y + m * N + n0), lo[m]);
            b = _mm512_add_ps(_mm512_loadu_ps(y + m * N + n0 + 16), hi[m]);
        } else if (bias) {
            a = _mm512_add_ps(_mm512_loadu_ps(bias + n0), lo[m]);
            b = _mm512_add_ps(_mm512_loadu_ps(bias + n0 + 16), hi[m]);
        }
        _mm512_storeu_ps(y + m * N + n0, a);
        _mm512_storeu_ps(y + m * N + n0 + 16, b);
    }
}

/* outputs n0..n0+31 of all M rows: per block the weight's 32 x kc tile turned once into buf (aligned to 64 bytes),
   then the rows in even groups of at most WIDE_ROWS */
static WIDE_TARGET void panel_quad(const float *x, const float *w, const float *bias, float *y, long M, long N, long K,
                                   long kc, long n0, float *buf) {
    const long groups = (M + WIDE_ROWS - 1) / WIDE_ROWS, size = (M + groups - 1) / groups;
    for (long k0 = 0; k0 < K; k0 += kc) {
        long k1 = k0 + kc < K ? k0 + kc : K;
        turn_tile32(w, K, n0, k0, k1, buf);
        for (long m0 = 0; m0 < M; m0 += size) {
            const float *xs = x + m0 * K;
            float *ys = y + m0 * N;
            switch (M - m0 < size ? (int)(M - m0) : (int)size) {
            case 1: chains32(buf, xs, bias, ys, 1, N, K, k0, k1, n0); break;
            case 2: chains32(buf, xs, bias, ys, 2, N, K, k0, k1, n0); break;
            case 3: chains32(buf, xs, bias, ys, 3, N, K, k0, k1, n0); break;
            case 4: chains32(buf, xs, bias, ys, 4, N, K, k0, k1, n0); break;
            case 5: chains32(buf, xs, bias, ys, 5, N, K, k0, k1, n0); break;
            case 6: chains32(buf, xs, bias, ys, 6, N, K, k0, k1, n0); break;
            case 7: chains32(buf, xs, bias, ys, 7, N, K, k0, k1, n0); break;
            case 8: chains32(buf, xs, bias, ys, 8, N, K, k0, k1, n0); break;
            case 9: chains32(buf, xs, bias, ys, 9, N, K, k0, k1, n0); break;
            case 10: chains32(buf, xs, bias, ys, 10, N, K, k0, k1, n0); break;
            case 11: chains32(buf, xs, bias, ys, 11, N, K, k0, k1, n0); break;
            default: chains32(buf, xs, bias, ys, 12, N, K, k0, k1, n0); break;
            }
        }
    }
}

/* the LANES order's start with head 4 for one output: columns 0-3 summed in order into lane 0, then columns 4-7 one per
   lane (each added to zero: exact); the lanes then go on from column 8 (MKL's one-row product) */
static INLINE __m128 head_lanes(const float *w, const float *x) {
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x));
    const __m128 lo = _mm256_castps256_ps128(p);
    __m128 s = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    s = _mm_add_ss(s, _mm_shuffle_ps(lo, lo, 2));
    s = _mm_add_ss(s, _mm_shuffle_ps(lo, lo, 3));
    return _mm_add_ps(_mm_move_ss(_mm_setzero_ps(), s), _mm256_extractf128_ps(p, 1));
}

/* the LANES order for outputs n0..n0+3 of rows 0..M-1 (M <= 4, a constant once inlined): each weight row's 8
   columns multiplied into each row (rounded products), the low four then the high four added into that output's
   four lanes; the lanes of the four outputs turned so one vector sum gives (0 + 2) + (1 + 3) for all four */
static INLINE void lanes4(const float *x, const float *w, const float *bias, float *y, const int M, long N, long K,
                          long n0, const int ahead, const int head) {  /* ahead: prefetch rows that far on (0: none) */
    __m128 acc[4][4];  /* [row][output]: lanes 0..3 */
    for (int m = 0; m < M; m++)
        for (int i = 0; i < 4; i++) acc[m][i] = _mm_setzero_ps();
    if (head)
        for (int m = 0; m < M; m++)
            for (int i = 0; i < 4; i++) acc[m][i] = head_lanes(w + (n0 + i) * K, x + m * K);
    for (long k = head ? 8 : 0; k < K; k += 8) {
        __m256 wv[4];
        for (int i = 0; i < 4; i++) wv[i] = _mm256_loadu_ps(w + (n0 + i) * K + k);
        if (ahead && n0 + 4 + ahead <= N && k % 16 == 0)  /* the rows `ahead` rows on, on their way to the cache */
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(w + (n0 + ahead + i) * K + k), _MM_HINT_NTA);
        for (int m = 0; m < M; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * K + k);
            for (int i = 0; i < 4; i++) {
                const __m256 p = _mm256_mul_ps(wv[i], xv);
                acc[m][i] = _mm_add_ps(_mm_add_ps(acc[m][i], _mm256_castps256_ps128(p)), _mm256_extractf128_ps(p, 1));
            }
        }
    }
    for (int m = 0; m < M; m++) {
        __m128 l0 = acc[m][0], l1 = acc[m][1], l2 = acc[m][2], l3 = acc[m][3];
        _MM_TRANSPOSE4_PS(l0, l1, l2, l3);  /* now l<j> holds lane j of the four outputs */
        __m128 out = _mm_add_ps(_mm_add_ps(l0, l2), _mm_add_ps(l1, l3));
        if (bias) out = _mm_add_ps(out, _mm_loadu_ps(bias + n0));
        _mm_storeu_ps(y + m * N + n0, out);
    }
}

/* the LANES order as lanes4(), for outputs n0..n0+7 of M <= 2 rows: each 256-bit sum holds two outputs' four lanes
   (the low four products of both added, then the high four), so eight outputs' chains are in flight at once: the
   adds' latency, not the loads, had set lanes4's pace at one and two rows (a chain of K / 4 dependent adds each) */
static INLINE void lanes8(const float *x, const float *w, const float *bias, float *y, const int M, long N, long K,
                          long n0, const int ahead, const int head) {
    __m256 acc[2][4];  /* [row][pair]: outputs 2q (low half) and 2q + 1 (high half), lanes 0..3 each */
    for (int m = 0; m < M; m++)
        for (int q = 0; q < 4; q++) acc[m][q] = _mm256_setzero_ps();
    if (head)
        for (int m = 0; m < M; m++)
            for (int q = 0; q < 4; q++)
                acc[m][q] = _mm256_set_m128(head_lanes(w + (n0 + 2 * q + 1) * K, x + m * K),
                                            head_lanes(w + (n0 + 2 * q) * K, x + m * K));
    for (long k = head ? 8 : 0; k < K; k += 8) {
        __m256 wv[8];
        for (int i = 0; i < 8; i++) wv[i] = _mm256_loadu_ps(w + (n0 + i) * K + k);
        if (ahead && n0 + 8 + ahead <= N && k % 16 == 0)
            /* non-temporal: a weight read once a step, kept out of L2 (and so of the L3 its evictions fill): the
               step's 56 linears streamed at 31-33 GB/s against 25-26 with T0 (docs/benchmarks.md, "Weights past
               the caches") */
            for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(w + (n0 + ahead + i) * K + k), _MM_HINT_NTA);
        for (int m = 0; m < M; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * K + k);
            for (int q = 0; q < 4; q++) {
                const __m256 a = _mm256_mul_ps(wv[2 * q], xv), b = _mm256_mul_ps(wv[2 * q + 1], xv);
                const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
                acc[m][q] = _mm256_add_ps(_mm256_add_ps(acc[m][q], lo), hi);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int h = 0; h < 2; h++) {  /* outputs n0 + 4h .. n0 + 4h + 3 */
            __m128 l0 = _mm256_castps256_ps128(acc[m][2 * h]), l1 = _mm256_extractf128_ps(acc[m][2 * h], 1);
            __m128 l2 = _mm256_castps256_ps128(acc[m][2 * h + 1]), l3 = _mm256_extractf128_ps(acc[m][2 * h + 1], 1);
            _MM_TRANSPOSE4_PS(l0, l1, l2, l3);
            __m128 out = _mm_add_ps(_mm_add_ps(l0, l2), _mm_add_ps(l1, l3));
            if (bias) out = _mm_add_ps(out, _mm_loadu_ps(bias + n0 + 4 * h));
            _mm_storeu_ps(y + m * N + n0 + 4 * h, out);
        }
}

/* lanes8()'s prefetch distance in weight rows: PREFETCH_BYTES8 on, 1 to 32 rows */
static inline int ahead8(long K) {
    const long rows = PREFETCH_BYTES8 / (4 * K);
    return rows < 1 ? 1 : rows > 32 ? 32 : (int)rows;
}

/* the LANES16 order (head 16) for outputs n0..n0+3 of one row: each output's sixteen lanes as two 256-bit FMA chains
   (lanes 0-7, 8-15), four outputs' chains in flight at once */
static INLINE void lanes16(const float *x, const float *w, const float *bias, float *y, long N, long K, long n0,
                           const int ahead) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        if (ahead && n0 + 4 + ahead <= N)
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(w + (n0 + ahead + i) * K + k), _MM_HINT_NTA);
        const __m256 xl = _mm256_loadu_ps(x + k), xh = _mm256_loadu_ps(x + k + 8);
        for (int i = 0; i < 4; i++) {
            lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + (n0 + i) * K + k), xl, lo[i]);
            hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + (n0 + i) * K + k + 8), xh, hi[i]);
        }
    }
    __m128 v[4];  /* per output: ((0-3 + 4-7) + 8-11) + 12-15 */
    for (int i = 0; i < 4; i++)
        v[i] = _mm_add_ps(_mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(lo[i]), _mm256_extractf128_ps(lo[i], 1)),
                                     _mm256_castps256_ps128(hi[i])),
                          _mm256_extractf128_ps(hi[i], 1));
    _MM_TRANSPOSE4_PS(v[0], v[1], v[2], v[3]);  /* now v[j] holds sum j of the four outputs */
    __m128 out = _mm_add_ps(_mm_add_ps(v[0], v[1]), _mm_add_ps(v[2], v[3]));
    if (bias) out = _mm_add_ps(out, _mm_loadu_ps(bias + n0));
    _mm_storeu_ps(y + n0, out);
}

/* the ONE_ROW16 order (head 17) for outputs n0..n0+3 of one row (K >= 32) */
static INLINE void one_row16(const float *x, const float *w, const float *bias, float *y, long N, long K, long n0,
                             const int ahead) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; i++) {  /* column 0's product alone in lane 0, +0 in the others */
        lo[i] = _mm256_setr_ps(w[(n0 + i) * K] * x[0], 0, 0, 0, 0, 0, 0, 0);
        hi[i] = _mm256_setzero_ps();
    }
    for (long k = 1; k <= K - 31; k += 16) {  /* columns 1 .. K - 16 */
        if (ahead && n0 + 4 + ahead <= N)
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(w + (n0 + ahead + i) * K + k), _MM_HINT_NTA);
        const __m256 xl = _mm256_loadu_ps(x + k), xh = _mm256_loadu_ps(x + k + 8);
        for (int i = 0; i < 4; i++) {
            lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + (n0 + i) * K + k), xl, lo[i]);
            hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + (n0 + i) * K + k + 8), xh, hi[i]);
        }
    }
    const long t = K - 15;  /* the tail: eight columns FMA'd, then seven added as rounded products */
    const __m256 xa = _mm256_loadu_ps(x + t), xb = _mm256_loadu_ps(x + t + 7);  /* xb: columns K-8 .. K-1 */
    const __m256 seven = _mm256_castsi256_ps(_mm256_setr_epi32(-1, -1, -1, -1, -1, -1, -1, 0));  /* lanes 0-6 */
    for (int i = 0; i < 4; i++) {
        const float *row = w + (n0 + i) * K;
        __m256 s8 = _mm256_add_ps(lo[i], hi[i]);  /* i + i+8 */
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  /* i + i+4 */
        __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  /* i + i+2 */
        __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));  /* 0 + 1 */
        /* the sum in lane 0 of eight, +0 in the others (set, not cast: a cast leaves the upper lanes undefined) */
        const __m256 start = _mm256_set_m128(_mm_setzero_ps(), _mm_move_ss(_mm_setzero_ps(), s1));
        __m256 tail = _mm256_fmadd_ps(_mm256_loadu_ps(row + t), xa, start);
        /* columns K-7 .. K-1 into lanes 0-6: the products of columns K-8 .. K-1 shifted down one lane (lane 7 kept) */
        const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(row + t + 7), xb);  /* lanes 0-7: columns K-8 .. K-1 */
        const __m256 shifted = _mm256_permutevar8x32_ps(p, _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 7));
        tail = _mm256_blendv_ps(tail, _mm256_add_ps(tail, shifted), seven);
        __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(tail), _mm256_extractf128_ps(tail, 1));
        __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
        float out = _mm_cvtss_f32(h1);
        if (bias) out += bias[n0 + i];
        y[n0 + i] = out;
    }
}

/* rows lanes_from..M-1 of outputs n0..n0+count-1 (count a multiple of 4) in LANES16 (head 16) or ONE_ROW16 (head 17,
   one row) order, four outputs at a time, every row of them while their weight rows are in the cache */
static void lanes16_rows(const float *x, const float *w, const float *bias, float *y, long lanes_from, long M, long N,
                         long K, long n0, long count, int prefetch, int head) {
    for (long n = n0; n < n0 + count; n += 4)
        for (long m = lanes_from; m < M; m++) {
            const int ahead = m == lanes_from && prefetch ? ahead8(K) : 0;
            if (head == 17)
                one_row16(x + m * K, w, bias, y + m * N, N, K, n, ahead);
            else
                lanes16(x + m * K, w, bias, y + m * N, N, K, n, ahead);
        }
}

/* rows lanes_from..M-1 of outputs n0..n0+count-1 (count a multiple of 8) in LANES order, in groups of 4 rows (a
   last group of one or two: eight outputs at a time, lanes8());
   prefetch: the first group prefetches the weight rows PREFETCH_ROWS on (0: none, where a panel just read them) */
static void lanes_rows(const float *x, const float *w, const float *bias, float *y, long lanes_from, long M, long N,
                       long K, long n0, long count, int prefetch, int head) {
    if (head >= 16) {
        lanes16_rows(x, w, bias, y, lanes_from, M, N, K, n0, count, prefetch, head);
        return;
    }
    for (long m0 = lanes_from; m0 < M; m0 += 4) {
        const float *xs = x + m0 * K;
        float *ys = y + m0 * N;
        const int rows = M - m0 < 4 ? (int)(M - m0) : 4, pf = m0 == lanes_from && prefetch;
        if (rows <= 2) {
            for (long n = n0; n < n0 + count; n += 8) {
                if (rows == 1)
                    lanes8(xs, w, bias, ys, 1, N, K, n, pf ? ahead8(K) : 0, head);
                else
                    lanes8(xs, w, bias, ys, 2, N, K, n, pf ? ahead8(K) : 0, head);
            }
            continue;
        }
        for (long n = n0; n < n0 + count; n += 4) {
            if (pf) {
                switch (rows) {
                case 1: lanes4(xs, w, bias, ys, 1, N, K, n, PREFETCH_ROWS, head); break;
                case 2: lanes4(xs, w, bias, ys, 2, N, K, n, PREFETCH_ROWS, head); break;
                case 3: lanes4(xs, w, bias, ys, 3, N, K, n, PREFETCH_ROWS, head); break;
                default: lanes4(xs, w, bias, ys, 4, N, K, n, PREFETCH_ROWS, head); break;
                }
            } else {
                switch (rows) {
                case 1: lanes4(xs, w, bias, ys, 1, N, K, n, 0, head); break;
                case 2: lanes4(xs, w, bias, ys, 2, N, K, n, 0, head); break;
                case 3: lanes4(xs, w, bias, ys, 3, N, K, n, 0, head); break;
                default: lanes4(xs, w, bias, ys, 4, N, K, n, 0, head); break;
                }
            }
        }
    }
}

/* The BLAS's sgemm (head 32, BLAS in row_kernel.py): the Fortran sgemm_ of the library torch's own GEMMs call (MKL
   inside libtorch_cpu), set once by row_kernel_set_sgemm(), called with the arguments torch's addmm passes for
   F.linear on contiguous rows (y^T = w . x^T in column-major terms, a bias copied into every row first and added with
   beta = 1), so its bits are F.linear's by construction (row_kernel.py checks them anyway, per row count), on the
   threads the BLAS was given (torch.set_num_threads sets them); the decode tape's way to call a layer settled on
   F.linear without Python */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);
static sgemm_fn blas_sgemm = 0;

void row_kernel_set_sgemm(void *function) { blas_sgemm = (sgemm_fn)function; }

static int blas_linear(const float *x, const float *w, const float *bias, float *y, long M, long N, long K) {
    if (!blas_sgemm || M > 2147483647L || N > 2147483647L || K > 2147483647L) return -1;
    const int m = (int)N, n = (int)M, k = (int)K;
    const float one = 1.0f, beta = bias ? 1.0f : 0.0f;
    if (bias)
        for (long r = 0; r < M; r++) memcpy(y + r * N, bias, (size_t)N * sizeof(float));
    blas_sgemm("t", "n", &m, &n, &k, &one, w, &k, x, &k, &beta, y, &m);
    return 0;
}

/* rows 0..B-1 blocked (B = lanes_from), the rest in LANES order; each panel's LANES rows right after its blocked
   rows, while its weight rows are in the cache */
int row_kernel_linear(const float *x, const float *w, const float *bias, float *y, long M, long N, long K, long kc,
                      long lanes_from, long head, int threads) {
    if (M < 1 || N < 8 || K < 8 || N % 8 || K % 8 || kc < 0 || kc % 8 || threads < 1) return -1;
    if (head == 32) return lanes_from == 0 ? blas_linear(x, w, bias, y, M, N, K) : -1;
    if (lanes_from < 0 || lanes_from > M || (lanes_from > 0 && kc == 0) ||
        (head != 0 && head != 4 && head != 16 && head != 17))
        return -1;
    if (head >= 16 && (K % 16 || (head == 17 && K < 32))) return -1;
    if (head && lanes_from == M) return -1;  /* a head for no lanes row */
    const long B = lanes_from;
    if (B == 0) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long n0 = 0; n0 < N; n0 += 8) lanes_rows(x, w, bias, y, 0, M, N, K, n0, 8, 1, head);
        return 0;
    }
    if (B <= 8) {  /* every tile used once: multiplied straight from the registers it was turned in */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long n0 = 0; n0 < N; n0 += 8) {
            switch ((int)B) {  /* each case a copy of panel() for its row count, unrolled */
            case 1: panel(x, w, bias, y, 1, N, K, kc, n0, B == M); break;
            case 2: panel(x, w, bias, y, 2, N, K, kc, n0, B == M); break;
            case 3: panel(x, w, bias, y, 3, N, K, kc, n0, B == M); break;
            case 4: panel(x, w, bias, y, 4, N, K, kc, n0, B == M); break;
            case 5: panel(x, w, bias, y, 5, N, K, kc, n0, B == M); break;
            case 6: panel(x, w, bias, y, 6, N, K, kc, n0, B == M); break;
            case 7: panel(x, w, bias, y, 7, N, K, kc, n0, B == M); break;
            default: panel(x, w, bias, y, 8, N, K, kc, n0, B == M); break;
            }
            lanes_rows(x, w, bias, y, B, M, N, K, n0, 8, 0, head);
        }
        return 0;
    }
    int failed = 0;
    const int quad = wide && N % 32 == 0;  /* four panels at a time in 512-bit vectors (panel_quad()) */
    const long pairs = N / 16;  /* else pairs of panels; an odd last panel alone */
    const long tasks = quad ? N / 32 : pairs + (N % 16 != 0), width = quad ? 32 : 16;
#pragma omp parallel num_threads(threads)
    {
        /* a quad's turned tile (32 floats a column), or a pair's two (16): 64-byte aligned for either */
        float *buf = aligned_alloc(64, 32 * sizeof(float) * (size_t)(kc < K ? kc : K));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long p = 0; p < tasks; p++) {
            if (!buf) continue;
            const long n0 = width * p;
            if (quad)
                panel_quad(x, w, bias, y, B, N, K, kc, n0, buf);
            else if (p < pairs)
                panel_pair(x, w, bias, y, B, N, K, kc, n0, (__m256 *)buf);
            else
                panel_rows(x, w, bias, y, B, N, K, kc, n0, (__m256 *)buf);
            lanes_rows(x, w, bias, y, B, M, N, K, n0, quad ? 32 : p < pairs ? 16 : 8, 0, head);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* A screen's approximate product in integers (head_screen.py): y[m, n] = I[m, n] * xs[m] * ws[n] with
   I = xq[m] . q[n] summed exactly in int32, where
   - xq[m] is row m of x rounded to `levels` steps of its largest magnitude (int16; xs[m] = that magnitude / levels),
   - q an int8 N x K copy of the weight (ws[n] its row scales) laid out by panels of 8 outputs and pairs of columns
     (turned_bytes(): panel p's columns k, k + 1 at q[(p * K + k) * 8], output by output, two bytes each), so the copy
     is read once, front to back: a quarter of the float32 weight's bytes.
   levels * 127 * K < 2^31 (checked): no partial sum can overflow. AVX2; N and K multiples of 8. */
#ifndef BYTE_AHEAD
#define BYTE_AHEAD 1024 /* byte_panels(): the copy's columns prefetched this far on in the first row group (8 KB, the
                           float16 copy's reach; 64 columns of it were 1.3x slower) */
#endif
static INLINE void byte_panels(const short *xq, const float *xs, const signed char *q, const float *ws, float *y,
                               const long ahead, const int R, const int P, long N, long K, long p) {
    __m256i acc[6][2];
    for (int m = 0; m < R; m++)
        for (int u = 0; u < P; u++) acc[m][u] = _mm256_setzero_si256();
    for (long k = 0; k < K; k += 2) {
        /* non-temporal: the copy (15.6 MiB for the benchmark's head) is read once a step; with T0 the float16 copy
           this replaced pushed what the step reads next (the host's Python objects) out of the caches: decode steps
           1.03x / 1.02x slower at 1 and 16 rows (docs/benchmarks.md, "The norm in one C call, the screen's copy
           past the caches, and forward calls straight") */
        for (int u = 0; u < P; u++) _mm_prefetch((const char *)(q + ((p + u) * K + k + ahead) * 8), _MM_HINT_NTA);
        __m256i wv[2];
        for (int u = 0; u < P; u++)
            wv[u] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + ((p + u) * K + k) * 8)));
        for (int m = 0; m < R; m++) {
            /* columns k, k + 1 of row m in every lane: a broadcast load (its bits, not a float's value) */
            const __m256i v = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(xq + m * K + k)));
            for (int u = 0; u < P; u++) acc[m][u] = _mm256_add_epi32(acc[m][u], _mm256_madd_epi16(v, wv[u]));
        }
    }
    for (int m = 0; m < R; m++) {
        const __m256 row = _mm256_set1_ps(xs[m]);
        for (int u = 0; u < P; u++) {
            const __m256 scale = _mm256_mul_ps(row, _mm256_loadu_ps(ws + (p + u) * 8));
            _mm256_storeu_ps(y + m * N + (p + u) * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][u]), scale));
        }
    }
}

/* panels p..p+P-1 (P = 1 or 2) for all M rows: up to 6 rows at once, in groups of 4 past that (the panels stay in
   the cache from one group to the next) */
#define BYTE_CASES(P)                                                                 \
    switch (R) {                                                                      \
    case 1: byte_panels(xq, xs, q, ws, ys, ahead, 1, P, N, K, p); break;              \
    case 2: byte_panels(xq, xs, q, ws, ys, ahead, 2, P, N, K, p); break;              \
    case 3: byte_panels(xq, xs, q, ws, ys, ahead, 3, P, N, K, p); break;              \
    case 4: byte_panels(xq, xs, q, ws, ys, ahead, 4, P, N, K, p); break;              \
    case 5: byte_panels(xq, xs, q, ws, ys, ahead, 5, P, N, K, p); break;              \
    default: byte_panels(xq, xs, q, ws, ys, ahead, 6, P, N, K, p); break;             \
    }
static void byte_rows(const short *x, const float *s, const signed char *q, const float *ws, float *y, long M, long N,
                      long K, long p, int P) {
    const long group = M <= 6 ? M : 4;
    for (long m0 = 0; m0 < M; m0 += group) {
        const short *xq = x + m0 * K;
        const float *xs = s + m0;
        float *ys = y + m0 * N;
        /* the first group streams the copy from memory; the later ones read the panels it left in L1 (a longer
           reach there only crowds them: 1.03x slower at 64 rows with the float16 copy) */
        const long ahead = m0 == 0 ? BYTE_AHEAD : 128;
        const int R = M - m0 < group ? (int)(M - m0) : (int)group;
        if (P == 2) {
            BYTE_CASES(2)
        } else {
            BYTE_CASES(1)
        }
    }
}

/* row m of x rounded to int16 steps of largest / levels (the row's x / step rounded to the nearest integer, within
   +-levels; 0 for a row of zeros): xs[m] holds the row's largest magnitude (byte_linear()'s check) and then its step */
static void byte_quantize(const float *x, short *xq, float *xs, long m, long K, int levels) {
    const float largest = xs[m];
    const float inverse = largest > 0.0f ? (float)levels / largest : 0.0f;  /* largest / levels is normal: checked */
    xs[m] = largest / (float)levels;
    for (long k = 0; k < K; k++) {
        float t = nearbyintf(x[m * K + k] * inverse);
        t = t > (float)levels ? (float)levels : (t < -(float)levels ? -(float)levels : t);
        xq[m * K + k] = (short)t;
    }
}

int byte_linear(const float *x, const signed char *q, const float *ws, float *y, long M, long N, long K, int levels,
                int threads) {
    if (M < 1 || N < 8 || K < 8 || N % 8 || K % 8 || threads < 1 || levels < 1 || levels > 32767 ||
        (double)levels * 127.0 * (double)K >= 2147483648.0)
        return -1;
    short *xq = aligned_alloc(32, (size_t)((M * K * 2 + 31) / 32 * 32));
    float *xs = malloc(sizeof(float) * (size_t)M);
    int code = !xq || !xs ? -2 : 0;
    for (long m = 0; m < M && !code; m++) {  /* finite, and each row's step (largest / levels) zero or a normal float */
        float a = 0.0f;
        for (long k = 0; k < K && !code; k++) {
            if (!isfinite(x[m * K + k])) code = -1;
            a = fabsf(x[m * K + k]) > a ? fabsf(x[m * K + k]) : a;
        }
        if (a > 0.0f && a < FLT_MIN * (float)levels) code = -1;
        xs[m] = a;
    }
    if (code) {
        free(xq);
        free(xs);
        return code;
    }
    const long panels = N / 8, pairs = panels / 2;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) byte_quantize(x, xq, xs, m, K, levels);
#pragma omp for schedule(static)
        for (long u = 0; u < pairs + panels % 2; u++) byte_rows(xq, xs, q, ws, y, M, N, K, 2 * u, u < pairs ? 2 : 1);
    }
    free(xq);
    free(xs);
    return 0;
}
