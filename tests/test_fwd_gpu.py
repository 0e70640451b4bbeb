"""Forward attention on the GPU against the fp32 reference (flash-attn's error rule), on the SM80 path: the forward
every GPU runs (on compute capability 9.0 the Hopper forward is the default; tests/test_hopper_gpu.py runs this grid
on it)."""
import pytest
import torch

from tests.attn_ref import assert_close_to_ref, attention_ref, poison_allocator

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HDIMS = [32, 40, 64, 72, 96, 128, 160, 192, 200, 224, 256]
SEQLENS = [(1, 1), (1, 239), (113, 203), (128, 217), (239, 1), (17, 17), (1023, 1024), (2048, 2048), (113, 1023)]


@pytest.fixture(autouse=True, params=[False, True], ids=["grid", "persistent"])
def sm80_path(monkeypatch, request):
    """Every test on both forms of the SM80 forward: one CTA per tile (the grid), and the resident CTAs walking the
    tiles (heuristics.FWD_SM80_PERSISTENT; causal kernels always take the grid)."""
    from codegen import heuristics
    from flashgen import dispatch
    monkeypatch.setenv("FLASHGEN_HOPPER", "0")   # read per call: dispatch's kernel cache is keyed by it
    monkeypatch.setattr(heuristics, "FWD_SM80_PERSISTENT", request.param)
    dispatch._fwd_kernel.cache_clear()
    yield request.param
    dispatch._fwd_kernel.cache_clear()


def _run(q, k, v, causal, **kw):
    import flashgen
    b, sq, h, d = q.shape
    poison_allocator(((b, sq, h, d), q.dtype), ((b, h, sq), torch.float32))
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    return out, lse


def _check(q, k, v, causal, ulps=0, **kw):
    out, lse = _run(q, k, v, causal, **kw)
    ref, lse_ref = attention_ref(q, k, v, causal, kw.get("softmax_scale"))
    ref_lowp, _ = attention_ref(q, k, v, causal, kw.get("softmax_scale"), upcast=False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close_to_ref(out, ref, ref_lowp, ulps=ulps)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert not torch.isnan(lse).any()
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("hdim", HDIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fwd_grid(dtype, hdim, causal, seqlens):
    _check(*grid_inputs(dtype, hdim, seqlens), causal)


def grid_inputs(dtype, hdim, seqlens):
    """Fresh random q, k, v for one grid point (fewer heads for the largest shapes)."""
    sq, sk = seqlens
    batch, nheads = (2, 3) if sq * sk < 1_000_000 else (1, 2)
    return tuple(torch.randn(batch, s, nheads, hdim, device="cuda", dtype=dtype) for s in (sq, sk, sk))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 3)], ids=["mqa", "gqa4", "gqa2"])
def test_fwd_gqa(dtype, hdim, causal, heads):
    h, hk = heads
    q = torch.randn(2, 257, h, hdim, device="cuda", dtype=dtype)
    k = torch.randn(2, 311, hk, hdim, device="cuda", dtype=dtype)
    v = torch.randn(2, 311, hk, hdim, device="cuda", dtype=dtype)
    _check(q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_many_heads_batch1_scale(causal):
    q, k, v = (torch.randn(1, 77, 48, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, causal, softmax_scale=0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_qkvpacked_and_kvpacked_strided(causal):
    import flashgen
    qkv = torch.randn(2, 200, 3, 4, 64, device="cuda", dtype=torch.float16)
    out = flashgen.flash_attn_qkvpacked_func(qkv, causal=causal)
    q, k, v = qkv.unbind(2)
    ref, _ = attention_ref(q, k, v, causal)
    ref_lowp, _ = attention_ref(q, k, v, causal, upcast=False)
    assert_close_to_ref(out, ref, ref_lowp)
    kv = torch.randn(2, 150, 2, 2, 64, device="cuda", dtype=torch.float16)
    q2 = torch.randn(2, 90, 4, 64, device="cuda", dtype=torch.float16)
    out2 = flashgen.flash_attn_kvpacked_func(q2, kv, causal=causal)
    ref2, _ = attention_ref(q2, kv[:, :, 0], kv[:, :, 1], causal)
    ref2_lowp, _ = attention_ref(q2, kv[:, :, 0], kv[:, :, 1], causal, upcast=False)
    assert_close_to_ref(out2, ref2, ref2_lowp)


def test_fwd_noncontiguous_strides():
    """A transposed-layout input (last dim contiguous) runs on its strides, no copy needed."""
    import flashgen
    base = torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16)   # (b, h, s, d) storage
    q = base.transpose(1, 2)                                                     # (b, s, h, d) view
    k = torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    out = flashgen.flash_attn_func(q, k, v)
    ref, _ = attention_ref(q, k, v)
    ref_lowp, _ = attention_ref(q, k, v, upcast=False)
    assert_close_to_ref(out, ref, ref_lowp)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("hdim", [64, 128, 72])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fwd_varlen(dtype, hdim, causal):
    import flashgen
    lens_q = [17, 0, 113, 1, 256, 300]
    lens_k = [33, 5, 113, 0, 256, 129]
    h, hk = 4, 2
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, hdim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hk, hdim, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hk, hdim, device="cuda", dtype=dtype)
    poison_allocator(((sum(lens_q), h, hdim), dtype), ((h, sum(lens_q)), torch.float32))
    out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                  return_attn_probs=True)
    assert lse.shape == (h, sum(lens_q))
    for i in range(len(lens_q)):
        sq0, sq1, sk0, sk1 = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if sq1 == sq0:
            continue
        qi, ki, vi = q[None, sq0:sq1], k[None, sk0:sk1], v[None, sk0:sk1]
        ref, lse_ref = attention_ref(qi, ki, vi, causal)
        ref_lowp, _ = attention_ref(qi, ki, vi, causal, upcast=False)
        assert_close_to_ref(out[None, sq0:sq1], ref, ref_lowp, name=f"seq {i}")
        torch.testing.assert_close(lse[:, sq0:sq1], lse_ref[0], atol=2e-3, rtol=2e-3)


def test_fwd_fully_masked_rows_are_zero():
    """Causal with seqlen_q > seqlen_k: the first rows see no key -> 0 output, lse -inf, no NaN."""
    q = torch.randn(1, 200, 2, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 50, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 50, 2, 64, device="cuda", dtype=torch.float16)
    out, lse = _run(q, k, v, True)
    assert torch.all(out[:, :150] == 0)
    assert torch.all(lse[:, :, :150] == float("-inf"))
    _check(q, k, v, True)


def test_fwd_current_stream():
    import flashgen
    q, k, v = (torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = flashgen.flash_attn_func(q, k, v)
    s.synchronize()
    ref, _ = attention_ref(q, k, v)
    ref_lowp, _ = attention_ref(q, k, v, upcast=False)
    assert_close_to_ref(out, ref, ref_lowp)


@pytest.mark.parametrize("hdim", [128, 256])
def test_fwd_persistent_walks_many_tiles(sm80_path, hdim):
    """More tiles than the GPU holds CTAs, so each resident CTA walks several (and loads each next tile's start
    under the current one's epilogue); odd lengths leave partial last tiles."""
    from flashgen import dispatch
    q = torch.randn(3, 1500, 40, hdim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 1111, 40, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kernel = dispatch.fwd_kernel(0, q.dtype, hdim, False, seqlen_q=1500, seqlen_k=1111)
    assert kernel.traits.persistent == sm80_path
    if sm80_path:
        assert 3 * 40 * -(-1500 // kernel.traits.block_m) > 2 * kernel.resident_ctas(0)
    _check(q, k, v, False)
