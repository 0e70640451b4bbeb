"""Compile every kernel the GPU tests use, in one process pool, before running them (a JIT compile inside a
test costs 30-60 s; sixteen at a time cost the same wall time as one).

    python tests/build_gpu_kernels.py [--arch sm_90a] [--jobs N] [--only dropout|hdim|hopper|sm80] [--family F ...]
                                      [--budget-seconds S]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from codegen import heuristics  # noqa: E402

# (dtype, head dim, forward only?) as the GPU tests parametrize them.
FWD_HDIMS = (32, 40, 64, 72, 96, 128, 160, 192, 200, 224, 256)            # test_fwd_gpu, both dtypes
BWD = [("bf16", h) for h in (32, 64, 72, 96, 128, 160, 192, 224, 256)] + [("fp16", 64), ("fp16", 128)]
DROPOUT = [("bf16", h) for h in (32, 64, 72, 128, 256)] + [("fp16", 64), ("fp16", 128)]   # test_dropout_gpu
BENCH = [("bf16", 64), ("bf16", 128), ("bf16", 256)]                                      # bench --mode dropout
# test_hopper_gpu.py's tuner candidates off the table: (head dim, (block_m, block_n, mainloop)), bf16.
HOPPER_CANDIDATES = [(64, (192, 128, "overlap")), (64, (192, 96, "serial")), (128, (192, 64, "serial")),
                     (128, (128, 176, "overlap")), (128, (128, 160, "pingpong")), (256, (128, 64, "serial")),
                     (128, (192, 80, "overlap", 4))]   # the H100 tuning file's hdim 128 non-causal 8k choice
# test_hdim_gpu.py: (dtype, head_dim, head_dim_v)
HDIM = [("bf16", 80, 80), ("fp16", 80, 80), ("bf16", 512, 512), ("fp16", 512, 512), ("bf16", 192, 128),
        ("fp16", 192, 128), ("bf16", 64, 128), ("bf16", 136, 88)]


def needed_hdim(arch: str) -> dict:
    """test_hdim_gpu.py's kernels: forward and every backward kernel that exists for the head dims."""
    out = {}
    for dtype, hd, hdv in HDIM:
        for causal in (False, True):
            out[heuristics.fwd_traits(arch, dtype, hd, causal, head_dim_v=hdv).name] = \
                heuristics.fwd_traits(arch, dtype, hd, causal, head_dim_v=hdv)
            for kind in heuristics.BWD_KINDS:
                try:
                    t = heuristics.bwd_traits(arch, dtype, hd, causal, kind, head_dim_v=hdv)
                except heuristics.TraitsError:   # dkdv_atomic above 256: the split schedule only
                    continue
                out[t.name] = t
    return out


def needed_dropout(arch: str) -> dict:
    """test_dropout_gpu.py's kernels, and the dropout-free bf16 hdim 64/128/256 ones `--mode dropout` compares with."""
    out = {heuristics.dropout_mask_traits(arch).name: heuristics.dropout_mask_traits(arch)}
    for dtype, hd in DROPOUT:
        for causal in (False, True):
            for drop in (True, False) if (dtype, hd) in BENCH else (True,):
                ts = [heuristics.fwd_traits(arch, dtype, hd, causal, dropout=drop)]
                ts += [t for t in [heuristics.fwd_sm90_traits(arch, dtype, hd, causal, dropout=drop)] if t is not None]
                ts += [heuristics.bwd_traits(arch, dtype, hd, causal, kind, dropout=drop)
                       for kind in heuristics.BWD_KINDS]
                ts += [t for t in [heuristics.bwd_sm90_traits(arch, dtype, hd, causal, dropout=drop)] if t is not None]
                ts += list(heuristics.bwd_sm90_split_traits(arch, dtype, hd, causal, dropout=drop) or ())
                out.update((t.name, t) for t in ts)
    return out


def needed_tuned(arch: str, only: str | None = None) -> dict:
    """Kernels the arch's tuning files (flashgen/tuning_data/, the user's) make dispatch pick for the tests' head dims
    instead of the table's, where the tests' seqlens fall into a tuned bucket."""
    from flashgen import tuning
    both = ("fp16", "bf16")
    ts = tuning.tuned_traits(arch, both, [h for _, h in DROPOUT], dropout=(True,))
    if only is None:
        ts += tuning.tuned_traits(arch, both, FWD_HDIMS, ("fwd",)) + tuning.tuned_traits(arch, both, [h for _, h in BWD])
    return {t.name: t for t in ts}


def staged_choices(arch: str) -> list[tuple]:
    """(dtype, bucket, causal, choice) of the Hopper forward choices that name their K/V stages: the arch's tuning
    files' (set by hand) and heuristics.FWD_SM90_SHAPE_TILES' (both dtypes; as a tuning choice, for set_fwd_sm90)."""
    from flashgen import tuning
    return sorted(set(tuning.hand_set_sm90_choices(arch)) | {
        (dtype, b, c, (m, n, mainloop, stages)) for (b, c, _), (m, n, stages, mainloop)
        in heuristics.FWD_SM90_SHAPE_TILES.items() for dtype in ("fp16", "bf16")})


def needed_hopper(arch: str) -> dict:
    """test_hopper_gpu.py's kernels (the Hopper forward, both dtypes, every mainloop, and the tuner candidates it
    checks); they include the table's choices, which the other GPU tests' forwards run by default on sm_90a."""
    out = {}
    for dtype in ("fp16", "bf16"):
        for hd in (64, 96, 128, 192, 256):
            for causal in (False, True):
                for mainloop in heuristics.FWD_SM90_MAINLOOPS:
                    t = heuristics.fwd_sm90_traits(arch, dtype, hd, causal, mainloop=mainloop)
                    if t is not None:
                        out[t.name] = t
    # test_hopper_gpu.py's persistent variants (bf16, every mainloop), and the walk dispatch takes at the tests'
    # seqlens in the buckets of heuristics.FWD_SM90_PERSISTENT_SEQLEN (both dtypes).
    for dtype in ("fp16", "bf16"):
        for hd in (64, 128, 256):
            if dtype == "fp16" and hd not in heuristics.FWD_SM90_PERSISTENT_SEQLEN:
                continue
            for causal in (False, True):
                for mainloop in heuristics.FWD_SM90_MAINLOOPS:
                    t = heuristics.fwd_sm90_traits(arch, dtype, hd, causal, mainloop=mainloop, persistent=True)
                    out[t.name] = t
    # the tuner candidates: on the grid, and walked where the tests' short seqlens take the walk
    for hd, choice in HOPPER_CANDIDATES:
        for causal in (False, True):
            for persistent in (False, True) if hd in heuristics.FWD_SM90_PERSISTENT_SEQLEN else (False,):
                t = heuristics.fwd_sm90_traits(arch, "bf16", hd, causal, *choice, persistent=persistent)
                if t is not None:
                    out[t.name] = t
    # test_hopper_fwd_hand_set_choices: the choices that name their stages, walked and on the grid.
    for dtype, hd, causal, choice in staged_choices(arch):
        for persistent in (False, True):
            t = heuristics.fwd_sm90_traits(arch, dtype, hd, causal, *choice, persistent=persistent)
            out[t.name] = t
    return out


def needed_hopper_bwd(arch: str) -> dict:
    """test_hopper_bwd_gpu.py's kernels: the Hopper backward of each head-dim bucket it tests, both dtypes."""
    out = {}
    for dtype in ("fp16", "bf16"):
        for hd in heuristics.BWD_SM90_BUCKETS:
            for causal in (False, True):
                # test_hopper_bwd_gpu.py's overrides, each on and off: lse through shared memory (every bucket), and
                # up to head dim 128 early_dv, dq_red and dq_handoff (which its override leaves off for 128-row
                # query blocks)
                variants = [dict(lse_smem=v) for v in (False, True)]
                if hd <= 128:
                    rows = heuristics.bwd_sm90_traits(arch, dtype, hd, causal).block_m
                    variants += [{k: v} for k in ("early_dv", "dq_red") for v in (False, True)]
                    variants += [dict(dq_handoff=v and rows == 64) for v in (False, True)]
                for kw in variants:
                    t = heuristics.bwd_sm90_traits(arch, dtype, hd, causal, **kw)
                    if t is not None:
                        out[t.name] = t
                # test_hopper_bwd_split_gpu.py: the split schedule's two kernels, the dQ one in both loop forms
                split = heuristics.bwd_sm90_split_traits(arch, dtype, hd, causal)
                if split is not None:
                    dkdv, dq = split
                    for t in (dkdv, dq, dataclasses.replace(dq, overlap=not dq.overlap)):
                        out[t.name] = t
    return out


HOPPER_FAMILIES = ("fwd_sm90", "bwd_sm90", "bwd_dq_sm90")


def needed(arch: str, only: str | None = None) -> list:
    if only == "hdim":
        return list(needed_hdim(arch).values())
    if only == "hopper":
        return list({**needed_hopper(arch), **needed_hopper_bwd(arch)}.values())
    if only == "sm80":   # everything but the Hopper families: kernels a Hopper header edit leaves cached
        return [t for t in needed(arch) if t.family not in HOPPER_FAMILIES]
    out = needed_dropout(arch)
    out.update(needed_tuned(arch, only))
    if only == "dropout":
        return list(out.values())
    out.update(needed_hdim(arch))
    out.update(needed_hopper(arch))
    out.update(needed_hopper_bwd(arch))
    for dtype in ("fp16", "bf16"):
        for hd in FWD_HDIMS:
            for causal in (False, True):
                for persistent in (False, True):   # test_fwd_gpu.py runs the grid and the persistent walk
                    t = heuristics.fwd_traits(arch, dtype, hd, causal, persistent=persistent)
                    out[t.name] = t
    for dtype, hd in BWD:
        for causal in (False, True):
            for kind in heuristics.BWD_KINDS:
                t = heuristics.bwd_traits(arch, dtype, hd, causal, kind)
                out[t.name] = t
    return list(out.values())


def _priority(t) -> tuple:
    """Build order when a call's time is short: the Hopper kernels (12 s each; the forward is the default on
    sm_90a), the SM80 forwards and backwards, dropout kernels last."""
    return ("dropout" in t.name, t.family not in HOPPER_FAMILIES, t.name)


def main() -> int:
    from flashgen import cache
    from flashgen.cli import _compile_one, default_jobs
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: flashgen's, by CPUs and memory)")
    ap.add_argument("--only", choices=["dropout", "hdim", "hopper", "sm80"],
                    help="only the kernels of test_dropout_gpu.py and benchmarks/bench_attention.py --mode dropout, "
                         "those of test_hdim_gpu.py, or the Hopper kernels of test_hopper_gpu.py and "
                         "test_hopper_bwd_gpu.py, or every kernel but the Hopper forward and backward")
    ap.add_argument("--family", nargs="*", default=[],
                    help="only kernels of these families (e.g. fwd_sm90 bwd_sm90 bwd_pre dropout_mask: every kernel "
                         "the Hopper test files run, the tuned and dropout ones included, ~40 min on 2 cores)")
    ap.add_argument("--budget-seconds", type=float, default=0,
                    help="start no compile after this long (0: no limit); the rest compile on first use")
    args = ap.parse_args()
    args.jobs = args.jobs or default_jobs()
    traits = sorted((t for t in needed(args.arch, args.only)
                     if not cache.is_cached(t) and (not args.family or t.family in args.family)), key=_priority)
    t0, failures, done, stopped = time.perf_counter(), 0, 0, False
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futs = [pool.submit(_compile_one, t.to_dict()) for t in traits]
        for fut in as_completed(futs):
            if fut.cancelled():
                continue
            name, hit, secs, err, res = fut.result()
            done += 1
            if err:
                failures += 1
                print(f"FAILED {name}: {err.splitlines()[0]}", flush=True)
            if args.budget_seconds and time.perf_counter() - t0 > args.budget_seconds and not stopped:
                stopped = True
                left = sum(f.cancel() for f in futs)   # the queued ones; those running finish
                print(f"budget of {args.budget_seconds:.0f} s spent: {left} kernels left to compile on first use",
                      flush=True)
    print(f"{len(traits)} kernels to build, {done} built, {failures} failures, {time.perf_counter() - t0:.0f} s wall "
          f"({args.jobs} jobs)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
