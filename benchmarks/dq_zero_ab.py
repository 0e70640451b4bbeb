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


def backward(dout, q, k, v, out, lse, scale, causal, zero_ahead: bool):
    """One fused Hopper backward with the zero-ahead on or off; (dq, dk, dv)."""
    heuristics.BWD_SM90_DQ_ZERO = zero_ahead
    try:
        with dispatch.hopper_backward(True):
            return interface._flash_attn_backward(dout, q, k, v, out, lse, scale, causal, backward_impl="fused")
    finally:
        heuristics.BWD_SM90_DQ_ZERO = True


def run(hdim: int, seqlen: int, causal: bool) -> dict:
    b, h = max(1, 16384 // seqlen), 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    scale = hdim ** -0.5
    out, lse = interface._flash_attn_forward(q, k, v, scale, causal)
    fill = backward(dout, q, k, v, out, lse, scale, causal, False)
    ahead = backward(dout, q, k, v, out, lse, scale, causal, True)
    diff = max((a.float() - f.float()).abs().max().item() / max(f.float().abs().max().item(), 1e-6)
               for a, f in zip(ahead[:3], fill[:3]))
    fns = {"fill": lambda: backward(dout, q, k, v, out, lse, scale, causal, False),
           "ahead": lambda: backward(dout, q, k, v, out, lse, scale, causal, True)}
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
            need.append(heuristics.bwd_sm90_traits(arch, "bf16", hdim, causal))
            need += [dispatch.fwd_traits(arch, torch.cuda.get_device_name(), "bf16", hdim, causal, seqlen_q=sq,
                                         seqlen_k=sk, hopper=True) for sq, sk in seqlen_pairs]
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
    ap.add_argument("--precompile", type=int, nargs="*", default=None,
                    help="only compile (in parallel) the kernels of these runs plus seqlen pairs sq sk ... (tests)")
    args = ap.parse_args()
    ba.ROUNDS = args.rounds
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    if args.precompile is not None:
        extra = list(zip(args.precompile[::2], args.precompile[1::2]))
        precompile(args.hdim, causals, [(s, s) for s in args.seqlen] + extra)
        return
    print(f"# dQ zero-ahead A/B, {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds")
    print("| hdim | causal | seqlen | fill | ahead | CUDNN | fill / CUDNN | ahead / CUDNN | ahead / fill | rel. diff |")
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in causals:
            for seqlen in args.seqlen:
                r = run(hdim, seqlen, causal)
                t = r["tf"]
                c = t.get("sdpa_cudnn", float("nan"))
                print(f"| {hdim} | {'yes' if causal else 'no'} | {seqlen} | {t['fill']:.0f} | {t['ahead']:.0f} | "
                      f"{c:.0f} | {t['fill'] / c:.3f} | {t['ahead'] / c:.3f} | {t['ahead'] / t['fill']:.3f} | "
                      f"{r['diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
