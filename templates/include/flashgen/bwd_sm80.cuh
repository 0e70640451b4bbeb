// Attention backward on the SM80 path (mma.sync m16n8k16, cp.async, swizzled smem, ldmatrix).
//
// With P = exp(scale * Q K^T - lse) recomputed from the forward's lse, and D = rowsum(dO * O):
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dK = scale * dS^T Q,   dQ = scale * dS K
//
// Two kernels share the pieces below:
//   bwd_dkdv_sm80: one block per (key block, head, batch); dK and dV stay in registers while the block walks
//                  the query blocks. With kAtomicDq it also adds its dQ share into an fp32 accumulator
//                  (the fused, sequence-parallel schedule); without, bwd_dq_sm80 computes dQ (split schedule).
//   bwd_dq_sm80:   one block per (query block, head, batch); dQ stays in registers while the block walks the
//                  key blocks. No atomics, so split results are bitwise reproducible.
#pragma once

#include "flashgen/bwd_pre.cuh"
#include "flashgen/sm80_common.cuh"

namespace flashgen {

// 8 warps arranged kM x kN over an M x N output tile. Per k16 step a warp loads its (M/kM) x 16 slice of A and
// (N/kN) x 16 slice of B with ldmatrix for (M/kM)(N/kN)/128 MMAs: the most square warp tile loads least per MMA
// (cost kN*M + kM*N). Warp tiles must be multiples of 16 (one ldmatrix.x4 feeds two n8 MMAs). Ties, as measured
// on the H100 (bf16 backward, 2026-11-23): a 64 x 64 tile takes 2 warps along M (S/dP of hdim 256: 240 -> 258
// TFLOP/s at 2k), other tiles 4 (S/dP of hdim 64 at 128 x 128: 2 along M lost 4%).
template <int M, int N>
struct WarpSplit {
  static constexpr int cost(int wm) {
    return (M % (16 * wm) != 0 || N % (16 * (8 / wm)) != 0) ? (1 << 30) : (8 / wm) * M + wm * N;
  }
  static constexpr int pick() {
    const int first = (M == 64 && N == 64) ? 2 : 4;
    const int order[5] = {first, 4, 2, 1, 8};
    int best = first;
    for (int i = 0; i < 5; ++i) {
      if (cost(order[i]) < cost(best)) best = order[i];
    }
    return best;
  }
  static constexpr int kM = pick();
  static constexpr int kN = 8 / kM;
  static_assert(cost(kM) < (1 << 30), "no warp split divides this tile");
};

// S/dP with dropout: the cheapest split (as WarpSplit) among those giving each warp a multiple of 32 columns.
template <int M, int N>
struct DropoutWarpSplit {
  static constexpr int cost(int wm) {
    return (M % (16 * wm) != 0 || N % (32 * (8 / wm)) != 0) ? (1 << 30) : (8 / wm) * M + wm * N;
  }
  static constexpr int pick() {
    const int order[4] = {4, 2, 8, 1};
    int best = order[0];
    for (int i = 1; i < 4; ++i) {
      if (cost(order[i]) < cost(best)) best = order[i];
    }
    return best;
  }
  static constexpr int kM = pick();
  static_assert(cost(kM) < (1 << 30), "no warp split gives every warp whole 32-column blocks");
};

template <class Element_, int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_,
          bool kCausal_, bool kEvenK_, bool kDropout_>
struct BwdSm80 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;     // Q, K, dQ, dK
  static constexpr int kHeadDimV = kHeadDimV_;   // V, dO, dV
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kEvenK = kEvenK_;   // both head dims equal their buckets: no column predicates
  static constexpr bool kDropout = kDropout_;
  static_assert(kNWarps == 8, "the warp layouts below assume 8 warps");
  static_assert(kBlockM % 64 == 0 && kBlockN % 32 == 0, "");
  static_assert(kStages == 1 || kStages == 2, "");

  using MmaOp = cute::conditional_t<cute::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                   SM80_16x8x16_F32BF16BF16F32_TN>;
  // Each GEMM splits its output tile over the 8 warps as its own WarpSplit (below): S = Q K^T and dP = dO V^T
  // (block_m x block_n), dK (block_n x head_dim), dV (block_n x head_dim_v), dQ (block_m x head_dim).
  template <int kRows, int kCols>
  using TiledMmaFor = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<WarpSplit<kRows, kCols>::kM>, Int<WarpSplit<kRows, kCols>::kN>, _1>>,
                               Tile<Int<16 * WarpSplit<kRows, kCols>::kM>, Int<16 * WarpSplit<kRows, kCols>::kN>, _16>>;
  // With dropout, each warp must hold whole 32-column blocks of S/dP (four n8 tiles), the granularity the
  // dropout mask is generated at (dropout.cuh; the forward's layout has it by construction): a warp split whose
  // N extent per warp is a multiple of 32, and columns permuted so that a warp's four n8 tiles are adjacent.
  static constexpr int kSdpWarpsM =
      cute::conditional_t<kDropout, DropoutWarpSplit<kBlockM, kBlockN>, WarpSplit<kBlockM, kBlockN>>::kM;
  static constexpr int kSdpWarpsN = 8 / kSdpWarpsM;
  using TiledMmaSdP = cute::conditional_t<
      kDropout,
      TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kSdpWarpsM>, Int<kSdpWarpsN>, _1>>,
               Tile<Int<16 * kSdpWarpsM>, Layout<Shape<_8, Int<kSdpWarpsN>, _4>, Stride<_1, _32, _8>>, _16>>,
      TiledMmaFor<kBlockM, kBlockN>>;
  using TiledMmaDk = TiledMmaFor<kBlockN, kHeadDim>;
  using TiledMmaDv = TiledMmaFor<kBlockN, kHeadDimV>;
  using TiledMmaDq = TiledMmaFor<kBlockM, kHeadDim>;

  using TilesQK = RowTiles<Element, kHeadDim, kNThreads>;
  using TilesV = RowTiles<Element, kHeadDimV, kNThreads>;
  using SmemLayoutQ = typename TilesQK::template SmemLayout<kBlockM>;
  using SmemLayoutdO = typename TilesV::template SmemLayout<kBlockM>;
  using SmemLayoutK = typename TilesQK::template SmemLayout<kBlockN>;
  using SmemLayoutV = typename TilesV::template SmemLayout<kBlockN>;
  // Transposed views (head dim x rows): B operands whose reduction runs over rows, read with ldmatrix.trans.
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{},
                                                                       GenRowMajor{})));
  using SmemLayoutdOt = decltype(composition(SmemLayoutdO{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockM>>{},
                                                                         GenRowMajor{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{},
                                                                       GenRowMajor{})));
  // P and dS tiles (block_m x block_n) and their transposes (block_n x block_m) for dV and dK.
  static constexpr int kPdSCols = kBlockN % 64 == 0 ? 64 : 32;
  using SmemLayoutAtomPdS = decltype(composition(Swizzle<kPdSCols == 64 ? 3 : 2, 3, 3>{},
                                                 Layout<Shape<_8, Int<kPdSCols>>, Stride<Int<kPdSCols>, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{},
                                                                           GenRowMajor{})));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomC = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kdOElems = kBlockM * kHeadDimV;
  static constexpr int kKElems = kBlockN * kHeadDim;
  static constexpr int kVElems = kBlockN * kHeadDimV;
  static constexpr int kPElems = kBlockM * kBlockN;
  // dK/dV kernel: kStages x Q, kStages x dO, K, V, P, dS.   dQ kernel: Q, dO, kStages x K, kStages x V, dS.
  static constexpr int kSmemBytesDkdv =
      (kStages * (kQElems + kdOElems) + kKElems + kVElems + 2 * kPElems) * int(sizeof(Element));
  static constexpr int kSmemBytesDq =
      (kQElems + kdOElems + kStages * (kKElems + kVElems) + kPElems) * int(sizeof(Element));
};

// Row-major (rows, kHeadDim) view of one head of a (.., rows, heads, head_dim) tensor.
template <int kHeadDim, class T>
__device__ __forceinline__ auto head_view(T* ptr, int rows, int64_t row_stride) {
  return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
}

template <class T>
__device__ __forceinline__ auto offset_by(T const& t, int elems) {
  return make_tensor(t.data() + elems, t.layout());
}

// lse (pre-scaled to base 2) and dsum of the rows this thread holds in the S fragment. Rows past the sequence
// and rows that saw no key (lse = -inf) get lse = +inf, so their P is exactly 0.
template <int kRows, class RowCoords>
__device__ __forceinline__ void load_row_stats(float (&lse_l2)[kRows], float (&dsum)[kRows], RowCoords const& tScS,
                                               float const* lse_ptr, float const* dsum_ptr, int rows_left) {
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int row = get<0>(tScS(i, 0));
    const float l = row < rows_left ? lse_ptr[row] : -kInf;
    lse_l2[i] = l == -kInf ? kInf : l * 1.4426950408889634f;
    dsum[i] = row < rows_left ? dsum_ptr[row] : 0.f;
  }
}

// In place: acc_s (S) becomes P, acc_dp (dP) becomes dS = P * (dP - D). Masked entries (keys past the
// sequence; with causal, keys right of the bottom-right-aligned diagonal) get P = 0. With dropout (mask Z, kept
// entries scaled by rp = 1 / (1 - p) in the forward): acc_s becomes P * Z (dV's operand; dV is scaled by rp in
// the epilogue) and dS = P * (rp * Z * dP - D), with D = rowsum(dO * O) as without dropout.
template <bool kCausal, bool kDropout, int kBlockM, int kBlockN, int kRows, class AccS, class AccDp, class Coords,
          class Bits>
__device__ __forceinline__ void compute_p_ds(AccS& acc_s, AccDp& acc_dp, Coords const& tCcS,
                                             float const (&lse_l2)[kRows], float const (&dsum)[kRows],
                                             int m_block, int n_block, int seqlen_q, int seqlen_k, float scale_log2,
                                             Dropout const& dropout, Bits const& drop_bits) {
  Tensor s = rowcol(acc_s);
  Tensor dp = rowcol(acc_dp);
  Tensor tScS = rowcol(tCcS);
  const int diag_shift = seqlen_k - seqlen_q;
  const bool need_mask = (n_block + 1) * kBlockN > seqlen_k ||
                         (kCausal && (n_block + 1) * kBlockN - 1 > m_block * kBlockM + diag_shift);
  const float rp = kDropout ? dropout.rp : 1.f;
  CUTE_UNROLL
  for (int i = 0; i < size<0>(s); ++i) {
    const int row = m_block * kBlockM + get<0>(tScS(i, 0));
    const int limit = kCausal ? min(seqlen_k, row + 1 + diag_shift) : seqlen_k;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j) {
      float pv = exp2f(fmaf(s(i, j), scale_log2, -lse_l2[i]));
      if (need_mask && n_block * kBlockN + get<1>(tScS(i, j)) >= limit) pv = 0.f;
      s(i, j) = pv;
      dp(i, j) = pv * (kDropout ? fmaf(dp(i, j), rp, -dsum[i]) : dp(i, j) - dsum[i]);
    }
  }
  if constexpr (kDropout) {
    // Fragment value v of MMA tile (m, n) is rowcol entry (2m + v / 2, 2n + v % 2).
    dropout_apply(dropout, drop_bits, [&](int v, int m, int n, bool keep) {
      if (!keep) {
        acc_dp(v, m, n) = -acc_s(v, m, n) * dsum[2 * m + v / 2];
        acc_s(v, m, n) = 0.f;
      }
    });
  }
}

// The fp32 dQ accumulator of the fused schedule is stored tile by tile (kBlockM x kHeadDim floats each) in
// the order the dQ MMA fragments come out, so that every atomic instruction of a warp covers one contiguous
// span: 16 bytes per lane with sm_90's vector atomics, 4 bytes per lane before. The convert entry point
// (bwd_dq_convert) reads it back with the same mapping, so the order never leaves this file.
template <int kNThreads>
__device__ __forceinline__ int dq_accum_index(int i, int tidx) {
#if __CUDA_ARCH__ >= 900
  return (i / 4) * (kNThreads * 4) + tidx * 4 + i % 4;
#else
  return i * kNThreads + tidx;
#endif
}

template <class K, class Params>
__device__ __forceinline__ float* dq_accum_tile(Params const& p, BwdSeq const& seq, int bidb, int bidh, int m_block) {
  return static_cast<float*>(p.dq_accum) + (seq.varlen ? 0 : bidb * p.dq_accum_batch_stride) +
         bidh * p.dq_accum_head_stride +
         (seq.template dq_accum_row0<K::kBlockM>() + int64_t(m_block) * K::kBlockM) * p.dq_accum_row_stride;
}

template <class K, class Acc>
__device__ __forceinline__ void atomic_add_dq_tile(float* tile, Acc const& acc_dq, float scale, int tidx) {
  static_assert(decltype(size(acc_dq))::value % 4 == 0, "");
#if __CUDA_ARCH__ >= 900
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 4) {
    atomicAdd(reinterpret_cast<float4*>(tile + dq_accum_index<K::kNThreads>(i, tidx)),
              make_float4(acc_dq(i) * scale, acc_dq(i + 1) * scale, acc_dq(i + 2) * scale, acc_dq(i + 3) * scale));
  }
#else
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) atomicAdd(tile + dq_accum_index<K::kNThreads>(i, tidx), acc_dq(i) * scale);
#endif
}

template <class K, bool kAtomicDq, class Params>
__device__ __forceinline__ void bwd_dkdv_sm80(Params const& p, char* smem) {
  using Element = typename K::Element;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kHeadDim = K::kHeadDim, kHeadDimV = K::kHeadDimV;
  constexpr int kStages = K::kStages;
  const int tidx = threadIdx.x;
  const int n_block = blockIdx.x, bidh = blockIdx.y, bidb = blockIdx.z;
  const int bidh_k = bidh / (p.nheads / p.nheads_k);
  const BwdSeq seq(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, bidb);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  if (n_block * kBlockN >= seqlen_k) return;

  // Query blocks that see a key of this block; causal is aligned to the bottom-right corner.
  const int m_block_max = (seqlen_q + kBlockM - 1) / kBlockM;
  const int m_block_min = K::kCausal ? max(0, (n_block * kBlockN - (seqlen_k - seqlen_q)) / kBlockM) : 0;

  auto q_ptr = static_cast<Element const*>(p.q) + seq.q_off(bidb, p.q_batch_stride, p.q_row_stride) +
               bidh * p.q_head_stride;
  auto do_ptr = static_cast<Element const*>(p.dout) + seq.q_off(bidb, p.dout_batch_stride, p.dout_row_stride) +
                bidh * p.dout_head_stride;
  auto k_ptr = static_cast<Element const*>(p.k) + seq.k_off(bidb, p.k_batch_stride, p.k_row_stride) +
               bidh_k * p.k_head_stride;
  auto v_ptr = static_cast<Element const*>(p.v) + seq.k_off(bidb, p.v_batch_stride, p.v_row_stride) +
               bidh_k * p.v_head_stride;
  auto dk_ptr = static_cast<Element*>(p.dk) + seq.k_off(bidb, p.dk_batch_stride, p.dk_row_stride) +
                bidh * p.dk_head_stride;
  auto dv_ptr = static_cast<Element*>(p.dv) + seq.k_off(bidb, p.dv_batch_stride, p.dv_row_stride) +
                bidh * p.dv_head_stride;
  const int64_t lse_off = seq.lse_off(bidb, p.lse_batch_stride) + bidh * p.lse_head_stride;
  float const* lse_ptr = static_cast<float const*>(p.lse) + lse_off;
  float const* dsum_ptr = static_cast<float const*>(p.dsum) + lse_off;

  Tensor gQ = local_tile(head_view<kHeadDim>(q_ptr, seqlen_q, p.q_row_stride), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                         make_coord(_, 0));  // (M, D, m_blocks)
  Tensor gdO = local_tile(head_view<kHeadDimV>(do_ptr, seqlen_q, p.dout_row_stride),
                          Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(_, 0));
  Tensor gK = local_tile(head_view<kHeadDim>(k_ptr, seqlen_k, p.k_row_stride), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                         make_coord(n_block, 0));
  Tensor gV = local_tile(head_view<kHeadDimV>(v_ptr, seqlen_k, p.v_row_stride),
                         Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, 0));
  Tensor gdK = local_tile(head_view<kHeadDim>(dk_ptr, seqlen_k, p.dk_row_stride),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gdV = local_tile(head_view<kHeadDimV>(dv_ptr, seqlen_k, p.dv_row_stride),
                          Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, 0));

  // Shared memory: kStages x Q, kStages x dO, K, V, P, dS. Stage s of Q/dO is the stage-0 tensor offset by s tiles.
  Element* base = reinterpret_cast<Element*>(smem);
  Tensor sQ = make_tensor(make_smem_ptr(base), typename K::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(base + kStages * K::kQElems), typename K::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(base + kStages * (K::kQElems + K::kdOElems)), typename K::SmemLayoutK{});
  Tensor sV = make_tensor(sK.data() + K::kKElems, typename K::SmemLayoutV{});
  Tensor sP = make_tensor(sV.data() + K::kVElems, typename K::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + K::kPElems, typename K::SmemLayoutPdS{});
  Tensor sQt = make_tensor(sQ.data(), typename K::SmemLayoutQt{});
  Tensor sdOt = make_tensor(sdO.data(), typename K::SmemLayoutdOt{});
  Tensor sKt = make_tensor(sK.data(), typename K::SmemLayoutKt{});
  Tensor sPt = make_tensor(sP.data(), typename K::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(sdS.data(), typename K::SmemLayoutPdSt{});

  typename K::TilesQK::GmemCopyLoad gmem_load;
  typename K::TilesV::GmemCopyLoad gmem_load_v;
  auto gmem_thr = gmem_load.get_thread_slice(tidx);
  auto gmem_thr_v = gmem_load_v.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tdOgdO = gmem_thr_v.partition_S(gdO);
  Tensor tdOsdO = gmem_thr_v.partition_D(sdO);
  Tensor tKgK = gmem_thr.partition_S(gK);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr_v.partition_S(gV);
  Tensor tVsV = gmem_thr_v.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tdOcdO = gmem_thr_v.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tVcV = gmem_thr_v.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  Tensor col_ok = column_predicate<K::kEvenK>(tQcQ, p.head_dim);
  Tensor col_ok_v = column_predicate<K::kEvenK>(tVcV, p.head_dim_v);

  // S and dP.
  typename K::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto copy_sdp_a = make_tiled_copy_A(typename K::SmemCopyAtom{}, mma_sdp);
  auto copy_sdp_b = make_tiled_copy_B(typename K::SmemCopyAtom{}, mma_sdp);
  Tensor tSsQ = copy_sdp_a.get_thread_slice(tidx).partition_S(sQ);
  Tensor tdPsdO = copy_sdp_a.get_thread_slice(tidx).partition_S(sdO);
  Tensor tSsK = copy_sdp_b.get_thread_slice(tidx).partition_S(sK);
  Tensor tdPsV = copy_sdp_b.get_thread_slice(tidx).partition_S(sV);
  Tensor tCcS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS = rowcol(tCcS);
  const Dropout dropout = K::kDropout ? Dropout(p.rng_state, bidb * p.nheads + bidh, p.dropout_threshold,
                                                p.rp_dropout)
                                      : Dropout();
  auto copy_pds = make_tiled_copy_C(typename K::SmemCopyAtomC{}, mma_sdp);
  auto thr_copy_pds = copy_pds.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_pds.partition_D(sP);
  Tensor tdSsdS = thr_copy_pds.partition_D(sdS);

  // dV += P^T dO and dK += dS^T Q: both operands transposed in shared memory.
  typename K::TiledMmaDv mma_dv;
  typename K::TiledMmaDk mma_dk;
  auto thr_dv = mma_dv.get_thread_slice(tidx);
  auto thr_dk = mma_dk.get_thread_slice(tidx);
  Tensor tdVrPt = thr_dv.partition_fragment_A(make_tensor(sPt.data().get(), get_nonswizzle_portion(typename K::SmemLayoutPdSt{})));
  Tensor tdVrdOt = thr_dv.partition_fragment_B(make_tensor(sdOt.data().get(), get_nonswizzle_portion(typename K::SmemLayoutdOt{})));
  Tensor tdKrdSt = thr_dk.partition_fragment_A(make_tensor(sdSt.data().get(), get_nonswizzle_portion(typename K::SmemLayoutPdSt{})));
  Tensor tdKrQt = thr_dk.partition_fragment_B(make_tensor(sQt.data().get(), get_nonswizzle_portion(typename K::SmemLayoutQt{})));
  auto copy_dv_a = make_tiled_copy_A(typename K::SmemCopyAtomT{}, mma_dv);
  auto copy_dv_b = make_tiled_copy_B(typename K::SmemCopyAtomT{}, mma_dv);
  auto copy_dk_a = make_tiled_copy_A(typename K::SmemCopyAtomT{}, mma_dk);
  auto copy_dk_b = make_tiled_copy_B(typename K::SmemCopyAtomT{}, mma_dk);
  Tensor tdVsPt = copy_dv_a.get_thread_slice(tidx).partition_S(sPt);
  Tensor tdVsdOt = copy_dv_b.get_thread_slice(tidx).partition_S(sdOt);
  Tensor tdKsdSt = copy_dk_a.get_thread_slice(tidx).partition_S(sdSt);
  Tensor tdKsQt = copy_dk_b.get_thread_slice(tidx).partition_S(sQt);
  Tensor acc_dk = partition_fragment_C(mma_dk, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dv, Shape<Int<kBlockN>, Int<kHeadDimV>>{});
  clear(acc_dk);
  clear(acc_dv);

  // dQ share = dS K (fused schedule only).
  typename K::TiledMmaDq mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(make_tensor(sKt.data().get(), get_nonswizzle_portion(typename K::SmemLayoutKt{})));
  auto copy_dq_a = make_tiled_copy_A(typename K::SmemCopyAtom{}, mma_dq);
  auto copy_dq_b = make_tiled_copy_B(typename K::SmemCopyAtomT{}, mma_dq);
  Tensor tdQsdS = copy_dq_a.get_thread_slice(tidx).partition_S(sdS);
  Tensor tdQsKt = copy_dq_b.get_thread_slice(tidx).partition_S(sKt);

  auto load_q_do = [&](int m_block, int stage) {
    const int rows_left = seqlen_q - m_block * kBlockM;
    copy_tile<true, K::kEvenK, true>(gmem_load, tQgQ(_, _, _, m_block), offset_by(tQsQ, stage * K::kQElems), tQcQ,
                                     col_ok, rows_left);
    copy_tile<true, K::kEvenK, true>(gmem_load_v, tdOgdO(_, _, _, m_block), offset_by(tdOsdO, stage * K::kdOElems),
                                     tdOcdO, col_ok_v, rows_left);
  };

  if (m_block_min < m_block_max) {
    const int k_rows_left = seqlen_k - n_block * kBlockN;
    copy_tile<true, K::kEvenK, true>(gmem_load, tKgK, tKsK, tKcK, col_ok, k_rows_left);
    copy_tile<true, K::kEvenK, true>(gmem_load_v, tVgV, tVsV, tVcV, col_ok_v, k_rows_left);
    load_q_do(m_block_max - 1, 0);
    cp_async_fence();
  }

  constexpr int kRows = decltype(size<0>(tScS))::value;
  const float scale_log2 = p.scale_log2;
  int stage = 0;
  for (int m_block = m_block_max - 1; m_block >= m_block_min; --m_block) {
    const int q_stage_off = stage * K::kQElems, do_stage_off = stage * K::kdOElems;
    cp_async_wait<0>();
    __syncthreads();  // this Q/dO landed; every warp is done with the previous P/dS and the other stage
    if (kStages == 2 && m_block > m_block_min) {
      load_q_do(m_block - 1, stage ^ 1);
      cp_async_fence();
    }
    float lse_l2[kRows], dsum[kRows];
    load_row_stats(lse_l2, dsum, tScS, lse_ptr + m_block * kBlockM, dsum_ptr + m_block * kBlockM,
                   seqlen_q - m_block * kBlockM);

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    [[maybe_unused]] const auto drop_bits =
        dropout_bits<K::kDropout>(dropout, tCcS, m_block * kBlockM, n_block * kBlockN);
    gemm_ss(mma_sdp, acc_s, tSrQ, tSrK, offset_by(tSsQ, q_stage_off), tSsK, copy_sdp_a, copy_sdp_b, tidx);
    gemm_ss(mma_sdp, acc_dp, tdPrdO, tdPrV, offset_by(tdPsdO, do_stage_off), tdPsV, copy_sdp_a, copy_sdp_b, tidx);
    compute_p_ds<K::kCausal, K::kDropout, kBlockM, kBlockN>(acc_s, acc_dp, tCcS, lse_l2, dsum, m_block, n_block,
                                                            seqlen_q, seqlen_k, scale_log2, dropout, drop_bits);
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_copy_pds.retile_S(rP), tPsP);
    copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS);
    __syncthreads();  // P and dS visible to every warp

    gemm_ss(mma_dv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, offset_by(tdVsdOt, do_stage_off), copy_dv_a, copy_dv_b, tidx);
    gemm_ss(mma_dk, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, offset_by(tdKsQt, q_stage_off), copy_dk_a, copy_dk_b, tidx);

    if constexpr (kAtomicDq) {
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b, tidx);
      // Rows past the sequence hold dS = 0, so the whole tile is added (the accumulator is padded to tiles).
      atomic_add_dq_tile<K>(dq_accum_tile<K>(p, seq, bidb, bidh, m_block), acc_dq, p.scale, tidx);
    }
    if (kStages == 1 && m_block > m_block_min) {
      __syncthreads();  // every warp is done reading this Q/dO
      load_q_do(m_block - 1, 0);
      cp_async_fence();
    }
    if (kStages == 2) stage ^= 1;
  }

  // Epilogue: dK *= scale (and dV *= 1 / (1 - p) with dropout); both through shared memory (K and V's space) to 16-byte stores. A key block no
  // query sees (causal) writes zeros.
  cp_async_wait<0>();
  __syncthreads();
  const float scale = p.scale;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= scale;
  if constexpr (K::kDropout) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dv); ++i) acc_dv(i) *= dropout.rp;
  }
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  auto copy_dk_c = make_tiled_copy_C(typename K::SmemCopyAtomC{}, mma_dk);
  auto copy_dv_c = make_tiled_copy_C(typename K::SmemCopyAtomC{}, mma_dv);
  auto thr_copy_dk = copy_dk_c.get_thread_slice(tidx);
  auto thr_copy_dv = copy_dv_c.get_thread_slice(tidx);
  copy(copy_dk_c, thr_copy_dk.retile_S(rdK), thr_copy_dk.partition_D(sK));
  copy(copy_dv_c, thr_copy_dv.retile_S(rdV), thr_copy_dv.partition_D(sV));
  __syncthreads();

  const int k_rows_left = seqlen_k - n_block * kBlockN;
  store_tile<typename K::TilesQK::GmemCopyStore, kBlockN, kHeadDim, K::kEvenK>(sK, gdK, col_ok, k_rows_left, tidx);
  store_tile<typename K::TilesV::GmemCopyStore, kBlockN, kHeadDimV, K::kEvenK>(sV, gdV, col_ok_v, k_rows_left, tidx);
}

// dQ tile (fp32 registers in the dQ MMA layout) * scale -> Element -> shared memory -> predicated 16-byte
// stores. sQ: a free kBlockM x kHeadDim shared-memory tile.
template <class K, class Acc, class SQ, class GdQ, class ColOk>
__device__ __forceinline__ void store_dq(Acc& acc_dq, float scale, SQ& sQ, GdQ& gdQ, ColOk const& col_ok,
                                         int rows_left, int tidx) {
  using Element = typename K::Element;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= scale;
  Tensor rdQ = convert_fragment<Element>(acc_dq);
  typename K::TiledMmaDq mma_dq;
  auto copy_dq_c = make_tiled_copy_C(typename K::SmemCopyAtomC{}, mma_dq);
  auto thr_copy_c = copy_dq_c.get_thread_slice(tidx);
  copy(copy_dq_c, thr_copy_c.retile_S(rdQ), thr_copy_c.partition_D(sQ));
  __syncthreads();
  store_tile<typename K::TilesQK::GmemCopyStore, K::kBlockM, K::kHeadDim, K::kEvenK>(sQ, gdQ, col_ok, rows_left, tidx);
}

template <class K, class Params>
__device__ __forceinline__ void bwd_dq_sm80(Params const& p, char* smem) {
  using Element = typename K::Element;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kHeadDim = K::kHeadDim, kHeadDimV = K::kHeadDimV;
  constexpr int kStages = K::kStages;
  const int tidx = threadIdx.x;
  // Causal: the bottom query blocks see the most keys; start them first.
  const int m_block = K::kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int bidh = blockIdx.y, bidb = blockIdx.z;
  const int bidh_k = bidh / (p.nheads / p.nheads_k);
  const BwdSeq seq(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, bidb);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  if (m_block * kBlockM >= seqlen_q) return;

  int n_block_max = (seqlen_k + kBlockN - 1) / kBlockN;
  if (K::kCausal) {
    const int last_key = (m_block + 1) * kBlockM - 1 + seqlen_k - seqlen_q;
    n_block_max = min(n_block_max, max(0, last_key + kBlockN) / kBlockN);
  }

  auto q_ptr = static_cast<Element const*>(p.q) + seq.q_off(bidb, p.q_batch_stride, p.q_row_stride) +
               bidh * p.q_head_stride;
  auto do_ptr = static_cast<Element const*>(p.dout) + seq.q_off(bidb, p.dout_batch_stride, p.dout_row_stride) +
                bidh * p.dout_head_stride;
  auto k_ptr = static_cast<Element const*>(p.k) + seq.k_off(bidb, p.k_batch_stride, p.k_row_stride) +
               bidh_k * p.k_head_stride;
  auto v_ptr = static_cast<Element const*>(p.v) + seq.k_off(bidb, p.v_batch_stride, p.v_row_stride) +
               bidh_k * p.v_head_stride;
  auto dq_ptr = static_cast<Element*>(p.dq) + seq.q_off(bidb, p.dq_batch_stride, p.dq_row_stride) +
                bidh * p.dq_head_stride;
  const int64_t lse_off = seq.lse_off(bidb, p.lse_batch_stride) + bidh * p.lse_head_stride;

  Tensor gQ = local_tile(head_view<kHeadDim>(q_ptr, seqlen_q, p.q_row_stride), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                         make_coord(m_block, 0));
  Tensor gdO = local_tile(head_view<kHeadDimV>(do_ptr, seqlen_q, p.dout_row_stride),
                          Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0));
  Tensor gdQ = local_tile(head_view<kHeadDim>(dq_ptr, seqlen_q, p.dq_row_stride),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(head_view<kHeadDim>(k_ptr, seqlen_k, p.k_row_stride), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                         make_coord(_, 0));  // (N, D, n_blocks)
  Tensor gV = local_tile(head_view<kHeadDimV>(v_ptr, seqlen_k, p.v_row_stride),
                         Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0));

  // Shared memory: Q, dO, kStages x K, kStages x V, dS.
  Element* base = reinterpret_cast<Element*>(smem);
  Tensor sQ = make_tensor(make_smem_ptr(base), typename K::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + K::kQElems, typename K::SmemLayoutdO{});
  Tensor sK = make_tensor(sdO.data() + K::kdOElems, typename K::SmemLayoutK{});
  Tensor sV = make_tensor(sK.data() + kStages * K::kKElems, typename K::SmemLayoutV{});
  Tensor sdS = make_tensor(sV.data() + kStages * K::kVElems, typename K::SmemLayoutPdS{});
  Tensor sKt = make_tensor(sK.data(), typename K::SmemLayoutKt{});

  typename K::TilesQK::GmemCopyLoad gmem_load;
  typename K::TilesV::GmemCopyLoad gmem_load_v;
  auto gmem_thr = gmem_load.get_thread_slice(tidx);
  auto gmem_thr_v = gmem_load_v.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tdOgdO = gmem_thr_v.partition_S(gdO);
  Tensor tdOsdO = gmem_thr_v.partition_D(sdO);
  Tensor tKgK = gmem_thr.partition_S(gK);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr_v.partition_S(gV);
  Tensor tVsV = gmem_thr_v.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tdOcdO = gmem_thr_v.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tVcV = gmem_thr_v.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  Tensor col_ok = column_predicate<K::kEvenK>(tQcQ, p.head_dim);
  Tensor col_ok_v = column_predicate<K::kEvenK>(tVcV, p.head_dim_v);

  typename K::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto copy_sdp_a = make_tiled_copy_A(typename K::SmemCopyAtom{}, mma_sdp);
  auto copy_sdp_b = make_tiled_copy_B(typename K::SmemCopyAtom{}, mma_sdp);
  Tensor tSsQ = copy_sdp_a.get_thread_slice(tidx).partition_S(sQ);
  Tensor tdPsdO = copy_sdp_a.get_thread_slice(tidx).partition_S(sdO);
  Tensor tSsK = copy_sdp_b.get_thread_slice(tidx).partition_S(sK);
  Tensor tdPsV = copy_sdp_b.get_thread_slice(tidx).partition_S(sV);
  Tensor tCcS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS = rowcol(tCcS);
  const Dropout dropout = K::kDropout ? Dropout(p.rng_state, bidb * p.nheads + bidh, p.dropout_threshold,
                                                p.rp_dropout)
                                      : Dropout();
  auto copy_pds = make_tiled_copy_C(typename K::SmemCopyAtomC{}, mma_sdp);
  auto thr_copy_pds = copy_pds.get_thread_slice(tidx);
  Tensor tdSsdS = thr_copy_pds.partition_D(sdS);

  typename K::TiledMmaDq mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(make_tensor(sKt.data().get(), get_nonswizzle_portion(typename K::SmemLayoutKt{})));
  auto copy_dq_a = make_tiled_copy_A(typename K::SmemCopyAtom{}, mma_dq);
  auto copy_dq_b = make_tiled_copy_B(typename K::SmemCopyAtomT{}, mma_dq);
  Tensor tdQsdS = copy_dq_a.get_thread_slice(tidx).partition_S(sdS);
  Tensor tdQsKt = copy_dq_b.get_thread_slice(tidx).partition_S(sKt);
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);

  constexpr int kRows = decltype(size<0>(tScS))::value;
  float lse_l2[kRows], dsum[kRows];
  load_row_stats(lse_l2, dsum, tScS, static_cast<float const*>(p.lse) + lse_off + m_block * kBlockM,
                 static_cast<float const*>(p.dsum) + lse_off + m_block * kBlockM, seqlen_q - m_block * kBlockM);

  auto load_kv = [&](int n_block, int stage) {
    const int rows_left = seqlen_k - n_block * kBlockN;
    copy_tile<true, K::kEvenK, true>(gmem_load, tKgK(_, _, _, n_block), offset_by(tKsK, stage * K::kKElems), tKcK,
                                     col_ok, rows_left);
    copy_tile<true, K::kEvenK, true>(gmem_load_v, tVgV(_, _, _, n_block), offset_by(tVsV, stage * K::kVElems), tVcV,
                                     col_ok_v, rows_left);
  };
  if (n_block_max > 0) {
    const int rows_left = seqlen_q - m_block * kBlockM;
    copy_tile<true, K::kEvenK, true>(gmem_load, tQgQ, tQsQ, tQcQ, col_ok, rows_left);
    copy_tile<true, K::kEvenK, true>(gmem_load_v, tdOgdO, tdOsdO, tdOcdO, col_ok_v, rows_left);
    load_kv(n_block_max - 1, 0);
    cp_async_fence();
  }

  const float scale_log2 = p.scale_log2;
  int stage = 0;
  for (int n_block = n_block_max - 1; n_block >= 0; --n_block) {
    const int k_stage_off = stage * K::kKElems, v_stage_off = stage * K::kVElems;
    cp_async_wait<0>();
    __syncthreads();  // this K/V landed; every warp is done with the previous dS and the other stage
    if (kStages == 2 && n_block > 0) {
      load_kv(n_block - 1, stage ^ 1);
      cp_async_fence();
    }
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    [[maybe_unused]] const auto drop_bits =
        dropout_bits<K::kDropout>(dropout, tCcS, m_block * kBlockM, n_block * kBlockN);
    gemm_ss(mma_sdp, acc_s, tSrQ, tSrK, tSsQ, offset_by(tSsK, k_stage_off), copy_sdp_a, copy_sdp_b, tidx);
    gemm_ss(mma_sdp, acc_dp, tdPrdO, tdPrV, tdPsdO, offset_by(tdPsV, v_stage_off), copy_sdp_a, copy_sdp_b, tidx);
    compute_p_ds<K::kCausal, K::kDropout, kBlockM, kBlockN>(acc_s, acc_dp, tCcS, lse_l2, dsum, m_block, n_block,
                                                            seqlen_q, seqlen_k, scale_log2, dropout, drop_bits);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS);
    __syncthreads();  // dS visible to every warp

    gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, offset_by(tdQsKt, k_stage_off), copy_dq_a, copy_dq_b, tidx);
    if (kStages == 1 && n_block > 0) {
      __syncthreads();  // every warp is done reading this K/V
      load_kv(n_block - 1, 0);
      cp_async_fence();
    }
    if (kStages == 2) stage ^= 1;
  }

  // Epilogue: through shared memory (Q's space) to 16-byte stores. No visible key: zeros.
  cp_async_wait<0>();
  __syncthreads();
  store_dq<K>(acc_dq, p.scale, sQ, gdQ, col_ok, seqlen_q - m_block * kBlockM, tidx);
}

// Fused schedule, last step: the fp32 dQ accumulator (already scaled) -> dQ in the input dtype.
// One block per (query tile, head, batch); shared memory: one kBlockM x kHeadDim Element tile.
template <class K, class Params>
__device__ __forceinline__ void bwd_dq_convert(Params const& p, char* smem) {
  using Element = typename K::Element;
  constexpr int kBlockM = K::kBlockM, kHeadDim = K::kHeadDim;
  const int tidx = threadIdx.x;
  const int m_block = blockIdx.x, bidh = blockIdx.y, bidb = blockIdx.z;
  const BwdSeq seq(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, bidb);
  if (m_block * kBlockM >= seq.seqlen_q) return;
  float const* tile = dq_accum_tile<K>(p, seq, bidb, bidh, m_block);
  typename K::TiledMmaDq mma_dq;
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
#if __CUDA_ARCH__ >= 900
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); i += 4) {
    const float4 v = *reinterpret_cast<float4 const*>(tile + dq_accum_index<K::kNThreads>(i, tidx));
    acc_dq(i) = v.x, acc_dq(i + 1) = v.y, acc_dq(i + 2) = v.z, acc_dq(i + 3) = v.w;
  }
#else
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) = tile[dq_accum_index<K::kNThreads>(i, tidx)];
#endif
  auto dq_ptr = static_cast<Element*>(p.dq) + seq.q_off(bidb, p.dq_batch_stride, p.dq_row_stride) +
                bidh * p.dq_head_stride;
  Tensor gdQ = local_tile(head_view<kHeadDim>(dq_ptr, seq.seqlen_q, p.dq_row_stride),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename K::SmemLayoutQ{});
  typename K::TilesQK::GmemCopyStore gmem_store;
  Tensor tcQ = gmem_store.get_thread_slice(tidx).partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor col_ok = column_predicate<K::kEvenK>(tcQ, p.head_dim);
  store_dq<K>(acc_dq, 1.f, sQ, gdQ, col_ok, seq.seqlen_q - m_block * kBlockM, tidx);
}


}  // namespace flashgen
