"""NVRTC compiles real kernels; the disk cache survives concurrency, corruption and kills (CPU only)."""
import fcntl
import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codegen.arch import ARCHS
from codegen.traits import BwdPreTraits, FwdTraits
from flashgen import cache
from flashgen.errors import FlashgenCompileError

ROOT = Path(__file__).resolve().parent.parent
# Small kernels keep CPU compile time down; each still instantiates the full CuTe mainloop (30-50 s of NVRTC on the CI
# box), so only the tests that need a compile in flight use them.
SMALL = FwdTraits("sm_90a", "bf16", 32, 64, 64, 4, False, True)
SMALL_CAUSAL = FwdTraits("sm_90a", "fp16", 32, 64, 64, 4, True, False)
# The cache's bookkeeping (entries, hits, rebuilds, pruning) on a real kernel without CuTe's mainloop: the backward's
# preprocess, ~1 s to compile.
QUICK = BwdPreTraits("sm_90a", "bf16", 64)


def _child(code: str, env_cache: Path) -> subprocess.Popen:
    env = dict(os.environ, FLASHGEN_CACHE_DIR=str(env_cache), PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


_COMPILE = ("from codegen.traits import traits_from_name; from flashgen import cache; "
            "c, m, hit = cache.get_or_compile(traits_from_name({name!r})); print(m['cubin_sha256'], hit)")


@pytest.fixture(scope="module")
def compiled(cache_dir):
    cubin, meta, hit = cache.get_or_compile(QUICK.validate())
    return cubin, meta, hit


def test_compile_real_kernel(compiled):
    cubin, meta, hit = compiled
    assert cubin[:4] == b"\x7fELF"
    assert meta["resources"]["registers"] > 0
    assert meta["cubin_sha256"] == hashlib.sha256(cubin).hexdigest()
    assert "ptxas" in meta["log"]


def test_second_lookup_is_a_hit(compiled):
    t0 = time.perf_counter()
    cubin, meta, hit = cache.get_or_compile(QUICK)
    assert hit and time.perf_counter() - t0 < 2.0
    assert cubin == compiled[0]


def test_corrupt_entry_is_rebuilt_not_loaded(compiled):
    entry = cache.entry_for(QUICK)
    good = entry.cubin_path.read_bytes()
    entry.cubin_path.write_bytes(good[: len(good) // 2])       # truncated, as by a crash mid-copy
    assert cache.read_entry(entry) is None
    entry.meta_path.write_text("{not json")                   # corrupt metadata
    assert cache.read_entry(entry) is None
    cubin, meta, hit = cache.get_or_compile(QUICK)
    assert not hit and cubin == good and cache.read_entry(entry) is not None


def test_concurrent_compiles_build_once(tmp_path):
    """Two processes asking for the same missing kernel: one compiles, the other waits and gets a hit."""
    procs = [_child(_COMPILE.format(name=SMALL_CAUSAL.name), tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    shas = {o[0].split()[0] for o in outs}
    hits = sorted(o[0].split()[1] for o in outs)
    assert len(shas) == 1 and hits == ["False", "True"], outs
    assert sum("compiling" in o[1] for o in outs) == 1


def test_kill_mid_compile_leaves_no_entry(tmp_path):
    p = _child(_COMPILE.format(name=SMALL.name), tmp_path)
    time.sleep(4)
    p.send_signal(signal.SIGKILL)
    p.wait()
    entry_dir = tmp_path
    assert not list(entry_dir.glob("*.json")), "a killed compile must not leave a complete-looking entry"
    for lock in entry_dir.glob("*.lock"):      # the lock died with the process
        with open(lock) as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_partial_write_is_detected(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    entry = cache.entry_for(SMALL)
    entry.cubin_path.parent.mkdir(parents=True, exist_ok=True)
    entry.cubin_path.write_bytes(b"\x7fELF" + b"\0" * 100)
    entry.meta_path.write_text(json.dumps({"cubin_size": 5000, "cubin_sha256": "0" * 64}))
    assert cache.read_entry(entry) is None


def test_compile_error_names_kernel_errors_and_source(tmp_path, monkeypatch):
    import shutil
    tdir = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", tdir)
    hdr = tdir / "include" / "flashgen" / "fwd_sm80.cuh"
    # An #error is catastrophic: NVRTC stops there instead of parsing CuTe first (~25 s).
    hdr.write_text("#error this is not C++\n" + hdr.read_text())
    monkeypatch.setenv("FLASHGEN_TEMPLATES_DIR", str(tdir))
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FlashgenCompileError) as ei:
        cache.get_or_compile(SMALL)
    msg = str(ei.value)
    assert SMALL.name in msg and "error" in msg
    assert ei.value.source_path in msg and Path(ei.value.source_path).exists()
    # Parallel builds hand it across processes: it must pickle with its message and fields.
    back = pickle.loads(pickle.dumps(ei.value))
    assert str(back) == msg and back.kernel == SMALL.name and back.source_path == ei.value.source_path


@pytest.mark.parametrize("arch", sorted(a for a in ARCHS if a != "sm_90a"))
def test_compiles_for_every_arch(arch, cache_dir):
    """A representative kernel compiles for every supported target, with no GPU."""
    t = FwdTraits(arch, "fp16", 64, 64, 64, 4, True, True).validate()
    cubin, meta, _ = cache.get_or_compile(t)
    assert cubin[:4] == b"\x7fELF" and meta["resources"]["registers"] > 0


def test_compiles_every_backward_family(cache_dir):
    """One real kernel of each backward family (two CuTe compiles in parallel, then the plain preprocess)."""
    from concurrent.futures import ProcessPoolExecutor

    from codegen import heuristics
    from flashgen.cli import _compile_one
    kinds = ("dkdv_atomic", "dq", "pre")
    traits = [heuristics.bwd_traits("sm_90a", "bf16", 32, False, kind) for kind in kinds]
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile_one, [t.to_dict() for t in traits]))
    for t, (name, hit, secs, err, res) in zip(traits, results):
        assert err is None, err
        assert name == t.name and res["registers"] > 0
        cubin, meta, hit = cache.get_or_compile(t)
        assert hit and cubin[:4] == b"\x7fELF"
    # The fused schedule's dQ convert kernel ships in the dK/dV cubin, under the kernel's name + "_convert_dq".
    cubin, _, _ = cache.get_or_compile(traits[0])
    assert (traits[0].name + "_convert_dq").encode() in cubin


def test_cache_key_follows_the_included_headers_only(tmp_path, monkeypatch):
    """An edit to a header changes the cache key of the kernels that include it, directly or through another
    header, and of no other kernel (no compile: keys only)."""
    import shutil
    from codegen import heuristics
    tdir = tmp_path / "templates"
    shutil.copytree(ROOT / "templates", tdir)
    monkeypatch.setenv("FLASHGEN_TEMPLATES_DIR", str(tdir))
    kernels = {"sm80": heuristics.fwd_traits("sm_90a", "bf16", 64, False),
               "sm90": heuristics.fwd_sm90_traits("sm_90a", "bf16", 64, False),
               "pre": heuristics.bwd_traits("sm_90a", "bf16", 64, False, "pre"),
               "sm90bwd": heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, False)}
    keys = lambda: {k: cache.entry_for(t).key for k, t in kernels.items()}
    hdr = tdir / "include" / "flashgen"
    before = keys()
    (hdr / "fwd_sm90.cuh").write_text((hdr / "fwd_sm90.cuh").read_text() + "\n// an edit\n")
    after = keys()
    assert after["sm90"] != before["sm90"] and after["sm80"] == before["sm80"] and after["pre"] == before["pre"]
    assert after["sm90bwd"] == before["sm90bwd"]   # the Hopper kernels share sm90_common.cuh, not each other
    (hdr / "sm90_common.cuh").write_text((hdr / "sm90_common.cuh").read_text() + "\n// an edit\n")
    after = keys()
    assert after["sm90"] != before["sm90"] and after["sm90bwd"] != before["sm90bwd"] and after["sm80"] == before["sm80"]
    (hdr / "dropout.cuh").write_text((hdr / "dropout.cuh").read_text() + "\n// an edit\n")   # via sm80_common.cuh
    again = keys()
    assert again["sm90"] != after["sm90"] and again["sm80"] != after["sm80"] and again["pre"] == after["pre"]


def test_prune_keeps_current_entries_and_drops_stale_ones(compiled):
    """`flashgen cache prune`: the compiled entry stays; one from an older render of the same kernel (another key),
    one with unreadable metadata and one naming traits this version cannot build go, with their cubins."""
    entry = cache.entry_for(QUICK)
    d = entry.meta_path.parent
    stale = d / f"{QUICK.name}-00000000000000000000"
    meta = json.loads(entry.meta_path.read_text())
    stale.with_suffix(".json").write_text(json.dumps({**meta, "key": "00000000000000000000"}))
    stale.with_suffix(".cubin").write_bytes(entry.cubin_path.read_bytes())
    (d / "garbage-11111111111111111111.json").write_text("{not json")
    (d / "unknown-22222222222222222222.json").write_text(json.dumps({"traits": {"family": "no_such_family"}}))
    from flashgen.cli import main
    assert main(["cache", "prune"]) == 0
    assert cache.read_entry(entry) is not None
    assert not stale.with_suffix(".json").exists() and not stale.with_suffix(".cubin").exists()
    assert not (d / "garbage-11111111111111111111.json").exists()
    assert not (d / "unknown-22222222222222222222.json").exists()
    assert entry.meta_path in set(d.glob("*.json"))   # other tests' entries in the shared cache stay too
