// Attention backward on the Hopper path (sm_90a), the fused schedule: one block per (key block, head, batch)
// keeps dK and dV in registers while it walks the query blocks, and adds each block's dQ share into an fp32
// accumulator by bulk reduces; a second entry point converts the accumulator to dQ.
//
//   warpgroup 0 (producer, few registers): one thread issues the TMA copies: K and V of the key block once, then
//     per query block Q and dO into a ring of kStages buffers ("full" barriers count the bytes in, "empty"
//     barriers are released by the consumers).
//   warpgroups 1..kConsumerWGs (consumers): each owns 64 keys of the block_n tile and works transposed, so that
//     every GEMM's A operand is either in shared memory K-major or in registers:
//       S^T = K Q^T, dP^T = V dO^T                        (wgmma, K-major; hdim 64: K and V from registers)
//       P^T = exp2(S^T scale_log2 - lse[col]), dS^T = P^T (dP^T - D[col])   (registers; columns are queries)
//       dV += P^T dO, dK += dS^T Q                        (wgmma, A from registers, B MN-major views of dO / Q)
//       dQ  = dS K -> shared memory -> one bulk reduce-add (wgmma, dS^T through shared memory, both MN-major; then
//             cp.reduce.async.bulk of the warpgroup's fp32 share into the accumulator, whole L2 lines instead of
//             8-byte atomics). The two warpgroups split dQ's columns and meet at a barrier per block, or take turns
//             on the whole tile (kDqHandoff: only the one whose turn it is waits for the other's dS), or, with
//             128-row query blocks, split its rows (kDqRowSplit). kDqRed: no stage, 16-byte reds from registers.
//   epilogue: dK * scale, dV through shared memory (K and V's space) to predicated 16-byte stores.
//
// Split tail (kSplit, p.split_k > 1; non-causal only): the last p.split_tiles key blocks of the grid's order, which
// would leave SMs idle in the last wave, each run as split_k work items (CTAs of a one-dimensional grid) over a range
// of query blocks apiece. dQ adds up as usual; each item writes its fp32 dK and dV to a slot of p.dkdv_partial and
// counts itself on its tile's p.split_counter, and the item that counts last sums the slots (in piece order, so the
// result does not depend on which ended last) and runs the epilogue.
//
// Head dim 256 (kColSplit): dK and dV of 64 keys x 256 (2 x 128 fp32 registers per thread) do not fit one warpgroup,
// so the two consumer warpgroups share one 64-key block: each computes S^T and dP^T for half of the block's queries,
// both write P^T and dS^T to shared memory, and after one barrier each computes dV, dK and dQ for half of the head
// dim with every operand in shared memory.
//
// With P = exp(scale Q K^T - lse) and D = rowsum(dO * O) from the preprocess kernel, as the SM80 backward.
#pragma once

#include "flashgen/sm90_common.cuh"   // first: it configures CuTe's wgmma shapes before any CuTe header
#include "flashgen/bwd_sm80.cuh"

namespace flashgen {

// Floats per row of a 64-column chunk of the fp32 dQ accumulator (dq_tile_index).
constexpr int kDqAccumRowFloats = 64;

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kCausal_,
          bool kLseSmem_ = false, bool kDropout_ = false, bool kEarlyDv_ = false, bool kDqHandoff_ = false,
          bool kSplit_ = false, bool kDqRed_ = false, bool kDq_ = true>
struct BwdSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;   // query rows per step
  static constexpr int kBlockN = kBlockN_;   // keys per block: 64 per consumer warpgroup
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  // lse and D of a query block through shared memory: each consumer thread loads one of the block's 2 x 64 values a
  // block ahead, instead of every thread loading its 2 x 16 columns and holding them across the GEMM wait.
  static constexpr bool kLseSmem = kLseSmem_;
  // Dropout: each block's keep flags regenerated from the forward's Philox mapping (bwd_sm90_keep_bits).
  static constexpr bool kDropout = kDropout_;
  // dV += P^T dO issued as soon as P is formed (before dP^T's wait) and dK += dS^T Q after the dQ GEMM, so the tensor
  // cores run dV while dS is formed, stored and the warpgroups meet, and dK while dQ goes out. Not with dropout (dV's
  // operand P Z is formed together with dS).
  static constexpr bool kEarlyDv = kEarlyDv_;
  static_assert(!(kEarlyDv && kDropout), "early_dv: no dropout variant");
  // dQ handoff: the two consumer warpgroups take turns computing a query block's whole dQ tile, and only the one
  // whose turn it is waits for the other's dS (a named barrier the other merely arrives at), instead of both meeting
  // at every block. The warpgroups can then drift apart, one's softmax and dS running under the other's GEMMs.
  static constexpr bool kDqHandoff = kDqHandoff_;
  // The mask as a second pass behind a block-uniform branch (blocks off the diagonal skip it) instead of a predicate
  // per entry inside the exp2 loop. At hdim 64 it removes ~150 instructions per block and lets early_dv pay on the
  // causal kernels (H100, twelfth session: causal +7-10%); at hdim 128, where dK and dV take twice the registers, the
  // extra live ranges spill (causal -18%), so those kernels keep the per-entry form (hdim 256 too: 5% slower with it,
  // fifteenth session).
  // With 128-row query blocks (head dim 64) the pass spills too (228 B vs 4 B without it).
  static constexpr bool kMaskPass = kHeadDim <= 64 && kBlockM == 64;
  static constexpr bool kColSplit = kHeadDim > 128;   // see the header comment
  static constexpr int kConsumerWGs = kColSplit ? 2 : kBlockN / 64;
  static constexpr bool kSplit = kSplit_;   // see the header comment
  // dQ added from registers: each thread's four values of a 64 x 64 fragment's column group (rows r, r + 8 x columns
  // c, c + 1) by one 16-byte red into an accumulator kept in fragment order (dq_frag_index), so a warp's red covers 512
  // contiguous bytes and no shared-memory stage, fence, barrier or stage read-out wait sits between dQ's GEMM and the
  // next block. The L2 traffic is the bulk reduce's. H100 (thirty-sixth session, ratio to cuDNN, 2k / 8k): hdim 64
  // causal (dq_handoff) +1.5-3%; hdim 128 -3 to -8%, hdim 64 non-causal -1 to -4% (where both warpgroups red every
  // block), so heuristics picks it per (bucket, causal).
  static constexpr bool kDqRed = kDqRed_;
  // Without dQ (the split schedule's dK / dV kernel; bwd_dq_sm90.cuh computes dQ): no dQ GEMM, stage or reduce, and
  // below head dim 256 no dS through shared memory and no barrier between the warpgroups.
  static constexpr bool kDq = kDq_;
  static_assert(kDq || (!kSplit && !kDqRed && !kDqHandoff && !kEarlyDv), "without dQ: none of dQ's options");
  static_assert(!kSplit || (!kCausal && !kDropout && !kColSplit), "split tail: non-causal, no dropout, head dim <= 128");
  static_assert(!kDqRed || !kColSplit, "dq red: one 64 x 64 dQ fragment per warpgroup (head dim <= 128)");
  static_assert(!kColSplit || (kBlockN == 64 && !kEarlyDv && !kDqHandoff),
                "head dim 256: one 64-key block, no early_dv or dq handoff");
  static constexpr int kNThreads = 128 * (kConsumerWGs + 1);
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kChunks = kHeadDim / 64;   // TMA boxes per tile row
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0 && kBlockN % 64 == 0, "");
  static_assert(kConsumerWGs == 1 || kConsumerWGs == 2, "");
  static_assert(!kDqHandoff || kConsumerWGs == 2, "dq handoff: two consumer warpgroups");
  static constexpr int kProducerRegs = kConsumerWGs == 2 ? 24 : 40;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 232;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= 65536, "register file");

  // dQ (block_m x head_dim) sums over all block_n keys. Its B operand (K, head-dim contiguous) is MN-major, and an
  // MN-major 128-byte-swizzled operand comes in 64-column spans: the consumer warpgroups split dQ's columns when
  // each share is whole spans, else they take turns computing the whole tile (one query block each).
  // With 128-row query blocks (head dim 64: FlashAttention 3's 128 x 128 tile) each warpgroup computes the dQ of 64
  // of the rows instead (kDqRowSplit): both warpgroups every block, each share one contiguous 64 x 64 chunk.
  static constexpr bool kDqRowSplit = kBlockM == 128;
  static_assert(!kDqRowSplit || (kConsumerWGs == 2 && kHeadDim == 64 && !kDqHandoff && !kColSplit),
                "128-row query blocks: head dim 64, two consumer warpgroups, no dq handoff");
  static constexpr bool kDqSplit = !kDqRowSplit && !kDqHandoff && kConsumerWGs > 1 &&
                                   kHeadDim % (64 * kConsumerWGs) == 0;
  static constexpr int kDqWGs = kDqSplit ? kConsumerWGs : 1;
  static constexpr int kDqCols = kHeadDim / kDqWGs;   // dQ columns per warpgroup
  // The fp32 dQ accumulator's tile order (dq_tile_index): 64-column chunks of kBlockM rows of 64 floats, so each
  // tile row is kDqAccumWidth = head_dim floats.
  static constexpr int kDqChunkStride = kDqAccumRowFloats;
  static constexpr int kDqAccumWidth = kHeadDim / 64 * kDqChunkStride;

  using AtomRows = Layout<Shape<Int<kConsumerWGs>, _1, _1>>;   // warpgroups stacked over the keys
  using AtomCols = Layout<Shape<_1, _2, _1>>;                    // kColSplit: two warpgroups side by side
  // K and V, the same for every query block, as the register A operands of S^T and dP^T (read from shared memory
  // once), where registers allow: 2 x 16 per thread at hdim 64. H100 (sixteenth session, ratio to cuDNN): causal
  // +2.6-3.8%, non-causal +0.5-1.1%; K or V alone +1-2% without spills, both ptxas spills 4 dQ-stage addresses
  // (16 B, reloaded once per dQ tile). At hdim 128 the 64 registers spill ~500 B.
  // With 128-row query blocks S^T and dP^T take 2 x 64 registers: no room (336 B of spills with them).
  static constexpr bool kSdpRs = kHeadDim <= 64 && kBlockM == 64;
  // S^T = K Q^T and dP^T = V dO^T: (block_n keys) x (block_m queries), reduction over the head dim; kColSplit: each
  // warpgroup half of the queries.
  using SdpShape = Shape<_64, Int<kColSplit ? kBlockM / 2 : kBlockM>, Int<kHeadDim>>;
  using MmaSdP = decltype(make_tiled_mma(
      cute::conditional_t<kSdpRs, decltype(SM90::GMMA::rs_op_selector<Element, Element, float, SdpShape>()),
                          decltype(SM90::GMMA::ss_op_selector<Element, Element, float, SdpShape>())>{},
      cute::conditional_t<kColSplit, AtomCols, AtomRows>{}));
  // dV += P^T dO and dK += dS^T Q: (block_n) x (head_dim), reduction over the queries, A from registers; kColSplit:
  // each warpgroup half of the head dim, A (P^T, dS^T) from shared memory.
  using MmaDkv = cute::conditional_t<kColSplit,
      decltype(make_tiled_mma(
          SM90::GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, Int<kBlockM>>,
                                     GMMA::Major::K, GMMA::Major::MN>(),
          AtomCols{})),
      decltype(make_tiled_mma(
          SM90::GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                                     GMMA::Major::MN>(),
          AtomRows{}))>;
  // dQ = dS K: (block_m) x (head_dim / kDqWGs per warpgroup), reduction over the keys, both operands MN-major.
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / kDqWGs>, Int<kBlockN>>,
                                 GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kBlockM / 64>, Int<kDqWGs>, _1>>{}));
  static_assert(kBlockM == 64 || kDqRowSplit, "one 64-row wgmma per dQ tile and warpgroup");

  // Tiles as TMA writes them: 8 x 64 swizzled atoms, rows first, each 64-column chunk one box.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // (head_dim x rows) views of the same bytes: MN-major B operands.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS (queries x keys, queries contiguous: the A operand of dQ, MN-major), two buffers so that one barrier per
  // query block suffices; the consumers write it through the (keys x queries) view of their accumulators.
  using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kBlockM>, Int<kBlockN>, _2>{}));
  using SmemLayoutdSt = decltype(composition(
      tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>>{}),
      make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Step<_2, _1>{})));
  // kColSplit: P^T and dS^T as the A operands of dV and dK, (keys x queries) K-major, two buffers: the same bytes as
  // SmemLayoutdS (an MN-major (queries x keys) tile is a K-major (keys x queries) one).
  using SmemLayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                              Shape<Int<kBlockN>, Int<kBlockM>, _2>{}));

  static constexpr int kQElems = kBlockM * kHeadDim;   // per stage, also dO
  static constexpr int kKElems = kBlockN * kHeadDim;   // also V
  static constexpr int kdSElems = kBlockM * kBlockN;   // per buffer
  // Q stages, dO stages, K, V, 2 dS buffers (kColSplit: and 2 P^T buffers), each consumer warpgroup's fp32 dQ share
  // (the source of its bulk reduce; with the handoff one stage that the warpgroups fill in turns), then the mbarriers
  // (8 bytes each): K/V full, Q/dO full and empty.
  // per consumer warpgroup: its 64-column chunks of 64 rows each
  static constexpr int kDqStageFloats = kDqCols / 64 * 64 * kDqChunkStride;
  static constexpr int kDqStages = kDqRed || !kDq ? 0 : kDqHandoff ? 1 : kConsumerWGs;
  // kColSplit: two P^T buffers after the dS ones.
  static constexpr int kPtOffset = (2 * kStages * kQElems + 2 * kKElems + 2 * kdSElems) * int(sizeof(Element));
  static constexpr int kDqStageOffset = kPtOffset + (kColSplit ? 2 * kdSElems * int(sizeof(Element)) : 0);
  static constexpr int kBarrierOffset = kDqStageOffset + kDqStages * kDqStageFloats * 4;
  static constexpr int kNBarriers = 1 + 2 * kStages;
  // kLseSmem: per consumer warpgroup two buffers of (lse base 2, D) x kBlockM floats, kLseVals per thread.
  static constexpr int kLseOffset = kBarrierOffset + kNBarriers * 8;
  // kDropout: per warp pair two buffers of 64 words (bwd_sm90_keep_bits' exchange).
  static constexpr int kKeepOffset = kLseOffset + (kLseSmem ? kConsumerWGs * 2 * 2 * kBlockM * 4 : 0);
  // kColSplit with dropout: warps w and w ^ 1 share the Philox calls on the non-causal kernels only
  // (bwd_sm90_keep_bits_col_split).
  static constexpr bool kColSplitPairs = kColSplit && kDropout && !kCausal;
  static constexpr int kSmemBytes = kKeepOffset + (kDropout && (!kColSplit || kColSplitPairs) ?
                                                   kConsumerWGs * 2 * 2 * 64 * 4 : 0);
  static constexpr int kLseVals = 2 * kBlockM / 128;
  static_assert(!kLseSmem || 2 * kBlockM % 128 == 0, "whole values per consumer thread");

  using Tiles = RowTiles<Element, kHeadDim, kConsumerThreads>;   // the epilogue's 16-byte stores
};

// Order of the fp32 dQ accumulator inside one (kBlockM x head_dim) tile: 64-column chunks one after another, each
// kBlockM rows of 64 floats, the 8-float units of row r permuted by XOR with r % 8. That puts the 8 rows of a warp's
// 8-byte stores of accumulator pairs on all eight 32-byte bank groups (2 wavefronts per store, the minimum) without
// padding (which cost 12.5% more accumulator traffic: memset, bulk reduces, conversion). The shared-memory shares are
// laid out the same way and copied byte for byte by the bulk reduce; bwd_sm90_convert_dq reads with this function
// too (8-column units stay contiguous).
template <int kBlockM>
__device__ __forceinline__ int dq_tile_index(int row, int col) {
  return (col / 64) * (kBlockM * kDqAccumRowFloats) + row * kDqAccumRowFloats + ((col % 64) ^ (8 * (row % 8)));
}

// Order of the fp32 dQ accumulator with kDqRed: one (kBlockM x head_dim) tile is 64 x 64 chunks (column chunk major),
// each in the order a warpgroup's m64n64 wgmma fragment comes out: (column group of 8, thread) x the thread's 4 values
// of the group, (row r, column c), (r, c + 1), (r + 8, c), (r + 8, c + 1). Thread t of the warpgroup holds rows
// 16 (t / 32) + (t % 32) / 4 (+ 8) and columns 2 (t % 4) (+ 1) of each group. bwd_sm90_convert_dq reads it back.
template <int kBlockM>
__device__ __forceinline__ int dq_frag_index(int row, int col) {
  const int r = row % 64, c = col % 64;
  const int chunk = (col / 64) * (kBlockM / 64) + row / 64;
  const int thread = (r / 16) * 32 + (r % 8) * 4 + (c % 8) / 2;
  return chunk * 4096 + ((c / 8) * 128 + thread) * 4 + (c % 2) + 2 * ((r % 16) / 8);
}

// Adds `bytes` of fp32 from shared memory into global memory in the background (one thread issues it); the reads
// of shared memory are awaited with bulk_wait_read, the whole operation with bulk_wait_all.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, float const* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(gmem), "r"(cast_smem_ptr_to_uint(smem)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// The backward producers' loads (bwd_sm90 and bwd_dq_sm90, the roles of Q / dO and K / V swapped): one tile pair
// loaded once, completing on `once`, then a ring of kStages pairs, stage s filled on full[s] and handed back on
// empty[s] by one arrival per consumer warp.
template <int kStages, int kConsumerWarps, class Barrier>
__device__ __forceinline__ void init_producer_barriers(Barrier& once, Barrier* full, Barrier* empty) {
  once.init(1);
  for (int s = 0; s < kStages; ++s) {
    full[s].init(1);
    empty[s].init(kConsumerWarps);
  }
  cutlass::arch::fence_barrier_init();
}

// Two tiles of kRows rows (a and b, each stored as kChunks 64-column boxes of kRows x 64) at `row` of their tensor
// maps, both completing on `bar`, which first expects their bytes.
template <int kRows, int kChunks, class Element, class Barrier>
__device__ __forceinline__ void tma_load_pair(Barrier& bar, cute::TmaDescriptor const& map_a, Element* a,
                                              cute::TmaDescriptor const& map_b, Element* b, int row, int head,
                                              int batch) {
  bar.arrive_and_expect_tx(2 * kRows * kChunks * 64 * int(sizeof(Element)));
  tma_load_tile<kRows, kChunks>(bar, map_a, a, row, head, batch);
  tma_load_tile<kRows, kChunks>(bar, map_b, b, row, head, batch);
}

// The dropout keep flags of a consumer thread's S^T entries: the flag of row r (key, + 8) and column j (query) of
// its rowcol view is bit bwd_sm90_keep_bit<K>(r, j), in the forward's mapping (dropout.cuh: one Philox call per 16
// queries x 32 keys gives one lane of the forward's fragment its 16 entries). Transposed, a thread's keys share the
// call's key fields and its queries need kBlockM / 8 calls, four entries from each. The same calls serve four
// threads: lanes l and l ^ 4 of a warp take other words of them, and the same lane of warps w and w ^ 1 (keys 16
// apart, the same 32-key field) other bytes. So each thread of a warp pair draws a quarter of the calls: the lanes
// swap words by shuffles, the warps swap the finished flags of each other's bytes through `xchg` (64 words per warp
// pair; the caller alternates two buffers by block). That is the forward's Philox work per entry. Flags go four at
// a time: the four bytes (two per word) gathered into one word, compared bytewise (Dropout::keep_flags), their msbs
// multiplied into the top four bits and shifted in. Coordinates only, so it runs while the S^T and dP^T GEMMs do.
//
// Bit layout: the warp of parity c draws the calls t = c kPairs + u (u < kPairs) into bits 16 c .. 16 c + 15; call t
// covers query slabs jp = t / 2 and kPairs + t / 2 of the block, with query % 2 = t % 2 (four flags per slab: query
// j's half (j / 2) % 2 and the two keys r). Groups are shifted in from the right, the first ending highest.
template <class K>
__host__ __device__ constexpr int bwd_sm90_keep_bit(int r, int j) {
  if (K::kColSplit) return 8 * r + j;   // bwd_sm90_keep_bits_col_split
  constexpr int kPairs = K::kBlockM / 32, kGroups = 2 * kPairs;
  const int b = j % 2, half = (j / 2) % 2, jp = j / 4;
  const int t = 2 * (jp % kPairs) + b, c = t / kPairs, u = t % kPairs;
  const int group = 2 * u + (jp >= kPairs ? 1 : 0);
  return 16 * c + 4 * (kGroups - 1 - group) + 2 * half + r;
}

template <class K>
__device__ __forceinline__ uint32_t bwd_sm90_keep_bits(Dropout const& d, int n_block, int m_block, int ctidx,
                                                       uint32_t* xchg) {
  constexpr int kPairs = K::kBlockM / 32;
  static_assert(K::kBlockM == 64, "16 flags per warp of a pair: one half of the word");
  const int lane = ctidx % 32, warp = (ctidx / 32) % 4, wg = ctidx / 128;
  const int c = warp % 2;   // this warp's parity in its pair
  // Keys n_block * kBlockN + 64 wg + 16 warp + lane / 4 (+ 8): key / 32, (key % 8) / 2 and key % 2 (the word's low
  // bit) are the same for both; key / 8 % 4 (the byte) is 2 c (+ 1).
  const uint32_t key_blk = uint32_t(n_block * K::kBlockN / 32 + 2 * wg + warp / 2);
  const uint32_t lane_k = uint32_t(lane / 4) >> 1;
  const bool odd = (lane / 4) & 1;   // this lane's words are y and w; its partner lane ^ 4's are x and z
  // Byte selectors: this warp's two bytes of the first word then of the second; the partner warp's.
  const uint32_t sel_mine = c ? 0x7632u : 0x5410u, sel_theirs = sel_mine ^ 0x2222u;
  auto flags4 = [&](uint32_t w) { return (d.keep_flags(w) & 0x80808080u) * 0x00204081u; };   // -> bits 28..31
  uint32_t mine = 0, theirs = 0;
  CUTE_UNROLL
  for (int u = 0; u < kPairs; ++u) {
    const int t = c * kPairs + u, b = t % 2;
    const uint32_t q7 = uint32_t(2 * (lane % 4) + b);   // query % 8
    // The even lane keeps slab t / 2, the odd one slab kPairs + t / 2.
    const uint4 r = philox4x32_10(d.key, make_uint4(key_blk, uint32_t(m_block * K::kBlockM / 16 + (odd ? kPairs : 0) + t / 2),
                                                     d.bh_bits | (q7 << 2) | lane_k, d.offset));
    // Words for queries < 8 and >= 8 of the slab (x/y, z/w): keep mine, send the partner its own.
    const uint32_t mine0 = odd ? r.y : r.x, mine1 = odd ? r.w : r.z;
    const uint32_t other0 = __shfl_xor_sync(0xffffffffu, odd ? r.x : r.y, 4);
    const uint32_t other1 = __shfl_xor_sync(0xffffffffu, odd ? r.z : r.w, 4);
    const uint32_t lo0 = odd ? other0 : mine0, lo1 = odd ? other1 : mine1;   // slab t / 2
    const uint32_t hi0 = odd ? mine0 : other0, hi1 = odd ? mine1 : other1;   // slab kPairs + t / 2
    mine = __funnelshift_l(flags4(__byte_perm(lo0, lo1, sel_mine)), mine, 4);
    mine = __funnelshift_l(flags4(__byte_perm(hi0, hi1, sel_mine)), mine, 4);
    theirs = __funnelshift_l(flags4(__byte_perm(lo0, lo1, sel_theirs)), theirs, 4);
    theirs = __funnelshift_l(flags4(__byte_perm(hi0, hi1, sel_theirs)), theirs, 4);
  }
  xchg[32 * c + lane] = theirs;
  asm volatile("bar.sync %0, 64;\n" ::"r"(8 + 2 * wg + warp / 2));   // the warp pair's own barrier (ids 8..11)
  return __byte_perm(mine, xchg[32 * (1 - c) + lane], c ? 0x1054u : 0x5410u);
}

// kColSplit: the keep flags of a consumer thread's 2 keys x 8 queries of S^T (its warpgroup's 32 queries), bit 8 r + j
// of the rowcol view. Query j is 32 wg + 8 (j / 2) + 2 (lane % 4) + j % 2 of the block, so the thread's entries come
// from four Philox calls (query / 16 and query % 2), each giving two words (query / 8 % 2) whose bytes (key / 8 % 4)
// hold both keys. Four threads make the same four calls: lanes l and l ^ 4 (keys k, k ^ 1) take the other two words,
// warps w and w ^ 1 (keys 16 apart) the other two bytes. kColSplitPairs: each draws one (query / 16 = its key's
// parity, query % 2 = its warp's), the lanes swap words by shuffles and the warps the finished flags of each other's
// bytes through `xchg` (as bwd_sm90_keep_bits): the forward's Philox work per entry. Otherwise only the lanes share:
// each draws two calls (query / 16 = its key's parity), twice the forward's work, without the warp pair's barrier.
// H100 (fifteenth session, cost over the dropout-free backward at 2k / 8k, lanes -> lanes and warps): 22% / 24% ->
// 12% / 15%, causal 12% / 12% -> 17% / 18%; so the warps share on the non-causal kernels only.
template <class K>
__device__ __forceinline__ uint32_t bwd_sm90_keep_bits_col_split(Dropout const& d, int n_block, int m_block, int ctidx,
                                                                 uint32_t* xchg) {
  static_assert(K::kBlockM == 64 && K::kBlockN == 64, "");
  const int lane = ctidx % 32, warp = (ctidx / 32) % 4, wg = ctidx / 128;
  const int key = n_block * K::kBlockN + 16 * warp + lane / 4;   // row r: key + 8 r
  const int c = warp % 2;           // bytes 2 c, 2 c + 1 are this warp's keys, the others its partner warp's
  const int odd = key & 1;          // words y, w are this lane's, x, z its partner lane's
  const int q0 = m_block * K::kBlockM + 32 * wg + 2 * (lane % 4);
  uint32_t mine = 0, theirs = 0;
  if constexpr (!K::kColSplitPairs) {
    auto set2 = [&](uint32_t w, int j) {   // column j = 4 jj + 2 h + b, this warp's two keys
      mine |= uint32_t(((w >> (16 * c)) & 0xffu) >= d.threshold) << j;
      mine |= uint32_t(((w >> (16 * c + 8)) & 0xffu) >= d.threshold) << (8 + j);
    };
    CUTE_UNROLL
    for (int b = 0; b < 2; ++b) {
      const uint4 r = philox4x32_10(d.key, d.counter(q0 + b + 16 * odd, key));   // jj = odd
      const uint32_t other0 = __shfl_xor_sync(0xffffffffu, odd ? r.x : r.y, 4);    // the partner lane's call
      const uint32_t other1 = __shfl_xor_sync(0xffffffffu, odd ? r.z : r.w, 4);
      set2(odd ? r.y : r.x, 4 * odd + b);
      set2(odd ? r.w : r.z, 4 * odd + 2 + b);
      set2(other0, 4 * (1 - odd) + b);
      set2(other1, 4 * (1 - odd) + 2 + b);
    }
    return mine;
  }
  const uint4 r = philox4x32_10(d.key, d.counter(q0 + c + 16 * odd, key));
  const uint32_t other0 = __shfl_xor_sync(0xffffffffu, odd ? r.x : r.y, 4);   // the partner lane's call: jj = !odd
  const uint32_t other1 = __shfl_xor_sync(0xffffffffu, odd ? r.z : r.w, 4);
  auto set = [&](uint32_t w, int j) {   // column j = 4 jj + 2 h + c: both warps' two keys
    mine |= uint32_t(((w >> (16 * c)) & 0xffu) >= d.threshold) << j;
    mine |= uint32_t(((w >> (16 * c + 8)) & 0xffu) >= d.threshold) << (8 + j);
    theirs |= uint32_t(((w >> (16 - 16 * c)) & 0xffu) >= d.threshold) << j;
    theirs |= uint32_t(((w >> (24 - 16 * c)) & 0xffu) >= d.threshold) << (8 + j);
  };
  set(odd ? r.y : r.x, 4 * odd + c);
  set(odd ? r.w : r.z, 4 * odd + 2 + c);
  set(other0, 4 * (1 - odd) + c);
  set(other1, 4 * (1 - odd) + 2 + c);
  xchg[32 * c + lane] = theirs;
  asm volatile("bar.sync %0, 64;\n" ::"r"(8 + 2 * wg + warp / 2));   // the warp pair's own barrier (ids 8..11)
  return mine | xchg[32 * (1 - c) + lane];
}

template <class K, class Params>
__device__ __forceinline__ void bwd_sm90(Params const& p, char* smem) {
  using Element = typename K::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kHeadDim = K::kHeadDim, kStages = K::kStages;
  const int tidx = threadIdx.x;
  const int warpgroup = tidx / 128;
  // Causal: key blocks heaviest first (n_block 0 sees the most query blocks) over groups of heads (grouped_tile).
  const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int2 tile;
  [[maybe_unused]] int piece = -1;
  if constexpr (K::kSplit) {
    // The natural order (key blocks of a head, heads, batches) over a one-dimensional grid of work items when split,
    // the usual three-dimensional grid when not (both number the tiles alike).
    const int n_blocks_k = (p.seqlen_k + kBlockN - 1) / kBlockN;
    const SplitItem item = split_item(cta, n_blocks_k * p.nheads * p.batch, p.split_tiles, p.split_k);
    tile = make_int2(item.tile % n_blocks_k, item.tile / n_blocks_k);
    piece = item.piece;
  } else {
    tile = grouped_tile(cta, gridDim.x, gridDim.y * gridDim.z, K::kCausal ? p.head_group : 0);
  }
  const int heads = K::kSplit ? p.nheads : int(gridDim.y);
  const int n_block = tile.x, bidh = tile.y % heads, bidb = tile.y / heads;
  const int bidh_k = bidh / (p.nheads / p.nheads_k);
  const BwdSeq seq(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, bidb);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  if (n_block * kBlockN >= seqlen_k) return;
  const int batch_crd = seq.varlen ? 0 : bidb;   // varlen tensor maps: one "batch", rows offset by cu_seqlens

  // Query blocks that see a key of this block; causal is aligned to the bottom-right corner.
  const int diag_shift = seqlen_k - seqlen_q;
  const int m_block_max = (seqlen_q + kBlockM - 1) / kBlockM;
  const int m_block_min = K::kCausal ? max(0, (n_block * kBlockN - diag_shift) / kBlockM) : 0;
  int n_iters = max(0, m_block_max - m_block_min);
  int m_top = m_block_max - 1;   // non-causal: step 0's query block
  if constexpr (K::kSplit) {
    if (piece >= 0) {   // a split tail's piece: its range of the walk's steps
      const int begin = piece * n_iters / p.split_k;
      m_top -= begin;
      n_iters = (piece + 1) * n_iters / p.split_k - begin;
    }
  }
  // Step i's query block: the last first, except with causal, where each key block starts at its diagonal block and
  // walks down the queries, so the CTAs of a head start on different dQ tiles. H100 (sixteenth session, ratio to
  // cuDNN, 2k / 8k, from the last block first): hdim 256 +2-3%, hdim 128 and 64 +1%.
  auto m_of = [&](int i) { return K::kCausal ? m_block_min + i : m_top - i; };

  Element* base = reinterpret_cast<Element*>(smem);
  Element* q_smem = base;
  Element* do_smem = q_smem + kStages * K::kQElems;
  Element* k_smem = do_smem + kStages * K::kQElems;
  Element* v_smem = k_smem + K::kKElems;
  Element* ds_smem = v_smem + K::kKElems;
  float* dq_stage = reinterpret_cast<float*>(smem + K::kDqStageOffset);
  Barrier* bar = reinterpret_cast<Barrier*>(smem + K::kBarrierOffset);
  Barrier& full_kv = bar[0];
  Barrier* full = bar + 1;
  Barrier* empty = full + kStages;

  if (tidx == 0) init_producer_barriers<kStages, 4 * K::kConsumerWGs>(full_kv, full, empty);
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<K::kProducerRegs>();
    if (tidx == 0 && n_iters > 0) {
      tma_load_pair<kBlockN, K::kChunks>(full_kv, p.tma_k, k_smem, p.tma_v, v_smem, seq.k_row0 + n_block * kBlockN,
                                         bidh_k, batch_crd);
      for (int i = 0; i < n_iters; ++i) {
        const int s = i % kStages;
        empty[s].wait(((i / kStages) & 1) ^ 1);   // the first round finds every buffer free
        tma_load_pair<kBlockM, K::kChunks>(full[s], p.tma_q, q_smem + s * K::kQElems, p.tma_do,
                                           do_smem + s * K::kQElems, seq.q_row0 + m_of(i) * kBlockM, bidh, batch_crd);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<K::kConsumerRegs>();
  const int ctidx = tidx - 128;   // thread index among the consumers
  const int wg = ctidx / 128;
  const bool warp_leader = ctidx % 32 == 0;
  const bool wg_leader = ctidx % 128 == 0;   // issues this warpgroup's bulk reduces
  float* my_dq_stage = dq_stage + (K::kDqStages > 1 ? wg * K::kDqStageFloats : 0);
  const int dq_col0 = K::kDqSplit ? wg * K::kDqCols : 0;   // first dQ column of this warpgroup's share
  const int dq_row0 = K::kDqRowSplit ? wg * 64 : 0;         // and its first row

  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename K::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(do_smem), typename K::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(k_smem), typename K::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(v_smem), typename K::SmemLayoutK{});
  Tensor sQt = make_tensor(make_smem_ptr(q_smem), typename K::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(do_smem), typename K::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(k_smem), typename K::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ds_smem), typename K::SmemLayoutdS{});
  [[maybe_unused]] Element* pt_smem = reinterpret_cast<Element*>(smem + K::kPtOffset);   // kColSplit

  typename K::MmaSdP mma_sdp;
  typename K::MmaDkv mma_dkv;
  typename K::MmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ctidx);
  auto thr_dkv = mma_dkv.get_thread_slice(ctidx);
  // Taking turns, each warpgroup computes the whole dQ tile as warpgroup 0 of a one-warpgroup MMA.
  auto thr_dq = mma_dq.get_thread_slice(K::kDqSplit || K::kDqRowSplit ? ctidx : ctidx % 128);
  // kColSplit: the shared-memory operands' descriptors from the slices of a warp-uniform index (the warpgroup's first
  // thread, through a shuffle ptxas sees as uniform), so they are built in uniform registers instead of moved there
  // (R2UR) before every wgmma. H100 (sixteenth session): hdim 256 loop 840 -> 769 instructions, its spills gone,
  // +2-3.5% vs cuDNN; hdim 128 level to -1.5% (one more spill in the loop), so only the column split takes it.
  const int desc_tidx = K::kColSplit ? __shfl_sync(0xffffffffu, ctidx / 128, 0) * 128 : ctidx;
  auto thr_sdp_desc = mma_sdp.get_thread_slice(desc_tidx);
  auto thr_dkv_desc = mma_dkv.get_thread_slice(desc_tidx);
  Tensor tSrK = thr_sdp_desc.partition_fragment_A(sK);   // wgmma descriptors (kSdpRs: registers, from thr_sdp)
  Tensor tSrV = thr_sdp_desc.partition_fragment_A(sV);
  Tensor tSrQ = thr_sdp_desc.partition_fragment_B(sQ);   // (.., .., .., stages)
  Tensor tSrdO = thr_sdp_desc.partition_fragment_B(sdO);
  Tensor tDVrdOt = thr_dkv_desc.partition_fragment_B(sdOt);
  Tensor tDKrQt = thr_dkv_desc.partition_fragment_B(sQt);
  // kColSplit: dV's and dK's A operands, P^T and dS^T from shared memory (both warpgroups read all of them).
  [[maybe_unused]] auto tDVrPt = thr_dkv_desc.partition_fragment_A(
      make_tensor(make_smem_ptr(pt_smem), typename K::SmemLayoutPt{}));
  [[maybe_unused]] auto tDKrdSt = thr_dkv_desc.partition_fragment_A(
      make_tensor(make_smem_ptr(ds_smem), typename K::SmemLayoutPt{}));
  // dQ's operand descriptors from slices with constant thread indices (warpgroup 0's and 1's columns), so that
  // they stay in uniform registers; from thr_dq they are per-thread values, 16 registers that spill at hdim 128.
  auto thr_dq_wg0 = mma_dq.get_thread_slice(0);
  auto thr_dq_wg1 = mma_dq.get_thread_slice(K::kDqSplit || K::kDqRowSplit ? 128 : 0);
  Tensor tDQrdS = thr_dq_wg0.partition_fragment_A(sdS);   // (.., .., .., buffer); warpgroup 0's rows
  [[maybe_unused]] Tensor tDQrdS_wg1 = thr_dq_wg1.partition_fragment_A(sdS);   // kDqRowSplit: warpgroup 1's
  Tensor tDQrKt_wg0 = thr_dq_wg0.partition_fragment_B(sKt);
  Tensor tDQrKt_wg1 = thr_dq_wg1.partition_fragment_B(sKt);
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of each S^T entry this thread holds; the rows are keys, the columns queries.
  Tensor tScS = rowcol_sm90(thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{})));
  Tensor tDQcDQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  constexpr int kRows = decltype(size<0>(tScS))::value;
  constexpr int kCols = decltype(size<1>(tScS))::value;

  const int64_t lse_off = seq.lse_off(bidb, p.lse_batch_stride) + bidh * p.lse_head_stride;
  float const* lse_ptr = static_cast<float const*>(p.lse) + lse_off;
  float const* dsum_ptr = static_cast<float const*>(p.dsum) + lse_off;
  const float scale_log2 = p.scale_log2;
  // kLseSmem: this thread's value of query block i (lse in base 2 for threads 0..63 of the warpgroup, D above);
  // columns past the sequence get lse = +inf (P = 0, as rows that saw no key) and D = 0.
  const int lse_t = ctidx % 128;
  float* lse_buf = reinterpret_cast<float*>(smem + K::kLseOffset) + wg * 4 * kBlockM;
  // kDropout: this warp pair's two exchange buffers of bwd_sm90_keep_bits (one per block parity: the partner
  // reads a block's words before it passes the next block's pair barrier).
  [[maybe_unused]] uint32_t* keep_xchg = reinterpret_cast<uint32_t*>(smem + K::kKeepOffset) + (ctidx / 64) * 2 * 64;
  // lse in base 2 for the exp2 of P; a query row that saw no key (lse -inf), or one past the sequence, gets +inf.
  auto lse_base2 = [](float l) { return l == -kInf ? kInf : l * 1.4426950408889634f; };
  // The raw value: lse_base2 is applied when it is stored a block later, so no instruction waits on the load now
  // (converted at once, the load's latency sat in every block: 5% of the H100's stall samples at hdim 128).
  // Value v of this thread is entry lse_t + 128 v of the buffer: lse of the block's queries, then their D.
  auto fetch_lse = [&](int i, int v) {
    const int e = lse_t + 128 * v, m_block = m_of(i), col = e % kBlockM;
    const bool in_seq = col < seqlen_q - m_block * kBlockM;
    if (e < kBlockM) return in_seq ? lse_ptr[m_block * kBlockM + col] : -kInf;
    return in_seq ? dsum_ptr[m_block * kBlockM + col] : 0.f;
  };
  [[maybe_unused]] float lse_next[K::kLseVals];
  if constexpr (K::kLseSmem) {
    CUTE_UNROLL
    for (int v = 0; v < K::kLseVals; ++v) lse_next[v] = n_iters > 0 ? fetch_lse(0, v) : 0.f;
  }
  [[maybe_unused]] const Dropout dropout = K::kDropout ? Dropout(p.rng_state, bidb * p.nheads + bidh,
                                                                 p.dropout_threshold, p.rp_dropout)
                                                       : Dropout();

  if (n_iters > 0) {
    full_kv.wait(0);
    if constexpr (K::kSdpRs) {
      copy(thr_sdp.partition_A(sK), tSrK);
      copy(thr_sdp.partition_A(sV), tSrV);
    }
  }
  // The query walk as one guarded loop that tests at its end, with S^T's accumulator declared outside it. H100
  // (twenty-eighth session, ratio to cuDNN, base / the for loop with acc_s inside): hdim 64 0.987 / 0.969 at 2k,
  // 0.984 / 0.979 at 8k, causal 1.006 / 0.997 and 1.010 / 0.985; hdim 128 1.006 / 1.000, 0.987 / 0.983, causal
  // 1.020 / 0.989 and 1.009 / 1.015; and the hdim 64 kernel's 4 B of spills are gone. The 128-row blocks take dP^T's
  // outside too (1.005 / 0.991 at 2k, 1.004 / 0.986 at 8k; the other kernels level or 0.5-1% slower with it).
  Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  [[maybe_unused]] Tensor acc_dp_walk = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  if (n_iters > 0) {
    for (int i = 0;;) {
      const int m_block = m_of(i), s = i % kStages, buf = i & 1;
      const uint32_t phase = (i / kStages) & 1;
      [[maybe_unused]] Tensor acc_dp_block = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      auto& acc_dp = K::kDqRowSplit ? acc_dp_walk : acc_dp_block;
      full[s].wait(phase);
      wgmma_issue<true>(mma_sdp, tSrK, tSrQ(_, _, _, s), acc_s);
      wgmma_issue<true>(mma_sdp, tSrV, tSrdO(_, _, _, s), acc_dp);
      [[maybe_unused]] uint32_t keep_bits = 0;
      if constexpr (K::kDropout && K::kColSplit) {
        keep_bits = bwd_sm90_keep_bits_col_split<K>(dropout, n_block, m_block, ctidx, keep_xchg + buf * 64);
      } else if constexpr (K::kDropout) {
        keep_bits = bwd_sm90_keep_bits<K>(dropout, n_block, m_block, ctidx, keep_xchg + buf * 64);
      }

      // lse (base 2) and D of this thread's query columns, loaded while the GEMMs run. Columns past the sequence
      // (their Q rows are zeros or another sequence's) get lse = +inf, as rows that saw no key: P = 0 there.
      float lse_l2[kCols], dsum[kCols];
      [[maybe_unused]] float* lse_cur = lse_buf + buf * 2 * kBlockM;   // kLseSmem: this block's buffer
      if constexpr (K::kLseSmem) {
        // Buffer `buf` was last read two blocks ago, before this warpgroup passed the previous block's barrier.
        CUTE_UNROLL
        for (int v = 0; v < K::kLseVals; ++v) {
          const int e = lse_t + 128 * v;
          lse_cur[e] = e < kBlockM ? lse_base2(lse_next[v]) : lse_next[v];
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(4 + wg));
        if (i + 1 < n_iters) {
          CUTE_UNROLL
          for (int v = 0; v < K::kLseVals; ++v) lse_next[v] = fetch_lse(i + 1, v);
        }
      } else {
        const int q_rows_left = seqlen_q - m_block * kBlockM;
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const int col = get<1>(tScS(0, j));
          lse_l2[j] = lse_base2(col < q_rows_left ? lse_ptr[m_block * kBlockM + col] : -kInf);
          dsum[j] = col < q_rows_left ? dsum_ptr[m_block * kBlockM + col] : 0.f;
        }
      }
      const bool need_mask = (n_block + 1) * kBlockN > seqlen_k ||
                             (K::kCausal && (n_block + 1) * kBlockN - 1 > m_block * kBlockM + diag_shift);

      warpgroup_wait<1>();   // S^T is in; dP^T may still run
      warpgroup_fence_operand(acc_s);
      if constexpr (K::kLseSmem) {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) lse_l2[j] = lse_cur[get<1>(tScS(0, j))];
      }
      // Keys past the sequence (zeros, or the next sequence's keys with varlen) and, with causal, keys right of the
      // bottom-right-aligned diagonal get P = 0.
      Tensor st = rowcol_sm90(acc_s);
      // Per key (row) the first query (column) that sees it; the queries below it are cut.
      auto first_query = [&](int r) {
        const int key = n_block * kBlockN + get<0>(tScS(r, 0));
        return key >= seqlen_k ? kBlockM : K::kCausal ? key - m_block * kBlockM - diag_shift : 0;
      };
      if constexpr (K::kMaskPass) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int j = 0; j < kCols; ++j) st(r, j) = exp2f(fmaf(st(r, j), scale_log2, -lse_l2[j]));
        }
        if (need_mask) {
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            const int first = first_query(r);
            CUTE_UNROLL
            for (int j = 0; j < kCols; ++j) {
              if (get<1>(tScS(r, j)) < first) st(r, j) = 0.f;
            }
          }
        }
      } else if constexpr (K::kCausal) {
        // Without the mask pass, causal kernels test each entry against its key's first query (0 where the block
        // needs no mask): one compare with a constant column offset instead of the causal predicate. H100, twentieth
        // session, ratio to cuDNN at 2k / 8k: hdim 128 causal 0.934-0.948 / 0.937-0.947 -> 0.962 / 0.976, hdim 256
        // causal level; non-causal kernels, whose mask is per key, measured 1-3% slower with it.
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int first = need_mask ? first_query(r) : 0;
          CUTE_UNROLL
          for (int j = 0; j < kCols; ++j) {
            const float pv = exp2f(fmaf(st(r, j), scale_log2, -lse_l2[j]));
            st(r, j) = get<1>(tScS(r, j)) < first ? 0.f : pv;
          }
        }
      } else {
        // Non-causal: only keys past the sequence are cut, a test per key.
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const bool cut = need_mask && n_block * kBlockN + get<0>(tScS(r, 0)) >= seqlen_k;
          CUTE_UNROLL
          for (int j = 0; j < kCols; ++j) {
            const float pv = exp2f(fmaf(st(r, j), scale_log2, -lse_l2[j]));
            st(r, j) = cut ? 0.f : pv;
          }
        }
      }
      constexpr bool kEarlyDv = K::kEarlyDv;   // see BwdSm90::kEarlyDv
      if constexpr (kEarlyDv) {
        Tensor p_frag = convert_fragment<Element>(acc_s);
        Tensor tPr = make_tensor(p_frag.data(), acc_as_a_layout_sm90(p_frag.layout()));
        warpgroup_fence_operand(tPr);
        wgmma_issue<false>(mma_dkv, tPr, tDVrdOt(_, _, _, s), acc_dv);
        warpgroup_wait<1>();   // dP^T is in; dV may still run
      } else {
        warpgroup_wait<0>();
      }
      warpgroup_fence_operand(acc_dp);
      if constexpr (K::kLseSmem) {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) dsum[j] = lse_cur[kBlockM + get<1>(tScS(0, j))];
      }
      Tensor dpt = rowcol_sm90(acc_dp);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          if constexpr (K::kDropout) {
            // Mask Z, kept entries scaled by rp in the forward: dS = P (rp Z dP - D); P Z is dV's operand (dV *= rp
            // in the epilogue).
            const bool keep = (keep_bits >> bwd_sm90_keep_bit<K>(r, j)) & 1u;
            dpt(r, j) = st(r, j) * fmaf(dpt(r, j), keep ? p.rp_dropout : 0.f, -dsum[j]);
            if (!keep) st(r, j) = 0.f;
          } else {
            dpt(r, j) = st(r, j) * (dpt(r, j) - dsum[j]);
          }
        }
      }

      // dV += P^T dO, dK += dS^T Q with the 16-bit P^T and dS^T as register A operands.
      Tensor ds_frag = convert_fragment<Element>(acc_dp);
      Tensor tdSr = make_tensor(ds_frag.data(), acc_as_a_layout_sm90(ds_frag.layout()));
      if constexpr (K::kColSplit) {
        // P^T to shared memory too: dV needs every query's P^T, half of which the other warpgroup holds.
        Tensor p_frag = convert_fragment<Element>(acc_s);
        store_stsm(mma_sdp, ctidx, p_frag, make_tensor(make_smem_ptr(pt_smem + buf * K::kdSElems),
                                                       typename K::SmemLayoutdSt{}));
      } else if constexpr (!kEarlyDv) {
        Tensor p_frag = convert_fragment<Element>(acc_s);
        Tensor tPr = make_tensor(p_frag.data(), acc_as_a_layout_sm90(p_frag.layout()));
        warpgroup_fence_operand(tPr);
        warpgroup_fence_operand(tdSr);
        wgmma_issue<false>(mma_dkv, tPr, tDVrdOt(_, _, _, s), acc_dv);
        wgmma_issue<false>(mma_dkv, tdSr, tDKrQt(_, _, _, s), acc_dk);
      }

      auto release_stage = [&]() {
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
        __syncwarp();
        if (warp_leader) empty[s].arrive();
      };
      if constexpr (!K::kDq && !K::kColSplit) {   // dV and dK are issued: nothing else reads this stage
        warpgroup_wait<0>();
        release_stage();
      } else {
        // dS^T -> shared memory for dQ; the wgmma proxy reads it after the fence and the barrier over both
        // warpgroups (buffer `buf` was last read two query blocks ago, before every consumer passed the previous
        // barrier).
        // By stmatrix (four 8 x 8 matrices an instruction) rather than 32-bit stores: ~10% fewer instructions in the
        // loop, +1-3% measured at hdim 64/128 (NOTES, thirty-first session).
        store_stsm(mma_sdp, ctidx, ds_frag, make_tensor(make_smem_ptr(ds_smem + buf * K::kdSElems),
                                                        typename K::SmemLayoutdSt{}));
        cutlass::arch::fence_view_async_shared();
        if constexpr (K::kDqHandoff) {
          // Block i's dQ is warpgroup (i % 2)'s: it waits for the other's dS, the other arrives and goes on. Its
          // arrival also frees the dQ stage (its reduce of block i - 1 has read it out). Two barrier ids alternate with
          // the block so that an arrival for the next block cannot complete this one; a warpgroup reaches block i + 2
          // only after the other passed block i + 1's barrier, so the dS buffer it rewrites has been read.
          const int id = 6 + (i & 1);
          if (wg == (i & 1)) {
            asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(K::kConsumerThreads));
          } else {
            if (!K::kDqRed && wg_leader) bulk_wait_read();
            asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(K::kConsumerThreads));
          }
        } else {
          // This warpgroup's dQ share from an earlier block must be read out before the barrier lets it be rewritten.
          if (!K::kDqRed && wg_leader) bulk_wait_read();
          consumer_sync<K::kConsumerThreads>();
        }

        // dQ = dS K, then the stage is free once every GEMM of this query block has landed. The accumulator lives only
        // inside the branch: a wgmma accumulator that a warpgroup may leave undefined serialises every wgmma.
        if (K::kDqSplit || K::kDqRowSplit || wg == i % K::kConsumerWGs) {
          Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
          if constexpr (K::kColSplit) {   // both P^T and dS^T are complete now; dQ last (first measured 25% slower)
            wgmma_issue<false>(mma_dkv, tDVrPt(_, _, _, buf), tDVrdOt(_, _, _, s), acc_dv);
            wgmma_issue<false>(mma_dkv, tDKrdSt(_, _, _, buf), tDKrQt(_, _, _, s), acc_dk);
          }
          // Head dims <= 128 keep releasing after dQ: with two stages it measured level (H100, fifteenth session).
          constexpr bool kReleaseBeforeDq = K::kColSplit;
          if constexpr (!K::kDq) {
          } else if (K::kDqRowSplit && wg == 1) {
            wgmma_issue<true>(mma_dq, tDQrdS_wg1(_, _, _, buf), tDQrKt_wg0, acc_dq);
          } else if (!K::kDqSplit || wg == 0) {
            wgmma_issue<true>(mma_dq, tDQrdS(_, _, _, buf), tDQrKt_wg0, acc_dq);
          } else {
            wgmma_issue<true>(mma_dq, tDQrdS(_, _, _, buf), tDQrKt_wg1, acc_dq);
          }
          if constexpr (kEarlyDv) {
            warpgroup_fence_operand(tdSr);
            wgmma_issue<false>(mma_dkv, tdSr, tDKrQt(_, _, _, s), acc_dk);
            warpgroup_wait<1>();   // dV and dQ landed; dK may still run
          } else if constexpr (kReleaseBeforeDq && K::kDq) {
            // Q and dO are free once dV and dK landed: with one stage the producer loads the next block's while dQ runs
            // and goes out (H100: +2-5% over releasing after dQ).
            warpgroup_wait<1>();
            release_stage();
            warpgroup_wait<0>();
          } else {
            warpgroup_wait<0>();
          }
          if constexpr (K::kDq) warpgroup_fence_operand(acc_dq);
          if constexpr (!kEarlyDv && !(kReleaseBeforeDq && K::kDq)) release_stage();
          // The whole share (rows past the sequence add dS = 0 into the accumulator's padding) into the accumulator.
          const float scale = p.scale;
          if constexpr (!K::kDq) {
          } else if constexpr (K::kDqRed) {
            // Four values a red; a warpgroup's 64 x 64 fragment has its column groups 512 floats apart.
            static_assert(decltype(size(acc_dq))::value == 32, "a 64 x 64 dQ fragment per warpgroup");
            float* frag = dq_accum_tile<K>(p, seq, bidb, bidh, m_block) +
                          dq_frag_index<kBlockM>(get<0>(tDQcDQ(0)), get<1>(tDQcDQ(0)));
            CUTE_UNROLL
            for (int j = 0; j < size(acc_dq); j += 4) {
              asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                           :: "l"(frag + j / 4 * 512), "f"(acc_dq(j) * scale), "f"(acc_dq(j + 1) * scale),
                              "f"(acc_dq(j + 2) * scale), "f"(acc_dq(j + 3) * scale) : "memory");
            }
          } else {
            // Into shared memory in the accumulator's order, then one bulk reduce-add of it.
            CUTE_UNROLL
            for (int j = 0; j < size(acc_dq); j += 2) {
              const int idx = dq_tile_index<64>(get<0>(tDQcDQ(j)) - dq_row0, get<1>(tDQcDQ(j)) - dq_col0);
              // A plain store: the compiler sees the shared-memory base and emits STS with an immediate offset per
              // pair.
              *reinterpret_cast<float2*>(my_dq_stage + idx) = make_float2(acc_dq(j) * scale, acc_dq(j + 1) * scale);
            }
            cutlass::arch::fence_view_async_shared();
            asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg));   // this warpgroup's share is complete
            if (wg_leader) {
              float* share = dq_accum_tile<K>(p, seq, bidb, bidh, m_block) + dq_tile_index<kBlockM>(dq_row0, dq_col0);
              bulk_reduce_add_f32(share, my_dq_stage, K::kDqStageFloats * 4);
            }
          }
          if constexpr (kEarlyDv) {
            warpgroup_wait<0>();
            release_stage();
          }
        } else {
          if constexpr (kEarlyDv) {
            warpgroup_fence_operand(tdSr);
            wgmma_issue<false>(mma_dkv, tdSr, tDKrQt(_, _, _, s), acc_dk);
          }
          warpgroup_wait<0>();
          release_stage();
        }
      }
      if (++i == n_iters) break;
    }
  }

  // Epilogue: dK *= scale; both through shared memory (K and V's tiles, free once every consumer is past its
  // last dQ GEMM) to 16-byte stores. A key block no query sees (causal) writes zeros.
  if (wg_leader) bulk_wait_all();   // the last dQ reduces are done before the block (and its shared memory) ends
  consumer_sync<K::kConsumerThreads>();
  if constexpr (K::kSplit) {
    // A split grid is one-dimensional, and without a split every CTA is a whole tile: blockIdx.x suffices here.
    const SplitItem item = split_item(blockIdx.x, (p.seqlen_k + kBlockN - 1) / kBlockN * p.nheads * p.batch,
                                      p.split_tiles, p.split_k);
    if (item.piece >= 0) {
      // A split tail's piece: dK and dV to its slot, count, and the last piece sums the slots back into its fragments.
      // A slot holds each thread's values in fragment order (float4 j of every thread, then j + 1), staged in shared
      // memory (Q, dO, K and V's space, free now) and moved by one bulk copy each way: with per-thread global
      // addresses here ptxas kept a value of the main loop on the stack (hdim 64: 4 B, reloaded every query block).
      constexpr int kVec = decltype(size(acc_dk))::value / 4, kSlotVecs = 2 * kVec * K::kConsumerThreads;
      constexpr int kSlotBytes = kSlotVecs * 16;
      static_assert(kSlotBytes <= (2 * kStages * K::kQElems + 2 * K::kKElems) * int(sizeof(Element)),
                    "the slot's stage fits in Q, dO, K and V's space");
      float4* stage = reinterpret_cast<float4*>(smem);
      float4* slots = static_cast<float4*>(p.dkdv_partial);
      const int first = item.slot - item.piece;   // the tile's first piece's slot
      int* count = reinterpret_cast<int*>(ds_smem) + 4;   // past the epilogue's tile offsets
      uint64_t* loaded = reinterpret_cast<uint64_t*>(ds_smem) + 3;
      CUTE_UNROLL
      for (int j = 0; j < kVec; ++j) {
        stage[j * K::kConsumerThreads + ctidx] =
            make_float4(acc_dk(4 * j), acc_dk(4 * j + 1), acc_dk(4 * j + 2), acc_dk(4 * j + 3));
        stage[(kVec + j) * K::kConsumerThreads + ctidx] =
            make_float4(acc_dv(4 * j), acc_dv(4 * j + 1), acc_dv(4 * j + 2), acc_dv(4 * j + 3));
      }
      cutlass::arch::fence_view_async_shared();
      consumer_sync<K::kConsumerThreads>();
      if (ctidx == 0) {
        SM90_BULK_COPY_S2G::copy(stage, slots + int64_t(item.slot) * kSlotVecs, kSlotBytes);
        tma_store_arrive();
        bulk_wait_all();
        // The slot is visible before the count that may let another piece read it.
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
        __threadfence();
        *count = atomicAdd(static_cast<int*>(p.split_counter) + first / p.split_k, 1);
        if (*count == p.split_k - 1) {
          __threadfence();
          asm volatile("fence.proxy.async.global;\n" ::: "memory");
          reinterpret_cast<Barrier*>(loaded)->init(1);
          cutlass::arch::fence_barrier_init();
        }
      }
      consumer_sync<K::kConsumerThreads>();
      if (*count != p.split_k - 1) return;
      clear(acc_dk);
      clear(acc_dv);
      #pragma unroll 1
      for (int q = 0; q < p.split_k; ++q) {
        if (ctidx == 0) {
          reinterpret_cast<Barrier*>(loaded)->arrive_and_expect_tx(kSlotBytes);
          SM90_BULK_COPY_G2S::copy(slots + int64_t(first + q) * kSlotVecs, loaded, stage, kSlotBytes);
        }
        reinterpret_cast<Barrier*>(loaded)->wait(q & 1);
        CUTE_UNROLL
        for (int j = 0; j < kVec; ++j) {
          const float4 a = stage[j * K::kConsumerThreads + ctidx], b = stage[(kVec + j) * K::kConsumerThreads + ctidx];
          acc_dk(4 * j) += a.x, acc_dk(4 * j + 1) += a.y, acc_dk(4 * j + 2) += a.z, acc_dk(4 * j + 3) += a.w;
          acc_dv(4 * j) += b.x, acc_dv(4 * j + 1) += b.y, acc_dv(4 * j + 2) += b.z, acc_dv(4 * j + 3) += b.w;
        }
        consumer_sync<K::kConsumerThreads>();   // the stage is read before the next slot (or dK and dV) rewrites it
      }
    }
  }
  const float scale = p.scale;
  CUTE_UNROLL
  for (int j = 0; j < size(acc_dk); ++j) acc_dk(j) *= scale;
  if constexpr (K::kDropout) {
    CUTE_UNROLL
    for (int j = 0; j < size(acc_dv); ++j) acc_dv(j) *= p.rp_dropout;
  }
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  // 32-bit stores, not stmatrix: with stmatrix here the epilogue spilled 4-16 B.
  store_pairs(rdK, thr_dkv.partition_C(sK));
  store_pairs(rdV, thr_dkv.partition_C(sV));
  // The tiles' global offsets go through shared memory (dS's first buffer, idle since the barrier above) and are read
  // after the barrier below: the compiler cannot compute the stores' addresses before then, while dK and dV still
  // take 128 registers. Computed up front, the predicated 64-bit addresses spilled (hdim 128: 100 B -> 0; hdim 256:
  // 204 B -> 36).
  int64_t* tile_off = reinterpret_cast<int64_t*>(ds_smem);
  if (ctidx == 0) {
    tile_off[0] = seq.k_off(bidb, p.dk_batch_stride, p.dk_row_stride) + bidh * p.dk_head_stride +
                  int64_t(n_block) * kBlockN * p.dk_row_stride;
    tile_off[1] = seq.k_off(bidb, p.dv_batch_stride, p.dv_row_stride) + bidh * p.dv_head_stride +
                  int64_t(n_block) * kBlockN * p.dv_row_stride;
  }
  consumer_sync<K::kConsumerThreads>();
  const int k_rows_left = seqlen_k - n_block * kBlockN;
  Element* dk_ptr = static_cast<Element*>(p.dk) + tile_off[0];
  Element* dv_ptr = static_cast<Element*>(p.dv) + tile_off[1];
  store_rows_sm90<typename K::Tiles, kBlockN, kHeadDim>(sK, dk_ptr, p.dk_row_stride, k_rows_left, p.head_dim, ctidx);
  store_rows_sm90<typename K::Tiles, kBlockN, kHeadDim>(sV, dv_ptr, p.dv_row_stride, k_rows_left, p.head_dim, ctidx);
}

// The fp32 dQ accumulator of bwd_sm90 (tiles of kBlockM x kDqAccumWidth in dq_tile_index order, or dq_frag_index's
// with kDqRed; already scaled) -> dQ in the input dtype: 8 columns per thread and row, 16-byte stores.
template <class K, class Params>
__device__ __forceinline__ void bwd_sm90_convert_dq(Params const& p) {
  using Element = typename K::Element;
  constexpr int kBlockM = K::kBlockM, kUnits = K::kHeadDim / 8;
  const int m_block = blockIdx.x, bidh = blockIdx.y, bidb = blockIdx.z;
  const BwdSeq seq(p.cu_seqlens_q, p.cu_seqlens_k, p.seqlen_q, p.seqlen_k, bidb);
  const int rows_left = seq.seqlen_q - m_block * kBlockM;
  if (rows_left <= 0) return;
  float const* tile = dq_accum_tile<K>(p, seq, bidb, bidh, m_block);
  Element* dq = static_cast<Element*>(p.dq) + seq.q_off(bidb, p.dq_batch_stride, p.dq_row_stride) +
                bidh * p.dq_head_stride + int64_t(m_block) * kBlockM * p.dq_row_stride;
  if constexpr (K::kDqRed) {
    // A thread takes a column group of 8 in rows r and r + 8 of a 64 x 64 chunk: the four fragment threads' 4 values,
    // 64 contiguous bytes. Consecutive threads take consecutive groups of a row: eight store 128 contiguous bytes.
    for (int u = threadIdx.x; u < kBlockM / 64 * (K::kHeadDim / 64) * 256; u += blockDim.x) {
      const int g = u % 256, j = g % 8, r8 = (g / 8) % 8, w = g / 64, chunk = u / 256;
      const int col = (chunk / (kBlockM / 64)) * 64 + j * 8, row = (chunk % (kBlockM / 64)) * 64 + w * 16 + r8;
      const float4* src = reinterpret_cast<float4 const*>(tile + chunk * 4096 + (j * 128 + w * 32 + r8 * 4) * 4);
      const float4 a0 = src[0], a1 = src[1], a2 = src[2], a3 = src[3];
      if (col >= p.head_dim) continue;
      cutlass::Array<Element, 8> v;
      if (row < rows_left) {
        v[0] = Element(a0.x), v[1] = Element(a0.y), v[2] = Element(a1.x), v[3] = Element(a1.y);
        v[4] = Element(a2.x), v[5] = Element(a2.y), v[6] = Element(a3.x), v[7] = Element(a3.y);
        *reinterpret_cast<uint128_t*>(dq + row * p.dq_row_stride + col) = *reinterpret_cast<uint128_t const*>(&v);
      }
      if (row + 8 < rows_left) {
        v[0] = Element(a0.z), v[1] = Element(a0.w), v[2] = Element(a1.z), v[3] = Element(a1.w);
        v[4] = Element(a2.z), v[5] = Element(a2.w), v[6] = Element(a3.z), v[7] = Element(a3.w);
        *reinterpret_cast<uint128_t*>(dq + (row + 8) * p.dq_row_stride + col) =
            *reinterpret_cast<uint128_t const*>(&v);
      }
    }
    return;
  }
  for (int u = threadIdx.x; u < kBlockM * kUnits; u += blockDim.x) {
    const int row = u / kUnits, col = (u % kUnits) * 8;
    if (row < rows_left && col < p.head_dim) {
      float const* src = tile + dq_tile_index<kBlockM>(row, col);
      const float4 a = *reinterpret_cast<float4 const*>(src);
      const float4 b = *reinterpret_cast<float4 const*>(src + 4);
      cutlass::Array<Element, 8> v;
      v[0] = Element(a.x), v[1] = Element(a.y), v[2] = Element(a.z), v[3] = Element(a.w);
      v[4] = Element(b.x), v[5] = Element(b.y), v[6] = Element(b.z), v[7] = Element(b.w);
      *reinterpret_cast<uint128_t*>(dq + row * p.dq_row_stride + col) = *reinterpret_cast<uint128_t const*>(&v);
    }
  }
}

}  // namespace flashgen
