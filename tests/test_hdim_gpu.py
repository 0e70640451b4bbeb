"""Head dims beyond the default buckets on the GPU: padded (80), wide (512: two column groups in the forward, the
split backward with 32-key blocks) and a V head dim that differs from Q/K's (192 / 128 as in MLA models, and
64 / 128), forward and backward, against the fp32 reference with the usual error rules."""
import pytest
import torch

from tests.attn_ref import assert_close_to_ref, assert_grads_close, attention_ref, poison_allocator

pytestmark = pytest.mark.gpu

# (dtype, head_dim of q/k, head_dim_v)
CASES = [(torch.bfloat16, 80, 80), (torch.float16, 80, 80),
         (torch.bfloat16, 512, 512), (torch.float16, 512, 512),
         (torch.bfloat16, 192, 128), (torch.float16, 192, 128),
         (torch.bfloat16, 64, 128), (torch.bfloat16, 136, 88)]
SEQLENS = [(1, 1), (17, 17), (113, 203), (239, 1), (1, 239), (1023, 1024)]


def _id(c):
    return f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}" + ("" if c[1] == c[2] else f"v{c[2]}")


def _inputs(dtype, d, dv, batch, sq, sk, h, hk=None):
    hk = hk or h
    return (torch.randn(batch, sq, h, d, device="cuda", dtype=dtype),
            torch.randn(batch, sk, hk, d, device="cuda", dtype=dtype),
            torch.randn(batch, sk, hk, dv, device="cuda", dtype=dtype))


def _check_fwd(q, k, v, causal):
    import flashgen
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    poison_allocator(((b, sq, h, dv), q.dtype), ((b, h, sq), torch.float32))
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (b, sq, h, dv) and out.dtype == q.dtype
    ref, lse_ref = attention_ref(q, k, v, causal)
    ref_lowp, _ = attention_ref(q, k, v, causal, upcast=False)
    assert_close_to_ref(out, ref, ref_lowp)
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=2e-3)


def _check_bwd(q, k, v, causal, schedule):
    import flashgen
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flashgen.flash_attn_func(*leaves, causal=causal, backward_impl=schedule)
    poison_allocator(*[(tuple(t.shape), t.dtype) for t in (q, k, v)])
    out.backward(dout)
    grads = tuple(t.grad for t in leaves)
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape
    assert_grads_close(grads, q, k, v, dout, causal)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fwd_head_dims(case, causal, seqlens):
    dtype, d, dv = case
    sq, sk = seqlens
    _check_fwd(*_inputs(dtype, d, dv, 2 if sq * sk < 500_000 else 1, sq, sk, 3), causal)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("schedule", ["auto", "split"])
def test_bwd_head_dims(case, causal, seqlens, schedule):
    dtype, d, dv = case
    sq, sk = seqlens
    _check_bwd(*_inputs(dtype, d, dv, 2 if sq * sk < 500_000 else 1, sq, sk, 3), causal, schedule)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hd512_many_heads_batch1(causal):
    q, k, v = _inputs(torch.bfloat16, 512, 512, 1, 300, 300, 16)
    _check_fwd(q, k, v, causal)
    _check_bwd(q, k, v, causal, "auto")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", [(192, 128), (512, 512)], ids=["hd192v128", "hd512"])
def test_gqa_head_dims(causal, dims):
    q, k, v = _inputs(torch.bfloat16, *dims, 2, 257, 311, 8, hk=2)
    _check_fwd(q, k, v, causal)
    _check_bwd(q, k, v, causal, "auto")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", [(192, 128), (512, 512)], ids=["hd192v128", "hd512"])
def test_varlen_head_dims(causal, dims):
    import flashgen
    d, dv = dims
    lens_q, lens_k = [17, 0, 113, 1, 256], [33, 5, 113, 0, 129]
    h, hk = 4, 2
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    assert out.shape == (sum(lens_q), h, dv)
    dout = torch.randn_like(out)
    out.backward(dout)
    # Per sequence against the fixed-length reference.
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs, ks, vs = (t.detach()[c[i]:c[i + 1]].unsqueeze(0) for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        o = out.detach()[cu_q[i]:cu_q[i + 1]].unsqueeze(0)
        if lq == 0:
            continue
        ref, _ = attention_ref(qs, ks, vs, causal)
        ref_lowp, _ = attention_ref(qs, ks, vs, causal, upcast=False)
        assert_close_to_ref(o, ref, ref_lowp, name=f"seq{i} out")
        grads = (q.grad[cu_q[i]:cu_q[i + 1]].unsqueeze(0), k.grad[cu_k[i]:cu_k[i + 1]].unsqueeze(0),
                 v.grad[cu_k[i]:cu_k[i + 1]].unsqueeze(0))
        assert_grads_close(grads, qs, ks, vs, dout[cu_q[i]:cu_q[i + 1]].unsqueeze(0), causal, name=f"seq{i} ")


def test_custom_op_head_dim_v():
    """flashgen::fwd / flashgen::bwd take a V head dim of its own, eager and under torch.compile."""
    import flashgen.ops
    q, k, v = _inputs(torch.bfloat16, 192, 128, 2, 129, 257, 4)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flashgen.ops.attention(*leaves, causal=True)
    assert out.shape == (2, 129, 4, 128)
    compiled = torch.compile(flashgen.ops.attention, fullgraph=True)(q, k, v, causal=True)
    torch.testing.assert_close(compiled, out, atol=0, rtol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert_grads_close(tuple(t.grad for t in leaves), q, k, v, dout, True)
