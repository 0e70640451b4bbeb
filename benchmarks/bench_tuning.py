"""Tuned vs default on this GPU: for every entry of the tuning file dispatch uses here (the user's, else the shipped
one; or --file), forward and backward TFLOP/s with the heuristic tables' choice and with the file's, in one process.

Shapes as in `flashgen tune` and bench_attention.py: 16k tokens, model dim 2048, random inputs, at the seqlen the
entry was measured at. The tuned side runs through the normal dispatch path (no overrides, backward_impl="auto"),
so it also checks that the file is picked up; the default side forces the tables' tiles and schedule.

    python benchmarks/bench_tuning.py [--file PATH] [--reps 50]
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import flashgen
from codegen import heuristics
from flashgen import dispatch, interface, tuner, tuning
from flashgen.cli import _compile_one, default_jobs


def kernels(arch, gpu, e):
    """Every kernel the default and the tuned side of one entry launch."""
    sq = e.seqlen
    out = [heuristics.fwd_traits(arch, e.dtype, e.hdim, e.causal),
           dispatch.fwd_traits(arch, gpu, e.dtype, e.hdim, e.causal, seqlen_q=sq, seqlen_k=sq)]
    if e.fwd_sm90:
        b = tuning.seqlen_bucket(sq)   # the walk (grid or persistent) follows the seqlen bucket
        out += [heuristics.fwd_sm90_traits(arch, e.dtype, e.hdim, e.causal, seqlen=b),
                dispatch.fwd_sm90_traits(arch, e.dtype, e.hdim, e.causal, e, seqlen=b)[0]]
    for impl in ("auto", dispatch.schedule(arch, gpu, e.dtype, e.hdim, e.causal, "auto", False, 1, sq, sq)):
        for kind in heuristics.bwd_kinds(heuristics.bwd_schedule(impl, False, 1, sq, sq)):
            out += [heuristics.bwd_traits(arch, e.dtype, e.hdim, e.causal, kind),
                    dispatch.bwd_traits(arch, gpu, e.dtype, e.hdim, e.causal, kind, seqlen_q=sq, seqlen_k=sq)]
    return out


def run_entry(arch, gpu, e, reps):
    seqlen = int(e.measured.get("seqlen") or e.seqlen)
    (q, k, v, dout), (b, h) = tuner.problem(e.dtype, e.hdim, seqlen, backward=True)
    scale, flops = e.hdim ** -0.5, tuner.fwd_flops(b, h, seqlen, seqlen, e.hdim, e.causal)
    key = (e.dtype, e.hdim, e.causal)
    ms = lambda fn: tuner.time_ms(fn, warmup=10, reps=reps)
    rows = []
    fwd = lambda: interface._flash_attn_forward(q, k, v, scale, e.causal)
    if e.fwd:
        default = heuristics.fwd_tiles(arch, e.hdim, e.causal)
        dispatch.set_fwd_tiles(*key, default)
        try:
            t_default = ms(fwd)
        finally:
            dispatch.set_fwd_tiles(*key, None)
        picked = dispatch.fwd_kernel(q.device.index, q.dtype, e.hdim, e.causal, seqlen_q=seqlen, seqlen_k=seqlen).traits
        assert (picked.block_m, picked.block_n, picked.num_warps) == e.fwd, (picked.name, e.fwd)
        rows.append(("fwd", tuner.fmt_fwd(default), flops / t_default / 1e9, tuner.fmt_fwd(e.fwd),
                     flops / ms(fwd) / 1e9))
    if e.fwd_sm90:   # the Hopper forward: the table's (block_m, block_n, mainloop) forced, then the file's through dispatch
        table = heuristics.fwd_sm90_traits(arch, e.dtype, e.hdim, e.causal)
        default = (table.block_m, table.block_n, heuristics.sm90_mainloop(table))
        with dispatch.hopper_forward(True):
            dispatch.set_fwd_sm90(*key, default)
            try:
                t_default = ms(fwd)
            finally:
                dispatch.set_fwd_sm90(*key, None)
            picked = dispatch.fwd_kernel(q.device.index, q.dtype, e.hdim, e.causal, seqlen_q=seqlen, seqlen_k=seqlen,
                                         tma_ok=True).traits
            assert (picked.block_m, picked.block_n, heuristics.sm90_mainloop(picked)) == e.fwd_sm90, picked.name
            rows.append(("fwd_sm90", tuner.fmt_sm90(default), flops / t_default / 1e9, tuner.fmt_sm90(e.fwd_sm90),
                         flops / ms(fwd) / 1e9))
    if e.bwd_schedule or e.bwd_tiles:
        out, lse = fwd()
        schedule = heuristics.bwd_schedule("auto", False, b * h, seqlen, seqlen)
        kinds = heuristics.bwd_kinds(schedule)[1:]
        default = {kind: tuner._bwd_tiles(heuristics.bwd_traits(arch, e.dtype, e.hdim, e.causal, kind))
                   for kind in kinds}
        for kind, t in default.items():
            dispatch.set_bwd_tiles(*key, kind, t)
        try:
            t_default = ms(lambda: interface._flash_attn_backward(dout, q, k, v, out, lse, scale, e.causal,
                                                                  backward_impl=schedule))
        finally:
            for kind in kinds:
                dispatch.set_bwd_tiles(*key, kind, None)
        tuned_schedule = dispatch.bwd_schedule(q.device.index, q.dtype, e.hdim, e.causal, "auto", False, b * h,
                                               seqlen, seqlen)
        tuned = {kind: tuner._bwd_tiles(dispatch.bwd_traits(arch, gpu, e.dtype, e.hdim, e.causal, kind,
                                                            seqlen_q=seqlen, seqlen_k=seqlen))
                 for kind in heuristics.bwd_kinds(tuned_schedule)[1:]}
        t_tuned = ms(lambda: interface._flash_attn_backward(dout, q, k, v, out, lse, scale, e.causal))
        rows.append(("bwd", tuner.fmt_bwd(schedule, default), 2.5 * flops / t_default / 1e9,
                     tuner.fmt_bwd(tuned_schedule, tuned), 2.5 * flops / t_tuned / 1e9))
    return seqlen, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", help="a tuning file to use instead of the one dispatch finds for this GPU")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    os.environ["FLASHGEN_HOPPER"] = "0"   # the SM80 path's rows; run_entry turns it on for the Hopper forward's
    os.environ["FLASHGEN_HOPPER_BWD"] = "0"   # the backward rows are the SM80 kernels' (tuning times those)
    dev = torch.cuda.current_device()
    arch, gpu = dispatch.device_arch(dev), dispatch.device_name(dev)
    if args.file:   # through the normal lookup: as this GPU's user file in a private tuning dir
        os.environ["FLASHGEN_TUNING_DIR"] = tempfile.mkdtemp(prefix="flashgen-tuning-")
        shutil.copy(args.file, tuning.user_file(gpu))
        dispatch.reload_tuning()
    table = tuning.table(gpu, arch)
    if table is None:
        sys.exit(f"bench_tuning: no usable tuning file for {gpu!r} ({arch}); run `flashgen tune` or pass --file")
    entries = [table.entries[k] for k in sorted(table.entries)]
    need = {t.name: t for e in entries for t in kernels(arch, gpu, e)}
    with ProcessPoolExecutor(max_workers=default_jobs()) as pool:   # no JIT compile inside a timing loop
        for name, hit, secs, err, _ in pool.map(_compile_one, [t.to_dict() for t in need.values()]):
            if err:
                print(f"# {name}: compile failed: {err.strip().splitlines()[-1]}")
    print(f"# tuned vs default, {gpu}, flashgen {flashgen.__version__}, torch {torch.__version__}, "
          f"{datetime.date.today()}; tuning file {table.path}; 16k tokens, model dim 2048; TFLOP/s (median of "
          f"{args.reps}; backward 2.5x forward FLOPs)")
    print("| dtype | hdim | causal | seqlen | pass | default | TFLOP/s | tuned | TFLOP/s | tuned / default |")
    print("|---|---:|:---:|---:|:---:|---|---:|---|---:|---:|")
    for e in entries:
        seqlen, rows = run_entry(arch, gpu, e, args.reps)
        for pas, dname, dtf, tname, ttf in rows:
            print(f"| {e.dtype} | {e.hdim} | {'yes' if e.causal else 'no'} | {seqlen} | {pas} | {dname} | {dtf:.0f} | "
                  f"{tname} | {ttf:.0f} | {ttf / dtf:.2f} |", flush=True)


if __name__ == "__main__":
    main()
