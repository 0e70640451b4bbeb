"""A/B of Hopper kernel variants in one process. A variant is the kernel's header (the repo's, or an experimental copy
given by --header) with -D defines, inlined into the rendered source of the kernel dispatch would run, compiled into a
cubin of its own and swapped in for dispatch's kernel; the base is the same header without defines.

    python benchmarks/ab_sm90.py compile --family bwd --header H --variant lpt=FLASHGEN_EXP_LPT=256 [--hdim ..]
    python benchmarks/ab_sm90.py compile --family fwd --variant pp=@m=128,@n=128,@mainloop=pingpong   (other tiles)
    python benchmarks/ab_sm90.py check   (the same arguments; variants vs the fp32 reference / the base, odd shapes)
    FLASHGEN_CACHE_DIR=D python benchmarks/ab_sm90.py seed --family bwd [--hdim ..]   (see below)
    python benchmarks/ab_sm90.py bench   (the same arguments) [--rounds 11] [--seqlen 2048 8192]
    python benchmarks/ab_sm90.py compile|seed|check|bench --dropout 0.1 ...   (the kernels with dropout; the ratio
        stays to SDPA CUDNN without dropout, as bench_attention.py --mode dropout's)
    ncu --profile-from-start off ... python benchmarks/ab_sm90.py profile   (one call each of cuDNN and every variant)

`compile` needs no GPU: run it on the dev box and carry --out (cubins compress ~10x) to the device. `bench` prints the
ratio to SDPA CUDNN per variant, with the base timed twice ("base", "base2") and the variants in random order each
round: identical kernels then agreed within ~1.5% on the H100, where a fixed order left them up to 4% apart.
bf16 (or --dtype fp16), 16k tokens, model dim 2048, as bench_attention.py.
A backward A/B also runs the forward and bwd_pre kernels dispatch picks (compiled on first use: ~20 s each on the
device); `seed` compiles them into flashgen's cache without a GPU, to carry along with --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import random
import sys
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GPU = "NVIDIA H100 80GB HBM3"   # whose tuning file picks the forward's tiles when compiling without a GPU
INCLUDE = {"fwd": "flashgen/fwd_sm90.cuh", "bwd": "flashgen/bwd_sm90.cuh"}
LAUNCH_ONLY = {"@split", "@group"}   # variant settings that change the launch, not the kernel


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["compile", "seed", "check", "bench", "profile"])
    ap.add_argument("--family", choices=["fwd", "bwd"], required=True)
    ap.add_argument("--header", help="the header to inline (default: the repo's)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DEF[,DEF..]",
                    help="a variant: its name and defines (X or X=V), e.g. lpt=FLASHGEN_EXP_LPT=256; @header=PATH "
                         "takes another header for it, and forward variants may set the tiles and the walk: "
                         "@m=128,@n=128,@mainloop=pingpong,@persistent=1,@stages=3 (with @force=1: dispatch's walk, "
                         "and its mainloop unless @mainloop names one, past the register estimate; @mainloop=serialpp, "
                         "the serial loop with ping-pong turns, needs docs/patches/fwd_serial_pingpong.patch's "
                         "header); backward variants the tiles: "
                         "@m=128,@n=128,@stages=2,@lse_smem=1,@early_dv=0,@dq_handoff=0,@dq_red=1; any variant @minblocks=2 "
                         "(the main entry's launch bounds ask for 2 CTAs per SM), @cluster=N (the main entry launches in clusters of N CTAs "
                         "along x: __cluster_dims__), @smem_extra=N (N more bytes of shared memory at "
                         "launch, for a header that uses them past kSmemBytes); @split=0 / @split=K: the base's "
                         "kernel with the split tail off / forced to K pieces (heuristics.FWD_SM90_SPLIT / "
                         "BWD_SM90_SPLIT); "
                         "@group=N: the base's kernel with causal tiles taken over head groups of N CTAs (0: the "
                         "natural order; heuristics.*_HEAD_GROUP_CTAS)")
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--bh", type=int, nargs=2, metavar=("BATCH", "HEADS"),
                    help="batch and heads for bench / profile (default: 16k tokens, model dim 2048)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout_p of every call: the kernels dispatch runs with dropout, and the variants' too")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=os.path.join(ROOT, ".gpucache", "ab"))
    args = ap.parse_args(argv)
    args.header = args.header or os.path.join(ROOT, "templates", "include", INCLUDE[args.family])
    args.defines = {"base": {}}
    for v in args.variant:
        name, _, defs = v.partition("=")
        args.defines[name] = dict((d.split("=", 1) + [""])[:2] for d in defs.split(",") if d)
    return args


def traits_for(family, hdim, causal, seqlen, tiles=None, dtype="bf16", dropout=False):
    """The kernel dispatch runs for the shape on the H100 (the forward's tiles come from its tuning file), or the
    forward with a variant's tiles ({"@m": .., "@n": .., "@mainloop": .., "@persistent": 0 / 1, "@stages": ..},
    each optional; "@force": 1 keeps dispatch's walk, and its mainloop unless "@mainloop" is given, and skips the
    traits' register estimate, so that ptxas decides whether the tiles fit). `dropout`: the kernels with dropout."""
    from codegen import heuristics
    from flashgen import dispatch
    if family == "fwd":
        if tiles and "@force" in tiles:   # dispatch's kernel with other tiles, past the traits' register estimate
            t = dispatch.fwd_traits("sm_90a", GPU, dtype, hdim, causal, dropout, seqlen_q=seqlen, seqlen_k=seqlen,
                                    hopper=True)
            t = dataclasses.replace(t, **{f: int(tiles[k]) for f, k in
                                          (("block_m", "@m"), ("block_n", "@n"), ("stages", "@stages")) if k in tiles})
            if "@mainloop" in tiles:   # another mainloop, past the estimate too ("serialpp": a patch's header only)
                loops = {**heuristics.FWD_SM90_MAINLOOPS, "serialpp": (False, True)}
                overlap, pingpong = loops[tiles["@mainloop"]]
                t = dataclasses.replace(t, overlap=overlap, pingpong=pingpong)
            # shared memory is still checked here (the launch would fail), registers are left to ptxas
            assert t.smem_bytes() <= t.arch_info().smem_per_block, f"{t.name}: {t.smem_bytes()} B of shared memory"
            return t
        if tiles and tiles.keys() & {"@m", "@n", "@mainloop", "@persistent"}:
            t = heuristics.fwd_sm90_traits("sm_90a", dtype, hdim, causal, int(tiles.get("@m", 0)) or None,
                                           int(tiles.get("@n", 0)) or None, tiles.get("@mainloop"),
                                           dropout=dropout, persistent=bool(int(tiles.get("@persistent", 0))))
        else:
            t = dispatch.fwd_traits("sm_90a", GPU, dtype, hdim, causal, dropout, seqlen_q=seqlen, seqlen_k=seqlen,
                                    hopper=True)
        if tiles and "@stages" in tiles:
            t = dataclasses.replace(t, stages=int(tiles["@stages"])).validate()
        return t
    if tiles:
        base = heuristics.bwd_sm90_traits("sm_90a", dtype, hdim, causal, dropout=dropout)
        flag = lambda k: bool(int(tiles[k])) if k in tiles else None
        return heuristics.bwd_sm90_traits("sm_90a", dtype, hdim, causal, tiles=(
            int(tiles.get("@m", base.block_m)), int(tiles.get("@n", base.block_n)),
            int(tiles.get("@stages", base.stages))), lse_smem=flag("@lse_smem"), early_dv=flag("@early_dv"),
            dq_handoff=flag("@dq_handoff"), dq_red=flag("@dq_red"), dropout=dropout)
    return heuristics.bwd_sm90_traits("sm_90a", dtype, hdim, causal, dropout=dropout)


def torch_dtype(name: str):
    """torch's dtype for a flashgen dtype name ("bf16", "fp16")."""
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def code_of(name, args):
    """The variant whose cubin `name` runs: base2 and launch-only variants (@split, @group) run the base's."""
    return "base" if name == "base2" or not set(args.defines[name]) - LAUNCH_ONLY else name


def tiles_of(args, name):
    """A variant's tile settings (the defines whose names start with @, but @header and the launch-only ones)."""
    return {k: v for k, v in args.defines[code_of(name, args)].items()
            if k.startswith("@") and k != "@header" and k not in LAUNCH_ONLY}


def jobs_of(args):
    """(variant, traits) pairs to compile, each kernel once."""
    seen = {}
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                for name in {code_of(n, args) for n in args.defines}:
                    t = traits_for(args.family, hdim, causal, s, tiles_of(args, name), args.dtype, args.dropout > 0)
                    seen[(name, t.name)] = t
    return [(name, t) for (name, _), t in seen.items()]


def cubin_path(args, name, t):
    return os.path.join(args.out, f"{name}__{t.name}.pkl")


def variant_source(family, t, header_path, defines: dict) -> str:
    """The rendered source of t with the family's header inlined from header_path, after #defines (name -> value;
    the @ settings are not defines)."""
    from codegen.render import render
    defs = "".join(f"#define {k} {v}\n" for k, v in defines.items() if not k.startswith("@"))
    header = open(header_path).read().replace("#pragma once", "")
    src = render(t).replace(f'#include "{INCLUDE[family]}"', header)
    assert src != render(t), f"{t.name}: the rendered source does not include {INCLUDE[family]}"
    return defs + src


def build(job):
    args, name, t = job
    from flashgen import compiler
    src = variant_source(args.family, t, args.defines[name].get("@header") or args.header, args.defines[name])
    if "@minblocks" in args.defines[name]:   # CTAs per SM the kernel's launch bounds ask ptxas to fit
        bound = f"__launch_bounds__({t.num_threads}, 1)"
        assert bound in src, f"{t.name}: no {bound}"
        src = src.replace(bound, f"__launch_bounds__({t.num_threads}, {args.defines[name]['@minblocks']})")
    if "@cluster" in args.defines[name]:   # CTAs per cluster along x, fixed at compile time (plain launches keep working)
        bound = f"__launch_bounds__({t.num_threads}, "
        assert bound in src, f"{t.name}: no {bound}"
        src = src.replace(bound, f"__cluster_dims__({args.defines[name]['@cluster']}, 1, 1) {bound}")
    res = compiler.compile_source(src, t.name, t.arch, f"<{name}>")
    resources = compiler.parse_resources(res.log, t.name)
    with open(cubin_path(args, name, t), "wb") as f:
        pickle.dump((res.cubin, resources), f)
    return name, t.name, resources


def compile_all(args):
    os.makedirs(args.out, exist_ok=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, kernel, res in pool.map(build, [(args, n, t) for n, t in jobs_of(args)]):
            print(f"{name:>12} {kernel}: {res.get('registers')} registers, {res.get('spill_stores')} B spill stores",
                  flush=True)


def seed(args):
    """Compile into flashgen's cache (FLASHGEN_CACHE_DIR) the kernels a backward A/B runs besides the variants: the
    forward dispatch picks on the H100 for each shape, and bwd_pre."""
    from flashgen import dispatch
    from flashgen.cli import _compile_one
    ts = {}
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                fwd = dispatch.fwd_traits("sm_90a", GPU, args.dtype, hdim, causal, args.dropout > 0, seqlen_q=s,
                                          seqlen_k=s, hopper=True)
                pre = dispatch.bwd_traits("sm_90a", GPU, args.dtype, hdim, causal, "pre", args.dropout > 0)
                ts.update({fwd.name: fwd, pre.name: pre})
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, hit, secs, err, _ in pool.map(_compile_one, [t.to_dict() for t in ts.values()]):
            print(f"{name}: {'cached' if hit else f'{secs:.0f} s'}" + (f" FAILED {err.splitlines()[0]}" if err else ""),
                  flush=True)


def kernel_of(args, name, hdim, causal, seqlen):
    from flashgen.loader import Kernel
    t = traits_for(args.family, hdim, causal, seqlen, tiles_of(args, name), args.dtype, args.dropout > 0)
    with open(cubin_path(args, code_of(name, args), t), "rb") as f:
        cubin, res = pickle.load(f)
    kernel = Kernel(t, cubin, res)
    if "@smem_extra" in args.defines[code_of(name, args)]:   # bytes an experimental header uses past kSmemBytes
        kernel.smem_bytes += int(args.defines[code_of(name, args)]["@smem_extra"])
    if "@cluster" in args.defines[code_of(name, args)]:
        # a cluster launch needs whole clusters: the main entry's grid x rounded up (the header returns the extra CTAs)
        c, launch = int(args.defines[code_of(name, args)]["@cluster"]), kernel.launch

        def launch_whole_clusters(grid, *a, entry=None, **kw):
            if entry is None:
                grid = (-(-grid[0] // c) * c, *grid[1:])
            return launch(grid, *a, entry=entry, **kw)
        kernel.launch = launch_whole_clusters
    if "@minblocks" in args.defines[code_of(name, args)]:
        # the whole carveout for shared memory, so that the CTAs the launch bounds ask for fit an SM
        from cuda.bindings import driver as drv
        import torch
        dev = torch.cuda.current_device()
        _, cu_dev = drv.cuDeviceGet(dev)
        err, = drv.cuKernelSetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                        100, kernel.kernel, cu_dev)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        print(f"{name} {t.name}: {kernel.resident_ctas(dev) // sms} CTAs per SM", flush=True)
    return kernel


def run_with(family, kernel, *call, split=None, group=None, dropout=(0.0, None)):
    """The forward (q, k, v, scale, causal) or backward (dout, q, k, v, out, lse, scale, causal) with `kernel` in place
    of dispatch's (split: heuristics.FWD_SM90_SPLIT / BWD_SM90_SPLIT for the call; group: CTAs per head group of a
    causal launch of the kernel's head-dim bucket, 0 the natural order; None: the table's; dropout: (dropout_p,
    rng_state) of the call)."""
    from codegen import heuristics
    from flashgen import dispatch, interface
    attr = "fwd_kernel" if family == "fwd" else "_bwd_sm90_kernel"
    table = "FWD_SM90_HEAD_GROUP_CTAS" if family == "fwd" else "BWD_SM90_HEAD_GROUP_CTAS"
    split_attr = "FWD_SM90_SPLIT" if family == "fwd" else "BWD_SM90_SPLIT"
    real, real_split, real_group = getattr(dispatch, attr), getattr(heuristics, split_attr), getattr(heuristics, table)
    setattr(dispatch, attr, lambda *a, **k: kernel)
    setattr(heuristics, split_attr, split)
    if group is not None:
        setattr(heuristics, table, {kernel.traits.head_dim: group})
    try:
        if family == "fwd":
            return interface._flash_attn_forward(*call, *dropout)
        return interface._flash_attn_backward(*call, backward_impl="fused", dropout_p=dropout[0],
                                              rng_state=dropout[1])
    finally:
        setattr(dispatch, attr, real)
        setattr(heuristics, split_attr, real_split)
        setattr(heuristics, table, real_group)


def launch_kw(args, name):
    """A variant's launch-only settings as run_with's keywords: split from @split (heuristics.*_SPLIT: 0 off,
    K >= 2 pieces), group from @group (CTAs per head group, 0 the natural order); None where not set."""
    d = args.defines["base" if name == "base2" else name]
    return {kw: None if d.get(key) is None else int(d[key]) for kw, key in (("split", "@split"), ("group", "@group"))}


def dropout_of(args):
    """run_with's dropout for one call: (dropout_p, a fresh rng_state), or no dropout."""
    from flashgen import interface
    return (args.dropout, interface._draw_rng_state("cuda")) if args.dropout else (0.0, None)


def check(args):
    """Forward variants against the fp32 reference (with --dropout: against the base kernel with the same rng state);
    backward variants against the base kernel (same inputs; dQ's fp32 reduces may land in another order)."""
    import torch
    from tests.attn_ref import attention_ref
    torch.zeros(1, device="cuda")
    dt = torch_dtype(args.dtype)
    failures = 0
    shapes = ((3, 5, 1000, 777), (2, 7, 300, 1500), (1, 3, 1023, 1023), (2, 40, 129, 129), (1, 17, 2048, 2048))
    for name in args.defines:
        if name == "base" and (args.family == "bwd" or args.dropout):
            continue
        for hdim in args.hdim:
            for causal in map(bool, args.causal):
                for s in sorted({s for s in args.seqlen}) if args.family == "fwd" else args.seqlen[:1]:
                    kern = kernel_of(args, name, hdim, causal, s)
                    base = kernel_of(args, "base", hdim, causal, s)
                    for b, h, sq, sk in shapes:
                        q = torch.randn(b, sq, h, hdim, device="cuda", dtype=dt)
                        k, v = (torch.randn(b, sk, h, hdim, device="cuda", dtype=dt) for _ in range(2))
                        out, lse = (x.contiguous() for x in attention_ref(q, k, v, causal))
                        drop = dropout_of(args)
                        if args.family == "fwd":
                            if args.dropout:
                                out = run_with("fwd", base, q, k, v, hdim ** -0.5, causal, dropout=drop)[0]
                            got = run_with("fwd", kern, q, k, v, hdim ** -0.5, causal, dropout=drop,
                                           **launch_kw(args, name))[0]
                            errs = [(got.float() - out.float()).abs().max().item()]
                            bad = not errs[0] < 3e-2
                        else:
                            dout = torch.randn_like(q)
                            call = (dout, q, k, v, out, lse, hdim ** -0.5, causal)
                            ref = run_with("bwd", base, *call, dropout=drop)
                            got = run_with("bwd", kern, *call, dropout=drop, **launch_kw(args, name))
                            errs = [((a.float() - c.float()).abs().max() / (c.float().abs().max() + 1e-6)).item()
                                    for a, c in zip(got, ref)]
                            bad = not all(e < 2e-2 for e in errs)
                        failures += bad
                        print(f"{name} hd{hdim} causal={int(causal)} {b}x{h}x{sq}x{sk}: "
                              f"{' '.join(f'{e:.2e}' for e in errs)}{'  FAIL' if bad else ''}", flush=True)
    print(f"check failures: {failures}")
    return 1 if failures else 0


def calls(args, names, hdim, causal, s):
    """SDPA CUDNN's call, each variant's (name -> call) and the FLOPs of one call, for the benchmark's shape at
    (hdim, causal, seqlen s)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from flashgen import interface
    kernels = {n: kernel_of(args, n, hdim, causal, s) for n in names}
    b, h = args.bh or (max(1, 16384 // s), 2048 // hdim)
    q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch_dtype(args.dtype)) for _ in range(3))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(args.family == "bwd") for x in (q, k, v))
    drop = dropout_of(args)   # SDPA CUDNN runs without dropout, as in bench_attention.py --mode dropout
    if args.family == "fwd":
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        ours = {n: (lambda n=n: run_with("fwd", kernels[n], q, k, v, hdim ** -0.5, causal, dropout=drop,
                                         **launch_kw(args, n)))
                for n in names}
    else:
        dout = torch.randn_like(q)
        out, lse = interface._flash_attn_forward(q, k, v, hdim ** -0.5, causal, *drop)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        cudnn = lambda: torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
        ours = {n: (lambda n=n: run_with("bwd", kernels[n], dout, q, k, v, out, lse, hdim ** -0.5, causal,
                                         dropout=drop, **launch_kw(args, n)))
                for n in names}
    flops = (2.5 if args.family == "bwd" else 1) * 4 * b * h * s * s * hdim / (2 if causal else 1)
    return cudnn, ours, flops


def bench(args):
    import torch
    from triton.testing import do_bench
    torch.zeros(1, device="cuda")
    names = list(dict.fromkeys([*args.defines, "base2"]))   # base timed twice; a --variant base2= adds no column
    ms = lambda fn: do_bench(fn, warmup=20, rep=100, return_mode="median")
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, ratio to SDPA CUDNN ({args.family}), "
          f"median of {args.rounds} rounds" + (f", batch {args.bh[0]}, heads {args.bh[1]}" if args.bh else "")
          + (f", flashgen with dropout_p {args.dropout}" if args.dropout else ""))
    print("| hdim | causal | seqlen | CUDNN TFLOP/s | " + " | ".join(names) + " |")
    print("|---:|:---:|---:|---:|" + "---:|" * len(names))
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                cudnn, ours, flops = calls(args, names, hdim, causal, s)
                times = {n: [] for n in ["cudnn"] + names}
                for _ in range(args.rounds):
                    times["cudnn"].append(ms(cudnn))
                    for n in random.sample(names, len(names)):
                        times[n].append(ms(ours[n]))
                med = {n: sorted(x)[len(x) // 2] for n, x in times.items()}
                print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {flops / med['cudnn'] / 1e9:.0f} | "
                      + " | ".join(f"{med['cudnn'] / med[n]:.3f}" for n in names) + " |", flush=True)
    return 0


def profile(args):
    """One call of SDPA CUDNN and of each variant per shape inside cudaProfilerStart / Stop (after 3 warm-up calls),
    in the order printed, for `ncu --profile-from-start off`."""
    import torch
    torch.zeros(1, device="cuda")
    cudart = torch.cuda.cudart()
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                cudnn, ours, _ = calls(args, list(args.defines), hdim, causal, s)
                for name, fn in [("cudnn", cudnn)] + list(ours.items()):
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    cudart.cudaProfilerStart()
                    fn()
                    torch.cuda.synchronize()
                    cudart.cudaProfilerStop()
                    print(f"profiled: {name} hd{hdim} causal={int(causal)} seqlen={s}", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return {"compile": compile_all, "seed": seed, "check": check, "bench": bench,
            "profile": profile}[args.mode](args) or 0


if __name__ == "__main__":
    sys.exit(main())
