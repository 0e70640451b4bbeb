"""flashgen command line: generate, list, inspect, explain, tune, cache, check."""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from codegen import heuristics
from codegen.arch import ARCHS, DEFAULT_ARCH, arch_for_capability, blocks_per_sm, get_arch
from codegen.render import check_generated, generated_dir, write_generated
from codegen.traits import HDIM_BUCKETS, MAX_HDIM, KernelTraits, TraitsError, traits_from_name

from . import cache, tuning


def _local_device():
    """(driver module, device 0) through the driver API (no torch import), or None without a GPU."""
    try:
        from cuda.bindings import driver as drv
        if drv.cuInit(0)[0] != drv.CUresult.CUDA_SUCCESS:
            return None
        err, dev = drv.cuDeviceGet(0)
        return (drv, dev) if err == drv.CUresult.CUDA_SUCCESS else None
    except Exception:
        return None


def local_arch() -> str | None:
    """The local GPU's compile target, or None without a GPU."""
    local = _local_device()
    if local is None:
        return None
    drv, dev = local
    attr = drv.CUdevice_attribute
    major = drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)[1]
    minor = drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)[1]
    try:
        return arch_for_capability(major, minor).name
    except ValueError:
        return None


def local_gpu_name() -> str | None:
    """The local GPU's name (what tuning files are keyed by), or None without a GPU."""
    local = _local_device()
    if local is None:
        return None
    drv, dev = local
    err, name = drv.cuDeviceGetName(256, dev)
    return name.split(b"\0", 1)[0].decode() if err == drv.CUresult.CUDA_SUCCESS else None


def _select(args) -> list[KernelTraits]:
    archs = [get_arch(a).name for a in (args.arch or [local_arch() or DEFAULT_ARCH])]
    dtypes = args.dtype or ["fp16", "bf16"]
    hdims = args.hdim or list(HDIM_BUCKETS)
    out = []
    families = tuple(getattr(args, "family", None) or ("fwd", "bwd"))
    dropout = (False, True) if getattr(args, "dropout", False) else (False,)
    for arch in archs:
        out += heuristics.default_set(arch, dtypes=dtypes, head_dims=hdims, families=families, dropout=dropout)
        # What the arch's tuning files make dispatch pick instead of the table.
        out += tuning.tuned_traits(arch, dtypes, [h for h in hdims if isinstance(h, int)], families, dropout)
    return list({t.name: t for t in out}.values())


def _hdim_arg(text: str):
    """--hdim N or QK:V -> N or (QK, V); each a multiple of 8 in [8, MAX_HDIM]."""
    try:
        dims = tuple(int(x) for x in text.split(":"))
    except ValueError:
        dims = ()
    if len(dims) not in (1, 2) or any(d % 8 or not 8 <= d <= MAX_HDIM for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r}: head dims must be multiples of 8 in [8, {MAX_HDIM}], as N or "
                                         f"QK:V")
    return dims[0] if len(dims) == 1 or dims[0] == dims[1] else dims


# An NVRTC compile of a CuTe kernel peaks near 3.5 GB of host memory (SM80 backward, measured on the dev box).
COMPILE_BYTES = 4 << 30


def default_jobs() -> int:
    """Parallel compiles: one per CPU, fewer where the memory available would not hold that many compiles."""
    cpus = os.cpu_count() or 1
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return cpus
    return max(1, min(cpus, free // COMPILE_BYTES))


def _compile_one(traits_dict: dict) -> tuple[str, bool, float, str | None, dict]:
    from codegen.traits import traits_from_dict
    t = traits_from_dict(traits_dict)
    t0 = time.perf_counter()
    try:
        _, meta, hit = cache.get_or_compile(t, jit_log=False)
        return t.name, hit, time.perf_counter() - t0, None, meta.get("resources", {})
    except Exception as e:  # reported in the summary; the pool keeps going
        return t.name, False, time.perf_counter() - t0, str(e), {}


def cmd_generate(args) -> int:
    t0 = time.perf_counter()
    selected = _select(args)
    out = Path(args.out) if args.out else generated_dir()
    write_generated(selected, out)
    print(f"flashgen: rendered {len(selected)} kernels for {', '.join(sorted({t.arch for t in selected}))} "
          f"into {out}")
    if args.no_compile:
        return 0
    compiled = hits = 0
    failures = []
    jobs = args.jobs or default_jobs()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futs = [pool.submit(_compile_one, t.to_dict()) for t in selected]
        for i, fut in enumerate(as_completed(futs), 1):
            name, hit, secs, err, res = fut.result()
            if err:
                failures.append((name, err))
                state = "FAILED"
            elif hit:
                hits += 1
                state = "cache hit"
            else:
                compiled += 1
                state = f"compiled {secs:5.1f} s  regs {res.get('registers')} spills {res.get('spill_stores')} B"
            bar = "#" * (24 * i // len(futs))
            print(f"[{bar:<24}] {i:>3}/{len(futs)} {name}: {state}", flush=True)
    print(f"flashgen generate: {len(selected)} kernels, {compiled} compiled, {hits} cache hits, "
          f"{len(failures)} failures, {time.perf_counter() - t0:.1f} s wall ({jobs} jobs)")
    for name, err in failures:
        print(f"\n{err}", file=sys.stderr)
    return 1 if failures else 0


def _row(t: KernelTraits) -> str:
    meta = cache.cached_meta(t)
    if meta is None:
        return f"{t.name:<58} {'-':>5} {'-':>7} {t.smem_bytes() // 1024:>5}K {'-':>9}  not compiled"
    r = meta["resources"]
    arch = t.arch_info()
    blocks = blocks_per_sm(arch, t.num_threads, r.get("registers", 0), t.smem_bytes())
    occupancy = f"{blocks}x{t.num_threads // 32}w {100 * blocks * t.num_threads // arch.max_threads_per_sm:>2}%"
    return (f"{t.name:<58} {r.get('registers', 0):>5} {r.get('spill_stores', 0):>6}B {t.smem_bytes() // 1024:>5}K"
            f" {occupancy:>9}  cached ({meta['cubin_size'] // 1024} KB, {meta['compile_seconds']} s)")


def cmd_list(args) -> int:
    archs = args.arch or [local_arch() or DEFAULT_ARCH]
    # occupancy: resident blocks per SM x warps per block, and the share of the SM's thread slots they fill.
    print(f"{'kernel':<58} {'regs':>5} {'spills':>7} {'smem':>6} {'occupancy':>9}  cache")
    for a in archs:
        for t in heuristics.default_set(get_arch(a).name):
            print(_row(t))
    return 0


def cmd_inspect(args) -> int:
    try:
        t = traits_from_name(args.name)
    except TraitsError as e:
        print(f"flashgen: {e}", file=sys.stderr)
        return 2
    print(f"kernel: {t.name}\nfamily: {t.family}\ntemplate: templates/{t.template}")
    for k, v in t.to_dict().items():
        if k not in ("name", "family"):
            print(f"  {k}: {v}")
    print(f"  threads: {t.num_threads}\n  shared memory: {t.smem_bytes()} B")
    try:
        t.validate()
        print("valid for its arch: yes")
    except TraitsError as e:
        print(f"valid for its arch: NO ({e})")
    entry = cache.entry_for(t)
    meta = cache.cached_meta(t)
    if meta is None:
        print(f"cache: not compiled (would be {entry.cubin_path})")
        return 0
    print(f"cache: {entry.cubin_path} ({meta['cubin_size']} B, compiled in {meta['compile_seconds']} s "
          f"with NVRTC {meta['nvrtc']}, CUTLASS {meta['cutlass']})")
    print("resources: " + ", ".join(f"{k}={v}" for k, v in meta["resources"].items()))
    ptxas = [ln for ln in meta.get("log", "").splitlines() if "ptxas" in ln]
    if ptxas:
        print("ptxas report:\n  " + "\n  ".join(ptxas))
    return 0


def cmd_explain(args) -> int:
    from . import dispatch
    gpu = args.gpu or local_gpu_name()
    arch = args.arch or local_arch()
    if arch is None and gpu:   # a CPU user asking about another GPU: its tuning file says which arch it runs
        t = tuning.table(gpu)
        arch = t.arch if t else None
    arch = get_arch(arch or DEFAULT_ARCH).name
    try:
        lines = dispatch.explain(arch, gpu, args.dtype, args.hdim, args.causal, args.batch, args.heads, args.seqlen_q,
                                 args.seqlen_k or args.seqlen_q, args.backward_impl, args.deterministic,
                                 head_dim_v=args.hdim_v)
    except (TraitsError, ValueError) as e:
        print(f"flashgen: {e}", file=sys.stderr)
        return 2
    for ln in lines:
        name = ln.split(":")[0].strip()
        state = ""
        if name.startswith(("fwd_", "bwd_")):
            state = "  [cached]" if cache.cached_meta(traits_from_name(name)) else "  [not compiled]"
        print(ln + state)
    return 0


def cmd_tune(args) -> int:
    from . import tuner
    return tuner.main(args)


def cmd_cache(args) -> int:
    if args.action == "info":
        i = cache.info()
        print(f"cache dir: {i['dir']}\nentries: {i['entries']}\nsize: {i['bytes'] / 2**20:.1f} MiB")
    elif args.action == "prune":
        kept, removed = cache.prune()
        print(f"flashgen: kept {kept} cached kernels, removed {removed} stale or damaged ones in {cache.cache_dir()}")
    else:
        print(f"flashgen: removed {cache.clear()} cached kernels from {cache.cache_dir()}")
    return 0


def cmd_check(args) -> int:
    out = Path(args.out) if args.out else generated_dir()
    problems = check_generated(out)
    if problems:
        print(f"flashgen check: {out} is out of date ({len(problems)} problems); run `flashgen generate`:")
        for p in problems[:50]:
            print(f"  {p}")
        return 1
    print(f"flashgen check: {out} matches codegen + templates")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashgen", description="FlashAttention kernel generator (NVRTC + CuTe)")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", aliases=["build"], help="render the kernel set and compile it into the cache")
    g.add_argument("--arch", action="append", choices=sorted(ARCHS),
                   help=f"target arch (repeatable); default: the local GPU's, else {DEFAULT_ARCH}")
    g.add_argument("--hdim", action="append", type=_hdim_arg, metavar="N|QK:V",
                   help=f"head dims to cover (repeatable), multiples of 8 up to {MAX_HDIM}; QK:V for a V head dim of "
                        f"its own (e.g. 192:128); default: the buckets {HDIM_BUCKETS[0]}..{HDIM_BUCKETS[-1]}")
    g.add_argument("--dtype", action="append", choices=["fp16", "bf16"])
    g.add_argument("--family", action="append", choices=["fwd", "bwd"],
                   help="kernel families to cover (repeatable); default: forward and backward")
    g.add_argument("--dropout", action="store_true",
                   help="also the dropout variants (and the dropout mask kernel); otherwise they compile on first use")
    g.add_argument("--jobs", "-j", type=int, default=0,
                   help="parallel compiles (default: CPU count, fewer where free memory is short: ~4 GB each)")
    g.add_argument("--no-compile", action="store_true", help="render only")
    g.add_argument("--out", help="output dir for rendered sources (default: generated/)")
    g.set_defaults(func=cmd_generate)

    ls = sub.add_parser("list", help="kernels of the default set with their resource reports")
    ls.add_argument("--arch", action="append", choices=sorted(ARCHS))
    ls.set_defaults(func=cmd_list)

    ins = sub.add_parser("inspect", help="traits, cache state and ptxas report of one kernel")
    ins.add_argument("name")
    ins.set_defaults(func=cmd_inspect)

    ex = sub.add_parser("explain", help="which kernels the dispatcher picks for a problem, and why")
    ex.add_argument("--arch", choices=sorted(ARCHS), help=f"default: the local GPU's, else {DEFAULT_ARCH}")
    ex.add_argument("--dtype", choices=["fp16", "bf16"], default="bf16")
    ex.add_argument("--hdim", type=int, required=True)
    ex.add_argument("--hdim-v", type=int, help="head dim of v (and the output) when it differs from q's")
    ex.add_argument("--causal", action="store_true")
    ex.add_argument("--batch", type=int, default=1)
    ex.add_argument("--heads", type=int, default=1)
    ex.add_argument("--seqlen-q", type=int, default=1024)
    ex.add_argument("--seqlen-k", type=int, default=0, help="default: seqlen-q")
    ex.add_argument("--backward-impl", choices=["auto", "fused", "split"], default="auto")
    ex.add_argument("--deterministic", action="store_true")
    ex.add_argument("--gpu", help="GPU name whose tuning file applies, e.g. 'NVIDIA H100 80GB HBM3' "
                                  "(default: the local GPU's; none on a CPU machine)")
    ex.set_defaults(func=cmd_explain)

    tu = sub.add_parser("tune", help="time candidate tiles and schedules on the local GPU, write a tuning file",
                        description="Benchmark the candidate traits (forward tiles and warps; backward schedule, tiles "
                                    "and stages) per (dtype, head-dim bucket, causal, seqlen bucket) on the local GPU "
                                    "and write the winners to a tuning file that dispatch prefers over its tables.")
    tu.add_argument("--hdim", action="append", type=int, choices=list(HDIM_BUCKETS), metavar="N",
                    help="head-dim bucket (repeatable; default: 64 128 256)")
    tu.add_argument("--causal", action="append", type=int, choices=[0, 1], help="repeatable; default: 0 and 1")
    tu.add_argument("--dtype", action="append", choices=["fp16", "bf16"], help="repeatable; default: bf16")
    tu.add_argument("--seqlen", action="append", type=int, metavar="S",
                    help="sequence length to time, stored under its bucket (repeatable; default: 2048 8192)")
    tu.add_argument("--family", action="append", choices=["fwd", "fwd_sm90", "bwd"],
                    help="the SM80 path's forward, the Hopper forward (sm_90a), the backward; repeatable; default: all")
    tu.add_argument("--budget-minutes", type=float, default=20.0,
                    help="stop starting new keys (and compiles) after this long, write what was measured (default 20)")
    tu.add_argument("--jobs", "-j", type=int, default=0,
                    help="parallel compiles (default: CPU count, fewer where free memory is short: ~4 GB each)")
    tu.add_argument("--out", help="tuning file to write (merged with its entries when it is usable; default: "
                                  "the user tuning file for the local GPU, in $FLASHGEN_TUNING_DIR or "
                                  "~/.cache/flashgen/tuning/)")
    tu.set_defaults(func=cmd_tune)

    c = sub.add_parser("cache", help="cache info | clear | prune (drop entries the current sources no longer map to)")
    c.add_argument("action", choices=["info", "clear", "prune"])
    c.set_defaults(func=cmd_cache)

    ck = sub.add_parser("check", help="fail when generated/ differs from what codegen + templates render")
    ck.add_argument("--out")
    ck.set_defaults(func=cmd_check)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
