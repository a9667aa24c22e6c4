// RMSNorm and fused residual-add + RMSNorm with Hugging Face Llama numerics: normalise in fp32,
// round to the weight's dtype, then scale by the weight in that dtype.
// One CTA per row; each thread walks the row in chunks of 8 elements (16-byte accesses).
#include "common.cuh"

namespace forge {

// out[c..c+8) = w * T(v * inv) for each chunk of the row this thread owns.
template <typename TIn, typename T, int BLOCK>
__device__ __forceinline__ void write_normalized(T* __restrict__ dst, const TIn* __restrict__ row,
                                                 const T* __restrict__ w, int d, float inv) {
  for (int c = threadIdx.x * 8; c < d; c += BLOCK * 8) {
    float v[8], g[8];
    load8(row + c, v);
    load8(w + c, g);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = g[i] * round_to<T>(v[i] * inv);
    store8(dst + c, v);
  }
}

// Writes out[row] = w * T(x * rsqrt(mean(x^2) + eps)). x: [rows, d] (row stride x_stride),
// w: [d], out: [rows, d] (row stride out_stride); d % 8 == 0.
template <typename TIn, typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
rms_norm_kernel(T* __restrict__ out, const TIn* __restrict__ x, const T* __restrict__ w, int d,
                long long x_stride, long long out_stride, float eps) {
  __shared__ float scratch[32];
  const TIn* row = x + blockIdx.x * x_stride;
  float sq = 0.f;
  for (int c = threadIdx.x * 8; c < d; c += BLOCK * 8) {
    float v[8];
    load8(row + c, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) sq += v[i] * v[i];
  }
  const float inv = rsqrtf(block_sum<BLOCK>(sq, scratch) / d + eps);
  write_normalized<TIn, T, BLOCK>(out + blockIdx.x * out_stride, row, w, d, inv);
}

// residual[row] += delta[row] (rounded to TRes, as `residual + delta` would be), then
// out[row] = rms_norm(residual[row]). residual: [rows, d] contiguous; delta, out: [rows, d].
template <typename TRes, typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
add_rms_norm_kernel(T* __restrict__ out, TRes* __restrict__ residual, const T* __restrict__ delta,
                    const T* __restrict__ w, int d, long long delta_stride, long long out_stride, float eps) {
  __shared__ float scratch[32];
  TRes* row = residual + blockIdx.x * (long long)d;
  const T* add = delta + blockIdx.x * delta_stride;
  float sq = 0.f;
  for (int c = threadIdx.x * 8; c < d; c += BLOCK * 8) {
    float r[8], a[8];
    load8(row + c, r);
    load8(add + c, a);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      r[i] = round_to<TRes>(r[i] + a[i]);
      sq += r[i] * r[i];
    }
    store8(row + c, r);
  }
  const float inv = rsqrtf(block_sum<BLOCK>(sq, scratch) / d + eps);
  // Each thread re-reads only the chunks it wrote itself: no barrier is needed for them.
  write_normalized<TRes, T, BLOCK>(out + blockIdx.x * out_stride, row, w, d, inv);
}

}  // namespace forge
