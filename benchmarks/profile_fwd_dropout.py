"""One forward with and one without dropout for Nsight Compute (ncu -k regex:fwd_sm80 python
benchmarks/profile_fwd_dropout.py): bf16, seqlen 8k, HDIM (default 128), 16k tokens."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from flashgen import interface

hdim = int(os.environ.get("HDIM", 128))
b, s, h = 2, 8192, 2048 // hdim
q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
rng = interface._draw_rng_state(q.device)
interface._flash_attn_forward(q, k, v, hdim ** -0.5, False)
interface._flash_attn_forward(q, k, v, hdim ** -0.5, False, 0.1, rng)
torch.cuda.synchronize()
