"""Cold-process load cost of cached kernels: disk read + cuLibraryLoadData, and cubin sizes.

    python benchmarks/bench_load.py        (after `flashgen generate`)
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

t0 = time.perf_counter()
import flashgen  # noqa: E402
t_import = time.perf_counter() - t0

import torch  # noqa: E402

from codegen import heuristics  # noqa: E402
from flashgen import cache, dispatch, loader  # noqa: E402

torch.zeros(1, device="cuda")   # create the context outside the timings
arch = dispatch.device_arch(0)
rows = []
for t in heuristics.default_set(arch):
    if not cache.is_cached(t):
        continue
    t1 = time.perf_counter()
    k = loader.get_kernel(t)
    rows.append((t.name, k.meta["cubin_size"], time.perf_counter() - t1, k.load_seconds, k.meta["compile_seconds"]))
print(f"import flashgen: {t_import * 1e3:.1f} ms; {len(rows)} cached kernels for {arch}")
print(f"cubin size: median {statistics.median(r[1] for r in rows) / 1024:.0f} KB, max {max(r[1] for r in rows) / 1024:.0f} KB")
print(f"cache read + load: median {statistics.median(r[2] for r in rows) * 1e3:.1f} ms, "
      f"max {max(r[2] for r in rows) * 1e3:.1f} ms (cuLibraryLoadData alone: median "
      f"{statistics.median(r[3] for r in rows) * 1e3:.1f} ms)")
print(f"compile time on this machine: median {statistics.median(r[4] for r in rows):.0f} s, "
      f"max {max(r[4] for r in rows):.0f} s")
