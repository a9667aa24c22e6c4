// Prefill attention over the paged cache for a varlen batch of chunks (each chunk's own K/V
// already written to the cache), causal within the chunk and over its cached context.
// Tensor cores through WMMA (16x16x16, fp32 accumulate); 16-bit dtypes only.
//
// A CTA takes one tile of a chunk for one KV head: kRows = 64 rows of (token, query head)
// pairs, token-major, so the GROUP heads sharing the KV head share every K/V tile load
// (kTokens = 64 / GROUP tokens per tile). Each of the 4 warps owns 16 rows. Per key tile:
//   S = Q K^T (WMMA -> shared), masked online softmax on the warp's own rows (P in shared,
//   O rows rescaled in shared), O += P V (WMMA, O loaded from and stored back to shared).
// WMMA's accumulator layout is opaque, which is why O lives in shared memory.
#include <mma.h>

#include "common.cuh"

namespace forge {

constexpr int kRows = 64;
constexpr int kWarps = 4;

template <typename T, int HEAD_DIM, int BLOCK_N>
struct PrefillSmem {
  // Row pitches padded by 16 bytes against bank conflicts; every WMMA tile stays 32-byte aligned.
  static constexpr int kLdX = HEAD_DIM + 16 / sizeof(T);  // Q, K, V: [rows, HEAD_DIM] of T
  static constexpr int kLdS = BLOCK_N + 4;                // S: [kRows, BLOCK_N] float
  static constexpr int kLdP = BLOCK_N + 8;                // P: [kRows, BLOCK_N] of T
  static constexpr int kLdO = HEAD_DIM + 4;               // O: [kRows, HEAD_DIM] float
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kRows * kLdX * sizeof(T);
  static constexpr int kV = kK + BLOCK_N * kLdX * sizeof(T);
  static constexpr int kS = kV + BLOCK_N * kLdX * sizeof(T);
  static constexpr int kP = kS + kRows * kLdS * sizeof(float);
  static constexpr int kO = kP + kRows * kLdP * sizeof(T);
  static constexpr int kBytes = kO + kRows * kLdO * sizeof(float);
};

// forge_service/backends/cuda/prefill_attention.py computes the same kBytes for the launch.

// Copies rows [0, n) of a [count, HEAD_DIM] tile into shared memory, zero-filling rows >= valid.
// `src(r)` gives row r's global address.
template <typename T, int HEAD_DIM, typename Src>
__device__ __forceinline__ void load_tile(T* dst, int ld, int count, int valid, Src src) {
  constexpr int kV = Vec<T>::kSize;
  constexpr int kPerRow = HEAD_DIM / kV;
  for (int i = threadIdx.x; i < count * kPerRow; i += kWarps * 32) {
    const int r = i / kPerRow, c = (i % kPerRow) * kV;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < valid) v = *reinterpret_cast<const uint4*>(src(r) + c);
    *reinterpret_cast<uint4*>(dst + r * ld + c) = v;
  }
}

template <typename T, int HEAD_DIM, int BLOCK_N>
__device__ __forceinline__ void scores(const T* sq, const T* sk, float* ss, int warp) {
  using namespace nvcuda;
  using L = PrefillSmem<T, HEAD_DIM, BLOCK_N>;
#pragma unroll
  for (int n = 0; n < BLOCK_N / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int k = 0; k < HEAD_DIM / 16; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;  // K rows = columns of K^T
      wmma::load_matrix_sync(a, sq + warp * 16 * L::kLdX + k * 16, L::kLdX);
      wmma::load_matrix_sync(b, sk + n * 16 * L::kLdX + k * 16, L::kLdX);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(ss + warp * 16 * L::kLdS + n * 16, acc, L::kLdS, wmma::mem_row_major);
  }
}

template <typename T, int HEAD_DIM, int BLOCK_N>
__device__ __forceinline__ void accumulate_pv(const T* sp, const T* sv, float* so, int warp) {
  using namespace nvcuda;
  using L = PrefillSmem<T, HEAD_DIM, BLOCK_N>;
#pragma unroll
  for (int n = 0; n < HEAD_DIM / 16; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    float* o = so + warp * 16 * L::kLdO + n * 16;
    wmma::load_matrix_sync(acc, o, L::kLdO, wmma::mem_row_major);
#pragma unroll
    for (int k = 0; k < BLOCK_N / 16; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
      wmma::load_matrix_sync(a, sp + warp * 16 * L::kLdP + k * 16, L::kLdP);
      wmma::load_matrix_sync(b, sv + k * 16 * L::kLdX + n * 16, L::kLdX);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(o, acc, L::kLdO, wmma::mem_row_major);
  }
}

// Online softmax over one key tile for this warp's 16 rows: two lanes per row, each lane
// taking half of the tile's columns and half of the row's output dimensions.
template <typename T, int HEAD_DIM, int BLOCK_N, int GROUP>
__device__ __forceinline__ void softmax_tile(const float* ss, T* sp, float* so, float& m, float& l,
                                             int warp, int key0, int kv_end, int first_pos, int q_len,
                                             int tile_token0, float scale_log2) {
  using L = PrefillSmem<T, HEAD_DIM, BLOCK_N>;
  const int lane = threadIdx.x & 31;
  const int r = warp * 16 + lane / 2, part = lane & 1;
  const int token = tile_token0 + r / GROUP;
  // The last row of a tile can be padding when GROUP does not divide kRows.
  const bool real = r < (kRows / GROUP) * GROUP && token < q_len;
  const int pos = first_pos + token;  // this query's position: it sees keys 0..pos
  constexpr int kHalfN = BLOCK_N / 2;
  float s[kHalfN];
  float tile_max = neg_inf();
#pragma unroll
  for (int j = 0; j < kHalfN; ++j) {
    const int c = part * kHalfN + j, t = key0 + c;
    s[j] = (real && t <= pos && t < kv_end) ? ss[r * L::kLdS + c] * scale_log2 : neg_inf();
    tile_max = fmaxf(tile_max, s[j]);
  }
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  const float m_new = fmaxf(m, tile_max);
  const float corr = rescale(m, m_new);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kHalfN; ++j) {
    const float p = rescale(s[j], m_new);
    sum += p;
    sp[r * L::kLdP + part * kHalfN + j] = from_float<T>(p);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  l = l * corr + sum;
  m = m_new;
  if (corr != 1.f) {  // once a row's maximum settles, most tiles leave O as it is
    for (int d = part * (HEAD_DIM / 2); d < (part + 1) * (HEAD_DIM / 2); ++d) so[r * L::kLdO + d] *= corr;
  }
}

// out, q: [tokens, H * HEAD_DIM] rows (strides out_stride, q_stride); caches as decode.
// Per chunk c: seq_q_start[c] (first row in q), seq_q_len[c], seq_ctx_len[c] (context after the
// chunk), block_tables[c * table_stride ...]. tiles: [num_tiles, 2] = (chunk, first token of the
// tile within the chunk), kTokens = 64 / GROUP tokens per tile. grid (num_tiles, num_kv_heads).
template <typename T, int HEAD_DIM, int GROUP, int BLOCK_N>
__global__ void __launch_bounds__(kWarps * 32, 2)
paged_prefill_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                     const T* __restrict__ v_cache, const int* __restrict__ block_tables,
                     const int* __restrict__ seq_q_start, const int* __restrict__ seq_q_len,
                     const int* __restrict__ seq_ctx_len, const int* __restrict__ tiles, int table_stride,
                     int block_size, int num_kv_heads, long long q_stride, long long out_stride, float scale_log2) {
  using L = PrefillSmem<T, HEAD_DIM, BLOCK_N>;
  constexpr int kTokens = kRows / GROUP;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sq = reinterpret_cast<T*>(smem + L::kQ);
  T* sk = reinterpret_cast<T*>(smem + L::kK);
  T* sv = reinterpret_cast<T*>(smem + L::kV);
  float* ss = reinterpret_cast<float*>(smem + L::kS);
  T* sp = reinterpret_cast<T*>(smem + L::kP);
  float* so = reinterpret_cast<float*>(smem + L::kO);

  const int chunk = tiles[2 * blockIdx.x], token0 = tiles[2 * blockIdx.x + 1];
  const int kv_head = blockIdx.y, num_heads = num_kv_heads * GROUP;
  const int q_len = seq_q_len[chunk], ctx = seq_ctx_len[chunk], row0 = seq_q_start[chunk];
  const int first_pos = ctx - q_len;
  const int tokens = min(kTokens, q_len - token0);
  const int* table = block_tables + chunk * (long long)table_stride;
  const int warp = threadIdx.x >> 5;

  load_tile<T, HEAD_DIM>(sq, L::kLdX, kRows, tokens * GROUP, [&](int r) {
    return q + (row0 + token0 + r / GROUP) * q_stride + (kv_head * GROUP + r % GROUP) * HEAD_DIM;
  });
  for (int i = threadIdx.x; i < kRows * L::kLdO; i += kWarps * 32) so[i] = 0.f;
  float m = neg_inf(), l = 0.f;
  const int kv_end = first_pos + token0 + tokens;  // the tile's last query sees keys < kv_end
  for (int key0 = 0; key0 < kv_end; key0 += BLOCK_N) {
    const int valid = min(BLOCK_N, kv_end - key0);
    auto row_of = [&](const T* cache) {
      return [=](int r) {
        const int t = key0 + r;
        const long long slot = (long long)table[t / block_size] * block_size + t % block_size;
        return cache + (slot * num_kv_heads + kv_head) * HEAD_DIM;
      };
    };
    __syncthreads();  // the previous tile's K/V are no longer read
    load_tile<T, HEAD_DIM>(sk, L::kLdX, BLOCK_N, valid, row_of(k_cache));
    load_tile<T, HEAD_DIM>(sv, L::kLdX, BLOCK_N, valid, row_of(v_cache));
    __syncthreads();
    scores<T, HEAD_DIM, BLOCK_N>(sq, sk, ss, warp);
    __syncwarp();
    softmax_tile<T, HEAD_DIM, BLOCK_N, GROUP>(ss, sp, so, m, l, warp, key0, kv_end, first_pos, q_len, token0,
                                              scale_log2);
    __syncwarp();
    accumulate_pv<T, HEAD_DIM, BLOCK_N>(sp, sv, so, warp);
    __syncwarp();
  }
  // Each row's two lanes write half of its dimensions.
  const int lane = threadIdx.x & 31;
  const int r = warp * 16 + lane / 2, part = lane & 1;
  if (r < tokens * GROUP) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* dst = out + (row0 + token0 + r / GROUP) * out_stride + (kv_head * GROUP + r % GROUP) * HEAD_DIM;
    for (int d = part * (HEAD_DIM / 2); d < (part + 1) * (HEAD_DIM / 2); ++d) {
      dst[d] = from_float<T>(so[r * L::kLdO + d] * inv);
    }
  }
  (void)num_heads;
}

}  // namespace forge
