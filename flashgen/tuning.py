"""Tuning files: tiles and backward schedule measured by `flashgen tune` on one GPU, preferred by the dispatcher
over the heuristic tables in codegen/heuristics.py.

A file holds one GPU's measurements for one flashgen version:

    {"format": 1, "flashgen_version": "0.1.0", "gpu": "NVIDIA H100 80GB HBM3", "arch": "sm_90a",
     "created": "2026-11-30T12:00:00", "entries": [
        {"dtype": "bf16", "hdim": 128, "causal": false, "seqlen": 2048,
         "fwd": [128, 64, 4],                                   # block_m, block_n, num_warps
         "fwd_sm90": [128, 128, "serial"],                      # Hopper forward: block_m, block_n, mainloop[, stages]
         "bwd": {"schedule": "fused", "tiles": {"dkdv_atomic": [64, 128, 2], "dkdv": [64, 128, 2], "dq": [64, 128, 2]}},
         "measured": {...}}]}                                   # TFLOP/s of default and best, for the record

An entry's key is (dtype, head-dim bucket, causal, seqlen bucket); "fwd", "fwd_sm90" and "bwd" are each optional
("fwd" is the SM80 path's forward, "fwd_sm90" the Hopper forward's, which sm_90a runs where it applies).
Files are named after the GPU (`nvidia-h100-80gb-hbm3.json`) and looked up in the user directory
($FLASHGEN_TUNING_DIR, else ~/.cache/flashgen/tuning/, where `flashgen tune` writes) and then in the package's
tuning_data/ (shipped). A file that does not parse or fit the schema (corrupt), or that was written by another
flashgen version or for another GPU or arch (stale), is ignored with a TuningFileWarning; so is an entry whose
tiles the arch cannot run. Ignored means the dispatcher uses the heuristic tables, never an error: tuning is an
optimisation only.
"""
from __future__ import annotations

import json
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from codegen import heuristics
from codegen.arch import get_arch
from codegen.traits import DTYPES, HDIM_BUCKETS, TraitsError, bucket_for_head_dim

FORMAT = 1
SEQLEN_BUCKETS, seqlen_bucket = heuristics.SEQLEN_BUCKETS, heuristics.seqlen_bucket   # one definition
BWD_TUNED_KINDS = ("dkdv_atomic", "dkdv", "dq")


class TuningFileWarning(UserWarning):
    """A tuning file (or one of its entries) was ignored; dispatch uses the heuristic tables instead."""


def slug(gpu_name: str) -> str:
    """File-name form of a GPU name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"


def user_dir() -> Path:
    return Path(os.environ.get("FLASHGEN_TUNING_DIR") or Path.home() / ".cache" / "flashgen" / "tuning")


def shipped_dir() -> Path:
    return Path(__file__).resolve().parent / "tuning_data"


def user_file(gpu_name: str) -> Path:
    return user_dir() / f"{slug(gpu_name)}.json"


def shipped_file(gpu_name: str) -> Path:
    return shipped_dir() / f"{slug(gpu_name)}.json"


@dataclass
class Entry:
    dtype: str
    hdim: int                     # head-dim bucket
    causal: bool
    seqlen: int                   # seqlen bucket
    fwd: tuple[int, int, int] | None = None                  # block_m, block_n, num_warps
    fwd_sm90: tuple | None = None                            # Hopper forward: block_m, block_n, mainloop[, stages]
    bwd_schedule: str | None = None                          # "fused" | "split"
    bwd_tiles: dict[str, tuple[int, int, int]] = field(default_factory=dict)   # kind -> block_m, block_n, stages
    measured: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def key(self) -> tuple[str, int, bool, int]:
        return (self.dtype, self.hdim, self.causal, self.seqlen)

    @property
    def key_text(self) -> str:
        return f"{self.dtype} hdim {self.hdim} {'causal' if self.causal else 'non-causal'} seqlen <= {self.seqlen}" + (
            "" if self.seqlen < SEQLEN_BUCKETS[-1] else " (and longer)")

    @property
    def origin(self) -> str:
        """Where the decision came from, for `flashgen explain`."""
        return f"{self.path} [{self.key_text}]"

    def to_json(self) -> dict:
        d = {"dtype": self.dtype, "hdim": self.hdim, "causal": self.causal, "seqlen": self.seqlen}
        if self.fwd:
            d["fwd"] = list(self.fwd)
        if self.fwd_sm90:
            d["fwd_sm90"] = list(self.fwd_sm90)
        if self.bwd_schedule or self.bwd_tiles:
            d["bwd"] = {"schedule": self.bwd_schedule, "tiles": {k: list(v) for k, v in self.bwd_tiles.items()}}
        if self.measured:
            d["measured"] = self.measured
        return d


@dataclass
class Table:
    path: Path
    flashgen_version: str
    gpu: str
    arch: str
    entries: dict[tuple[str, int, bool, int], Entry]


class _Corrupt(ValueError):
    pass


def _tiles(v, where: str) -> tuple[int, int, int]:
    if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                        for x in v)):
        raise _Corrupt(f"{where} must be a list of 3 positive integers, got {v!r}")
    return tuple(v)


def _is_bucket(hdim) -> bool:
    try:
        return isinstance(hdim, int) and not isinstance(hdim, bool) and bucket_for_head_dim(hdim) == hdim
    except TraitsError:
        return False


def _entry(e, i: int) -> Entry:
    where = f"entries[{i}]"
    if not isinstance(e, dict):
        raise _Corrupt(f"{where} must be an object")
    unknown = set(e) - {"dtype", "hdim", "causal", "seqlen", "fwd", "fwd_sm90", "bwd", "measured"}
    if unknown:
        raise _Corrupt(f"{where} has unknown fields {sorted(unknown)}")
    if e.get("dtype") not in DTYPES:
        raise _Corrupt(f"{where}.dtype must be one of {DTYPES}")
    if not _is_bucket(e.get("hdim")):
        raise _Corrupt(f"{where}.hdim must be a head-dim bucket {HDIM_BUCKETS}")
    if not isinstance(e.get("causal"), bool):
        raise _Corrupt(f"{where}.causal must be true or false")
    if e.get("seqlen") not in SEQLEN_BUCKETS:
        raise _Corrupt(f"{where}.seqlen must be a seqlen bucket {SEQLEN_BUCKETS}")
    out = Entry(e["dtype"], e["hdim"], e["causal"], e["seqlen"])
    if "fwd" in e:
        out.fwd = _tiles(e["fwd"], f"{where}.fwd")
    if "fwd_sm90" in e:
        v = e["fwd_sm90"]
        # stages is optional (the table's where absent): `flashgen tune` writes three, a measured choice may add it
        if not (isinstance(v, list) and len(v) in (3, 4) and v[2] in heuristics.FWD_SM90_MAINLOOPS
                and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v[:2] + v[3:])):
            raise _Corrupt(f"{where}.fwd_sm90 must be [block_m, block_n, mainloop] or [block_m, block_n, mainloop, "
                           f"stages] with a mainloop from {tuple(heuristics.FWD_SM90_MAINLOOPS)}, got {v!r}")
        out.fwd_sm90 = tuple(v)
    if "bwd" in e:
        b = e["bwd"]
        if not isinstance(b, dict) or b.get("schedule") not in heuristics.BWD_SCHEDULES + (None,) \
                or not isinstance(b.get("tiles", {}), dict) or set(b.get("tiles", {})) - set(BWD_TUNED_KINDS):
            raise _Corrupt(f"{where}.bwd must be {{'schedule': 'fused'|'split', 'tiles': {{kind: [m, n, stages]}}}} "
                           f"with kinds from {BWD_TUNED_KINDS}")
        out.bwd_schedule = b.get("schedule")
        out.bwd_tiles = {k: _tiles(v, f"{where}.bwd.tiles.{k}") for k, v in b.get("tiles", {}).items()}
    if not isinstance(e.get("measured", {}), dict):
        raise _Corrupt(f"{where}.measured must be an object")
    out.measured = e.get("measured", {})
    return out


def parse(data, path: Path) -> Table:
    """A Table from a file's decoded JSON; raises _Corrupt naming the first thing that does not fit the schema."""
    if not isinstance(data, dict):
        raise _Corrupt("top level must be an object")
    if data.get("format") != FORMAT:
        raise _Corrupt(f"format must be {FORMAT}, got {data.get('format')!r}")
    for k in ("flashgen_version", "gpu", "arch"):
        if not isinstance(data.get(k), str):
            raise _Corrupt(f"{k!r} must be a string")
    if not isinstance(data.get("entries"), list):
        raise _Corrupt("'entries' must be a list")
    entries = {}
    for i, e in enumerate(data["entries"]):
        entry = _entry(e, i)
        if entry.key in entries:
            raise _Corrupt(f"entries[{i}] repeats the key {entry.key_text}")
        entry.path = path
        entries[entry.key] = entry
    return Table(path, data["flashgen_version"], data["gpu"], data["arch"], entries)


_warned: set[str] = set()


def _warn(message: str) -> None:
    if message not in _warned:   # once per file and reason per process
        _warned.add(message)
        warnings.warn(message, TuningFileWarning, stacklevel=4)


def _version() -> str:
    from . import __version__
    return __version__


def _check_entry(entry: Entry, arch: str) -> None:
    """Raises TraitsError when the arch cannot run the entry's tiles (the dispatcher would fail on them)."""
    if entry.fwd:
        heuristics.fwd_traits(arch, entry.dtype, entry.hdim, entry.causal, entry.fwd)
    if entry.fwd_sm90 and fwd_sm90_traits(arch, entry, entry.hdim) is None:
        raise TraitsError(f"{arch} has no Hopper forward for head dim {entry.hdim}")
    for kind, tiles in entry.bwd_tiles.items():
        heuristics.bwd_traits(arch, entry.dtype, entry.hdim, entry.causal, kind, tiles)


def fwd_sm90_traits(arch: str, entry: Entry, head_dim: int):
    """The Hopper forward an entry's fwd_sm90 picks for a runtime head dim at the entry's seqlen bucket (which decides
    the walk; None: the arch has none; raises TraitsError when the traits do not validate)."""
    return heuristics.fwd_sm90_traits(arch, entry.dtype, head_dim, entry.causal, *entry.fwd_sm90, seqlen=entry.seqlen)


def read(path: Path, gpu_name: str, arch: str | None = None) -> Table | None:
    """The usable part of one file for `gpu_name` (and `arch`, when given), or None with a warning saying why not."""
    ignore = f"flashgen: ignoring tuning file {path}"
    try:
        table = parse(json.loads(Path(path).read_text()), Path(path))
        get_arch(table.arch)
    except json.JSONDecodeError as e:
        _warn(f"{ignore}: corrupt, not valid JSON ({e}); using the heuristic tables")
        return None
    except (_Corrupt, ValueError) as e:
        _warn(f"{ignore}: corrupt, {e}; using the heuristic tables")
        return None
    except OSError as e:
        _warn(f"{ignore}: unreadable ({e}); using the heuristic tables")
        return None
    # Another version's kernels may differ (tiles measured on them mean little, or name kernels it lacks).
    stale = (f"written by flashgen {table.flashgen_version}, this is flashgen {_version()}"
             if table.flashgen_version != _version()
             else f"measured on {table.gpu!r}, this device is {gpu_name!r}" if table.gpu != gpu_name
             else f"measured for {table.arch}, this device runs {arch}" if arch is not None and table.arch != arch
             else None)
    if stale:
        _warn(f"{ignore}: stale, {stale} (re-run `flashgen tune`); using the heuristic tables")
        return None
    for key, entry in list(table.entries.items()):
        try:
            _check_entry(entry, table.arch)
        except TraitsError as e:
            _warn(f"flashgen: tuning file {path}: skipping the entry for {entry.key_text}: {e}")
            del table.entries[key]
    return table


_tables: dict[tuple[str, str | None], Table | None] = {}


def table(gpu_name: str, arch: str | None = None) -> Table | None:
    """The tuning table for a GPU: the user file if it exists and is usable, else the shipped one, else None.
    Read once per process (reload() forgets)."""
    key = (gpu_name, arch)
    if key not in _tables:
        found = None
        for path in (user_file(gpu_name), shipped_file(gpu_name)):
            if path.is_file():
                found = read(path, gpu_name, arch)
                if found is not None:
                    break
        _tables[key] = found
    return _tables[key]


def lookup(gpu_name: str | None, arch: str | None, dtype: str, head_dim: int, causal: bool, seqlen_q: int = 0,
           seqlen_k: int = 0) -> Entry | None:
    """The entry for one call (head dim and seqlens as the call has them), or None: use the heuristic tables."""
    if not gpu_name:
        return None
    t = table(gpu_name, arch)
    if t is None:
        return None
    return t.entries.get((dtype, bucket_for_head_dim(head_dim), bool(causal), seqlen_bucket(seqlen_q, seqlen_k)))


def tables_for_arch(arch: str) -> list[Table]:
    """The usable tables of every GPU that has a tuning file (user or shipped) for `arch`."""
    gpus = set()
    for d in (user_dir(), shipped_dir()):
        for path in sorted(d.glob("*.json")) if d.is_dir() else []:
            try:
                data = json.loads(path.read_text())
                if data["arch"] == arch:
                    gpus.add(data["gpu"])
            except Exception:
                pass   # table() says what is wrong with it when that GPU is in use
    return [t for t in (table(g, arch) for g in sorted(gpus)) if t is not None]


def hand_set_sm90_choices(arch: str) -> list[tuple]:
    """(dtype, head-dim bucket, causal, choice) of the Hopper forward choices in `arch`'s tuning files that name their
    K/V stages: set by hand from a measurement (`flashgen tune` does not time stages), so no tune checked their output."""
    return sorted({(e.dtype, e.hdim, e.causal, e.fwd_sm90) for t in tables_for_arch(arch)
                   for e in t.entries.values() if e.fwd_sm90 and len(e.fwd_sm90) > 3})


def tuned_traits(arch: str, dtypes, head_dims, families=("fwd", "bwd"), dropout=(False,)) -> list:
    """The kernels tuning files for `arch` make the dispatcher pick (beyond the heuristic tables), for
    `flashgen generate` and the GPU tests' prebuild. Dropout variants that do not fit the tuned tiles are left out
    (dispatch falls back to the table's for them)."""
    out = []
    for t in tables_for_arch(arch):
        for e in t.entries.values():
            for hd in (h for h in head_dims if isinstance(h, int) and e.dtype in dtypes
                       and bucket_for_head_dim(h) == e.hdim):
                for drop in dropout:
                    try:
                        if "fwd" in families and e.fwd:
                            out.append(heuristics.fwd_traits(arch, e.dtype, hd, e.causal, e.fwd, dropout=drop))
                    except TraitsError:
                        pass
                    if "fwd" in families and e.fwd_sm90 and not drop:   # the Hopper forward has no dropout
                        out += [t for t in (fwd_sm90_traits(arch, e, hd),) if t is not None]
                    for kind, tiles in (e.bwd_tiles.items() if "bwd" in families else ()):
                        try:
                            out.append(heuristics.bwd_traits(arch, e.dtype, hd, e.causal, kind, tiles, dropout=drop))
                        except TraitsError:
                            pass
    return out


def reload() -> None:
    """Forget the files read so far (and the warnings given), e.g. after `flashgen tune` wrote one."""
    _tables.clear()
    _warned.clear()


def write(path: Path, gpu_name: str, arch: str, entries) -> None:
    """Write a tuning file atomically (a reader never sees half a file), entries sorted by key."""
    head = {"format": FORMAT, "flashgen_version": _version(), "gpu": gpu_name, "arch": arch,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    rows = [json.dumps(e.to_json()) for e in sorted(entries, key=lambda e: e.key)]   # one line per entry
    text = ("{\n" + "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
            + ' "entries": [\n' + ",\n".join(f"  {r}" for r in rows) + "\n ]\n}\n")
    from .cache import _atomic_write
    _atomic_write(Path(path), text.encode())
