/* Causal prefill attention for the CPU backend (AVX-512): a chunk of query tokens of one sequence
 * against its context in the KV cache, bit for bit what decode attention (decode_attention.c) gives
 * each query. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"

/* Prefill attention computes, for every query and key, the very operations `attend` does, so a
 * token gets the same bits in a prefill chunk as in a decode step. It lays them out for many
 * queries at once: a tile of 16 keys is transposed once (kt: key i in lane i), and a query's score
 * for the 16 keys is one vector, lane i for key i. attend's dot product for a key is 16 lane
 * partials, partial j = q[32c + 2j] k[32c + 2j] + q[32c + 2j + 1] k[32c + 2j + 1] over c in order
 * (dot_pairs from zero), then sum16's tree over the partials; here partial j is a vector over the
 * 16 keys, built by the same additions with q's pair broadcast, and the tree is vertical adds:
 * ((p_j + p_j+8) + (p_j+4 + p_j+12)) pairwise down. */
#define PREFILL_HEADS 48  /* query heads (rows x heads of one KV head) per prefill job */
#define SCORE_GROUP 4     /* query heads whose scores are computed together, sharing each key load */

/* r: 16 rows of 16 32-bit values -> dst[j * 16 + i] = r[i][j]. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r, float *dst) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* r[4i + j], quad q: rows 4i .. 4i + 3 of column 4q + j */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 v1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        const __m512 v2 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        const __m512 w1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 w2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
        _mm512_storeu_ps(dst + j * 16, _mm512_shuffle_f32x4(v1, w1, 0x88));
        _mm512_storeu_ps(dst + (4 + j) * 16, _mm512_shuffle_f32x4(v2, w2, 0x88));
        _mm512_storeu_ps(dst + (8 + j) * 16, _mm512_shuffle_f32x4(v1, w1, 0xDD));
        _mm512_storeu_ps(dst + (12 + j) * 16, _mm512_shuffle_f32x4(v2, w2, 0xDD));
    }
}

/* 16 keys at `slots` (count of them; past count, zeros) of one KV head, transposed. With
 * VDPBF16PS kt[hd / 2][16] pairs (row e, lane i: key i's elements 2e and 2e + 1 as load_pairs gives
 * them: half the bytes of widening them); else kt[hd][16] fp32 (row d, lane i: key i's element d). */
static inline __attribute__((always_inline)) void transpose_keys(const uint16_t *k_cache, const int64_t *slots,
                                                                 int64_t count, int64_t row, int64_t off,
                                                                 const int64_t hd, float *kt) {
    __m512 r[16];
#ifdef __AVX512BF16__
    for (int64_t e0 = 0; e0 < hd / 2; e0 += 16) {
        for (int i = 0; i < 16; i++)
            r[i] = i < count ? _mm512_castsi512_ps((__m512i)load_pairs(k_cache + slots[i] * row + off + 2 * e0))
                             : _mm512_setzero_ps();
        transpose16(r, kt + e0 * 16);
    }
#else
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        for (int i = 0; i < 16; i++)
            r[i] = i < count ? bf16x16(k_cache + slots[i] * row + off + d0) : _mm512_setzero_ps();
        transpose16(r, kt + d0 * 16);
    }
#endif
}

/* Partial j of each of NG query heads' dots with the 16 keys of kt. The queries are NG rows of hd
 * floats at qf: with VDPBF16PS each row's first half holds the head's hd bf16 as load_pairs gives
 * them, else the row is the head widened to fp32 (see prefill_job). */
static inline __attribute__((always_inline)) void partial(const float *kt, const float *qf, const int64_t hd,
                                                          const int NG, int j, __m512 *p) {
    for (int g = 0; g < NG; g++) p[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < hd / 32; c++) {
        const int64_t d = 32 * c + 2 * j;
#ifdef __AVX512BF16__
        const __m512bh keys = (__m512bh)_mm512_loadu_si512(kt + d / 2 * 16);
        const aliased_i32 *pairs = (const aliased_i32 *)qf;  /* head g's elements d, d + 1: pair d / 2 of its row */
        for (int g = 0; g < NG; g++)
            p[g] = _mm512_dpbf16_ps(p[g], (__m512bh)_mm512_set1_epi32(pairs[g * hd + d / 2]), keys);
#else
        const __m512 even = _mm512_loadu_ps(kt + d * 16), odd = _mm512_loadu_ps(kt + (d + 1) * 16);
        for (int g = 0; g < NG; g++)
            p[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * hd + d + 1]), odd,
                                   _mm512_fmadd_ps(_mm512_set1_ps(qf[g * hd + d]), even, p[g]));
#endif
    }
}

/* sum16's tree over the partials, level by level: pairs j, j + 8; then those sums j, j + 4; then j, j + 2.
 * Written out level by level: one loop over the levels (all 16 partials first) measured 8-10% slower. */
static inline __attribute__((always_inline)) void level8(const float *kt, const float *qf, const int64_t hd,
                                                         const int NG, int j, __m512 *y) {
    __m512 a[SCORE_GROUP], b[SCORE_GROUP];
    partial(kt, qf, hd, NG, j, a);
    partial(kt, qf, hd, NG, j + 8, b);
    for (int g = 0; g < NG; g++) y[g] = _mm512_add_ps(a[g], b[g]);
}

static inline __attribute__((always_inline)) void level4(const float *kt, const float *qf, const int64_t hd,
                                                         const int NG, int j, __m512 *y) {
    __m512 a[SCORE_GROUP], b[SCORE_GROUP];
    level8(kt, qf, hd, NG, j, a);
    level8(kt, qf, hd, NG, j + 4, b);
    for (int g = 0; g < NG; g++) y[g] = _mm512_add_ps(a[g], b[g]);
}

static inline __attribute__((always_inline)) void level2(const float *kt, const float *qf, const int64_t hd,
                                                         const int NG, int j, __m512 *y) {
    __m512 a[SCORE_GROUP], b[SCORE_GROUP];
    level4(kt, qf, hd, NG, j, a);
    level4(kt, qf, hd, NG, j + 2, b);
    for (int g = 0; g < NG; g++) y[g] = _mm512_add_ps(a[g], b[g]);
}

/* The scores of NG query heads against the 16 keys of kt (before the scale): lane i for key i. */
static inline __attribute__((always_inline)) void score16(const float *kt, const float *qf, const int64_t hd,
                                                          const int NG, __m512 *s) {
    __m512 a[SCORE_GROUP], b[SCORE_GROUP];
    level2(kt, qf, hd, NG, 0, a);
    level2(kt, qf, hd, NG, 1, b);
    for (int g = 0; g < NG; g++) s[g] = _mm512_add_ps(a[g], b[g]);
}

/* One prefill job: the G query heads of KV head kvh (heads kvh G ..) of the chunk's rows i0 .. i1 - 1,
 * row i seeing keys 0 .. base + i. `work` holds (i1 - i0) G (hd + n + 16) + 16 hd floats and
 * (i1 - i0) G tops, n = base + i1: the heads' queries in fp32, their score rows, a key tile. */
static inline __attribute__((always_inline)) void prefill_job(const uint16_t *q, int64_t q_stride,
                                                              const uint16_t *k_cache, const uint16_t *v_cache,
                                                              const int64_t *slots, int64_t base, int64_t i0,
                                                              int64_t i1, int64_t H, int64_t Hkv, const int64_t hd,
                                                              int64_t kvh, float scale, float *work, __m512 *top,
                                                              uint16_t *out) {
    const int64_t G = H / Hkv, nq = (i1 - i0) * G, longest = base + i1, stride = longest + 16;
    const int64_t row = Hkv * hd, off = kvh * hd, pairs = hd / 32;
    float *qf = work, *s = qf + nq * hd, *kt = s + nq * stride;
#define HEAD(t) ((i0 + (t) / G) * H + kvh * G + (t) % G)  /* query head t's index in q and out rows */
#define SEES(t) (base + i0 + (t) / G + 1)                 /* the keys it sees */
    for (int64_t t = 0; t < nq; t++) {
        const uint16_t *src = q + (i0 + t / G) * q_stride + (kvh * G + t % G) * hd;
#ifdef __AVX512BF16__
        for (int64_t d = 0; d < hd; d += 32)  /* as load_pairs gives them, in the first half of the row */
            _mm512_storeu_si512((uint16_t *)(qf + t * hd) + d, (__m512i)load_pairs(src + d));
#else
        for (int64_t d = 0; d < hd; d += 16) _mm512_storeu_ps(qf + t * hd + d, bf16x16(src + d));
#endif
        top[t] = _mm512_set1_ps(-INFINITY);
    }
    for (int64_t l0 = 0; l0 < longest; l0 += 16) {
        transpose_keys(k_cache, slots + l0, longest - l0 < 16 ? longest - l0 : 16, row, off, hd, kt);
        for (int64_t t0 = 0; t0 < nq; t0 += SCORE_GROUP) {
            const int NG = nq - t0 < SCORE_GROUP ? (int)(nq - t0) : SCORE_GROUP;
            if (SEES(t0 + NG - 1) <= l0) continue;  /* rows see more keys as t rises */
            __m512 sc[SCORE_GROUP];
            switch (NG) {
                case 1: score16(kt, qf + t0 * hd, hd, 1, sc); break;
                case 2: score16(kt, qf + t0 * hd, hd, 2, sc); break;
                case 3: score16(kt, qf + t0 * hd, hd, 3, sc); break;
                default: score16(kt, qf + t0 * hd, hd, SCORE_GROUP, sc); break;
            }
            for (int g = 0; g < NG; g++)
                if (SEES(t0 + g) > l0)
                    keep_scores(s + (t0 + g) * stride + l0, _mm512_mul_ps(sc[g], _mm512_set1_ps(scale)),
                                SEES(t0 + g) - l0, &top[t0 + g]);
        }
    }
    const int group = hd <= 64 ? 4 : 2;  /* heads whose weighted values run together, sharing each value */
    for (int64_t t0 = 0; t0 < nq; t0 += group) {
        const int NG = nq - t0 < group ? (int)(nq - t0) : group;
        float inv[MAX_GROUP];
        __m512 acc[MAX_GROUP][2 * MAX_PAIRS];
        for (int g = 0; g < NG; g++) {
            inv[g] = normalise(s + (t0 + g) * stride, SEES(t0 + g), top[t0 + g]);
            for (int64_t j = 0; j < 2 * pairs; j++) acc[g][j] = _mm512_setzero_ps();
        }
        /* all of them the keys the first sees, then each the rest of its own */
        const float *p = s + t0 * stride;
        switch (NG) {
            case 1: weigh(acc, 1, p, stride, v_cache, slots, 0, SEES(t0), row, off, hd); break;
            case 2: weigh(acc, 2, p, stride, v_cache, slots, 0, SEES(t0), row, off, hd); break;
            case 3: weigh(acc, 3, p, stride, v_cache, slots, 0, SEES(t0), row, off, hd); break;
            default: weigh(acc, 4, p, stride, v_cache, slots, 0, SEES(t0), row, off, hd); break;
        }
        for (int g = 1; g < NG; g++)
            weigh(acc + g, 1, p + g * stride, stride, v_cache, slots, SEES(t0), SEES(t0 + g), row, off, hd);
        for (int g = 0; g < NG; g++) store_head(acc[g], inv[g], pairs, out + HEAD(t0 + g) * hd);
    }
#undef HEAD
#undef SEES
}

/* A chunk of L query tokens of one sequence, the last L of its C context tokens (at `slots`, this
 * chunk's own K/V included): query i attends keys 0 .. C - L + i. q [L, H, hd] with rows `q_stride`
 * apart; out [L, H, hd]. Bit for bit what forge_decode_attention gives each query (see above). A
 * job is a run of rows and the heads of one KV head: PREFILL_HEADS query heads share each key tile. */
int forge_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *slots, int64_t C, int64_t L, int64_t H, int64_t Hkv, int64_t hd,
                            float scale, uint16_t *out, int threads) {
    if (!shapes_ok(H, Hkv, hd) || L > C || L < 1) return 1;
    const int64_t G = H / Hkv, rows = G >= PREFILL_HEADS ? 1 : PREFILL_HEADS / G, blocks = (L + rows - 1) / rows;
    const int64_t floats = (rows * G * (hd + C + 16) + 16 * hd + 15) / 16 * 16;  /* whole cache lines */
    float *work = aligned_alloc(64, 64 * (size_t)(threads * (floats / 16 + rows * G)));
    if (!work) return 2;
    __m512 *tops = (__m512 *)(work + threads * floats);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t job = 0; job < blocks * Hkv; job++) {  /* the last rows, which see the most keys, first */
        const int64_t b = blocks - 1 - job / Hkv, kvh = job % Hkv, i0 = b * rows, i1 = i0 + rows < L ? i0 + rows : L;
        const int thread = omp_get_thread_num();
        float *w = work + thread * floats;
        __m512 *top = tops + thread * rows * G;
#define JOB(HD) prefill_job(q, q_stride, k_cache, v_cache, slots, C - L, i0, i1, H, Hkv, HD, kvh, scale, w, top, out)
        switch (hd) {  /* head sizes with their own compiled loop, as in ATTEND_HD */
            case 64: JOB(64); break;
            case 128: JOB(128); break;
            default: JOB(hd); break;
        }
#undef JOB
    }
    free(work);
    return 0;
}
