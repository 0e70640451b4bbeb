"""Tuning files (CPU only): precedence in dispatch, stale and corrupt files, explain, the shipped files, the tuner's
pure parts and its command line without a GPU. No kernel compiles: the dispatch decisions return traits."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import flashgen
from codegen import heuristics
from flashgen import dispatch, tuner, tuning
from flashgen.tuning import TuningFileWarning

ROOT = Path(__file__).resolve().parent.parent
GPU, ARCH = "NVIDIA H100 80GB HBM3", "sm_90a"
DEFAULT_128 = heuristics.fwd_tiles(ARCH, 128, False)       # (128, 64, 4)
TUNED_128 = (128, 32, 4)
ENTRY = {"dtype": "bf16", "hdim": 128, "causal": False, "seqlen": 2048, "fwd": list(TUNED_128),
         "bwd": {"schedule": "split", "tiles": {"dkdv_atomic": [64, 64, 1], "dkdv": [64, 64, 2], "dq": [64, 64, 2]}},
         "measured": {"seqlen": 2048}}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """A private user tuning dir and a private shipped dir (the package's real files stay out of these tests)."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir(), shipped.mkdir()
    monkeypatch.setenv("FLASHGEN_TUNING_DIR", str(user))
    monkeypatch.setattr(tuning, "shipped_dir", lambda: shipped)
    tuning.reload()
    yield user, shipped
    tuning.reload()


def write(directory: Path, entries=(ENTRY,), gpu=GPU, version=None, arch=ARCH, text=None) -> Path:
    path = directory / f"{tuning.slug(GPU)}.json"
    if text is None:
        text = json.dumps({"format": 1, "flashgen_version": version or flashgen.__version__, "gpu": gpu, "arch": arch,
                           "created": "2026-11-30T00:00:00", "entries": list(entries)})
    path.write_text(text)
    return path


def fwd_tiles(gpu=GPU, dtype="bf16", hdim=128, causal=False, seqlen=2048, dropout=False):
    t = dispatch.fwd_traits(ARCH, gpu, dtype, hdim, causal, dropout, seqlen_q=seqlen, seqlen_k=seqlen)
    return (t.block_m, t.block_n, t.num_warps)


def bwd_tiles(kind, seqlen=2048, causal=False):
    t = dispatch.bwd_traits(ARCH, GPU, "bf16", 128, causal, kind, seqlen_q=seqlen, seqlen_k=seqlen)
    return (t.block_m, t.block_n, t.stages)


def test_buckets_and_names():
    assert [tuning.seqlen_bucket(s) for s in (0, 1, 512, 513, 1024, 1025, 2048, 4096, 8192, 8193, 32768, 10**6)] == \
        [512, 512, 512, 1024, 1024, 2048, 2048, 8192, 8192, 32768, 32768, 32768]
    assert tuning.seqlen_bucket(100, 3000) == 8192           # the longer of q and k
    assert tuning.slug(GPU) == "nvidia-h100-80gb-hbm3"
    assert tuning.slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"


def test_entry_changes_dispatch_for_its_key_only(dirs):
    write(dirs[0])
    assert DEFAULT_128 != TUNED_128
    assert fwd_tiles() == TUNED_128
    assert fwd_tiles(seqlen=1500) == TUNED_128                # same bucket (<= 2048)
    assert fwd_tiles(hdim=120) == TUNED_128                   # padded into the 128 bucket
    assert fwd_tiles(seqlen=4096) == DEFAULT_128              # other seqlen buckets: the table
    assert fwd_tiles(seqlen=100) == DEFAULT_128
    assert fwd_tiles(causal=True) == heuristics.fwd_tiles(ARCH, 128, True)
    assert fwd_tiles(dtype="fp16") == DEFAULT_128
    assert fwd_tiles(gpu="NVIDIA A100-SXM4-80GB") == DEFAULT_128
    assert fwd_tiles(gpu=None) == DEFAULT_128
    v = lambda hdv: dispatch.fwd_traits(ARCH, GPU, "bf16", 128, False, seqlen_q=2048, seqlen_k=2048, head_dim_v=hdv)
    assert (v(128).block_n, v(120).block_n, v(64).block_n) == (32, 32, 64)   # V of another bucket: not what was tuned
    # Backward tiles per kind, and the schedule only where "auto" decides.
    assert bwd_tiles("dkdv_atomic") == (64, 64, 1) and bwd_tiles("dq") == (64, 64, 2)
    assert bwd_tiles("dkdv", seqlen=8192) == (64, 128, 2)
    assert dispatch.bwd_traits(ARCH, GPU, "bf16", 128, False, "pre", seqlen_q=2048).name == \
        heuristics.bwd_traits(ARCH, "bf16", 128, False, "pre").name
    sched = lambda impl="auto", det=False, s=2048: dispatch.schedule(ARCH, GPU, "bf16", 128, False, impl, det, 16, s, s)
    assert sched() == "split" and sched(s=8192) == "fused"
    assert sched("fused") == "fused" and sched(det=True) == "split"


def test_hopper_entry_picks_the_hopper_forward(dirs):
    """fwd_sm90 [block_m, block_n, mainloop] steers the Hopper forward on sm_90a; set_fwd_sm90 overrides it; the SM80 path
    keeps its own entry ("fwd") for the calls the Hopper forward does not take."""
    write(dirs[0], [dict(ENTRY, fwd_sm90=[128, 176, "overlap"])])
    sm90 = lambda hdim=128, seqlen=2048: dispatch.fwd_traits(ARCH, GPU, "bf16", hdim, False, seqlen_q=seqlen,
                                                             seqlen_k=seqlen, hopper=True)
    t = sm90()
    assert (t.family, t.block_n, t.overlap, t.pingpong) == ("fwd_sm90", 176, True, False)
    assert sm90(hdim=120).block_n == 176                      # same key: SM80 bucket 128
    no_entry = heuristics.fwd_sm90_traits(ARCH, "bf16", 128, False, seqlen=8192)   # the tables' for that seqlen
    assert sm90(seqlen=8192).name == no_entry.name
    assert fwd_tiles() == TUNED_128                           # the SM80 path's forward: its own entry
    dispatch.set_fwd_sm90("bf16", 128, False, (192, 64, "serial"))
    try:
        assert (sm90().block_m, sm90().block_n, sm90().overlap, sm90().num_threads) == (192, 64, False, 512)
    finally:
        dispatch.set_fwd_sm90("bf16", 128, False, None)
    # At the entry's seqlen bucket (2048) the Hopper forward walks persistently (heuristics.FWD_SM90_PERSISTENT_SEQLEN).
    text = "\n".join(dispatch.explain(ARCH, GPU, "bf16", 128, False, 4, 16, 2048, 2048))
    assert "forward: fwd_sm90_bf16_hd128_m128n176_s2_ov_ps_sm90a" in text and "overlap mainloop from tuning file" in text
    names = {t.name for t in tuning.tuned_traits(ARCH, ("bf16",), [128], ("fwd",))}
    assert "fwd_sm90_bf16_hd128_m128n176_s2_ov_ps_sm90a" in names
    assert all(t.family == "fwd" for t in tuning.tuned_traits(ARCH, ("bf16",), [128], ("fwd",), dropout=(True,)))


def test_hopper_entry_may_set_the_stages(dirs):
    """A fourth element of fwd_sm90 sets the K/V stages (the table's where absent); five elements, or stages 0, make
    the file corrupt."""
    write(dirs[0], [dict(ENTRY, seqlen=8192, fwd_sm90=[192, 80, "overlap", 3])])   # the tables': 4 stages
    dispatch.reload_tuning()
    t = dispatch.fwd_traits(ARCH, GPU, "bf16", 128, False, seqlen_q=8192, seqlen_k=8192, hopper=True)
    assert (t.block_m, t.block_n, t.stages, t.overlap, t.pingpong) == (192, 80, 3, True, False), t.name
    assert t.name == "fwd_sm90_bf16_hd128_m192n80_s3_ov_sm90a"
    assert t.smem_bytes() <= 227 * 1024
    for bad in ([192, 80, "overlap", 0], [192, 80, "overlap", 4, 1]):
        write(dirs[0], [dict(ENTRY, seqlen=8192, fwd_sm90=bad)])
        dispatch.reload_tuning()
        with pytest.warns(tuning.TuningFileWarning, match=r"fwd_sm90 must be \[block_m, block_n, mainloop\]"):
            t = dispatch.fwd_traits(ARCH, GPU, "bf16", 128, False, seqlen_q=8192, seqlen_k=8192, hopper=True)
        assert t.name == heuristics.fwd_sm90_traits(ARCH, "bf16", 128, False, seqlen=8192).name   # ignored: tables


def test_overrides_win_and_dropout_falls_back(dirs):
    write(dirs[0], [ENTRY, dict(ENTRY, hdim=64, fwd=[128, 16, 4], bwd={"schedule": "fused", "tiles": {}})])
    dispatch.set_fwd_tiles("bf16", 128, False, (64, 64, 4))
    try:
        assert fwd_tiles() == (64, 64, 4)
    finally:
        dispatch.set_fwd_tiles("bf16", 128, False, None)
    assert fwd_tiles() == TUNED_128
    assert fwd_tiles(dropout=True) == TUNED_128               # block_n 32 holds the dropout mask blocks
    assert fwd_tiles(hdim=64) == (128, 16, 4)
    assert fwd_tiles(hdim=64, dropout=True) == heuristics.fwd_tiles(ARCH, 64, False)   # 16 columns cannot


@pytest.mark.parametrize("kind,match", [
    ("version", r"stale, written by flashgen 0\.0\.1"),
    ("gpu", r"stale, measured on 'NVIDIA H100 PCIe'"),
    ("arch", r"stale, measured for sm_80"),
    ("json", r"corrupt, not valid JSON"),
    ("schema-fwd", r"corrupt, entries\[0\]\.fwd must be a list of 3 positive integers"),
    ("schema-sm90", r"corrupt, entries\[0\]\.fwd_sm90 must be \[block_m, block_n, mainloop\]"),
    ("schema-top", r"corrupt, 'entries' must be a list"),
    ("schema-key", r"corrupt, entries\[0\]\.seqlen must be a seqlen bucket"),
])
def test_stale_or_corrupt_file_is_ignored_with_a_warning(dirs, kind, match):
    path = {"version": lambda: write(dirs[0], version="0.0.1"),
            "gpu": lambda: write(dirs[0], gpu="NVIDIA H100 PCIe"),
            "arch": lambda: write(dirs[0], arch="sm_80"),
            "json": lambda: write(dirs[0], text='{"format": 1, "entries": [{"dtype": '),
            "schema-fwd": lambda: write(dirs[0], [dict(ENTRY, fwd=[128, 64])]),
            "schema-sm90": lambda: write(dirs[0], [dict(ENTRY, fwd_sm90=[128, 128, "fast"])]),
            "schema-top": lambda: write(dirs[0], text=json.dumps({"format": 1, "flashgen_version": flashgen.__version__,
                                                                 "gpu": GPU, "arch": ARCH, "entries": {}})),
            "schema-key": lambda: write(dirs[0], [dict(ENTRY, seqlen=4096)])}[kind]()
    with pytest.warns(TuningFileWarning, match=match) as record:
        assert fwd_tiles() == DEFAULT_128
    assert str(path) in str(record[0].message) and "heuristic tables" in str(record[0].message)
    with warnings.catch_warnings():   # once per file per process
        warnings.simplefilter("error")
        assert fwd_tiles() == DEFAULT_128 and bwd_tiles("dkdv_atomic") == (64, 128, 2)


def test_entry_the_arch_cannot_run_is_skipped(dirs):
    too_big = dict(ENTRY, hdim=256, fwd=[256, 128, 4])       # far beyond 227 KB of shared memory
    write(dirs[0], [ENTRY, too_big])
    with pytest.warns(TuningFileWarning, match=r"skipping the entry for bf16 hdim 256 non-causal seqlen <= 2048"):
        assert fwd_tiles(hdim=256) == heuristics.fwd_tiles(ARCH, 256, False)
    assert fwd_tiles() == TUNED_128                           # the rest of the file still counts


def test_user_file_wins_over_shipped(dirs):
    user, shipped = dirs
    write(shipped)
    assert fwd_tiles() == TUNED_128
    write(user, [dict(ENTRY, fwd=[64, 64, 4])])
    tuning.reload()
    assert fwd_tiles() == (64, 64, 4)
    assert tuning.table(GPU, ARCH).path == user / "nvidia-h100-80gb-hbm3.json"
    write(user, version="0.0.1")                              # an unusable user file: the shipped one
    tuning.reload()
    with pytest.warns(TuningFileWarning, match="stale"):
        assert fwd_tiles() == TUNED_128


def test_write_round_trip(dirs):
    path = dirs[0] / "out.json"
    entry = tuning.parse({"format": 1, "flashgen_version": "x", "gpu": GPU, "arch": ARCH, "entries": [ENTRY]},
                         path).entries[("bf16", 128, False, 2048)]
    tuning.write(path, GPU, ARCH, [entry])
    data = json.loads(path.read_text())
    assert data["flashgen_version"] == flashgen.__version__ and data["entries"] == [ENTRY]
    assert tuning.read(path, GPU, ARCH).entries[entry.key].fwd == TUNED_128
    assert not list(dirs[0].glob(".*tmp"))                     # the temp file was renamed into place


def test_explain_names_the_tuning_file(dirs):
    path = write(dirs[0])
    text = "\n".join(dispatch.explain(ARCH, GPU, "bf16", 128, False, 4, 16, 2048, 2048))
    assert f"tuning: {path} entry for bf16 hdim 128 non-causal seqlen bucket 2048" in text
    assert "m128n32_w4" in text and f"from tuning file {path}" in text
    assert "backward schedule: split (auto: measured fastest, tuning file" in text
    assert "bwd_dq_sm80_bf16_hd128_m64n64_w8_s2_sm90a" in text
    text = "\n".join(dispatch.explain(ARCH, GPU, "bf16", 128, False, 4, 16, 8192, 8192))
    assert "has no entry for bf16 hdim 128 non-causal seqlen bucket 8192" in text and "FWD_TILES_BIG[128]" in text
    assert "tuning: no GPU" in dispatch.explain(ARCH, None, "bf16", 128, False)[0]
    # The command line, as a CPU user asking what an H100 would run.
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLASHGEN_TUNING_DIR=str(dirs[0]))
    r = subprocess.run([sys.executable, "-m", "flashgen", "explain", "--hdim", "128", "--seqlen-q", "2048",
                        "--gpu", GPU], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"tuning: {path} entry" in r.stdout and "fwd_sm80_bf16_hd128_m128n32_w4_li_pv2_lean_sm90a" in r.stdout


def test_shipped_files_are_current_and_valid():
    files = sorted(tuning.shipped_dir().glob("*.json"))
    for path in files:   # none yet is fine: the H100 file is produced by `flashgen tune` on the GPU
        data = json.loads(path.read_text())
        assert data["flashgen_version"] == flashgen.__version__, f"{path}: re-run `flashgen tune` for this version"
        assert path.name == f"{tuning.slug(data['gpu'])}.json"
        with warnings.catch_warnings():
            warnings.simplefilter("error", TuningFileWarning)   # stale, corrupt, or an entry skipped: fail
            table = tuning.read(path, data["gpu"], data["arch"])
        assert table is not None and len(table.entries) == len(data["entries"]) > 0


def test_tuner_plan_and_choice():
    p = tuner.plan(ARCH, "bf16", 64, False, ("fwd", "bwd"))
    assert p["fwd"][0] == heuristics.fwd_tiles(ARCH, 64, False) and len(p["fwd"]) == len(set(p["fwd"])) > 3
    default_bwd = heuristics.bwd_traits(ARCH, "bf16", 64, False, "dkdv_atomic")
    assert p["bwd"][0] == ("fused", {"dkdv_atomic": (default_bwd.block_m, default_bwd.block_n, default_bwd.stages)})
    assert {s for s, _ in p["bwd"]} == {"fused", "split"}
    assert all(set(t) == {"dkdv", "dq"} for s, t in p["bwd"] if s == "split")
    names = tuner.kernels_of(ARCH, "bf16", 64, False, p)
    assert sum(n.startswith("bwd_pre_") for n in names) == 1 and len(names) > len(p["fwd"]) + len(p["bwd"])
    assert tuner.plan(ARCH, "bf16", 64, False, ("fwd",))["bwd"] == []
    assert tuner.plan(ARCH, "bf16", 64, False, ("fwd",))["fwd_sm90"] == {}   # the Hopper forward: its own family
    p = tuner.plan(ARCH, "bf16", 64, False, tuner.FAMILIES)
    names = tuner.kernels_of(ARCH, "bf16", 64, False, p)
    sm90 = p["fwd_sm90"][0]   # seqlen unknown
    assert sm90[0] == heuristics.FWD_SM90_TILES[64][:2] + heuristics.FWD_SM90_TILES[64][3:]
    assert len(sm90) == len(set(sm90)) > 3
    assert {"fwd_sm90_bf16_hd64_m128n176_s2_ov_pp_sm90a", "fwd_sm90_bf16_hd64_m192n96_s2_ov_sm90a"} <= set(names)
    assert not any(m == 192 and mainloop == "pingpong" for m, _, mainloop in sm90)   # two warpgroups
    assert tuner.plan("sm_80", "bf16", 64, False, tuner.FAMILIES)["fwd_sm90"] == {}   # no Hopper forward there
    # Where FWD_SM90_SHAPE_TILES decides a seqlen bucket, its whole choice (stages too) is the default there.
    p = tuner.plan(ARCH, "bf16", 128, False, ("fwd_sm90",), seqlens=(1024, 8192))
    assert p["fwd_sm90"][8192][0] == (192, 80, "overlap", 4) and p["fwd_sm90"][1024][0] == (128, 128, "pingpong")
    causal = tuner.plan(ARCH, "bf16", 256, True, ("fwd_sm90",), seqlens=(2048,))["fwd_sm90"][2048]
    assert causal[0] == (128, 64, "pingpong", 2) and (128, 64, "pingpong") not in causal   # the same kernel: once
    names = tuner.kernels_of(ARCH, "bf16", 128, False, p)
    assert {"fwd_sm90_bf16_hd128_m192n80_s4_ov_sm90a", "fwd_sm90_bf16_hd128_m192n80_s2_ov_sm90a",
            "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_ps_sm90a"} <= set(names)
    # A winner within the noise margin keeps the default; a clear winner is recorded, per schedule too.
    fwd = [((128, 64, 4), 300.0), ((128, 32, 4), 303.0), ((64, 64, 4), None)]
    bwd = [("fused", {"dkdv_atomic": (64, 128, 2)}, 250.0), ("fused", {"dkdv_atomic": (64, 64, 2)}, 240.0),
           ("split", {"dkdv": (64, 128, 2), "dq": (64, 128, 2)}, 200.0),
           ("split", {"dkdv": (64, 64, 2), "dq": (64, 64, 2)}, 270.0)]
    e, rows = tuner.entry_from("bf16", 64, False, 3000, fwd, bwd)
    assert e.key == ("bf16", 64, False, 8192) and e.fwd == (128, 64, 4)
    assert e.bwd_schedule == "split" and e.bwd_tiles == {"dkdv_atomic": (64, 128, 2), "dkdv": (64, 64, 2),
                                                         "dq": (64, 64, 2)}
    assert [r[0] for r in rows] == ["fwd", "bwd"] and rows[1][4] == 270.0 and e.fwd_sm90 is None
    e2, _ = tuner.entry_from("bf16", 64, False, 3000, [((128, 64, 4), 300.0), ((64, 64, 4), 330.0)], [])
    assert e2.fwd == (64, 64, 4) and e2.bwd_schedule is None
    merged = tuner.merge({e.key: e}, [e2])[e.key]   # a forward-only run keeps the backward already on file
    assert merged.fwd == (64, 64, 4) and merged.bwd_schedule == "split"
    # The Hopper forward's (block_m, block_n, mainloop) is chosen the same way and kept by a run that did not
    # measure it.
    e3, rows = tuner.entry_from("bf16", 64, False, 3000, [], [],
                                [((128, 128, "serial"), 400.0), ((192, 96, "overlap"), 450.0)])
    assert e3.fwd_sm90 == (192, 96, "overlap") and e3.fwd is None and rows == [
        ("fwd_sm90", "sm90 128x128 serial", 400.0, "sm90 192x96 overlap", 450.0)]
    e4, _ = tuner.entry_from("bf16", 64, False, 3000, [((128, 64, 4), 300.0)], [])
    assert tuner.merge({e3.key: e3}, [e4])[e3.key].fwd_sm90 == (192, 96, "overlap")


def _cli(*args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_tune_help_and_no_gpu(tmp_path):
    r = _cli("tune", "--help")
    assert r.returncode == 0 and "--budget-minutes" in r.stdout and "--seqlen" in r.stdout
    if not __import__("torch").cuda.is_available():
        r = _cli("tune", "--hdim", "64", "--out", str(tmp_path / "t.json"))
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr
        assert not (tmp_path / "t.json").exists()


def test_generate_builds_the_tuned_kernels(dirs, tmp_path):
    write(dirs[0], [ENTRY, dict(ENTRY, seqlen=8192, fwd=[128, 16, 4])])
    names = {t.name for t in tuning.tuned_traits(ARCH, ("bf16",), [128, 120], ("fwd", "bwd"))}
    assert {"fwd_sm80_bf16_hd128_m128n32_w4_li_pv2_lean_sm90a", "fwd_sm80_bf16_hd128p_m128n32_w4_li_pv2_lean_sm90a",
            "fwd_sm80_bf16_hd128_m128n16_w4_li_pv2_lean_sm90a", "bwd_dq_sm80_bf16_hd128_m64n64_w8_s2_sm90a",
            "bwd_dkdv_atomicdq_sm80_bf16_hd128_m64n64_w8_s1_sm90a"} <= names
    assert not tuning.tuned_traits("sm_80", ("bf16",), [128]) and not tuning.tuned_traits(ARCH, ("fp16",), [128])
    drop = {t.name for t in tuning.tuned_traits(ARCH, ("bf16",), [128], ("fwd",), dropout=(True,))}
    assert drop == {"fwd_sm80_bf16_hd128_m128n32_w4_dropout_li_pv2_lean_sm90a"}      # 16 columns cannot hold the mask
    r = _cli("generate", "--arch", ARCH, "--hdim", "128", "--dtype", "bf16", "--family", "fwd", "--no-compile",
             "--out", str(tmp_path / "gen"), env_extra={"FLASHGEN_TUNING_DIR": str(dirs[0])})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "gen" / ARCH).glob("*.cu")) == [
        "fwd_sm80_bf16_hd128_m128n16_w4_li_pv2_lean_sm90a.cu", "fwd_sm80_bf16_hd128_m128n32_w4_li_pv2_lean_sm90a.cu",
        "fwd_sm80_bf16_hd128_m128n64_w4_causal_li_pv2_lean_sm90a.cu", "fwd_sm80_bf16_hd128_m128n64_w4_li_pv2_lean_sm90a.cu",
        "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_causal_sm90a.cu",
        "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_ps_causal_sm90a.cu",   # the walk at short seqlens (default_set)
        "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_ps_sm90a.cu", "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_sm90a.cu",
        "fwd_sm90_bf16_hd128_m128n128_s2_ov_ps_causal_sm90a.cu",      # heuristics.FWD_SM90_SHAPE_TILES
        "fwd_sm90_bf16_hd128_m192n80_s3_ov_ps_sm90a.cu", "fwd_sm90_bf16_hd128_m192n80_s4_ov_causal_sm90a.cu",
        "fwd_sm90_bf16_hd128_m192n80_s4_ov_sm90a.cu"]


def _fake_compile(traits_dict):   # the tuner's compile step without NVRTC (runs in the pool's forked workers)
    failed = traits_dict["name"].startswith("bwd_dq_") and traits_dict["block_n"] == 64
    return traits_dict["name"], True, 0.0, "error: fake compile failure\n" if failed else None, {}


def test_tuner_pipeline_without_gpu(dirs, monkeypatch):
    """tune() with the GPU parts replaced: compile pool, budget, choice, file, merge, table."""
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    monkeypatch.setattr(dispatch, "device_arch", lambda i: ARCH)
    monkeypatch.setattr(dispatch, "device_name", lambda i: GPU)
    monkeypatch.setattr("flashgen.cli._compile_one", _fake_compile)
    fast = {(128, 32, 4): 330.0, (64, 64, 2): 280.0, (128, 176, "serial"): 600.0}

    def fake_fwd(arch, dtype, hdim, causal, seqlen, cands, ready, say, hopper=False):
        name = lambda t: (heuristics.fwd_sm90_traits(arch, dtype, hdim, causal, *t, seqlen=seqlen) if hopper
                          else heuristics.fwd_traits(arch, dtype, hdim, causal, t)).name
        return [(t, fast.get(t, 300.0) if name(t) in ready else None) for t in cands]

    def fake_bwd(arch, dtype, hdim, causal, seqlen, cands, ready, say):
        return [(s, t, fast.get(next(iter(t.values())), 250.0) if all(
            heuristics.bwd_traits(arch, dtype, hdim, causal, k, v).name in ready for k, v in t.items()) else None)
            for s, t in cands]
    monkeypatch.setattr(tuner, "measure_fwd", fake_fwd)
    monkeypatch.setattr(tuner, "measure_bwd", fake_bwd)
    lines = []
    out, entries = tuner.tune(hdims=[128], causals=[0], dtypes=["bf16"], seqlens=[2048, 8192], families=tuner.FAMILIES,
                              budget_minutes=5, jobs=2, out=None, say=lines.append)
    text = "\n".join(lines)
    assert out == tuning.user_file(GPU) and len(entries) == 2
    assert "bwd_dq_sm80_bf16_hd128_m64n64_w8_s2_sm90a: compile failed, candidate dropped" in text
    assert "| bf16 | 128 | no | 2048 | fwd | 128x64 w4 | 300 | 128x32 w4 | 330 | 1.10 |" in text
    # At 2048 the default is heuristics.FWD_SM90_SHAPE_TILES' choice, stages and walk included.
    assert "| bf16 | 128 | no | 2048 | fwd_sm90 | sm90 192x80 overlap s3 | 300 | sm90 128x176 serial | 600 | 2.00 |" in text
    # Fused 64x64 is the fastest backward; split 64x64 did not compile, so split keeps its table tiles.
    assert "| bf16 | 128 | no | 8192 | bwd | fused 64x128 s2 | 250 | fused 64x64 s2 | 280 | 1.12 |" in text
    assert fwd_tiles() == (128, 32, 4) and bwd_tiles("dkdv_atomic", seqlen=8192) == (64, 64, 2)
    assert dispatch.fwd_traits(ARCH, GPU, "bf16", 128, False, seqlen_q=2048, seqlen_k=2048, hopper=True).block_n == 176
    assert bwd_tiles("dq") == (64, 128, 2)
    data = json.loads(out.read_text())
    assert [e["seqlen"] for e in data["entries"]] == [2048, 8192] and data["gpu"] == GPU
    # A forward-only run of another head dim adds its entries and keeps these; budget 0 measures nothing.
    tuner.tune(hdims=[64], causals=[1], dtypes=["bf16"], seqlens=[2048], families=("fwd",), budget_minutes=5, jobs=2,
               out=None, say=lines.append)
    data = json.loads(out.read_text())
    assert [(e["hdim"], "bwd" in e) for e in data["entries"]] == [(64, False), (128, True), (128, True)]
    lines.clear()
    _, none = tuner.tune(hdims=[256], causals=[0], dtypes=["bf16"], seqlens=[2048], families=("fwd",),
                         budget_minutes=0, jobs=2, out=None, say=lines.append)
    assert none == [] and len(json.loads(out.read_text())["entries"]) == 3
    assert "budget of 0 min reached" in "\n".join(lines) and "0 of 1 keys measured" in lines[-1]
