// Attention dropout: which entries of P are kept, as a pure function of (rng state, batch*head, row, col).
// Plain CUDA (no CuTe), so the mask kernel that tests read it back with compiles in seconds.
//
// Randomness: Philox-4x32 with 10 rounds, keyed by the 64-bit seed of the call's rng state (two int64
// values torch's generator wrote on the device, see flashgen/interface.py). One Philox call yields four
// 32-bit words = sixteen bytes, for the sixteen entries a thread of an m16n8 MMA accumulator holds in one
// 16-row x 32-column block of S (four n8 tiles):
//   counter = (col / 32, row / 16, (bh << 5) | (row % 8) * 4 + (col % 8) / 2, low word of the offset)
//   word    = ((row / 8) % 2) * 2 + col % 2         (the accumulator value index of the entry)
//   byte    = (col / 8) % 4                           (which n8 tile of the 32 columns)
//   keep    = byte >= threshold, threshold = round(p * 256)
// Bytes rather than 16-bit values halve the Philox work, which the forward pays between S and P V (NOTES.md);
// the drop probability is then threshold / 256 and kept entries are scaled by 256 / (256 - threshold), so the
// expectation stays exact. The forward and both backward kernels generate exactly these bits from their
// fragments, and Dropout::keep() computes one entry from its coordinates for the mask kernel. Nothing is
// stored per element.
#pragma once

#include <cuda/std/cstdint>

namespace flashgen {
using cuda::std::int64_t;
using cuda::std::uint32_t;
using cuda::std::uint8_t;

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u, kPhiloxW0 = 0x9E3779B9u,
                   kPhiloxW1 = 0xBB67AE85u;

// The ten round keys of a Philox key, computed once per kernel: every thread's key is the same, so the
// compiler can keep them in uniform registers instead of re-adding the Weyl constants in every call.
struct PhiloxKeys {
  uint32_t k0[10], k1[10];
  __device__ __forceinline__ void set(uint32_t key0, uint32_t key1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
      k0[r] = key0 + uint32_t(r) * kPhiloxW0;
      k1[r] = key1 + uint32_t(r) * kPhiloxW1;
    }
  }
};

__device__ __forceinline__ uint4 philox4x32_10(PhiloxKeys const& keys, uint4 c) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = __umulhi(kPhiloxM0, c.x), lo0 = kPhiloxM0 * c.x;
    const uint32_t hi1 = __umulhi(kPhiloxM1, c.z), lo1 = kPhiloxM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ keys.k0[r], lo1, hi0 ^ c.w ^ keys.k1[r], lo0);
  }
  return c;
}

struct Dropout {
  PhiloxKeys key;
  uint32_t offset;
  uint32_t bh_bits;     // (batch * nheads + head) << 5
  uint32_t threshold;   // a byte below it drops the entry
  float rp;             // 256 / (256 - threshold): kept entries are scaled by it
  uint32_t low7_bias;   // keep_flags(): 0x80 - (threshold % 128) in every byte
  uint32_t msb_or;      // keep_flags(): all ones when threshold < 128

  Dropout() = default;
  // rng_state: two int64 on the device (seed, offset), written by torch's generator before the launch.
  __device__ __forceinline__ Dropout(void const* rng_state, int bh, uint32_t threshold_, float rp_) {
    const uint4 s = *static_cast<uint4 const*>(rng_state);
    key.set(s.x, s.y);
    offset = s.z;
    bh_bits = uint32_t(bh) << 5;
    threshold = threshold_;
    rp = rp_;
    low7_bias = 0x80808080u - (threshold & 0x7fu) * 0x01010101u;
    msb_or = threshold < 128 ? ~0u : 0u;
  }

  __device__ __forceinline__ uint4 counter(int row, int col) const {
    return make_uint4(uint32_t(col) >> 5, uint32_t(row) >> 4, bh_bits | ((row & 7) << 2) | ((col & 7) >> 1), offset);
  }

  // Byte k of w >= threshold, as one 32-bit compare: shift byte k to the top (the bytes below it cannot reach
  // threshold << 24 on their own).
  template <int kByte>
  __device__ __forceinline__ bool keep_byte(uint32_t w) const {
    return (w << (24 - 8 * kByte)) >= (threshold << 24);
  }

  // Keep flags of the four bytes of w, in each byte's msb, in three instructions: the low 7 bits l of a byte
  // compare by a bytewise add that cannot carry (msb of l + 0x80 - threshold % 128 is l >= threshold % 128),
  // then one majority LOP3 with the byte's own msb h: keep = h | that below threshold 128, h & that above.
  __device__ __forceinline__ uint32_t keep_flags(uint32_t w) const {
    const uint32_t x = (w & 0x7f7f7f7fu) + low7_bias;
    return (w & x) | (msb_or & (w | x));
  }

  // One entry, from its coordinates (row: query index, col: key index, both within the sequence).
  __device__ __forceinline__ bool keep(int row, int col) const {
    const uint4 r = philox4x32_10(key, counter(row, col));
    const int word = ((row >> 3) & 1) * 2 + (col & 1);
    const uint32_t w = word == 0 ? r.x : word == 1 ? r.y : word == 2 ? r.z : r.w;
    return ((w >> (8 * ((col >> 3) & 3))) & 0xffu) >= threshold;
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
