"""The flash-attn 2x rule for the backward's dQ under cheaper reduce forms, on the CPU (no kernel involved).

dQ sums one fp32 partial per key block (bwd_sm90.cuh: a bulk reduce-add per block into an fp32 accumulator). This
emulates, for one head of bf16 inputs, dQ with every partial added into a bf16 accumulator (bf16 reduces) and with
paired key blocks, one of which hands its partial over in bf16 to be added in fp32 (16-bit pair shares), and prints
each one's max error against the fp32 reference next to PyTorch's bf16 autograd error (the rule allows 2x that).

    python benchmarks/dq_share_precision.py [--seqlen 2048 8192] [--seeds 0 1 2]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.attn_ref import attention_ref   # noqa: E402  (the tests' plain PyTorch attention)


def errors(seqlen: int, head_dim: int = 128, block_n: int = 128) -> dict:
    q, k, v, do = (torch.randn(seqlen, head_dim).bfloat16() for _ in range(4))
    scale = 1 / math.sqrt(head_dim)

    def dq_autograd(q, k, v, do):   # one sequence, one head: (seqlen, head_dim) as attention_ref's (1, s, 1, d)
        q = q.clone()[None, :, None].requires_grad_()
        out, _ = attention_ref(q, k[None, :, None], v[None, :, None], upcast=False)
        out.backward(do[None, :, None])
        return q.grad[0, :, 0], out.detach()[0, :, 0]

    ref, out = dq_autograd(*(x.float() for x in (q, k, v, do)))
    torch_bf16, _ = dq_autograd(q, k, v, do)
    # The kernel's dS (bf16, from D = rowsum(dO * O) with O in bf16), then one fp32 partial per key block.
    qf, kf, vf, dof = (x.float() for x in (q, k, v, do))
    p = torch.softmax((qf @ kf.T) * scale, -1)
    d = (dof * out.bfloat16().float()).sum(-1, keepdim=True)
    ds = (p * (dof @ vf.T - d)).bfloat16().float()
    parts = [(ds[:, n:n + block_n] @ kf[n:n + block_n]) * scale for n in range(0, seqlen, block_n)]
    acc = torch.zeros_like(parts[0]).bfloat16()
    for part in parts:
        acc = (acc.float() + part).bfloat16()
    pairs = sum(parts[i] + (parts[i + 1].bfloat16().float() if i + 1 < len(parts) else 0)
                for i in range(0, len(parts), 2))
    ref16 = ref.bfloat16().float()
    err = lambda x: (x.bfloat16().float() - ref16).abs().max().item()
    return {"torch bf16": err(torch_bf16.float()), "fp32 reduces": err(sum(parts)), "bf16 reduces": err(acc.float()),
            "16-bit pair shares": err(pairs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    args = ap.parse_args()
    for seqlen in args.seqlen:
        for seed in args.seeds:
            torch.manual_seed(seed)
            e = errors(seqlen)
            base = e.pop("torch bf16")
            print(f"seqlen {seqlen} seed {seed}: torch bf16 {base:.3g}; " +
                  "; ".join(f"{k} {x:.3g} ({x / base:.2f}x)" for k, x in e.items()), flush=True)


if __name__ == "__main__":
    main()
