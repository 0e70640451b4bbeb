"""Where the Hopper backward's time goes: variants of bwd_sm90 that each leave one stage out (wrong results, timing
only), timed next to the kernel as it is by benchmarks/ab_sm90.py. Each variant is a patched copy of
templates/include/flashgen/bwd_sm90.cuh, written under --out and taken by ab_sm90.py as the variant's @header.

    python benchmarks/ablate_bwd_sm90.py compile [--hdim 64 128] [--out DIR]      (no GPU needed)
    python benchmarks/ablate_bwd_sm90.py bench [--hdim 64 128] [--seqlen 2048 8192] [--out DIR]

bf16, non-causal, 16k tokens, model dim 2048; bench prints each variant's ratio to SDPA CUDNN's backward.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab_sm90  # noqa: E402

# variant -> [(text in bwd_sm90.cuh, replacement)], every occurrence replaced; a missing text is an error, so the
# variants follow the kernel. "no_barrier" drops the warpgroups' meeting over dS (hdim 128; hdim 64 hands dQ over).
VARIANTS = {
    "no_dq_reduce": [("        bulk_reduce_add_f32(share, ", "        if (false) bulk_reduce_add_f32(share, ")],
    "no_dq": [("    if (K::kDqSplit || wg == i % K::kConsumerWGs) {", "    if (false) {")],
    "no_barrier": [("      if (wg_leader) bulk_wait_read();\n      consumer_sync<K::kConsumerThreads>();\n",
                    "      if (wg_leader) bulk_wait_read();\n")],
    "fma_for_exp2": [("exp2f(fmaf(st(r, j), scale_log2, -lse_l2[j]))", "fmaf(st(r, j), scale_log2, -lse_l2[j])")],
}


def patched_headers(out: str) -> list[str]:
    """Writes each variant's header under `out`; returns ab_sm90.py's --variant values for them."""
    os.makedirs(out, exist_ok=True)
    header = open(os.path.join(ab_sm90.ROOT, "templates", "include", ab_sm90.INCLUDE["bwd"])).read()
    variants = []
    for name, edits in VARIANTS.items():
        text = header
        for old, new in edits:
            assert old in text, f"{name}: the kernel no longer contains {old!r}"
            text = text.replace(old, new)
        path = os.path.join(out, f"{name}.cuh")
        with open(path, "w") as f:
            f.write(text)
        variants.append(f"{name}=@header={path}")
    return variants


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["compile", "bench"])
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=os.path.join(ab_sm90.ROOT, ".gpucache", "ablate"))
    args = ap.parse_args(argv)
    variants = [a for v in patched_headers(args.out) for a in ("--variant", v)]
    return ab_sm90.main([args.mode, "--family", "bwd", "--causal", "0", "--hdim", *map(str, args.hdim),
                         "--seqlen", *map(str, args.seqlen), "--rounds", str(args.rounds), "--jobs", str(args.jobs),
                         "--out", args.out, *variants])


if __name__ == "__main__":
    sys.exit(main())
