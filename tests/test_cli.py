"""The flashgen command line (CPU only)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, cache=None, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if cache is not None:
        env["FLASHGEN_CACHE_DIR"] = str(cache)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


def test_generate_no_compile_and_check(tmp_path):
    out = tmp_path / "gen"
    r = _run("generate", "--arch", "sm_89", "--hdim", "80", "--dtype", "bf16", "--no-compile", "--out", str(out))
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (out / "sm_89").glob("*.cu"))
    # Forward and backward by default: 2 forward, the preprocess, and dK/dV (fused and split) + dQ per causal.
    assert len(files) == 9 and "bwd_pre_bf16_hd96_w4_sm89.cu" in files
    assert sum(f.startswith("bwd_dkdv_atomicdq_") and "_hd96p_" in f for f in files) == 2
    assert (out / "manifest.json").exists()
    r = _run("generate", "--arch", "sm_89", "--hdim", "80", "--dtype", "bf16", "--family", "fwd", "--no-compile",
             "--out", str(out))
    files = sorted(p.name for p in (out / "sm_89").glob("*.cu"))
    assert files == ["fwd_sm80_bf16_hd96p_m128n64_w4_causal_li_sm89.cu", "fwd_sm80_bf16_hd96p_m128n64_w4_li_sm89.cu"]
    assert _run("check", "--out", str(out)).returncode == 0
    (out / "sm_89" / files[0]).write_text("// stale\n")
    r = _run("check", "--out", str(out))
    assert r.returncode == 1 and "differs" in r.stdout


def test_check_on_repo_generated_tree():
    r = _run("check")
    assert r.returncode == 0, r.stdout


def test_generate_compiles_with_summary_then_hits(tmp_path):
    args = ("generate", "--arch", "sm_80", "--hdim", "32", "--dtype", "fp16", "--family", "fwd", "--out",
            str(tmp_path / "g"), "-j", "2")
    r = _run(*args, cache=tmp_path / "c")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kernels, 2 compiled, 0 cache hits, 0 failures" in r.stdout
    r = _run(*args, cache=tmp_path / "c")
    assert "2 kernels, 0 compiled, 2 cache hits, 0 failures" in r.stdout
    r = _run("list", "--arch", "sm_80", cache=tmp_path / "c")
    assert r.returncode == 0
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("fwd_sm80_fp16_hd32_m128n128_w4_sm80"))
    assert "cached" in line
    r = _run("inspect", "fwd_sm80_fp16_hd32_m128n128_w4_sm80", cache=tmp_path / "c")
    assert r.returncode == 0 and "registers=" in r.stdout and "ptxas" in r.stdout
    r = _run("cache", "info", cache=tmp_path / "c")
    assert "entries: 2" in r.stdout
    r = _run("cache", "clear", cache=tmp_path / "c")
    assert "removed 2" in r.stdout
    assert "entries: 0" in _run("cache", "info", cache=tmp_path / "c").stdout


def test_inspect_unknown_name():
    r = _run("inspect", "not_a_kernel")
    assert r.returncode == 2 and "not a flashgen kernel name" in r.stderr


def test_explain_names_the_kernels_and_reasons():
    r = _run("explain", "--arch", "sm_90a", "--hdim", "80", "--causal", "--batch", "2", "--heads", "8")
    assert r.returncode == 0, r.stderr
    assert "head dim 80 -> bucket 96 (padded" in r.stdout
    # seqlen 1024 (the default): the Hopper forward walks its tiles persistently (FWD_SM90_PERSISTENT_SEQLEN)
    assert "forward: fwd_sm90_bf16_hd128_m128n128_s2_ov_ps_causal_sm90a" in r.stdout   # heuristics.FWD_SM90_SHAPE_TILES
    assert "overlap mainloop from heuristics.FWD_SM90_SHAPE_TILES" in r.stdout
    assert "persistent walk" in r.stdout
    assert "TMA cannot describe: fwd_sm80_bf16_hd96p_m128n64_w4_causal_li_sm90a" in r.stdout   # the SM80 fallback
    assert "FWD_TILES_BIG[96]" in r.stdout
    assert "backward schedule: fused" in r.stdout and "bwd_dkdv_atomicdq_sm80_bf16_hd96p_" in r.stdout
    r = _run("explain", "--arch", "sm_86", "--hdim", "256", "--deterministic")
    assert "backward schedule: split (deterministic=True)" in r.stdout and "none fits" in r.stdout


def test_new_head_dims_from_the_command_line(tmp_path):
    """`--hdim 512` adds a wide bucket (split backward only), `--hdim 192:128` a V head dim of its own."""
    out = tmp_path / "gen"
    r = _run("generate", "--arch", "sm_90a", "--hdim", "512", "--hdim", "192:128", "--dtype", "bf16", "--no-compile",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    files = {p.name for p in (out / "sm_90a").glob("*.cu")}
    assert "fwd_sm80_bf16_hd512_m64n32_w8_sm90a.cu" in files and "fwd_sm80_bf16_hd192v128_m128n64_w8_ps_sm90a.cu" in files
    assert not any(f.startswith("bwd_dkdv_atomicdq_") and "_hd512_" in f for f in files)   # fused: up to 256
    assert "bwd_dq_sm80_bf16_hd512_m64n32_w8_s1_sm90a.cu" in files and "bwd_pre_bf16_hd128_w4_sm90a.cu" in files
    r = _run("generate", "--hdim", "520", "--no-compile", "--out", str(out))
    assert r.returncode == 2 and "multiples of 8 in [8, 512]" in r.stderr
    r = _run("explain", "--arch", "sm_90a", "--hdim", "192", "--hdim-v", "128")
    assert r.returncode == 0 and "head dim of v 128 -> bucket 128" in r.stdout and "hd192v128" in r.stdout
    r = _run("explain", "--arch", "sm_90a", "--hdim", "512")
    assert "2 column groups of O" in r.stdout and "split (head dim 512 > 256: split only)" in r.stdout


def test_default_jobs_fit_the_memory(monkeypatch):
    """One compile per CPU, but no more than the free memory holds (~4 GB each), and at least one."""
    from flashgen import cli
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages.get(name, pages["free"] // 4096))
    pages["free"] = 24 << 30
    assert cli.default_jobs() == 6
    pages["free"] = 1 << 30
    assert cli.default_jobs() == 1
    pages["free"] = 1 << 40
    assert cli.default_jobs() == 64
