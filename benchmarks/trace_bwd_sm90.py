"""Where a Hopper backward CTA's time goes outside its query walk: clock64 stamps per CTA (one key block each) at the
boundaries of its prologue, walk and epilogue, from a traced copy of bwd_sm90.cuh.

    python benchmarks/trace_bwd_sm90.py compile [--hdim 64 128] [--causal 0] [--seqlen 2048] [--header H]   (no GPU)
    python benchmarks/trace_bwd_sm90.py run ...     (the same arguments, on the GPU; writes --npy)
    python benchmarks/trace_bwd_sm90.py analyze [--npy DIR]

`compile` writes the traced header next to the cubins (--out) and compiles it with ab_sm90.py (variant "tr"), so
carry --out to the device. Stamps are SM clock cycles (clock64); the analysis gives each phase in cycles and in steps
(the walk's median cycles per query block), so a fixed cost reads directly against the model of NOTES' thirty-fourth
session (W = steps x s + F per wave). Phases per CTA (the first consumer thread's view, but `gap`):

    kv      entry -> K and V in             q0      K and V in -> step 0's Q and dO in
    walk    the query blocks (per step)     drain   walk done -> the last dQ reduces done, consumers synced
    epi     dK, dV out (its own stores)     gap     the previous CTA's end on the same SM -> this CTA's entry
"""
from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ab_sm90  # noqa: E402
import trace_fwd_sm90  # noqa: E402

CTAS, EVENTS = 16384, 8   # [cta][event]: smid + 1, entry, kv, q0, walk end, drain end, epilogue end, steps

_DECL = """// Trace (benchmarks/trace_bwd_sm90.py): per CTA [smid + 1, clock64 x 6, steps].
constexpr int kTrCtas = %d, kTrEv = %d;
__device__ long long fg_trace[kTrCtas * kTrEv];
__device__ __forceinline__ void tr_put(int e, long long v, bool on) {
  const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (on && cta < kTrCtas) fg_trace[cta * kTrEv + e] = v;
}
__device__ __forceinline__ void tr_rec(int e, bool on) { tr_put(e, clock64(), on); }
""" % (CTAS, EVENTS)
_ENTRY = """  {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    tr_put(0, sm + 1, tidx == 0);
  }
  tr_rec(1, tidx == 0);
"""
EDITS = [
    ("template <class K, class Params>\n__device__ __forceinline__ void bwd_sm90(Params const& p, char* smem) {\n",
     _DECL, ""),
    ("  // Causal: key blocks heaviest first", _ENTRY, ""),
    ("    full_kv.wait(0);\n", "", "    tr_rec(2, ctidx == 0);\n"),
    ("      full[s].wait(phase);\n", "", "      tr_rec(3, ctidx == 0 && i == 0);\n"),
    ("  // Epilogue: dK *= scale;", "  tr_rec(4, ctidx == 0);\n  tr_put(7, n_iters, ctidx == 0);\n", ""),
    ("  if constexpr (K::kSplit) {\n    // A split grid is one-dimensional", "  tr_rec(5, ctidx == 0);\n", ""),
    ("  store_rows_sm90<typename K::Tiles, kBlockN, kHeadDim>(sV, dv_ptr, p.dv_row_stride, k_rows_left, p.head_dim, "
     "ctidx);\n", "", "  tr_rec(6, ctidx == 0);\n"),
]


def analyze(npy_dir):
    """Per shape: each phase's median in cycles and in walk steps, and the fixed cost they add up to."""
    import numpy as np
    for fn in sorted(glob.glob(os.path.join(npy_dir, "*_r1.npy"))):
        a = np.load(fn).reshape(CTAS, EVENTS)
        a = a[(a[:, :7] > 0).all(axis=1)].astype(float)   # whole CTAs (a split tail's pieces but the last end early)
        steps = a[:, 7]
        step = np.median((a[:, 4] - a[:, 3])[steps > 0] / steps[steps > 0])
        ph = {"kv": a[:, 2] - a[:, 1], "q0": a[:, 3] - a[:, 2], "drain": a[:, 5] - a[:, 4], "epi": a[:, 6] - a[:, 5]}
        gaps = []
        for sm in np.unique(a[:, 0]):
            c = a[a[:, 0] == sm]
            c = c[np.argsort(c[:, 1])]
            gaps.extend(c[1:, 1] - c[:-1, 6])
        ph["gap"] = np.array(gaps)
        print(f"{os.path.basename(fn)[:-7]}: {len(a)} CTAs, walk {step:.0f} cycles a step, "
              f"{np.median(steps):.0f} steps (median)")
        fixed = 0.0
        for name, d in ph.items():
            med = float(np.median(d))
            fixed += med
            print(f"  {name:6s} {med:8.0f} cycles {med / step:6.2f} steps  (p90 {np.percentile(d, 90):8.0f})")
        print(f"  fixed  {fixed:8.0f} cycles {fixed / step:6.2f} steps")


def main(argv=None) -> int:
    return trace_fwd_sm90.trace_main(argv, __doc__, "bwd", EDITS, analyze,
                                     ("--hdim", "64", "128", "--causal", "0", "--seqlen", "2048"))


if __name__ == "__main__":
    sys.exit(main())
