// Pieces the Hopper kernels (fwd_sm90.cuh, bwd_sm90.cuh) share: the CuTe set-up, views of wgmma accumulators,
// wgmma issue helpers and the shared-memory -> global stores. A header of its own so that an edit to one kernel
// leaves the other's cache keys (which hash the headers a kernel includes) alone.
#pragma once

// wgmma N extents that are not 2^k x 8 (e.g. 80, 176 keys per block: FlashAttention 3's tiles for head dims 256 and 128)
// come from CuTe's op selectors only with this set; without it a 176-wide S GEMM became eleven 64 x 16 x 16 wgmmas
// per k step. Defined before any CuTe header of the translation unit.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "flashgen/sm80_common.cuh"

namespace flashgen {

// Accumulator of a 64 x N wgmma ((2, 2, N / 8), MMA_M, MMA_N) viewed as (rows, cols): value bit 1 picks row
// r / r + 8, bit 0 column c / c + 1, the third mode the 8-column group.
template <class Layout>
__device__ __forceinline__ constexpr auto rowcol_layout_sm90(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "expects a wgmma accumulator fragment");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}
template <class T>
__device__ __forceinline__ auto rowcol_sm90(T&& t) {
  return make_tensor(t.data(), rowcol_layout_sm90(t.layout()));
}

// The S accumulator (converted to 16 bits) re-read as the register A operand of O += P V: two adjacent 8-column
// groups are one k16 slice of the A fragment ((2, 2, 2), MMA_M, block_n / 16).
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_a_layout_sm90(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "expects a wgmma accumulator fragment");
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0, "");
  auto l = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<1>(l), get<2, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(l), get<2>(acc))));
}

// Issues acc (+)= A B over the whole k extent as one wgmma batch (committed, not waited for). kZero: acc = A B.
template <bool kZero, class TiledMma, class A, class B, class C>
__device__ __forceinline__ void wgmma_issue(TiledMma& mma, A const& a, B const& b, C& acc) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZero) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

constexpr uint64_t kEvictNormal = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);

// One tile of kRows rows at `row` of a 4-D tensor map (head dim, rows, heads, batch) into `dst`, as kChunks boxes of
// kRows x 64 columns one after the other, completing on `bar`: the caller has armed it with the tile's bytes.
template <int kRows, int kChunks, class Element, class Barrier>
__device__ __forceinline__ void tma_load_tile(Barrier& bar, cute::TmaDescriptor const& map, Element* dst, int row,
                                              int head, int batch) {
  CUTE_UNROLL
  for (int c = 0; c < kChunks; ++c) {
    SM90_TMA_LOAD_4D::copy(&map, reinterpret_cast<uint64_t*>(&bar), kEvictNormal, dst + c * kRows * 64, c * 64, row,
                           head, batch);
  }
}

// Tile t of `blocks` blocks per (head, batch) pair, with causal work falling from block rank 0 on: (rank, pair). group 0
// walks each pair's blocks in turn; group g > 0 takes rank 0 of g pairs, then rank 1 of the same pairs, and so on, so
// the heavy blocks start first and the grid ends on light ones (a short tail), while the CTAs that run together stay
// on a few heads (their Q / K / V and dQ tiles share L2). The last group may hold fewer pairs.
__device__ __forceinline__ int2 grouped_tile(int t, int blocks, int pairs, int group) {
  if (group <= 0) return make_int2(t % blocks, t / blocks);
  const int first = t / (group * blocks) * group;   // the group's first pair
  const int size = min(group, pairs - first);
  const int w = t - first * blocks;
  return make_int2(w / size, first + w % size);
}

// Named barrier over the consumer warpgroups (id 0 is __syncthreads').
template <int kThreads>
__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads));
}

// Element offset -> 32-bit shared-memory address in tensor s (its swizzle applied). CuTe's swizzle_ptr swizzles the
// generic address: each access then takes a 64-bit register pair and loses the state space (the hdim 256 backward's
// epilogue spilled them; its loop's dS stores cost the hdim 128 backward 2-5%). The shared window's base has zeros in
// every bit a swizzle touches, so both give the same bank pattern.
template <class STensor>
__device__ __forceinline__ auto smem_addr_of(STensor const& s) {
  using Swizzle = typename get_swizzle<typename STensor::iterator>::type;
  constexpr uint32_t kBytes = sizeof(typename STensor::value_type);
  const uint32_t base = cast_smem_ptr_to_uint(raw_pointer_cast(s.data().get()));
  return [base](int offset) { return Swizzle::apply(base + uint32_t(offset) * kBytes); };
}

// (rows x kHeadDim) tile in a GMMA K-major swizzled smem layout -> global, 16-byte units, rows < rows_left and
// columns < head_dim only. kZero: zeros instead (s is not read).
template <class Tiles, int kRows, int kHeadDim, bool kZero = false, class STensor, class Element>
__device__ __forceinline__ void store_rows_sm90(STensor const& s, Element* gptr, int64_t row_stride, int rows_left,
                                                int head_dim, int tidx) {
  Tensor g = make_tensor(make_gmem_ptr(gptr), make_shape(Int<kRows>{}, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
  typename Tiles::GmemCopyStore gmem_store;
  auto thr = gmem_store.get_thread_slice(tidx);
  Tensor tg = thr.partition_D(g);
  Tensor tc = thr.partition_D(make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{}));
  const auto smem_addr = smem_addr_of(s);
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tg); ++m) {
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tg); ++k) {
      const int row = get<0>(tc(0, m, k)), col = get<1>(tc(0, m, k));
      if (row < rows_left && col < head_dim) {
        // 8 columns starting at a multiple of 8 are one 16-byte unit of the swizzled tile.
        uint4 v = make_uint4(0, 0, 0, 0);
        if constexpr (!kZero) {
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(smem_addr(s.layout()(row, col))));
        }
        *reinterpret_cast<uint4*>(&tg(0, m, k)) = v;
      }
    }
  }
}

// A 16-bit wgmma accumulator fragment into its shared-memory partition, two values per 32-bit store: values j and
// j + 1 are adjacent columns, which every layout used here keeps in one 16-byte unit.
template <class Frag, class STensor>
__device__ __forceinline__ void store_pairs(Frag const& r, STensor&& s) {
  using Element = typename Frag::value_type;
  static_assert(sizeof(Element) == 2, "");
  const auto smem_addr = smem_addr_of(s);
  CUTE_UNROLL
  for (int j = 0; j < size(r); j += 2) {
    cutlass::Array<Element, 2> v;
    v[0] = r(j), v[1] = r(j + 1);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_addr(s.layout()(j))),
                 "r"(*reinterpret_cast<uint32_t const*>(&v)));
  }
}

// A 16-bit fragment in tiled_mma's accumulator layout (thread tidx) into the whole shared-memory tile s by stmatrix:
// four 8 x 8 matrices per instruction, one row address per lane.
template <class TiledMma, class Frag, class STensor>
__device__ __forceinline__ void store_stsm(TiledMma const& mma, int tidx, Frag const& r, STensor const& s) {
  auto tiled = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, typename Frag::value_type>{}, mma);
  auto thr = tiled.get_thread_slice(tidx);
  copy(tiled, thr.retile_S(r), thr.partition_D(s));
}

// Split tail (the forward over key ranges, the backward over query ranges): item u of a launch whose last split_tiles
// of `tiles` tiles run as split_k pieces each, a tile's pieces consecutive: its tile, its piece (-1: the whole tile)
// and the slot of the piece's partial results (the tail's pieces in order).
struct SplitItem {
  int tile, piece, slot;
};

// (A launch without a split passes split_tiles 0: every item is whole.)
__device__ __forceinline__ SplitItem split_item(int u, int tiles, int split_tiles, int split_k) {
  const int whole = tiles - split_tiles;
  if (u < whole) return {u, -1, 0};
  const int v = u - whole;
  return {whole + v / split_k, v % split_k, v};
}

}  // namespace flashgen
