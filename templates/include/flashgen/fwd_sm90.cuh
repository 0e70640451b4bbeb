// Attention forward on the Hopper path (sm_90a): TMA loads that complete on mbarriers, wgmma for both GEMMs and
// warp specialization.
//
//   warpgroup 0 (producer, few registers): one thread issues the TMA copies, Q once and K/V per key block into a
//     ring of kStages buffers; "full" barriers count the bytes in, "empty" barriers are released by the consumers.
//   warpgroups 1..kConsumerWGs (consumers, many registers): each owns 64 query rows of the block_m tile and skips
//     the key blocks none of them sees (causal diagonal, rows past the sequence).
//     S = Q K^T (wgmma, both operands in shared memory), mask, online softmax in registers (base 2),
//     O += P V (wgmma, P from registers, V^T read MN-major from the same smem tile TMA wrote).
//   epilogue: O / rowsum -> shared memory (Q's space) -> TMA stores (or predicated 16-byte stores), lse per row; in a
//     persistent walk a store warp (warp 1 of warpgroup 0) issues the TMA stores and waits for their read-out, so the
//     consumers go straight on to their next tile.
//
// Loads go through 4-D tensor maps (head dim, rows, heads, batch) built on the host (flashgen/tma.py): a TMA box
// is 64 columns (128 bytes, the swizzle span) by block rows, so a tile of head_dim columns takes head_dim / 64
// boxes, laid out in shared memory exactly as the GMMA K-major 128-byte-swizzle atoms expect. The tensor map's
// bounds zero-fill rows past the sequence and columns past the runtime head dim.
#pragma once

#include "flashgen/sm90_common.cuh"

namespace flashgen {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, bool kCausal_, bool kOverlap_,
          bool kPingpong_, bool kDropout_ = false, bool kPersistent_ = false, int kQBufs_ = 1, bool kSplit_ = false,
          bool kStaleMax_ = false>
struct FwdSm90 {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  // Issue block i's S GEMM together with block i-1's P V GEMM, so the softmax overlaps tensor-core work.
  static constexpr bool kOverlap = kOverlap_;
  static constexpr int kConsumerWGs = kBlockM / 64;
  // The two consumer warpgroups take turns issuing their GEMMs (named barriers 2 and 3), so one's softmax runs
  // while the other's GEMMs occupy the tensor cores.
  static constexpr bool kPingpong = kPingpong_;
  static_assert(!kPingpong || (kOverlap && kConsumerWGs == 2), "ping-pong: two consumer warpgroups, overlapped");
  // Philox dropout on P (dropout.cuh's mapping, the same mask as the SM80 kernels draw): each block's Philox words are
  // drawn while its S GEMM (overlapped: and the previous block's P V GEMM) runs on the tensor cores.
  static constexpr bool kDropout = kDropout_;
  static_assert(!kDropout || kBlockN % 32 == 0, "dropout: 32-column mask blocks");
  // One CTA per SM walks the tiles, taking the next from a global counter (p.tile_counter) in the plain grid's order:
  // the K/V ring runs on across tiles and the next tile's Q loads into a second buffer (kQBufs) during this tile's
  // last blocks, so launch, barrier set-up and the first loads' latency are paid once per SM, not once per tile.
  static constexpr bool kPersistent = kPersistent_;
  static constexpr int kQBufs = kQBufs_;   // Q buffers (O is staged in its tile's); 2 where shared memory allows
  static_assert(kQBufs == 1 || (kPersistent && kQBufs == 2), "");
  // Split tail (p.split_k > 1): the last p.split_tiles tiles of the grid's order, which would leave SMs idle in the
  // last wave, each run as split_k work items (CTAs of a one-dimensional grid) over a key range apiece. Each item
  // writes its rows' O (fp32, normalised) and lse to p.o_partial / p.lse_partial; per consumer warpgroup, the item
  // that counts last on p.split_counter merges them (lse-weighted, in key-range order) and stores O and lse.
  static constexpr bool kSplit = kSplit_;
  static_assert(!kSplit || (!kCausal && !kDropout && !kPersistent), "split tail: a non-causal grid, no dropout");
  // The overlapped loop's blocks first try P with the running max as it stands (exp_stale in fwd_sm90; the traits'
  // stale_max says where).
  static constexpr bool kStaleMax = kStaleMax_;
  static_assert(!kStaleMax || kOverlap, "");
  static constexpr int kNThreads = 128 * (kConsumerWGs + 1);
  static constexpr int kChunks = kHeadDim / 64;   // TMA boxes per tile
  static_assert(kHeadDim % 64 == 0 && kBlockM % 64 == 0 && kBlockN % 16 == 0 && kBlockN <= 256, "");

  // Register budgets after setmaxnreg (multiples of 8): the consumers take what the producer gives up, within the
  // CTA's pool, the launch's per-thread count (64K / threads, rounded down to 8) x threads. Past the pool a consumer's
  // setmaxnreg.inc waits forever (a variant with 48 + 2 x 232 registers per 128 threads > 168 x 384 hung).
  static constexpr int kProducerRegs = kConsumerWGs == 3 ? 32 : kConsumerWGs == 2 ? 24 : 40;
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : kConsumerWGs == 2 ? 240 : 232;
  static constexpr int kLaunchRegs = (65536 / kNThreads < 255 ? 65536 / kNThreads : 255) / 8 * 8;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= kLaunchRegs * kNThreads, "register pool");

  using AtomLayout = Layout<Shape<Int<kConsumerWGs>, _1, _1>>;
  // S = Q K^T: 64 x block_n per warpgroup, reduction over the head dim, both operands K-major in smem.
  using MmaS = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayout{}));
  // O += P V: 64 x head_dim per warpgroup, reduction over the keys, P in registers, V MN-major in smem.
  using MmaO = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                                 GMMA::Major::MN>(),
      AtomLayout{}));

  // (rows, head_dim) tiles of 8 x 64 swizzled atoms, rows first: each 64-column chunk is one TMA box.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V^T (head_dim x keys) over the same bytes: the B operand of P V, MN-major.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  static constexpr int kQElems = kBlockM * kHeadDim;   // per buffer
  static constexpr int kKVElems = kBlockN * kHeadDim;   // per stage
  static constexpr int kQBytes = kQElems * int(sizeof(Element));
  static constexpr int kKVBytes = kKVElems * int(sizeof(Element));
  // Q buffers, K stages, V stages, the mbarriers (8 bytes each), one word per consumer thread for order_before_wait,
  // then (persistent) per Q buffer the tile the producer loaded into it: its index and coordinates (an int4).
  static constexpr int kBarrierOffset = (kQBufs * kQElems + 2 * kStages * kKVElems) * int(sizeof(Element));
  // Q full / empty per buffer, K and V full / empty per stage, (persistent) O ready per Q buffer
  static constexpr int kNBarriers = 2 * kQBufs + 4 * kStages + (kPersistent ? kQBufs : 0);
  // Rounded up to 16 bytes: the tile slots after the scratch words are int4 (an odd count of barriers, as one Q
  // buffer's walk has, left them 8-byte aligned: a misaligned-address fault).
  static constexpr int kScratchOffset = kBarrierOffset + (kNBarriers * 8 + 15) / 16 * 16;
  static constexpr int kTileSlotOffset = kScratchOffset + 4 * 128 * kConsumerWGs;
  static constexpr int kSmemBytes = kTileSlotOffset + (kPersistent ? 16 * kQBufs : 0);
  static_assert(kBarrierOffset % 16 == 0 && kTileSlotOffset % 16 == 0, "the tile slots are int4");

  // The 16-byte stores of the epilogue (consumer threads only).
  using Tiles = RowTiles<Element, kHeadDim, 128 * kConsumerWGs>;
};

// Accumulator of a 64 x N wgmma viewed as m16n8 fragments ((2, 2), MMA_M, N / 8): value bit 0 picks column c / c + 1,
// bit 1 row r / r + 8, the last mode the 8-column group, as mma.sync's C fragments (what dropout_bits expects).
template <class Layout>
__device__ __forceinline__ constexpr auto m16n8_layout_sm90(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "expects a wgmma accumulator fragment");
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc)), get<1>(acc),
                     make_layout(get<0, 2>(acc), get<2>(acc)));
}

// The same, waited for before returning.
template <bool kZero, class TiledMma, class A, class B, class C>
__device__ __forceinline__ void wgmma_gemm(TiledMma& mma, A const& a, B const& b, C& acc) {
  wgmma_issue<kZero>(mma, a, b, acc);
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
}

// ptxas moves a wgmma wait (WARPGROUP.DEPBAR) up past independent ALU work, into the first latency slot it finds
// (seen in the SASS: the overlapped mainloop's softmax ran after the P V GEMM had landed, and the Philox rounds
// after the S GEMM). A shared-memory store stays ordered before the wait, and with it everything its value depends
// on: storing a value computed from that work (e.g. a row sum) keeps the work under the tensor cores.
__device__ __forceinline__ void order_before_wait(uint32_t slot, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot), "r"(v) : "memory");
}

// Whether any thread of consumer warpgroup wg has pred: a reduction over its 128 threads on named barrier 4 + wg (the
// epilogue's, free during the main loop).
__device__ __forceinline__ bool warpgroup_any(bool pred, int wg) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(4 + wg));
  return any != 0;
}

// Whether a tile's O goes out by TMA stores (the map clips rows and columns past the tensor; a varlen tile only when
// all its rows are its sequence's, since past them the next sequence begins) or by predicated stores.
template <class Params>
__device__ __forceinline__ bool o_by_tma(Params const& p, int q_rows_left, int block_m) {
  return p.o_tma && (p.cu_seqlens_q == nullptr || q_rows_left >= block_m);
}

// The TMA stores of warpgroup w's 64 rows of a tile's O, staged in its Q buffer q_buf: one per 64-column box. row0:
// the tile's first row in the map (tile.q_row0 + m_block * kBlockM).
template <class K, class Params, class Element>
__device__ __forceinline__ void store_o_tma(Params const& p, Element* q_buf, int w, int row0, int bidh, int batch_crd) {
  CUTE_UNROLL
  for (int c = 0; c < K::kChunks; ++c) {
    SM90_TMA_STORE_4D::copy(&p.tma_o, q_buf + c * K::kBlockM * 64 + w * 64 * 64, c * 64, row0 + w * 64, bidh,
                            batch_crd);
  }
}

// Ping-pong turns of the two consumer warpgroups: barrier 2 + w is warpgroup w's turn; it waits there (128 threads)
// for the other warpgroup's 128 arrivals.
__device__ __forceinline__ void turn_wait(int wg) { asm volatile("bar.sync %0, 256;\n" ::"r"(2 + wg)); }
__device__ __forceinline__ void turn_pass(int wg) { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 + (wg ^ 1))); }

// Where one tile (a block_m x head_dim block of O for one head and sequence) reads and writes, and how many key blocks
// it sees. Varlen tensor maps have one "batch" and rows offset by cu_seqlens.
struct FwdSm90Tile {
  int bidh_k;
  int seqlen_q, seqlen_k, q_row0, k_row0, batch_crd;
  int64_t o_off, lse_off;
  int n_block_max;   // key blocks this tile sees (causal: bottom-right aligned); 0: O = 0, lse = -inf
  bool has_rows;     // false: the tile starts past its sequence (varlen, or a persistent walk's padding)

  template <int kBlockM, int kBlockN, bool kCausal, class Params>
  __device__ __forceinline__ static FwdSm90Tile make(Params const& p, int m_block, int bidh, int bidb) {
    FwdSm90Tile t;
    t.bidh_k = p.nheads == p.nheads_k ? bidh : bidh / (p.nheads / p.nheads_k);   // no division for plain MHA
    t.seqlen_q = p.seqlen_q, t.seqlen_k = p.seqlen_k, t.q_row0 = 0, t.k_row0 = 0, t.batch_crd = bidb;
    t.o_off = bidb * p.o_batch_stride, t.lse_off = bidb * p.lse_batch_stride;
    if (p.cu_seqlens_q != nullptr) {
      const int* cu_q = static_cast<const int*>(p.cu_seqlens_q);
      const int* cu_k = static_cast<const int*>(p.cu_seqlens_k);
      t.q_row0 = cu_q[bidb], t.k_row0 = cu_k[bidb];
      t.seqlen_q = cu_q[bidb + 1] - t.q_row0, t.seqlen_k = cu_k[bidb + 1] - t.k_row0;
      t.batch_crd = 0, t.o_off = t.q_row0 * p.o_row_stride, t.lse_off = t.q_row0;
    }
    t.has_rows = m_block * kBlockM < t.seqlen_q;
    t.n_block_max = key_blocks<kBlockN, kCausal>((m_block + 1) * kBlockM - 1, t.seqlen_q, t.seqlen_k);
    return t;
  }
  // Key blocks that rows up to last_row see (causal: bottom-right aligned, so the last row sees the most).
  template <int kBlockN, bool kCausal>
  __device__ __forceinline__ static int key_blocks(int last_row, int seqlen_q, int seqlen_k) {
    const int n = (seqlen_k + kBlockN - 1) / kBlockN;
    return kCausal ? min(n, max(0, last_row + seqlen_k - seqlen_q + kBlockN) / kBlockN) : n;
  }
  // Key blocks a consumer warpgroup's 64 rows (from first_row) see: on the causal diagonal a tile taller than a key
  // block has warpgroups whose rows end blocks before the tile's last row does, and rows past the sequence see none.
  template <int kBlockN, bool kCausal>
  __device__ __forceinline__ int rows_key_blocks(int first_row) const {
    if (first_row >= seqlen_q) return 0;
    return min(n_block_max, key_blocks<kBlockN, kCausal>(first_row + 63, seqlen_q, seqlen_k));
  }
  // How tile m_block's O leaves. kTma: staged in its Q buffer, then TMA stores (o_by_tma); kDirect: staged, then
  // predicated stores (a varlen tile cut by its sequence's end); kZeros: a walk's tile without key blocks, which loaded
  // no Q, stores zeros straight to global memory; kNone: the tile starts past its sequence. A walk's store warp and its
  // consumers both decide by this.
  enum class OStore { kNone, kZeros, kDirect, kTma };
  template <bool kPersistent, class Params>
  __device__ __forceinline__ OStore o_store(Params const& p, int m_block, int block_m) const {
    if (!has_rows) return OStore::kNone;
    if (kPersistent && n_block_max == 0) return OStore::kZeros;
    return o_by_tma(p, seqlen_q - m_block * block_m, block_m) ? OStore::kTma : OStore::kDirect;
  }
};

// A plain grid's CTA: its own tile, (m_block, head, batch); causal tiles in tile_coords' order.
template <class K, class Params>
__device__ __forceinline__ int3 grid_tile(Params const& p) {
  const int t = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int2 c = grouped_tile(t, gridDim.x, gridDim.y * gridDim.z, K::kCausal ? p.head_group : 0);
  return make_int3(K::kCausal ? int(gridDim.x) - 1 - c.x : c.x, c.y % int(gridDim.y), c.y / int(gridDim.y));
}
// (m_block, head, batch) of tile t in the order the plain grid launches in (m_block fastest, so CTAs that run together
// share K/V in L2). Causal blocks near the bottom do the most work: they come first, so the tail is short; with
// p.head_group > 0 they come first over groups of heads (grouped_tile).
template <class K, class Params>
__device__ __forceinline__ int3 tile_coords(Params const& p, int t) {
  const int m_blocks = (p.seqlen_q + K::kBlockM - 1) / K::kBlockM;
  const int2 c = grouped_tile(t, m_blocks, p.nheads * p.batch, K::kCausal ? p.head_group : 0);
  return make_int3(K::kCausal ? m_blocks - 1 - c.x : c.x, c.y % p.nheads, c.y / p.nheads);
}
template <class K, class Params>
__device__ __forceinline__ int tile_count(Params const& p) {
  return (p.seqlen_q + K::kBlockM - 1) / K::kBlockM * p.nheads * p.batch;
}
// A split-tail grid's CTA u: a whole tile, or a piece of split_k key ranges of a tail tile (split_item).
template <class K, class Params>
__device__ __forceinline__ SplitItem work_item(Params const& p, int u) {
  if (!K::kSplit) return {u, -1, 0};
  return split_item(u, tile_count<K>(p), p.split_tiles, p.split_k);
}
// The first key block of an item's range; its last is key_range_end's minus one (blocks run highest first).
template <class Params>
__device__ __forceinline__ int key_range_begin(Params const& p, int piece, int n_blocks) {
  return piece < 0 ? 0 : piece * n_blocks / p.split_k;
}
template <class Params>
__device__ __forceinline__ int key_range_end(Params const& p, int piece, int n_blocks) {
  return piece < 0 ? n_blocks : (piece + 1) * n_blocks / p.split_k;
}

// Split tail: warpgroup wg's rows of one piece of a tail tile. Its O (o: normalised, the rowcol view; tOcO the
// coordinates in the tile) and lse go to the piece's slot, and the piece counts itself on the warpgroup's counter. The
// last to count merges the split_k pieces from their slots: lse = log sum exp of theirs, O = sum of each one's O
// weighted by exp(lse_piece - lse), in key-range order (the result does not depend on which piece ended last), and
// stores O (rows below rows_left, columns below p.head_dim) and lse. scratch: 4.25 KB of shared memory only this
// warpgroup uses (weights per row and piece, then the rows' lse); bcast: a word of it for the counter's value.
constexpr int kMaxSplit = 16;   // pieces per tile the merge's scratch holds (heuristics.FWD_SM90_SPLIT_MAX <= this)
template <class Element, int kBlockM, int kHeadDim, int kWGs, class Params, class TO, class TC>
__device__ __forceinline__ void finish_piece(Params const& p, TO const& o, float const* lse, TC const& tOcO, int piece,
                                             int slot, int wg, Element* o_ptr, float* lse_ptr, int rows_left,
                                             float* scratch) {
  constexpr int kPairs = decltype(size<1>(o))::value / 2;
  float* o_part = static_cast<float*>(p.o_partial);
  float* lse_part = static_cast<float*>(p.lse_partial);
  const int first = slot - piece;   // the tile's first piece's slot
  const int t = threadIdx.x % 128;
  // A thread's values of a row come in pairs of neighbouring columns, pair j at 8 j from its first column (the m16n8
  // view, m16n8_layout_sm90): one base address per row and immediate offsets.
  const int col0 = get<1>(tOcO(0, 0));
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(o))::value; ++r) {
    const int row = get<0>(tOcO(r, 0));
    float2* dst = reinterpret_cast<float2*>(o_part + (int64_t(slot) * kBlockM + row) * kHeadDim + col0);
    CUTE_UNROLL
    for (int j = 0; j < kPairs; ++j) dst[4 * j] = make_float2(o(r, 2 * j), o(r, 2 * j + 1));
    if (col0 == 0) lse_part[int64_t(slot) * kBlockM + row] = lse[r];
  }
  __threadfence();   // the partials are visible before the count that may let another piece read them
  int* bcast = reinterpret_cast<int*>(scratch + kMaxSplit * 64 + 64);
  asm volatile("bar.sync %0, 128;\n" ::"r"(4 + wg));
  if (t == 0) *bcast = atomicAdd(static_cast<int*>(p.split_counter) + first / p.split_k * kWGs + wg, 1);
  asm volatile("bar.sync %0, 128;\n" ::"r"(4 + wg));
  if (*bcast != p.split_k - 1) return;
  __threadfence();
  // The weights, a row per thread of the first 64.
  const int row0 = 64 * wg;   // the warpgroup's first row in the tile
  if (t < 64) {
    const float* l = lse_part + int64_t(first) * kBlockM + row0 + t;
    float m = -kInf, sum = 0.f;
    for (int q = 0; q < p.split_k; ++q) m = fmaxf(m, __ldcg(l + q * kBlockM));
    for (int q = 0; q < p.split_k; ++q) sum += expf(__ldcg(l + q * kBlockM) - m);
    const float total = m == -kInf ? -kInf : m + logf(sum);   // a row no key reached: O = 0, lse = -inf
    for (int q = 0; q < p.split_k; ++q) {
      scratch[t * kMaxSplit + q] = m == -kInf ? 0.f : expf(__ldcg(l + q * kBlockM) - total);
    }
    if (row0 + t < rows_left) lse_ptr[row0 + t] = total;
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(4 + wg));
  // O in units of 8 columns, consecutive threads on consecutive units (a warp reads whole rows), in groups of up to
  // 8 passes over the warpgroup's rows: every piece's loads of a group are independent, and 64 accumulators per
  // thread leave room beside what the epilogue still holds (hdim 256 in one group spilled).
  constexpr int kUnitsPerRow = kHeadDim / 8, kPasses = 64 * kUnitsPerRow / 128, kGroup = kPasses < 8 ? kPasses : 8;
  static_assert(64 * kUnitsPerRow % 128 == 0, "whole passes over the warpgroup's rows");
  CUTE_UNROLL
  for (int g = 0; g < kPasses; g += kGroup) {
    float acc[kGroup][8];
    CUTE_UNROLL
    for (int i = 0; i < kGroup; ++i) {
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
    }
    #pragma unroll 1
    for (int q = 0; q < p.split_k; ++q) {
      const float* src = o_part + (int64_t(first + q) * kBlockM + row0) * kHeadDim;
      CUTE_UNROLL
      for (int i = 0; i < kGroup && g + i < kPasses; ++i) {   // (hdim 192: 12 passes, the second group 4)
        const int u = (g + i) * 128 + t;
        const float w = scratch[u / kUnitsPerRow * kMaxSplit + q];
        const float4 a = __ldcg(reinterpret_cast<const float4*>(src + u * 8));
        const float4 b = __ldcg(reinterpret_cast<const float4*>(src + u * 8 + 4));
        acc[i][0] += w * a.x, acc[i][1] += w * a.y, acc[i][2] += w * a.z, acc[i][3] += w * a.w;
        acc[i][4] += w * b.x, acc[i][5] += w * b.y, acc[i][6] += w * b.z, acc[i][7] += w * b.w;
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < kGroup && g + i < kPasses; ++i) {
      const int u = (g + i) * 128 + t, r = u / kUnitsPerRow, col = u % kUnitsPerRow * 8;
      if (row0 + r < rows_left && col < p.head_dim) {
        uint4 v;
        Element* e = reinterpret_cast<Element*>(&v);
        CUTE_UNROLL
        for (int j = 0; j < 8; ++j) e[j] = Element(acc[i][j]);
        *reinterpret_cast<uint4*>(o_ptr + int64_t(row0 + r) * p.o_row_stride + col) = v;
      }
    }
  }
}

template <class K, class Params>
__device__ __forceinline__ void fwd_sm90(Params const& p, char* smem) {
  using Element = typename K::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kHeadDim = K::kHeadDim, kStages = K::kStages;
  const int tidx = threadIdx.x;
  const int warpgroup = tidx / 128;

  Element* base = reinterpret_cast<Element*>(smem);
  Element* q_smem = base;
  Element* k_smem = base + K::kQBufs * K::kQElems;
  Element* v_smem = k_smem + kStages * K::kKVElems;
  Barrier* bar = reinterpret_cast<Barrier*>(smem + K::kBarrierOffset);
  Barrier* full_q = bar;
  Barrier* full_k = full_q + K::kQBufs;
  Barrier* empty_k = full_k + kStages;
  Barrier* full_v = empty_k + kStages;
  Barrier* empty_v = full_v + kStages;
  Barrier* empty_q = empty_v + kStages;   // persistent: a Q buffer is free again (its O stored and read out)
  // Persistent: every consumer warp has written its rows of O into the Q buffer (the store warp's cue).
  [[maybe_unused]] Barrier* o_ready = empty_q + K::kQBufs;
  // Persistent: the tile the producer loaded into each Q buffer, (index, m_block, head, batch) with index -1 when no
  // tiles are left, published by its full_q arrival. The consumers take the coordinates as they are: tile_coords'
  // divisions sat on each tile's set-up (hdim 64 causal 2k: +1.5-4% without them in the consumers).
  [[maybe_unused]] int4* tile_slot = reinterpret_cast<int4*>(smem + K::kTileSlotOffset);

  if (tidx == 0) {
    for (int b = 0; b < K::kQBufs; ++b) {
      full_q[b].init(1);
      // A walk's buffer comes back from the store warp; a grid's Q buffer is never handed back.
      empty_q[b].init(K::kPersistent ? 1 : 4 * K::kConsumerWGs);
      if (K::kPersistent) o_ready[b].init(4 * K::kConsumerWGs);
    }
    for (int s = 0; s < kStages; ++s) {
      full_k[s].init(1);
      full_v[s].init(1);
      empty_k[s].init(4 * K::kConsumerWGs);   // one arrival per consumer warp
      empty_v[s].init(4 * K::kConsumerWGs);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<K::kProducerRegs>();
    if (K::kPersistent && tidx == 32) {
      // The walk's store warp: per tile (the producer's order), once O is in the Q buffer, its TMA stores (one per
      // 64-column box and warpgroup), their read-out, and the buffer back to the producer. Off the consumers' path:
      // their leaders used to wait for the read-out before the next tile's first S GEMM (0.4-0.75 k cycles a tile).
      for (int j = 0;; ++j) {
        const int qb = j % K::kQBufs;
        const uint32_t phase = (j / K::kQBufs) & 1;
        full_q[qb].wait(phase);
        const int4 slot = tile_slot[qb];
        if (slot.x < 0) break;
        o_ready[qb].wait(phase);
        const FwdSm90Tile tile = FwdSm90Tile::template make<kBlockM, kBlockN, K::kCausal>(p, slot.y, slot.z, slot.w);
        if (tile.template o_store<true>(p, slot.y, kBlockM) == FwdSm90Tile::OStore::kTma) {
          for (int w = 0; w < K::kConsumerWGs; ++w) {
            store_o_tma<K>(p, q_smem + qb * K::kQElems, w, tile.q_row0 + slot.y * kBlockM, slot.z, tile.batch_crd);
          }
          tma_store_arrive();
          tma_store_wait<0>();
        }
        empty_q[qb].arrive();
      }
    }
    if (tidx == 0) {
      // K/V stage and phase come from one count that runs on across tiles (persistent).
      int kv = 0;
      // Loads tile (m_block, bidh, bidb) into Q buffer qb and the K/V ring (a split tail's piece: its key range). A
      // tile without rows or key blocks loads nothing; a persistent walk still arrives on full_q[qb] so the consumers
      // see the tile.
      auto load_tile = [&](int m_block, int bidh, int bidb, int qb, int piece) {
        const FwdSm90Tile tile = FwdSm90Tile::template make<kBlockM, kBlockN, K::kCausal>(p, m_block, bidh, bidb);
        const int n_hi = K::kSplit ? key_range_end(p, piece, tile.n_block_max) : tile.n_block_max;
        const int n_blocks = n_hi - (K::kSplit ? key_range_begin(p, piece, tile.n_block_max) : 0);
        if (!tile.has_rows || n_blocks == 0) {
          if constexpr (K::kPersistent) full_q[qb].arrive();
          return;
        }
        full_q[qb].arrive_and_expect_tx(K::kQBytes);
        tma_load_tile<kBlockM, K::kChunks>(full_q[qb], p.tma_q, q_smem + qb * K::kQElems,
                                           tile.q_row0 + m_block * kBlockM, bidh, tile.batch_crd);
        // One block per pass: unrolled (4x by default), the copies' addresses spilled in the producer's 24 registers.
        #pragma unroll 1
        for (int i = 0; i < n_blocks; ++i, ++kv) {
          const int s = kv % kStages;
          const uint32_t phase = (kv / kStages) & 1;
          const int k_row = tile.k_row0 + (n_hi - 1 - i) * kBlockN;
          empty_k[s].wait(phase ^ 1);   // the first round finds every buffer free
          full_k[s].arrive_and_expect_tx(K::kKVBytes);
          tma_load_tile<kBlockN, K::kChunks>(full_k[s], p.tma_k, k_smem + s * K::kKVElems, k_row, tile.bidh_k,
                                             tile.batch_crd);
          empty_v[s].wait(phase ^ 1);
          full_v[s].arrive_and_expect_tx(K::kKVBytes);
          tma_load_tile<kBlockN, K::kChunks>(full_v[s], p.tma_v, v_smem + s * K::kKVElems, k_row, tile.bidh_k,
                                             tile.batch_crd);
        }
      };
      if constexpr (!K::kPersistent) {
        if constexpr (K::kSplit) {   // a one-dimensional grid of work items
          const SplitItem it = work_item<K>(p, blockIdx.x);
          const int3 c = tile_coords<K>(p, it.tile);
          load_tile(c.x, c.y, c.z, 0, it.piece);
        } else {
          const int3 c = grid_tile<K>(p);
          load_tile(c.x, c.y, c.z, 0, -1);
        }
      } else {
        // Tile j goes to Q buffer j % kQBufs once the consumers have handed that buffer back. The first tile is the
        // CTA's own index, the others come from the counter as CTAs free up: the grid's order and its balance
        // (causal heaviest first), which a static round robin over the CTAs does not give.
        const int tiles = tile_count<K>(p);
        for (int j = 0;; ++j) {
          const int qb = j % K::kQBufs;
          const int t = j == 0 ? int(blockIdx.x) : int(gridDim.x) + atomicAdd(static_cast<int*>(p.tile_counter), 1);
          empty_q[qb].wait(((j / K::kQBufs) & 1) ^ 1);   // the first round finds every buffer free
          const int3 c = tile_coords<K>(p, t < tiles ? t : 0);
          tile_slot[qb] = make_int4(t < tiles ? t : -1, c.x, c.y, c.z);
          if (t >= tiles) {
            full_q[qb].arrive();
            break;
          }
          load_tile(c.x, c.y, c.z, qb, -1);
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<K::kConsumerRegs>();
  const int ctidx = tidx - 128;   // thread index among the consumers
  const uint32_t order_slot = static_cast<uint32_t>(__cvta_generic_to_shared(smem + K::kScratchOffset)) + 4 * ctidx;
  const bool warp_leader = ctidx % 32 == 0;

  Tensor sK = make_tensor(make_smem_ptr(k_smem), typename K::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(v_smem), typename K::SmemLayoutVt{});

  typename K::MmaS mma_s;
  typename K::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ctidx);
  auto thr_o = mma_o.get_thread_slice(ctidx);
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (.., .., .., stages)
  Tensor tOrVt = thr_o.partition_fragment_B(sVt);
  Tensor tScS = rowcol_sm90(thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  [[maybe_unused]] Tensor tCcS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRows = decltype(size<0>(tScS))::value;
  const float scale_log2 = p.scale_log2;
  auto release = [&](Barrier& empty) {
    __syncwarp();
    if (warp_leader) empty.arrive();
  };

  int kv = 0;   // key blocks consumed so far: the K/V barriers' stages and phases
  // One tile, its Q (and later O) in buffer qb; or a split tail's piece of it (piece >= 0).
  auto run_tile = [&](int m_block, int bidh, int bidb, int qb, int piece) {
    const FwdSm90Tile tile = FwdSm90Tile::template make<kBlockM, kBlockN, K::kCausal>(p, m_block, bidh, bidb);
    if (tile.template o_store<K::kPersistent>(p, m_block, kBlockM) == FwdSm90Tile::OStore::kNone) return;
    Element* q_buf = q_smem + qb * K::kQElems;
    // The warpgroup index through a shuffle, which ptxas sees as warp-uniform: Q's wgmma descriptors from its slice
    // stay in uniform registers instead of moving over (R2UR) before every S wgmma. The main loop's bounds depend on
    // it too: from ctidx / 128 itself ptxas put the R2URs back into the loop (42 per block, 3-8% slower).
    const int wg = __shfl_sync(0xffffffffu, ctidx / 128, 0);
    Tensor tSrQ = mma_s.get_thread_slice(wg * 128)
                      .partition_fragment_A(make_tensor(make_smem_ptr(q_buf), typename K::SmemLayoutQ{}));
    const int seqlen_q = tile.seqlen_q, seqlen_k = tile.seqlen_k;
    // Blocks n_block_max - 1 down to n_block_max - n_blocks (a split tail's piece: its key range).
    const int n_block_max = K::kSplit ? key_range_end(p, piece, tile.n_block_max) : tile.n_block_max;
    const int n_lo = K::kSplit ? key_range_begin(p, piece, tile.n_block_max) : 0;
    const int n_blocks = n_block_max - n_lo;
    auto stage = [&](int i) { return (kv + i) % kStages; };
    auto phase_of = [&](int i) { return uint32_t((kv + i) / kStages) & 1; };
    // Blocks come highest first, so the ones past this warpgroup's rows (causal diagonal, rows past the sequence) are
    // the first i_first: it waits for each and releases it, with no GEMM (a release before the block has landed
    // could complete the stage's previous round while another warpgroup still reads it).
    const int rows_blocks = tile.template rows_key_blocks<kBlockN, K::kCausal>(m_block * kBlockM + 64 * wg);
    const int i_first = n_block_max - (K::kSplit ? min(n_block_max, max(n_lo, rows_blocks)) : rows_blocks);
    auto pass_block = [&](int i) {
      full_k[stage(i)].wait(phase_of(i));
      release(empty_k[stage(i)]);
      full_v[stage(i)].wait(phase_of(i));
      release(empty_v[stage(i)]);
    };

    Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    float row_max[kRows], row_sum[kRows];
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) { row_max[i] = -kInf; row_sum[i] = 0.f; }
    clear(acc_o);

    const int diag_shift = seqlen_k - seqlen_q;
    auto mask = [&](auto& acc_s, int n_block) {
      // mask_block tests the tile's first row; a block left of this warpgroup's own diagonal needs no mask.
      if (K::kCausal && (n_block + 1) * kBlockN <= min(seqlen_k, m_block * kBlockM + 64 * wg + diag_shift + 1)) return;
      mask_block<K::kCausal, kBlockM, kBlockN>(rowcol_sm90(acc_s), tScS, m_block, n_block, seqlen_k, diag_shift);
    };
    auto softmax = [&](auto& acc_s, float* correction) {
      online_softmax(rowcol_sm90(acc_s), row_max, row_sum, scale_log2, correction);
    };
    // The overlapped mainloops keep a row's max until it moves by 2^8 and skip O's rescale where no row moved.
    auto softmax_lazy = [&](auto& acc_s, float* correction) {
      return online_softmax<true>(rowcol_sm90(acc_s), row_max, row_sum, scale_log2, correction);
    };
    auto rescale_o = [&](float const* correction) { rescale_rows(rowcol_sm90(acc_o), correction); };
    // The overlapped loop's wait for block i - 1's P V GEMM (stage sp), after a store of the row sums' bits: every
    // entry's exp2 feeds a row sum, so the softmax stays under that GEMM (order_before_wait). Then P's registers and
    // V's buffer are free and O can be rescaled.
    [[maybe_unused]] auto wait_pv = [&](float const* sums, int sp) {
      uint32_t bits = 0;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) bits ^= __float_as_uint(sums[r]);
      order_before_wait(order_slot, bits);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      release(empty_v[sp]);
    };
    // The overlapped loop's first try at a block (kStaleMax): P = 2^(s * scale - m) with the running max m as it
    // stands, without the block's own row max (one FMNMX per entry, on the chain from S to P). Exact whatever m is,
    // as long as P stays in range: returns whether a row sum of the thread's entries passed 2^16
    // (a max that moved by 16 or more in log2 units; inf, NaN) or a row with no max yet saw a key (its -1e30 makes
    // every unmasked entry inf). sum: the block's row sums of the thread's entries.
    [[maybe_unused]] auto exp_stale = [&](auto& acc_s, float* sum) -> bool {
      Tensor sv = rowcol_sm90(acc_s);
      bool redo = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const float m_scaled = row_max[r] == -kInf ? -1e30f : row_max[r] * scale_log2;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(sv); ++c) sv(r, c) = exp2f(sv(r, c) * scale_log2 - m_scaled);
        sum[r] = row_reduce<1>(sv, r, [](float a, float b) { return a + b; });
        redo |= !(sum[r] <= 65536.f);
      }
      return redo;
    };
    float correction[kRows];

    if (!K::kPersistent && n_blocks > 0) full_q[0].wait(0);   // a persistent walk waited before the tile
    // Dropout: entries of P are dropped after the row sums (the softmax normaliser sees every key); the kept ones are
    // scaled by 1 / (1 - p) in the epilogue. Philox keys from the (seed, offset) pair torch's generator wrote.
    const Dropout dropout = K::kDropout ? Dropout(p.rng_state, bidb * p.nheads + bidh, p.dropout_threshold,
                                                  p.rp_dropout)
                                        : Dropout();
    // The mask's Philox words depend on coordinates only: drawn right after a GEMM is issued, and kept ahead of the
    // next wait (order_before_wait), so the rounds run under the tensor cores.
    auto draw_bits = [&](int n_block) {
      auto bits = dropout_bits<K::kDropout>(dropout, make_tensor(tCcS.data(), m16n8_layout_sm90(tCcS.layout())),
                                            m_block * kBlockM, n_block * kBlockN);
      if constexpr (K::kDropout) {
        uint32_t all = 0;
        for (auto const& row : bits.r) {
          for (auto const& w : row) all ^= w.x ^ w.y ^ w.z ^ w.w;
        }
        order_before_wait(order_slot, all);
      }
      return bits;
    };
    auto apply_bits = [&](auto& acc_s, auto const& bits) {
      if constexpr (K::kDropout) {
        Tensor s4 = make_tensor(acc_s.data(), m16n8_layout_sm90(acc_s.layout()));
        dropout_apply(dropout, bits, [&](int v, int m, int n, bool keep) {
          if (!keep) s4(v, m, n) = 0.f;
        });
      }
    };

    if constexpr (!K::kOverlap) {
      // One block at a time: S GEMM, softmax, P V GEMM, each waited for.
      #pragma unroll 1
      for (int i = 0; i < i_first; ++i) pass_block(i);
      for (int i = i_first; i < n_blocks; ++i) {
        const int n_block = n_block_max - 1 - i, s = stage(i);
        const uint32_t phase = phase_of(i);
        Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        full_k[s].wait(phase);
        wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, s), acc_s);
        [[maybe_unused]] auto drop_bits = draw_bits(n_block);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_s);
        release(empty_k[s]);
        mask(acc_s, n_block);
        softmax(acc_s, correction);
        rescale_o(correction);
        apply_bits(acc_s, drop_bits);
        Tensor p_frag = convert_fragment<Element>(acc_s);
        Tensor tOrP = make_tensor(p_frag.data(), acc_as_a_layout_sm90(p_frag.layout()));
        full_v[s].wait(phase);
        warpgroup_fence_operand(tOrP);
        wgmma_gemm<false>(mma_o, tOrP, tOrVt(_, _, _, s), acc_o);
        release(empty_v[s]);
      }
    } else if (n_blocks > 0) {
      // Overlapped: block i's S GEMM and block i-1's P V GEMM are issued together; the softmax of block i runs
      // while the tensor cores finish P V, and O is rescaled once that GEMM has landed.
      Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor p_frag = make_tensor<Element>(acc_s.layout());
      Tensor tOrP = make_tensor(p_frag.data(), acc_as_a_layout_sm90(p_frag.layout()));
      // Ping-pong: warpgroup 0 has the first turn; each issue point waits for its turn and passes it on. Both
      // warpgroups have n_blocks + 1 issue points (a block past the warpgroup's rows is one, without GEMMs), and
      // warpgroup 1 skips its last pass, so the counts balance.
      if (K::kPingpong && wg == 1) turn_pass(wg);
      #pragma unroll 1
      for (int i = 0; i < i_first; ++i) {
        if (K::kPingpong) turn_wait(wg), turn_pass(wg);
        pass_block(i);
      }
      if (i_first == n_blocks) {   // no block for these rows: only the last issue point
        if (K::kPingpong) {
          turn_wait(wg);
          if (wg == 0) turn_pass(wg);
        }
      } else {
        full_k[stage(i_first)].wait(phase_of(i_first));
        if (K::kPingpong) turn_wait(wg);
        wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, stage(i_first)), acc_s);
        if (K::kPingpong) turn_pass(wg);
        {
          [[maybe_unused]] auto drop_bits = draw_bits(n_block_max - 1 - i_first);
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_s);
          release(empty_k[stage(i_first)]);
          mask(acc_s, n_block_max - 1 - i_first);
          softmax_lazy(acc_s, correction);   // O is still zero: nothing to rescale
          apply_bits(acc_s, drop_bits);
        }
        convert_into(acc_s, p_frag);
        // Blocks i_first + 1 .. n_blocks - 1 as a loop that tests at its end, behind one guard (as the backward's
        // query walk). H100 (twenty-eighth session, ratio to cuDNN at 2k, base / this / base2): hdim 256 causal 1.068 /
        // 1.096 / 1.070, 1.074 / 1.106 / 1.079, 1.082 / 1.089 / 1.085; the other five 2k shapes level.
        if (i_first + 1 < n_blocks) {
          for (int i = i_first + 1;;) {
            const int n_block = n_block_max - 1 - i, s = stage(i), sp = stage(i - 1);
            const uint32_t phase = phase_of(i), phase_p = phase_of(i - 1);
            full_k[s].wait(phase);
            full_v[sp].wait(phase_p);
            if (K::kPingpong) turn_wait(wg);
            wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, s), acc_s);
            warpgroup_fence_operand(tOrP);
            wgmma_issue<false>(mma_o, tOrP, tOrVt(_, _, _, sp), acc_o);
            if (K::kPingpong) turn_pass(wg);
            [[maybe_unused]] auto drop_bits = draw_bits(n_block);
            warpgroup_wait<1>();   // S of block i is in; P V of block i - 1 may still run
            warpgroup_fence_operand(acc_s);
            bool rescale = false;
            if constexpr (K::kStaleMax) {
              mask(acc_s, n_block);
              float block_sum[kRows];
              const bool redo = exp_stale(acc_s, block_sum);
              wait_pv(block_sum, sp);
              if (warpgroup_any(redo, wg)) {
                // Rare (a jump in the scores, a row's first key): the exact step from S again; K's buffer is still
                // this warpgroup's, and the wgmma needs the whole warpgroup, hence the vote.
                wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, s), acc_s);
                warpgroup_wait<0>();
                warpgroup_fence_operand(acc_s);
                mask(acc_s, n_block);
                rescale = softmax_lazy(acc_s, correction);
              } else {
                CUTE_UNROLL
                for (int r = 0; r < kRows; ++r) row_sum[r] += block_sum[r];
              }
              release(empty_k[s]);
              apply_bits(acc_s, drop_bits);   // after the sums: the normaliser sees every key
            } else {
              release(empty_k[s]);
              mask(acc_s, n_block);
              rescale = softmax_lazy(acc_s, correction);
              apply_bits(acc_s, drop_bits);
              wait_pv(row_sum, sp);
            }
            if (rescale) rescale_o(correction);
            convert_into(acc_s, p_frag);
            if (++i == n_blocks) break;
          }
        }
        const int s = stage(n_blocks - 1);
        full_v[s].wait(phase_of(n_blocks - 1));
        if (K::kPingpong) turn_wait(wg);
        warpgroup_fence_operand(tOrP);
        wgmma_issue<false>(mma_o, tOrP, tOrVt(_, _, _, s), acc_o);
        if (K::kPingpong && wg == 0) turn_pass(wg);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        release(empty_v[s]);
      }
    }

    // Epilogue: normalise, lse = (max * scale_log2 + log2(sum)) * ln 2; a row that saw no key gives 0 and -inf.
    Tensor o = rowcol_sm90(acc_o);
    float lse[kRows];
    finish_rows(o, row_max, row_sum, scale_log2, K::kDropout ? dropout.rp : 1.f, lse);

    kv += n_blocks;
    const int q_rows_left = seqlen_q - m_block * kBlockM;
    Tensor tOcO = rowcol_sm90(thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    if constexpr (K::kSplit) {
      // A split tail's piece: the warpgroup's last piece to finish merges them and stores O and lse. Rows past the
      // sequence have nothing to merge.
      // The item again from the CTA's index (a split grid has one per CTA) rather than held through the main loop.
      const SplitItem it = work_item<K>(p, blockIdx.x);
      if (it.piece >= 0) {
        if (64 * wg < q_rows_left) {
          finish_piece<Element, kBlockM, kHeadDim, K::kConsumerWGs>(
              p, o, lse, tOcO, it.piece, it.slot, wg,
              static_cast<Element*>(p.o) + tile.o_off + bidh * p.o_head_stride +
                  int64_t(m_block) * kBlockM * p.o_row_stride,
              static_cast<float*>(p.lse) + tile.lse_off + bidh * p.lse_head_stride + m_block * kBlockM, q_rows_left,
              reinterpret_cast<float*>(q_buf + wg * 64 * 64));
        }
        return;
      }
    }
    if (get<1>(tOcO(0, 0)) == 0) {
      float* lse_ptr = static_cast<float*>(p.lse) + tile.lse_off + bidh * p.lse_head_stride + m_block * kBlockM;
      CUTE_UNROLL
      for (int r = 0; r < size<0>(o); ++r) {
        const int row = get<0>(tOcO(r, 0));
        if (row < q_rows_left) lse_ptr[row] = lse[r];
      }
    }

    Element* o_ptr = static_cast<Element*>(p.o) + tile.o_off + bidh * p.o_head_stride +
                     int64_t(m_block) * kBlockM * p.o_row_stride;
    Tensor sO = make_tensor(make_smem_ptr(q_buf), typename K::SmemLayoutQ{});
    // Decided here rather than held through the main loop.
    const FwdSm90Tile::OStore o_store = tile.template o_store<K::kPersistent>(p, m_block, kBlockM);
    if (o_store == FwdSm90Tile::OStore::kZeros) {
      // No Q was loaded: O = 0 straight to global memory (the walk hands the buffer back).
      store_rows_sm90<typename K::Tiles, kBlockM, kHeadDim, true>(sO, o_ptr, p.o_row_stride, q_rows_left, p.head_dim,
                                                                  ctidx);
      return;
    }
    // O through shared memory: each warpgroup writes its own 64 rows of Q's tile, which only it has read.
    // 32-bit stores: stmatrix here measured level to -4% (NOTES, thirty-first session).
    store_pairs(convert_fragment<Element>(acc_o), thr_o.partition_C(sO));
    if (o_store == FwdSm90Tile::OStore::kTma) {
      // Then TMA stores of the warpgroup's rows, one 64-column box each: no barrier over all the consumers, and the
      // threads go on while the stores drain. The map clips rows and columns past the tensor; a varlen tile comes
      // here only when all its rows are its sequence's (past them the next sequence begins).
      cutlass::arch::fence_view_async_shared();   // the generic-proxy writes above, before the TMA unit reads them
      if (K::kPersistent) return;   // the store warp takes it from here (o_ready)
      asm volatile("bar.sync %0, 128;\n" ::"r"(4 + wg));
      if (ctidx % 128 == 0) {
        store_o_tma<K>(p, q_buf, wg, tile.q_row0 + m_block * kBlockM, bidh, tile.batch_crd);
        tma_store_arrive();
        tma_store_wait<0>();   // read out before the CTA ends
      }
    } else {
      consumer_sync<128 * K::kConsumerWGs>();
      store_rows_sm90<typename K::Tiles, kBlockM, kHeadDim>(sO, o_ptr, p.o_row_stride, q_rows_left, p.head_dim, ctidx);
    }
  };
  if constexpr (!K::kPersistent) {
    if constexpr (K::kSplit) {
      const SplitItem it = work_item<K>(p, blockIdx.x);
      const int3 c = tile_coords<K>(p, it.tile);
      run_tile(c.x, c.y, c.z, 0, it.piece);
    } else {
      const int3 c = grid_tile<K>(p);
      run_tile(c.x, c.y, c.z, 0, -1);
    }
  } else {
    for (int j = 0;; ++j) {   // the tiles the producer took, in its order (see the producer's walk)
      const int qb = j % K::kQBufs;
      full_q[qb].wait((j / K::kQBufs) & 1);
      const int4 slot = tile_slot[qb];
      if (slot.x < 0) break;
      run_tile(slot.y, slot.z, slot.w, qb, -1);
      // O is in buffer qb, or stored without it: the store warp's cue. O's stores into the buffer were generic-proxy
      // writes, its TMA stores and the next Q's load async-proxy ones.
      cutlass::arch::fence_view_async_shared();
      release(o_ready[qb]);
    }
  }
}

}  // namespace flashgen
