"""Where a Hopper forward walk's time goes per tile: clock64 stamps at the phase boundaries of every consumer
warpgroup's tiles (and the producer's tile claims), from a traced copy of fwd_sm90.cuh.

    python benchmarks/trace_fwd_sm90.py compile [--hdim 64 128] [--causal 0 1] [--seqlen 2048]   (no GPU needed)
    python benchmarks/trace_fwd_sm90.py run ...     (the same arguments, on the GPU; writes --npy)
    python benchmarks/trace_fwd_sm90.py analyze [--npy DIR]

With FLASHGEN_TRACE_GRID=1 (compile, run and analyze alike) a grid kernel is traced instead: every CTA's one tile, its
SM, its entry and start-up stamps, and per SM the gap from one CTA's end to the next one's entry.

`compile` writes the traced header next to the cubins (--out) and compiles it with ab_sm90.py (variant "tr"), so
carry --out to the device. The stamps are SM clock cycles (clock64), so phase lengths do not depend on the clock the
power cap leaves. The trace costs ~3% (ab_sm90.py bench with the same variant measures it). Only persistent walks
record tiles after the first. Phases per consumer warpgroup and tile (events in the order the code reaches them):

    wait_q     the tile's Q buffer (full_q)           setup    tile set-up, up to the first K wait
    k0         the first K block's wait                s0       the first S GEMM
    soft0      first softmax, up to the second issue    body     the overlapped blocks after it
    drain      the last P V GEMM                        epi      O to shared memory, fenced (a walk's store warp
                                                                 takes it from there)
    storewait  a grid's O stores: barrier, issue, read-out (the leader thread only; none in a walk)
"""
from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ab_sm90  # noqa: E402

# The trace buffer: [cta][tile][warpgroup (3: producer)][event]. A grid kernel (one tile per CTA) is traced with
# FLASHGEN_TRACE_GRID=1 (compile and analyze): every CTA of a 16k-token launch, one tile each.
GRID = os.environ.get("FLASHGEN_TRACE_GRID") == "1"
CTAS, TILES, EVENTS = (4096, 1, 12) if GRID else (264, 48, 12)
PHASES = [("wait_q", 0, 1), ("setup", 1, 10), ("k0", 10, 2), ("s0", 2, 3), ("soft0", 3, 4), ("body", 4, 5),
          ("drain", 5, 6), ("epi", 6, 7), ("storewait", 7, 8)]

# (anchor in fwd_sm90.cuh, what goes before it / after it). Each anchor must occur exactly once.
_DECL = """// Trace (benchmarks/trace_fwd_sm90.py): clock64 per [cta][tile][warpgroup][event].
constexpr int kTrCtas = %d, kTrTiles = %d, kTrEv = %d;
__device__ long long fg_trace[kTrCtas * kTrTiles * 4 * kTrEv];
__device__ __forceinline__ void tr_put(int cta, int j, int w, int e, bool on, long long v) {
  if (on && cta < kTrCtas && j < kTrTiles) fg_trace[((cta * kTrTiles + j) * 4 + w) * kTrEv + e] = v;
}
__device__ __forceinline__ void tr_rec(int cta, int j, int w, int e, bool on) { tr_put(cta, j, w, e, on, clock64()); }
// The CTA's linear index (a grid kernel's grid is 3-D) and its SM.
__device__ __forceinline__ int tr_cta() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }
__device__ __forceinline__ long long tr_smid() {
  unsigned s;
  asm volatile("mov.u32 %%0, %%%%smid;" : "=r"(s));
  return s + 1;   // 0 marks an empty slot
}
""" % (CTAS, TILES, EVENTS)
EDITS = [
    ("template <class K, class Params>\n__device__ __forceinline__ void fwd_sm90(", _DECL, ""),
    ("  // One tile, its Q (and later O) in buffer qb", "  int tr_j = 0;\n  const bool tr_on = ctidx % 128 == 0;\n"
     "  auto TR = [&](int e) { tr_rec(tr_cta(), tr_j, ctidx / 128, e, tr_on); };\n", ""),
    ("        full_k[stage(i_first)].wait(phase_of(i_first));\n        if (K::kPingpong) turn_wait(wg);\n",
     "        TR(10);\n", "        TR(2);\n"),
    ("          release(empty_k[stage(i_first)]);\n          mask(acc_s, n_block_max - 1 - i_first);", "          TR(3);\n", ""),
    ("            wgmma_issue<true>(mma_s, tSrQ, tSrK(_, _, _, s), acc_s);\n            warpgroup_fence_operand(tOrP);",
     "            if (i == i_first + 1) TR(4);\n", ""),
    ("        warpgroup_fence_operand(tOrP);\n        wgmma_issue<false>(mma_o, tOrP, tOrVt(_, _, _, s), acc_o);\n"
     "        if (K::kPingpong && wg == 0) turn_pass(wg);\n", "        TR(5);\n", ""),
    # O staged and fenced: a walk hands it to its store warp here; a grid's leader goes on to the stores
    ("      if (K::kPersistent) return;   // the store warp takes it from here (o_ready)\n", "      TR(7);\n", ""),
    # the CTA's entry (producer slot, event 3) and its SM (event 4)
    ("  if (tidx == 0) {\n    for (int b = 0; b < K::kQBufs; ++b) {",
     "  tr_rec(tr_cta(), 0, 3, 3, threadIdx.x == 0);\n  tr_put(tr_cta(), 0, 3, 4, threadIdx.x == 0, tr_smid());\n", ""),
    ("          const int t = j == 0 ? int(blockIdx.x) : int(gridDim.x) + atomicAdd(",
     "          tr_rec(blockIdx.x, j, 3, 0, true);\n", ""),
    ("          empty_q[qb].wait(((j / K::kQBufs) & 1) ^ 1);   // the first round finds every buffer free\n",
     "          tr_rec(blockIdx.x, j, 3, 1, true);\n", "          tr_rec(blockIdx.x, j, 3, 2, true);\n"),
    ("        release(empty_v[s]);\n      }\n    }\n", "        TR(6);\n", ""),
    ("        tma_store_wait<0>();   // read out before the CTA ends\n", "", "        TR(8);\n"),
    ("      full_q[qb].wait((j / K::kQBufs) & 1);\n", "      tr_j = j;\n      TR(0);\n", "      TR(1);\n"),
]

# Grid mode: the CTA's start in finer steps. Producer slot: 5 after the barriers' set-up, 6 Q's copies issued, 7 the
# first K's issued; consumer warpgroups: 0 registers allocated, 1 before Q's wait, 9 after it.
if GRID:
    EDITS = EDITS + [
        ("  __syncthreads();\n\n  if (warpgroup == 0) {\n", "", "    tr_rec(tr_cta(), 0, 3, 5, tidx == 0);\n"),
        ("        // One block per pass: unrolled (4x by default)", "        tr_rec(tr_cta(), 0, 3, 6, true);\n", ""),
        ("          empty_v[s].wait(phase ^ 1);\n          full_v[s].arrive_and_expect_tx",
         "          if (i == 0) tr_rec(tr_cta(), 0, 3, 7, true);\n", ""),
        ("  cutlass::arch::warpgroup_reg_alloc<K::kConsumerRegs>();\n", "",
         "  tr_rec(tr_cta(), 0, (tidx - 128) / 128, 0, tidx % 128 == 0);\n"),
        ("    if (!K::kPersistent && n_blocks > 0) full_q[0].wait(0);", "    TR(1);\n", "\n    TR(9);"),
    ]


def traced_header(src: str, edits=EDITS, what: str = "fwd_sm90.cuh") -> str:
    """The header with the trace stamps put in (asserts that every anchor is there once)."""
    for anchor, before, after in edits:
        assert src.count(anchor) == 1, f"trace anchor not found once in {what}: {anchor!r}"
        src = src.replace(anchor, before + anchor + after)
    return src


def trace_buffer(kernel):
    """(device pointer, bytes) of the traced cubin's flashgen::fg_trace."""
    from cuda.bindings import driver as drv
    err, dptr, size = drv.cuLibraryGetGlobal(kernel.library, b"_ZN8flashgen8fg_traceE")
    assert err == drv.CUresult.CUDA_SUCCESS, err
    return dptr, size


def traced_calls(kernel, call, path_stem, reps=2, warmup=5):
    """`call` run warm, then `reps` times with the trace buffer cleared before each; each buffer to
    <path_stem>_r<rep>.npy."""
    import numpy as np
    import torch
    from cuda.bindings import driver as drv
    dptr, size = trace_buffer(kernel)
    for _ in range(warmup):
        call()
    for rep in range(reps):
        drv.cuMemsetD8(dptr, 0, size)
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
        buf = np.zeros(size // 8, dtype=np.int64)
        drv.cuMemcpyDtoH(buf.ctypes.data, dptr, size)
        np.save(f"{path_stem}_r{rep}.npy", buf)


def run_shapes(args, npy_dir, family: str):
    """Each shape's traced kernel (forward, or backward after a forward): warm-up calls, then two traced calls, each
    buffer saved to npy_dir."""
    import torch
    from flashgen import interface
    torch.zeros(1, device="cuda")
    os.makedirs(npy_dir, exist_ok=True)
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                k = ab_sm90.kernel_of(args, "tr", hdim, causal, s)
                b, h = args.bh or (max(1, 16384 // s), 2048 // hdim)
                q, kk, v, dout = (torch.randn(b, s, h, hdim, device="cuda", dtype=ab_sm90.torch_dtype(args.dtype))
                                  for _ in range(4))
                scale = hdim ** -0.5
                if family == "fwd":
                    call = lambda: ab_sm90.run_with("fwd", k, q, kk, v, scale, causal)
                else:
                    out, lse = interface._flash_attn_forward(q, kk, v, scale, causal)
                    call = lambda: ab_sm90.run_with("bwd", k, dout, q, kk, v, out, lse, scale, causal)
                traced_calls(k, call, os.path.join(npy_dir, f"{k.name}_s{s}"))
                print(f"traced {k.name} seqlen {s}", flush=True)


def analyze(npy_dir):
    """Per shape: each phase's median over first tiles and over later tiles (cycles), the later tiles' mean, and the
    producer's tile claim (the counter's atomic) and buffer wait."""
    import numpy as np
    for fn in sorted(glob.glob(os.path.join(npy_dir, "*_r1.npy"))):
        a = np.load(fn).reshape(CTAS, TILES, 4, EVENTS).astype(float)
        a[a == 0] = np.nan
        wgs = int(fn.split("_m")[1].split("n")[0]) // 64
        c = a[:, :, :wgs]
        print(f"{os.path.basename(fn)[:-7]}: {np.sum(~np.isnan(c[:, :, 0, 8]))} tiles traced")
        print(f"  {'phase':10s} {'first':>7s} {'later':>7s} {'mean':>7s}")
        for name, x, y in PHASES:
            d = c[..., y] - c[..., x]
            print(f"  {name:10s} {np.nanmedian(d[:, 0]):7.0f} {np.nanmedian(d[:, 1:]):7.0f} {np.nanmean(d[:, 1:]):7.0f}")
        pr = a[:, 1:, 3]
        print(f"  producer: claim {np.nanmedian(pr[..., 1] - pr[..., 0]):.0f}, buffer wait "
              f"{np.nanmedian(pr[..., 2] - pr[..., 1]):.0f}")


def analyze_grid(npy_dir):
    """A grid kernel's CTAs (FLASHGEN_TRACE_GRID=1): per consumer warpgroup, the median of each phase from the CTA's
    entry, the body per key block, and per SM the gap from one CTA's end (its last O store read out) to the next
    CTA's entry (launch, the previous CTA's exit). Cycles of the SM's clock."""
    import numpy as np
    for fn in sorted(glob.glob(os.path.join(npy_dir, "*_r1.npy"))):
        a = np.load(fn).reshape(CTAS, TILES, 4, EVENTS)[:, 0].astype(float)
        seqlen = int(fn.rsplit("_s", 1)[1].split("_")[0])
        name = os.path.basename(fn)
        mn = name.split("_m")[1]
        bm, bn = int(mn.split("n")[0]), int(mn.split("n")[1].split("_")[0])
        wgs = bm // 64
        ok = a[:, 3, 3] > 0
        a = a[ok]
        a[a == 0] = np.nan
        entry, sm = a[:, 3, 3], a[:, 3, 4]
        end = np.nanmax(a[:, :wgs, 8], axis=1)
        print(f"{name[:-7]}: {len(a)} CTAs on {len(np.unique(sm))} SMs, {-(-seqlen // bn)} key blocks a tile")
        rows = [("setup+q", None, 10), ("k0", 10, 2), ("s0", 2, 3), ("soft0", 3, 4), ("body", 4, 5), ("drain", 5, 6),
                ("epi", 6, 7), ("storewait", 7, 8)]
        for w in range(wgs):
            cells = []
            for nm, x, y in rows:
                d = a[:, w, y] - (entry if x is None else a[:, w, x])
                cells.append(f"{nm} {np.nanmedian(d):.0f}")
            nb = -(-seqlen // bn) - 2
            cells.append(f"body/block {np.nanmedian(a[:, w, 5] - a[:, w, 4]) / max(nb, 1):.0f}")
            print(f"  wg{w}: " + ", ".join(cells))
        pr = a[:, 3]
        print(f"  producer: barriers set up {np.nanmedian(pr[:, 5] - entry):.0f}, Q issued {np.nanmedian(pr[:, 6] - entry):.0f}, "
              f"K0 issued {np.nanmedian(pr[:, 7] - entry):.0f}")
        for w in range(wgs):
            print(f"  wg{w} from entry: registers {np.nanmedian(a[:, w, 0] - entry):.0f}, before Q wait "
                  f"{np.nanmedian(a[:, w, 1] - entry):.0f}, Q in {np.nanmedian(a[:, w, 9] - entry):.0f} "
                  f"(p10 {np.nanpercentile(a[:, w, 9] - entry, 10):.0f}, p90 {np.nanpercentile(a[:, w, 9] - entry, 90):.0f}), "
                  f"K0 in {np.nanmedian(a[:, w, 2] - entry):.0f}")
        cta = end - entry
        gaps = []
        for s_ in np.unique(sm):
            i = np.where(sm == s_)[0]
            i = i[np.argsort(entry[i])]
            gaps += list(entry[i[1:]] - end[i[:-1]])
        gaps = np.array(gaps)
        print(f"  CTA entry to end: median {np.nanmedian(cta):.0f}; gap end -> next entry on the SM: median "
              f"{np.nanmedian(gaps):.0f}, p10 {np.nanpercentile(gaps, 10):.0f}, p90 {np.nanpercentile(gaps, 90):.0f}")


def trace_main(argv, doc: str, family: str, edits, analyze_fn, defaults=()) -> int:
    """A tracer's command line: `compile` writes the traced header (the family's, or --header's) next to the cubins
    (--out) and compiles it as ab_sm90.py's variant "tr"; `run` traces on the GPU into --npy; `analyze` reads it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("compile", "run", "analyze"):
        print(doc)
        return 2
    npy = os.environ.get("OUT", os.path.join(ROOT, ".gpucache", f"trace_{family}_npy"))
    if "--npy" in argv:
        i = argv.index("--npy")
        npy = argv[i + 1]
        del argv[i:i + 2]
    if argv[0] == "analyze":
        analyze_fn(npy)
        return 0
    mode = "compile" if argv[0] == "compile" else "bench"   # ab_sm90's modes; run only borrows its arguments
    out = os.path.join(ROOT, ".gpucache", f"trace_{family}")   # argparse keeps the last --out: argv's, if given
    args = ab_sm90.parse_args([mode, "--family", family, "--variant", "tr=", *defaults, "--out", out] + argv[1:])
    hdr = os.path.join(args.out, f"{family}_trace.cuh")
    args.defines["tr"]["@header"] = hdr
    if argv[0] == "compile":
        os.makedirs(args.out, exist_ok=True)
        with open(hdr, "w") as f:
            f.write(traced_header(open(args.header).read(), edits, os.path.basename(ab_sm90.INCLUDE[family])))
        args.defines = {"tr": args.defines["tr"]}
        ab_sm90.compile_all(args)
    else:
        run_shapes(args, npy, family)
    return 0


def main(argv=None) -> int:
    return trace_main(argv, __doc__, "fwd", EDITS, analyze_grid if GRID else analyze)


if __name__ == "__main__":
    sys.exit(main())
