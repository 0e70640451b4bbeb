"""Chart the latest forward benchmark table of benchmarks/RESULTS.md: TFLOP/s against seqlen.

    python benchmarks/plot.py [--results benchmarks/RESULTS.md] [--out benchmarks/fwd_bf16.png]

Reads the first table with the header `| hdim | causal | seqlen | flashgen | SDPA FLASH | SDPA CUDNN | ...`
(RESULTS.md keeps the latest run first) and draws one panel per head dim, non-causal on the top row and
causal on the bottom, with a line for flashgen and each SDPA backend. Needs matplotlib.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = ["hdim", "causal", "seqlen", "flashgen", "SDPA FLASH", "SDPA CUDNN"]
SERIES = [("flashgen", "tab:red", "o"), ("SDPA FLASH", "tab:blue", "s"), ("SDPA CUDNN", "tab:green", "^")]


def _cells(line: str) -> list[str] | None:
    line = line.strip()
    if not line.startswith("|"):
        return None
    return [c.strip() for c in line.strip("|").split("|")]


def read_table(text: str) -> tuple[str, list[dict]]:
    """The first forward table: (title of the `## ` section holding it, rows as dicts of the named columns)."""
    lines = text.splitlines()
    title = ""
    for i, line in enumerate(lines):
        if line.startswith("## "):
            title = line[3:].strip()
        cells = _cells(line)
        if cells is None or cells[:len(HEADER)] != HEADER:
            continue
        rows = []
        for row_line in lines[i + 2:]:   # skip the |---:| alignment line
            row = _cells(row_line)
            if row is None:
                break
            rec = dict(zip(cells, row))
            rows.append({"hdim": int(rec["hdim"]), "causal": rec["causal"].lower() in ("yes", "true", "1"),
                         "seqlen": int(rec["seqlen"]),
                         **{name: float(rec[name]) for name, *_ in SERIES}})
        return title, rows
    raise ValueError(f"no table with header | {' | '.join(HEADER)} | found")


def plot(title: str, rows: list[dict], out: Path):
    import matplotlib
    matplotlib.use("Agg")   # files only, no display needed
    import matplotlib.pyplot as plt

    hdims = sorted({r["hdim"] for r in rows})
    modes = [c for c in (False, True) if any(r["causal"] == c for r in rows)]
    top = max(r[name] for r in rows for name, *_ in SERIES)
    fig, axes = plt.subplots(len(modes), len(hdims), figsize=(3.6 * len(hdims), 3.0 * len(modes)),
                             squeeze=False, sharex=True, sharey=True)
    for row_axes, causal in zip(axes, modes):
        for ax, hdim in zip(row_axes, hdims):
            pts = sorted((r for r in rows if r["hdim"] == hdim and r["causal"] == causal), key=lambda r: r["seqlen"])
            for name, color, marker in SERIES:
                ax.plot([r["seqlen"] for r in pts], [r[name] for r in pts], label=name, color=color,
                        marker=marker, markersize=4, linewidth=1.5)
            ax.set_xscale("log", base=2)
            seqlens = [r["seqlen"] for r in pts]
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(0, top * 1.08)
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(f"hdim {hdim}, {'causal' if causal else 'non-causal'}", fontsize=10)
            if ax in axes[-1]:
                ax.set_xlabel("seqlen")
            if ax is row_axes[0]:
                ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Forward, bf16: {title}" if title else "Forward, bf16", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="markdown file with the tables")
    ap.add_argument("--out", type=Path, default=HERE / "fwd_bf16.png", help="PNG to write")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("benchmarks/plot.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    try:
        title, rows = read_table(args.results.read_text())
    except (OSError, ValueError) as e:
        print(f"{args.results}: {e}", file=sys.stderr)
        return 1
    if not rows:
        print(f"{args.results}: the forward table has no rows", file=sys.stderr)
        return 1
    plot(title, rows, args.out)
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
