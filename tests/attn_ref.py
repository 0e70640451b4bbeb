"""Plain PyTorch attention used as the reference, and the correctness rule of the FlashAttention tests."""
import math

import torch


def masked_scores(q, k, causal=False, softmax_scale=None):
    """scale * q k^T as (b, h, sq, sk) for q (b, sq, h, d), k (b, sk, hk, d) (GQA heads repeated), with the
    bottom-right-aligned causal mask as -inf; also returns k repeated to h heads."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    k = k.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if causal:
        row = torch.arange(sq, device=q.device).view(-1, 1)
        col = torch.arange(sk, device=q.device).view(1, -1)
        scores = scores.masked_fill(col > row + sk - sq, float("-inf"))
    return scores, k


def softmax_rows(scores):
    """softmax over keys; a row with every key masked attends to nothing (zeros), so gradients stay finite."""
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True, keep=None, keep_scale=1.0):
    """q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq).
    upcast=True computes in fp32 (the reference); False in the input dtype (the error baseline).
    Causal is aligned to the bottom-right corner; a row that sees no key gives 0 and lse -inf.
    keep (b, h, sq, sk) bool: dropout mask applied to the probabilities, kept ones scaled by keep_scale."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    h, hk = q.shape[2], k.shape[2]
    scores, _ = masked_scores(q, k, causal, softmax_scale)
    lse = torch.logsumexp(scores.float(), dim=-1)
    attn = softmax_rows(scores)
    if keep is not None:
        attn = attn.masked_fill(~keep, 0.0) * keep_scale
    out = torch.einsum("bhts,bshd->bthd", attn, v.repeat_interleave(h // hk, dim=2))
    return out.to(dtype), lse


def assert_close_to_ref(out, ref, ref_lowp, name="out", factor=2.0, atol=1e-5, ulps=0):
    """flash-attn's rule: max error vs the fp32 reference <= factor x PyTorch's same-dtype error + atol.
    ulps > 0 also allows each element that many units in the last place of its reference value in out's dtype (for
    inputs where PyTorch's same-dtype path is exact by construction, so that its error gives the rule no scale)."""
    assert not torch.isnan(out).any(), f"{name} has NaN (unwritten or poisoned elements)"
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if out.numel() == 0:   # e.g. the gradient of a varlen sequence of length 0
        return
    diff = (out.float() - ref.float()).abs()
    err = diff.max().item()
    base = (ref_lowp.float() - ref.float()).abs().max().item()
    if ulps:
        mag = ref.float().abs().clamp_min(torch.finfo(out.dtype).tiny)
        ulp = torch.finfo(out.dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))
        excess = (diff - ulps * ulp).max().item()
        assert excess <= factor * base + atol, (f"{name}: max error {err:.3g}, beyond {ulps} ulp {excess:.3g} > "
                                                f"{factor} x {base:.3g} + {atol}")
        return
    assert err <= factor * base + atol, f"{name}: max error {err:.3g} > {factor} x {base:.3g} + {atol}"


def poison_allocator(*shapes_dtypes, device="cuda"):
    """Fill the caching allocator's next blocks of these sizes with NaN, so an output allocated right
    after starts as NaN and any element the kernel fails to write is caught."""
    bufs = [torch.full(s, float("nan"), dtype=dt, device=device) for s, dt in shapes_dtypes]
    del bufs


def grads_ref(q, k, v, dout, causal=False, softmax_scale=None, upcast=True):
    """dq, dk, dv of attention_ref: upcast=True in fp32 from fp32 leaves (the reference), False in the
    input dtype (the error baseline)."""
    leaves = [t.detach().float() if upcast else t.detach() for t in (q, k, v)]
    for t in leaves:
        t.requires_grad_(True)
    out, _ = attention_ref(*leaves, causal=causal, softmax_scale=softmax_scale, upcast=upcast)
    out.backward(dout.float() if upcast else dout)
    return tuple(t.grad for t in leaves)


def assert_grads_close(grads, q, k, v, dout, causal=False, softmax_scale=None, name=""):
    """The backward rule: each gradient's max error <= 3 x PyTorch's same-dtype autograd error + 1e-4."""
    ref = grads_ref(q, k, v, dout, causal, softmax_scale)
    low = grads_ref(q, k, v, dout, causal, softmax_scale, upcast=False)
    for gname, g, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        assert g.shape == r.shape and g.dtype == q.dtype, f"{name}{gname}: {g.shape} {g.dtype}"
        assert_close_to_ref(g, r, lo, name=f"{name}{gname}", factor=3.0, atol=1e-4)
