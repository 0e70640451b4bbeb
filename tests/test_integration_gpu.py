"""torch integration on the GPU: flashgen.modules against plain PyTorch, the flashgen:: custom ops under
torch.library.opcheck and torch.compile(fullgraph=True), and CUDA graph capture of the forward.

Small shapes with one head dim (64, bf16) so that few kernels are compiled.
"""
import pytest
import torch

import flashgen
from flashgen import ops
from flashgen.modules import MHA, FlashCrossAttention, FlashSelfAttention
from tests.attn_ref import assert_close_to_ref, attention_ref

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
HDIM = 64


def _randn(*shape, requires_grad=False):
    return torch.randn(*shape, device="cuda", dtype=DTYPE, requires_grad=requires_grad)


def _check(out, q, k, v, causal, scale=None):
    ref, _ = attention_ref(q, k, v, causal, scale)
    ref_lowp, _ = attention_ref(q, k, v, causal, scale, upcast=False)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_close_to_ref(out, ref, ref_lowp)


def _varlen_ref_check(out, q, k, v, cu_q, cu_k, causal):
    """Each packed sequence against the reference run on it alone."""
    for i in range(cu_q.numel() - 1):
        (sq, eq), (sk, ek) = cu_q[i:i + 2].tolist(), cu_k[i:i + 2].tolist()
        _check(out[None, sq:eq], q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], causal)


# ----------------------------------------------------------------------------------------------------
# modules


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_self_attention(causal):
    torch.manual_seed(0)
    qkv = _randn(2, 97, 3, 4, HDIM)
    attn = FlashSelfAttention(causal=causal).eval()
    _check(attn(qkv), *qkv.unbind(2), causal)

    seqlens = [97, 31, 64]
    cu = torch.tensor([0, 97, 128, 192], device="cuda", dtype=torch.int32)
    packed = _randn(sum(seqlens), 3, 4, HDIM)
    out = attn(packed, cu_seqlens=cu, max_seqlen=max(seqlens))
    _varlen_ref_check(out, *packed.unbind(1), cu, cu, causal)


def test_flash_cross_attention_gqa():
    torch.manual_seed(0)
    q, kv = _randn(2, 45, 8, HDIM), _randn(2, 77, 2, 2, HDIM)
    attn = FlashCrossAttention(softmax_scale=0.2).eval()
    ref = attention_ref(q, kv[:, :, 0], kv[:, :, 1], False, 0.2)
    assert_close_to_ref(attn(q, kv), ref[0], attention_ref(q, kv[:, :, 0], kv[:, :, 1], False, 0.2, upcast=False)[0])


def _mha_ref(mha, x, upcast):
    """The module written out with its own (bf16) projections and reference attention in fp32 or bf16."""
    h, hk, d = mha.num_heads, mha.num_heads_kv, mha.head_dim
    q, k, v = mha.Wqkv(x).split([h * d, hk * d, hk * d], dim=-1)
    q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))
    return mha.out_proj(attention_ref(q, k, v, mha.causal, upcast=upcast)[0].flatten(-2))


@pytest.mark.parametrize("num_heads_kv", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mha(num_heads_kv, causal):
    torch.manual_seed(0)
    mha = MHA(4 * HDIM, 4, num_heads_kv=num_heads_kv, causal=causal, device="cuda", dtype=DTYPE).eval()
    x = _randn(3, 70, 4 * HDIM)
    with torch.no_grad():
        assert_close_to_ref(mha(x), _mha_ref(mha, x, True), _mha_ref(mha, x, False))

        # key_padding_mask: unpadded, run varlen, re-padded; each sequence equals it run alone
        lens = [70, 9, 41]
        mask = torch.arange(70, device="cuda")[None] < torch.tensor(lens, device="cuda")[:, None]
        out = mha(x, key_padding_mask=mask)
        assert out.shape == x.shape and not out[~mask].any()
        for b, n in enumerate(lens):
            xb = x[b:b + 1, :n]
            assert_close_to_ref(out[b:b + 1, :n], _mha_ref(mha, xb, True), _mha_ref(mha, xb, False))

        # already-unpadded input with cu_seqlens gives the same rows
        cu = torch.tensor([0, 70, 79, 120], device="cuda", dtype=torch.int32)
        torch.testing.assert_close(mha(x[mask], cu_seqlens=cu, max_seqlen=70), out[mask])


# ----------------------------------------------------------------------------------------------------
# custom ops


def test_opcheck():
    q, k, v = _randn(2, 40, 4, HDIM), _randn(2, 56, 2, HDIM), _randn(2, 56, 2, HDIM)
    torch.library.opcheck(torch.ops.flashgen.fwd.default, (q, k, v, 0.125, True))
    cu_q = torch.tensor([0, 15, 40], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 56], device="cuda", dtype=torch.int32)
    torch.library.opcheck(torch.ops.flashgen.varlen_fwd.default,
                          (q[0], k[0], v[0], cu_q, cu_k, 25, 36, 0.125, False))


class _Block(torch.nn.Module):
    """A small attention block written on flashgen.ops (the path torch.compile traces)."""

    def __init__(self, dim=2 * HDIM, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False, device="cuda", dtype=DTYPE)
        self.proj = torch.nn.Linear(dim, dim, bias=False, device="cuda", dtype=DTYPE)

    def forward(self, x, cu_seqlens=None, max_seqlen=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, HDIM)).unbind(-3)
        if cu_seqlens is None:
            out = ops.attention(q, k, v, causal=True)
        else:
            out = ops.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
        return x + self.proj(out.flatten(-2))


def test_compile_fullgraph_forward():
    torch._dynamo.reset()
    torch.manual_seed(0)

    # The op alone: the compiled graph runs the same kernel, so the result is bit-identical.
    def attn(q, k, v):
        return ops.attention(q, k, v, causal=True) * 2

    q, k, v = _randn(2, 100, 4, HDIM), _randn(2, 130, 2, HDIM), _randn(2, 130, 2, HDIM)
    assert torch.equal(torch.compile(attn, fullgraph=True)(q, k, v), attn(q, k, v))

    # A block around it (the compiled matmuls may round differently: compared with bf16 tolerances).
    block = _Block().eval()
    compiled = torch.compile(block, fullgraph=True)
    x = _randn(2, 100, 2 * HDIM)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x))
        cu = torch.tensor([0, 60, 100], device="cuda", dtype=torch.int32)
        torch.testing.assert_close(compiled(x[0], cu, 60), block(x[0], cu, 60))
    torch._dynamo.reset()


def test_compile_fullgraph_backward():
    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = (_randn(2, 100, h, HDIM, requires_grad=True) for h in (4, 2, 2))
    dout = _randn(2, 100, 4, HDIM)
    out = torch.compile(lambda q, k, v: ops.attention(q, k, v, causal=True), fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(attention_ref(q, k, v, True)[0], (q, k, v), dout)
    ref_lowp = torch.autograd.grad(attention_ref(q, k, v, True, upcast=False)[0], (q, k, v), dout)
    for name, g, r, rl in zip(("dq", "dk", "dv"), grads, ref, ref_lowp):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert_close_to_ref(g, r, rl, name=name, factor=3.0, atol=1e-4)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------
# CUDA graphs


def _capture(fn):
    """Warm up on a side stream (kernels compile and load there, outside capture), then capture fn once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    return graph, static_out


def test_cuda_graph_forward():
    torch.manual_seed(0)
    q, k, v = _randn(2, 90, 4, HDIM), _randn(2, 90, 2, HDIM), _randn(2, 90, 2, HDIM)
    cu = torch.tensor([0, 33, 90], device="cuda", dtype=torch.int32)

    def step():
        out = flashgen.flash_attn_func(q, k, v, causal=True)
        out_varlen = flashgen.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 57, 57, causal=True)
        return out, out_varlen

    graph, (static_out, static_varlen) = _capture(step)
    for t in (q, k, v):   # new inputs into the captured buffers
        t.copy_(torch.randn_like(t))
    cu.copy_(torch.tensor([0, 57, 90], device="cuda", dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    out, out_varlen = step()
    assert torch.equal(static_out, out)
    assert torch.equal(static_varlen, out_varlen)
    _check(out, q, k, v, True)
    _varlen_ref_check(out_varlen, q[0], k[0], v[0], cu, cu, True)


def test_cuda_graph_forward_backward():
    """Forward + backward (both schedules) captured once, replayed on new inputs: equal to eager."""
    torch.manual_seed(0)
    q, k, v = _randn(2, 90, 4, HDIM), _randn(2, 90, 2, HDIM), _randn(2, 90, 2, HDIM)
    dout = _randn(2, 90, 4, HDIM)
    for t in (q, k, v):
        t.requires_grad_(True)

    def step(impl):
        def run():
            for t in (q, k, v):
                t.grad = None
            out = flashgen.flash_attn_func(q, k, v, causal=True, backward_impl=impl)
            out.backward(dout)
            return out, q.grad, k.grad, v.grad
        return run

    for impl in ("fused", "split"):
        graph, static = _capture(step(impl))
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        eager = step(impl)()
        for name, a, b in zip(("out", "dq", "dk", "dv"), static, eager):
            if impl == "split":
                assert torch.equal(a, b), name
            else:   # fp32 atomics may add in another order
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_capture_without_warmup_says_so(monkeypatch):
    from flashgen.errors import FlashgenLaunchError
    monkeypatch.setenv("FLASHGEN_HOPPER", "0")   # on sm_90a the Hopper hd256 forward (loaded by other tests) runs 232
    q = _randn(1, 16, 2, 232)   # a padded head dim no other test loads
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(FlashgenLaunchError, match="warm-up"):
        with torch.cuda.graph(graph):
            flashgen.flash_attn_func(q, q, q)


def test_two_streams_concurrently():
    """Two calls in flight on two streams of the same device give the results of running them alone."""
    torch.manual_seed(0)
    inputs = [[_randn(2, 700, 4, HDIM) for _ in range(3)] for _ in range(2)]
    expected = [flashgen.flash_attn_func(*x, causal=bool(i)) for i, x in enumerate(inputs)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for i, (s, x) in enumerate(zip(streams, inputs)):
        with torch.cuda.stream(s):
            outs.append([flashgen.flash_attn_func(*x, causal=bool(i)) for _ in range(20)])
    torch.cuda.synchronize()
    for i, results in enumerate(outs):
        for r in results:
            assert torch.equal(r, expected[i])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_second_device():
    """Inputs on cuda:1 run on cuda:1 (kernels launch on that device's current stream)."""
    q, k, v = (torch.randn(2, 100, 4, HDIM, device="cuda:1", dtype=DTYPE, requires_grad=True) for _ in range(3))
    out = flashgen.flash_attn_func(q, k, v, causal=True)
    assert out.device == q.device
    out.sum().backward()
    assert q.grad.device == q.device
    ref, _ = attention_ref(q.detach(), k.detach(), v.detach(), True)
    ref_lowp, _ = attention_ref(q.detach(), k.detach(), v.detach(), True, upcast=False)
    assert_close_to_ref(out, ref, ref_lowp)
