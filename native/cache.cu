// Writes this step's K and V into the paged cache by slot mapping. The cache of one layer is
// [num_blocks * block_size, num_kv_heads, head_dim]: slot s holds one token's heads contiguously.
#include "common.cuh"

namespace forge {

// k, v: [tokens, num_kv_heads * head_dim] rows (token strides k_stride, v_stride);
// slot_mapping: [tokens] int64, negative = skip (padding rows of a captured graph).
// One CTA per token; `row` = num_kv_heads * head_dim, a multiple of Vec<T>::kSize.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
write_kv_kernel(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ k,
                const T* __restrict__ v, const long long* __restrict__ slot_mapping, int row,
                long long k_stride, long long v_stride) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  constexpr int kV = Vec<T>::kSize;
  const uint4* ks = reinterpret_cast<const uint4*>(k + blockIdx.x * k_stride);
  const uint4* vs = reinterpret_cast<const uint4*>(v + blockIdx.x * v_stride);
  uint4* kd = reinterpret_cast<uint4*>(k_cache + slot * row);
  uint4* vd = reinterpret_cast<uint4*>(v_cache + slot * row);
  for (int i = threadIdx.x; i < row / kV; i += BLOCK) {
    const uint4 kv = ks[i], vv = vs[i];
    kd[i] = kv;
    vd[i] = vv;
  }
}

}  // namespace forge
