"""Dropout without a GPU: the Philox reference against Random123's known-answer vectors, the documented mask
mapping's statistics, traits and names, rendering, the CLI, and NVRTC compiles of the dropout kernels."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from codegen import heuristics
from codegen.render import render
from codegen.traits import DropoutMaskTraits, FwdTraits, TraitsError, traits_from_name
from tests.dropout_ref import keep_mask, philox4x32_10

ROOT = Path(__file__).resolve().parent.parent


# Random123's philox4x32_10 known-answer vectors (counter, key -> output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_reference_known_answers(ctr, key, want):
    got = philox4x32_10([np.uint64(c) for c in ctr], [np.uint64(k) for k in key])
    assert tuple(int(x) for x in got) == want


def test_philox_constants_match_the_header():
    """The kernels' Philox (dropout.cuh) uses the same multipliers and Weyl constants as the reference."""
    src = (ROOT / "templates" / "include" / "flashgen" / "dropout.cuh").read_text()
    for const in ("0xD2511F53u", "0xCD9E8D57u", "0x9E3779B9u", "0xBB67AE85u"):
        assert const in src


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_documented_mapping_keep_rate_and_independence(p):
    from flashgen.interface import dropout_threshold
    masks = [keep_mask(0x1234_5678_9ABC_DEF0, 77, p, bh, 256, 512) for bh in range(4)]
    exact = 1 - dropout_threshold(p) / 256
    for m in masks:
        assert abs(m.mean() - exact) < 0.01
    # Different heads, seeds and offsets give different masks.
    assert (masks[0] != masks[1]).mean() > 0.1
    assert (keep_mask(1, 77, p, 0, 64, 64) != keep_mask(2, 77, p, 0, 64, 64)).mean() > 0.1
    assert (keep_mask(1, 77, p, 0, 64, 64) != keep_mask(1, 78, p, 0, 64, 64)).mean() > 0.1


def test_threshold_and_scale():
    from flashgen.interface import dropout_keep_scale, dropout_threshold
    assert dropout_threshold(0.0) == 0 and dropout_keep_scale(0.0) == 1.0
    assert dropout_threshold(0.5) == 128 and dropout_keep_scale(0.5) == 2.0
    assert dropout_threshold(0.1) == 26 and dropout_keep_scale(0.1) == 256 / 230
    assert dropout_threshold(0.9999) == 255      # never everything dropped: the scale stays finite


def test_dropout_is_a_trait():
    t = heuristics.fwd_traits("sm_90a", "bf16", 128, True, dropout=True)
    assert t.name == "fwd_sm80_bf16_hd128_m128n64_w4_causal_dropout_li_pv2_lean_sm90a"
    assert traits_from_name(t.name) == t
    for kind in ("dkdv_atomic", "dkdv", "dq"):
        b = heuristics.bwd_traits("sm_90a", "fp16", 72, False, kind, dropout=True)
        assert b.name.endswith("_dropout_sm90a") and traits_from_name(b.name) == b
    assert heuristics.bwd_traits("sm_90a", "fp16", 72, False, "pre", dropout=True).name == "bwd_pre_fp16_hd96_w4_sm90a"
    mask = heuristics.dropout_mask_traits("sm_86")
    assert mask.name == "dropout_mask_w4_r16_sm86" and traits_from_name(mask.name) == mask
    with pytest.raises(TraitsError, match="multiple of 32"):
        FwdTraits(arch="sm_90a", dtype="bf16", head_dim=64, block_m=64, block_n=16, num_warps=4,
                  dropout=True).validate()
    with pytest.raises(TraitsError, match="uint8"):
        DropoutMaskTraits(arch="sm_90a", dtype="bf16").validate()


def test_render_dropout_variants():
    drop = render(heuristics.fwd_traits("sm_90a", "bf16", 64, False, dropout=True))
    plain = render(heuristics.fwd_traits("sm_90a", "bf16", 64, False))
    # FwdSm80<..., causal, even_k, dropout, persistent, ldsm_imm, pv_passes>; the parameter struct carries the
    # dropout fields either way.
    assert "false, true, true, false, false, 1, false>;" in drop and "false, true, false, false, false, 1, false>;" in plain
    assert "rng_state" in plain
    for kind in ("dkdv_atomic", "dq"):
        assert ", true>;" in render(heuristics.bwd_traits("sm_90a", "bf16", 64, True, kind, dropout=True))
    src = render(heuristics.dropout_mask_traits("sm_90a"))
    assert "flashgen::dropout_mask<128, 16>" in src and "DropoutMaskParams" in src


def test_default_set_with_dropout():
    plain = heuristics.default_set("sm_90a", head_dims=(64,))
    both = heuristics.default_set("sm_90a", head_dims=(64,), dropout=(False, True))
    names = {t.name for t in both}
    assert not any("dropout" in t.name for t in plain)
    # Every forward (SM80 and Hopper) and SM80 backward kernel gets a dropout twin; the Hopper backwards (fused, and
    # the split schedule's two) have none in the default set (dropout's compile on first use; its split schedule runs
    # the SM80 kernels), nor the Hopper forward's persistent walk (dropout takes the grid); the preprocess is shared;
    # plus the mask kernel.
    hopper_bwd = [t for t in plain if t.family in ("bwd_sm90", "bwd_dq_sm90")]
    walks = [t for t in plain if t.family == "fwd_sm90" and t.persistent]
    assert len(hopper_bwd) == 3 * 4 and len(walks) == 4 and sum(t.family == "fwd_sm90" and t.dropout for t in both) == 4
    assert len(both) == 2 * len(plain) - len(hopper_bwd) - len(walks) - 2 + 1
    assert "dropout_mask_w4_r16_sm90a" in names


def test_cli_generate_dropout(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "flashgen", "generate", "--arch", "sm_80", "--hdim", "64", "--dtype",
                        "bf16", "--family", "fwd", "--dropout", "--no-compile", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "sm_80").glob("*.cu"))
    assert files == ["dropout_mask_w4_r16_sm80.cu", "fwd_sm80_bf16_hd64_m128n64_w4_causal_dropout_sm80.cu",
                     "fwd_sm80_bf16_hd64_m128n64_w4_causal_sm80.cu", "fwd_sm80_bf16_hd64_m128n64_w4_dropout_sm80.cu",
                     "fwd_sm80_bf16_hd64_m128n64_w4_sm80.cu"]


def test_compiles_dropout_kernels(cache_dir):
    """NVRTC-compiles the mask kernel and a forward and a fused-backward dropout kernel (two CuTe compiles in
    parallel): the dropout code paths of the templates build."""
    from concurrent.futures import ProcessPoolExecutor

    from flashgen import cache
    from flashgen.cli import _compile_one
    traits = [heuristics.fwd_traits("sm_90a", "bf16", 32, True, dropout=True),
              heuristics.bwd_traits("sm_90a", "bf16", 32, False, "dkdv_atomic", dropout=True),
              heuristics.dropout_mask_traits("sm_90a")]
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile_one, [t.to_dict() for t in traits]))
    for t, (name, hit, secs, err, res) in zip(traits, results):
        assert err is None, err
        assert name == t.name and res["registers"] > 0
        cubin, _, hit = cache.get_or_compile(t)
        assert hit and cubin[:4] == b"\x7fELF"
