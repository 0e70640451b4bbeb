"""Moving between padded (batch, seqlen, ...) and packed (total_tokens, ...) layouts for the varlen API.

Same names, arguments and return values as `flash_attn.bert_padding` (flash-attn >= 2.6). Pure PyTorch:
works on CPU and CUDA, and gradients flow through every function.
"""
from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input"]


class IndexFirstAxis(torch.autograd.Function):
    """x[indices] along dim 0; the backward scatters the gradient back into zeros."""

    @staticmethod
    def forward(ctx, x, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = x.shape[0]
        return x.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        grad_x = grad.new_zeros((ctx.first_axis_dim, *grad.shape[1:]))
        # index_add_ rather than a plain store: a repeated index must sum its gradients.
        grad_x.index_add_(0, indices, grad)
        return grad_x, None


class IndexPutFirstAxis(torch.autograd.Function):
    """A zero tensor of first_axis_dim rows with `values` written at rows `indices`."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_axis_dim, *values.shape[1:]))
        out[indices] = values
        return out

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return grad.index_select(0, indices), None, None


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows `indices` (1-D int64) of x along its first axis, differentiable w.r.t. x."""
    return IndexFirstAxis.apply(x, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Inverse of index_first_axis: (first_axis_dim, ...) zeros with values[i] at row indices[i]."""
    return IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Pack the kept tokens of a padded batch.

    hidden_states: (batch, seqlen, ...). attention_mask: (batch, seqlen), bool or int, nonzero = a real token.
    unused_mask: (batch, seqlen), optional: tokens that are allocated (kept in the packed tensor and counted
    in cu_seqlens) but not attended to; `seqused` counts only the attention_mask tokens.
    Returns (hidden_states (total, ...), indices (total,) int64 into batch * seqlen, cu_seqlens (batch + 1,)
    int32 starting at 0, max_seqlen_in_batch (int), seqused (batch,) int32).
    """
    used = attention_mask.bool()
    kept = used | unused_mask.bool() if unused_mask is not None else used
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    # A Python int, as flash-attn returns: the varlen API takes max_seqlen on the host.
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.cat([seqlens.new_zeros(1), torch.cumsum(seqlens, dim=0, dtype=torch.int32)])
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of unpad_input: (total, ...) -> (batch, seqlen, ...), zeros where no token was kept."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
