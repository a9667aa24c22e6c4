/* GEMMs over group-quantised weights for the CPU backend (AVX-512 VNNI), for every batch size:
 * decode steps of one row to many, and prefill chunks.
 *
 * A decode step multiplies a few activation rows by every weight once; torch's 4-bit kernel
 * dequantises each weight to float for that, which makes it compute-bound well below memory
 * speed. These kernels quantise the activations to int8 per group of 32 inputs instead, and
 * multiply integers with VNNI (64 byte products per instruction), as llama.cpp does. One int8
 * level alone costs fidelity (a greedy continuation agreed with fp32 on 11 of 20 test prompts,
 * against 14 with bf16 activations), so a second level carries the first one's rounding error:
 *
 *   w[n, k] = code[n, k] * wd[n, g] + wm[n, g]        g = k / 32
 *     q4: codes 0..15;  q8: codes 0..255 (int8 + 128, so wm = -128 wd)
 *   x[m, k] ~ (a[m, k] + f[m, k] / 254) * xd[m, g]     a, f in -127..127
 *   y[m, n] = sum_g wd xd sum_k(code (a + f / 254)) + wm xd sum_k(a + f / 254)
 *
 * For q8 the offset term is integer arithmetic: the first level's dot starts from -128 sum_k(a),
 * the second's from -128 sum_k(f), so that each ends as the exact signed dot (sum_k((code - 128) a)),
 * and a group costs a row one float multiply-add fewer (they share the VNNI's pipes).
 *
 * The first level's error in a group is up to amax / 254 per value, so nearly all of it sits in
 * the few groups that hold one of the row's large values (a model's activations have a handful of
 * channels far above the rest). The second level is kept for those groups only, f = 0 elsewhere:
 * about one group in five on the default model's decode steps (see FINE_ABOVE in cpu_kernels.py
 * for what that costs in fidelity: top tokens flip no more often than with it everywhere).
 * Rows go through a tile in blocks of 8, so that each pass over a tile's weights (unpacked once
 * per group) serves 8 rows, and 8 independent VNNI chains hide the instruction's latency; in a
 * prefill chunk, a q4 tile is unpacked once for all its blocks. The first level runs over every
 * group; then, for each group that some row of the block needs at the second level, the weights
 * are unpacked (or read) once more and only those rows take it (about one group in five per row,
 * against one in three to one in two for a block's rows together). Each row sums its groups in
 * the same order whatever its block: a row's result does not depend on M, on the rows batched
 * with it, or on which prefill chunk it came in (batch invariance, which greedy determinism rests
 * on).
 *
 * Layout: weight rows in tiles of 16, so that the 16 int32 lanes of a VNNI product are 16 output
 * columns and nothing needs a horizontal sum. For each tile and group, a run of 64-byte vectors
 * holds chunk c (inputs 4c .. 4c + 3 of the group) of all 16 rows: lane j = row j's 4 codes.
 * q8 stores the group's 8 chunks as 8 vectors; q4 stores 4 vectors whose low nibbles are chunks
 * 0..3 and high nibbles chunks 4..7. Scales and offsets are fp16, [tile][group][16].
 * Activations are quantised into blocks of 8 rows, group by group, so that a tile reads a block's
 * rows at fixed offsets from one pointer (no per-row pointers to spill), and each weight chunk meets
 * all 8 rows before the next: 8 VNNI chains side by side.
 *
 * Threads: OpenMP over tiles. The library links libgomp by soname, so inside a process that has
 * loaded torch it shares torch's OpenMP runtime and thread pool.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define TILE 16  /* weight rows per tile: one per int32 lane */
#define ROWS 8   /* activation rows per pass over a tile */
#define UNPACK_ONCE_ROWS (8 * ROWS)  /* past this many rows, a q4 tile is unpacked once for all of them */
#define PARALLEL_BLOCKS 4  /* blocks of ROWS rows from which all threads quantise the activations */
_Static_assert(ROWS <= 8, "need[] holds one bit per row of a block");

enum { OK = 0, BAD_SHAPE = 1, NO_MEMORY = 2 };

int forge_supported(void) {
    __builtin_cpu_init();
#ifdef FORGE_AVX2  /* the AVX2 build (avx2.h) */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#endif
}

static inline __m512 load16(const void *x, int bf16, int64_t at) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + at);
}

/* Rows m0 .. m1 - 1 (m0 a multiple of ROWS) of x [M, K] (bf16 or fp32) -> int8 levels a0 (in a)
 * and, with levels = 2, a1 (in a_fine), with x ~ xd (a0 + a1 / 254), and scales xd and
 * xs = xd * sum(a0 + a1 / 254) per row and group of 32, and xo = -128 sum(a0), -128 sum(a1) (the
 * q8 codes' offset, per level; stored as below, a pair per row and group). The second level
 * carries the first one's rounding error in the groups that hold one of the row's large values
 * (amax > fine_above * the row's RMS; all groups when fine_above is 0) and is zero elsewhere.
 * Bit i of need[b][g] says that row ROWS b + i has a second level in group g.
 *
 * Each level is stored by block of ROWS rows, group by group: [M / ROWS][K / 32][ROWS][32] (xd and
 * xs [M / ROWS][K / 32][ROWS]), so that a tile reads a block's rows in one group at fixed offsets
 * from one pointer. A last, partial block's missing rows are never read. */
static inline int64_t at_block(int64_t m, int64_t g, int64_t groups) {  /* row m, group g's index / 32 */
    return (m / ROWS * groups + g) * ROWS + m % ROWS;
}

static void quantize_rows(const void *x, int x_bf16, int64_t m0, int64_t m1, int64_t K, int levels,
                          float fine_above, int8_t *a, int8_t *a_fine, float *xd, float *xs, int32_t *xo,
                          uint8_t *need) {
    const int64_t groups = K / GROUP;
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    memset(need + m0 / ROWS * groups, 0, ((m1 - m0 + ROWS - 1) / ROWS) * groups);
    for (int64_t m = m0; m < m1; m++) {
        __m512 squares = _mm512_setzero_ps();
        for (int64_t at = m * K; at < (m + 1) * K; at += 16) {
            const __m512 v = load16(x, x_bf16, at);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const float mean_square = _mm512_reduce_add_ps(squares) / (float)K;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = m * K + g * GROUP, slot = at_block(m, g, groups);
            const __m512 v[2] = {load16(x, x_bf16, at), load16(x, x_bf16, at + 16)};
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            const int second = levels == 2 && amax * amax > fine_above * fine_above * mean_square;
            const float d = amax / 127.0f;
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m512 total_levels = _mm512_setzero_ps();
            __m512i sum0 = _mm512_setzero_si512(), sum1 = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512 scaled = _mm512_mul_ps(v[h], inv);  /* in units of d */
                const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(scaled), hi), lo);
                const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(scaled, _mm512_cvtepi32_ps(q0)), _mm512_set1_ps(254.0f));
                const __m512i q1 = second ? _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(rest), hi), lo)
                                          : _mm512_setzero_si512();
                sum0 = _mm512_add_epi32(sum0, q0);
                sum1 = _mm512_add_epi32(sum1, q1);
                total_levels = _mm512_add_ps(total_levels, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1),
                                                                           _mm512_set1_ps(1.0f / 254.0f),
                                                                           _mm512_cvtepi32_ps(q0)));
                _mm_storeu_si128((__m128i *)(a + slot * GROUP + 16 * h), _mm512_cvtepi32_epi8(q0));
                if (levels == 2)
                    _mm_storeu_si128((__m128i *)(a_fine + slot * GROUP + 16 * h), _mm512_cvtepi32_epi8(q1));
            }
            xd[slot] = d;
            xs[slot] = d * _mm512_reduce_add_ps(total_levels);
            xo[2 * slot] = -128 * _mm512_reduce_add_epi32(sum0);
            xo[2 * slot + 1] = -128 * _mm512_reduce_add_epi32(sum1);
            if (second) need[m / ROWS * groups + g] |= (uint8_t)(1u << (m % ROWS));
        }
    }
}

static inline __m512 halves(const uint16_t *p) {  /* 16 fp16 -> fp32 */
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* How a GEMM stores y: fp32, bf16, or fp32 holding y rounded to bf16 (the bf16 store's values,
 * widened: what a caller that wants fp32 would get from the bf16 store and a copy). */
enum { OUT_FP32 = 0, OUT_BF16 = 1, OUT_BF16_AS_FP32 = 2 };

static inline void store16(void *out, int out_form, int64_t at, __m512 y) {
    if (out_form == OUT_FP32) {
        _mm512_storeu_ps((float *)out + at, y);
        return;
    }
    /* round to nearest even, then keep the high halves */
    __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    if (out_form == OUT_BF16_AS_FP32)
        _mm512_storeu_si512((float *)out + at, _mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* The 16 weight rows of a tile in group g as 8 vectors of 4 codes per int32 lane. */
static inline __attribute__((always_inline)) void unpack(int q4, const uint8_t *w, __m512i *chunk) {
    if (q4) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(w + 64 * c);
            chunk[c] = _mm512_and_si512(v, low);
            chunk[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
    } else {
        for (int c = 0; c < 8; c++) chunk[c] = _mm512_loadu_si512(w + 64 * c);
    }
}

#ifdef FORGE_AVX2
/* The AVX2 build has no VPDPBUSD (4 unsigned x signed byte products a lane, summed exactly into
 * int32). Its group dots come from VPMADDUBSW (pairs of such products summed into int16, saturating)
 * and VPMADDWD, each half of a tile apart (8 int32 lanes), kept exact by what the codes can be:
 *   q4, codes 0..15: a pair is at most 2 x 15 x 127 = 3,810, so the 8 chunks' pairs add up in int16
 *     (at most 30,480) before one VPMADDWD: two instructions a chunk.
 *   q8, codes 0..255 (a signed code c + 128): c's magnitude (at most 128) against x with c's sign
 *     (|x| <= 127: a pair fits int16), widened a chunk at a time. That is sum(c x), the signed dot,
 *     which the VNNI build reaches from its start, -128 sum(x) (quantize_rows' xo), so xo is not
 *     read here.
 * Each int32 lane then holds the sum the VNNI build's lane does, so the float arithmetic after it
 * gives the same bits.
 *
 * Each chunk of codes (in one half of the tile) meets every row of the block before the next chunk:
 * the rows' sums stay in registers, and the codes are loaded and unpacked once a block. One
 * row at a time through a group needs its 8 chunks in both halves, 16 vectors, all of AVX2's
 * registers: they were spilled, and each product loaded its codes back. The products are written in
 * assembly: in C, GCC merged the two halves' broadcasts of the same 4 activation bytes and kept a
 * group's 64 of them in memory, which made this order the slower one (q4 1.06-1.25x). Written out,
 * the GEMMs at the default model's shapes take 0.72-0.89 of the time of one row at a time (q4 and
 * q8, one thread, 1 to 128 rows). */
static inline __attribute__((always_inline)) void group_dots(int q4, int packed, const uint8_t *w, const int8_t *x,
                                                             const int R, __m512i *dot) {
    const __m256i one = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    for (int h = 0; h < 2; h++) {
        __m256i sum[ROWS];
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) sum[i] = _mm256_setzero_si256();
        /* Row i's product with chunk c takes its 4 bytes at x + 32 i + 4 c (the "m" operand tells
         * GCC that the statement reads the rows' activations). */
        if (q4) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {  /* chunks c and c + 4 */
                __m256i lo_codes, hi_codes;
                if (packed) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * h));
                    lo_codes = _mm256_and_si256(v, low);
                    hi_codes = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                } else {
                    lo_codes = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * h));
                    hi_codes = _mm256_loadu_si256((const __m256i *)(w + 64 * (c + 4) + 32 * h));
                }
#pragma GCC unroll 8
                for (int i = 0; i < R; i++)
                    __asm__("vpbroadcastd %c[at](%[x]), %%ymm14\n\t"
                            "vpmaddubsw %%ymm14, %[lo], %%ymm14\n\t"
                            "vpaddw %%ymm14, %[sum], %[sum]\n\t"
                            "vpbroadcastd %c[at]+16(%[x]), %%ymm15\n\t"
                            "vpmaddubsw %%ymm15, %[hi], %%ymm15\n\t"
                            "vpaddw %%ymm15, %[sum], %[sum]"
                            : [sum] "+x"(sum[i])
                            : [lo] "x"(lo_codes), [hi] "x"(hi_codes), [x] "r"(x + 4 * c), [at] "i"(i * GROUP),
                              "m"(*(const int8_t(*)[R * GROUP])x)
                            : "xmm14", "xmm15");
            }
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) sum[i] = _mm256_madd_epi16(sum[i], one);
        } else {
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m256i codes = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * h)), flip);
                const __m256i magnitude = _mm256_sign_epi8(codes, codes);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++)
                    __asm__("vpbroadcastd %c[at](%[x]), %%ymm14\n\t"
                            "vpsignb %[codes], %%ymm14, %%ymm14\n\t"
                            "vpmaddubsw %%ymm14, %[magnitude], %%ymm14\n\t"
                            "vpmaddwd %[one], %%ymm14, %%ymm14\n\t"
                            "vpaddd %%ymm14, %[sum], %[sum]"
                            : [sum] "+x"(sum[i])
                            : [codes] "x"(codes), [magnitude] "x"(magnitude), [one] "x"(one), [x] "r"(x + 4 * c),
                              [at] "i"(i * GROUP), "m"(*(const int8_t(*)[R * GROUP])x)
                            : "xmm14");
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            if (h) dot[i].hi = sum[i]; else dot[i].lo = sum[i];
        }
    }
}
#else
/* dot += codes (16 lanes of 4 unsigned bytes) . the 4 signed bytes at x, broadcast to every lane by
 * the instruction itself (an embedded {1to16} memory operand): GCC does not fold a broadcast into
 * VNNI's source, and as a separate instruction it costs a vector uop per product. */
static inline __attribute__((always_inline)) __m512i dpbusd_at(__m512i dot, __m512i codes, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(codes), "m"(*(const int32_t *)x));
    return dot;
}

static inline __m512i dot8(__m512i dot, const __m512i *chunk, const int8_t *x) {  /* + one row's group */
    for (int c = 0; c < 8; c++) dot = dpbusd_at(dot, chunk[c], x + 4 * c);
    return dot;
}
#endif

/* One tile of 16 weight rows against the R rows of block b -> y[R][16]: the first level over every
 * group, then the second in the groups and rows `need` names (need[g]: a bit per row). q4 and R are
 * literal constants at each call, so the accumulators stay in registers through both levels: the
 * second adds into them row by row (a test of the row's bit, unrolled), groups in order as the
 * first level. (Kept in memory and indexed by the bit's position, they made each needed group a
 * load and a store: 4-5% of the GEMMs' time on the default model's layers at 8 to 125 rows.)
 * The block's rows are read at fixed offsets (see quantize_rows), and each chunk of weights meets
 * every row before the next chunk is taken, so R VNNI chains run side by side. Given `ahead` (the
 * next tile's packed codes; its scales and offsets follow this tile's), each group also prefetches
 * that tile's group. */
static inline __attribute__((always_inline)) void tile(int q4, int unpacked, const uint8_t *codes,
                                                       const uint16_t *wd16, const uint16_t *wm16, const int8_t *a,
                                                       const int8_t *a_fine, const float *xd, const float *xs,
                                                       const int32_t *xo, const uint8_t *need, int64_t K, int64_t b,
                                                       const int R, __m512 *y, const uint8_t *ahead) {
    const int packed = q4 && !unpacked;  /* codes in the q4 layout; else 8 vectors a group, as q8 */
    const int64_t groups = K / GROUP, group_bytes = packed ? TILE * GROUP / 2 : TILE * GROUP;
#ifdef FORGE_AVX2
    (void)xo;  /* q8's dots are the signed sums (group_dots) */
#else
    __m512i chunk[8];
#endif
    __m512 acc[ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t slot = (b * groups + g) * ROWS;
        const int8_t *ab = a + slot * GROUP;
        const float *xdb = xd + slot, *xsb = xs + slot;
#ifndef FORGE_AVX2
        unpack(packed, codes + g * group_bytes, chunk);
#endif
        if (ahead) {  /* the next tile's group g (packed), on its way while this one computes */
            const int64_t ahead_bytes = q4 ? TILE * GROUP / 2 : TILE * GROUP;
            for (int64_t at = 0; at < ahead_bytes; at += 64)
                _mm_prefetch((const char *)ahead + g * ahead_bytes + at, _MM_HINT_T0);
            if (!(g & 1)) {  /* 16 fp16 scales a group: a cache line holds two */
                _mm_prefetch((const char *)(wd16 + (groups + g) * TILE), _MM_HINT_T0);
                if (q4) _mm_prefetch((const char *)(wm16 + (groups + g) * TILE), _MM_HINT_T0);
            }
        }
        __m512i dot[ROWS];
#ifdef FORGE_AVX2
        group_dots(q4, packed, codes + g * group_bytes, ab, R, dot);
#else
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) dot[i] = q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(xo[2 * (slot + i)]);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                dot[i] = dpbusd_at(dot[i], chunk[c], ab + i * GROUP + 4 * c);
            }
        }
#endif
        const __m512 wd = halves(wd16 + g * TILE);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(wd, _mm512_set1_ps(xdb[i])), acc[i]);
        if (q4) {  /* q8's offset is in its dots already */
            const __m512 wm = halves(wm16 + g * TILE);
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xsb[i]), acc[i]);
        }
    }
    for (int64_t g = 0; g < groups; g++) {  /* then the second level, group by group */
        const unsigned rows = need[g];
        if (!rows) continue;
        const int64_t slot = (b * groups + g) * ROWS;
#ifndef FORGE_AVX2
        unpack(packed, codes + g * group_bytes, chunk);
#endif
        const __m512 wd = halves(wd16 + g * TILE);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            if (!(rows >> i & 1)) continue;
#ifdef FORGE_AVX2  /* a row at a time: a test of each row's bit per chunk cost more than it saved */
            __m512i dot;
            group_dots(q4, packed, codes + g * group_bytes, a_fine + (slot + i) * GROUP, 1, &dot);
            const __m512 sum = _mm512_cvtepi32_ps(dot);
#else
            const __m512i start = q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(xo[2 * (slot + i) + 1]);
            const __m512 sum = _mm512_cvtepi32_ps(dot8(start, chunk, a_fine + (slot + i) * GROUP));
#endif
            const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(xd[slot + i] * (1.0f / 254.0f)));
            acc[i] = _mm512_fmadd_ps(sum, scale, acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) y[i] = acc[i];
}

/* Tile t against every activation row. q4 is a literal constant at each call. */
static inline __attribute__((always_inline)) void tile_rows(int q4, int64_t t, const uint8_t *codes,
                                                            const uint16_t *wd16, const uint16_t *wm16,
                                                            const int8_t *a, const int8_t *a_fine,
                                                            const float *xd, const float *xs, const int32_t *xo,
                                                            const uint8_t *need, int64_t M, int64_t K, int64_t N,
                                                            void *out, int out_form, uint8_t *spare) {
    const int64_t groups = K / GROUP, tile_bytes = (q4 ? K / 2 : K) * TILE;
    const uint8_t *w = codes + t * tile_bytes;
    const uint16_t *d = wd16 + t * groups * TILE, *o = q4 ? wm16 + t * groups * TILE : NULL;
    /* Given `spare` (linear does, for a q4 weight and many blocks of rows), the tile's codes are
     * unpacked once into it (K / 32 groups of 8 vectors, as q8's), and each block reads them there. */
    const int unpacked = spare != NULL;
    if (unpacked) {
        for (int64_t g = 0; g < groups; g++) {
            __m512i chunk[8];
            unpack(1, w + g * TILE * GROUP / 2, chunk);
            for (int c = 0; c < 8; c++) _mm512_store_si512(spare + (g * 8 + c) * 64, chunk[c]);
        }
        w = spare;
    }
    __m512 y[ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t rows = M - m0 < ROWS ? M - m0 : ROWS, b = m0 / ROWS;
        const uint8_t *rows_need = need + b * groups;
        /* The last full block's pass (or the only block's) fetches the next tile group by group: the
         * hardware prefetcher, left alone, has no weights in flight while a tile's other blocks
         * compute, and a decode step's 60 MB of weights come from memory (30 layers' weights cycled:
         * 9 / 16 / 32 rows 4.2 / 5.6 / 8.9 -> 3.4 / 4.2 / 7.1 ms; a 32-row decode step 20-21.6 ->
         * 16.7-17.3 ms). Not a last, short block's: its few rows' pass is too short to hide the fetch
         * (bench/kernel_ab.py, fused steps of 18 / 20 / 26 / 34 / 50 rows, 9 to 25 a thread: 0.90 /
         * 0.90 / 0.96 / 0.93 / 0.94 of the step; 16 / 32 / 64 rows unchanged). */
        const int64_t fetching = M < ROWS ? 0 : M / ROWS - 1;
        const uint8_t *ahead = b == fetching && t + 1 < N / TILE ? codes + (t + 1) * tile_bytes : NULL;
#define TILE_CASE(R)                                                                                   \
    if (unpacked)                                                                                      \
        tile(q4, 1, w, d, o, a, a_fine, xd, xs, xo, rows_need, K, b, R, y, ahead);                     \
    else                                                                                               \
        tile(q4, 0, w, d, o, a, a_fine, xd, xs, xo, rows_need, K, b, R, y, ahead);                     \
    break;
        switch (rows) {
            case 1: TILE_CASE(1)
            case 2: TILE_CASE(2)
            case 3: TILE_CASE(3)
            case 4: TILE_CASE(4)
            case 5: TILE_CASE(5)
            case 6: TILE_CASE(6)
            case 7: TILE_CASE(7)
            default: TILE_CASE(8)
        }
#undef TILE_CASE
        for (int64_t i = 0; i < rows; i++) store16(out, out_form, (m0 + i) * N + t * TILE, y[i]);
    }
}

static int linear(int q4, const void *x, int x_bf16, int64_t M, int64_t K, int64_t N, const uint8_t *codes,
                  const uint16_t *wd16, const uint16_t *wm16, void *out, int out_form, int levels,
                  float fine_above, int threads) {
    if (M < 1 || N < TILE || N % TILE || K < GROUP || K % GROUP || levels < 1 || levels > 2 || !(fine_above >= 0))
        return BAD_SHAPE;
    const int64_t groups = K / GROUP, blocks = (M + ROWS - 1) / ROWS;
    const int64_t padded = blocks * ROWS;
    int8_t *a = malloc(levels * padded * K + 4 * padded * groups * sizeof(float) + blocks * groups);
    if (!a) return NO_MEMORY;
    float *xd = (float *)(a + levels * padded * K), *xs = xd + padded * groups;
    int32_t *xo = (int32_t *)(xs + padded * groups);  /* a pair per row and group */
    uint8_t *need = (uint8_t *)(xo + 2 * padded * groups);
    int8_t *a_fine = levels == 2 ? a + padded * K : NULL;  /* the second level, read where need[] says */
    /* From 4 blocks of rows (decode steps of 32 rows and prefill chunks) the rows are quantised by
     * all threads, a block each at a time: one thread alone took about a sixth of a 512-row GEMM,
     * and at 32 rows the others waited for it (a 32-row decode step, 20.3 -> 19.9 ms); below,
     * by one, where waking the others costs more than it saves (16 rows: no gain). */
    if (blocks >= PARALLEL_BLOCKS) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t b = 0; b < blocks; b++)
            quantize_rows(x, x_bf16, b * ROWS, (b + 1) * ROWS < M ? (b + 1) * ROWS : M, K, levels, fine_above, a,
                          a_fine, xd, xs, xo, need);
    } else {
        quantize_rows(x, x_bf16, 0, M, K, levels, fine_above, a, a_fine, xd, xs, xo, need);
    }
    /* A q4 tile's codes, unpacked once per tile for many blocks of rows: storing them costs more
     * than unpacking again up to about 8 blocks (measured: +10% at 2-4, even at 8, -8% at 64). */
    uint8_t *spare = NULL;
    if (q4 && M > UNPACK_ONCE_ROWS && !(spare = aligned_alloc(64, (size_t)(threads * groups * TILE * GROUP)))) {
        free(a);
        return NO_MEMORY;
    }
    /* Tiles go to threads in chunks as they free up, so that a thread held up (another process on
     * its core) does not hold up the call; a call of one block of rows is too short to share out
     * finer than the threads. Guided: each chunk is a share of the tiles left, down to `chunk`, so
     * that a thread first streams through a long run of weights, which the hardware prefetcher
     * follows, and only the last tiles go out in small pieces (decode steps of 16 and 32 rows
     * 12.4 / 20.1 -> 11.7 / 19.5 ms against equal chunks throughout; prefill unchanged). */
    const int64_t tiles = N / TILE, even = (tiles + threads - 1) / threads;
    const int64_t chunk = M <= ROWS ? even : tiles / (8 * threads) > 1 ? tiles / (8 * threads) : 1;
    /* q4 is tested inside the parallel loop: OpenMP moves its body into a function of its own that
     * receives captured values at run time, so a test outside would leave it a variable there. */
#pragma omp parallel for schedule(guided, chunk) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        if (q4)
            tile_rows(1, t, codes, wd16, wm16, a, a_fine, xd, xs, xo, need, M, K, N, out, out_form,
                      spare ? spare + (int64_t)omp_get_thread_num() * groups * TILE * GROUP : NULL);
        else
            tile_rows(0, t, codes, wd16, NULL, a, a_fine, xd, xs, xo, need, M, K, N, out, out_form, NULL);
    }
    free(spare);
    free(a);
    return OK;
}

/* y[M, N] = x[M, K] @ w[N, K].T, w in the q4 layout (codes [N / 16][K / 32][256] bytes, wd16 and
 * wm16 fp16 [N / 16][K / 32][16]). x is bf16 when x_bf16 says so, fp32 otherwise; y is stored as
 * out_form says (OUT_FP32, OUT_BF16 or OUT_BF16_AS_FP32); x is quantised to one int8 level, or with
 * levels = 2 to a second one in its outlier groups (see quantize_rows); `threads` OpenMP threads. */
int forge_q4_linear(const void *x, int x_bf16, int64_t M, int64_t K, int64_t N, const uint8_t *codes,
                    const uint16_t *wd16, const uint16_t *wm16, void *out, int out_form, int levels,
                    float fine_above, int threads) {
    return linear(1, x, x_bf16, M, K, N, codes, wd16, wm16, out, out_form, levels, fine_above, threads);
}

/* As forge_q4_linear, w in the q8 layout (codes [N / 16][K / 32][512] bytes, wd16). */
int forge_q8_linear(const void *x, int x_bf16, int64_t M, int64_t K, int64_t N, const uint8_t *codes,
                    const uint16_t *wd16, void *out, int out_form, int levels, float fine_above, int threads) {
    return linear(0, x, x_bf16, M, K, N, codes, wd16, NULL, out, out_form, levels, fine_above, threads);
}
