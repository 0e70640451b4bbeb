"""Where the Hopper backward's time goes: time variants of bwd_sm90 that each leave one stage out (wrong results,
timing only), next to the kernel as it is, in one process. Each variant is a patched copy of
templates/include/flashgen/bwd_sm90.cuh inlined into the rendered source and swapped in for dispatch's kernel.

    python benchmarks/ablate_bwd_sm90.py [--hdim 64 128] [--seqlen 2048 8192]

bf16, non-causal, 16k tokens, model dim 2048, TFLOP/s as bench_attention.py's backward (2.5x forward FLOPs).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from codegen import heuristics
from codegen.render import render

HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates", "include", "flashgen",
                      "bwd_sm90.cuh")
# variant -> [(text in bwd_sm90.cuh, replacement)]; a missing text is an error, so the variants follow the kernel.
VARIANTS = {
    "as is": [],
    "no dQ reduce": [("      if (wg_leader) {\n        bulk_reduce_add_f32(", "      if (false) {\n        bulk_reduce_add_f32(")],
    "no dQ": [("    if (K::kDqSplit || wg == i % K::kConsumerWGs) {", "    if (false) {")],
    "no barrier": [("    if (wg_leader) bulk_wait_read();\n    consumer_sync<K::kConsumerThreads>();\n",
                    "    if (wg_leader) bulk_wait_read();\n")],
    "FMA for exp2": [("float pv = exp2f(fmaf(st(r, j), scale_log2, -lse_l2[j]));",
                      "float pv = fmaf(st(r, j), scale_log2, -lse_l2[j]);")],
}


def build(args):
    variant, hdim = args
    from flashgen import compiler
    t = heuristics.bwd_sm90_traits("sm_90a", "bf16", hdim, False)
    header = open(HEADER).read()
    for old, new in VARIANTS[variant]:
        assert old in header, f"{variant}: the kernel no longer contains {old!r}"
        header = header.replace(old, new)
    src = render(t).replace('#include "flashgen/bwd_sm90.cuh"', header.replace("#pragma once", ""))
    res = compiler.compile_source(src, t.name, t.arch, f"<{variant}>")
    return variant, hdim, res.cubin, re.findall(r"(\d+) bytes spill stores", res.log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 8192])
    args = ap.parse_args()
    from triton.testing import do_bench
    from flashgen import dispatch, interface
    from flashgen.loader import Kernel
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        built = list(pool.map(build, [(v, h) for h in args.hdim for v in VARIANTS]))
    torch.zeros(1, device="cuda")   # a context before cuLibraryLoadData
    print("| hdim | seqlen | variant | TFLOP/s | spill stores (B) |\n|---:|---:|---|---:|---|")
    for seqlen in args.seqlen:
        for variant, hdim, cubin, spills in built:
            kernel = Kernel(heuristics.bwd_sm90_traits("sm_90a", "bf16", hdim, False), cubin, {})
            b, h = max(1, 16384 // seqlen), 2048 // hdim
            q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            dout = torch.randn_like(q)
            out, lse = interface._flash_attn_forward(q, k, v, hdim ** -0.5, False)
            real = dispatch._bwd_sm90_kernel
            dispatch._bwd_sm90_kernel = lambda *a: kernel
            try:
                ms = do_bench(lambda: interface._flash_attn_backward(dout, q, k, v, out, lse, hdim ** -0.5, False,
                                                                     backward_impl="fused"),
                              warmup=30, rep=200, return_mode="median")
            finally:
                dispatch._bwd_sm90_kernel = real
            tf = 2.5 * 4 * b * h * seqlen * seqlen * hdim / (ms * 1e-3) / 1e12
            print(f"| {hdim} | {seqlen} | {variant} | {tf:.0f} | {'/'.join(spills)} |", flush=True)


if __name__ == "__main__":
    main()
