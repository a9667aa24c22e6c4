// Sampling on the GPU, one CTA per row: greedy argmax, or temperature, min_p, top_k, top_p and an
// exponential race (argmax of w / E with E ~ Exp(1)), the same selection rules as
// forge_service/sampling/sampler.py. Noise comes from Philox4x32-10 keyed by the row's seed and
// counted by (vocabulary index, step), so a row's token depends only on its own logits, seed and
// step: batch-invariant, and the same after preemption and recompute.
// Thresholds come from radix selection over the float bits of the weights (non-negative floats
// order like their bits); masses are summed in 2^-40 fixed point so that sums are exact and
// independent of the order of atomics.
#include "common.cuh"

namespace forge {

constexpr float kTiny = 1.17549435e-38f;  // FLT_MIN: the smallest weight a kept token may have
constexpr float kMassScale = 1099511627776.f;  // 2^40

struct Philox {
  __device__ static uint4 draw(uint4 c, uint2 k) {
#pragma unroll
    for (int i = 0; i < 10; ++i) {
      const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
      const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
      c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
      k.x += 0x9E3779B9u;
      k.y += 0xBB67AE85u;
    }
    return c;
  }
};

// Exp(1) draw from 24 random bits: u in (0, 1) strictly, so E > 0 and finite.
__device__ __forceinline__ float exponential(unsigned bits) {
  const float u = ((bits >> 8) + 0.5f) * (1.f / 16777216.f);
  return -logf(u);
}

struct Row {
  const float* logits;
  int vocab;
  float max;
  float scale;  // log2(e) / temperature
  __device__ __forceinline__ float weight(int i) const { return exp2f((logits[i] - max) * scale); }
};

// Shared state of a radix selection pass.
template <typename U>
struct Radix {
  U hist[256];
  U above;  // total of the digits above the chosen one
  int digit;
};

// Warp 0 finds the largest digit d whose bucket, with the buckets above, reaches `need`:
// sum(hist[> d]) < need <= sum(hist[>= d]). Lane j scans digits 255 - 8j down to 248 - 8j.
template <typename U>
__device__ __forceinline__ void choose_digit(Radix<U>& r, U need) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x >= 32) return;
  U mine = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) mine += r.hist[255 - 8 * lane - j];
  U incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const U up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  U acc = incl - mine;
  if (acc < need && need <= incl) {
    for (int j = 0; j < 8; ++j) {
      const int d = 255 - 8 * lane - j;
      if (acc + r.hist[d] >= need) {
        r.digit = d;
        r.above = acc;
        break;
      }
      acc += r.hist[d];
    }
  }
  const U total = __shfl_sync(0xffffffffu, incl, 31);
  if (lane == 31 && total < need) {  // cannot happen for valid input; keep the lowest bucket
    r.digit = 0;
    r.above = total - r.hist[0];
  }
}

// After a pass's histogram: fix this digit of the threshold and narrow what the next pass counts.
template <typename U>
__device__ __forceinline__ void next_digit(Radix<U>& r, U& need, unsigned& prefix, unsigned& mask, int shift) {
  choose_digit(r, need);
  __syncthreads();
  need -= r.above;
  prefix |= (unsigned)r.digit << shift;
  mask |= 255u << shift;
  __syncthreads();  // r.digit and r.above are rewritten by the next pass
}

template <int BLOCK>
__device__ __forceinline__ void clear(unsigned* h) { for (int i = threadIdx.x; i < 256; i += BLOCK) h[i] = 0; }
template <int BLOCK>
__device__ __forceinline__ void clear(unsigned long long* h) { for (int i = threadIdx.x; i < 256; i += BLOCK) h[i] = 0; }

// Adds 1 to bin `bin` for each active lane: lanes of one bin add once together (weights cluster
// in few top-digit bins, and same-address shared atomics within a warp serialise).
__device__ __forceinline__ void count(unsigned* hist, unsigned bin) {
  const unsigned peers = __match_any_sync(__activemask(), bin);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned)__popc(peers));
}

__device__ __forceinline__ unsigned long long warp_sum(unsigned long long x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The k-th largest weight (exact), by four 8-bit digit passes counting elements.
template <int BLOCK>
__device__ __forceinline__ float kth_largest(const Row& row, int k, Radix<unsigned>& r) {
  unsigned prefix = 0, mask = 0, need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    clear<BLOCK>(r.hist);
    __syncthreads();
    for (int i = threadIdx.x; i < row.vocab; i += BLOCK) {
      const unsigned b = __float_as_uint(row.weight(i));
      if ((b & mask) != prefix) continue;
      count(r.hist, (b >> shift) & 255u);
    }
    __syncthreads();
    next_digit(r, need, prefix, mask, shift);
  }
  return __uint_as_float(prefix);
}

// The largest t such that the kept weights (>= cutoff) that are >= t hold top_p of the kept mass.
// Same-bin u64 atomics serialise within a warp; fine while top_p rows are few (measure).
template <int BLOCK>
__device__ __forceinline__ float mass_threshold(const Row& row, float cutoff, float top_p, Radix<unsigned long long>& r) {
  using U = unsigned long long;
  U mine = 0;
  for (int i = threadIdx.x; i < row.vocab; i += BLOCK) {
    const float w = row.weight(i);
    if (w >= cutoff) mine += (U)(w * kMassScale);
  }
  mine = warp_sum(mine);
  if ((threadIdx.x & 31) == 0) r.hist[threadIdx.x >> 5] = mine;
  __syncthreads();
  U total = 0;
  for (int w = 0; w < BLOCK / 32; ++w) total += r.hist[w];
  U need = (U)ceil((double)top_p * (double)total);
  need = need < 1 ? 1 : (need > total ? total : need);
  unsigned prefix = 0, mask = 0;
  __syncthreads();
  for (int shift = 24; shift >= 0; shift -= 8) {
    clear<BLOCK>(r.hist);
    __syncthreads();
    for (int i = threadIdx.x; i < row.vocab; i += BLOCK) {
      const float w = row.weight(i);
      const unsigned b = __float_as_uint(w);
      if (w >= cutoff && (b & mask) == prefix) atomicAdd(&r.hist[(b >> shift) & 255u], (U)(w * kMassScale));
    }
    __syncthreads();
    next_digit(r, need, prefix, mask, shift);
  }
  return __uint_as_float(prefix);
}

// Block-wide argmax of (value, index): the largest value, the smallest index among ties.
template <int BLOCK>
__device__ __forceinline__ int block_argmax(float v, int i, float* sv, int* si, float* out_v) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  __syncthreads();
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = lane < BLOCK / 32 ? sv[lane] : neg_inf();
    i = lane < BLOCK / 32 ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    if (lane == 0) { sv[0] = v; si[0] = i; }
  }
  __syncthreads();
  if (out_v) *out_v = sv[0];
  return si[0];
}

// logits: [rows, vocab] float32 (row stride `stride`); temperature <= 0 means greedy;
// top_k <= 0 or >= vocab, top_p >= 1, min_p <= 0 disable those filters. out: [rows] int64.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
sample_kernel(long long* __restrict__ out, const float* __restrict__ logits, int vocab, long long stride,
              const float* __restrict__ temperature, const int* __restrict__ top_k,
              const float* __restrict__ top_p, const float* __restrict__ min_p,
              const unsigned long long* __restrict__ seeds, const long long* __restrict__ steps) {
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ Radix<unsigned> counts;
  __shared__ Radix<unsigned long long> masses;
  const int b = blockIdx.x;
  Row row{logits + b * stride, vocab, neg_inf(), 0.f};

  float best = neg_inf();
  int best_i = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += BLOCK) {
    const float x = row.logits[i];
    if (x > best) { best = x; best_i = i; }
  }
  const int greedy = block_argmax<BLOCK>(best, best_i, sv, si, &row.max);
  const float temp = temperature[b];
  if (temp <= 0.f) {
    if (threadIdx.x == 0) out[b] = greedy;
    return;
  }
  row.scale = kLog2e / temp;

  float cutoff = kTiny;  // tokens with smaller weights are dropped
  if (min_p[b] > 0.f) cutoff = fmaxf(cutoff, min_p[b]);  // the largest weight is 1
  const int k = top_k[b];
  if (k > 0 && k < vocab) cutoff = fmaxf(cutoff, kth_largest<BLOCK>(row, k, counts));
  if (top_p[b] < 1.f) cutoff = fmaxf(cutoff, mass_threshold<BLOCK>(row, cutoff, top_p[b], masses));

  const unsigned long long seed = seeds[b];
  const unsigned long long step = (unsigned long long)steps[b];
  const uint2 key = make_uint2((unsigned)seed, (unsigned)(seed >> 32));
  float win = -1.f;
  int win_i = 0x7fffffff;
  for (int g = threadIdx.x; g * 4 < vocab; g += BLOCK) {
    const uint4 bits = Philox::draw(make_uint4((unsigned)g, 0u, (unsigned)step, (unsigned)(step >> 32)), key);
    const unsigned draws[4] = {bits.x, bits.y, bits.z, bits.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // fully unrolled: draws[j] stays in a register
      const int i = 4 * g + j;
      const float w = i < vocab ? row.weight(i) : 0.f;
      if (w >= cutoff) {
        const float race = w / exponential(draws[j]);
        if (race > win) { win = race; win_i = i; }
      }
    }
  }
  const int chosen = block_argmax<BLOCK>(win, win_i, sv, si, nullptr);
  if (threadIdx.x == 0) out[b] = chosen;
}

}  // namespace forge
