/* What decode attention (decode_attention.c) and prefill attention (prefill_attention.c) share: a
 * score's dot product, the softmax, the weighted sum of the values and the output's rounding. Prefill
 * runs these very operations in the same order for every query and key, so a token gets the same
 * bits in a prefill chunk as in a decode step. */
#ifndef FORGE_ATTENTION_H
#define FORGE_ATTENTION_H

#include <immintrin.h>
#include <stdint.h>

#include "vec.h"

#define MAX_HEAD_DIM 256
#define MAX_PAIRS (MAX_HEAD_DIM / 32)

/* 32 bf16 at p as fp32: the even-indexed elements and the odd-indexed ones. One op each, where
 * widening them in order takes two per 16: a bf16 is the high half of its fp32. Dot products do
 * not care about the order, and weighted sums are put back in order once at the end. */
static inline void split_bf16(const uint16_t *p, __m512 *even, __m512 *odd) {
    const __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* A score's dot product runs over 32 bf16 of a query and a key at a time, lane j taking the pair
 * 2j, 2j + 1: it adds q[2j] k[2j], then q[2j + 1] k[2j + 1]. Products of two bf16 are exact in
 * fp32, so the two additions are the only roundings, and both ways below give the same bits.
 * Where the CPU has AVX512-BF16 (the build passes -mavx512bf16 there), one VDPBF16PS: 32 products
 * an instruction, at the rate of a 16-product FMA. It adds a pair's high half's product first, so
 * the pairs are loaded with their halves swapped (element 2j high). Elsewhere, two fused
 * multiply-adds of the split halves. (VDPBF16PS flushes denormal inputs and results to zero; an
 * attention score never comes near 1e-38.) */
#ifdef __AVX512BF16__
typedef __m512bh bf16_pairs;  /* 32 bf16, each pair's halves swapped */
typedef int32_t __attribute__((may_alias)) aliased_i32;  /* a pair stored by a vector store, read alone */

static inline bf16_pairs load_pairs(const uint16_t *p) {
    return (__m512bh)_mm512_rol_epi32(_mm512_loadu_si512(p), 16);
}

static inline __m512 dot_pairs(__m512 dot, bf16_pairs q, bf16_pairs k) { return _mm512_dpbf16_ps(dot, q, k); }
#else
typedef struct {
    __m512 even, odd;
} bf16_pairs;

static inline bf16_pairs load_pairs(const uint16_t *p) {
    bf16_pairs v;
    split_bf16(p, &v.even, &v.odd);
    return v;
}

static inline __m512 dot_pairs(__m512 dot, bf16_pairs q, bf16_pairs k) {
    return _mm512_fmadd_ps(q.odd, k.odd, _mm512_fmadd_ps(q.even, k.even, dot));
}
#endif

/* A score row's softmax in place, without the division: s[l] = e^(s[l] - max), lane l % 16 summing
 * them in order; returns 1 / their sum. `top` holds the row's maximum in one of its lanes. */
static inline float normalise(float *s, int64_t n, __m512 top) {
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 keep = n - l >= 16 ? 0xFFFF : (__mmask16)((1u << (n - l)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + l), most)));
        _mm512_mask_storeu_ps(s + l, keep, e);
        total = _mm512_add_ps(total, e);
    }
    return 1.0f / _mm512_reduce_add_ps(total);
}

/* One head's output: the even and odd elements' weighted sums (acc, 2 pairs vectors) times inv,
 * rounded to bf16 and put back in order (element 2i in the low half of dword i). */
static inline void store_head(const __m512 *acc, float inv, int64_t pairs, uint16_t *out) {
    const __m512 scale_out = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < pairs; c++) {
        const __m512i even = _mm512_castps_si512(round_bf16(_mm512_mul_ps(acc[2 * c], scale_out)));
        const __m512i odd = _mm512_castps_si512(round_bf16(_mm512_mul_ps(acc[2 * c + 1], scale_out)));
        _mm512_storeu_si512(out + 32 * c, _mm512_or_si512(odd, _mm512_srli_epi32(even, 16)));
    }
}

#define MAX_GROUP 4  /* query heads per KV head that run together; more run in runs of this many */

/* The first `count` of 16 scores (all of them from 16 up) stored at s, and kept in `top`, a running
 * maximum per lane. */
static inline void keep_scores(float *s, __m512 scores, int64_t count, __m512 *top) {
    const __mmask16 keep = count >= 16 ? 0xFFFF : (__mmask16)((1u << count) - 1);
    _mm512_mask_storeu_ps(s, keep, scores);
    *top = _mm512_mask_max_ps(*top, keep, *top, scores);
}

/* acc[g] += p[g stride + l] V[l] for l in lb .. le - 1, in order, g < NG: the weighted values of NG
 * heads of one KV head (V at `slots`, rows `row` apart from `off`), each value read and split once. */
#ifdef FORGE_AVX2
/* The AVX2 build takes a quarter of each value at a time (half of one run of 32 elements: 8 even and
 * 8 odd lanes), so that the NG heads' accumulators for it stay in registers: all of them at once are
 * NG hd / 8 vectors, 32 for 4 heads of 64, twice its 16 registers, and each multiply-add then went
 * through memory. Each lane adds the same products in the same order: the same bits. */
static inline __attribute__((always_inline)) void weigh(__m512 (*acc)[2 * MAX_PAIRS], const int NG, const float *p,
                                                        int64_t stride, const uint16_t *v_cache, const int64_t *slots,
                                                        int64_t lb, int64_t le, int64_t row, int64_t off,
                                                        const int64_t hd) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t c = 0; c < hd / 32; c++) {
        for (int h = 0; h < 2; h++) {
            __m256 even[MAX_GROUP], odd[MAX_GROUP];
            for (int g = 0; g < NG; g++) {
                even[g] = h ? acc[g][2 * c].hi : acc[g][2 * c].lo;
                odd[g] = h ? acc[g][2 * c + 1].hi : acc[g][2 * c + 1].lo;
            }
            const uint16_t *quarter = v_cache + off + 32 * c + 16 * h;  /* elements 32 c + 16 h .. + 15 */
            for (int64_t l = lb; l < le; l++) {  /* split as split_bf16 splits that half */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(quarter + slots[l] * row));
                const __m256 ve = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 vo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int g = 0; g < NG; g++) {
                    const __m256 w = _mm256_set1_ps(p[g * stride + l]);
                    even[g] = _mm256_fmadd_ps(w, ve, even[g]);
                    odd[g] = _mm256_fmadd_ps(w, vo, odd[g]);
                }
            }
            for (int g = 0; g < NG; g++) {
                if (h) {
                    acc[g][2 * c].hi = even[g];
                    acc[g][2 * c + 1].hi = odd[g];
                } else {
                    acc[g][2 * c].lo = even[g];
                    acc[g][2 * c + 1].lo = odd[g];
                }
            }
        }
    }
}
#else
static inline __attribute__((always_inline)) void weigh(__m512 (*acc)[2 * MAX_PAIRS], const int NG, const float *p,
                                                        int64_t stride, const uint16_t *v_cache, const int64_t *slots,
                                                        int64_t lb, int64_t le, int64_t row, int64_t off,
                                                        const int64_t hd) {
    const int64_t pairs = hd / 32;
    __m512 a[MAX_GROUP][2 * MAX_PAIRS];
    for (int g = 0; g < NG; g++)
        for (int64_t j = 0; j < 2 * pairs; j++) a[g][j] = acc[g][j];
    for (int64_t l = lb; l < le; l++) {
        const uint16_t *v = v_cache + slots[l] * row + off;
        __m512 vv[2 * MAX_PAIRS];
        for (int64_t c = 0; c < pairs; c++) split_bf16(v + 32 * c, &vv[2 * c], &vv[2 * c + 1]);
        for (int g = 0; g < NG; g++) {
            const __m512 w = _mm512_set1_ps(p[g * stride + l]);
            for (int64_t j = 0; j < 2 * pairs; j++) a[g][j] = _mm512_fmadd_ps(w, vv[j], a[g][j]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int64_t j = 0; j < 2 * pairs; j++) acc[g][j] = a[g][j];
}
#endif

static inline int shapes_ok(int64_t H, int64_t Hkv, int64_t hd) {
    return hd % 32 == 0 && hd <= MAX_HEAD_DIM && Hkv > 0 && H % Hkv == 0;
}

#endif
