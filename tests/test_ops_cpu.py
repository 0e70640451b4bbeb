"""torch integration without a GPU: lazy submodules, the flashgen:: custom ops (schemas, fake implementations,
autograd wiring, torch.compile tracing, argument order into interface.py), and flashgen.modules' tensor
plumbing with a CPU reference standing in for the kernels.

Fake CUDA tensors (FakeTensorMode) check metadata; meta tensors run autograd and torch.compile, which fake
CUDA tensors cannot do on a CPU-only torch build. torch.library.opcheck needs real CUDA: it is in
test_integration_gpu.py.
"""
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import flashgen
from flashgen import interface, modules, ops
from tests.attn_ref import attention_ref
from tests.conftest import ROOT


def test_import_flashgen_stays_light_and_submodules_load_lazily():
    code = ("import sys, flashgen; assert 'torch' not in sys.modules, 'import flashgen imported torch'; "
            "assert flashgen.bert_padding.unpad_input and flashgen.modules.MHA and flashgen.ops.attention; "
            "import torch; assert torch.ops.flashgen.fwd.default")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with pytest.raises(AttributeError):
        flashgen.not_a_submodule


def test_schemas():
    schemas = {name: str(getattr(torch.ops.flashgen, name).default._schema)
               for name in ("fwd", "varlen_fwd", "bwd", "varlen_bwd")}
    drop = "float dropout_p=0., Tensor? rng_state=None"
    assert schemas["fwd"] == ("flashgen::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
                              f"{drop}) -> (Tensor, Tensor)")
    assert schemas["varlen_fwd"] == (
        "flashgen::varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        f"SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, {drop}) -> (Tensor, Tensor)")
    assert schemas["bwd"] == ("flashgen::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                              f"float softmax_scale, bool causal, {drop}) -> (Tensor, Tensor, Tensor)")
    assert schemas["varlen_bwd"] == (
        "flashgen::varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
        f"float softmax_scale, bool causal, {drop}) -> (Tensor, Tensor, Tensor)")


# ----------------------------------------------------------------------------------------------------
# fake implementations on fake CUDA tensors


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def _contig_strides(shape):
    return torch.empty(shape, device="meta").stride()


def _assert_meta(t, shape, dtype):
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cuda"
    assert t.stride() == _contig_strides(shape), f"strides {t.stride()} are not contiguous for {shape}"


@pytest.mark.parametrize("layout", ["packed", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fwd_fake(fake, dtype, layout):
    # q strided: a slice of packed qkv, or a dense (b, h, s, d) tensor seen as (b, s, h, d), which empty_like
    # would copy the strides of; k/v with fewer heads (GQA) and another seqlen. (Python indexing of fake
    # CUDA tensors fails on a CPU-only torch build: select / narrow / transpose work.)
    if layout == "packed":
        q = torch.empty(2, 33, 3, 8, 64, device="cuda", dtype=dtype).select(2, 0)
    else:
        q = torch.empty(2, 8, 33, 64, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.empty(2, 47, 2, 64, device="cuda", dtype=dtype)
    v = torch.empty_like(k)
    out, lse = torch.ops.flashgen.fwd(q, k, v, 0.125, True)
    _assert_meta(out, (2, 33, 8, 64), dtype)
    _assert_meta(lse, (2, 8, 33), torch.float32)


def test_varlen_fwd_fake(fake):
    q = torch.empty(100, 3, 4, 128, device="cuda", dtype=torch.bfloat16).select(1, 0)
    k = torch.empty(80, 2, 128, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.empty(4, device="cuda", dtype=torch.int32)
    cu_k = torch.empty(4, device="cuda", dtype=torch.int32)
    out, lse = torch.ops.flashgen.varlen_fwd(q, k, k, cu_q, cu_k, 50, 40, 0.1, False)
    _assert_meta(out, (100, 4, 128), torch.bfloat16)
    _assert_meta(lse, (4, 100), torch.float32)


def test_bwd_fakes(fake):
    dt = torch.float16
    q = torch.empty(2, 8, 33, 64, device="cuda", dtype=dt).transpose(1, 2)
    k, v = torch.empty(2, 47, 2, 2, 64, device="cuda", dtype=dt).unbind(2)
    out = torch.empty(2, 33, 8, 64, device="cuda", dtype=dt)
    lse = torch.empty(2, 8, 33, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.ops.flashgen.bwd(out, q, k, v, out, lse, 0.125, False)
    _assert_meta(dq, (2, 33, 8, 64), dt)
    _assert_meta(dk, (2, 47, 2, 64), dt)
    _assert_meta(dv, (2, 47, 2, 64), dt)

    qv, kv_ = torch.empty(90, 8, 64, device="cuda", dtype=dt), torch.empty(70, 2, 2, 64, device="cuda", dtype=dt)
    cu = torch.empty(3, device="cuda", dtype=torch.int32)
    dq, dk, dv = torch.ops.flashgen.varlen_bwd(qv, qv, *kv_.unbind(1), qv,
                                               torch.empty(8, 90, device="cuda"), cu, cu, 60, 50, 0.125, True)
    _assert_meta(dq, (90, 8, 64), dt)
    _assert_meta(dk, (70, 2, 64), dt)
    _assert_meta(dv, (70, 2, 64), dt)


class _Recorder(TorchDispatchMode):
    """Logs the flashgen ops called and their arguments, then lets the (fake) op run."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "flashgen":
            self.calls.append((func.__name__, args))
        return func(*args, **(kwargs or {}))


def test_checked_entry_points(fake):
    q = torch.empty(2, 16, 4, 96, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(2, 24, 2, 96, device="cuda", dtype=torch.bfloat16)
    with _Recorder() as rec:
        out = ops.attention(q, k, k, causal=True)
        q0, k0 = q.select(0, 0), k.select(0, 0)
        out2 = ops.varlen_attention(q0, k0, k0, torch.empty(3, device="cuda", dtype=torch.int32),
                                    torch.empty(3, device="cuda", dtype=torch.int32), 8, 12, softmax_scale=0.5)
    assert out.shape == q.shape and out2.shape == q0.shape
    (name, args), (name2, args2) = rec.calls
    assert name == "fwd.default" and args[3:] == (96 ** -0.5, True)   # default scale 1 / sqrt(headdim)
    assert name2 == "varlen_fwd.default" and args2[5:] == (8, 12, 0.5, False)

    with pytest.raises(TypeError, match="q must be torch.float16 or torch.bfloat16"):
        ops.attention(q.float(), k, k)
    with pytest.raises(ValueError, match="head dim"):
        ops.attention(q.narrow(-1, 0, 90), k.narrow(-1, 0, 90), k.narrow(-1, 0, 90))
    k3 = k.narrow(2, 0, 1).expand(2, 24, 3, 96)
    with pytest.raises(ValueError, match="multiple of nheads of k/v"):
        ops.attention(q, k3, k3)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32"):
        ops.varlen_attention(q0, k0, k0, torch.empty(3, device="cuda", dtype=torch.int64),
                             torch.empty(3, device="cuda", dtype=torch.int32), 8, 12)


def test_cpu_tensors_are_rejected_by_the_ops():
    """CUDA-only ops: a CPU tensor reaches no kernel launch (the dispatcher has no CPU implementation)."""
    q = torch.zeros(1, 4, 1, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError):
        torch.ops.flashgen.fwd(q, q, q, 0.125, False)


# ----------------------------------------------------------------------------------------------------
# op bodies call interface.py with its argument order


def test_op_bodies_forward_arguments_in_order(monkeypatch):
    seen = {}

    def record(name, result):
        def fn(*args):
            seen[name] = args
            return result
        return fn

    t = [torch.full((1,), float(i)) for i in range(8)]
    monkeypatch.setattr(interface, "_flash_attn_forward", record("fwd", (t[0], t[1])), raising=False)
    monkeypatch.setattr(interface, "_flash_attn_varlen_forward", record("varlen_fwd", (t[0], t[1])), raising=False)
    # The backward may return more than (dq, dk, dv), as flash-attn's does: extras are dropped.
    monkeypatch.setattr(interface, "_flash_attn_backward", record("bwd", (t[0], t[1], t[2], t[3])), raising=False)
    monkeypatch.setattr(interface, "_flash_attn_varlen_backward", record("varlen_bwd", (t[0], t[1], t[2])),
                        raising=False)
    rng = t[7]
    assert ops._fwd_impl(t[0], t[1], t[2], 0.5, True) == (t[0], t[1])
    assert seen["fwd"] == (t[0], t[1], t[2], 0.5, True, 0.0, None)
    ops._fwd_impl(t[0], t[1], t[2], 0.5, True, 0.1, rng)
    assert seen["fwd"] == (t[0], t[1], t[2], 0.5, True, 0.1, rng)
    ops._varlen_fwd_impl(t[0], t[1], t[2], t[3], t[4], 7, 9, 0.5, False, 0.2, rng)
    assert seen["varlen_fwd"] == (t[0], t[1], t[2], t[3], t[4], 7, 9, 0.5, False, 0.2, rng)
    assert ops._bwd_impl(*t[:6], 0.25, True, 0.1, rng) == (t[0], t[1], t[2])
    assert seen["bwd"] == (*t[:6], 0.25, True, "auto", False, 0.1, rng)
    assert ops._varlen_bwd_impl(*t[:8], 5, 6, 0.25, False) == (t[0], t[1], t[2])
    assert seen["varlen_bwd"] == (*t[:8], 5, 6, 0.25, False, "auto", False, 0.0, None)


# ----------------------------------------------------------------------------------------------------
# autograd and torch.compile on meta tensors (the fake implementations stand in for the kernels)


def _meta(*shape, grad=True):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16, requires_grad=grad)


def test_autograd_shapes_meta():
    q, k, v = _meta(2, 16, 4, 64), _meta(2, 24, 2, 64), _meta(2, 24, 2, 64)
    out, lse = torch.ops.flashgen.fwd(q, k, v, 0.125, True)
    (out.float().sum() + lse.sum()).backward()   # lse's gradient is ignored, not an error
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)

    q, kv = _meta(40, 4, 64), _meta(30, 2, 2, 64)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    out, _ = torch.ops.flashgen.varlen_fwd(q, kv[:, 0], kv[:, 1], cu, cu, 20, 15, 0.125, False)
    out.sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape


def test_autograd_passes_dropout_to_the_backward_op(monkeypatch):
    """The forward op's dropout_p and rng state reach the backward op (the same mask is regenerated)."""
    calls = []
    monkeypatch.setattr(torch.ops.flashgen, "bwd", lambda *args: calls.append(args) or args[1:4])

    class Ctx:
        def save_for_backward(self, *tensors):
            self.saved_tensors = tensors

    q, k, v = _meta(2, 16, 4, 64), _meta(2, 24, 2, 64), _meta(2, 24, 2, 64)
    out, lse = _meta(2, 16, 4, 64), torch.empty(2, 4, 16, device="meta")
    rng = torch.empty(2, device="meta", dtype=torch.int64)
    for dropout_p, rng_state in ((0.25, rng), (0.0, None)):
        ctx = Ctx()
        ops._fwd_setup_context(ctx, (q, k, v, 0.125, True, dropout_p, rng_state), (out, lse))
        grads = ops._fwd_backward(ctx, out, None)
        assert len(grads) == 7 and grads[3:] == (None,) * 4
        assert calls[-1][6:8] == (0.125, True) and calls[-1][8] == dropout_p
        assert calls[-1][9] is rng_state


def _capture_backend(graphs):
    """An aot_autograd backend that records the forward and backward graphs and runs them as they are."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.setdefault(kind, []).append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim=128, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, device="meta", dtype=torch.bfloat16)

    def forward(self, x, cu_seqlens=None, max_seqlen=None):
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, -1))
        if cu_seqlens is None:
            out, _ = torch.ops.flashgen.fwd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], 0.125, True)
        else:
            out, _ = torch.ops.flashgen.varlen_fwd(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                                   max_seqlen, max_seqlen, 0.125, True)
        return out.flatten(-2)


def _ops_in(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "flashgen" in str(n.target)}


def test_compile_fullgraph_traces_ops_meta():
    """fullgraph=True raises on any graph break; the forward graph holds fwd, the backward graph bwd."""
    torch._dynamo.reset()
    graphs = {}
    model = _TinyAttention()
    compiled = torch.compile(model, fullgraph=True, backend=_capture_backend(graphs))
    x = _meta(2, 16, 128)
    compiled(x).sum().backward()
    assert _ops_in(graphs["fw"][-1]) == {"flashgen.fwd.default"}
    assert _ops_in(graphs["bw"][-1]) == {"flashgen.bwd.default"}
    assert model.qkv.weight.grad.shape == model.qkv.weight.shape

    graphs.clear()
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    compiled(_meta(40, 128), cu, 24).sum().backward()
    assert _ops_in(graphs["fw"][-1]) == {"flashgen.varlen_fwd.default"}
    assert _ops_in(graphs["bw"][-1]) == {"flashgen.varlen_bwd.default"}
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------
# flashgen.modules with a CPU reference in place of the kernels (checks reshapes, packing and options)


def _ref_varlen(q, k, v, cu_q, cu_k, causal, scale):
    out = torch.zeros_like(q)
    for i in range(cu_q.numel() - 1):
        (sq, eq), (sk, ek) = cu_q[i:i + 2].tolist(), cu_k[i:i + 2].tolist()
        if eq > sq:
            out[sq:eq] = attention_ref(q[None, sq:eq], k[None, sk:ek], v[None, sk:ek], causal, scale)[0][0]
    return out


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Replaces the four packed API functions that the modules call with fp32 CPU references; returns
    the list of option dicts they were called with."""
    calls = []

    def opts(kw):
        calls.append(kw)
        return kw["causal"], kw["softmax_scale"]

    def qkvpacked(qkv, **kw):
        return attention_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *opts(kw))[0]

    def kvpacked(q, kv, **kw):
        return attention_ref(q, kv[:, :, 0], kv[:, :, 1], *opts(kw))[0]

    def varlen_qkvpacked(qkv, cu, max_seqlen, **kw):
        return _ref_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, *opts(kw))

    def varlen_kvpacked(q, kv, cu_q, cu_k, max_q, max_k, **kw):
        return _ref_varlen(q, kv[:, 0], kv[:, 1], cu_q, cu_k, *opts(kw))

    monkeypatch.setattr(interface, "flash_attn_qkvpacked_func", qkvpacked)
    monkeypatch.setattr(interface, "flash_attn_kvpacked_func", kvpacked)
    monkeypatch.setattr(interface, "flash_attn_varlen_qkvpacked_func", varlen_qkvpacked)
    monkeypatch.setattr(interface, "flash_attn_varlen_kvpacked_func", varlen_kvpacked)
    return calls


def _mha_ref(mha, x, x_kv=None, causal=False):
    """MHA written out with plain ops and the module's own weights, on padded (batch, seqlen, dim) input."""
    h, hk, d = mha.num_heads, mha.num_heads_kv, mha.head_dim
    if mha.cross_attn:
        q = mha.Wq(x).unflatten(-1, (h, d))
        k, v = mha.Wkv(x if x_kv is None else x_kv).unflatten(-1, (2, hk, d)).unbind(2)
    else:
        q, k, v = mha.Wqkv(x).split([h * d, hk * d, hk * d], dim=-1)
        q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))
    return mha.out_proj(attention_ref(q, k, v, causal)[0].flatten(-2))


def test_flash_self_and_cross_attention_modules(cpu_kernels):
    torch.manual_seed(0)
    qkv = torch.randn(2, 9, 3, 4, 16)
    attn = modules.FlashSelfAttention(causal=True, softmax_scale=0.3, attention_dropout=0.1)
    out = attn(qkv)
    torch.testing.assert_close(out, attention_ref(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], True, 0.3)[0])
    assert cpu_kernels[-1] == dict(dropout_p=0.1, softmax_scale=0.3, causal=True, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False)
    attn.eval()
    attn(qkv, causal=False)
    assert cpu_kernels[-1]["dropout_p"] == 0.0 and cpu_kernels[-1]["causal"] is False

    # varlen: the packed sequences of the padded batch give the same rows
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    torch.testing.assert_close(attn(qkv.flatten(0, 1), cu_seqlens=cu, max_seqlen=9), attn(qkv).flatten(0, 1))
    with pytest.raises(ValueError, match="max_seqlen"):
        attn(qkv.flatten(0, 1), cu_seqlens=cu)

    q, kv = torch.randn(2, 5, 4, 16), torch.randn(2, 7, 2, 2, 16)   # GQA: 4 q heads, 2 kv heads
    cross = modules.FlashCrossAttention().eval()
    torch.testing.assert_close(cross(q, kv), attention_ref(q, kv[:, :, 0], kv[:, :, 1])[0])
    cu_q, cu_k = torch.tensor([0, 5, 10], dtype=torch.int32), torch.tensor([0, 7, 14], dtype=torch.int32)
    torch.testing.assert_close(cross(q.flatten(0, 1), kv.flatten(0, 1), cu_seqlens=cu_q, max_seqlen=5,
                                     cu_seqlens_k=cu_k, max_seqlen_k=7), cross(q, kv).flatten(0, 1))


@pytest.mark.parametrize("num_heads_kv", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mha_self_attention(cpu_kernels, num_heads_kv, causal):
    torch.manual_seed(0)
    mha = modules.MHA(64, 4, num_heads_kv=num_heads_kv, causal=causal).eval()
    hk = num_heads_kv or 4
    assert mha.Wqkv.weight.shape == ((4 + 2 * hk) * 16, 64) and mha.out_proj.weight.shape == (64, 64)
    x = torch.randn(3, 11, 64)
    with torch.no_grad():
        torch.testing.assert_close(mha(x), _mha_ref(mha, x, causal=causal))

        # key_padding_mask: kept tokens match each sequence run alone, padding rows are 0
        lens = [11, 4, 7]
        mask = torch.arange(11)[None] < torch.tensor(lens)[:, None]
        out = mha(x, key_padding_mask=mask)
        for b, n in enumerate(lens):
            torch.testing.assert_close(out[b, :n], _mha_ref(mha, x[b:b + 1, :n], causal=causal)[0])
        assert not out[~mask].any()

        # already packed input
        packed = x[mask]
        cu = torch.tensor([0, 11, 15, 22], dtype=torch.int32)
        torch.testing.assert_close(mha(packed, cu_seqlens=cu, max_seqlen=11), out[mask])


def test_mha_cross_attention(cpu_kernels):
    torch.manual_seed(0)
    mha = modules.MHA(32, 4, num_heads_kv=2, cross_attn=True).eval()
    assert mha.Wq.weight.shape == (32, 32) and mha.Wkv.weight.shape == (2 * 2 * 8, 32)
    x, x_kv = torch.randn(2, 5, 32), torch.randn(2, 8, 32)
    with torch.no_grad():
        torch.testing.assert_close(mha(x, x_kv), _mha_ref(mha, x, x_kv))
        torch.testing.assert_close(mha(x), _mha_ref(mha, x))   # x_kv defaults to x

        # masked keys: every query row is computed, against its sequence's kept keys only
        lens = [3, 8]
        mask = torch.arange(8)[None] < torch.tensor(lens)[:, None]
        out = mha(x, x_kv, key_padding_mask=mask)
        for b, n in enumerate(lens):
            torch.testing.assert_close(out[b], _mha_ref(mha, x[b:b + 1], x_kv[b:b + 1, :n])[0])

        cu_q, cu_k = torch.tensor([0, 5, 10], dtype=torch.int32), torch.tensor([0, 3, 11], dtype=torch.int32)
        packed = mha(x.flatten(0, 1), x_kv[mask], cu_seqlens=cu_q, max_seqlen=5, cu_seqlens_k=cu_k, max_seqlen_k=8)
        torch.testing.assert_close(packed, out.flatten(0, 1))


def test_mha_training_passes_dropout(cpu_kernels):
    mha = modules.MHA(32, 2, dropout=0.2)
    x = torch.randn(1, 4, 32)
    mha(x)
    assert cpu_kernels[-1]["dropout_p"] == 0.2
    mha.eval()
    mha(x)
    assert cpu_kernels[-1]["dropout_p"] == 0.0


def test_mha_argument_errors():
    with pytest.raises(ValueError, match="divisible"):
        modules.MHA(30, 4)
    with pytest.raises(ValueError, match="multiple of num_heads_kv"):
        modules.MHA(32, 4, num_heads_kv=3)
    mha = modules.MHA(32, 2)
    with pytest.raises(ValueError, match="cross_attn"):
        mha(torch.randn(1, 4, 32), torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        mha(torch.randn(1, 4, 32), key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_seqlen"):
        mha(torch.randn(4, 32), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
