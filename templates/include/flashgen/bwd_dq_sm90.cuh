// Attention backward on the Hopper path (sm_90a), the split schedule's dQ kernel: one block per (query block, head,
// batch) keeps its dQ tile in registers while it walks the key blocks, so no block adds into another's result and dQ
// comes out bitwise the same on every run (the schedule's dK / dV kernel is bwd_sm90.cuh without dQ, kDq = false).
//
//   warpgroup 0 (producer, few registers): one thread issues the TMA copies: Q and dO of the query block once, then
//     per key block K and V into a ring of kStages buffers ("full" barriers count the bytes in, "empty" barriers are
//     released by the consumers).
//   warpgroups 1..kConsumerWGs (consumers): each owns 64 query rows of the block_m tile:
//       S = Q K^T, dP = dO V^T                                  (wgmma, both operands K-major in shared memory)
//       P = exp2(S scale_log2 - lse[row]), dS = P (dP - D[row])   (registers; lse and D fixed for the whole walk)
//       dQ += dS K                                              (wgmma, dS from registers, K MN-major)
//   dropout: dS = P (rp Z dP - D), the keep flags Z drawn per block as the forward draws them (its fragment view).
//   epilogue: dQ * scale through shared memory (Q's tile, free after the last S GEMM) to predicated 16-byte stores.
//
// It recomputes S and dP, which the dK / dV kernel computes too: 7 GEMMs per (query, key) block pair against the fused
// schedule's 5, the price of determinism without ordering the fused kernel's dQ reduces.
#pragma once

#include "flashgen/sm90_common.cuh"   // first: it configures CuTe's wgmma shapes before any CuTe header
#include "flashgen/bwd_sm90.cuh"       // the producer's loads (tma_load_pair), as the fused kernel's
// With dropout the S tile has the forward's orientation (rows = queries), so the forward's own view of it
// (m16n8_layout_sm90) regenerates the forward's mask: one definition of the entry -> Philox mapping for both.
#include "flashgen/fwd_sm90.cuh"

namespace flashgen {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kCausal_, bool kOverlap_ = false,
          bool kDropout_ = false>
struct BwdDqSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;   // query rows per block: 64 per consumer warpgroup
  static constexpr int kBlockN = kBlockN_;   // keys per step of the walk
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  // The next key block's S and dP issued right behind this block's dQ GEMM, before waiting for it: the tensor cores
  // go from one to the next without the wait and the issue in between.
  static constexpr bool kOverlap = kOverlap_;
  static_assert(!kOverlap || kStages_ >= 2, "overlap: the next block's K and V in another stage");
  static constexpr bool kDropout = kDropout_;
  static_assert(!kDropout || kBlockN_ % 32 == 0, "dropout: whole 32-key Philox blocks (dropout_bits)");
  static constexpr int kConsumerWGs = kBlockM / 64;
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0 && kBlockN % 16 == 0, "");
  static_assert(kConsumerWGs >= 1 && kConsumerWGs <= 3, "");
  static constexpr int kNThreads = 128 * (kConsumerWGs + 1);
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kChunks = kHeadDim / 64;   // TMA boxes per tile row
  static constexpr int kProducerRegs = kConsumerWGs == 1 ? 40 : 24;
  // One consumer warpgroup (head dim 256, whose dQ tile alone takes 128 registers a thread) takes all 256: at 232, as
  // the fused kernel's, the overlapped causal loop spilled 40 B.
  static constexpr int kConsumerRegs = kConsumerWGs == 1 ? 256 : kConsumerWGs == 2 ? 240 : 160;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= 65536, "register file");

  using AtomRows = Layout<Shape<Int<kConsumerWGs>, _1, _1>>;   // warpgroups stacked over the query rows
  // S = Q K^T and dP = dO V^T: (block_m queries) x (block_n keys), reduction over the head dim.
  using MmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomRows{}));
  // dQ += dS K: (block_m) x (head_dim), reduction over the keys; A (dS) from registers, B (K) MN-major.
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                                 GMMA::Major::MN>(),
      AtomRows{}));

  // Tiles as TMA writes them: 8 x 64 swizzled atoms, rows first, each 64-column chunk one box.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));   // also dO
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // (head_dim x keys) view of the same bytes: dQ's MN-major B operand.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  static constexpr int kQElems = kBlockM * kHeadDim;   // also dO
  static constexpr int kKElems = kBlockN * kHeadDim;   // per stage, also V
  // Q, dO, kStages x (K, V), then the mbarriers (8 bytes each): Q/dO full, K/V full and empty per stage.
  static constexpr int kBarrierOffset = (2 * kQElems + 2 * kStages * kKElems) * int(sizeof(Element));
  static constexpr int kNBarriers = 1 + 2 * kStages;
  static constexpr int kSmemBytes = kBarrierOffset + kNBarriers * 8;

  using Tiles = RowTiles<Element, kHeadDim, kConsumerThreads>;   // the epilogue's 16-byte stores
};

template <class K, class Params>
__device__ __forceinline__ void bwd_dq_sm90(Params const& p, char* smem) {
  using Element = typename K::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kHeadDim = K::kHeadDim, kStages = K::kStages;
  const int tidx = threadIdx.x;
  const int warpgroup = tidx / 128;
  // Causal: the last query blocks see the most keys, so they start first.
  const int m_block = K::kCausal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int bidh = blockIdx.y, bidb = blockIdx.z;
  const int bidh_k = bidh / (p.nheads / p.nheads_k);
  const BwdSeq seq(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, bidb);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  if (m_block * kBlockM >= seqlen_q) return;
  const int batch_crd = seq.varlen ? 0 : bidb;   // varlen tensor maps: one "batch", rows offset by cu_seqlens

  // Key blocks that some query of this block sees; causal is aligned to the bottom-right corner.
  const int diag_shift = seqlen_k - seqlen_q;
  int n_iters = (seqlen_k + kBlockN - 1) / kBlockN;
  if constexpr (K::kCausal) {
    const int last_key = (m_block + 1) * kBlockM - 1 + diag_shift;   // the block's last row sees keys <= last_key
    n_iters = last_key < 0 ? 0 : min(n_iters, last_key / kBlockN + 1);
  }

  Element* base = reinterpret_cast<Element*>(smem);
  Element* q_smem = base;
  Element* do_smem = q_smem + K::kQElems;
  Element* k_smem = do_smem + K::kQElems;
  Element* v_smem = k_smem + kStages * K::kKElems;
  Barrier* bar = reinterpret_cast<Barrier*>(smem + K::kBarrierOffset);
  Barrier& full_q = bar[0];
  Barrier* full = bar + 1;
  Barrier* empty = full + kStages;

  if (tidx == 0) init_producer_barriers<kStages, 4 * K::kConsumerWGs>(full_q, full, empty);
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<K::kProducerRegs>();
    if (tidx == 0 && n_iters > 0) {
      tma_load_pair<kBlockM, K::kChunks>(full_q, p.tma_q, q_smem, p.tma_do, do_smem, seq.q_row0 + m_block * kBlockM,
                                         bidh, batch_crd);
      for (int i = 0; i < n_iters; ++i) {
        const int s = i % kStages;
        empty[s].wait(((i / kStages) & 1) ^ 1);   // the first round finds every buffer free
        tma_load_pair<kBlockN, K::kChunks>(full[s], p.tma_k, k_smem + s * K::kKElems, p.tma_v,
                                           v_smem + s * K::kKElems, seq.k_row0 + i * kBlockN, bidh_k, batch_crd);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<K::kConsumerRegs>();
  const int ctidx = tidx - 128;   // thread index among the consumers
  const bool warp_leader = ctidx % 32 == 0;

  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename K::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(do_smem), typename K::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(k_smem), typename K::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(v_smem), typename K::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(k_smem), typename K::SmemLayoutKt{});

  typename K::MmaSdP mma_sdp;
  typename K::MmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ctidx);
  auto thr_dq = mma_dq.get_thread_slice(ctidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);   // wgmma descriptors
  Tensor tSrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);   // (.., .., .., stages)
  Tensor tSrV = thr_sdp.partition_fragment_B(sV);
  // K as dQ's B operand is the same for every warpgroup: its descriptors from warpgroup 0's slice (a constant
  // thread index keeps them in uniform registers).
  Tensor tDQrKt = mma_dq.get_thread_slice(0).partition_fragment_B(sKt);   // (.., .., .., stages)
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);
  warpgroup_fence_operand(acc_dq);   // zeroed before the first S and dP are issued (kOverlap: not while they run)
  // (query, key) of each S entry this thread holds.
  Tensor tCcS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS = rowcol_sm90(tCcS);
  constexpr int kRows = decltype(size<0>(tScS))::value;
  constexpr int kCols = decltype(size<1>(tScS))::value;

  // lse (base 2) and D of this thread's rows, fixed for the whole walk. A row that saw no key in the forward (lse
  // -inf), or one past the sequence, gets lse = +inf: P = 0 there.
  const int64_t lse_off = seq.lse_off(bidb, p.lse_batch_stride) + bidh * p.lse_head_stride;
  float const* lse_ptr = static_cast<float const*>(p.lse) + lse_off;
  float const* dsum_ptr = static_cast<float const*>(p.dsum) + lse_off;
  const float scale_log2 = p.scale_log2;
  const int q_rows_left = seqlen_q - m_block * kBlockM;
  float lse_l2[kRows], dsum[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int row = get<0>(tScS(r, 0));
    const float l = row < q_rows_left ? lse_ptr[m_block * kBlockM + row] : -kInf;
    lse_l2[r] = l == -kInf ? kInf : l * 1.4426950408889634f;
    dsum[r] = row < q_rows_left ? dsum_ptr[m_block * kBlockM + row] : 0.f;
  }

  [[maybe_unused]] const Dropout dropout = K::kDropout ? Dropout(p.rng_state, bidb * p.nheads + bidh,
                                                                 p.dropout_threshold, p.rp_dropout)
                                                       : Dropout();
  if (n_iters > 0) full_q.wait(0);
  Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
  // S = Q K^T and dP = dO V^T of key block i (acc_s and acc_dp, two batches).
  auto issue_sdp = [&](int i) {
    const int s = i % kStages;
    full[s].wait((i / kStages) & 1);
    wgmma_issue<true>(mma_sdp, tSrQ, tSrK(_, _, _, s), acc_s);
    wgmma_issue<true>(mma_sdp, tSrdO, tSrV(_, _, _, s), acc_dp);
  };
  auto release = [&](int s) {   // K and V of stage s are read
    __syncwarp();
    if (warp_leader) empty[s].arrive();
  };
  // kOverlap: both ways into the loop's head have the same two batches (S, dP) in flight, and the last block leaves
  // by a break: where a path with none in flight joined the head, ptxas serialised every wgmma (C7514).
  if (n_iters > 0) {
    if constexpr (K::kOverlap) issue_sdp(0);
    for (int i = 0;; ++i) {
      const int s = i % kStages;
      if constexpr (!K::kOverlap) issue_sdp(i);
      // Keys past the sequence (zeros, or the next sequence's keys with varlen) and, with causal, keys right of the
      // bottom-right-aligned diagonal get P = 0: per row, the keys from `cut` on.
      const bool need_mask = (i + 1) * kBlockN > seqlen_k ||
                             (K::kCausal && (i + 1) * kBlockN - 1 > m_block * kBlockM + diag_shift);
      // The block's keep flags: coordinates only, drawn while S and dP run.
      [[maybe_unused]] auto bits = dropout_bits<K::kDropout>(
          dropout, make_tensor(tCcS.data(), m16n8_layout_sm90(tCcS.layout())), m_block * kBlockM, i * kBlockN);
      warpgroup_wait<1>();   // S is in; dP may still run
      warpgroup_fence_operand(acc_s);
      // P and dS go to registers of their own: the accumulators are only read, so that the next block's S and dP
      // (kOverlap) can be issued while this block's dQ GEMM runs (ptxas serialises every wgmma when a non-wgmma
      // instruction writes an accumulator register while a wgmma is in flight).
      Tensor st = rowcol_sm90(acc_s);
      Tensor ps = make_tensor_like<float>(acc_s);   // P, then dS
      Tensor pr = rowcol_sm90(ps);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = m_block * kBlockM + get<0>(tScS(r, 0));
        const int cut = !need_mask ? kBlockN
                        : min(seqlen_k, K::kCausal ? row + diag_shift + 1 : seqlen_k) - i * kBlockN;
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const float pv = exp2f(fmaf(st(r, j), scale_log2, -lse_l2[r]));
          pr(r, j) = get<1>(tScS(r, j)) < cut ? pv : 0.f;
        }
      }
      warpgroup_wait<0>();   // dP is in
      warpgroup_fence_operand(acc_dp);
      if constexpr (K::kDropout) {
        // Row (v >> 1) + 2 m of the rowcol view is entry (v, m, n)'s.
        Tensor p4 = make_tensor(ps.data(), m16n8_layout_sm90(ps.layout()));
        Tensor dp4 = make_tensor(acc_dp.data(), m16n8_layout_sm90(acc_dp.layout()));
        dropout_apply(dropout, bits, [&](int v, int m, int n, bool keep) {
          p4(v, m, n) *= fmaf(dp4(v, m, n), keep ? dropout.rp : 0.f, -dsum[(v >> 1) + 2 * m]);
        });
      } else {
        Tensor dpt = rowcol_sm90(acc_dp);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int j = 0; j < kCols; ++j) pr(r, j) *= dpt(r, j) - dsum[r];
        }
      }
      Tensor ds_frag = convert_fragment<Element>(ps);
      Tensor tdSr = make_tensor(ds_frag.data(), acc_as_a_layout_sm90(ds_frag.layout()));
      warpgroup_fence_operand(tdSr);
      wgmma_issue<false>(mma_dq, tdSr, tDQrKt(_, _, _, s), acc_dq);
      if constexpr (K::kOverlap) {
        if (i + 1 == n_iters) {
          warpgroup_wait<0>();
          release(s);
          break;
        }
        issue_sdp(i + 1);
        warpgroup_wait<2>();   // dQ is in; the next S and dP may still run
        release(s);
      } else {
        warpgroup_wait<0>();
        release(s);
        if (i + 1 == n_iters) break;
      }
    }
  }
  warpgroup_fence_operand(acc_dq);

  // Epilogue: dQ * scale, through shared memory (this warpgroup's rows of Q's tile: only it read them, and its last
  // S GEMM has landed) to 16-byte stores. A query block that sees no key writes zeros.
  const float scale = p.scale;
  CUTE_UNROLL
  for (int j = 0; j < size(acc_dq); ++j) acc_dq(j) *= scale;
  Tensor rdQ = convert_fragment<Element>(acc_dq);
  store_pairs(rdQ, thr_dq.partition_C(sQ));
  consumer_sync<K::kConsumerThreads>();
  Element* dq_ptr = static_cast<Element*>(p.dq) + seq.q_off(bidb, p.dq_batch_stride, p.dq_row_stride) +
                    bidh * p.dq_head_stride + int64_t(m_block) * kBlockM * p.dq_row_stride;
  store_rows_sm90<typename K::Tiles, kBlockM, kHeadDim>(sQ, dq_ptr, p.dq_row_stride, q_rows_left, p.head_dim, ctidx);
}

}  // namespace flashgen
