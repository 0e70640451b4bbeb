"""Traits, names, rendering and the generated/ tree (CPU only)."""
import jinja2
import pytest

from codegen import heuristics
from codegen.arch import ARCHS, arch_for_capability, get_arch
from codegen.render import check_generated, generated_dir, render, templates_dir, write_generated
from codegen.traits import FAMILIES, FwdTraits, TraitsError, traits_from_dict, traits_from_name


def test_name_encodes_every_trait():
    t = FwdTraits("sm_80", "bf16", 128, 128, 64, 4, True, True)
    assert t.name == "fwd_sm80_bf16_hd128_m128n64_w4_causal_sm80"
    assert traits_from_name(t.name) == t
    assert traits_from_dict(t.to_dict()) == t
    padded = FwdTraits("sm_90a", "fp16", 64, 128, 64, 4, False, False)
    assert padded.name == "fwd_sm80_fp16_hd64p_m128n64_w4_sm90a"
    assert traits_from_name(padded.name) == padded


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_default_set_valid_and_renders(arch):
    kernels = heuristics.default_set(arch)
    assert len({t.name for t in kernels}) == len(kernels)
    by_family = {}
    for t in kernels:
        by_family.setdefault(t.family, []).append(t)
    assert len(by_family["fwd"]) == 32   # 2 dtypes x 8 buckets x causal
    # Backward: pre per (dtype, bucket), the three tile kernels per (dtype, bucket, causal), where they fit.
    n_bwd_buckets = len(by_family["bwd_pre"])
    assert len(by_family["bwd_dq"]) == 2 * n_bwd_buckets and len(by_family["bwd_dkdv"]) == 4 * n_bwd_buckets
    assert n_bwd_buckets == (16 if get_arch(arch).smem_per_block >= 160 * 1024 else 10)
    for t in kernels:
        t.validate()
        assert t.smem_bytes() <= get_arch(arch).smem_per_block
        src = render(t)
        assert t.name in src and t.params.name in src
        assert render(t) == src   # deterministic


def test_every_family_renders():
    for family, cls in FAMILIES.items():
        t = cls(arch="sm_90a") if family == "dropout_mask" else cls(arch="sm_90a", dtype="bf16")   # mask: uint8
        assert t.name in render(t.validate())


def test_validation_rejects_bad_traits():
    with pytest.raises(TraitsError, match="shared memory"):
        FwdTraits("sm_86", "bf16", 256, 128, 128, 8).validate()
    with pytest.raises(TraitsError, match="block_m"):
        FwdTraits("sm_90a", "bf16", 64, 48, 64, 4).validate()
    with pytest.raises(TraitsError, match="spill"):
        FwdTraits("sm_90a", "bf16", 256, 128, 128, 4).validate()
    with pytest.raises(TraitsError, match="dtype"):
        FwdTraits("sm_90a", "fp32", 64).validate()


def test_backward_traits_names_and_limits():
    t = heuristics.bwd_traits("sm_90a", "bf16", 128, True, "dkdv_atomic")
    assert t.name == "bwd_dkdv_atomicdq_sm80_bf16_hd128_m64n128_w8_s2_causal_sm90a"
    assert traits_from_name(t.name) == t
    assert heuristics.bwd_traits("sm_80", "bf16", 128, False, "dq").stages == 1     # 2 stages need > 163 KB
    assert heuristics.bwd_traits("sm_90a", "fp16", 72, False, "dq").name == "bwd_dq_sm80_fp16_hd96p_m64n128_w8_s2_sm90a"
    with pytest.raises(TraitsError, match="no backward tiles"):
        heuristics.bwd_traits("sm_86", "bf16", 256, False, "dkdv")
    assert heuristics.bwd_schedule("auto", True, 1, 1, 1) == "split"
    with pytest.raises(ValueError, match="backward_impl"):
        heuristics.bwd_schedule("fast", False, 1, 1, 1)


def test_padded_head_dims_pick_next_bucket():
    t = heuristics.fwd_traits("sm_90a", "fp16", 40, False)
    assert t.head_dim == 64 and not t.even_k
    assert heuristics.fwd_traits("sm_90a", "fp16", 256, True).even_k
    with pytest.raises(TraitsError):
        heuristics.fwd_traits("sm_90a", "fp16", 520, False)
    assert heuristics.fwd_traits("sm_90a", "fp16", 264, False).head_dim == 320


def test_wide_and_separate_v_head_dims():
    """hdim up to 512 (two column groups in the forward, the split backward) and head_dim_v != head_dim."""
    t = heuristics.fwd_traits("sm_90a", "bf16", 512, True)
    assert t.name == "fwd_sm80_bf16_hd512_m64n32_w8_causal_sm90a" and t.groups == 2
    assert t.smem_bytes() == (96 * 512 + 32 * 512) * 2
    assert heuristics.fwd_traits("sm_86", "bf16", 512, False).smem_bytes() <= get_arch("sm_86").smem_per_block
    mla = heuristics.fwd_traits("sm_90a", "bf16", 192, False, head_dim_v=128)
    assert mla.name == "fwd_sm80_bf16_hd192v128_m128n64_w8_ps_sm90a" and mla.groups == 1
    assert traits_from_name(mla.name) == mla and traits_from_dict(mla.to_dict()) == mla
    assert heuristics.fwd_traits("sm_90a", "bf16", 136, False, head_dim_v=88).name.startswith(
        "fwd_sm80_bf16_hd160v96p_")
    for kind in ("dkdv", "dq"):
        b = heuristics.bwd_traits("sm_90a", "bf16", 192, True, kind, head_dim_v=128)
        assert "hd192v128" in b.name and traits_from_name(b.name) == b
        assert heuristics.bwd_traits("sm_90a", "bf16", 512, False, kind).block_n == 32
    assert heuristics.bwd_traits("sm_90a", "bf16", 192, False, "pre", head_dim_v=128).head_dim == 128   # rows of dO
    with pytest.raises(TraitsError, match="fused schedule"):
        heuristics.bwd_traits("sm_90a", "bf16", 512, False, "dkdv_atomic", tiles=(64, 32, 1))
    assert heuristics.bwd_schedule("auto", False, 1, 1, 1, head_dim=512) == "split"
    with pytest.raises(ValueError, match="fused"):
        heuristics.bwd_schedule("fused", False, 1, 1, 1, head_dim=512)
    kinds = {t.family + ("_atomic" if getattr(t, "atomic_dq", False) else "")
             for t in heuristics.default_set("sm_90a", dtypes=("bf16",), head_dims=(512,))}
    assert kinds == {"fwd", "bwd_pre", "bwd_dkdv", "bwd_dq"}
    assert len(heuristics.default_set("sm_90a", dtypes=("bf16",), head_dims=((192, 128),))) == 2 + 1 + 2 * 3


def test_arch_for_capability():
    assert arch_for_capability(9, 0).name == "sm_90a"
    assert arch_for_capability(8, 6).name == "sm_86"
    assert arch_for_capability(8, 7).name == "sm_86"   # same major, nearest lower minor
    with pytest.raises(ValueError):
        arch_for_capability(7, 5)


def test_strict_undefined(tmp_path, monkeypatch):
    tdir = tmp_path / "templates"
    tdir.mkdir()
    (tdir / "fwd_sm80.cu.j2").write_text("{{ name }} {{ not_a_trait }}\n")
    monkeypatch.setenv("FLASHGEN_TEMPLATES_DIR", str(tdir))
    with pytest.raises(jinja2.UndefinedError):
        render(heuristics.fwd_traits("sm_90a", "bf16", 64, False))


def test_generated_tree_is_current():
    assert check_generated(generated_dir()) == []


def test_check_detects_template_change(tmp_path, monkeypatch):
    import shutil
    out = tmp_path / "gen"
    write_generated(heuristics.default_set("sm_86", head_dims=(64,)), out)
    assert check_generated(out) == []
    tdir = tmp_path / "templates"
    shutil.copytree(templates_dir(), tdir)
    hdr = tdir / "include" / "flashgen" / "fwd_sm80.cuh"
    hdr.write_text(hdr.read_text() + "\n// edited\n")
    monkeypatch.setenv("FLASHGEN_TEMPLATES_DIR", str(tdir))
    assert any("templates" in p for p in check_generated(out))
    j2 = tdir / "fwd_sm80.cu.j2"
    j2.write_text(j2.read_text().replace("attention forward", "attention fwd"))
    assert any("differs" in p for p in check_generated(out))


def test_blocks_per_sm():
    from codegen.arch import blocks_per_sm
    h100, rtx = get_arch("sm_90a"), get_arch("sm_86")
    assert blocks_per_sm(h100, 128, 255, 48 * 1024) == 2      # registers: 255 -> 256 per thread, 4 warps
    assert blocks_per_sm(h100, 256, 255, 160 * 1024) == 1
    assert blocks_per_sm(h100, 128, 32, 100 * 1024) == 2      # shared memory
    assert blocks_per_sm(h100, 128, 24, 0) == 16              # threads
    assert blocks_per_sm(rtx, 128, 168, 48 * 1024) == 2


def test_persistent_sm80_forward_traits():
    """Non-causal SM80 forwards of the table's buckets walk their tiles persistently; O gets shared memory of its own
    (the next tile's Q and K land meanwhile); causal kernels stay on the grid."""
    t = heuristics.fwd_traits("sm_90a", "bf16", 256, False)
    assert t.persistent and t.name == "fwd_sm80_bf16_hd256_m128n64_w8_ps_sm90a" and traits_from_name(t.name) == t
    grid = heuristics.fwd_traits("sm_90a", "bf16", 256, False, persistent=False)
    assert t.smem_bytes() == grid.smem_bytes() + 128 * 256 * 2
    assert not heuristics.fwd_traits("sm_90a", "bf16", 256, True).persistent
    assert not heuristics.fwd_traits("sm_90a", "bf16", 256, True, persistent=True).persistent
    assert not heuristics.fwd_traits("sm_90a", "bf16", 64, False).persistent   # hdim 64 measured no gain
    with pytest.raises(TraitsError, match="non-causal"):
        FwdTraits("sm_90a", "bf16", 128, 128, 64, 4, causal=True, persistent=True).validate()
    assert "FwdSm80<cutlass::bfloat16_t, 256, 256, 128, 64, 8, false, true, false, true, false, 1, false>" in render(t)


def test_ldsm_imm_sm80_forward_traits():
    """The table's buckets address ldmatrix through immediates (ldsm_imm, `_li`), hdim 128 with O += P V in two
    column passes (`_pv2`); passes need ldsm_imm and a power-of-two share of O's 16-column tiles."""
    t = heuristics.fwd_traits("sm_90a", "bf16", 128, False)
    assert t.name == "fwd_sm80_bf16_hd128_m128n64_w4_li_pv2_lean_sm90a" and traits_from_name(t.name) == t
    assert "FwdSm80<cutlass::bfloat16_t, 128, 128, 128, 64, 4, false, true, false, false, true, 2, true>" in render(t)
    c = heuristics.fwd_traits("sm_90a", "bf16", 72, True)
    assert c.name == "fwd_sm80_bf16_hd96p_m128n64_w4_causal_li_sm90a" and traits_from_name(c.name) == c
    assert not heuristics.fwd_traits("sm_90a", "bf16", 256, False).ldsm_imm      # measured 2% slower there
    # hdim 128 runs the register-lean mainloop (`_lean`: spill-free), causal too; hdim 64 does not.
    assert t.lean_loop and heuristics.fwd_traits("sm_90a", "bf16", 128, True).lean_loop
    assert not heuristics.fwd_traits("sm_90a", "bf16", 64, True).lean_loop
    # hdim 192 / 128 (V) is keyed by its wider bucket: ldsm_imm off; hdim 64 / 128 by 128: two passes over 128 columns.
    assert heuristics.fwd_traits("sm_90a", "bf16", 64, False, head_dim_v=128).pv_passes == 2
    with pytest.raises(TraitsError, match="needs ldsm_imm"):
        FwdTraits("sm_90a", "bf16", 128, 128, 64, 4, pv_passes=2).validate()
    with pytest.raises(TraitsError, match="power of two"):
        FwdTraits("sm_90a", "bf16", 96, 128, 64, 4, ldsm_imm=True, pv_passes=2).validate()


def test_persistent_sm80_forward_compiles_to_a_walk():
    """With no GPU: the persistent kernel strides its tile loop by the grid size, and ptxas keeps it free of spills
    (the thread index is re-read per tile, so no thread-dependent address stays live across the walk)."""
    import re
    from flashgen import compiler
    t = heuristics.fwd_traits("sm_90a", "fp16", 64, False, persistent=True)
    res = compiler.compile_source(render(t), t.name, t.arch, "<memory>", ptx=True)
    assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0"], res.log
    assert "nctaid.x" in res.ptx
