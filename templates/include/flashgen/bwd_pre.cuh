// Backward preprocess (dsum = rowsum(dO * O)) and the sequence bookkeeping every backward kernel shares.
// Plain CUDA: no CuTe, so this kernel compiles in seconds.
#pragma once

#include <cutlass/array.h>
#include <cutlass/numeric_types.h>

namespace flashgen {

// Where one (batch, head) lives: varlen packs sequences along rows (cu_seqlens), fixed length uses batch
// strides. `q_row0` / `k_row0` are the first packed rows (0 for fixed length).
struct BwdSeq {
  int seqlen_q, seqlen_k;
  int64_t q_row0, k_row0;
  bool varlen;

  // cu_k may be null (the preprocess kernel only knows the query side).
  __device__ __forceinline__ BwdSeq(void const* cu_seqlens_q, void const* cu_seqlens_k, int fixed_seqlen_q,
                                    int fixed_seqlen_k, int bidb) {
    varlen = cu_seqlens_q != nullptr;
    bidb_ = bidb;
    q_row0 = k_row0 = 0;
    seqlen_q = fixed_seqlen_q;
    seqlen_k = fixed_seqlen_k;
    if (varlen) {
      const int* cu_q = static_cast<const int*>(cu_seqlens_q);
      q_row0 = cu_q[bidb];
      seqlen_q = cu_q[bidb + 1] - cu_q[bidb];
      if (cu_seqlens_k != nullptr) {
        const int* cu_k = static_cast<const int*>(cu_seqlens_k);
        k_row0 = cu_k[bidb];
        seqlen_k = cu_k[bidb + 1] - cu_k[bidb];
      }
    }
  }
  // Element offset of (bidb, first row) in a tensor with the given batch and row strides.
  __device__ __forceinline__ int64_t q_off(int bidb, int64_t batch_stride, int64_t row_stride) const {
    return varlen ? q_row0 * row_stride : bidb * batch_stride;
  }
  __device__ __forceinline__ int64_t k_off(int bidb, int64_t batch_stride, int64_t row_stride) const {
    return varlen ? k_row0 * row_stride : bidb * batch_stride;
  }
  // First row of this sequence in the fp32 dQ accumulator, whose sequences start on whole kBlockM tiles:
  // varlen rounds (cu_seqlens_q[b] + kBlockM * b) down to a tile, which never overlaps the previous sequence's
  // last tile (the accumulator has total_q + kBlockM * batch rows, rounded up).
  template <int kBlockM>
  __device__ __forceinline__ int64_t dq_accum_row0() const {
    return varlen ? (q_row0 + int64_t(kBlockM) * bidb_) / kBlockM * kBlockM : 0;
  }
  int bidb_;
  // lse and dsum: (batch, heads, seqlen_q) fixed length, (heads, total_q) varlen.
  __device__ __forceinline__ int64_t lse_off(int bidb, int64_t batch_stride) const {
    return varlen ? q_row0 : bidb * batch_stride;
  }
};

// dsum = rowsum(dO * O) in fp32, one row per group of kThreadsPerRow threads (16-byte loads), laid out like lse.
// kThreadsPerRow comes from codegen (BwdPreTraits), which sizes the grid with the same number.
template <class Element, int kHeadDim, int kNThreads, int kThreadsPerRow, class Params>
__device__ __forceinline__ void bwd_pre(Params const& p) {
  static_assert(kThreadsPerRow <= 32 && 32 % kThreadsPerRow == 0, "a row's threads share a warp");
  constexpr int kVec = 8;
  constexpr int kRowsPerBlock = kNThreads / kThreadsPerRow;
  const int bidh = blockIdx.y, bidb = blockIdx.z;
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kThreadsPerRow;
  const int lane = threadIdx.x % kThreadsPerRow;
  const BwdSeq seq(p.cu_seqlens_q, nullptr, p.seqlen_q, 0, bidb);
  float sum = 0.f;
  if (row < seq.seqlen_q) {
    Element const* o = static_cast<Element const*>(p.o) + seq.q_off(bidb, p.o_batch_stride, p.o_row_stride) +
                       bidh * p.o_head_stride + row * p.o_row_stride;
    Element const* d = static_cast<Element const*>(p.dout) + seq.q_off(bidb, p.dout_batch_stride, p.dout_row_stride) +
                       bidh * p.dout_head_stride + row * p.dout_row_stride;
    #pragma unroll
    for (int c = lane * kVec; c < kHeadDim; c += kThreadsPerRow * kVec) {
      if (c < p.head_dim) {
        cutlass::Array<Element, kVec> ov = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(o + c);
        cutlass::Array<Element, kVec> dv = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(d + c);
        #pragma unroll
        for (int i = 0; i < kVec; ++i) sum += float(ov[i]) * float(dv[i]);
      }
    }
  }
  #pragma unroll
  for (int off = kThreadsPerRow / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (lane == 0 && row < seq.seqlen_q) {
    static_cast<float*>(p.dsum)[seq.lse_off(bidb, p.dsum_batch_stride) + bidh * p.dsum_head_stride + row] = sum;
  }
}

}  // namespace flashgen
