"""Host cost of one call: microseconds of Python and driver work per flashgen call on a problem small enough that the
GPU keeps up, next to torch SDPA (cuDNN backend) on the same problem. A launch that costs more host time than its
kernel's GPU time leaves the GPU idle; triton's do_bench (bench_attention.py) flushes L2 before every repetition,
so the host time beyond that flush shows up in its TFLOP/s at seqlen 2k.

    python benchmarks/bench_host.py [--seqlen 1024] [--hdim 128] [--calls 1000] [--profile]
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashgen  # noqa: E402


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(host us per call: until the calls return, total us per call: until the GPU is done)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--profile", action="store_true", help="cProfile 500 forward calls, top 25 by own time")
    args = ap.parse_args()
    q, k, v = (torch.randn(1, args.seqlen, 2, args.hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    print(f"# host cost per call, {torch.cuda.get_device_name()}, batch 1, 2 heads, seqlen {args.seqlen}, "
          f"hdim {args.hdim}, causal, bf16")
    print("| call | host us | total us |\n|---|---:|---:|")
    rows = [("flashgen.flash_attn_func", lambda: flashgen.flash_attn_func(q, k, v, causal=True))]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        rows.append(("SDPA cuDNN forward", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)))
        for name, fn in rows:
            print("| %s | %.1f | %.1f |" % (name, *per_call_us(fn, args.calls)))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    fwd_bwd = lambda: torch.autograd.grad(flashgen.flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), dout)  # noqa: E731
    print("| flashgen forward + backward | %.1f | %.1f |" % per_call_us(fwd_bwd, max(1, args.calls // 4)))
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(500):
            flashgen.flash_attn_func(q, k, v, causal=True)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())


if __name__ == "__main__":
    main()
