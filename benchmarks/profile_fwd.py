"""Forward calls for Nsight Compute, bf16, seqlen SEQLEN (default 8k), 16k tokens, head dim HDIM (default 128),
CAUSAL=1 for causal. DROPOUT=1 adds a call with p = 0.1 after the dropout-free one. CUDNN=1 adds one SDPA CUDNN
forward on the same inputs (ncu -k regex:"fprop|fwd_sm"). FLASHGEN_HOPPER picks the path.

    ncu --clock-control none -k regex:fwd_sm --section SpeedOfLight --section WarpStateStats \
        python benchmarks/profile_fwd.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from flashgen import interface

hdim = int(os.environ.get("HDIM", 128))
s = int(os.environ.get("SEQLEN", 8192))
causal = os.environ.get("CAUSAL", "0") == "1"
b, h = max(1, 16384 // s), 2048 // hdim
q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
interface._flash_attn_forward(q, k, v, hdim ** -0.5, causal)
if os.environ.get("DROPOUT", "0") == "1":
    interface._flash_attn_forward(q, k, v, hdim ** -0.5, causal, 0.1, interface._draw_rng_state(q.device))
if os.environ.get("CUDNN", "0") == "1":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
torch.cuda.synchronize()
