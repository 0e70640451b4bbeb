// The SM80 forward's GEMM steps with ldmatrix addressed through immediates (FwdTraits.ldsm_imm): the same loops as
// gemm_ss / gemm_rs in sm80_common.cuh, with each thread's shared-memory addresses held as a few registers.
#pragma once

#include "flashgen/sm80_common.cuh"

namespace flashgen {

// ldmatrix of k-slice K of a thread's smem copy partition (CPY, CPY_MN, CPY_K), columns [N0, N0 + NCount) of
// CPY_MN, into its register view. The partition's offset splits into the modes with run-time strides (the
// swizzle's per-thread part: a few registers, computed once) and those with static strides, which go into the
// instruction as an immediate. Left to CuTe's copy, NVVM kept every (mn, k) address as a loop-invariant register
// of its own: 40 of them in the hdim 128 forward, which spilled (NOTES.md).
template <bool kTrans, int N0, int NCount, class STensor, class RTensor, int K>
__device__ __forceinline__ void ldsm_slice(STensor const& s, RTensor& r, Int<K>) {
  using T = typename STensor::value_type;
  static_assert(sizeof(T) == 2 && decltype(size<0>(s))::value == 8, "one ldmatrix.x4 per 8 16-bit values");
  auto keep_static = [](auto st) {
    if constexpr (is_static<decltype(st)>::value) return st; else return Int<0>{};
  };
  auto keep_dynamic = [](auto st) {
    if constexpr (is_static<decltype(st)>::value) return Int<0>{}; else return st;
  };
  auto static_part = make_layout(shape(s.layout()), transform_leaf(stride(s.layout()), keep_static));
  auto dynamic_part = make_layout(shape(s.layout()), transform_leaf(stride(s.layout()), keep_dynamic));
  const uint32_t base = cast_smem_ptr_to_uint(raw_pointer_cast(s.data()));
  cute::for_each(make_int_sequence<NCount>{}, [&](auto j) {
    constexpr int n = N0 + decltype(j)::value;
    constexpr int kOff = decltype(static_part(_0{}, Int<n>{}, Int<K>{}))::value * int(sizeof(T));
    const uint32_t addr = base + uint32_t(dynamic_part(0, n, K)) * uint32_t(sizeof(T));
    Tensor d = recast<uint32_t>(r(_, Int<n>{}, Int<K>{}));
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4+%5];\n"
                   : "=r"(d(0)), "=r"(d(1)), "=r"(d(2)), "=r"(d(3)) : "r"(addr), "n"(kOff));
    } else {
      asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4+%5];\n"
                   : "=r"(d(0)), "=r"(d(1)), "=r"(d(2)), "=r"(d(3)) : "r"(addr), "n"(kOff));
    }
  });
}

// Columns [kPass * kCount, (kPass + 1) * kCount) of mode `kMode` of a register fragment, as a view.
template <int kMode, int kCount, int kPass, class T>
__device__ __forceinline__ auto fragment_cols(T&& t) {
  auto lay = t.layout();
  auto cols = layout<0>(logical_divide(layout<kMode>(lay), Int<kCount>{}));
  auto offset = [&] {
    if constexpr (kMode == 1) return lay(0, kPass * kCount, 0); else return lay(0, 0, kPass * kCount);
  }();
  if constexpr (kMode == 1) {
    return make_tensor(t.data() + offset, make_layout(layout<0>(lay), cols, layout<2>(lay)));
  } else {
    return make_tensor(t.data() + offset, make_layout(layout<0>(lay), layout<1>(lay), cols));
  }
}

template <class Copy, class Op>
constexpr bool copy_is = cute::is_same_v<typename Copy::Traits, Copy_Traits<Op>>;

// gemm_ss with A and B (ldmatrix.x4, non-transposed) loaded through ldsm_slice.
template <class TiledMma, class Acc, class RA, class RB, class SA, class SB, class CopyA, class CopyB>
__device__ __forceinline__ void gemm_ss_imm(TiledMma& tiled_mma, Acc& acc, RA& rA, RB& rB, SA const& sA,
                                            SB const& sB, CopyA const& copy_a, CopyB const& copy_b, int tidx) {
  static_assert(copy_is<CopyA, SM75_U32x4_LDSM_N> && copy_is<CopyB, SM75_U32x4_LDSM_N>, "");
  Tensor rA_view = copy_a.get_thread_slice(tidx).retile_D(rA);
  Tensor rB_view = copy_b.get_thread_slice(tidx).retile_D(rB);
  constexpr int kSlices = decltype(size<2>(rA))::value;
  constexpr int kA = decltype(size<1>(rA_view))::value, kB = decltype(size<1>(rB_view))::value;
  ldsm_slice<false, 0, kA>(sA, rA_view, _0{});
  ldsm_slice<false, 0, kB>(sB, rB_view, _0{});
  cute::for_each(make_int_sequence<kSlices>{}, [&](auto i_) {
    constexpr int i = decltype(i_)::value;
    if constexpr (i + 1 < kSlices) {
      ldsm_slice<false, 0, kA>(sA, rA_view, Int<i + 1>{});
      ldsm_slice<false, 0, kB>(sB, rB_view, Int<i + 1>{});
    }
    cute::gemm(tiled_mma, rA(_, _, i), rB(_, _, i), acc);
  });
}

// gemm_rs with B (ldmatrix.x4.trans) loaded through ldsm_slice, in kPasses passes over acc's columns: a pass holds
// the B fragments of its own columns only.
template <int kPasses, class TiledMma, class Acc, class RA, class RB, class SB, class CopyB>
__device__ __forceinline__ void gemm_rs_imm(TiledMma& tiled_mma, Acc& acc, RA const& rA, RB& rB, SB const& sB,
                                            CopyB const& copy_b, int tidx) {
  static_assert(copy_is<CopyB, SM75_U16x8_LDSM_T>, "");
  Tensor rB_view = copy_b.get_thread_slice(tidx).retile_D(rB);
  constexpr int kSlices = decltype(size<2>(rA))::value;
  constexpr int kCopyN = decltype(size<1>(rB_view))::value / kPasses;
  constexpr int kMmaN = decltype(size<1>(rB))::value / kPasses;
  static_assert(kCopyN * kPasses == decltype(size<1>(rB_view))::value, "passes split B's columns evenly");
  cute::for_each(make_int_sequence<kPasses>{}, [&](auto h_) {
    constexpr int h = decltype(h_)::value;
    Tensor rB_cols = fragment_cols<1, kMmaN, h>(rB);
    Tensor acc_cols = fragment_cols<2, kMmaN, h>(acc);
    ldsm_slice<true, h * kCopyN, kCopyN>(sB, rB_view, _0{});
    cute::for_each(make_int_sequence<kSlices>{}, [&](auto i_) {
      constexpr int i = decltype(i_)::value;
      if constexpr (i + 1 < kSlices) ldsm_slice<true, h * kCopyN, kCopyN>(sB, rB_view, Int<i + 1>{});
      cute::gemm(tiled_mma, rA(_, _, i), rB_cols(_, _, i), acc_cols);
    });
  });
}

}  // namespace flashgen
