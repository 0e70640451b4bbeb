"""nn.Modules with flash-attn's names and arguments (`flash_attn.modules.mha`), on flashgen's public API.

FlashSelfAttention / FlashCrossAttention take already-projected q, k, v; MHA adds the projections. Attribute
names (Wqkv, Wq, Wkv, out_proj, inner_attn, inner_cross_attn) follow flash-attn's MHA, so its state dicts
load. Dropout is applied only in training mode, by the attention kernels themselves (Philox, seeded from torch's
CUDA generator).
"""
from __future__ import annotations

import torch
from torch import nn

from . import interface
from .bert_padding import pad_input, unpad_input

__all__ = ["FlashSelfAttention", "FlashCrossAttention", "MHA"]


class _FlashAttnBase(nn.Module):
    def __init__(self, causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)   # holds p; the kernel applies the dropout itself
        self.window_size = window_size
        # A buffer so that .to(device) moves the slopes with the module; not saved in state dicts.
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.deterministic = deterministic

    def _options(self, causal) -> dict:
        return dict(dropout_p=self.drop.p if self.training else 0.0, softmax_scale=self.softmax_scale,
                    causal=self.causal if causal is None else causal, window_size=self.window_size,
                    alibi_slopes=self.alibi_slopes, deterministic=self.deterministic)


class FlashSelfAttention(_FlashAttnBase):
    """Softmax attention over a packed qkv tensor.

    softmax_scale: default 1 / sqrt(headdim). attention_dropout: dropout on the attention probabilities
    (training mode only). causal may be overridden per call.
    """

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False):
        super().__init__(causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        """qkv: (batch, seqlen, 3, nheads, headdim), or (total, 3, nheads, headdim) with cu_seqlens (batch + 1,)
        int32 and max_seqlen. Returns (batch, seqlen, nheads, headdim) or (total, nheads, headdim)."""
        opts = self._options(causal)
        if cu_seqlens is None:
            return interface.flash_attn_qkvpacked_func(qkv, **opts)
        if max_seqlen is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
        return interface.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **opts)


class FlashCrossAttention(_FlashAttnBase):
    """Softmax attention of q over a packed kv tensor (also the GQA / MQA path: kv may have fewer heads)."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False):
        super().__init__(causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None):
        """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim).
        Varlen: q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim), with cu_seqlens / max_seqlen
        for q and cu_seqlens_k / max_seqlen_k for kv."""
        opts = self._options(causal)
        if cu_seqlens is None:
            return interface.flash_attn_kvpacked_func(q, kv, **opts)
        if max_seqlen is None or cu_seqlens_k is None or max_seqlen_k is None:
            raise ValueError("varlen cross attention needs cu_seqlens, max_seqlen, cu_seqlens_k and max_seqlen_k")
        return interface.flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                                         **opts)


class MHA(nn.Module):
    """Multi-head attention: projections + flashgen attention + output projection.

    Self-attention uses one fused Wqkv (embed_dim -> (num_heads + 2 * num_heads_kv) * head_dim, q heads first,
    then k, then v); num_heads_kv < num_heads gives GQA / MQA. cross_attn=True uses Wq on x and Wkv on x_kv.
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads_kv < 1 or num_heads % num_heads_kv:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_heads_kv ({num_heads_kv})")
        self.embed_dim, self.num_heads, self.num_heads_kv = embed_dim, num_heads, num_heads_kv
        self.head_dim = embed_dim // num_heads
        self.cross_attn, self.causal = cross_attn, causal
        kv_dim = 2 * num_heads_kv * self.head_dim
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, embed_dim + kv_dim, bias=qkv_proj_bias, **factory)
        self.inner_attn = FlashSelfAttention(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.inner_cross_attn = FlashCrossAttention(causal=causal, softmax_scale=softmax_scale,
                                                    attention_dropout=dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None,
                max_seqlen_k=None):
        """x: (batch, seqlen, embed_dim), or (total, embed_dim) packed with cu_seqlens (batch + 1,) int32 and
        max_seqlen. x_kv (cross_attn only, default x): the same for the keys, with cu_seqlens_k / max_seqlen_k
        (default cu_seqlens / max_seqlen) when packed.

        key_padding_mask: (batch, seqlen_k) bool, True = a real token; padded input only. Self-attention drops
        the masked tokens entirely (unpad, varlen attention, re-pad): their output rows are 0. Cross-attention
        masks the keys of x_kv; every query row is computed.
        Returns a tensor shaped like x.
        """
        packed = cu_seqlens is not None
        if packed:
            if max_seqlen is None:
                raise ValueError("max_seqlen is required with cu_seqlens")
            if key_padding_mask is not None:
                raise ValueError("key_padding_mask is for padded input; packed input (cu_seqlens) has no padding")
            if x.dim() != 2:
                raise ValueError(f"packed x must be (total, embed_dim), got {tuple(x.shape)}")
        elif x.dim() != 3:
            raise ValueError(f"x must be (batch, seqlen, embed_dim) (or packed with cu_seqlens), got {tuple(x.shape)}")
        if key_padding_mask is not None:
            kv_len = (x if x_kv is None else x_kv).shape[:2]
            if tuple(key_padding_mask.shape) != tuple(kv_len):
                raise ValueError(f"key_padding_mask must be (batch, seqlen_k) = {tuple(kv_len)}, "
                                 f"got {tuple(key_padding_mask.shape)}")
        if self.cross_attn:
            return self._cross(x, x if x_kv is None else x_kv, key_padding_mask, cu_seqlens, max_seqlen,
                               cu_seqlens_k, max_seqlen_k)
        if x_kv is not None:
            raise ValueError("x_kv is only for cross_attn=True")
        if key_padding_mask is None:
            return self.out_proj(self._self_attn(x, cu_seqlens, max_seqlen))
        batch, seqlen = x.shape[:2]
        x_unpad, indices, cu, max_len, _ = unpad_input(x, key_padding_mask)
        out = self.out_proj(self._self_attn(x_unpad, cu, max_len))
        return pad_input(out, indices, batch, seqlen)

    def _self_attn(self, x, cu_seqlens, max_seqlen):
        """x (..., embed_dim) -> attention output (..., embed_dim), before out_proj."""
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        qkv = self.Wqkv(x).unflatten(-1, (h + 2 * hk, d))
        if hk == h:
            out = self.inner_attn(qkv.unflatten(-2, (3, h)), cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        else:
            q, kv = qkv[..., :h, :], qkv[..., h:, :].unflatten(-2, (2, hk))
            out = self.inner_cross_attn(q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                        cu_seqlens_k=cu_seqlens, max_seqlen_k=max_seqlen)
        return out.flatten(-2)

    def _cross(self, x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k):
        h, hk, d = self.num_heads, self.num_heads_kv, self.head_dim
        q = self.Wq(x).unflatten(-1, (h, d))
        if key_padding_mask is None:
            if cu_seqlens is not None:
                cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
                max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
            kv = self.Wkv(x_kv).unflatten(-1, (2, hk, d))
            out = self.inner_cross_attn(q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                        cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
            return self.out_proj(out.flatten(-2))
        # Padded keys: pack the kept keys, and view the queries (all kept) as equal-length packed sequences.
        batch, seqlen_q = q.shape[:2]
        kv_unpad, _, cu_k, max_k, _ = unpad_input(x_kv, key_padding_mask)
        kv = self.Wkv(kv_unpad).unflatten(-1, (2, hk, d))
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
        out = self.inner_cross_attn(q.reshape(batch * seqlen_q, h, d), kv, cu_seqlens=cu_q, max_seqlen=seqlen_q,
                                    cu_seqlens_k=cu_k, max_seqlen_k=max_k)
        return self.out_proj(out.reshape(batch, seqlen_q, h * d))
