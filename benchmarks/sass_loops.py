"""Static look at a Hopper kernel's main loop without a GPU: compile it (NVRTC, as flashgen does), disassemble the
cubin with cuobjdump, and report each loop that issues wgmmas with ptxas's own schedule, read from the control bits
of every instruction: the stall cycles it waits before the next instruction may issue. Their sum over a loop body is
a static cycle estimate for one warp (dynamic waits on barriers, wgmma and memory not included); summed per opcode
it shows which chain the warp waits on (twenty-fourth session: the forward's row max as a serial FMNMX chain, the
MUFU.EX2 pace of one per 8 cycles).

    python benchmarks/sass_loops.py fwd 128 [--causal] [--dropout] [-D NAME=VALUE ...] [--header H] [--dump]
    python benchmarks/sass_loops.py bwd 64 --causal
    python benchmarks/sass_loops.py ab .gpucache/ab     (ab_sm90.py compile's cubins: each variant's main loop
                                                          against the base's)
    python benchmarks/sass_loops.py audit               (issue 7's SASS check of the kernels the 12 benchmark shapes
                                                          run, and the split schedule's: HGMMA, TMA loads, no
                                                          spills, registers per warpgroup)

`ab` exists because an edit outside a loop can change the loop's code (twenty-ninth session: a `__nanosleep` before
the forward's walk added 27-42 instructions and 3 spill accesses to its loop and cost 2-12%). Read an A/B of such an
edit only where the loop matches the base's.

cuobjdump comes from PATH or the pip wheel nvidia-cuda-cuobjdump (`pip install nvidia-cuda-cuobjdump`); no GPU needed.
The kernel is the one dispatch runs for bf16 at seqlen 8k on the H100 (ab_sm90.py's traits_for); -D and --header
compile a variant as ab_sm90.py does.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The Volta-and-later control bits in the high 64-bit word of each 128-bit instruction.
STALL_SHIFT, STALL_MASK = 41, 0xF
WAIT_SHIFT, WAIT_MASK = 52, 0x3F


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for site in sys.path:
        hits = glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump"))
        if hits:   # the wheel's cuobjdump runs the nvdisasm beside it
            os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + os.path.dirname(hits[0])
            return hits[0]
    sys.exit("cuobjdump not found: put it on PATH or `pip install nvidia-cuda-cuobjdump`")


def parse_sass(text: str) -> list[tuple[int, str, int, int]]:
    """(address, instruction text, stall cycles, wait-barrier mask) per instruction of cuobjdump -sass output."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* 0x[0-9a-f]+ \*/", line)
        hi = re.match(r"\s*/\* (0x[0-9a-f]+) \*/\s*$", lines[i + 1])
        if m and hi:
            word = int(hi.group(1), 16)
            out.append((int(m.group(1), 16), m.group(2).rstrip(" ;"), (word >> STALL_SHIFT) & STALL_MASK,
                        (word >> WAIT_SHIFT) & WAIT_MASK))
    return out


def opcode(text: str) -> str:
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def wgmma_loops(ins: list, innermost: bool = True) -> list[tuple[int, int]]:
    """(first, last) addresses of the backward branches' bodies that hold a wgmma (HGMMA), shortest first; innermost:
    only those that hold no other such body (not the tile walk around the main loops). The retry blocks of mbarrier
    waits, which ptxas places after the kernel's end, branch back into the loops too: their ranges overlap the main
    loop's and run past it, so the main loop is the shortest."""
    loops = set()
    for addr, text, _, _ in ins:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            if any(lo <= a <= addr and opcode(t) == "HGMMA" for a, t, _, _ in ins):
                loops.add((lo, addr))
    if innermost:
        loops = {(lo, hi) for lo, hi in loops
                 if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in loops)}
    return sorted(loops, key=lambda lh: lh[1] - lh[0])


def report(ins: list, lo: int, hi: int, top: int, dump: bool) -> None:
    body = [x for x in ins if lo <= x[0] <= hi]
    stalls, counts = collections.Counter(), collections.Counter()
    for _, text, stall, _ in body:
        stalls[opcode(text)] += stall
        counts[opcode(text)] += 1
    print(f"loop {lo:#x}-{hi:#x}: {len(body)} instructions, {sum(s for _, _, s, _ in body)} stall cycles, "
          f"{counts['HGMMA']} HGMMA, {counts['MUFU']} MUFU")
    print("  stall cycles / instructions by opcode: " +
          ", ".join(f"{k} {v}/{counts[k]}" for k, v in stalls.most_common(top)))
    if dump:
        for addr, text, stall, wait in body:
            print(f"  {addr:05x} stall {stall:2d} wait {wait:06b}  {text}")


def sass_of(cubin: bytes) -> list:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return parse_sass(subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                                         check=True).stdout)


def compare_ab(out_dir: str) -> int:
    """Per kernel of an ab_sm90.py compile directory and per variant: the main loop's instructions, stall cycles and
    spill accesses (in the loop / in all), and whether its opcode sequence is the base's."""
    import pickle
    kernels = collections.defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(out_dir, "*__*.pkl"))):
        variant, kernel = os.path.basename(path)[:-4].split("__", 1)
        with open(path, "rb") as f:
            kernels[kernel][variant] = pickle.load(f)[0]
    spills = lambda xs: sum(opcode(t) in ("LDL", "STL") for _, t, _, _ in xs)
    for kernel, variants in kernels.items():
        print(kernel)
        base_ops = None
        for variant in ["base"] + sorted(set(variants) - {"base"}):
            if variant not in variants:
                continue
            ins = sass_of(variants[variant])
            loops = wgmma_loops(ins)
            lo, hi = loops[0] if loops else (0, -1)
            body = [x for x in ins if lo <= x[0] <= hi]
            ops = [opcode(t) for _, t, _, _ in body]
            same = ""
            if variant == "base":
                base_ops = ops
            elif base_ops is not None:
                same = "  same opcodes as base" if ops == base_ops else "  differs from base"
            print(f"  {variant:10s} loop {len(body)} instructions, {sum(x[2] for x in body)} stall cycles, "
                  f"spill accesses {spills(body)} in the loop / {spills(ins)} in all{same}")
    return 0


def audit(seqlens=(2048, 8192)) -> int:
    """One markdown row per kernel dispatch runs for the benchmark shapes (bf16, hdim 64 / 128 / 256, causal or not,
    forward and backward; compiled into the cache if missing): ptxas's registers and spills, the setmaxnreg counts
    (producer / consumers), and the SASS's HGMMA, TMA loads (UTMALDG), TMA stores and bulk reduces (UTMASTG / UBLKRED),
    16-byte reds (REDG) and local-memory accesses (LDL / STL)."""
    from ab_sm90 import traits_for
    from flashgen import cache
    shapes = collections.defaultdict(list)
    for family in ("fwd", "bwd"):
        for hdim in (64, 128, 256):
            for causal in (False, True):
                for seqlen in seqlens:
                    t = traits_for(family, hdim, causal, seqlen)
                    shapes[t].append(f"{hdim}{' causal' if causal else ''} {seqlen // 1024}k")
    from codegen import heuristics
    for hdim in (64, 128, 256):   # the split (deterministic) schedule's two kernels, the same at every seqlen
        for causal in (False, True):
            for t in heuristics.bwd_sm90_split_traits("sm_90a", "bf16", hdim, causal):
                shapes[t].append(f"split {hdim}{' causal' if causal else ''}")
    print("| kernel | shapes | registers (ptxas) | setmaxnreg | spills (B) | HGMMA | UTMALDG | UTMASTG | UBLKRED | REDG "
          "| LDL / STL |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    bad = 0
    for t, where in shapes.items():
        cubin, meta, _ = cache.get_or_compile(t, jit_log=False)
        res = meta.get("resources", {})
        ins = sass_of(cubin)
        ops = collections.Counter(opcode(text) for _, text, _, _ in ins)
        regs = sorted({int(m.group(1), 0) for _, text, _, _ in ins
                       for m in [re.search(r"USETMAXREG\S*\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+|\d+)", text)] if m})
        spills = res.get("spill_stores", 0) + res.get("spill_loads", 0)
        bad += bool(spills or ops["LDL"] or ops["STL"] or not ops["HGMMA"] or not ops["UTMALDG"])
        print(f"| {t.name} | {', '.join(where)} | {res.get('registers')} | {' / '.join(map(str, regs)) or '-'} | "
              f"{spills} | {ops['HGMMA']} | {ops['UTMALDG']} | {ops['UTMASTG']} | {ops['UBLKRED']} | {ops['REDG']} | "
              f"{ops['LDL']} / {ops['STL']} |")
    print(f"{len(shapes)} kernels; {bad} with spills, local-memory accesses or no HGMMA / UTMALDG")
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ab"] and len(argv) == 2:
        return compare_ab(argv[1])
    if argv[:1] == ["audit"]:
        return audit()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=["fwd", "bwd"])
    ap.add_argument("hdim", type=int)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dropout", action="store_true")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME[=VALUE]")
    ap.add_argument("--header", help="a patched copy of the family's header to inline (as ab_sm90.py --header)")
    ap.add_argument("--top", type=int, default=12, help="opcodes to list per loop")
    ap.add_argument("--dump", action="store_true", help="print every instruction of each loop with its stall")
    ap.add_argument("--all-loops", action="store_true", help="also the loops around the main loops")
    args = ap.parse_args(argv)

    from ab_sm90 import INCLUDE, traits_for, variant_source
    from codegen import heuristics
    from flashgen import compiler
    if args.dropout:
        t = (heuristics.fwd_sm90_traits("sm_90a", "bf16", args.hdim, args.causal, dropout=True, seqlen=8192)
             if args.family == "fwd" else
             heuristics.bwd_sm90_traits("sm_90a", "bf16", args.hdim, args.causal, dropout=True))
    else:
        t = traits_for(args.family, args.hdim, args.causal, 8192)
    header = args.header or os.path.join(ROOT, "templates", "include", INCLUDE[args.family])
    src = variant_source(args.family, t, header, dict((d.split("=", 1) + [""])[:2] for d in args.defines))
    res = compiler.compile_source(src, t.name, t.arch, "<sass_loops>")
    print(t.name, res.resources)
    ins = sass_of(res.cubin)
    for lo, hi in wgmma_loops(ins, innermost=not args.all_loops):
        report(ins, lo, hi, args.top, args.dump)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
