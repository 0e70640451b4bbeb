"""The dropout mask written out in NumPy from its definition (templates/include/flashgen/dropout.cuh), and the
attention reference with a given keep-mask."""
import numpy as np

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
    from tests.attn_ref import attention_ref
    return attention_ref(q, k, v, causal, softmax_scale, upcast, keep=keep, keep_scale=dropout_keep_scale(p))[0]
