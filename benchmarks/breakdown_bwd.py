"""Where one backward call's GPU time goes: the kernel times of flashgen's backward (what dispatch runs: on sm_90a the
Hopper kernel, its dQ conversion, bwd_pre and the accumulator's zero fill) next to SDPA CUDNN's, summed per kernel
name by torch.profiler over --calls calls. Kernel time only: launch gaps and host time are not in it (bench_attention.py
times whole calls).

    python benchmarks/breakdown_bwd.py [--hdim 64 128] [--causal 0 1] [--seqlen 2048 8192] [--split]

--split adds the split (deterministic) schedule's kernels as a third line.

Shapes as bench_attention.py: 16k tokens, model dim 2048, bf16.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_attention import fwd_inputs
from flashgen import interface


def kernel_times(fn, calls: int) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel fn launches (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:70]] += e.time_range.elapsed_us() / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--split", action="store_true", help="also the split (deterministic) schedule")
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}, bf16, kernel time per backward call (us), {args.calls} calls")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                q, k, v, _ = fwd_inputs(hdim, s, causal)
                dout = torch.randn_like(q)
                scale = hdim ** -0.5
                out, lse = interface._flash_attn_forward(q, k, v, scale, causal)
                qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                impls = {"flashgen": lambda: interface._flash_attn_backward(dout, q, k, v, out, lse, scale, causal),
                         "cudnn": lambda: torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2),
                                                              retain_graph=True)}
                if args.split:
                    impls["flashgen split"] = lambda: interface._flash_attn_backward(
                        dout, q, k, v, out, lse, scale, causal, backward_impl="split")
                for name, fn in impls.items():
                    times = kernel_times(fn, args.calls)
                    total = sum(times.values())
                    print(f"hdim {hdim} causal {int(causal)} seqlen {s} {name}: {total:.0f} us = " +
                          " + ".join(f"{t:.0f} {kname}" for kname, t in times.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
