"""flashgen's kernels as torch.library custom ops, for torch.compile(fullgraph=True) and CUDA graphs.

The public API (flashgen.flash_attn_func, ...) launches kernels through the driver API from Python, which
Dynamo cannot trace. These ops are opaque to it instead: each has a fake implementation that gives the
output metadata without running anything, and the forward ops have autograd formulas built on the
backward ops. Importing this module registers them:

    import flashgen.ops
    out, lse = torch.ops.flashgen.fwd(q, k, v, q.shape[-1] ** -0.5, True)
    out = flashgen.ops.attention(q, k, v, causal=True)          # same, with checks and the default scale

Schemas (every op also takes `float dropout_p=0.0, Tensor? rng_state=None` last: the dropout probability
and the (seed, offset) int64 pair on the device that the kernels draw the mask from; `attention` draws it):
    flashgen::fwd(q, k, v, float softmax_scale, bool causal, ...) -> (out, lse)
    flashgen::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k,
                         float softmax_scale, bool causal, ...) -> (out, lse)
    flashgen::bwd(dout, q, k, v, out, lse, float softmax_scale, bool causal, ...) -> (dq, dk, dv)
    flashgen::varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, SymInt max_seqlen_q,
                         SymInt max_seqlen_k, float softmax_scale, bool causal, ...) -> (dq, dk, dv)
Layouts as in the API: q (batch, seqlen_q, nheads, d) -> lse (batch, nheads, seqlen_q) fp32; varlen
q (total_q, nheads, d) -> lse (nheads, total_q) fp32. No CUDA is needed to import this module.
"""
# No `from __future__ import annotations`: custom_op infers each schema from the real annotation objects.
from typing import Optional

import torch
from torch import Tensor

from . import interface

__all__ = ["fwd", "varlen_fwd", "bwd", "varlen_bwd", "attention", "varlen_attention"]


def _contiguous_like(t: Tensor) -> Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------------
# forward (each op body is a plain function wrapped by custom_op, so that CPU tests can check that it calls
# interface.py with that function's exact argument order)


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, dropout_p: float = 0.0,
              rng_state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv) -> out (b, sq, h, dv), lse (b, h, sq) fp32."""
    out, lse = interface._flash_attn_forward(q, k, v, softmax_scale, causal, dropout_p, rng_state)
    return out, lse


fwd = torch.library.custom_op("flashgen::fwd", _fwd_impl, mutates_args=(), device_types="cuda")


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, dropout_p=0.0, rng_state=None):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def _varlen_fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                     dropout_p: float = 0.0, rng_state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """q (total_q, h, d), k (total_k, hk, d), v (total_k, hk, dv) -> out (total_q, h, dv), lse (h, total_q) fp32."""
    out, lse = interface._flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                    max_seqlen_k, softmax_scale, causal, dropout_p, rng_state)
    return out, lse


varlen_fwd = torch.library.custom_op("flashgen::varlen_fwd", _varlen_fwd_impl, mutates_args=(), device_types="cuda")


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     dropout_p=0.0, rng_state=None):
    total_q, nheads, _ = q.shape
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# backward


def _bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
              causal: bool, dropout_p: float = 0.0, rng_state: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> dq (like q), dk (like k), dv (like v)."""
    grads = interface._flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, "auto", False, dropout_p,
                                           rng_state)
    dq, dk, dv = grads[:3]   # tolerate extra outputs (flash-attn's backward also returns softmax_d)
    return dq, dk, dv


bwd = torch.library.custom_op("flashgen::bwd", _bwd_impl, mutates_args=(), device_types="cuda")


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, dropout_p=0.0, rng_state=None):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


def _varlen_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                     causal: bool, dropout_p: float = 0.0,
                     rng_state: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> dq (like q), dk (like k), dv (like v)."""
    grads = interface._flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  max_seqlen_k, softmax_scale, causal, "auto", False, dropout_p,
                                                  rng_state)
    dq, dk, dv = grads[:3]
    return dq, dk, dv


varlen_bwd = torch.library.custom_op("flashgen::varlen_bwd", _varlen_bwd_impl, mutates_args=(),
                                     device_types="cuda")


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, dropout_p=0.0, rng_state=None):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


# ----------------------------------------------------------------------------------------------------
# autograd: the gradient of lse is ignored (as in flash-attn), the forward's lse is reused by the backward


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, dropout_p, rng_state = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, interface._save_rng(rng_state, lse))
    ctx.softmax_scale, ctx.causal, ctx.dropout_p = softmax_scale, causal, dropout_p


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, rng = ctx.saved_tensors
    # The kernels read rows with unit stride; a gradient arriving as a strided view gets packed first.
    dq, dk, dv = torch.ops.flashgen.bwd(dout.contiguous(), q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                        ctx.dropout_p, interface._load_rng(rng))
    return dq, dk, dv, None, None, None, None


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, dropout_p, rng_state = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                          interface._save_rng(rng_state, lse))
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.dropout_p = softmax_scale, causal, dropout_p


def _varlen_fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashgen.varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                               ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.softmax_scale, ctx.causal,
                                               ctx.dropout_p, interface._load_rng(rng))
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("flashgen::fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("flashgen::varlen_fwd", _varlen_fwd_backward, setup_context=_varlen_fwd_setup_context)


# ----------------------------------------------------------------------------------------------------
# checked entry points (metadata checks only: traceable, and safe inside CUDA graph capture)


def _scale(q: Tensor, softmax_scale) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def _dropout_args(q: Tensor, dropout_p, rng_state, generator):
    """dropout_p checked; the rng state drawn from torch's generator when dropout needs one and none was given."""
    interface._check_options(dropout_p, (-1, -1), 0.0, None, None, generator)
    dropout_p = float(dropout_p)
    if dropout_p and rng_state is None:
        rng_state = interface._draw_rng_state(q.device, generator)
    return dropout_p, rng_state if dropout_p else None


def attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale=None, causal: bool = False, dropout_p: float = 0.0,
              rng_state: Optional[Tensor] = None, generator=None) -> Tensor:
    """flash_attn_func's core through flashgen::fwd: q (b, sq, h, d), k/v (b, sk, hk, d) -> (b, sq, h, d).
    dropout_p > 0: the mask comes from rng_state (two int64 on q's device), drawn from torch's CUDA generator
    (or `generator`) when not given."""
    interface._check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    interface._check_tensor("k", k, 4, "(batch, seqlen_k, nheads_k, headdim)")
    interface._check_tensor("v", v, 4, "(batch, seqlen_k, nheads_k, headdim)")
    interface._check_same(q, k, v)
    if k.shape[:-1] != v.shape[:-1] or k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must both be (batch={q.shape[0]}, seqlen_k, nheads_k, headdim[_v]), "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    interface._check_options(dropout_p, (-1, -1), 0.0, None, None, generator)
    interface._check_heads_and_dim(q.shape[2], k.shape[2], q.shape[3], k.shape[3], v.shape[3], float(dropout_p))
    dropout_p, rng_state = _dropout_args(q, dropout_p, rng_state, generator)
    return torch.ops.flashgen.fwd(q, k, v, _scale(q, softmax_scale), bool(causal), dropout_p, rng_state)[0]


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, softmax_scale=None, causal: bool = False, dropout_p: float = 0.0,
                     rng_state: Optional[Tensor] = None, generator=None) -> Tensor:
    """flash_attn_varlen_func's core through flashgen::varlen_fwd: q (total_q, h, d) -> (total_q, h, d).
    The values of cu_seqlens are not checked (that would read the device); they must be valid."""
    interface._check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    interface._check_tensor("k", k, 3, "(total_k, nheads_k, headdim)")
    interface._check_tensor("v", v, 3, "(total_k, nheads_k, headdim)")
    interface._check_same(q, k, v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in (total_k, nheads_k), got {tuple(k.shape)} and {tuple(v.shape)}")
    batch = interface._check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.device)
    interface._check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch, q.device)
    interface._check_options(dropout_p, (-1, -1), 0.0, None, None, generator)
    interface._check_heads_and_dim(q.shape[1], k.shape[1], q.shape[2], k.shape[2], v.shape[2], float(dropout_p))
    dropout_p, rng_state = _dropout_args(q, dropout_p, rng_state, generator)
    return torch.ops.flashgen.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         _scale(q, softmax_scale), bool(causal), dropout_p, rng_state)[0]
