"""Attention benchmark: flashgen vs torch SDPA (FLASH = flash-attn 2, CUDNN) in one process, forward and backward.

flash-attn's benchmark shapes: 16k tokens (batch = 16384 / seqlen), model dim 2048 (nheads = 2048 / hdim), bf16.
FLOPs: forward 4 * b * h * sq * sk * d, halved when causal; backward 2.5x forward. Median of triton's do_bench; the
fwd and bwd tables take the median over --rounds rounds, the columns in a new random order each round.
The backward times flashgen's fused and split schedules on the SM80 kernels, the Hopper backward (sm_90a; the fused
schedule as one wgmma kernel) and what "auto" runs; SDPA's backward is timed through autograd on a retained graph.

    python benchmarks/bench_attention.py [--mode fwd bwd dropout hopper] [--hdim 64 128 256] [--seqlen 512 ... 16384] [--tiles]

--mode dropout: forward and backward with dropout_p=0.1 against the same call without dropout and against
torch SDPA's EFFICIENT, FLASH and CUDNN backends with the same dropout, at seqlen 2k and 8k; FLASH's and CUDNN's
own cost of dropout (each backend with and without it) put flashgen's in context.
--mode hopper: the Hopper forward's three mainloops next to the SM80 path and SDPA (sm_90a). The forward table runs
the path dispatch picks: the Hopper forward on sm_90a, the SM80 path with FLASHGEN_HOPPER=0 or on other GPUs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen import dispatch, tuning


# "do_bench": triton's do_bench (L2 flushed before each repetition; the call's host time counts where it exceeds the
# flush); "cudagraph": replays of a captured graph of the call (no host time, warm L2), --cudagraph.
TIMING = "do_bench"


def bench_ms(fn) -> float:
    from triton.testing import do_bench, do_bench_cudagraph
    if TIMING == "cudagraph":
        return do_bench_cudagraph(fn, rep=300, return_mode="median")
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


ROUNDS = 5   # --rounds


def time_all(fns: dict) -> dict:
    """Milliseconds of each callable: the median over ROUNDS rounds of one bench_ms each, the callables in a new random
    order every round. One reading of the same kernel moved by up to 15% between readings on the H100 (hdim 128 8k
    backward: 459-531 TFLOP/s, cuDNN 510-544), so single readings in a fixed order could favour either side."""
    times = {n: [] for n in fns}
    for _ in range(ROUNDS):
        for n in random.sample(list(fns), len(fns)):
            times[n].append(bench_ms(fns[n]))
    return {n: statistics.median(t) for n, t in times.items()}


def in_context(ctx, fn):
    """fn, called inside a fresh ctx() each time (an SDPA backend, a dispatch switch)."""
    def run():
        with ctx():
            return fn()
    return run


def sdpa_fns(fns: dict, make_fn, names=("sdpa_flash", "sdpa_cudnn")) -> dict:
    """fns plus SDPA's FLASH and CUDNN backends (make_fn(backend) -> callable), those of `names` that run here."""
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        if name not in names:
            continue
        try:
            fn = make_fn(backend)
            fn()
            fns[name] = fn
        except RuntimeError as e:
            print(f"  {name} unavailable: {str(e).splitlines()[0][:100]}")
    return fns


def fwd_flops(b, h, sq, sk, d, causal):
    f = 4 * b * h * sq * sk * d
    return f / 2 if causal else f


def sdpa_bwd_fn(q, k, v, dout, causal, backend):
    """SDPA's backward under `backend` for flashgen-layout (b, s, h, d) inputs, as a callable to time: the forward runs
    once here, each call is one autograd.grad of it."""
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dt = dout.transpose(1, 2)
    return in_context(lambda: sdpa_kernel(backend), lambda: torch.autograd.grad(o, (qt, kt, vt), dt, retain_graph=True))


def run_shape_bwd(hdim, seqlen, causal, dtype=torch.bfloat16, batch=None, nheads=None,
                  which=("fused", "split", "hopper", "hopper_split", "sdpa_flash", "sdpa_cudnn")):
    from flashgen import interface
    from codegen import heuristics
    b, h = batch or max(1, 16384 // seqlen), nheads or 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=dtype) for _ in range(3))
    dout = torch.randn_like(q)
    scale = hdim ** -0.5
    out, lse = interface._flash_attn_forward(q, k, v, scale, causal)
    flops = 2.5 * fwd_flops(b, h, seqlen, seqlen, hdim, causal)
    fns = {}
    for impl in ("fused", "split"):
        if impl in which:   # the SM80 kernels
            fns[impl] = in_context(lambda: dispatch.hopper_backward(False), lambda impl=impl: interface._flash_attn_backward(
                dout, q, k, v, out, lse, scale, causal, backward_impl=impl))
    arch = dispatch.device_arch(torch.cuda.current_device())
    if "hopper" in which and heuristics.bwd_sm90_traits(arch, "bf16", hdim, causal) is not None:
        # the fused schedule as one Hopper kernel
        fns["hopper"] = in_context(lambda: dispatch.hopper_backward(True), lambda: interface._flash_attn_backward(
            dout, q, k, v, out, lse, scale, causal, backward_impl="fused"))
    if "hopper_split" in which and heuristics.bwd_sm90_split_traits(arch, "bf16", hdim, causal) is not None:
        # the split (deterministic) schedule as two Hopper kernels
        fns["hopper_split"] = in_context(lambda: dispatch.hopper_backward(True), lambda: interface._flash_attn_backward(
            dout, q, k, v, out, lse, scale, causal, backward_impl="split"))
    res = time_all(sdpa_fns(fns, lambda backend: sdpa_bwd_fn(q, k, v, dout, causal, backend), which))
    auto = heuristics.bwd_schedule("auto", False, b * h, seqlen, seqlen)
    res["auto"] = res.get(auto, float("nan"))
    if auto == "fused" and "hopper" in res and dispatch.hopper_backward_enabled():
        auto, res["auto"] = "hopper", res["hopper"]   # what dispatch runs for "auto" here
    tf = {k: flops / (ms * 1e-3) / 1e12 for k, ms in res.items()}
    tf.setdefault("hopper", float("nan"))
    tf.setdefault("hopper_split", float("nan"))
    tf.setdefault("sdpa_flash", float("nan"))
    tf.setdefault("sdpa_cudnn", float("nan"))
    tf["auto_schedule"] = auto
    return tf


def fwd_inputs(hdim, seqlen, causal, dtype=torch.bfloat16):
    """q, k, v of the benchmark shape and the forward's FLOPs."""
    b, h = max(1, 16384 // seqlen), 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=dtype) for _ in range(3))
    return q, k, v, fwd_flops(b, h, seqlen, seqlen, hdim, causal)


def sdpa_fwd_fns(q, k, v, causal, fns=None) -> dict:
    """fns plus the forward of torch SDPA's FLASH (flash-attn 2) and CUDNN backends, those that run here."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return sdpa_fns(dict(fns or {}), lambda backend: in_context(
        lambda: sdpa_kernel(backend), lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)))


def sdpa_fwd_ms(q, k, v, causal) -> dict:
    """Forward milliseconds of torch SDPA's FLASH and CUDNN backends (nan where unavailable)."""
    return {"sdpa_flash": float("nan"), "sdpa_cudnn": float("nan"), **time_all(sdpa_fwd_fns(q, k, v, causal))}


def run_shape(hdim, seqlen, causal, dtype=torch.bfloat16):
    q, k, v, flops = fwd_inputs(hdim, seqlen, causal, dtype)
    fns = sdpa_fwd_fns(q, k, v, causal, {"flashgen": lambda: flashgen.flash_attn_func(q, k, v, causal=causal)})
    res = {"sdpa_flash": float("nan"), "sdpa_cudnn": float("nan"), **time_all(fns)}
    return {k: flops / (ms * 1e-3) / 1e12 for k, ms in res.items()}


def run_shape_hopper(hdim, seqlen, causal, dtype=torch.bfloat16):
    """The SM80-path forward and each Hopper mainloop against SDPA in one process, with the largest difference
    between the SM80 and Hopper outputs as a sanity check."""
    from codegen import heuristics
    q, k, v, flops = fwd_inputs(hdim, seqlen, causal, dtype)
    res, outs = {}, {}
    for name, hopper, mainloop in (("sm80", False, None), ("hopper", True, "serial"), ("hopper_ov", True, "overlap"),
                                   ("hopper_pp", True, "pingpong")):
        heuristics.FWD_SM90_MAINLOOP = mainloop
        dispatch._fwd_kernel.cache_clear()
        with dispatch.hopper_forward(hopper):
            outs[name] = flashgen.flash_attn_func(q, k, v, causal=causal)
            res[name] = bench_ms(lambda: flashgen.flash_attn_func(q, k, v, causal=causal))
    heuristics.FWD_SM90_MAINLOOP = None
    dispatch._fwd_kernel.cache_clear()
    res.update(sdpa_fwd_ms(q, k, v, causal))
    out = {k: flops / (ms * 1e-3) / 1e12 for k, ms in res.items()}
    out["diff"] = max((outs["sm80"].float() - outs[name].float()).abs().max().item()
                      for name in ("hopper", "hopper_ov", "hopper_pp"))
    return out


def print_hopper(args, gpu):
    print(f"# flashgen Hopper forward mainloops vs the SM80 path, {gpu}, torch {torch.__version__}, "
          f"{datetime.date.today()}, bf16, 16k tokens, model dim 2048; TFLOP/s (median, {TIMING})")
    print("| hdim | causal | seqlen | SM80 path | Hopper | + overlap | + ping-pong | SDPA FLASH | SDPA CUDNN "
          "| best vs CUDNN | max diff |")
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                r = run_shape_hopper(hdim, s, causal)
                best = max(r["hopper"], r["hopper_ov"], r["hopper_pp"])
                print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {r['sm80']:.0f} | {r['hopper']:.0f} | "
                      f"{r['hopper_ov']:.0f} | {r['hopper_pp']:.0f} | {r['sdpa_flash']:.0f} | {r['sdpa_cudnn']:.0f} | "
                      f"{best / r['sdpa_cudnn']:.2f} | {r['diff']:.2g} |", flush=True)


def run_shape_dropout(hdim, seqlen, causal, p=0.1, dtype=torch.bfloat16):
    """TFLOP/s of forward and backward, flashgen with and without dropout and SDPA backends with dropout."""
    from flashgen import interface
    b, h = max(1, 16384 // seqlen), 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=dtype) for _ in range(3))
    dout = torch.randn_like(q)
    scale = hdim ** -0.5
    f = fwd_flops(b, h, seqlen, seqlen, hdim, causal)
    res = {"fwd_nodrop": f / bench_ms(lambda: flashgen.flash_attn_func(q, k, v, causal=causal)),
           "fwd_drop": f / bench_ms(lambda: flashgen.flash_attn_func(q, k, v, dropout_p=p, causal=causal))}
    rng = interface._draw_rng_state(q.device)
    out, lse = interface._flash_attn_forward(q, k, v, scale, causal, p, rng)
    out0, lse0 = interface._flash_attn_forward(q, k, v, scale, causal)
    res["bwd_nodrop"] = 2.5 * f / bench_ms(lambda: interface._flash_attn_backward(dout, q, k, v, out0, lse0, scale,
                                                                                  causal))
    res["bwd_drop"] = 2.5 * f / bench_ms(lambda: interface._flash_attn_backward(dout, q, k, v, out, lse, scale, causal,
                                                                                dropout_p=p, rng_state=rng))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    dt = dout.transpose(1, 2)
    # Each SDPA backend with the same dropout and, for its own cost of dropout, without ("_nodrop").
    for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        for suffix, drop in (("", p), ("_nodrop", 0.0)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, dropout_p=drop, is_causal=causal)
                    res[f"fwd_{name}{suffix}"] = f / bench_ms(fn)
                    o = fn()
                    res[f"bwd_{name}{suffix}"] = 2.5 * f / bench_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), dt,
                                                                                               retain_graph=True))
            except RuntimeError as e:
                res[f"fwd_{name}{suffix}"] = res[f"bwd_{name}{suffix}"] = float("nan")
                print(f"  sdpa {name} (dropout_p={drop}) unavailable: {str(e).splitlines()[0][:100]}")
    return {key: ms_inv / 1e9 for key, ms_inv in res.items()}   # flops / ms -> TFLOP/s


def print_dropout(args, gpu):
    print(f"# flashgen attention with dropout_p=0.1, {gpu}, torch {torch.__version__}, {datetime.date.today()}, bf16, "
          f"16k tokens, model dim 2048; TFLOP/s (median; FLOPs as without dropout)")
    print("| hdim | causal | seqlen | pass | flashgen | flashgen no dropout | cost of dropout | SDPA EFFICIENT | "
          "SDPA FLASH | SDPA CUDNN | vs EFFICIENT | vs FLASH | vs CUDNN | FLASH's cost of dropout | "
          "CUDNN's cost of dropout |")
    print("|---:|:---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                r = run_shape_dropout(hdim, s, causal)
                for pas in ("fwd", "bwd"):
                    d, n = r[f"{pas}_drop"], r[f"{pas}_nodrop"]
                    cost = lambda name: f"{(r[f'{pas}_{name}_nodrop'] / r[f'{pas}_{name}'] - 1) * 100:.0f}%"
                    print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {pas} | {d:.0f} | {n:.0f} | "
                          f"{(n / d - 1) * 100:.0f}% | {r[f'{pas}_efficient']:.0f} | {r[f'{pas}_flash']:.0f} | "
                          f"{r[f'{pas}_cudnn']:.0f} | {d / r[f'{pas}_efficient']:.2f} | {d / r[f'{pas}_flash']:.2f} | "
                          f"{d / r[f'{pas}_cudnn']:.2f} | {cost('flash')} | {cost('cudnn')} |", flush=True)


def print_dropout_tiles(args):
    """Forward with dropout_p=0.1 for each candidate tile against the default dropout-free forward."""
    print("\n# forward tiles with dropout_p=0.1 (TFLOP/s, bf16, seqlen 2k / 8k; cost vs the default dropout-free tiles)")
    print("| hdim | causal | tiles (m, n, warps) | 2k | 8k | cost 2k | cost 8k |")
    print("|---:|:---:|---|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            base = {s: run_shape(hdim, s, causal)["flashgen"] for s in (2048, 8192)}
            for tiles in DROPOUT_TILE_CANDIDATES.get(hdim, []):
                dispatch.set_fwd_tiles("bf16", hdim, causal, tiles)
                try:
                    r = {s: _fwd_dropout_tflops(hdim, s, causal) for s in (2048, 8192)}
                    print(f"| {hdim} | {'yes' if causal else 'no'} | {tiles} | {r[2048]:.0f} | {r[8192]:.0f} | "
                          f"{(base[2048] / r[2048] - 1) * 100:.0f}% | {(base[8192] / r[8192] - 1) * 100:.0f}% |",
                          flush=True)
                except Exception as e:
                    print(f"| {hdim} | {'yes' if causal else 'no'} | {tiles} | failed: {str(e)[:60]} | | | |")
                dispatch.set_fwd_tiles("bf16", hdim, causal, None)


def _fwd_dropout_tflops(hdim, seqlen, causal, p=0.1):
    b, h = max(1, 16384 // seqlen), 2048 // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = bench_ms(lambda: flashgen.flash_attn_func(q, k, v, dropout_p=p, causal=causal))
    return fwd_flops(b, h, seqlen, seqlen, hdim, causal) / ms / 1e9


def main():
    global ROUNDS
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", nargs="*", default=["fwd", "bwd"], choices=["fwd", "bwd", "dropout", "hopper"])
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--bh", type=int, nargs="*", default=[],
                    help="also time the backward schedules at batch 1 with these head counts")
    ap.add_argument("--bwd-tiles", action="store_true",
                    help="also time candidate backward tiles (block_m, block_n, stages) per head dim and schedule")
    ap.add_argument("--dropout-tiles", action="store_true",
                    help="time candidate forward tiles with dropout per head dim (DROPOUT_TILE_CANDIDATES)")
    ap.add_argument("--tiles", action="store_true",
                    help="also time candidate forward tiles per head dim (block_m, block_n, warps)")
    ap.add_argument("--persistent", action="store_true",
                    help="the Hopper forward's persistent variant (one CTA per SM walks the tiles) wherever it runs "
                         "(default: where heuristics.FWD_SM90_PERSISTENT_SEQLEN takes it)")
    ap.add_argument("--cudagraph", action="store_true",
                    help="time forward calls (and SDPA's) as CUDA graph replays: kernel time without host time "
                         "(--mode fwd and hopper only)")
    ap.add_argument("--lse-smem", action="store_true",
                    help="the Hopper backward's variant that passes lse and D through shared memory, for every key "
                         "(default: heuristics.BWD_SM90_LSE_SMEM_TABLE)")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="rounds of the fwd and bwd tables (median; columns in a new random order each round)")
    args = ap.parse_args()
    ROUNDS = args.rounds
    if args.cudagraph:
        if set(args.mode) - {"fwd", "hopper"}:
            ap.error("--cudagraph times forward calls only: use it with --mode fwd / hopper")
        global TIMING
        TIMING = "cudagraph"
    from codegen import heuristics
    heuristics.FWD_SM90_PERSISTENT = True if args.persistent else None   # None: dispatch's walk per seqlen bucket
    heuristics.BWD_SM90_LSE_SMEM = True if args.lse_smem else None
    precompile(args)
    gpu = torch.cuda.get_device_name()
    if args.dropout_tiles:
        print_dropout_tiles(args)
    if "hopper" in args.mode:
        print_hopper(args, gpu)
    if "dropout" in args.mode:
        print_dropout(args, gpu)
    if "bwd" in args.mode:
        print_bwd(args, gpu)
        if args.bwd_tiles:
            print_bwd_tiles(args)
    if "fwd" not in args.mode:
        return
    hopper = dispatch.hopper_enabled() and dispatch.device_arch(torch.cuda.current_device()) == "sm_90a"
    print(f"# flashgen attention forward ({'Hopper path' if hopper else 'SM80 path'}), {gpu}, torch {torch.__version__}, "
          f"{datetime.date.today()}, bf16, 16k tokens, model dim 2048; TFLOP/s (median, {TIMING})")
    print(f"| hdim | causal | seqlen | flashgen | SDPA FLASH | SDPA CUDNN | vs FLASH | vs CUDNN |")
    print(f"|---:|:---:|---:|---:|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                r = run_shape(hdim, s, causal)
                print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {r['flashgen']:.0f} | {r['sdpa_flash']:.0f} | "
                      f"{r['sdpa_cudnn']:.0f} | {r['flashgen'] / r['sdpa_flash']:.2f} | "
                      f"{r['flashgen'] / r['sdpa_cudnn']:.2f} |", flush=True)
    if args.tiles:
        print("\n# forward tile candidates (TFLOP/s, bf16, seqlen 2k / 8k)")
        print("| hdim | causal | tiles (m, n, warps) | 2k | 8k |")
        print("|---:|:---:|---|---:|---:|")
        for hdim, cands in TILE_CANDIDATES.items():
            if hdim not in args.hdim:
                continue
            for causal in map(bool, args.causal):
                for tiles in cands:
                    dispatch.set_fwd_tiles("bf16", hdim, causal, tiles)
                    try:
                        r2, r8 = (run_shape(hdim, s, causal)["flashgen"] for s in (2048, 8192))
                        print(f"| {hdim} | {'yes' if causal else 'no'} | {tiles} | {r2:.0f} | {r8:.0f} |", flush=True)
                    except Exception as e:
                        print(f"| {hdim} | {'yes' if causal else 'no'} | {tiles} | failed: {str(e)[:60]} | |")
                    dispatch.set_fwd_tiles("bf16", hdim, causal, None)


def print_bwd(args, gpu):
    if args.bh:
        print_bwd_bh(args)
        return
    print(f"# flashgen attention backward, {gpu}, torch {torch.__version__}, {datetime.date.today()}, bf16, "
          f"16k tokens, model dim 2048; TFLOP/s (median, 2.5x forward FLOPs)")
    print("| hdim | causal | seqlen | fused | split | auto (pick) | Hopper | Hopper split | SDPA FLASH | SDPA CUDNN | "
          "auto vs FLASH | auto vs CUDNN | Hopper vs CUDNN | Hopper split vs split |")
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                r = run_shape_bwd(hdim, s, causal)
                print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {r['fused']:.0f} | {r['split']:.0f} | "
                      f"{r['auto']:.0f} ({r['auto_schedule']}) | {r['hopper']:.0f} | {r['hopper_split']:.0f} | "
                      f"{r['sdpa_flash']:.0f} | {r['sdpa_cudnn']:.0f} | {r['auto'] / r['sdpa_flash']:.2f} | "
                      f"{r['auto'] / r['sdpa_cudnn']:.2f} | {r['hopper'] / r['sdpa_cudnn']:.2f} | "
                      f"{r['hopper_split'] / r['split']:.2f} |", flush=True)


def print_bwd_bh(args):
    print("\n# backward schedules at small batch x heads (batch 1, TFLOP/s)")
    print("| hdim | causal | seqlen | heads | fused | split | SDPA FLASH |")
    print("|---:|:---:|---:|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                for h in args.bh:
                    r = run_shape_bwd(hdim, s, causal, batch=1, nheads=h, which=("fused", "split", "sdpa_flash"))
                    print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {h} | {r['fused']:.0f} | "
                          f"{r['split']:.0f} | {r['sdpa_flash']:.0f} |", flush=True)


def print_bwd_tiles(args):
    print("\n# backward tile candidates (TFLOP/s, bf16, seqlen 2k / 8k)")
    print("| hdim | causal | schedule | tiles (m, n, stages) | 2k | 8k |")
    print("|---:|:---:|---|---|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for schedule, kinds in (("fused", ("dkdv_atomic",)), ("split", ("dkdv", "dq"))):
                for tiles in BWD_TILE_CANDIDATES.get(hdim, []):
                    for kind in kinds:
                        dispatch.set_bwd_tiles("bf16", hdim, causal, kind, tiles)
                    try:
                        r2, r8 = (run_shape_bwd(hdim, s, causal, which=(schedule,))[schedule] for s in (2048, 8192))
                        print(f"| {hdim} | {'yes' if causal else 'no'} | {schedule} | {tiles} | {r2:.0f} | {r8:.0f} |",
                              flush=True)
                    except Exception as e:
                        print(f"| {hdim} | {'yes' if causal else 'no'} | {schedule} | {tiles} | failed: {str(e)[:60]} | |")
                    for kind in kinds:
                        dispatch.set_bwd_tiles("bf16", hdim, causal, kind, None)


def precompile(args):
    """Compile every kernel the run needs in parallel first (a JIT compile inside a timing loop is slow)."""
    from concurrent.futures import ProcessPoolExecutor
    from codegen import heuristics
    from flashgen.cli import _compile_one, default_jobs
    arch = dispatch.device_arch(torch.cuda.current_device())
    need = []
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            need.append(heuristics.fwd_traits(arch, "bf16", hdim, causal))
            if heuristics.fwd_sm90_traits(arch, "bf16", hdim, causal):   # the default forward on sm_90a
                # the walk (grid or persistent) depends on the seqlen bucket (heuristics.fwd_sm90_persistent)
                buckets = {tuning.seqlen_bucket(s) for s in args.seqlen}
                need += [heuristics.fwd_sm90_traits(arch, "bf16", hdim, causal, seqlen=b) for b in buckets]
                # and what dispatch runs: the GPU's tuning file may pick other tiles than the table
                need += [dispatch.fwd_traits(arch, torch.cuda.get_device_name(), "bf16", hdim, causal, seqlen_q=s,
                                             seqlen_k=s, hopper=True) for s in args.seqlen]
                if "hopper" in args.mode:
                    need += [heuristics.fwd_sm90_traits(arch, "bf16", hdim, causal, mainloop=m, seqlen=b)
                             for m in heuristics.FWD_SM90_MAINLOOPS for b in buckets]
            if "dropout" in args.mode:
                # The Hopper kernels where they exist (what dispatch runs on sm_90a), else the SM80 ones.
                fwd_h = heuristics.fwd_sm90_traits(arch, "bf16", hdim, causal, dropout=True)
                need.append(fwd_h or heuristics.fwd_traits(arch, "bf16", hdim, causal, dropout=True))
                for drop in (False, True):
                    bwd_h = heuristics.bwd_sm90_traits(arch, "bf16", hdim, causal, dropout=drop)
                    kinds = ("pre",) if bwd_h else heuristics.BWD_KINDS
                    need += [heuristics.bwd_traits(arch, "bf16", hdim, causal, kind, dropout=drop) for kind in kinds]
                    need += [bwd_h] if bwd_h else []
                need.append(heuristics.dropout_mask_traits(arch))
            if "bwd" in args.mode:
                need += [heuristics.bwd_traits(arch, "bf16", hdim, causal, kind) for kind in heuristics.BWD_KINDS]
                if heuristics.bwd_sm90_traits(arch, "bf16", hdim, causal) is not None:
                    need.append(heuristics.bwd_sm90_traits(arch, "bf16", hdim, causal))
            if args.bwd_tiles:
                for tiles in BWD_TILE_CANDIDATES.get(hdim, []):
                    for kind in ("dkdv_atomic", "dkdv", "dq"):
                        try:
                            need.append(heuristics.bwd_traits(arch, "bf16", hdim, causal, kind, tiles))
                        except Exception:
                            pass
            if args.dropout_tiles:
                for t in DROPOUT_TILE_CANDIDATES.get(hdim, []):
                    try:
                        need.append(heuristics.fwd_traits(arch, "bf16", hdim, causal, t, dropout=True))
                    except Exception:
                        pass
                need.append(heuristics.dropout_mask_traits(arch))
            if args.tiles:
                need += [heuristics.fwd_traits(arch, "bf16", hdim, causal, t) for t in TILE_CANDIDATES.get(hdim, [])]
    need = {t.name: t for t in need}   # the table's and dispatch's choices often name the same kernel: build it once
    with ProcessPoolExecutor(max_workers=default_jobs()) as pool:
        for name, hit, secs, err, res in pool.map(_compile_one, [t.to_dict() for t in need.values()]):
            if err:
                print(f"# {name}: compile failed: {err.splitlines()[0]}")
            elif not hit:
                print(f"# compiled {name} in {secs:.0f} s, regs {res.get('registers')}, spills {res.get('spill_stores')} B")


BWD_TILE_CANDIDATES = {
    64: [(64, 128, 2), (128, 128, 2)],
    128: [(64, 128, 2), (64, 128, 1)],
    256: [(64, 64, 2), (64, 64, 1)],
}

DROPOUT_TILE_CANDIDATES = {
    64: [(128, 64, 4), (128, 64, 8), (128, 128, 4), (128, 128, 8), (64, 64, 4), (64, 128, 4)],
    128: [(128, 64, 4), (128, 32, 4), (128, 64, 8)],
}

TILE_CANDIDATES = {
    64: [(128, 128, 4), (128, 64, 4), (64, 128, 4)],
    128: [(128, 64, 4), (128, 32, 4), (64, 64, 4), (128, 64, 8)],
    256: [(128, 64, 8), (64, 64, 4), (128, 32, 8)],
}

if __name__ == "__main__":
    main()
