"""SM clock and board power while one call runs back to back: SDPA CUDNN and each ab_sm90 variant, sustained.

    python benchmarks/clock_power.py --family fwd --hdim 256 --causal 0 --seqlen 8192 \
        --variant hkv=FLASHGEN_EXP_HALF_KV --out .gpucache/ab   [--seconds 2.5]

Takes ab_sm90.py's arguments (compile the variants with it first) and, per shape, runs each call (CUDNN, base,
the variants, base again) back to back for --seconds with no L2 flush, sampling `nvidia-smi` every 50 ms: TFLOP/s,
the median and lowest SM clock and the median power. On the H100 both cuDNN and flashgen's forward sit at the 700 W
cap there, so the clock (and with it the speed) depends on the energy a kernel spends per FLOP (NOTES, fortieth
session). do_bench's numbers (ab_sm90.py bench) flush L2 between calls and are the ones the targets use.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ab_sm90  # noqa: E402


def sustained(fn, seconds: float):
    """(ms per call, [(SM clock MHz, power W)]) over `seconds` of back-to-back calls, the first 200 ms of samples
    dropped (the clock settles)."""
    import torch
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, n = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    samples = [(float(c), float(p)) for c, p in rows][4:]
    return start.elapsed_time(end) / n, samples


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    seconds = 2.5
    if "--seconds" in argv:
        i = argv.index("--seconds")
        seconds = float(argv[i + 1])
        del argv[i:i + 2]
    args = ab_sm90.parse_args(["bench", *argv])
    import torch
    torch.zeros(1, device="cuda")
    names = list(args.defines)
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, {args.family}, {seconds} s of back-to-back calls each")
    print("| hdim | causal | seqlen | call | TFLOP/s | SM clock MHz (median / min) | power W (median) |")
    print("|---:|:---:|---:|---|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                cudnn, ours, flops = ab_sm90.calls(args, names, hdim, causal, s)
                for name, fn in [("CUDNN", cudnn), *ours.items(), ("base again", ours["base"])]:
                    ms, samples = sustained(fn, seconds)
                    clk = sorted(c for c, _ in samples)
                    pw = sorted(p for _, p in samples)
                    print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {name} | {flops / ms / 1e9:.0f} | "
                          f"{clk[len(clk) // 2]:.0f} / {clk[0]:.0f} | {pw[len(pw) // 2]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
