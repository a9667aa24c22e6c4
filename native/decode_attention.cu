// Paged decode attention (one query token per sequence), GQA-aware, with a split-KV
// (flash-decoding) path for long contexts and the kernel that reduces the splits.
//
// Grid (num_seqs, num_kv_heads, num_splits); NUM_WARPS warps per CTA, a CTA a part of a row's
// context, cut by the row's length alone (so a row's result does not depend on its batch). A
// CTA serves the GROUP query heads that share one KV head, so every K/V row is read from memory
// once. Each key row
// is split across LANES = HEAD_DIM / Vec lanes (one 16-byte load each), so a warp works on
// 32 / LANES keys at once and UNROLL of those batches are loaded before any is used.
// Scores live in the log2 domain: q is pre-scaled by softmax_scale * log2(e).
#include "common.cuh"

namespace forge {

template <typename T, int HEAD_DIM, int GROUP>
struct DecodeShape {
  static constexpr int kVec = Vec<T>::kSize;
  static constexpr int kLanes = HEAD_DIM / kVec;  // lanes per key row
  static constexpr int kKeysPerWarp = 32 / kLanes;
  static_assert(HEAD_DIM % kVec == 0 && kLanes <= 32 && 32 % kLanes == 0, "unsupported head_dim");
};

// Per-lane state of the online softmax for the GROUP heads: max, sum, and this lane's kVec
// output dimensions.
template <int GROUP, int VEC>
struct SoftmaxState {
  float m[GROUP], l[GROUP], acc[GROUP][VEC];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
      m[h] = neg_inf();
      l[h] = 0.f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[h][e] = 0.f;
    }
  }

  // Merge with the state held by the lane `offset` away (xor), lanes of the same dimensions.
  __device__ __forceinline__ void merge_lane(int offset) {
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[h], offset);
      const float lo = __shfl_xor_sync(0xffffffffu, l[h], offset);
      const float mn = fmaxf(m[h], mo);
      const float a = rescale(m[h], mn), b = rescale(mo, mn);
      l[h] = l[h] * a + lo * b;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[h][e], offset);
        acc[h][e] = acc[h][e] * a + ao * b;
      }
      m[h] = mn;
    }
  }
};

// How a context of `len` positions is cut: parts of per_part positions (the last shorter),
// per_part = max(min_part, ceil(len / max_parts)), so at most max_parts parts; at least one (an
// empty row, a padding row of a graph, writes zeros).
__device__ __forceinline__ void split_parts(int len, int min_part, int max_parts, int& per_part, int& parts) {
  per_part = max(min_part, (len + max_parts - 1) / max_parts);
  parts = max(1, (len + per_part - 1) / per_part);
}

template <typename T, int HEAD_DIM, int GROUP, int NUM_WARPS, int UNROLL>
__device__ __forceinline__ void decode_split(
    SoftmaxState<GROUP, Vec<T>::kSize>& st, const float (&qr)[GROUP][Vec<T>::kSize],
    const T* __restrict__ k_cache, const T* __restrict__ v_cache, const int* __restrict__ table,
    int block_size, int num_kv_heads, int kv_head, int start, int end) {
  using S = DecodeShape<T, HEAD_DIM, GROUP>;
  constexpr int kV = S::kVec;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int key_slot = lane / S::kLanes, dim = (lane % S::kLanes) * kV;
  constexpr int kStep = NUM_WARPS * S::kKeysPerWarp * UNROLL;
  // The loop bound is warp-uniform, so every lane reaches the shuffles below.
  for (int base = start + warp * S::kKeysPerWarp * UNROLL; base < end; base += kStep) {
    float kf[UNROLL][kV], vf[UNROLL][kV];
    bool valid[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * S::kKeysPerWarp + key_slot;
      valid[u] = t < end;
      if (valid[u]) {
        const long long slot = (long long)table[t / block_size] * block_size + t % block_size;
        const long long off = (slot * num_kv_heads + kv_head) * HEAD_DIM + dim;
        load_vec(k_cache + off, kf[u]);
        load_vec(v_cache + off, vf[u]);
      } else {
#pragma unroll
        for (int e = 0; e < kV; ++e) kf[u][e] = vf[u][e] = 0.f;
      }
    }
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
      float s[UNROLL];
      float m_new = st.m[h];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < kV; ++e) d += qr[h][e] * kf[u][e];
#pragma unroll
        for (int o = S::kLanes / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        s[u] = valid[u] ? d : neg_inf();
        m_new = fmaxf(m_new, s[u]);
      }
      const float corr = rescale(st.m[h], m_new);
      st.l[h] *= corr;
#pragma unroll
      for (int e = 0; e < kV; ++e) st.acc[h][e] *= corr;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const float p = rescale(s[u], m_new);
        st.l[h] += p;
#pragma unroll
        for (int e = 0; e < kV; ++e) st.acc[h][e] += p * vf[u][e];
      }
      st.m[h] = m_new;
    }
  }
}

// q: [num_seqs, H, HEAD_DIM] rows of stride q_stride; caches [slots, num_kv_heads, HEAD_DIM];
// block_tables: [num_seqs, table_stride] int32; seq_lens: [num_seqs] int32 (0 = padding row).
// A row of one part writes its result to out ([num_seqs, H * HEAD_DIM], row stride out_stride);
// a row of several has each part write its normalised partial output to part_out
// [num_seqs, H, num_splits, HEAD_DIM] and its log2-sum-exp to part_lse [num_seqs, H, num_splits],
// num_splits being the grid's (at least the longest row's parts).
template <typename T, int HEAD_DIM, int GROUP, int NUM_WARPS, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS * 32)
paged_decode_kernel(T* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_lse,
                    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, int table_stride,
                    int block_size, int num_kv_heads, long long q_stride, long long out_stride,
                    int min_part, int max_parts, float scale_log2) {
  using S = DecodeShape<T, HEAD_DIM, GROUP>;
  constexpr int kV = S::kVec;
  __shared__ float sm_m[NUM_WARPS][GROUP], sm_l[NUM_WARPS][GROUP];
  __shared__ float sm_acc[NUM_WARPS][GROUP][HEAD_DIM];

  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
  const int num_heads = num_kv_heads * GROUP;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int dim = (lane % S::kLanes) * kV;
  // A row's context is cut into parts by its own length alone (split_parts), never by the grid
  // or the other rows, so a row gets the same bits in any batch; the grid's splits only cover
  // the longest row's parts, and a row's splits past its parts have nothing to do.
  const int len = seq_lens[seq];
  int per_part, parts;
  split_parts(len, min_part, max_parts, per_part, parts);
  if (split >= parts) return;  // the whole CTA, before any barrier
  const int start = split * per_part;
  const int end = min(len, start + per_part);

  float qr[GROUP][kV];
#pragma unroll
  for (int h = 0; h < GROUP; ++h) {
    load_vec(q + seq * q_stride + (kv_head * GROUP + h) * HEAD_DIM + dim, qr[h]);
#pragma unroll
    for (int e = 0; e < kV; ++e) qr[h][e] *= scale_log2;
  }
  SoftmaxState<GROUP, kV> st;
  st.init();
  decode_split<T, HEAD_DIM, GROUP, NUM_WARPS, UNROLL>(st, qr, k_cache, v_cache, block_tables + seq * (long long)table_stride,
                                                      block_size, num_kv_heads, kv_head, start, end);
  // Lanes with the same dimensions but other keys hold partial states: merge them.
#pragma unroll
  for (int o = S::kLanes; o < 32; o <<= 1) st.merge_lane(o);
  if (lane < S::kLanes) {
#pragma unroll
    for (int h = 0; h < GROUP; ++h) {
#pragma unroll
      for (int e = 0; e < kV; ++e) sm_acc[warp][h][dim + e] = st.acc[h][e];
      if (lane == 0) {
        sm_m[warp][h] = st.m[h];
        sm_l[warp][h] = st.l[h];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NUM_WARPS * 32) {
    const int h = i / HEAD_DIM, d = i % HEAD_DIM;
    float m = neg_inf();
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, sm_m[w][h]);
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float c = rescale(sm_m[w][h], m);
      l += sm_l[w][h] * c;
      o += sm_acc[w][h][d] * c;
    }
    const float value = l > 0.f ? o / l : 0.f;
    const int head = kv_head * GROUP + h;
    if (parts == 1) {
      out[seq * out_stride + head * HEAD_DIM + d] = from_float<T>(value);
    } else {
      const long long row = ((long long)seq * num_heads + head) * num_splits + split;
      part_out[row * HEAD_DIM + d] = value;
      if (d == 0) part_lse[row] = l > 0.f ? m + log2f(l) : neg_inf();
    }
  }
}

// Combines a row's parts, in order: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
// grid (num_seqs, H). A row of one part was written whole by the decode kernel.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
reduce_splits_kernel(T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_lse,
                     const int* __restrict__ seq_lens, int num_splits, int min_part, int max_parts, int head_dim,
                     long long out_stride) {
  const int seq = blockIdx.x, head = blockIdx.y, num_heads = gridDim.y;
  int per_part, parts;
  split_parts(seq_lens[seq], min_part, max_parts, per_part, parts);
  if (parts == 1) return;
  const long long row = ((long long)seq * num_heads + head) * num_splits;
  float m = neg_inf();
  for (int s = 0; s < parts; ++s) m = fmaxf(m, part_lse[row + s]);
  for (int d = threadIdx.x; d < head_dim; d += BLOCK) {
    float num = 0.f, den = 0.f;
    for (int s = 0; s < parts; ++s) {
      const float w = rescale(part_lse[row + s], m);
      num += w * part_out[(row + s) * head_dim + d];
      den += w;
    }
    out[seq * out_stride + head * head_dim + d] = from_float<T>(den > 0.f ? num / den : 0.f);
  }
}

}  // namespace forge
