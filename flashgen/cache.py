"""On-disk cubin cache.

An entry is <dir>/<kernel name>-<key>.cubin plus a .json beside it with the cubin's sha256, the compile
log and the ptxas resource report. The key hashes everything that changes the cubin: the rendered source,
the headers it includes (templates hash, CUTLASS version), NVRTC version, options and arch.
Writes go to a temp file and are renamed into place, the .json last, so a reader never sees half an entry;
a per-entry file lock makes concurrent processes compile once; an entry whose cubin does not match its
recorded hash (truncated, corrupted) is rebuilt, never loaded.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from codegen.render import headers_hash, render
from codegen.traits import KernelTraits

from . import compiler

log = logging.getLogger("flashgen")


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHGEN_CACHE_DIR") or Path.home() / ".cache" / "flashgen")


def cache_key(source: str, arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, headers_hash(source), arch, " ".join(compiler.BASE_OPTIONS),
                 compiler.nvrtc_version(), compiler.cutlass_version(), _cccl_version()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:20]


def _cccl_version() -> str:
    for inc in compiler.include_dirs():
        p = Path(inc) / "cuda" / "version"
        if p.exists():
            import re
            m = re.search(r"#\s*define\s+CCCL_VERSION\s+(\d+)", p.read_text())
            if m:
                return m.group(1)
    return "unknown"


@dataclass
class Entry:
    name: str
    key: str
    cubin_path: Path
    meta_path: Path
    source_path: Path

    @property
    def lock_path(self) -> Path:
        return self.cubin_path.with_suffix(".lock")


def entry_for(traits: KernelTraits, source: str | None = None) -> Entry:
    source = render(traits) if source is None else source
    key = cache_key(source, traits.arch)
    d = cache_dir()
    stem = f"{traits.name}-{key}"
    return Entry(traits.name, key, d / f"{stem}.cubin", d / f"{stem}.json", d / "src" / f"{stem}.cu")


def read_entry(entry: Entry) -> tuple[bytes, dict] | None:
    """(cubin, meta) when the entry is complete and intact, else None."""
    try:
        meta = json.loads(entry.meta_path.read_text())
        cubin = entry.cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if len(cubin) != meta.get("cubin_size") or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
        return None
    return cubin, meta


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def get_or_compile(traits: KernelTraits, *, jit_log: bool = True) -> tuple[bytes, dict, bool]:
    """(cubin, meta, was_cached). Compiles under the entry's lock when missing or damaged."""
    source = render(traits)
    entry = entry_for(traits, source)
    hit = read_entry(entry)
    if hit is not None:
        return hit[0], hit[1], True
    with _locked(entry.lock_path):
        hit = read_entry(entry)   # another process may have built it while we waited
        if hit is not None:
            return hit[0], hit[1], True
        _atomic_write(entry.source_path, source.encode())
        if jit_log:
            print(f"flashgen: compiling {traits.name} (first use) ...", file=sys.stderr, flush=True)
        result = compiler.compile_source(source, traits.name, traits.arch, str(entry.source_path))
        if jit_log:
            print(f"flashgen: compiled {traits.name} in {result.seconds:.1f} s", file=sys.stderr, flush=True)
        meta = {
            "name": traits.name, "key": entry.key, "traits": traits.to_dict(),
            "cubin_size": len(result.cubin), "cubin_sha256": hashlib.sha256(result.cubin).hexdigest(),
            "compile_seconds": round(result.seconds, 2), "resources": result.resources,
            "nvrtc": compiler.nvrtc_version(), "cutlass": compiler.cutlass_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "log": result.log,
        }
        _atomic_write(entry.cubin_path, result.cubin)
        _atomic_write(entry.meta_path, json.dumps(meta, indent=1).encode())
    return result.cubin, meta, False


def is_cached(traits: KernelTraits) -> bool:
    return read_entry(entry_for(traits)) is not None


def cached_meta(traits: KernelTraits) -> dict | None:
    hit = read_entry(entry_for(traits))
    return hit[1] if hit else None


def info() -> dict:
    d = cache_dir()
    metas = sorted(d.glob("*.json")) if d.exists() else []
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.exists() else 0
    return {"dir": str(d), "entries": len(metas), "bytes": size}


def prune() -> tuple[int, int]:
    """Remove entries that no current render maps to (templates, headers, compiler or CUTLASS changed since they were
    compiled) and damaged ones; keep the rest. Returns (kept, removed)."""
    from codegen.traits import traits_from_dict
    d = cache_dir()
    kept = removed = 0
    for meta_path in sorted(d.glob("*.json")) if d.exists() else []:
        try:
            meta = json.loads(meta_path.read_text())
            entry = entry_for(traits_from_dict(meta["traits"]))
            ok = entry.meta_path == meta_path and read_entry(entry) is not None
        except Exception:   # unreadable, or traits this version no longer has
            ok = False
        if ok:
            kept += 1
            continue
        removed += 1
        stem = meta_path.with_suffix("")
        for path in (meta_path, stem.with_suffix(".cubin"), stem.with_suffix(".lock"), d / "src" / f"{stem.name}.cu"):
            path.unlink(missing_ok=True)
    return kept, removed


def clear() -> int:
    d = cache_dir()
    n = len(list(d.glob("*.cubin"))) if d.exists() else 0
    if d.exists():
        shutil.rmtree(d)
    return n
