// Attention dropout: which entries of P are kept, as a pure function of (rng state, batch*head, row, col).
// Plain CUDA (no CuTe), so the mask kernel that tests read it back with compiles in seconds.
//
// Randomness: Philox-4x32 with 10 rounds, keyed by the 64-bit seed of the call's rng state (two int64
// values torch's generator wrote on the device, see flashgen/interface.py). One Philox call yields four
// 32-bit words = eight 16-bit values, for the eight entries a thread of an m16n8 MMA accumulator holds in
// one 16 x 16 block of S:
//   counter = (col / 16, row / 16, (bh << 5) | (row % 8) * 4 + (col % 8) / 2, low word of the offset)
//   word    = ((row / 8) % 2) * 2 + col % 2         (the accumulator value index of the entry)
//   half    = (col / 8) % 2                           (low / high 16 bits)
//   keep    = half-word >= threshold, threshold = round(p * 65536)
// The forward and both backward kernels generate exactly these bits from their fragments, and
// Dropout::keep() computes one entry from its coordinates for the mask kernel. Nothing is stored per element.
#pragma once

#include <cuda/std/cstdint>

namespace flashgen {
using cuda::std::int64_t;
using cuda::std::uint32_t;
using cuda::std::uint8_t;

__device__ __forceinline__ uint4 philox4x32_10(uint2 key, uint4 c) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kM0, c.x), lo0 = kM0 * c.x;
    const uint32_t hi1 = __umulhi(kM1, c.z), lo1 = kM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
    key.x += kW0;
    key.y += kW1;
  }
  return c;
}

struct Dropout {
  uint2 key;
  uint32_t offset;
  uint32_t bh_bits;     // (batch * nheads + head) << 5
  uint32_t threshold;   // a 16-bit value below it drops the entry
  float rp;             // 1 / (1 - p): kept entries are scaled by it

  Dropout() = default;
  // rng_state: two int64 on the device (seed, offset), written by torch's generator before the launch.
  __device__ __forceinline__ Dropout(void const* rng_state, int bh, uint32_t threshold_, float rp_) {
    const uint4 s = *static_cast<uint4 const*>(rng_state);
    key = make_uint2(s.x, s.y);
    offset = s.z;
    bh_bits = uint32_t(bh) << 5;
    threshold = threshold_;
    rp = rp_;
  }

  __device__ __forceinline__ uint4 counter(int row, int col) const {
    return make_uint4(uint32_t(col) >> 4, uint32_t(row) >> 4, bh_bits | ((row & 7) << 2) | ((col & 7) >> 1), offset);
  }

  // One entry, from its coordinates (row: query index, col: key index, both within the sequence).
  __device__ __forceinline__ bool keep(int row, int col) const {
    const uint4 r = philox4x32_10(key, counter(row, col));
    const int word = ((row >> 3) & 1) * 2 + (col & 1);
    const uint32_t w = word == 0 ? r.x : word == 1 ? r.y : word == 2 ? r.z : r.w;
    const uint32_t half = (col >> 3) & 1 ? w >> 16 : w & 0xffffu;
    return half >= threshold;
  }
};

// Mask kernel (tests and return_attn_probs): keep[b, h, row, col] as uint8 (1 kept, 0 dropped; 0 outside
// the sequence). Grid (ceil(seqlen_k / kThreads), ceil(seqlen_q / kRowsPerBlock), batch * nheads).
template <int kThreads, int kRowsPerBlock, class Params>
__device__ __forceinline__ void dropout_mask(Params const& p) {
  const int bh = blockIdx.z, bidb = bh / p.nheads, bidh = bh % p.nheads;
  int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  if (p.cu_seqlens_q != nullptr) {
    const int* cu_q = static_cast<const int*>(p.cu_seqlens_q);
    const int* cu_k = static_cast<const int*>(p.cu_seqlens_k);
    seqlen_q = cu_q[bidb + 1] - cu_q[bidb];
    seqlen_k = cu_k[bidb + 1] - cu_k[bidb];
  }
  const Dropout dropout(p.rng_state, bh, p.dropout_threshold, 1.f);
  const int col = blockIdx.x * kThreads + threadIdx.x;
  if (col >= p.seqlen_k) return;
  uint8_t* out = static_cast<uint8_t*>(p.mask) + bidb * p.mask_batch_stride + bidh * p.mask_head_stride + col;
  for (int i = 0; i < kRowsPerBlock; ++i) {
    const int row = blockIdx.y * kRowsPerBlock + i;
    if (row >= p.seqlen_q) break;
    out[row * p.mask_row_stride] = (row < seqlen_q && col < seqlen_k && dropout.keep(row, col)) ? 1 : 0;
  }
}

}  // namespace flashgen
