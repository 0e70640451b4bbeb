// Attention forward on the SM80 path (mma.sync m16n8k16, cp.async, swizzled smem, ldmatrix), run by
// every GPU from sm_80 on. One thread block computes a block_m x head_dim_v tile of O for one (batch, head),
// walking the key/value blocks from the last to the first so the masked blocks come first.
//
//   mainloop: S = Q K^T (smem x smem), mask, online softmax in registers (base 2), O += P V (regs x smem)
//   epilogue: O / rowsum -> smem -> predicated 16-byte stores, lse per row
//
// Q and K have head_dim columns, V and O head_dim_v (equal unless the model says otherwise, e.g. 192 / 128).
// Warps beyond the block_m / 16 that the rows need form column groups: each group computes the whole S (the
// Q K^T GEMM is repeated per group) and its own head_dim_v / groups columns of O. That keeps the O accumulator
// of wide head dims (up to 512) in registers.
#pragma once

#include "flashgen/sm80_common.cuh"
#include "flashgen/sm80_ldsm.cuh"

namespace flashgen {

template <class Element_, int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, bool kCausal_,
          bool kEvenK_, bool kDropout_, bool kPersistent_ = false, bool kLdsmImm_ = false, int kPvPasses_ = 1,
          bool kLeanLoop_ = false>
struct FwdSm80 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kEvenK = kEvenK_;   // both head dims equal their buckets: no column predicates
  static constexpr bool kDropout = kDropout_;
  // The resident CTAs walk the tiles and load the next tile's Q and first K block under the current tile's
  // epilogue: a grid's CTAs start and end in lockstep waves whose prologue loads and epilogue stores all hit
  // memory at once (hdim 256 gained 5-8%, NOTES.md). Non-causal only (equal tiles, dealt round robin).
  static constexpr bool kPersistent = kPersistent_;
  // ldmatrix addresses as a few per-thread registers plus immediate offsets (gemm_ss / gemm_rs kImm), and O += P V
  // in kPvPasses passes over O's columns.
  static constexpr bool kLdsmImm = kLdsmImm_;
  static constexpr int kPvPasses = kPvPasses_;
  // A mainloop that gives up a few percent for registers (hdim 128's ran out, NOTES.md): V is waited for (and the next
  // K block issued) right before O += P V instead of before the softmax, a barrier ptxas does not interleave the
  // softmax with the P V MMAs across; the K/V copies re-derive their addresses per block; causal masking is checked
  // per block in the one loop instead of a masked phase of its own.
  static constexpr bool kLeanLoop = kLeanLoop_;
  // Column groups: a group's warps cover all block_m rows (16 per MMA slice) and head_dim_v / kGroups O columns.
  static constexpr int kGroupWarps = kNWarps < kBlockM / 16 ? kNWarps : kBlockM / 16;
  static constexpr int kGroups = kNWarps / kGroupWarps;
  static constexpr int kGroupThreads = kGroupWarps * 32;
  static constexpr int kHeadDimVGroup = kHeadDimV / kGroups;

  using MmaOp = cute::conditional_t<cute::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                   SM80_16x8x16_F32BF16BF16F32_TN>;
  // A group's warps stacked along M; the N tile of 16 lets one ldmatrix.x4 feed two n8 MMAs. Every warp holds
  // all block_n columns, so whole 32-column blocks, the granularity of the dropout mask.
  using TiledMma = TiledMMA<MMA_Atom<MmaOp>, Layout<Shape<Int<kGroupWarps>, _1, _1>>,
                            Tile<Int<16 * kGroupWarps>, _16, _16>>;

  using TilesQK = RowTiles<Element, kHeadDim, kNThreads>;
  using TilesV = RowTiles<Element, kHeadDimV, kNThreads>;
  using SmemLayoutQ = typename TilesQK::template SmemLayout<kBlockM>;
  using SmemLayoutK = typename TilesQK::template SmemLayout<kBlockN>;
  using SmemLayoutV = typename TilesV::template SmemLayout<kBlockN>;
  using SmemLayoutO = typename TilesV::template SmemLayout<kBlockM>;
  // V read as V^T (head_dim_v x keys) for the B operand of O += P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_layout(Shape<Int<kHeadDimV>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Q, K, then V; O (after the mainloop) reuses the start, so V sits past whichever of Q + K and O is larger.
  // Persistent: the next tile's Q and K land while this one's O is staged, so O gets its own space after V.
  static constexpr int kQKElems = (kBlockM + kBlockN) * kHeadDim;
  static constexpr int kOElems = kBlockM * kHeadDimV;
  static constexpr int kVOffset = kQKElems > kOElems || kPersistent ? kQKElems : kOElems;
  static constexpr int kOOffset = kPersistent ? kVOffset + kBlockN * kHeadDimV : 0;
  static constexpr int kSmemBytes =
      (kVOffset + kBlockN * kHeadDimV + (kPersistent ? kOElems : 0)) * int(sizeof(Element));
  static_assert(kBlockM % (16 * kGroupWarps) == 0, "each warp owns whole 16-row MMA slices");
  static_assert(kNWarps % kGroupWarps == 0 && kHeadDimV % (16 * kGroups) == 0, "column groups split O evenly");
  static_assert(kBlockN % 16 == 0, "");
};

// The rows (cols) of a tile that column group `group` of kGroups owns; the tile itself with one group.
template <int kGroups, class T>
__device__ __forceinline__ auto group_rows(T const& t, int group) {
  if constexpr (kGroups == 1) {
    return t;
  } else {
    constexpr int kRows = decltype(size<0>(t))::value / kGroups;
    return local_tile(t, Shape<Int<kRows>, decltype(size<1>(t))>{}, make_coord(group, 0));
  }
}
template <int kGroups, class T>
__device__ __forceinline__ auto group_cols(T const& t, int group) {
  if constexpr (kGroups == 1) {
    return t;
  } else {
    constexpr int kCols = decltype(size<1>(t))::value / kGroups;
    return local_tile(t, Shape<decltype(size<0>(t)), Int<kCols>>{}, make_coord(0, group));
  }
}

__device__ __forceinline__ int thread_index_per_tile() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// Where one tile's rows live: sequence extents and first elements. Varlen packs sequences along rows, fixed
// length uses batch strides.
struct FwdTileRows {
  int seqlen_q, seqlen_k;
  int64_t q_off, k_off, v_off, o_off, lse_off;
};

template <class Params>
__device__ __forceinline__ FwdTileRows fwd_tile_rows(Params const& p, int bidb) {
  FwdTileRows r{p.seqlen_q, p.seqlen_k, bidb * p.q_batch_stride, bidb * p.k_batch_stride,
                bidb * p.v_batch_stride, bidb * p.o_batch_stride, bidb * p.lse_batch_stride};
  if (p.cu_seqlens_q != nullptr) {
    const int* cu_q = static_cast<const int*>(p.cu_seqlens_q);
    const int* cu_k = static_cast<const int*>(p.cu_seqlens_k);
    const int q0 = cu_q[bidb], k0 = cu_k[bidb];
    r.seqlen_q = cu_q[bidb + 1] - q0;
    r.seqlen_k = cu_k[bidb + 1] - k0;
    r.q_off = q0 * p.q_row_stride;
    r.o_off = q0 * p.o_row_stride;
    r.k_off = k0 * p.k_row_stride;
    r.v_off = k0 * p.v_row_stride;
    r.lse_off = q0;
  }
  return r;
}

// Key blocks query block m_block sees; causal is aligned to the bottom-right corner.
template <class K>
__device__ __forceinline__ int fwd_n_block_max(int m_block, int seqlen_q, int seqlen_k) {
  int n_block_max = (seqlen_k + K::kBlockN - 1) / K::kBlockN;
  if (K::kCausal) {
    const int last_key = (m_block + 1) * K::kBlockM - 1 + seqlen_k - seqlen_q;  // last key of the last row
    n_block_max = min(n_block_max, max(0, last_key + K::kBlockN) / K::kBlockN);
  }
  return n_block_max;
}

// A persistent walk's tile t in the grid's order (query blocks fastest, then heads, then batches), so the CTAs that
// run at once share the K/V of few heads in L2.
struct FwdTileCoord {
  int m_block, bidh, bidb;
};
template <class K, class Params>
__device__ __forceinline__ int fwd_num_m_blocks(Params const& p) {
  return (p.seqlen_q + K::kBlockM - 1) / K::kBlockM;
}
template <class K, class Params>
__device__ __forceinline__ FwdTileCoord fwd_persistent_tile(Params const& p, int t) {
  const int m_blocks = fwd_num_m_blocks<K>(p);
  const int bh = t / m_blocks;
  return {t - bh * m_blocks, bh % p.nheads, bh / p.nheads};
}

// Issue the cp.async loads of a tile's Q and its first (last-indexed) K block; false when the tile has no rows or
// sees no key, so it loads nothing.
template <class K, class Params, class GmemLoad, class SQ, class SK>
__device__ __forceinline__ bool fwd_load_tile_start(Params const& p, FwdTileCoord c, GmemLoad const& gmem_load,
                                                    SQ& sQ, SK& sK, int tidx) {
  using Element = typename K::Element;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kHeadDim = K::kHeadDim;
  const FwdTileRows r = fwd_tile_rows(p, c.bidb);
  if (c.m_block * kBlockM >= r.seqlen_q) return false;
  const int n_block_max = fwd_n_block_max<K>(c.m_block, r.seqlen_q, r.seqlen_k);
  if (n_block_max <= 0) return false;
  const int n = n_block_max - 1;
  const int bidh_k = c.bidh / (p.nheads / p.nheads_k);
  Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q) + r.q_off + c.bidh * p.q_head_stride),
                          make_shape(r.seqlen_q, Int<kHeadDim>{}), make_stride(p.q_row_stride, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k) + r.k_off + bidh_k * p.k_head_stride),
                          make_shape(r.seqlen_k, Int<kHeadDim>{}), make_stride(p.k_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(c.m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n, 0));
  auto gmem_thr = gmem_load.get_thread_slice(tidx);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kHeadDim>{})));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(make_shape(Int<kBlockN>{}, Int<kHeadDim>{})));
  Tensor col_ok = column_predicate<K::kEvenK>(tQcQ, p.head_dim);
  copy_tile<true, K::kEvenK, true>(gmem_load, gmem_thr.partition_S(gQ), gmem_thr.partition_D(sQ), tQcQ, col_ok,
                                   r.seqlen_q - c.m_block * kBlockM);
  copy_tile<true, K::kEvenK, true>(gmem_load, gmem_thr.partition_S(gK), gmem_thr.partition_D(sK), tKcK, col_ok,
                                   r.seqlen_k - n * kBlockN);
  cp_async_fence();
  return true;
}

// Mainloop step: wait for V[n_block] (every warp is then also done reading K[n_block]) and issue K[n_block - 1].
template <bool kEvenK, class GmemLoad, class TG, class TS, class TC, class Pred>
__device__ __forceinline__ void fwd_wait_v_load_k(GmemLoad const& gmem_load, TG const& tKgK, TS& tKsK, TC const& tKcK,
                                                  Pred const& col_ok, int n_block) {
  cp_async_wait<0>();
  __syncthreads();
  if (n_block > 0) {
    copy_tile<false, kEvenK, true>(gmem_load, tKgK(_, _, _, n_block - 1), tKsK, tKcK, col_ok, 0);
    cp_async_fence();
  }
}

// One block_m x head_dim_v tile of O. `loaded`: its Q and first K block are already in flight (a persistent walk's
// previous tile issued them). Persistent walks pass their next tile, whose start loads this one issues once every
// warp is done with Q and K; returns whether it did.
template <class K, class Params>
__device__ __forceinline__ bool fwd_sm80_tile(Params const& p, char* smem, int m_block, int bidh, int bidb,
                                              bool loaded, int next_tile) {
  using Element = typename K::Element;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kHeadDim = K::kHeadDim, kHeadDimV = K::kHeadDimV;
  // A persistent walk reads the thread index afresh per tile (volatile), so the compiler cannot hoist the
  // thread's address arithmetic out of the walk and keep it live (spilled) across every mainloop.
  const int tidx = K::kPersistent ? thread_index_per_tile() : int(threadIdx.x);
  // MMA work is per column group; loads and stores use every thread. One group: plain tidx (the division and
  // the group offsets below would otherwise stay in the code and cost registers).
  const int group = K::kGroups == 1 ? 0 : tidx / K::kGroupThreads;
  const int tidx_g = K::kGroups == 1 ? tidx : tidx % K::kGroupThreads;
  const int bidh_k = bidh / (p.nheads / p.nheads_k);

  const FwdTileRows rows = fwd_tile_rows(p, bidb);
  const int seqlen_q = rows.seqlen_q, seqlen_k = rows.seqlen_k;
  const int64_t q_off = rows.q_off, k_off = rows.k_off, v_off = rows.v_off, o_off = rows.o_off,
                lse_off = rows.lse_off;
  if (m_block * kBlockM >= seqlen_q) return false;
  const int n_block_max = fwd_n_block_max<K>(m_block, seqlen_q, seqlen_k);
  [[maybe_unused]] bool next_loaded = false;

  Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q) + q_off + bidh * p.q_head_stride),
                          make_shape(seqlen_q, Int<kHeadDim>{}), make_stride(p.q_row_stride, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k) + k_off + bidh_k * p.k_head_stride),
                          make_shape(seqlen_k, Int<kHeadDim>{}), make_stride(p.k_row_stride, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v) + v_off + bidh_k * p.v_head_stride),
                          make_shape(seqlen_k, Int<kHeadDimV>{}), make_stride(p.v_row_stride, _1{}));
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.o) + o_off + bidh * p.o_head_stride),
                          make_shape(seqlen_q, Int<kHeadDimV>{}), make_stride(p.o_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n_blocks)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0));

  Element* base = reinterpret_cast<Element*>(smem);
  Tensor sQ = make_tensor(make_smem_ptr(base), typename K::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename K::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(base + K::kVOffset), typename K::SmemLayoutV{});
  // This group's head_dim_v / kGroups rows of V^T.
  Tensor sVt = group_rows<K::kGroups>(make_tensor(sV.data(), typename K::SmemLayoutVt{}), group);
  Tensor sVtNoSwizzle = group_rows<K::kGroups>(make_tensor(sV.data().get(), typename K::SmemLayoutVtNoSwizzle{}),
                                               group);

  typename K::TilesQK::GmemCopyLoad gmem_load;
  typename K::TilesV::GmemCopyLoad gmem_load_v;
  auto gmem_thr = gmem_load.get_thread_slice(tidx);
  auto gmem_thr_v = gmem_load_v.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);  // (CPY, CPY_N, CPY_D, n_blocks)
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr_v.partition_S(gV);
  Tensor tVsV = gmem_thr_v.partition_D(sV);

  // Coordinates of what this thread copies, for the row and head-dim predicates.
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(make_shape(Int<kBlockM>{}, Int<kHeadDim>{})));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(make_shape(Int<kBlockN>{}, Int<kHeadDim>{})));
  Tensor tVcV = gmem_thr_v.partition_S(make_identity_tensor(make_shape(Int<kBlockN>{}, Int<kHeadDimV>{})));
  Tensor col_ok = column_predicate<K::kEvenK>(tQcQ, p.head_dim);
  Tensor col_ok_v = column_predicate<K::kEvenK>(tVcV, p.head_dim_v);

  typename K::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx_g);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<K::kHeadDimVGroup>>{});

  auto copy_q = make_tiled_copy_A(typename K::SmemCopyAtom{}, tiled_mma);
  auto copy_k = make_tiled_copy_B(typename K::SmemCopyAtom{}, tiled_mma);
  auto copy_v = make_tiled_copy_B(typename K::SmemCopyAtomT{}, tiled_mma);
  Tensor tSsQ = copy_q.get_thread_slice(tidx_g).partition_S(sQ);
  Tensor tSsK = copy_k.get_thread_slice(tidx_g).partition_S(sK);
  Tensor tOsVt = copy_v.get_thread_slice(tidx_g).partition_S(sVt);

  // (row, col) of every S accumulator this thread holds: fragment order (dropout) and the rows x cols view
  // used by the softmax.
  Tensor tCcS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS = rowcol(tCcS);

  constexpr int kRows = decltype(size<0>(tScS))::value;
  float row_max[kRows], row_sum[kRows];
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) { row_max[i] = -kInf; row_sum[i] = 0.f; }
  clear(acc_o);

  const int q_rows_left = seqlen_q - m_block * kBlockM;
  // No key visible (causal with seqlen_q > seqlen_k, or seqlen_k == 0): nothing to load; the epilogue
  // writes zeros and lse = -inf. Loading Q anyway would race its cp.async with the epilogue's smem stores.
  if (n_block_max > 0 && !loaded) {
    const int n = n_block_max - 1;
    copy_tile<true, K::kEvenK, true>(gmem_load, tQgQ, tQsQ, tQcQ, col_ok, q_rows_left);
    copy_tile<true, K::kEvenK, true>(gmem_load, tKgK(_, _, _, n), tKsK, tKcK, col_ok, seqlen_k - n * kBlockN);
    cp_async_fence();
  }

  const float scale_log2 = p.scale_log2;
  // Dropout drops entries of P after the row sums (the softmax normaliser sees every key); the kept ones are
  // scaled by 1 / (1 - p) in the epilogue.
  const Dropout dropout = K::kDropout ? Dropout(p.rng_state, bidb * p.nheads + bidh, p.dropout_threshold,
                                                p.rp_dropout)
                                      : Dropout();
  // Key columns >= col_limit(row) are masked: the sequence end, and with causal the diagonal.
  const int diag_shift = seqlen_k - seqlen_q;

  // The Philox words of a key block depend on coordinates only. Head dims > 64 draw each block's words just before
  // its S GEMM and zero dropped fp32 entries; head dims <= 64, whose short GEMMs hide less, draw one block ahead
  // (behind the previous block's P V GEMM) and mask the packed 16-bit P. Measured on the H100 (NOTES.md): each
  // choice is the better one for its head dims (hdim 64: 32-38% -> 27-34% cost; hdim 128: 10-14% -> 18-25%).
  constexpr bool kDrawAhead = K::kDropout && kHeadDim <= 64;
  [[maybe_unused]] auto drop_bits_ahead =
      dropout_bits<kDrawAhead>(dropout, tCcS, m_block * kBlockM, (n_block_max - 1) * kBlockN);
  // Blocks that can need a mask: the last one (a partial tail) and those the causal diagonal crosses. Causal kernels
  // with key blocks of 64 or more walk those first steps as a phase of their own (the unrolled phase loop generates
  // the body twice), so the main phase has no mask code: H100, bf16, 2k/8k vs flash-attn 2, hdim 64 128x64 1.03 ->
  // 1.06-1.09x, hdim 256 64x64 0.94-0.96 -> 1.03-1.05x, 128x64x8 0.84-0.90 -> 0.95-1.01x (its 36 B of spills gone).
  // hdim 128 128x32 lost 5% that way (five masked steps twice over: 24 B of spills), and the non-causal kernels only
  // ever mask their first step, so those walk one phase that checks for the mask at run time.
  constexpr bool kMaskPhase = K::kCausal && kBlockN >= 64 && !K::kLeanLoop;
  constexpr int kMaskedSteps = (kBlockM + kBlockN - 1) / kBlockN + 1;
  CUTE_UNROLL
  for (int phase = 0; phase < (kMaskPhase ? 2 : 1); ++phase) {
    const bool masked = phase == 0;   // known at compile time once the phase loop is unrolled
    // A loop variable per phase: with one phase this is the plain loop, whose address arithmetic NVVM compiles
    // exactly as before (an outer-scope counter moved the non-causal kernels from 0-96 to 48-112 B of spills).
    const int n_block_first = masked ? n_block_max - 1 : n_block_max - 1 - kMaskedSteps;
    const int n_block_last = kMaskPhase && masked ? max(0, n_block_max - kMaskedSteps) : 0;
    for (int n_block = n_block_first; n_block >= n_block_last; --n_block) {
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      cp_async_wait<0>();
      __syncthreads();  // K[n_block] landed; every warp is done reading V of the previous block
      // Only the last key block can be partial; the loop walks downwards from it.
      if (masked && n_block == n_block_max - 1) {
        copy_tile<true, K::kEvenK, true>(gmem_load_v, tVgV(_, _, _, n_block), tVsV, tVcV, col_ok_v,
                                         seqlen_k - n_block * kBlockN);
      } else {
        if constexpr (K::kLeanLoop) {   // the partition's offsets are not kept live across the loop
          copy_tile<false, K::kEvenK, true>(
              gmem_load_v, gmem_load_v.get_thread_slice(thread_index_per_tile()).partition_S(gV)(_, _, _, n_block),
              tVsV, tVcV, col_ok_v, 0);
        } else {
          copy_tile<false, K::kEvenK, true>(gmem_load_v, tVgV(_, _, _, n_block), tVsV, tVcV, col_ok_v, 0);
        }
      }
      cp_async_fence();

      [[maybe_unused]] const auto drop_bits = [&] {
        if constexpr (kDrawAhead) {
          return drop_bits_ahead;
        } else {
          return dropout_bits<K::kDropout>(dropout, tCcS, m_block * kBlockM, n_block * kBlockN);
        }
      }();
      if constexpr (K::kLdsmImm) {
        gemm_ss_imm(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, copy_q, copy_k, tidx_g);
      } else {
        gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, copy_q, copy_k, tidx_g);
      }

      Tensor s = rowcol(acc_s);
      if (masked) mask_block<K::kCausal, kBlockM, kBlockN>(s, tScS, m_block, n_block, seqlen_k, diag_shift);

      if constexpr (!K::kLeanLoop) {
        fwd_wait_v_load_k<K::kEvenK>(gmem_load, tKgK, tKsK, tKcK, col_ok, n_block);
      }

      // Online softmax, base 2: p = 2^(s * scale_log2 - max * scale_log2), O and the sum rescaled.
      float correction[kRows];
      online_softmax(s, row_max, row_sum, scale_log2, correction);
      rescale_rows(rowcol(acc_o), correction);

      if constexpr (K::kDropout && !kDrawAhead) {
        dropout_apply(dropout, drop_bits, [&](int v, int m, int n, bool keep) {
          if (!keep) acc_s(v, m, n) = 0.f;
        });
      }
      Tensor p_frag = convert_fragment<Element>(acc_s);
      if constexpr (kDrawAhead) {
        dropout_apply_packed(dropout, drop_bits, p_frag);
        drop_bits_ahead = dropout_bits<true>(dropout, tCcS, m_block * kBlockM, (n_block - 1) * kBlockN);
      }
      Tensor tOrP = make_tensor(p_frag.data(), acc_as_a_layout(p_frag.layout()));
      if constexpr (K::kLeanLoop) {
        fwd_wait_v_load_k<K::kEvenK>(gmem_load, gmem_load.get_thread_slice(thread_index_per_tile()).partition_S(gK),
                                     tKsK, tKcK, col_ok, n_block);
      }
      if constexpr (K::kLdsmImm) {
        gemm_rs_imm<K::kPvPasses>(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, copy_v, tidx_g);
      } else {
        gemm_rs(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, copy_v, tidx_g);
      }
    }
  }

  // Every warp is done with Q and K (the last block's second barrier): the next tile's start loads under the
  // epilogue (O is staged in a space of its own). Issued here rather than in the last block, whose extra branch
  // moved the mainloop's register allocation (spills).
  if constexpr (K::kPersistent) {
    if (next_tile < fwd_num_m_blocks<K>(p) * p.nheads * p.batch) {
      next_loaded = fwd_load_tile_start<K>(p, fwd_persistent_tile<K>(p, next_tile), gmem_load, sQ, sK, tidx);
    }
  }

  // Epilogue: normalise, lse = (max * scale_log2 + log2(sum)) * ln 2; an all-masked row gives 0 and -inf.
  Tensor o = rowcol(acc_o);
  float lse[kRows];
  finish_rows(o, row_max, row_sum, scale_log2, K::kDropout ? dropout.rp : 1.f, lse);

  Tensor r_out = convert_fragment<Element>(acc_o);
  // Past the mainloop's last barrier no warp reads Q or K, so the O tile can take their place (sV is kept clear);
  // a persistent walk has O's own space, which the previous tile's store must be done reading.
  if constexpr (K::kPersistent) __syncthreads();
  Tensor sO = make_tensor(make_smem_ptr(base + K::kOOffset), typename K::SmemLayoutO{});
  Tensor sO_group = group_cols<K::kGroups>(sO, group);
  auto copy_o = make_tiled_copy_C(typename K::SmemCopyAtomO{}, tiled_mma);
  auto thr_copy_o = copy_o.get_thread_slice(tidx_g);
  copy(copy_o, thr_copy_o.retile_S(r_out), thr_copy_o.partition_D(sO_group));

  // lse: the lanes of group 0 holding column 0 of a row write it.
  Tensor tOcO = rowcol(thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<K::kHeadDimVGroup>>{})));
  if (group == 0 && get<1>(tOcO(0, 0)) == 0) {
    float* lse_ptr = static_cast<float*>(p.lse) + lse_off + bidh * p.lse_head_stride + m_block * kBlockM;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(o); ++i) {
      const int row = get<0>(tOcO(i, 0));
      if (row < q_rows_left) lse_ptr[row] = lse[i];
    }
  }
  __syncthreads();

  store_tile<typename K::TilesV::GmemCopyStore, kBlockM, kHeadDimV, K::kEvenK>(sO, gO, col_ok_v, q_rows_left, tidx);
  return next_loaded;
}

template <class K, class Params>
__device__ __forceinline__ void fwd_sm80(Params const& p, char* smem) {
  if constexpr (!K::kPersistent) {
    // Causal blocks near the bottom do the most work: start them first so the tail of the grid is short.
    const int m_block = K::kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    fwd_sm80_tile<K>(p, smem, m_block, blockIdx.y, blockIdx.z, false, 0);
  } else {
    // Equal tiles (non-causal), dealt round robin in the grid's order.
    const int num_tiles = fwd_num_m_blocks<K>(p) * p.nheads * p.batch;
    bool loaded = false;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const FwdTileCoord c = fwd_persistent_tile<K>(p, tile);
      loaded = fwd_sm80_tile<K>(p, smem, c.m_block, c.bidh, c.bidb, loaded, tile + gridDim.x);
    }
  }
}

}  // namespace flashgen
