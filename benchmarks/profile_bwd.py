"""One backward call of each kind for Nsight Compute (ncu -k regex:... python benchmarks/profile_bwd.py):
flashgen fused and split, plus torch SDPA FLASH's backward on the same shape (HDIM, default 128; SEQLEN, default 8k,
16k tokens; CAUSAL=1). CUDNN=1 takes SDPA CUDNN's backward instead of FLASH's; IMPL=fused skips the split one."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashgen import interface

hdim = int(os.environ.get("HDIM", 128))
causal = bool(int(os.environ.get("CAUSAL", 0)))
s = int(os.environ.get("SEQLEN", 8192))
b, h = max(1, 16384 // s), 2048 // hdim
q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
dout = torch.randn_like(q)
out, lse = interface._flash_attn_forward(q, k, v, hdim ** -0.5, causal)
for impl in ("fused",) if os.environ.get("IMPL") == "fused" else ("fused", "split"):
    interface._flash_attn_backward(dout, q, k, v, out, lse, hdim ** -0.5, causal, backward_impl=impl)
qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if os.environ.get("CUDNN", "0") == "1" else SDPBackend.FLASH_ATTENTION):
    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    o.backward(dout.transpose(1, 2))
torch.cuda.synchronize()
