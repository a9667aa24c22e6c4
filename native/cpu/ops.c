/* The bf16 path's elementwise ops and its paged attention (decode and prefill) for the CPU backend (AVX-512).
 *
 * At one token a step, each of these is a few microseconds of arithmetic behind tens of
 * microseconds of torch dispatch (an RMSNorm is eight torch ops, decode attention about fifteen);
 * here each is one call. They keep the torch code's roundings (HF numerics): a product or sum of
 * bf16 tensors is rounded to bf16 where torch rounds it, and the residual stream stays fp32.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 round_bf16(__m512 y) {  /* to the nearest bf16, ties to even, kept as fp32 */
    __m512i u = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline void store_bf16(uint16_t *p, __m512 y) {
    const __m512i u = _mm512_castps_si512(round_bf16(y));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

static inline __m512 exp16(__m512 x) {  /* e^x, about 1 ulp: 2^n e^r with |r| <= ln2 / 2 */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Rows are independent in the elementwise ops below: OpenMP over rows where there are enough of
 * them to pay for waking the threads (a prefill chunk), one thread for a decode step's few. */
#define PARALLEL_ROWS 32

/* residual [T, D] fp32 += delta (bf16, may be NULL); out [T, D] bf16 = weight * bf16(residual / rms).
 * D % 16 == 0. */
void forge_add_rms_norm(float *residual, const uint16_t *delta, const uint16_t *weight, uint16_t *out, int64_t T,
                        int64_t D, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        float *x = residual + t * D;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            if (delta) {
                v = _mm512_add_ps(v, bf16x16(delta + t * D + i));
                _mm512_storeu_ps(x + i, v);
            }
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)D + eps));
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 normed = round_bf16(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
            store_bf16(out + t * D + i, _mm512_mul_ps(normed, bf16x16(weight + i)));
        }
    }
}

/* The final norm of the rows that need logits: for each i < N, v = x[rows[i]] (fp32, x [T, D]) +
 * delta[rows[i]] (bf16; none when delta is NULL), rounded as torch's `x + delta`; h[i] = weight *
 * (v / rms(v)) in fp32, as torch_ref.rms_norm with an fp32 weight rounds it, and h_low[i] = h[i]
 * rounded to bf16. x is not written. D % 16 == 0. Returns 1, writing nothing, if a row is not in
 * 0 .. T - 1. One thread: a step's few rows, where the torch ops cost ~10 us each. */
int forge_final_norm(const float *x, const uint16_t *delta, int64_t T, const int64_t *rows, int64_t N, int64_t D,
                     const float *weight, float eps, float *h, uint16_t *h_low) {
    for (int64_t i = 0; i < N; i++)
        if (rows[i] < 0 || rows[i] >= T) return 1;
    for (int64_t i = 0; i < N; i++) {
        const float *xr = x + rows[i] * D;
        const uint16_t *dr = delta ? delta + rows[i] * D : NULL;
        float *hr = h + i * D;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t j = 0; j < D; j += 16) {
            __m512 v = _mm512_loadu_ps(xr + j);
            if (dr) v = _mm512_add_ps(v, bf16x16(dr + j));
            _mm512_storeu_ps(hr + j, v);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)D + eps));
        for (int64_t j = 0; j < D; j += 16) {
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(weight + j), _mm512_mul_ps(_mm512_loadu_ps(hr + j), inv));
            _mm512_storeu_ps(hr + j, y);
            store_bf16(h_low + i * D + j, y);
        }
    }
    return 0;
}

/* gate_up [T, 2F] bf16 -> out [T, F] bf16 = bf16(silu(gate)) * up. F % 16 == 0. */
void forge_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t F, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *gate = gate_up + t * 2 * F, *up = gate + F;
        for (int64_t i = 0; i < F; i += 16) {
            const __m512 g = bf16x16(gate + i);
            const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                          exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            store_bf16(out + t * F + i, _mm512_mul_ps(silu, bf16x16(up + i)));
        }
    }
}

/* Rotate `heads` heads of hd values in place, rows `stride` apart: HF rotate-half with bf16 tables
 * cos, sin [T, hd]: x * cos + rotate_half(x) * sin, each product rounded to bf16. hd % 32 == 0. */
void forge_rotary(uint16_t *x, int64_t T, int64_t heads, int64_t hd, int64_t stride, const uint16_t *cos,
                  const uint16_t *sin, int threads) {
    const int64_t half = hd / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + t * stride + h * hd;
            for (int64_t i = 0; i < half; i += 16) {
                const __m512 a = bf16x16(v + i), b = bf16x16(v + half + i);
                const __m512 c0 = bf16x16(cos + t * hd + i), s0 = bf16x16(sin + t * hd + i);
                const __m512 c1 = bf16x16(cos + t * hd + half + i), s1 = bf16x16(sin + t * hd + half + i);
                const __m512 first = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, c0)),
                                                   round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b), s0)));
                const __m512 second = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, c1)), round_bf16(_mm512_mul_ps(a, s1)));
                store_bf16(v + i, first);
                store_bf16(v + half + i, second);
            }
        }
    }
}

/* x[t, :N] += bias for T rows `stride` apart, each sum rounded to bf16 as torch rounds a bf16 sum
 * (Qwen2's q, k, v biases on the fresh projection). N % 16 == 0. */
void forge_add_bias(uint16_t *x, int64_t T, int64_t N, int64_t stride, const uint16_t *bias, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < N; i += 16)
            store_bf16(x + t * stride + i, _mm512_add_ps(bf16x16(x + t * stride + i), bf16x16(bias + i)));
}

/* LoRA: y[m, :N] += Bt.T @ (A @ x[m, :K]) for each of the `count` rows m listed in `rows`, in fp32
 * (A [R, K], Bt [R, N], the adapter's scale folded into Bt), a bf16 y rounded once after the sum.
 * Each row is computed on its own in one fixed order, so its result does not depend on the rows
 * beside it. x and y are bf16 or fp32 (the flags), rows `x_stride` / `y_stride` apart;
 * K % 16 == 0, N % 16 == 0, R <= MAX_LORA_RANK. */
#define MAX_LORA_RANK 256
#define LORA_ROWS 4  /* rows that share each pass over an adapter's weights */
#define LORA_RANKS 4  /* rows of A that share each load of x */

static inline __m512 load_either(const void *p, int bf16, int64_t at) {
    return bf16 ? bf16x16((const uint16_t *)p + at) : _mm512_loadu_ps((const float *)p + at);
}

/* Rows rows[0 .. nb - 1] (nb <= LORA_ROWS) of one call: each weight vector read once serves them all,
 * while each row's own sums run in the same order as alone (its result does not depend on nb). */
static inline __attribute__((always_inline)) void lora_rows(const void *x, int x_bf16, int64_t x_stride,
                                                            const int64_t *rows, const int nb, int64_t K,
                                                            const float *A, int64_t R, const float *Bt, int64_t N,
                                                            void *y, int y_bf16, int64_t y_stride) {
    float t[LORA_ROWS][MAX_LORA_RANK];
    for (int64_t r0 = 0; r0 < R; r0 += LORA_RANKS) {  /* LORA_RANKS rows of A at a time: each x load serves them */
        const int64_t rb = R - r0 < LORA_RANKS ? R - r0 : LORA_RANKS;
        __m512 acc[LORA_ROWS][LORA_RANKS];
        for (int j = 0; j < nb; j++)
            for (int i = 0; i < LORA_RANKS; i++) acc[j][i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 xv[LORA_ROWS];
            for (int j = 0; j < nb; j++) xv[j] = load_either(x, x_bf16, rows[j] * x_stride + k);
#pragma GCC unroll 4
            for (int i = 0; i < LORA_RANKS; i++) {
                if (i >= rb) break;
                const __m512 a = _mm512_loadu_ps(A + (r0 + i) * K + k);
                for (int j = 0; j < nb; j++) acc[j][i] = _mm512_fmadd_ps(xv[j], a, acc[j][i]);
            }
        }
        for (int j = 0; j < nb; j++)
            for (int64_t i = 0; i < rb; i++) t[j][r0 + i] = _mm512_reduce_add_ps(acc[j][i]);
    }
    for (int64_t n = 0; n < N; n += 16) {
        __m512 acc[LORA_ROWS];
        for (int j = 0; j < nb; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t r = 0; r < R; r++) {
            const __m512 b = _mm512_loadu_ps(Bt + r * N + n);
            for (int j = 0; j < nb; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(t[j][r]), b, acc[j]);
        }
        for (int j = 0; j < nb; j++) {
            const int64_t at = rows[j] * y_stride + n;
            const __m512 sum = _mm512_add_ps(load_either(y, y_bf16, at), acc[j]);
            if (y_bf16)
                store_bf16((uint16_t *)y + at, sum);
            else
                _mm512_storeu_ps((float *)y + at, sum);
        }
    }
}

void forge_lora_add(const void *x, int x_bf16, int64_t x_stride, const int64_t *rows, int64_t count, int64_t K,
                    const float *A, int64_t R, const float *Bt, int64_t N, void *y, int y_bf16, int64_t y_stride,
                    int threads) {
    const int64_t blocks = (count + LORA_ROWS - 1) / LORA_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks >= 2)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t *block = rows + b * LORA_ROWS;
        const int64_t nb = count - b * LORA_ROWS < LORA_ROWS ? count - b * LORA_ROWS : LORA_ROWS;
        switch (nb) {  /* a literal row count each, so the accumulators stay in registers */
            case 1: lora_rows(x, x_bf16, x_stride, block, 1, K, A, R, Bt, N, y, y_bf16, y_stride); break;
            case 2: lora_rows(x, x_bf16, x_stride, block, 2, K, A, R, Bt, N, y, y_bf16, y_stride); break;
            case 3: lora_rows(x, x_bf16, x_stride, block, 3, K, A, R, Bt, N, y, y_bf16, y_stride); break;
            default: lora_rows(x, x_bf16, x_stride, block, 4, K, A, R, Bt, N, y, y_bf16, y_stride);
        }
    }
}

/* RMSNorm of each head of hd values in place, rows `stride` apart (Qwen3's q_norm and k_norm):
 * heads [0, split) weighed by `first`, heads [split, heads) by `rest`, with forge_add_rms_norm's
 * roundings (normalised in fp32, rounded to bf16, then scaled and rounded). hd % 16 == 0. */
void forge_head_rms_norm(uint16_t *x, int64_t T, int64_t heads, int64_t split, int64_t hd, int64_t stride,
                         const uint16_t *first, const uint16_t *rest, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T >= PARALLEL_ROWS)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *v = x + t * stride + h * hd;
            const uint16_t *weight = h < split ? first : rest;
            __m512 squares = _mm512_setzero_ps();
            for (int64_t i = 0; i < hd; i += 16) {
                const __m512 a = bf16x16(v + i);
                squares = _mm512_fmadd_ps(a, a, squares);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hd + eps));
            for (int64_t i = 0; i < hd; i += 16) {
                const __m512 normed = round_bf16(_mm512_mul_ps(bf16x16(v + i), inv));
                store_bf16(v + i, _mm512_mul_ps(normed, bf16x16(weight + i)));
            }
        }
    }
}

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

/* Lane i of the result = the sum of v[i]'s lanes (v is clobbered): 16 horizontal sums in 46 ops,
 * where 16 separate reductions take about 128 and a long dependency chain each. */
static inline __m512 sum16(__m512 *v) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)  /* quads 0-1 hold key 2i, quads 2-3 key 2i + 1 */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)  /* quad q holds key 4i + q */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)  /* quad q: lanes 0 and 2 hold key 8i + q, lanes 1 and 3 key 8i + 4 + q */
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    /* lane 4q + r holds key q, 8 + q, 4 + q, 12 + q for r = 0, 1, 2, 3 */
    const __m512 mixed = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, mixed);
}

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
#define AHEAD_BYTES (4 << 20)  /* a decode attention job's keys and values and the next one's, at most */

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

/* G query heads (q: G heads of hd, contiguous) against n keys at `slots` of their shared KV head
 * (rows `row` apart from `off`): out = softmax(scale q.K) V per head, in fp32, rounded to bf16.
 * Each key and value is read and widened once for all G heads. `s` holds G (n + 16) floats of
 * scratch. G and hd are constants where inlined, so queries and accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const uint16_t *q, const uint16_t *k_cache,
                                                          const uint16_t *v_cache, const int64_t *slots, int64_t n,
                                                          int64_t row, int64_t off, const int64_t hd, const int G,
                                                          float scale, float *s, uint16_t *out,
                                                          const int64_t *ahead, int64_t ahead_from, int64_t ahead_to) {
    const int64_t pairs = hd / 32, stride = n + 16, chunks = (n + 15) / 16;
    bf16_pairs qv[MAX_GROUP][MAX_PAIRS];
    for (int g = 0; g < G; g++)
        for (int64_t c = 0; c < pairs; c++) qv[g][c] = load_pairs(q + g * hd + 32 * c);
    __m512 top[MAX_GROUP];
    for (int g = 0; g < G; g++) top[g] = _mm512_set1_ps(-INFINITY);
    for (int64_t l0 = 0; l0 < n; l0 += 16) {  /* scores, 16 keys at a time */
        const int64_t count = n - l0 < 16 ? n - l0 : 16;
        /* Ahead of use, as slots come in blocks scattered over the cache, which the hardware
         * prefetcher does not follow: this KV head's part of the next 16 keys to L1; and to L2 the
         * next 16 keys' values and the 16 keys after those. The first KV head of a row (off 0)
         * fetches the whole rows, so that the passes of the row's other KV heads find them in L2. */
        const int64_t bytes = off == 0 ? 2 * row : 2 * hd;
        for (int64_t l = l0 + 16; l < n && l < l0 + 32; l++) {
            for (int64_t b = 0; b < 2 * hd; b += 64)
                _mm_prefetch((const char *)(k_cache + slots[l] * row + off) + b, _MM_HINT_T0);
            for (int64_t b = 0; b < bytes; b += 64)
                _mm_prefetch((const char *)(v_cache + slots[l] * row + off) + b, _MM_HINT_T1);
        }
        for (int64_t l = l0 + 32; l < n && l < l0 + 48; l++)
            for (int64_t b = 0; b < bytes; b += 64)
                _mm_prefetch((const char *)(k_cache + slots[l] * row + off) + b, _MM_HINT_T1);
        if (ahead) {  /* this chunk's share of the next job's keys and values, whole rows, to L2 */
            const int64_t c = l0 / 16, span = ahead_to - ahead_from;
            for (int64_t l = ahead_from + span * c / chunks; l < ahead_from + span * (c + 1) / chunks; l++)
                for (int64_t b = 0; b < 2 * row; b += 64) {
                    _mm_prefetch((const char *)(k_cache + ahead[l] * row) + b, _MM_HINT_T1);
                    _mm_prefetch((const char *)(v_cache + ahead[l] * row) + b, _MM_HINT_T1);
                }
        }
        __m512 dots[MAX_GROUP][16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {  /* past the last key, the last key again (masked off below) */
            const uint16_t *k = k_cache + slots[l0 + (i < count ? i : count - 1)] * row + off;
            bf16_pairs kv[MAX_PAIRS];
            for (int64_t c = 0; c < pairs; c++) kv[c] = load_pairs(k + 32 * c);
            for (int g = 0; g < G; g++) {
                __m512 dot = _mm512_setzero_ps();
                for (int64_t c = 0; c < pairs; c++) dot = dot_pairs(dot, qv[g][c], kv[c]);
                dots[g][i] = dot;
            }
        }
        for (int g = 0; g < G; g++)
            keep_scores(s + g * stride + l0, _mm512_mul_ps(sum16(dots[g]), _mm512_set1_ps(scale)), count, &top[g]);
    }
    float inv[MAX_GROUP];
    for (int g = 0; g < G; g++) inv[g] = normalise(s + g * stride, n, top[g]);
    __m512 acc[MAX_GROUP][2 * MAX_PAIRS];  /* even and odd elements of each 32 */
    for (int g = 0; g < G; g++)
        for (int64_t j = 0; j < 2 * pairs; j++) acc[g][j] = _mm512_setzero_ps();
    weigh(acc, G, s, stride, v_cache, slots, 0, n, row, off, hd);
    for (int g = 0; g < G; g++) store_head(acc[g], inv[g], pairs, out + g * hd);
}

#define ATTEND_HD(G)                                                                                      \
    switch (hd) {                                                                                         \
        case 64: attend(q, k_cache, v_cache, slots, n, row, off, 64, G, scale, s, out, ah, from, to); break; \
        case 128: attend(q, k_cache, v_cache, slots, n, row, off, 128, G, scale, s, out, ah, from, to); break; \
        default: attend(q, k_cache, v_cache, slots, n, row, off, hd, G, scale, s, out, ah, from, to); break; \
    }

/* Query heads first .. last - 1 of one token (q, out: that token's heads 0 ..), against KV head
 * h / (H / Hkv) each: the heads of one KV head together, up to MAX_GROUP at a time, with G and hd
 * fixed at compile time for the common sizes. `s` holds MAX_GROUP (n + 16) floats. */
static void attend_heads(const uint16_t *q0, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots,
                         int64_t n, int64_t H, int64_t Hkv, int64_t hd, int64_t first, int64_t last, float scale,
                         float *s, uint16_t *out0, const int64_t *next, int64_t next_n) {
    const int64_t group = H / Hkv, row = Hkv * hd;
    for (int64_t h = first; h < last;) {
        const int64_t kvh = h / group, end = (kvh + 1) * group < last ? (kvh + 1) * group : last;
        const int64_t count = end - h < MAX_GROUP ? end - h : MAX_GROUP, off = kvh * hd;
        const uint16_t *q = q0 + h * hd;
        uint16_t *out = out0 + h * hd;
        /* The KV heads after the first read from L2 what the first fetched: meanwhile the next
         * job's keys come in, a share for each of them (its first run of query heads). */
        const int later = next && kvh > 0 && h == kvh * group;
        const int64_t *ah = later ? next : NULL;
        const int64_t from = later ? next_n * (kvh - 1) / (Hkv - 1) : 0, to = later ? next_n * kvh / (Hkv - 1) : 0;
        switch (count) {
            case 1: ATTEND_HD(1) break;
            case 2: ATTEND_HD(2) break;
            case 3: ATTEND_HD(3) break;
            default: ATTEND_HD(4) break;
        }
        h += count;
    }
}

static int shapes_ok(int64_t H, int64_t Hkv, int64_t hd) {
    return hd % 32 == 0 && hd <= MAX_HEAD_DIM && Hkv > 0 && H % Hkv == 0;
}

/* One query token per row d against its paged context: out[d, h] = softmax(scale q.K) V, in fp32.
 * q [D, H, hd] bf16 with rows `q_stride` apart; caches [slots, Hkv, hd] bf16; tables [D, W] block
 * ids; lens [D] context lengths; out [D, H, hd]. hd % 32 == 0, hd <= 256. */
int forge_decode_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *tables, int64_t width, const int32_t *lens, int64_t block_size, int64_t D,
                           int64_t H, int64_t Hkv, int64_t hd, float scale, uint16_t *out, int threads) {
    if (!shapes_ok(H, Hkv, hd)) return 1;
    int64_t longest = 0;
    for (int64_t d = 0; d < D; d++) longest = lens[d] > longest ? lens[d] : longest;
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(D * longest));
    float *scores = malloc(sizeof(float) * (size_t)(threads * MAX_GROUP * (longest + 16)));
    int64_t *claim = aligned_alloc(64, (size_t)threads * 64);  /* each run's next job, a cache line each */
    if (!slots || !scores || !claim) {
        free(slots);
        free(scores);
        free(claim);
        return 2;
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t l = 0; l < lens[d]; l++)
            slots[d * longest + l] = tables[d * width + l / block_size] * block_size + l % block_size;
    /* A job is all heads of one sequence, or where that leaves too few jobs to keep every thread
     * busy, a run of consecutive heads of it. Within a job the heads of one KV head run together
     * (attend_heads), and the job reads whole cache rows, where jobs of one KV head each would
     * split every row's cache lines between threads. At 16 sequences of 200 tokens reading is
     * most of the time. */
    int64_t shares = (2 * threads + D - 1) / D;
    shares = shares < 1 ? 1 : shares > H ? H : shares;
    const int64_t per_share = (H + shares - 1) / shares, jobs = D * shares;
    /* Each thread takes the jobs of its own run of consecutive ones, then helps with the others'
     * runs, one job at a time: a thread held up leaves the rest of its run to the others, and the
     * job a thread most likely takes next is the next of its run. While a job's later KV heads
     * compute (their keys and values come from L2, where the first KV head's pass fetched them),
     * the next job's come in from memory, up to AHEAD_BYTES for the two jobs together. With 2
     * threads, 30 layers' attention of 64 sequences of 150 tokens took 12.2-13.0 ms and takes
     * 9.0-9.7; of 32 sequences of 1,000 tokens, 43.4-44.2 -> 33.5-33.6 ms (fetching the next job
     * whole paid even past L2's 1 MB). */
    const int64_t key_bytes = 4 * Hkv * hd;  /* a key's K and V rows, bf16 */
    for (int64_t r = 0; r < threads; r++) claim[8 * r] = r * jobs / threads;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num();
        float *s = scores + t * MAX_GROUP * (longest + 16);
        for (int64_t v = 0; v < threads; v++) {
            const int64_t r = (t + v) % threads, run_end = (r + 1) * jobs / threads;
            int64_t job;
            while ((job = __atomic_fetch_add(&claim[8 * r], 1, __ATOMIC_RELAXED)) < run_end) {
                const int64_t d = job / shares, first = job % shares * per_share;
                const int64_t last = first + per_share < H ? first + per_share : H;
                const int64_t *next = NULL;
                int64_t next_n = 0;
                if (shares == 1 && Hkv > 1 && job + 1 < run_end) {
                    const int64_t room = (AHEAD_BYTES - key_bytes * lens[d]) / key_bytes;
                    next_n = lens[d + 1] < room ? lens[d + 1] : room;
                    next = next_n > 0 ? slots + (d + 1) * longest : NULL;
                }
                attend_heads(q + d * q_stride, k_cache, v_cache, slots + d * longest, lens[d], H, Hkv, hd, first,
                             last, scale, s, out + d * H * hd, next, next_n);
            }
        }
    }
    free(claim);
    free(slots);
    free(scores);
    return 0;
}

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

#define MAX_REFINE 64  /* most leading logits a row refines */

/* Row r's k largest logits (among equal values, the lower index), recomputed as the fp32 dot of
 * h[r] [D] with those rows of the bf16 weight [V, D]: 16 lanes of fused multiply-adds in order over
 * D, then the lanes' sum. logits [N, V] fp32, updated in place; k <= MAX_REFINE and k <= V. A row's
 * results depend on that row alone. The scan compares 16 logits at a time with the k-th best so far,
 * which after the first few hundred lets nearly every vector through untouched. */
void forge_refine_top(float *logits, int64_t N, int64_t V, const uint16_t *weight, const float *h, int64_t D,
                      int64_t k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (N > 1)
    for (int64_t r = 0; r < N; r++) {
        float *row = logits + r * V, best[MAX_REFINE];
        int64_t at[MAX_REFINE], n = 0;
        for (int64_t i0 = 0; i0 < V; i0 += 16) {
            const __mmask16 in = V - i0 >= 16 ? 0xFFFF : (__mmask16)((1u << (V - i0)) - 1);
            __mmask16 m = n < k ? in
                                : _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, row + i0),
                                                          _mm512_set1_ps(best[k - 1]), _CMP_GT_OQ);
            while (m) {
                const int j = __builtin_ctz(m);
                m &= m - 1;
                const float x = row[i0 + j];
                if (n == k && !(x > best[k - 1])) continue;
                int64_t p = n < k ? n++ : k - 1;  /* full: the last one goes */
                for (; p > 0 && best[p - 1] < x; p--) {
                    best[p] = best[p - 1];
                    at[p] = at[p - 1];
                }
                best[p] = x;
                at[p] = i0 + j;
            }
        }
        const float *x = h + r * D;
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *w = weight + at[t] * D;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                const __mmask16 in = D - d >= 16 ? 0xFFFF : (__mmask16)((1u << (D - d)) - 1);
                const __m512 wv = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, w + d)), 16));
                acc = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(in, x + d), acc);
            }
            row[at[t]] = _mm512_reduce_add_ps(acc);
        }
    }
}
