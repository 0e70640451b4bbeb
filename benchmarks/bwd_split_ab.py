"""The Hopper split (deterministic) backward's dQ kernel in variants, side by side with the Hopper fused backward and
SDPA CUDNN in one process (bench_attention's timing: median over --rounds rounds, random order each round).

    python benchmarks/bwd_split_ab.py [--hdim 64 128 256] [--seqlen 2048 8192] [--causal 0 1] [--rounds 5]
                                      [--variant NAME=overlap:0|1[,stages:N][,block_m:N][,block_n:N]
                                                      [,dkdv_stages:N][,dkdv_ls:0|1] ...]
                                      [--dropout P]

A variant sets heuristics.BWD_DQ_SM90_OVERLAP (the table's where it names no overlap) and the bucket's
heuristics.BWD_DQ_SM90_TILES entry for its calls, and dkdv_* the dK / dV kernel's Q/dO stages and lse_smem; the default
variants are the two overlap settings. Variants on the same tiles must give the first's gradients bit for bit, others
(another order of dQ's sums) within 1% of its largest entry. Prints TFLOP/s (2.5x forward FLOPs, the benchmark's
rule) and each variant's ratio to SDPA CUDNN, to the fused Hopper backward and to the SM80 kernels' split schedule
(`sm80 split`, FLASHGEN_HOPPER_BWD=0). --dropout P: every flashgen column with dropout p (SDPA CUDNN without).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention as ba  # noqa: E402
from codegen import heuristics  # noqa: E402
from flashgen import dispatch, interface  # noqa: E402


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, spec = text.partition("=")
    knobs = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition(":")
        if key not in ("overlap", "stages", "block_m", "block_n", "dkdv_stages", "dkdv_ls"):
            raise SystemExit(f"unknown knob {key!r} in {text!r}")
        knobs[key] = int(value)
    return name, knobs


@contextlib.contextmanager
def dq_variant(bucket: int, knobs: dict):
    """The dispatcher's dQ kernel for `bucket` per the knobs while inside (tile knobs apply with dropout too)."""
    old_ov = heuristics.BWD_DQ_SM90_OVERLAP
    tables = (heuristics.BWD_DQ_SM90_TILES, heuristics.BWD_DQ_SM90_DROPOUT_TILES)
    old_tables = [dict(t) for t in tables]
    m, n, stages = tables[0][bucket]
    heuristics.BWD_DQ_SM90_OVERLAP = bool(knobs["overlap"]) if "overlap" in knobs else old_ov
    if {"block_m", "block_n", "stages"} & set(knobs):
        for t in tables:
            t[bucket] = (knobs.get("block_m", m), knobs.get("block_n", n), knobs.get("stages", stages))
    dkdv_knobs = {f: cast(knobs[k]) for k, f, cast in (("dkdv_stages", "stages", int), ("dkdv_ls", "lse_smem", bool))
                  if k in knobs}
    split_traits = heuristics.bwd_sm90_split_traits
    if dkdv_knobs:
        def with_dkdv(*args, **kwargs):
            dkdv, dq = split_traits(*args, **kwargs)
            return dataclasses.replace(dkdv, **dkdv_knobs).validate(), dq
        heuristics.bwd_sm90_split_traits = with_dkdv
    dispatch._bwd_sm90_split_kernels.cache_clear()
    try:
        yield
    finally:
        heuristics.bwd_sm90_split_traits = split_traits
        heuristics.BWD_DQ_SM90_OVERLAP = old_ov
        for t, old in zip(tables, old_tables):
            t.clear()
            t.update(old)
        dispatch._bwd_sm90_split_kernels.cache_clear()


def run_shape(hdim: int, seqlen: int, causal: bool, variants: dict, dropout: float = 0.0) -> dict:
    b, h = max(1, 16384 // seqlen), 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    scale = hdim ** -0.5
    rng = interface._draw_rng_state(q.device) if dropout else None
    out, lse = interface._flash_attn_forward(q, k, v, scale, causal, dropout, rng)
    bucket = heuristics.sm90_bucket(hdim)

    def backward(impl):
        return lambda: interface._flash_attn_backward(dout, q, k, v, out, lse, scale, causal, backward_impl=impl,
                                                      dropout_p=dropout, rng_state=rng)
    fns = {"fused": ba.in_context(lambda: dispatch.hopper_backward(True), backward("fused")),
           "sm80 split": ba.in_context(lambda: dispatch.hopper_backward(False), backward("split"))}
    for name, knobs in variants.items():
        fns[name] = ba.in_context(lambda knobs=knobs: _both(dispatch.hopper_backward(True), dq_variant(bucket, knobs)),
                                  backward("split"))
    ref = None
    for name in variants:   # every variant's gradients the same bits as the first's: only the schedule differs
        grads = fns[name]()
        ref = ref or grads
        if variants[name].get("block_n") or variants[name].get("block_m"):   # another order of the dQ sums
            assert all((a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()
                       for a, b in zip(ref, grads)), name
        else:
            assert all(torch.equal(a, b) for a, b in zip(ref, grads)), name
    ba.sdpa_fns(fns, lambda backend: ba.sdpa_bwd_fn(q, k, v, dout, causal, backend), ("sdpa_cudnn",))
    flops = 2.5 * ba.fwd_flops(b, h, seqlen, seqlen, hdim, causal)
    return {n: flops / (ms * 1e-3) / 1e12 for n, ms in ba.time_all(fns).items()}


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", nargs="*", default=[])
    ap.add_argument("--dropout", type=float, default=0.0)
    args = ap.parse_args()
    ba.ROUNDS = args.rounds
    variants = dict(parse_variant(v) for v in args.variant) or {"serial": {"overlap": 0}, "overlap": {"overlap": 1}}
    gpu = torch.cuda.get_device_name()
    print(f"# Hopper split backward, dQ kernel variants, {gpu}, bf16, 16k tokens, model dim 2048; TFLOP/s, "
          f"median of {args.rounds}; ratio to SDPA CUDNN / to the Hopper fused backward"
          + (f"; flashgen with dropout_p={args.dropout}, SDPA CUDNN without" if args.dropout else ""))
    names = list(variants)
    print("| hdim | causal | seqlen | fused | sm80 split | CUDNN | " + " | ".join(names) + " | " +
          " | ".join(f"{n} / CUDNN | {n} / fused | {n} / sm80 split" for n in names) + " |")
    print("|---:|:---:|---:|" + "---:|" * (3 + 4 * len(names)))
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                r = run_shape(hdim, s, causal, variants, args.dropout)
                cudnn, sm80 = r.get("sdpa_cudnn", float("nan")), r["sm80 split"]
                print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {r['fused']:.0f} | {sm80:.0f} | {cudnn:.0f} | " +
                      " | ".join(f"{r[n]:.0f}" for n in names) + " | " +
                      " | ".join(f"{r[n] / cudnn:.3f} | {r[n] / r['fused']:.3f} | {r[n] / sm80:.3f}" for n in names)
                      + " |", flush=True)


if __name__ == "__main__":
    main()
