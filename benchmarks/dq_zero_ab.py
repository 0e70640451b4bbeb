"""A/B of the Hopper backward's dQ accumulator zeroed ahead inside the launch (heuristics.BWD_SM90_DQ_ZERO, True)
against the fill before it (False): the same cubin, only the host side differs. bf16, 16k tokens, model dim 2048, the
issue's twelve shapes by default; SDPA CUDNN in the same process; median of --rounds rounds in random order
(bench_attention.time_all). Each shape first checks that both paths give the same gradients (up to the order of the
fp32 dQ adds).

    python benchmarks/dq_zero_ab.py [--hdim 64 128 256] [--seqlen 2048 8192] [--rounds 5]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402
from codegen import heuristics  # noqa: E402
from flashgen import dispatch, interface  # noqa: E402


REAL_ZERO = heuristics.bwd_sm90_dq_zero
REAL_FILL = interface._dq_accum_zeros

# Host-side variants, all on the same cubin: the fill, the zero-ahead, the zero-ahead with its check and zeroing
# idle (the host fills every slab: what the mechanism costs by itself), with a lead one wave longer, and no zeroing at
# all (a bound only: dQ is wrong).
VARIANTS = {
    "fill": dict(zero=False),
    "ahead": dict(zero=True),
    "idle": dict(zero=True, decide=lambda slabs, *a: (REAL_ZERO(slabs, *a)[0], slabs)),
    "lead2": dict(zero=True, decide=lambda slabs, blocks, group, resident, extra=0:
                  REAL_ZERO(slabs, blocks, group, 2 * resident, extra)),
    "none": dict(zero=False, fill=lambda numel, device: torch.empty(numel, dtype=torch.float32, device=device)),
    # every CTA checks its slab (all chunks already zero and marked so): what the check costs
    "check": dict(zero=True, decide=lambda *a: (REAL_ZERO(*a)[0], 0), init=lambda flat, numel, pre, states: (
        flat[:states].zero_(), flat[states:].view(torch.int32).fill_(2))),
}
REAL_INIT = interface._dq_zero_init


def backward(dout, q, k, v, out, lse, scale, causal, variant: str):
    """One fused Hopper backward under a host-side variant; (dq, dk, dv)."""
    var = VARIANTS[variant]
    heuristics.BWD_SM90_DQ_ZERO = var["zero"]
    heuristics.bwd_sm90_dq_zero = var.get("decide", REAL_ZERO)
    interface._dq_accum_zeros = var.get("fill", REAL_FILL)
    interface._dq_zero_init = var.get("init", REAL_INIT)
    try:
        with dispatch.hopper_backward(True):
            return interface._flash_attn_backward(dout, q, k, v, out, lse, scale, causal, backward_impl="fused")
    finally:
        heuristics.BWD_SM90_DQ_ZERO = True
        heuristics.bwd_sm90_dq_zero = REAL_ZERO
        interface._dq_accum_zeros = REAL_FILL
        interface._dq_zero_init = REAL_INIT


def run(hdim: int, seqlen: int, causal: bool, variants) -> dict:
    b, h = max(1, 16384 // seqlen), 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    scale = hdim ** -0.5
    out, lse = interface._flash_attn_forward(q, k, v, scale, causal)
    fill = backward(dout, q, k, v, out, lse, scale, causal, "fill")
    diff = {}
    for var in variants:
        if var in ("fill", "none", "check"):
            continue
        got = backward(dout, q, k, v, out, lse, scale, causal, var)
        diff[var] = max((a.float() - f.float()).abs().max().item() / max(f.float().abs().max().item(), 1e-6)
                        for a, f in zip(got[:3], fill[:3]))
    fns = {var: (lambda var=var: backward(dout, q, k, v, out, lse, scale, causal, var)) for var in variants}
    res = ba.time_all(ba.sdpa_fns(fns, lambda backend: ba.sdpa_bwd_fn(q, k, v, dout, causal, backend), ("sdpa_cudnn",)))
    flops = 2.5 * ba.fwd_flops(b, h, seqlen, seqlen, hdim, causal)
    tf = {n: flops / (ms * 1e-3) / 1e12 for n, ms in res.items()}
    return {"tf": tf, "diff": diff}


def precompile(hdims, causals, seqlen_pairs):
    """Every kernel the runs need (Hopper forward as dispatched, bwd_pre, the Hopper backward), compiled in parallel."""
    from concurrent.futures import ProcessPoolExecutor
    from flashgen.cli import _compile_one, default_jobs
    arch = dispatch.device_arch(torch.cuda.current_device())
    need = []
    for hdim in hdims:
        for causal in causals:
            need.append(heuristics.bwd_traits(arch, "bf16", hdim, causal, "pre"))
            for drop in (False, True):   # the dropout kernels for the tests
                need.append(heuristics.bwd_sm90_traits(arch, "bf16", hdim, causal, dropout=drop))
                need += [dispatch.fwd_traits(arch, torch.cuda.get_device_name(), "bf16", hdim, causal, dropout=drop,
                                             seqlen_q=sq, seqlen_k=sk, hopper=True) for sq, sk in seqlen_pairs]
    need = {t.name: t for t in need if t is not None}
    with ProcessPoolExecutor(max_workers=default_jobs()) as pool:
        for name, hit, secs, err, res in pool.map(_compile_one, [t.to_dict() for t in need.values()]):
            if err:
                print(f"# {name}: compile failed: {err.splitlines()[0]}")
            elif not hit:
                print(f"# compiled {name} in {secs:.0f} s, spills {res.get('spill_stores')} B", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--precompile", type=int, nargs="*", default=None,
                    help="only compile (in parallel) the kernels of these runs plus seqlen pairs sq sk ... (tests)")
    args = ap.parse_args()
    ba.ROUNDS = args.rounds
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    if args.precompile is not None:
        extra = list(zip(args.precompile[::2], args.precompile[1::2]))
        precompile(args.hdim, causals, [(s, s) for s in args.seqlen] + extra)
        return
    variants = args.variants
    print(f"# dQ zero-ahead A/B, {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds; "
          f"TFLOP/s and ratio to SDPA CUDNN; max relative difference of dQ / dK / dV to the fill's")
    print("| hdim | causal | seqlen | CUDNN | " + " | ".join(variants) + " | " +
          " | ".join(f"{v} / CUDNN" for v in variants) + " | diff |")
    print("|---:|:---:|---:|---:|" + "---:|" * (2 * len(variants)) + "---|")
    for hdim in args.hdim:
        for causal in causals:
            for seqlen in args.seqlen:
                r = run(hdim, seqlen, causal, variants)
                t = r["tf"]
                c = t.get("sdpa_cudnn", float("nan"))
                diff = " ".join(f"{k} {d:.1e}" for k, d in r["diff"].items())
                print(f"| {hdim} | {'yes' if causal else 'no'} | {seqlen} | {c:.0f} | " +
                      " | ".join(f"{t[v]:.0f}" for v in variants) + " | " +
                      " | ".join(f"{t[v] / c:.3f}" for v in variants) + f" | {diff} |", flush=True)


if __name__ == "__main__":
    main()
