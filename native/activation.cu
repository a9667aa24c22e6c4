// SiLU-and-multiply over a fused gate/up projection: out = silu(gate) * up, rounded as torch
// rounds `F.silu(gate) * up` in T (silu to T, then the product to T).
#include "common.cuh"

namespace forge {

// x: [rows, 2 * f] (gate then up; row stride x_stride), out: [rows, f] contiguous; f % 8 == 0.
// grid: (rows, ceil(f / (8 * BLOCK))).
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int f, long long x_stride) {
  const int c = (blockIdx.y * BLOCK + threadIdx.x) * 8;
  if (c >= f) return;
  const T* row = x + blockIdx.x * x_stride;
  float g[8], u[8];
  load8(row + c, g);
  load8(row + f + c, u);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float silu = round_to<T>(g[i] / (1.f + expf(-g[i])));
    g[i] = silu * u[i];
  }
  store8(out + blockIdx.x * (long long)f + c, g);
}

}  // namespace forge
