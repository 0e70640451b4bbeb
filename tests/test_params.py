"""The parameter struct: Python packing must match what NVRTC lays out."""
import re
import struct

from codegen.params import ALL_PARAMS, FWD_PARAMS, offset_probe_source
from flashgen.compiler import compile_ptx


def test_offsets_match_nvrtc_ptx():
    for ps in ALL_PARAMS.values():
        ptx = compile_ptx(offset_probe_source(ps), "probe", "sm_80")
        for field, _, offset in ps.layout()[0]:
            body = ptx.split(f".entry probe_{field}(")[1].split(".entry")[0]
            m = re.search(r"\.param \.align \d+ \.b8 probe_\w+_param_0\[(\d+)\]", body)
            assert m and int(m.group(1)) == ps.size, f"{ps.name}: NVRTC size {m and m.group(1)} != {ps.size}"
            assert _field_offsets(body) == [offset], f"{ps.name}.{field}: NVRTC {_field_offsets(body)}, Python {offset}"


def _field_offsets(body: str) -> list[int]:
    """Offsets of the struct bytes a probe kernel uses. ptxas may widen the read to ld.param.v2/.v4 of
    neighbouring fields; then the element whose register the kernel goes on to use is the field."""
    out = []
    rx = r"ld\.param(?:\.v(\d))?\.[a-z](\d+)\s+(%\w+|\{[^}]*\}), \[probe_\w+_param_0(?:\+(\d+))?\];"
    for m in re.finditer(rx, body):
        regs = [r.strip() for r in m.group(3).strip("{}").split(",")]
        rest = body[m.end():]
        used = [i for i, r in enumerate(regs) if re.search(re.escape(r) + r"\b", rest)]
        out += [int(m.group(4) or 0) + i * int(m.group(2)) // 8 for i in used]
    return out


def test_pack_roundtrip():
    vals = {"q": 0x1000, "k": 0x2000, "seqlen_q": 17, "seqlen_k": 1023, "scale_log2": 0.5, "q_row_stride": 3 * 64}
    buf = FWD_PARAMS.pack(vals)
    assert len(buf) == FWD_PARAMS.size
    layout = {f: (k, off) for f, k, off in FWD_PARAMS.layout()[0]}
    assert struct.unpack_from("<Q", buf, layout["k"][1])[0] == 0x2000
    assert struct.unpack_from("<i", buf, layout["seqlen_k"][1])[0] == 1023
    assert struct.unpack_from("<f", buf, layout["scale_log2"][1])[0] == 0.5
    assert struct.unpack_from("<q", buf, layout["q_row_stride"][1])[0] == 192


def test_pack_rejects_unknown_field():
    import pytest
    with pytest.raises(KeyError, match="nope"):
        FWD_PARAMS.pack({"nope": 1})


def test_rendered_source_asserts_size():
    from codegen.heuristics import fwd_traits
    from codegen.render import render
    src = render(fwd_traits("sm_90a", "bf16", 128, False))
    assert f"static_assert(sizeof(FwdParams) == {FWD_PARAMS.size}" in src


def test_pack_puts_every_field_at_its_offset():
    """The one-call packer against a field-by-field reference, every struct, distinct random values per field;
    missing fields pack as zeros and unknown ones are refused."""
    import random

    import pytest
    rng = random.Random(0)
    codes = {"ptr": "Q", "i64": "q", "u64": "Q", "i32": "i", "u32": "I", "f32": "f", "tmap": "128s"}
    for ps in ALL_PARAMS.values():
        values = {f: {"tmap": rng.randbytes(128), "f32": rng.random(), "i64": rng.randrange(-2**40, 2**40)}
                  .get(kind, rng.randrange(1, 2**31)) for f, kind in ps.fields}
        ref = bytearray(ps.size)
        for f, kind, off in ps.layout()[0]:
            struct.pack_into("<" + codes[kind], ref, off, values[f])
        assert ps.pack(values) == bytes(ref), ps.name
        assert ps.pack({}) == bytes(ps.size), ps.name
        with pytest.raises(KeyError, match="not_a_field"):
            ps.pack({"not_a_field": 1})
