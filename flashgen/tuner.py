"""`flashgen tune`: time the candidate traits per (dtype, head-dim bucket, causal, seqlen bucket) on the local GPU
and write the winners to a tuning file (format and lookup: flashgen/tuning.py).

Per (dtype, head dim, causal) the candidates are the SM80 path's forward tiles (heuristics.fwd_tile_candidates),
on sm_90a also the Hopper forward's (block_m, block_n, mainloop) (heuristics.fwd_sm90_candidates), and, for each
backward schedule, the tiles of heuristics.bwd_tile_candidates; the heuristic's own choice is always candidate
zero ("default"). All kernels compile first in a process pool, in key order, while the GPU times the
keys whose kernels are ready. Each candidate runs through the interface's launchers with its tiles forced by
dispatch.set_fwd_tiles / set_bwd_tiles, its output is checked once against the default's (a broken candidate
cannot win), and it is timed with CUDA events (median). Problem: flash-attn's benchmark shapes, 16k tokens
(batch = 16384 / seqlen) and model dim 2048 (nheads = 2048 / hdim), random inputs.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path

from codegen import heuristics

from . import tuning

TOKENS, MODEL_DIM = 16384, 2048
# What a tune measures: the SM80 path's forward tiles, the Hopper forward's (sm_90a only), the backward.
FAMILIES = ("fwd", "fwd_sm90", "bwd")
WARMUP, REPS = 3, 15
# A candidate replaces the default only when this much faster: smaller differences are run-to-run noise.
MARGIN = 1.02


def fwd_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, hdim: int, causal: bool) -> float:
    f = 4.0 * batch * nheads * seqlen_q * seqlen_k * hdim
    return f / 2 if causal else f


def problem(dtype: str, hdim: int, seqlen: int, backward: bool = False):
    """Random q, k, v (and dout) of the benchmark shape, and its (batch, nheads)."""
    import torch
    b, h = max(1, TOKENS // seqlen), max(1, MODEL_DIM // hdim)
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    qkv = [torch.randn(b, seqlen, h, hdim, device="cuda", dtype=tdtype) for _ in range(3 + backward)]
    return qkv, (b, h)


def time_ms(fn, warmup: int = WARMUP, reps: int = REPS) -> float:
    """Median milliseconds of fn() on the current stream, timed with CUDA events."""
    import torch
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def close(outs, refs) -> bool:
    """Same result as the default's up to accumulation order: each tensor within 2% of its largest magnitude
    (a few bf16 ulps there; a wrong tile mapping is off by the whole magnitude)."""
    for a, r in zip(outs, refs):
        a, r = a.float(), r.float()
        if not bool(a.isfinite().all()) or (a - r).abs().max().item() > 0.02 * max(r.abs().max().item(), 1e-3):
            return False
    return True


def fmt_fwd(tiles) -> str:
    return f"{tiles[0]}x{tiles[1]} w{tiles[2]}"


def fmt_sm90(choice) -> str:
    return f"sm90 {choice[0]}x{choice[1]} {choice[2]}" + (f" s{choice[3]}" if len(choice) > 3 else "")


def fmt_bwd(schedule: str, tiles: dict) -> str:
    shown = {f"{m}x{n} s{s}" for m, n, s in tiles.values()}
    return f"{schedule} " + "/".join(sorted(shown))


def seqlen_buckets(seqlens) -> list[int]:
    """The seqlen buckets of `seqlens` (0: unknown), in order."""
    return sorted({tuning.seqlen_bucket(s) if s else 0 for s in seqlens})


def plan(arch: str, dtype: str, hdim: int, causal: bool, families, seqlens=(0,)) -> dict:
    """The candidates of one (dtype, hdim, causal): {"fwd": [tiles, ...], "fwd_sm90": {seqlen bucket: [(m, n,
    mainloop[, stages]), ...]}, "bwd": [(schedule, {kind: tiles}), ...]}, the heuristic's choice first in each list
    (the Hopper forward's table choice, and its walk, follow the seqlen bucket)."""
    out = {"fwd": [], "fwd_sm90": {}, "bwd": []}
    if "fwd" in families:
        out["fwd"] = heuristics.fwd_tile_candidates(arch, dtype, hdim, causal)
    if "fwd_sm90" in families:
        out["fwd_sm90"] = {b: c for b in seqlen_buckets(seqlens)
                           if (c := heuristics.fwd_sm90_candidates(arch, dtype, hdim, causal, b))}
    if "bwd" in families:
        auto = heuristics.bwd_schedule("auto", False, 1, 0, 0)
        for schedule in (auto,) + tuple(s for s in heuristics.BWD_SCHEDULES if s != auto):
            kinds = heuristics.bwd_kinds(schedule)[1:]
            cands = []
            try:   # the heuristic's tiles for this schedule (per kind), then the shared candidates
                cands.append({k: _bwd_tiles(heuristics.bwd_traits(arch, dtype, hdim, causal, k)) for k in kinds})
            except Exception:
                pass
            for tiles in heuristics.bwd_tile_candidates(arch, dtype, hdim, causal, schedule):
                c = {k: tiles for k in kinds}
                if c not in cands:
                    cands.append(c)
            out["bwd"] += [(schedule, c) for c in cands]
    return out


def _bwd_tiles(t) -> tuple[int, int, int]:
    return (t.block_m, t.block_n, t.stages)


def kernels_of(arch: str, dtype: str, hdim: int, causal: bool, cands: dict) -> dict:
    """name -> traits of every kernel the candidates launch (the Hopper forward's per seqlen bucket: its walk, grid or
    persistent, follows the bucket; 0: unknown, the grid)."""
    ts = [heuristics.fwd_traits(arch, dtype, hdim, causal, tiles) for tiles in cands["fwd"]]
    ts += [heuristics.fwd_sm90_traits(arch, dtype, hdim, causal, *c, seqlen=b)
           for b, cs in cands.get("fwd_sm90", {}).items() for c in cs]
    if cands["bwd"]:   # the table's forward makes the backward's inputs
        ts += [heuristics.fwd_traits(arch, dtype, hdim, causal),
               heuristics.bwd_traits(arch, dtype, hdim, causal, "pre")]
    for _, tiles in cands["bwd"]:
        ts += [heuristics.bwd_traits(arch, dtype, hdim, causal, kind, t) for kind, t in tiles.items()]
    return {t.name: t for t in ts}


def measure_fwd(arch, dtype, hdim, causal, seqlen, cands, ready, say, hopper: bool = False) -> list[tuple]:
    """[(candidate, TFLOP/s or None), ...] in candidate order. Candidates are the SM80 path's tiles, or with
    `hopper` the Hopper forward's (block_m, block_n, mainloop)."""
    from . import dispatch, interface
    if hopper:   # the kernel dispatch runs at this seqlen: the walk follows its bucket
        bucket = tuning.seqlen_bucket(seqlen)
        traits_of, force, fmt = (lambda c: heuristics.fwd_sm90_traits(arch, dtype, hdim, causal, *c, seqlen=bucket),
                                 lambda c: dispatch.set_fwd_sm90(dtype, hdim, causal, c), fmt_sm90)
    else:
        traits_of, force, fmt = (lambda c: heuristics.fwd_traits(arch, dtype, hdim, causal, c),
                                 lambda c: dispatch.set_fwd_tiles(dtype, hdim, causal, c), fmt_fwd)
    (q, k, v), (b, h) = problem(dtype, hdim, seqlen)
    flops, scale = fwd_flops(b, h, seqlen, seqlen, hdim, causal), hdim ** -0.5
    ref, res = None, []
    with dispatch.hopper_forward(hopper):
        for i, cand in enumerate(cands):
            tf = None
            if i > 0 and ref is None:
                say("    fwd: the default did not run; key skipped")
                break
            if traits_of(cand).name not in ready:
                say(f"    fwd {fmt(cand):<20} dropped: not compiled")
            else:
                force(cand)
                try:
                    out = interface._flash_attn_forward(q, k, v, scale, causal)[0]
                    if i == 0:
                        ref = out
                    if not close([out], [ref]):
                        say(f"    fwd {fmt(cand):<20} dropped: output differs from the default's")
                    else:
                        tf = flops / time_ms(lambda: interface._flash_attn_forward(q, k, v, scale, causal)) / 1e9
                        say(f"    fwd {fmt(cand):<20} {tf:6.1f} TFLOP/s")
                except Exception as e:
                    say(f"    fwd {fmt(cand):<20} dropped: {str(e).splitlines()[0][:120]}")
                finally:
                    force(None)
            res.append((cand, tf))
    return res


def measure_bwd(arch, dtype, hdim, causal, seqlen, cands, ready, say) -> list[tuple]:
    """[(schedule, {kind: tiles}, TFLOP/s or None), ...] in candidate order."""
    from . import dispatch, interface
    (q, k, v, dout), (b, h) = problem(dtype, hdim, seqlen, backward=True)
    flops, scale = 2.5 * fwd_flops(b, h, seqlen, seqlen, hdim, causal), hdim ** -0.5
    dispatch.set_fwd_tiles(dtype, hdim, causal, heuristics.fwd_tiles(arch, hdim, causal))   # compiled, not tuned
    try:
        with dispatch.hopper_forward(False):   # the SM80 forward, the one the tune compiled
            out, lse = interface._flash_attn_forward(q, k, v, scale, causal)
    finally:
        dispatch.set_fwd_tiles(dtype, hdim, causal, None)
    ref, res = None, []
    for i, (schedule, tiles) in enumerate(cands):
        tf, label = None, fmt_bwd(schedule, tiles)
        if i > 0 and ref is None:
            say("    bwd: the default did not run; key skipped")
            break
        names = [heuristics.bwd_traits(arch, dtype, hdim, causal, kind, t).name for kind, t in tiles.items()]
        if not all(n in ready for n in names + [heuristics.bwd_traits(arch, dtype, hdim, causal, "pre").name]):
            say(f"    bwd {label:<22} dropped: not compiled")
        else:
            for kind, t in tiles.items():
                dispatch.set_bwd_tiles(dtype, hdim, causal, kind, t)
            try:
                def run():   # the SM80 kernels these tiles are for, also where the Hopper backward takes the call
                    with dispatch.hopper_backward(False):
                        return interface._flash_attn_backward(dout, q, k, v, out, lse, scale, causal,
                                                              backward_impl=schedule)
                grads = run()
                if i == 0:
                    ref = grads
                if not close(grads, ref):
                    say(f"    bwd {label:<22} dropped: gradients differ from the default's")
                else:
                    tf = flops / time_ms(run) / 1e9
                    say(f"    bwd {label:<22} {tf:6.1f} TFLOP/s")
            except Exception as e:
                say(f"    bwd {label:<22} dropped: {str(e).splitlines()[0][:120]}")
            finally:
                for kind in tiles:
                    dispatch.set_bwd_tiles(dtype, hdim, causal, kind, None)
        res.append((schedule, tiles, tf))
    return res


def _pick(default, best, tf):
    """The best candidate when it beats the default by MARGIN, else the default (None: default not measured)."""
    if tf(default) is None:
        return None
    return best if tf(best) >= MARGIN * tf(default) else default


def entry_from(dtype, hdim, causal, seqlen, fwd_res, bwd_res, sm90_res=()) -> tuple[tuning.Entry, list[tuple]]:
    """The tuning entry for one key and its summary rows (pass, default, TFLOP/s, chosen, TFLOP/s)."""
    e = tuning.Entry(dtype, hdim, causal, tuning.seqlen_bucket(seqlen), measured={"seqlen": seqlen})
    rows = []
    for family, res, fmt in (("fwd", fwd_res, fmt_fwd), ("fwd_sm90", sm90_res, fmt_sm90)):
        ok = [r for r in res if r[1] is not None]
        chosen = _pick(res[0], max(ok, key=lambda r: r[1]), lambda r: r[1]) if ok else None
        if chosen is not None:
            setattr(e, family, tuple(chosen[0]))
            e.measured[family] = {"default": [list(res[0][0]), round(res[0][1], 1)],
                                  "chosen": [list(chosen[0]), round(chosen[1], 1)], "candidates": len(ok)}
            rows.append((family, fmt(res[0][0]), res[0][1], fmt(chosen[0]), chosen[1]))
    if bwd_res:
        picks = {}
        for schedule in heuristics.BWD_SCHEDULES:   # per schedule: its own winner (deterministic calls run split)
            mine = [r for r in bwd_res if r[0] == schedule]
            ok = [r for r in mine if r[2] is not None]
            if ok:
                picks[schedule] = _pick(mine[0], max(ok, key=lambda r: r[2]), lambda r: r[2])
        default = bwd_res[0]
        picks = {s: p for s, p in picks.items() if p is not None}
        if default[2] is not None and picks:
            chosen = _pick(default, max(picks.values(), key=lambda r: r[2]), lambda r: r[2])
            e.bwd_schedule = chosen[0]
            e.bwd_tiles = {k: t for p in picks.values() for k, t in p[1].items()}
            e.measured["bwd"] = {"default": [fmt_bwd(default[0], default[1]), round(default[2], 1)],
                                 "chosen": [fmt_bwd(chosen[0], chosen[1]), round(chosen[2], 1)],
                                 "candidates": sum(r[2] is not None for r in bwd_res)}
            rows.append(("bwd", fmt_bwd(default[0], default[1]), default[2], fmt_bwd(chosen[0], chosen[1]),
                         chosen[2]))
    return e, rows


def merge(old: dict, new: list[tuning.Entry]) -> dict:
    """Entries of an existing file updated with new measurements; a family not measured now is kept."""
    out = dict(old)
    for e in new:
        prev = out.get(e.key)
        if prev is not None:
            if e.fwd is None:
                e.fwd, e.measured["fwd"] = prev.fwd, prev.measured.get("fwd")
            if e.fwd_sm90 is None:
                e.fwd_sm90, e.measured["fwd_sm90"] = prev.fwd_sm90, prev.measured.get("fwd_sm90")
            if e.bwd_schedule is None and not e.bwd_tiles:
                e.bwd_schedule, e.bwd_tiles = prev.bwd_schedule, prev.bwd_tiles
                e.measured["bwd"] = prev.measured.get("bwd")
            e.measured = {k: v for k, v in e.measured.items() if v is not None}
        out[e.key] = e
    return out


def tune(*, hdims, causals, dtypes, seqlens, families, budget_minutes: float, jobs: int, out: Path | None,
         say=print) -> tuple[Path, list[tuning.Entry]]:
    """Measure, write `out` (default: the user tuning file for this GPU), return it and the new entries."""
    import torch
    from . import dispatch
    from .cli import _compile_one
    t0 = time.monotonic()
    deadline = t0 + budget_minutes * 60
    dev = torch.cuda.current_device()
    arch, gpu = dispatch.device_arch(dev), dispatch.device_name(dev)
    out = Path(out) if out else tuning.user_file(gpu)
    groups = [(d, h, bool(c)) for d in dtypes for h in hdims for c in causals]
    plans = {g: plan(arch, *g, families, seqlens) for g in groups}
    kernels = {g: kernels_of(arch, *g, plans[g]) for g in groups}
    n = len({name for ks in kernels.values() for name in ks})
    say(f"flashgen tune: {gpu} ({arch}), {len(groups)} x {len(seqlens)} keys, {n} kernels to build on {jobs} jobs, "
        f"budget {budget_minutes:g} min; writing {out}")

    # Niced compile workers: the timing loop in this process must keep the GPU's queue fed.
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=os.nice, initargs=(10,))
    futs = {name: pool.submit(_compile_one, t.to_dict())   # in key order: the first keys are ready first
            for g in groups for name, t in kernels[g].items()}
    ready, entries, rows, stopped = set(), [], [], False
    try:
        for g, seqlen in ((g, s) for g in groups for s in seqlens):
            dtype, hdim, causal = g
            _, pending = wait([futs[name] for name in kernels[g]], timeout=max(0.0, deadline - time.monotonic()))
            if pending or time.monotonic() > deadline:
                say(f"flashgen tune: budget of {budget_minutes:g} min reached; stopping")
                stopped = True
                break
            for name in kernels[g]:
                err = futs[name].result()[3]
                if err and name not in ready and seqlen == seqlens[0]:
                    say(f"  {name}: compile failed, candidate dropped: {err.strip().splitlines()[-1][:160]}")
                elif not err:
                    ready.add(name)
            say(f"  {dtype} hdim {hdim} {'causal' if causal else 'non-causal'} seqlen {seqlen} "
                f"(bucket {tuning.seqlen_bucket(seqlen)}), at {time.monotonic() - t0:.0f} s:")
            fwd_res = measure_fwd(arch, dtype, hdim, causal, seqlen, plans[g]["fwd"], ready, say)
            sm90_res = measure_fwd(arch, dtype, hdim, causal, seqlen,
                                   plans[g]["fwd_sm90"].get(tuning.seqlen_bucket(seqlen), []), ready, say, hopper=True)
            bwd_res = measure_bwd(arch, dtype, hdim, causal, seqlen, plans[g]["bwd"], ready, say)
            e, r = entry_from(dtype, hdim, causal, seqlen, fwd_res, bwd_res, sm90_res)
            if e.fwd or e.fwd_sm90 or e.bwd_schedule:
                entries.append(e)
                rows += [(dtype, hdim, causal, seqlen) + row for row in r]
    finally:
        if stopped:   # the budget is spent: end the compiles still running (our own workers) instead of waiting
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)

    old = {}
    if out.exists():
        prev = tuning.read(out, gpu, arch)   # a stale or corrupt file is replaced (with a warning)
        old = prev.entries if prev else {}
    merged = merge(old, entries)
    if entries:
        tuning.write(out, gpu, arch, merged.values())
        dispatch.reload_tuning()
    if rows:
        say(f"\n# flashgen tune, {gpu}, flashgen {tuning._version()}, TFLOP/s (median of {REPS}; "
            f"16k tokens, model dim 2048; backward 2.5x forward FLOPs)")
        say("| dtype | hdim | causal | seqlen | pass | default | TFLOP/s | tuned | TFLOP/s | tuned / default |")
        say("|---|---:|:---:|---:|:---:|---|---:|---|---:|---:|")
    for dtype, hdim, causal, seqlen, pas, dname, dtf, cname, ctf in rows:
        say(f"| {dtype} | {hdim} | {'yes' if causal else 'no'} | {seqlen} | {pas} | {dname} | {dtf:.0f} | "
            f"{cname} | {ctf:.0f} | {ctf / dtf:.2f} |")
    measured = len(entries)
    total = len(groups) * len(seqlens)
    say(f"\nflashgen tune: {measured} of {total} keys measured in {time.monotonic() - t0:.0f} s; "
        + (f"wrote {len(merged)} entries to {out}" if entries else "nothing written"))
    return out, entries


def main(args) -> int:
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        print("flashgen tune: needs a CUDA GPU to time kernels on, and none is available "
              "(torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from .cli import default_jobs
    seqlens = args.seqlen or [2048, 8192]
    buckets = [tuning.seqlen_bucket(s) for s in seqlens]
    if any(s <= 0 for s in seqlens) or len(set(buckets)) != len(buckets):
        print(f"flashgen tune: --seqlen values must be positive and fall into different buckets "
              f"{tuning.SEQLEN_BUCKETS}; got {seqlens} -> buckets {buckets}", file=sys.stderr)
        return 2
    _, entries = tune(hdims=args.hdim or [64, 128, 256], causals=args.causal or [0, 1], dtypes=args.dtype or ["bf16"],
                      seqlens=seqlens, families=tuple(args.family or FAMILIES),
                      budget_minutes=args.budget_minutes, jobs=args.jobs or default_jobs(), out=args.out)
    return 0 if entries else 1
