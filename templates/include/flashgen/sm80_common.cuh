// Building blocks shared by the SM80-path (mma.sync) attention kernels: predicated tile copies,
// register-pipelined GEMMs, fragment layout views and conversions, quad reductions.
#pragma once

#include <cuda/std/limits>
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "flashgen/dropout.cuh"

namespace flashgen {
using namespace cute;

constexpr float kInf = cuda::std::numeric_limits<float>::infinity();

// Swizzled shared-memory tiles and 16-byte global copies for rows of kDim elements.
template <class Element, int kDim, int kNThreads>
struct RowTiles {
  // Rows of 64 elements (128 B) take the full 8-way swizzle, so ldmatrix is conflict-free.
  static constexpr int kBlockKSmem = kDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzle, 3, 3>{}, Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  template <int kRows>
  using SmemLayout = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kRows>, Int<kDim>>{}));
  // A row of the smem atom is covered by kThreadsPerRow threads.
  static constexpr int kElemsPerAccess = 16 / sizeof(Element);
  static constexpr int kThreadsPerRow = kBlockKSmem / kElemsPerAccess;
  using GmemThreadLayout = Layout<Shape<Int<kNThreads / kThreadsPerRow>, Int<kThreadsPerRow>>,
                                  Stride<Int<kThreadsPerRow>, _1>>;
  using GmemCopyLoad = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
                                                GmemThreadLayout{}, Layout<Shape<_1, Int<kElemsPerAccess>>>{}));
  using GmemCopyStore = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{},
                                                 GmemThreadLayout{}, Layout<Shape<_1, Int<kElemsPerAccess>>>{}));
  static_assert(kDim % kBlockKSmem == 0, "");
};

// Global -> shared (or back) copy of one (CPY, CPY_ROWS, CPY_COLS) partition. Rows at or past
// `rows_left` (checked only with kCheckRows: interior tiles are full) and column chunks whose predicate
// is false are skipped; with kClear the skipped part of the destination is zero-filled, so padded
// rows/columns contribute nothing to the GEMMs.
template <bool kCheckRows, bool kEvenCols, bool kClear, class TiledCopy, class Src, class Dst, class Coord, class Pred>
__device__ __forceinline__ void copy_tile(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                          Coord const& coord, Pred const& col_ok, int rows_left) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (!kCheckRows || get<0>(coord(0, m, 0)) < rows_left) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (kEvenCols || col_ok(k)) {
          copy(tiled_copy, src(_, m, k), dst(_, m, k));
        } else if (kClear) {
          clear(dst(_, m, k));
        }
      }
    } else if (kClear) {
      clear(dst(_, m, _));
    }
  }
}

// Per column chunk of a copy partition: is it inside the runtime head dim? (Unused when kEven.)
template <bool kEven, class Coords>
__device__ __forceinline__ auto column_predicate(Coords const& coords, int head_dim) {
  Tensor ok = make_tensor<bool>(make_shape(size<2>(coords)));
  if (!kEven) {
    CUTE_UNROLL
    for (int k = 0; k < size(ok); ++k) ok(k) = get<1>(coords(0, 0, k)) < head_dim;
  }
  return ok;
}

// A (kRows x kCols) tile from shared memory to global memory with 16-byte stores, rows past rows_left and
// columns outside the head dim skipped.
template <class GmemCopyStore, int kRows, int kCols, bool kEvenCols, class STensor, class GTensor, class Pred>
__device__ __forceinline__ void store_tile(STensor const& s, GTensor& g, Pred const& col_ok, int rows_left, int tidx) {
  GmemCopyStore gmem_store;
  auto thr = gmem_store.get_thread_slice(tidx);
  Tensor tg = thr.partition_D(g);
  Tensor tr = make_tensor<typename GTensor::value_type>(shape(tg));
  copy(gmem_store, thr.partition_S(s), tr);
  Tensor tc = thr.partition_D(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
  copy_tile<true, kEvenCols, false>(gmem_store, tr, tg, tc, col_ok, rows_left);
}

// acc += A * B with both operands in shared memory; the ldmatrix of k-slice i+1 is issued before the
// MMAs of slice i so shared-memory latency hides behind tensor-core work.
template <class TiledMma, class Acc, class RA, class RB, class SA, class SB, class CopyA, class CopyB>
__device__ __forceinline__ void gemm_ss(TiledMma& tiled_mma, Acc& acc, RA& rA, RB& rB, SA const& sA,
                                        SB const& sB, CopyA const& copy_a, CopyB const& copy_b, int tidx) {
  auto thr_a = copy_a.get_thread_slice(tidx);
  auto thr_b = copy_b.get_thread_slice(tidx);
  Tensor rA_view = thr_a.retile_D(rA);
  Tensor rB_view = thr_b.retile_D(rB);
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(rA); ++i) {
    if (i + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, i + 1), rA_view(_, _, i + 1));
      copy(copy_b, sB(_, _, i + 1), rB_view(_, _, i + 1));
    }
    cute::gemm(tiled_mma, rA(_, _, i), rB(_, _, i), acc);
  }
}

// acc += A * B with A already in registers (the softmax probabilities) and B in shared memory.
template <class TiledMma, class Acc, class RA, class RB, class SB, class CopyB>
__device__ __forceinline__ void gemm_rs(TiledMma& tiled_mma, Acc& acc, RA const& rA, RB& rB, SB const& sB,
                                        CopyB const& copy_b, int tidx) {
  auto thr_b = copy_b.get_thread_slice(tidx);
  Tensor rB_view = thr_b.retile_D(rB);
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(rA); ++i) {
    if (i + 1 < size<2>(rA)) {
      copy(copy_b, sB(_, _, i + 1), rB_view(_, _, i + 1));
    }
    cute::gemm(tiled_mma, rA(_, _, i), rB(_, _, i), acc);
  }
}

// View of an m16n8 accumulator fragment ((2,2), MMA_M, MMA_N) as (rows, cols):
// value bit 1 picks row r / r+8, value bit 0 picks column c / c+1.
template <class Layout>
__device__ __forceinline__ constexpr auto rowcol_layout(Layout const& acc) {
  static_assert(decltype(size<0>(acc))::value == 4, "expects an SM80 m16n8 accumulator fragment");
  auto l = logical_divide(acc, Shape<_2>{});
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

template <class T>
__device__ __forceinline__ auto rowcol(T&& t) {
  return make_tensor(t.data(), rowcol_layout(t.layout()));
}

// The accumulator of S = Q K^T re-read as the A operand of O += P V: two adjacent n8 accumulator
// tiles hold exactly the k16 slice an m16n8k16 A fragment needs.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_as_a_layout(Layout const& acc) {
  static_assert(decltype(size<0>(acc))::value == 4, "expects an SM80 m16n8 accumulator fragment");
  static_assert(decltype(size<2>(acc))::value % 2 == 0, "needs an even number of n8 tiles");
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Register fragment converted into an existing one of another element type and the same size (vectorized: cvt packs
// two values at a time). Into a fragment that lives across a loop iteration (the Hopper forward's P) this writes its
// registers directly; an element-wise copy of a converted temporary cost ~100 byte permutes per block there.
template <class Src, class Dst>
__device__ __forceinline__ void convert_into(Src const& src, Dst& dst) {
  using From = typename Src::value_type;
  using To = typename Dst::value_type;
  constexpr int N = decltype(size(src))::value;
  static_assert(N == decltype(size(dst))::value, "");
  *reinterpret_cast<cutlass::Array<To, N>*>(raw_pointer_cast(dst.data())) =
      cutlass::NumericArrayConverter<To, From, N>{}(
          *reinterpret_cast<cutlass::Array<From, N> const*>(raw_pointer_cast(src.data())));
}

// Register fragment converted to another element type, in a new fragment of the same layout.
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& src) {
  Tensor dst = make_tensor<To>(src.layout());
  convert_into(src, dst);
  return dst;
}

// Max / sum across the 4 lanes of a quad: an m16n8 accumulator row is spread over them.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x + __shfl_xor_sync(0xffffffff, x, 1);
}

// A row's max over kMaxWays interleaved partial maxima (exact: max is associative): measured against the serial chain
// with the lazy vote below on the H200 (twenty-fourth session), hdim 64 forward +1-3.5%, hdim 128 level to +1.5%.
constexpr int kMaxWays = 4;

// op over row r of a (rows, cols) fragment view as kWays interleaved partial results combined at the end: ptxas keeps
// a serial chain's order, so a row's cols-deep chain (one FMNMX or FADD per latency) becomes kWays chains
// cols / kWays deep that issue back to back.
template <int kWays, class S, class Op>
__device__ __forceinline__ float row_reduce(S const& s, int r, Op op) {
  constexpr int kCols = decltype(size<1>(s))::value;
  constexpr int kW = kCols % kWays == 0 ? kWays : 1;
  float part[kW];
  CUTE_UNROLL
  for (int w = 0; w < kW; ++w) part[w] = s(r, w);
  CUTE_UNROLL
  for (int c = kW; c < kCols; ++c) part[c % kW] = op(part[c % kW], s(r, c));
  CUTE_UNROLL
  for (int step = kW / 2; step > 0; step /= 2) {
    CUTE_UNROLL
    for (int w = 0; w < step; ++w) part[w] = op(part[w], part[w + step]);
  }
  return part[0];
}

// One step of the online softmax, base 2, on a (rows, cols) view of the S accumulator whose rows are spread over
// the 4 lanes of a quad (mma.sync and wgmma alike): S becomes P = 2^(s * scale_log2 - max * scale_log2), the row max
// and sum move on, and correction[r] is the factor row r of O must be rescaled by (rescale_rows).
// kLazy: a row keeps its running max unless the block's exceeds it by more than kLazyRescaleLog2 (log2 units of the
// scaled scores), so P stays below 2^kLazyRescaleLog2 and most blocks need no rescale of O. Exact: O, the row sums and
// lse use the same max. Returns whether any row of the warp took a new max (without kLazy: true, always rescale).
constexpr float kLazyRescaleLog2 = 8.f;
template <bool kLazy = false, class S>
__device__ __forceinline__ bool online_softmax(S s, float* row_max, float* row_sum, float scale_log2,
                                               float* correction) {
  constexpr int kRows = decltype(size<0>(s))::value;
  float m[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    m[r] = row_reduce<kMaxWays>(s, r, [](float a, float b) { return fmaxf(a, b); });
    if constexpr (!kLazy) m[r] = fmaxf(m[r], row_max[r]);
  }
  [[maybe_unused]] bool moved = false;
  auto quad_maxes = [&] {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      m[r] = quad_max(m[r]);
      if constexpr (kLazy) {
        // A row with every key masked so far has max -inf: any finite block max replaces it (the difference is +inf).
        m[r] = (m[r] - row_max[r]) * scale_log2 > kLazyRescaleLog2 ? m[r] : row_max[r];
        moved |= m[r] != row_max[r];
      }
    }
  };
  if constexpr (kLazy) {
    // Where no lane's own maximum moves a row, no quad's does: one vote instead of the shuffles' latency.
    bool stay = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) stay &= (m[r] - row_max[r]) * scale_log2 <= kLazyRescaleLog2;
    if (__all_sync(0xffffffffu, stay)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) m[r] = row_max[r];
    } else {
      quad_maxes();
    }
  } else {
    quad_maxes();
  }
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    // A row with every key masked so far keeps max -inf: use 0 so exp2 gives 0, never NaN.
    const float m_scaled = m[r] == -kInf ? 0.f : m[r] * scale_log2;
    correction[r] = exp2f(row_max[r] * scale_log2 - m_scaled);
    row_max[r] = m[r];
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) s(r, c) = exp2f(s(r, c) * scale_log2 - m_scaled);
    // The sum stays one serial chain (the order the tests' numbers were taken with): it trails the MUFU anyway.
    row_sum[r] = row_sum[r] * correction[r] + row_reduce<1>(s, r, [](float a, float b) { return a + b; });
  }
  if constexpr (kLazy) return __any_sync(0xffffffffu, moved);
  return true;
}

// Keys >= limit(row) of one key block get -inf: the sequence end, and with causal the bottom-right-aligned diagonal.
// s: (rows, cols) view of the S accumulator; coords: the same view of its (row, col) within the tile.
template <bool kCausal, int kBlockM, int kBlockN, class S, class Coords>
__device__ __forceinline__ void mask_block(S s, Coords const& coords, int m_block, int n_block, int seqlen_k,
                                           int diag_shift) {
  const bool need_mask = (n_block + 1) * kBlockN > seqlen_k ||
                         (kCausal && (n_block + 1) * kBlockN - 1 > m_block * kBlockM + diag_shift);
  if (!need_mask) return;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const int row = m_block * kBlockM + get<0>(coords(r, 0));
    const int limit = kCausal ? min(seqlen_k, row + 1 + diag_shift) : seqlen_k;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      if (n_block * kBlockN + get<1>(coords(r, c)) >= limit) s(r, c) = -kInf;
    }
  }
}

// Epilogue of the online softmax: O /= rowsum (times `scale`, e.g. the dropout keep-rate inverse) and
// lse = (max * scale_log2 + log2(sum)) * ln 2; a row that saw no key gives 0 and lse -inf.
template <class O>
__device__ __forceinline__ void finish_rows(O o, float const* row_max, float const* row_sum, float scale_log2,
                                            float scale, float* lse) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(o); ++r) {
    const float sum = quad_sum(row_sum[r]);
    const bool empty = sum == 0.f || sum != sum;
    const float inv = empty ? 1.f : scale / sum;
    lse[r] = empty ? -kInf : (row_max[r] * scale_log2 + __log2f(sum)) * 0.6931471805599453f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
  }
}

template <class O>
__device__ __forceinline__ void rescale_rows(O o, float const* correction) {
  CUTE_UNROLL
  for (int r = 0; r < size<0>(o); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
  }
}

// The random words of an SM80 m16n8 accumulator fragment ((2,2), MMA_M, MMA_N), one Philox call per 16-row x
// 32-column block. They depend on coordinates only, so the kernels draw them before the GEMM whose result they
// mask: the integer work then overlaps the tensor-core work instead of sitting between softmax and P V.
// coords: the fragment's (row, col) within the tile (partition_C of an identity tensor); row0/col0: the tile's
// first row/col in the sequence. Needs MMA_N tiles 4j..4j+3 of a thread to be the four 8-column slices of one
// 32-column block (a warp's N extent in contiguous 32s).
template <int kM, int kN4>
struct DropoutBits {
  uint4 r[kM][kN4];
};
struct NoDropoutBits {};

template <bool kEnabled, class Coords>
__device__ __forceinline__ auto dropout_bits(Dropout const& dropout, Coords const& coords, int row0, int col0) {
  if constexpr (kEnabled) {
    constexpr int kM = decltype(size<1>(coords))::value;
    constexpr int kN = decltype(size<2>(coords))::value;
    static_assert(decltype(size<0>(coords))::value == 4, "expects an m16n8 accumulator fragment");
    static_assert(kN % 4 == 0, "needs n8 tiles in fours");
    DropoutBits<kM, kN / 4> bits;
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int n = 0; n < kN; n += 4) {
        const int row = row0 + get<0>(coords(0, m, n));
        const int col = col0 + get<1>(coords(0, m, n));
        bits.r[m][n / 4] = philox4x32_10(dropout.key, dropout.counter(row, col));
      }
    }
    return bits;
  } else {
    return NoDropoutBits{};
  }
}

// Calls f(v, m, n, keep) for every entry of the fragment the bits were drawn for.
template <int kM, int kN4, class F>
__device__ __forceinline__ void dropout_apply(Dropout const& dropout, DropoutBits<kM, kN4> const& bits, F&& f) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int j = 0; j < kN4; ++j) {
      const uint32_t w[4] = {bits.r[m][j].x, bits.r[m][j].y, bits.r[m][j].z, bits.r[m][j].w};
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        f(v, m, 4 * j, dropout.keep_byte<0>(w[v]));
        f(v, m, 4 * j + 1, dropout.keep_byte<1>(w[v]));
        f(v, m, 4 * j + 2, dropout.keep_byte<2>(w[v]));
        f(v, m, 4 * j + 3, dropout.keep_byte<3>(w[v]));
      }
    }
  }
}

// Zeroes the dropped entries of P after its conversion to 16-bit pairs (the A operand of P V): per pair one PRMT
// spreads the two keep flags (sign replication of a flag byte over a 16-bit half) into an AND mask.
template <int kM, int kN4, class Frag>
__device__ __forceinline__ void dropout_apply_packed(Dropout const& dropout, DropoutBits<kM, kN4> const& bits,
                                                     Frag& frag) {
  static_assert(sizeof(typename Frag::value_type) == 2, "expects 16-bit P");
  static_assert(decltype(size<1>(frag))::value == kM && decltype(size<2>(frag))::value == 4 * kN4, "");
  // Compact ((2,2), M, N): values 0,1 (row r, cols c and c+1) of tile (m, n) form one 32-bit word, values 2,3 the next.
  static_assert(cute::is_same_v<decltype(frag.layout()), decltype(make_layout(frag.shape()))>, "");
  uint32_t* words = reinterpret_cast<uint32_t*>(raw_pointer_cast(frag.data()));
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int j = 0; j < kN4; ++j) {
      const uint4 r = bits.r[m][j];
      const uint32_t k0 = dropout.keep_flags(r.x), k1 = dropout.keep_flags(r.y);
      const uint32_t k2 = dropout.keep_flags(r.z), k3 = dropout.keep_flags(r.w);
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int w = 2 * (m + kM * (4 * j + b));
        // Bytes 0-1 <- sign of byte b of the first word, bytes 2-3 <- sign of byte b of the second.
        constexpr uint32_t kSel[4] = {0xCC88u, 0xDD99u, 0xEEAAu, 0xFFBBu};
        uint32_t mask01, mask23;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mask01) : "r"(k0), "r"(k1), "r"(kSel[b]));
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mask23) : "r"(k2), "r"(k3), "r"(kSel[b]));
        words[w] &= mask01;
        words[w + 1] &= mask23;
      }
    }
  }
}

__device__ __forceinline__ void cp_async_fence() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

}  // namespace flashgen
