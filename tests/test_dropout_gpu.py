"""Dropout on the GPU: the Philox mask against its NumPy definition, the keep rate, output and gradients against
a reference that applies the mask recovered from S_dmask (2x / 3x PyTorch's same-dtype error), reproducibility
with torch seeds, and CUDA-graph replays drawing fresh masks."""
import pytest
import torch

from tests.attn_ref import assert_close_to_ref, poison_allocator
from tests.dropout_ref import attention_dropout_ref, keep_mask

pytestmark = pytest.mark.gpu

P = 0.17
SCHEDULES = ["fused", "split"]
CONFIGS = [(torch.bfloat16, h) for h in (32, 64, 72, 128, 256)] + [(torch.float16, 64), (torch.float16, 128)]
SEQLENS = [(1, 1), (113, 203), (128, 217), (239, 1), (17, 17), (1023, 1024)]


def _keep_from_s_dmask(s_dmask, sq, sk):
    return s_dmask[:, :, :sq, :sk] >= 0


def _grads_ref(q, k, v, dout, keep, p, causal, upcast):
    leaves = [t.detach().float() if upcast else t.detach() for t in (q, k, v)]
    for t in leaves:
        t.requires_grad_(True)
    out = attention_dropout_ref(*leaves, keep, p, causal=causal, upcast=upcast)
    out.backward(dout.float() if upcast else dout)
    return out.detach(), tuple(t.grad for t in leaves)


def _flash_formula_dq_dk(q, k, v, dout, out, keep, p, causal):
    """dq, dk computed the way the FlashAttention backward computes them from input-dtype tensors (fp32
    arithmetic): D = rowsum(dO * O) from the rounded output O, dS = P * (Z * rp * dO V^T - D). PyTorch's
    autograd cancels the softmax gradient exactly where a row sees one key (dS = 0); this formula cannot,
    because with dropout O = rp * V is rounded to the input dtype before D is formed. flashgen (like
    flash-attn) computes exactly this, so the dq/dk baseline is the larger error of the two computations."""
    from flashgen.interface import dropout_keep_scale
    from tests.attn_ref import masked_scores, softmax_rows
    h, hk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = d ** -0.5
    q, k, v, dout, out = (t.float() for t in (q, k, v, dout, out))
    scores, kk = masked_scores(q, k, causal, scale)
    vv = v.repeat_interleave(h // hk, dim=2)
    prob = softmax_rows(scores)
    dp = torch.einsum("bthd,bshd->bhts", dout, vv) * keep * dropout_keep_scale(p)
    dsum = (dout * out).sum(-1).transpose(1, 2).unsqueeze(-1)
    ds = prob * (dp - dsum)
    dq = torch.einsum("bhts,bshd->bthd", ds, kk) * scale
    dk = (torch.einsum("bhts,bthd->bshd", ds, q) * scale).unflatten(2, (hk, h // hk)).sum(3)
    return dq, dk


def _check_against_ref(q, k, v, causal, schedule, p=P, **kw):
    """Forward with return_attn_probs, backward, both checked against the reference with S_dmask's mask."""
    import flashgen
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    poison_allocator((tuple(q.shape), q.dtype))
    out, lse, s_dmask = flashgen.flash_attn_func(*leaves, dropout_p=p, causal=causal, return_attn_probs=True,
                                                 backward_impl=schedule, **kw)
    sq, sk = q.shape[1], k.shape[1]
    assert s_dmask.shape == (q.shape[0], q.shape[2], -(-sq // 128) * 128, -(-sk // 128) * 128)
    keep = _keep_from_s_dmask(s_dmask, sq, sk)
    dout = torch.randn_like(q)
    poison_allocator(*[(tuple(t.shape), t.dtype) for t in (q, k, v)])
    out.backward(dout)
    ref, gref = _grads_ref(q, k, v, dout, keep, p, causal, upcast=True)
    low, glow = _grads_ref(q, k, v, dout, keep, p, causal, upcast=False)
    assert_close_to_ref(out, ref, low)
    _check_grads((t.grad for t in leaves), gref, glow,
                 [_flash_formula_dq_dk(q, k, v, dout, o, keep, p, causal) for o in (low, out.detach())])
    return keep


def _check_grads(grads, gref, glow, formulas, prefix=""):
    """3x rule per gradient; dq and dk take the largest of the same-dtype errors: autograd's and each of
    `formulas` (_flash_formula_dq_dk with D formed from PyTorch's rounded output and from flashgen's own: with one
    key the two outputs round the dropout scale differently, and D carries that rounding step into dq)."""
    for i, (name, g, r, lo) in enumerate(zip(("dq", "dk", "dv"), grads, gref, glow)):
        assert g.shape == r.shape and g.dtype == lo.dtype, f"{prefix}{name}: {g.shape} {g.dtype}"
        assert not torch.isnan(g).any(), f"{prefix}{name} has NaN"
        for formula in formulas if i < 2 else ():
            if (formula[i] - r).abs().max() > (lo.float() - r).abs().max():
                lo = formula[i]
        assert_close_to_ref(g, r, lo, name=prefix + name, factor=3.0, atol=1e-4)


def _qkv(batch, sq, sk, h, hk, d, dtype=torch.bfloat16):
    return (torch.randn(batch, sq, h, d, device="cuda", dtype=dtype),
            torch.randn(batch, sk, hk, d, device="cuda", dtype=dtype),
            torch.randn(batch, sk, hk, d, device="cuda", dtype=dtype))


def test_mask_kernel_matches_definition():
    from flashgen.interface import dropout_mask
    rng = torch.tensor([0x1234_5678_9ABC_DEF1, 0x0FED_CBA9_8765_4321], dtype=torch.int64, device="cuda")
    seed, offset = (int(x) & (2**64 - 1) for x in rng.tolist())
    b, h, sq, sk = 2, 3, 77, 133
    got = dropout_mask(rng, P, b, h, sq, sk).cpu().numpy()
    for bh in range(b * h):
        want = keep_mask(seed, offset, P, bh, sq, sk)
        assert (got[bh // h, bh % h] == want).all(), f"mask of (batch, head) {divmod(bh, h)} differs"


@pytest.mark.parametrize("p", [0.1, 0.17, 0.5, 0.9])
def test_keep_rate(p):
    """Within 0.5% (relative) of 1 - p for the usual rates, and of 1 - threshold / 256 (the kernels' byte
    granularity) for every rate."""
    import flashgen
    from flashgen.interface import dropout_threshold
    q, k, v = _qkv(4, 1024, 1024, 8, 8, 64)
    _, _, s_dmask = flashgen.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    rate = (s_dmask >= 0).float().mean().item()
    exact = 1 - dropout_threshold(p) / 256
    assert abs(rate - exact) <= 0.005 * exact, f"keep rate {rate:.5f}, expected {exact:.5f}"
    if p <= 0.5:
        assert abs(rate - (1 - p)) <= 0.005 * (1 - p), f"keep rate {rate:.5f}, expected {1 - p:.5f}"


@pytest.fixture(params=["fwd_default", "fwd_sm80"])
def fwd_path(request, monkeypatch):
    """The forward dispatch picks (the Hopper one on sm_90a) and the SM80 one (FLASHGEN_HOPPER=0): both draw the
    mask the backward regenerates (on sm_90a the Hopper backward kernels of either schedule)."""
    from codegen import heuristics
    from flashgen import dispatch
    if request.param == "fwd_sm80":
        monkeypatch.setenv("FLASHGEN_HOPPER", "0")
    else:   # the Hopper forward on short sequences too
        monkeypatch.setattr(heuristics, "FWD_SM90_SHORT_SEQLEN", {})
    dispatch._fwd_kernel.cache_clear()
    yield request.param
    dispatch._fwd_kernel.cache_clear()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dropout_grid(config, causal, seqlens, schedule, fwd_path):
    dtype, hdim = config
    sq, sk = seqlens
    batch, nheads = (2, 3) if sq * sk < 1_000_000 else (1, 2)
    _check_against_ref(*_qkv(batch, sq, sk, nheads, nheads, hdim, dtype), causal, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_gqa(causal, schedule):
    _check_against_ref(*_qkv(2, 257, 311, 8, 2, 128), causal, schedule)


def test_s_dmask_sign_is_the_kernel_mask():
    import flashgen
    from flashgen.interface import dropout_mask
    q, k, v = _qkv(2, 200, 300, 4, 4, 64)
    torch.manual_seed(5)
    _, _, s_dmask = flashgen.flash_attn_func(q, k, v, dropout_p=P, return_attn_probs=True)
    torch.manual_seed(5)
    rng = torch.empty(2, dtype=torch.int64, device="cuda").random_()
    keep = dropout_mask(rng, P, 2, 4, 200, 300)
    s = s_dmask[:, :, :200, :300]
    assert (s[s != 0] > 0).eq(keep[s != 0]).all()
    assert (s_dmask[:, :, 200:] == 0).all() and (s_dmask[:, :, :, 300:] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_varlen(causal):
    """Per sequence against the reference (empty sequences included), forward and gradients."""
    import flashgen
    lens_q, lens_k = [37, 0, 128, 211], [50, 9, 0, 300]
    h, hk, d = 4, 2, 64
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse, s_dmask = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=P,
                                                        causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        if lq == 0:
            continue
        if lk == 0:
            assert (out[qs] == 0).all() and (q.grad[qs] == 0).all()
            continue
        keep = s_dmask[b:b + 1, :, :lq, :lk] >= 0
        qb, kb, vb = (t.detach()[s].unsqueeze(0) for t, s in ((q, qs), (k, ks), (v, ks)))
        ref, gref = _grads_ref(qb, kb, vb, dout[qs].unsqueeze(0), keep, P, causal, upcast=True)
        low, glow = _grads_ref(qb, kb, vb, dout[qs].unsqueeze(0), keep, P, causal, upcast=False)
        assert_close_to_ref(out[qs].unsqueeze(0), ref, low, name=f"seq{b} out")
        formulas = [_flash_formula_dq_dk(qb, kb, vb, dout[qs].unsqueeze(0), o, keep, P, causal)
                    for o in (low, out[qs].detach().unsqueeze(0))]
        _check_grads((g.unsqueeze(0) for g in (q.grad[qs], k.grad[ks], v.grad[ks])), gref, glow, formulas,
                     prefix=f"seq{b} ")


def test_same_seed_same_result_next_call_differs():
    import flashgen
    q, k, v = _qkv(2, 300, 300, 4, 4, 128)
    torch.manual_seed(1234)
    a = flashgen.flash_attn_func(q, k, v, dropout_p=P)
    b = flashgen.flash_attn_func(q, k, v, dropout_p=P)
    torch.manual_seed(1234)
    a2 = flashgen.flash_attn_func(q, k, v, dropout_p=P)
    assert torch.equal(a, a2), "same torch seed must give the bitwise-same output"
    assert not torch.equal(a, b), "consecutive calls must draw different masks"
    g1, g2 = torch.Generator(device="cuda"), torch.Generator(device="cuda")
    g1.manual_seed(7), g2.manual_seed(7)
    assert torch.equal(flashgen.flash_attn_func(q, k, v, dropout_p=P, generator=g1),
                       flashgen.flash_attn_func(q, k, v, dropout_p=P, generator=g2))


def test_deterministic_backward_with_dropout_is_bitwise():
    import flashgen
    q, k, v = _qkv(2, 333, 444, 4, 4, 64)
    dout = torch.randn_like(q)
    grads = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(99)
        flashgen.flash_attn_func(*leaves, dropout_p=P, causal=True, deterministic=True).backward(dout)
        grads.append([t.grad for t in leaves])
    for g in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], g))


def test_cuda_graph_replays_draw_fresh_masks():
    import flashgen
    q, k, v = _qkv(2, 256, 256, 4, 4, 64)
    flashgen.flash_attn_func(q, k, v, dropout_p=P, return_attn_probs=True)   # warm-up: compiles and loads
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flashgen.flash_attn_func(q, k, v, dropout_p=P, return_attn_probs=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, s_dmask = flashgen.flash_attn_func(q, k, v, dropout_p=P, return_attn_probs=True)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), s_dmask.clone()))
    assert not torch.equal(results[0][1] >= 0, results[1][1] >= 0), "replays must draw different masks"
    for o, sd in results:
        keep = sd[:, :, :256, :256] >= 0
        ref = attention_dropout_ref(q, k, v, keep, P)
        low = attention_dropout_ref(q, k, v, keep, P, upcast=False)
        assert_close_to_ref(o, ref, low)


def test_custom_ops_dropout_eager_and_compiled():
    """flashgen.ops with dropout: the same mask as the public API under the same seed, correct against the
    reference with the mask kernel's mask, and torch.compile(fullgraph=True) equal to eager for a given rng state."""
    import flashgen
    import flashgen.ops as fops
    from flashgen.interface import dropout_mask
    q, k, v = _qkv(2, 200, 300, 4, 2, 64)
    torch.manual_seed(3)
    a = fops.attention(q, k, v, causal=True, dropout_p=P)
    torch.manual_seed(3)
    assert torch.equal(a, flashgen.flash_attn_func(q, k, v, causal=True, dropout_p=P))

    rng = torch.tensor([0x0123_4567_89AB_CDEF, 42], dtype=torch.int64, device="cuda")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fops.attention(*leaves, causal=True, dropout_p=P, rng_state=rng)
    keep = dropout_mask(rng, P, 2, 4, 200, 300)
    assert_close_to_ref(out, attention_dropout_ref(q, k, v, keep, P, causal=True),
                        attention_dropout_ref(q, k, v, keep, P, causal=True, upcast=False))
    dout = torch.randn_like(out)
    out.backward(dout)
    _, gref = _grads_ref(q, k, v, dout, keep, P, True, upcast=True)
    low, glow = _grads_ref(q, k, v, dout, keep, P, True, upcast=False)
    _check_grads([t.grad for t in leaves], gref, glow,
                 [_flash_formula_dq_dk(q, k, v, dout, o, keep, P, True) for o in (low, out.detach())])

    f = torch.compile(lambda q, k, v: fops.attention(q, k, v, causal=True, dropout_p=P, rng_state=rng),
                      fullgraph=True)
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out2 = f(*leaves2)
    out2.backward(dout)
    assert torch.equal(out, out2)
    for x, y in zip(leaves, leaves2):   # the fused backward adds dQ with atomics: equal up to rounding order
        torch.testing.assert_close(x.grad, y.grad, atol=2e-2, rtol=2e-2)
