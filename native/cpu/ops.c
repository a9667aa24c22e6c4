/* The bf16 path's elementwise ops for the CPU backend (AVX-512): the residual add and RMSNorm, SiLU,
 * rotary, biases, LoRA's updates, and the refinement of each row's leading logits. (Attention is in
 * decode_attention.c and prefill_attention.c.)
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

#include "vec.h"

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
