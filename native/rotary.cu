// Rotary position embedding in place, Hugging Face "rotate half" layout, as
// forge_service/layers/rotary.py: cos/sin tables are [max_positions, head_dim] float32 with the
// two halves equal; out[i] = x[i] cos[i] - x[i + h] sin[i], out[i + h] = x[i + h] cos[i + h] + x[i] sin[i + h].
#include "common.cuh"

namespace forge {

// q: [tokens, num_q_heads, head_dim] (token stride q_stride, head stride head_dim), k likewise with
// num_k_heads; positions: [tokens] int64. One CTA per token; threads walk (head, pair) items.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
rotary_kernel(T* __restrict__ q, T* __restrict__ k, const long long* __restrict__ positions,
              const float* __restrict__ cos, const float* __restrict__ sin, int num_q_heads,
              int num_k_heads, int head_dim, long long q_stride, long long k_stride) {
  const int token = blockIdx.x;
  const int half = head_dim / 2;
  const long long pos = positions[token];
  const float* c = cos + pos * head_dim;
  const float* s = sin + pos * head_dim;
  const int items = (num_q_heads + num_k_heads) * half;
  for (int it = threadIdx.x; it < items; it += BLOCK) {
    const int head = it / half, i = it % half;
    T* x = head < num_q_heads ? q + token * q_stride + head * head_dim
                              : k + token * k_stride + (head - num_q_heads) * head_dim;
    const float lo = to_float(x[i]), hi = to_float(x[i + half]);
    x[i] = from_float<T>(lo * c[i] - hi * s[i]);
    x[i + half] = from_float<T>(hi * c[i + half] + lo * s[i + half]);
  }
}

}  // namespace forge
