"""One backward call of each kind for Nsight Compute (ncu -k regex:... python benchmarks/profile_bwd.py):
flashgen fused and split at hdim 128, seqlen 8k, plus torch SDPA FLASH's backward on the same shape."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashgen import interface

hdim = int(os.environ.get("HDIM", 128))
causal = bool(int(os.environ.get("CAUSAL", 0)))
b, s, h = 2, 8192, 2048 // hdim
q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
dout = torch.randn_like(q)
out, lse = interface._flash_attn_forward(q, k, v, hdim ** -0.5, causal)
for impl in ("fused", "split"):
    interface._flash_attn_backward(dout, q, k, v, out, lse, hdim ** -0.5, causal, backward_impl=impl)
qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    o.backward(dout.transpose(1, 2))
torch.cuda.synchronize()
