/* The AVX-512 subset the CPU kernels use, on AVX2 + FMA + F16C: for CPUs without AVX-512 (AMD
 * before Zen 4, Intel client cores), where the kernels would otherwise give way to torch's.
 *
 * cpu_kernels.py builds the same sources a second way for them: `-mavx2 -mfma -mf16c -DFORGE_AVX2
 * -include avx2.h`. Included first, this header brings in immintrin.h, then renames the 512-bit
 * types and intrinsics the sources use to the ones below, which hold 16 lanes as two 256-bit
 * halves (lanes 0-7 in lo, 8-15 in hi). Each one gives the bits its AVX-512 namesake gives:
 * lane-wise arithmetic is the same instruction on each half; reductions add in the order GCC's
 * _mm512_reduce_* do (upper half + lower half, then upper quarter + lower quarter, ...); masked
 * loads and stores touch only the lanes their mask names. So a kernel's results do not depend on
 * which of the two builds runs it (tests/unit/test_cpu_kernels.py compares them where the CPU
 * runs both), and batch invariance holds here as it does there.
 *
 * The one instruction without a lane-wise twin is VNNI's VPDPBUSD (4 unsigned x signed byte
 * products a lane, summed exactly into int32): quant_gemm.c takes its group dots from
 * VPMADDUBSW and VPMADDWD itself, where it knows its codes' range (see there).
 */
#ifndef FORGE_AVX2_H
#define FORGE_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct { __m256 lo, hi; } f16x;
typedef struct { __m256i lo, hi; } i16x;
typedef struct { __m256d lo, hi; } d16x;

#define FORGE_INLINE static inline __attribute__((always_inline))

/* ---- setting, loading, storing ---- */

FORGE_INLINE f16x f16x_set1_ps(float v) { return (f16x){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
FORGE_INLINE f16x f16x_setzero_ps(void) { return (f16x){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
FORGE_INLINE i16x i16x_set1_epi32(int v) { return (i16x){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
FORGE_INLINE i16x i16x_set1_epi8(char v) { return (i16x){_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
FORGE_INLINE i16x i16x_setzero_si512(void) { return (i16x){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
FORGE_INLINE i16x i16x_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9,
                                  int e10, int e11, int e12, int e13, int e14, int e15) {
    return (i16x){_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7),
                  _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15)};
}
FORGE_INLINE f16x f16x_loadu_ps(const void *p) {
    return (f16x){_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8)};
}
FORGE_INLINE void f16x_storeu_ps(void *p, f16x v) {
    _mm256_storeu_ps((float *)p, v.lo);
    _mm256_storeu_ps((float *)p + 8, v.hi);
}
FORGE_INLINE i16x i16x_loadu_si512(const void *p) {
    return (i16x){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
FORGE_INLINE void i16x_storeu_si512(void *p, i16x v) {
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)p + 1, v.hi);
}

/* ---- masks: bit i of a __mmask16 is lane i ---- */

FORGE_INLINE i16x lanes_of(__mmask16 k) {  /* lane i all ones where bit i is set */
    const __m256i bits_lo = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i bits_hi = _mm256_setr_epi32(256, 512, 1024, 2048, 4096, 8192, 16384, 32768);
    const __m256i all = _mm256_set1_epi32(k);
    return (i16x){_mm256_cmpeq_epi32(_mm256_and_si256(all, bits_lo), bits_lo),
                  _mm256_cmpeq_epi32(_mm256_and_si256(all, bits_hi), bits_hi)};
}
FORGE_INLINE f16x f16x_maskz_loadu_ps(__mmask16 k, const void *p) {  /* masked-off lanes are not read */
    const i16x m = lanes_of(k);
    return (f16x){_mm256_maskload_ps((const float *)p, m.lo), _mm256_maskload_ps((const float *)p + 8, m.hi)};
}
FORGE_INLINE void f16x_mask_storeu_ps(void *p, __mmask16 k, f16x v) {
    const i16x m = lanes_of(k);
    _mm256_maskstore_ps((float *)p, m.lo, v.lo);
    _mm256_maskstore_ps((float *)p + 8, m.hi, v.hi);
}
FORGE_INLINE f16x f16x_maskz_mov_ps(__mmask16 k, f16x v) {
    const i16x m = lanes_of(k);
    return (f16x){_mm256_and_ps(v.lo, _mm256_castsi256_ps(m.lo)), _mm256_and_ps(v.hi, _mm256_castsi256_ps(m.hi))};
}
FORGE_INLINE f16x f16x_mask_max_ps(f16x src, __mmask16 k, f16x a, f16x b) {
    const i16x m = lanes_of(k);
    return (f16x){_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), _mm256_castsi256_ps(m.lo)),
                  _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), _mm256_castsi256_ps(m.hi))};
}
/* The lanes of k where a `predicate` b (a _CMP_ constant) holds. */
#define f16x_mask_cmp_ps_mask(k, a, b, predicate)                                                        \
    ((__mmask16)((k) & (_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, (predicate))) |                 \
                        _mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, (predicate))) << 8)))
FORGE_INLINE __m256i m256_maskz_loadu_epi16(__mmask16 k, const void *p) {  /* 16 uint16; masked off: 0, unread */
    if (k == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t v[16] = {0};
    for (int i = 0; i < 16; i++)
        if (k >> i & 1) memcpy(&v[i], (const uint16_t *)p + i, sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)v);
}

/* ---- lane-wise arithmetic ---- */

#define FORGE_F16X_2(name, op)                                                                         \
    FORGE_INLINE f16x f16x_##name(f16x a, f16x b) { return (f16x){op(a.lo, b.lo), op(a.hi, b.hi)}; }
FORGE_F16X_2(add_ps, _mm256_add_ps)
FORGE_F16X_2(sub_ps, _mm256_sub_ps)
FORGE_F16X_2(mul_ps, _mm256_mul_ps)
FORGE_F16X_2(div_ps, _mm256_div_ps)
FORGE_F16X_2(max_ps, _mm256_max_ps)
FORGE_F16X_2(min_ps, _mm256_min_ps)
FORGE_F16X_2(unpacklo_ps, _mm256_unpacklo_ps)  /* within each 128-bit quarter, as in AVX-512 */
FORGE_F16X_2(unpackhi_ps, _mm256_unpackhi_ps)
#undef FORGE_F16X_2
#define FORGE_I16X_2(name, op)                                                                         \
    FORGE_INLINE i16x i16x_##name(i16x a, i16x b) { return (i16x){op(a.lo, b.lo), op(a.hi, b.hi)}; }
FORGE_I16X_2(and_si512, _mm256_and_si256)
FORGE_I16X_2(or_si512, _mm256_or_si256)
FORGE_I16X_2(add_epi32, _mm256_add_epi32)
FORGE_I16X_2(min_epi32, _mm256_min_epi32)
FORGE_I16X_2(max_epi32, _mm256_max_epi32)
#undef FORGE_I16X_2
FORGE_INLINE d16x d16x_unpacklo_pd(d16x a, d16x b) {
    return (d16x){_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)};
}
FORGE_INLINE d16x d16x_unpackhi_pd(d16x a, d16x b) {
    return (d16x){_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)};
}
FORGE_INLINE f16x f16x_fmadd_ps(f16x a, f16x b, f16x c) {
    return (f16x){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
FORGE_INLINE f16x f16x_fnmadd_ps(f16x a, f16x b, f16x c) {
    return (f16x){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
FORGE_INLINE f16x f16x_abs_ps(f16x a) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return (f16x){_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
#define i16x_srli_epi32(a, n) ((i16x){_mm256_srli_epi32((a).lo, (n)), _mm256_srli_epi32((a).hi, (n))})
#define i16x_slli_epi32(a, n) ((i16x){_mm256_slli_epi32((a).lo, (n)), _mm256_slli_epi32((a).hi, (n))})
#define i16x_srli_epi16(a, n) ((i16x){_mm256_srli_epi16((a).lo, (n)), _mm256_srli_epi16((a).hi, (n))})
/* roundscale with a scale of 0 (the rounding mode in the low bits): a round to an integer */
#define f16x_roundscale_ps(a, mode) ((f16x){_mm256_round_ps((a).lo, (mode)), _mm256_round_ps((a).hi, (mode))})
/* a * 2^n for integer-valued n in [-126, 127] (2^n a normal float, so the product's one rounding is
 * scalef's): the range exp16 in vec.h gives it. */
FORGE_INLINE f16x f16x_scalef_ps(f16x a, f16x n) {
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.lo), bias), 23));
    const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.hi), bias), 23));
    return (f16x){_mm256_mul_ps(a.lo, lo), _mm256_mul_ps(a.hi, hi)};
}

/* ---- conversions and casts ---- */

FORGE_INLINE f16x f16x_castsi512_ps(i16x a) { return (f16x){_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
FORGE_INLINE i16x i16x_castps_si512(f16x a) { return (i16x){_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
FORGE_INLINE d16x d16x_castps_pd(f16x a) { return (d16x){_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
FORGE_INLINE f16x f16x_castpd_ps(d16x a) { return (f16x){_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)}; }
FORGE_INLINE f16x f16x_cvtepi32_ps(i16x a) { return (f16x){_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
FORGE_INLINE i16x i16x_cvtps_epi32(f16x a) { return (i16x){_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
FORGE_INLINE i16x i16x_cvtepu16_epi32(__m256i a) {
    return (i16x){_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
FORGE_INLINE f16x f16x_cvtph_ps(__m256i a) {
    return (f16x){_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
}
FORGE_INLINE __m128i low_words(__m256i a) {  /* the low 16 bits of each int32 lane, in order (truncated) */
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, pick), 0x08));
}
FORGE_INLINE __m256i i16x_cvtepi32_epi16(i16x a) {
    return _mm256_set_m128i(low_words(a.hi), low_words(a.lo));
}
FORGE_INLINE __m128i i16x_cvtepi32_epi8(i16x a) {  /* the low byte of each lane (truncated) */
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a.lo, pick), order);
    const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a.hi, pick), order);
    return _mm_unpacklo_epi64(_mm256_castsi256_si128(lo), _mm256_castsi256_si128(hi));
}

/* ---- shuffles across the 16 lanes ---- */

/* 128-bit quarters: a's (imm & 3) and (imm >> 2 & 3), then b's (imm >> 4 & 3) and (imm >> 6 & 3) */
#define f16x_shuffle_f32x4(a, b, imm)                                                                  \
    ((f16x){_mm256_permute2f128_ps((a).lo, (a).hi, ((imm) & 3) | (((imm) >> 2 & 3) << 4)),               \
            _mm256_permute2f128_ps((b).lo, (b).hi, ((imm) >> 4 & 3) | (((imm) >> 6 & 3) << 4))})
FORGE_INLINE f16x f16x_permutexvar_ps(i16x index, f16x a) {  /* lane i = a's lane index[i] & 15 */
    const __m256 from_lo_0 = _mm256_permutevar8x32_ps(a.lo, index.lo), from_hi_0 = _mm256_permutevar8x32_ps(a.hi, index.lo);
    const __m256 from_lo_1 = _mm256_permutevar8x32_ps(a.lo, index.hi), from_hi_1 = _mm256_permutevar8x32_ps(a.hi, index.hi);
    /* bit 3 of an index picks the upper half: moved to the sign bit for blendv */
    return (f16x){_mm256_blendv_ps(from_lo_0, from_hi_0, _mm256_castsi256_ps(_mm256_slli_epi32(index.lo, 28))),
                  _mm256_blendv_ps(from_lo_1, from_hi_1, _mm256_castsi256_ps(_mm256_slli_epi32(index.hi, 28)))};
}

/* ---- reductions, in the order of GCC's _mm512_reduce_* ---- */

FORGE_INLINE float f16x_reduce_add_ps(f16x a) {
    const __m256 t3 = _mm256_add_ps(a.hi, a.lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
FORGE_INLINE float f16x_reduce_max_ps(f16x a) {
    const __m256 t3 = _mm256_max_ps(a.hi, a.lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
FORGE_INLINE int i16x_reduce_add_epi32(i16x a) {  /* integer sums: any order gives the same */
    const __m256i t3 = _mm256_add_epi32(a.hi, a.lo);
    __m128i t = _mm_add_epi32(_mm256_extracti128_si256(t3, 1), _mm256_castsi256_si128(t3));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(t) + _mm_extract_epi32(t, 1);
}

/* ---- the names the sources use (some are macros in GCC's headers: undefined first) ---- */

#undef __m512
#define __m512 f16x
#undef __m512i
#define __m512i i16x
#undef __m512d
#define __m512d d16x
#undef _mm512_set1_ps
#define _mm512_set1_ps f16x_set1_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps f16x_setzero_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 i16x_set1_epi32
#undef _mm512_set1_epi8
#define _mm512_set1_epi8 i16x_set1_epi8
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 i16x_setzero_si512
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 i16x_setr_epi32
#undef _mm512_loadu_ps
#define _mm512_loadu_ps f16x_loadu_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps f16x_storeu_ps
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 i16x_loadu_si512
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 i16x_storeu_si512
#undef _mm512_store_si512
#define _mm512_store_si512 i16x_storeu_si512
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps f16x_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps f16x_mask_storeu_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps f16x_maskz_mov_ps
#undef _mm512_mask_max_ps
#define _mm512_mask_max_ps f16x_mask_max_ps
#undef _mm512_mask_cmp_ps_mask
#define _mm512_mask_cmp_ps_mask f16x_mask_cmp_ps_mask
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 m256_maskz_loadu_epi16
#undef _mm512_add_ps
#define _mm512_add_ps f16x_add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps f16x_sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps f16x_mul_ps
#undef _mm512_div_ps
#define _mm512_div_ps f16x_div_ps
#undef _mm512_max_ps
#define _mm512_max_ps f16x_max_ps
#undef _mm512_min_ps
#define _mm512_min_ps f16x_min_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps f16x_fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps f16x_fnmadd_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps f16x_abs_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps f16x_roundscale_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps f16x_scalef_ps
#undef _mm512_unpacklo_ps
#define _mm512_unpacklo_ps f16x_unpacklo_ps
#undef _mm512_unpackhi_ps
#define _mm512_unpackhi_ps f16x_unpackhi_ps
#undef _mm512_unpacklo_pd
#define _mm512_unpacklo_pd d16x_unpacklo_pd
#undef _mm512_unpackhi_pd
#define _mm512_unpackhi_pd d16x_unpackhi_pd
#undef _mm512_and_si512
#define _mm512_and_si512 i16x_and_si512
#undef _mm512_or_si512
#define _mm512_or_si512 i16x_or_si512
#undef _mm512_add_epi32
#define _mm512_add_epi32 i16x_add_epi32
#undef _mm512_min_epi32
#define _mm512_min_epi32 i16x_min_epi32
#undef _mm512_max_epi32
#define _mm512_max_epi32 i16x_max_epi32
#undef _mm512_srli_epi32
#define _mm512_srli_epi32 i16x_srli_epi32
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 i16x_slli_epi32
#undef _mm512_srli_epi16
#define _mm512_srli_epi16 i16x_srli_epi16
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps f16x_castsi512_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 i16x_castps_si512
#undef _mm512_castps_pd
#define _mm512_castps_pd d16x_castps_pd
#undef _mm512_castpd_ps
#define _mm512_castpd_ps f16x_castpd_ps
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps f16x_cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 i16x_cvtps_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 i16x_cvtepu16_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps f16x_cvtph_ps
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 i16x_cvtepi32_epi16
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 i16x_cvtepi32_epi8
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4 f16x_shuffle_f32x4
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps f16x_permutexvar_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps f16x_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps f16x_reduce_max_ps
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 i16x_reduce_add_epi32

#endif
