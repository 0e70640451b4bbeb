"""The dropout mask written out in NumPy from its definition (templates/include/flashgen/dropout.cuh), and the
attention reference with a given keep-mask."""
import math

import numpy as np
import torch

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    """Philox-4x32-10 on uint32 arrays: ctr (4, ...) and key (2, ...) broadcast; returns (4, ...) uint32."""
    c = [np.asarray(x, dtype=np.uint64) for x in ctr]
    k0, k1 = (np.asarray(x, dtype=np.uint64) for x in key)
    for _ in range(10):
        p0, p1 = np.uint64(_M0) * c[0], np.uint64(_M1) * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(_MASK32)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(_MASK32)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + np.uint64(_W0)) & np.uint64(_MASK32), (k1 + np.uint64(_W1)) & np.uint64(_MASK32)
    return np.stack([x.astype(np.uint32) for x in c])


def keep_mask(seed: int, offset: int, p: float, bh: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """(seqlen_q, seqlen_k) bool keep-mask of one (batch * nheads + head) from the documented mapping."""
    row = np.arange(seqlen_q, dtype=np.uint64).reshape(-1, 1)
    col = np.arange(seqlen_k, dtype=np.uint64).reshape(1, -1)
    ctr = (col >> np.uint64(5), row >> np.uint64(4),
           np.uint64(bh << 5) | ((row & np.uint64(7)) << np.uint64(2)) | ((col & np.uint64(7)) >> np.uint64(1)),
           np.uint64(offset & _MASK32))
    r = philox4x32_10(ctr, (seed & _MASK32, (seed >> 32) & _MASK32))
    word = (((row >> np.uint64(3)) & np.uint64(1)) * np.uint64(2) + (col & np.uint64(1))).astype(np.int64)
    w = np.take_along_axis(r, np.broadcast_to(word, r.shape[1:])[None], axis=0)[0]
    byte = (w >> (np.uint32(8) * ((col >> np.uint64(3)) & np.uint64(3)).astype(np.uint32))) & np.uint32(0xFF)
    return byte >= min(255, round(p * 256))


def attention_dropout_ref(q, k, v, keep, p, causal=False, softmax_scale=None, upcast=True):
    """Attention with dropout applied with the given keep-mask (batch, nheads, seqlen_q, seqlen_k):
    out = (softmax(scale q k^T) * keep * rp) v, rp = 1 / keep probability (flashgen's byte-quantised p, so
    the expectation is exact). upcast=True in fp32 (reference), False in the input dtype."""
    from flashgen.interface import dropout_keep_scale
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if causal:
        row = torch.arange(sq, device=q.device).view(-1, 1)
        col = torch.arange(sk, device=q.device).view(1, -1)
        scores = scores.masked_fill(col > row + sk - sq, float("-inf"))
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    attn = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    attn = attn.masked_fill(~keep, 0.0) * dropout_keep_scale(p)
    out = torch.einsum("bhts,bshd->bthd", attn, v)
    return out.to(dtype)
