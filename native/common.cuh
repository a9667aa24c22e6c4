// Shared device helpers for Forge's kernels: dtype conversions, 16-byte vector access, reductions.
// Compiled by NVRTC (no host standard library): only builtin types and CUDA headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace forge {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Round through T and back: the value torch would hold after storing x as T.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// Elements of T in one 16-byte access.
template <typename T> struct Vec {
  static constexpr int kSize = 16 / sizeof(T);
};

// 16-byte load of kSize elements of T, widened to float. `p` must be 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[Vec<T>::kSize]) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::kSize; ++i) out[i] = to_float(e[i]);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[Vec<T>::kSize]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::kSize; ++i) e[i] = from_float<T>(in[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// 8 consecutive elements as float (two 16-byte accesses for fp32, one for 16-bit types):
// row kernels walk rows in chunks of 8 so that one code path serves every dtype.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, float (&out)[8]) {
  constexpr int kV = Vec<T>::kSize;
#pragma unroll
  for (int j = 0; j < 8 / kV; ++j) {
    float part[kV];
    load_vec(p + j * kV, part);
#pragma unroll
    for (int i = 0; i < kV; ++i) out[j * kV + i] = part[i];
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ p, const float (&in)[8]) {
  constexpr int kV = Vec<T>::kSize;
#pragma unroll
  for (int j = 0; j < 8 / kV; ++j) {
    float part[kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) part[i] = in[j * kV + i];
    store_vec(p + j * kV, part);
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats; BLOCK % 32 == 0.
template <int BLOCK>
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < BLOCK / 32 ? scratch[lane] : 0.f;
  return warp_sum(x);
}

template <int BLOCK>
__device__ __forceinline__ float block_max(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < BLOCK / 32 ? scratch[lane] : neg_inf();
  return warp_max(x);
}

// Softmax state of one row in the log2 domain: running max m, sum l = sum 2^(s - m).
// Merging two states never forms (-inf) - (-inf): an empty side contributes 0.
__device__ __forceinline__ float rescale(float m_old, float m_new) {
  return m_old == neg_inf() ? 0.f : exp2f(m_old - m_new);
}

}  // namespace forge
