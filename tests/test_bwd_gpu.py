"""Backward attention on the GPU: both schedules against the fp32 reference (3x PyTorch's same-dtype error)."""
import pytest
import torch

from tests.attn_ref import assert_grads_close, poison_allocator

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def sm80_backward(monkeypatch):
    """These tests are the SM80 kernels' (every GPU's); tests/test_hopper_bwd_gpu.py runs them on the Hopper one."""
    monkeypatch.setenv("FLASHGEN_HOPPER_BWD", "0")

SCHEDULES = ["fused", "split"]
# bf16 over every bucket (and a padded head dim); fp16 on the two most used buckets.
CONFIGS = [(torch.bfloat16, h) for h in (32, 64, 72, 96, 128, 160, 192, 224, 256)] + \
          [(torch.float16, 64), (torch.float16, 128)]
SEQLENS = [(1, 1), (1, 239), (113, 203), (128, 217), (239, 1), (17, 17), (1023, 1024), (2048, 2048), (113, 1023)]


def _poison_grads(*tensors):
    poison_allocator(*[(tuple(t.shape), t.dtype) for t in tensors])


def _fwd_bwd(fn, inputs, dout, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves, **kw)
    _poison_grads(*inputs)
    out.backward(dout)
    return out, tuple(t.grad for t in leaves)


def _check(q, k, v, causal, schedule, **kw):
    import flashgen
    dout = torch.randn_like(q)
    _, grads = _fwd_bwd(flashgen.flash_attn_func, (q, k, v), dout, causal=causal, backward_impl=schedule, **kw)
    assert_grads_close(grads, q, k, v, dout, causal, kw.get("softmax_scale"))
    return grads


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bwd_grid(config, causal, seqlens, schedule):
    dtype, hdim = config
    sq, sk = seqlens
    batch, nheads = (2, 3) if sq * sk < 1_000_000 else (1, 2)
    q = torch.randn(batch, sq, nheads, hdim, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, nheads, hdim, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, nheads, hdim, device="cuda", dtype=dtype)
    _check(q, k, v, causal, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 3)], ids=["mqa", "gqa4", "gqa2"])
def test_bwd_gqa(causal, heads, schedule):
    h, hk = heads
    q = torch.randn(2, 257, h, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 311, hk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 311, hk, 128, device="cuda", dtype=torch.bfloat16)
    _check(q, k, v, causal, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bwd_scale_many_heads_batch1(schedule):
    q, k, v = (torch.randn(1, 77, 48, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _check(q, k, v, True, schedule, softmax_scale=0.3)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("hdim", [64, 128, 72])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_varlen(hdim, causal, schedule):
    import flashgen
    dtype = torch.bfloat16
    lens_q = [17, 0, 113, 1, 256, 300]
    lens_k = [33, 5, 113, 0, 256, 129]
    h, hk = 4, 2
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, hdim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hk, hdim, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hk, hdim, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    _, (dq, dk, dv) = _fwd_bwd(flashgen.flash_attn_varlen_func, (q, k, v), dout, cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal,
                               backward_impl=schedule)
    for i in range(len(lens_q)):
        sq0, sq1, sk0, sk1 = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if sq1 == sq0:   # no query: no gradient reaches this sequence's keys
            assert torch.all(dk[sk0:sk1] == 0) and torch.all(dv[sk0:sk1] == 0)
            continue
        if sk1 == sk0:   # no key: the output is 0 whatever q is
            assert torch.all(dq[sq0:sq1] == 0)
            continue
        assert_grads_close((dq[None, sq0:sq1], dk[None, sk0:sk1], dv[None, sk0:sk1]), q[None, sq0:sq1],
                           k[None, sk0:sk1], v[None, sk0:sk1], dout[None, sq0:sq1], causal, name=f"seq {i} ")


def test_bwd_packed_gradients():
    import flashgen
    qkv = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    _, (dqkv,) = _fwd_bwd(flashgen.flash_attn_qkvpacked_func, (qkv,), dout, causal=True)
    assert dqkv.shape == qkv.shape
    q, k, v = qkv.unbind(2)
    assert_grads_close(dqkv.unbind(2), q, k, v, dout, True)
    q = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 300, 2, 2, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    _, (dq, dkv) = _fwd_bwd(flashgen.flash_attn_kvpacked_func, (q, kv), dout)
    assert dkv.shape == kv.shape
    assert_grads_close((dq, *dkv.unbind(2)), q, *kv.unbind(2), dout)


def test_bwd_varlen_qkvpacked():
    import flashgen
    lens = [100, 0, 37]
    cu = torch.tensor([0, 100, 100, 137], dtype=torch.int32, device="cuda")
    qkv = torch.randn(sum(lens), 3, 2, 64, device="cuda", dtype=torch.float16)
    dout = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.float16)
    _, (dqkv,) = _fwd_bwd(flashgen.flash_attn_varlen_qkvpacked_func, (qkv,), dout, cu_seqlens=cu, max_seqlen=100,
                          causal=True)
    assert dqkv.shape == qkv.shape
    for a, b in ((0, 100), (100, 137)):
        s = qkv[None, a:b]
        assert_grads_close(dqkv[None, a:b].unbind(2), *s.unbind(2), dout[None, a:b], True)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bwd_fully_masked_rows(schedule):
    """Causal with seqlen_q > seqlen_k: the first rows see no key -> zero dq there, never NaN."""
    q = torch.randn(1, 200, 2, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 50, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 50, 2, 64, device="cuda", dtype=torch.float16)
    dq, dk, dv = _check(q, k, v, True, schedule)
    assert torch.all(dq[:, :150] == 0)
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


@pytest.mark.parametrize("impl", ["split", "fused"])
def test_bwd_deterministic_is_bitwise(impl):
    """deterministic=True runs the split schedule (no atomics) whatever backward_impl says."""
    import flashgen
    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    runs = [_fwd_bwd(flashgen.flash_attn_func, (q, k, v), dout, causal=True, deterministic=True,
                     backward_impl=impl)[1] for _ in range(5)]
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            assert torch.equal(a, b)
    assert_grads_close(runs[0], q, k, v, dout, True)


def test_bwd_finite_difference_spot_check():
    """Central difference of f(q) = sum(out * g) along a random direction vs <dq, step>. The step is taken
    between two fp16-representable points, so only the forward's output rounding is noise."""
    import flashgen
    q, k, v = (torch.randn(1, 9, 1, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    g = torch.randn_like(q)
    direction = torch.randn_like(q, dtype=torch.float32)
    _, (dq, _, _) = _fwd_bwd(flashgen.flash_attn_func, (q, k, v), g)
    q_plus, q_minus = (q.float() + 0.05 * direction).half(), (q.float() - 0.05 * direction).half()

    def f(x):
        return (flashgen.flash_attn_func(x, k, v).float() * g.float()).sum().item()

    diff = f(q_plus) - f(q_minus)
    predicted = (dq.float() * (q_plus.float() - q_minus.float())).sum().item()
    assert abs(diff - predicted) <= 0.03 * abs(predicted) + 0.01, (diff, predicted)


def test_bwd_rejects_bad_backward_impl():
    import flashgen
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="backward_impl"):
        flashgen.flash_attn_func(q, q, q, backward_impl="fast")
