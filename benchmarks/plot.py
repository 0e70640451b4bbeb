"""Chart the latest forward or backward benchmark table of benchmarks/RESULTS.md: TFLOP/s against seqlen.

    python benchmarks/plot.py [--mode fwd|bwd] [--results benchmarks/RESULTS.md] [--out benchmarks/<mode>_bf16.png]

Reads the first table whose header starts `| hdim | causal | seqlen | flashgen | SDPA FLASH | SDPA CUDNN |`
(forward) or `| hdim | causal | seqlen | fused | split | auto (pick) | SDPA FLASH | SDPA CUDNN |` (backward;
flashgen's line is what "auto" picks) -- RESULTS.md keeps the latest run first -- and draws one panel per head
dim, non-causal on the top row and causal on the bottom, with a line for flashgen and each SDPA backend.
Needs matplotlib.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# mode -> (table header prefix, column holding flashgen's number, chart title)
MODES = {
    "fwd": (["hdim", "causal", "seqlen", "flashgen", "SDPA FLASH", "SDPA CUDNN"], "flashgen", "Forward"),
    "bwd": (["hdim", "causal", "seqlen", "fused", "split", "auto (pick)", "SDPA FLASH", "SDPA CUDNN"], "auto (pick)",
            "Backward"),
}
SERIES = [("flashgen", "tab:red", "o"), ("SDPA FLASH", "tab:blue", "s"), ("SDPA CUDNN", "tab:green", "^")]


def _cells(line: str) -> list[str] | None:
    line = line.strip()
    if not line.startswith("|"):
        return None
    return [c.strip() for c in line.strip("|").split("|")]


def _number(cell: str) -> float:
    return float(cell.split()[0])   # "285 (fused)" -> 285


def read_table(text: str, mode: str = "fwd") -> tuple[str, list[dict]]:
    """The first table of `mode`: (title of the `## ` section holding it, rows as dicts of the named columns)."""
    header, flashgen_col, _ = MODES[mode]
    lines = text.splitlines()
    title = ""
    for i, line in enumerate(lines):
        if line.startswith("## "):
            title = line[3:].strip()
        cells = _cells(line)
        if cells is None or cells[:len(header)] != header:
            continue
        rows = []
        for row_line in lines[i + 2:]:   # skip the |---:| alignment line
            row = _cells(row_line)
            if row is None:
                break
            rec = dict(zip(cells, row))
            rows.append({"hdim": int(rec["hdim"]), "causal": rec["causal"].lower() in ("yes", "true", "1"),
                         "seqlen": int(rec["seqlen"]),
                         "flashgen": _number(rec[flashgen_col]),
                         **{name: _number(rec[name]) for name, *_ in SERIES[1:]}})
        return title, rows
    raise ValueError(f"no table with header | {' | '.join(header)} | found")


def plot(title: str, rows: list[dict], out: Path, mode: str = "fwd"):
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
    what = MODES[mode][2]
    fig.suptitle(f"{what}, bf16: {title}" if title else f"{what}, bf16", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="markdown file with the tables")
    ap.add_argument("--mode", choices=sorted(MODES), default="fwd")
    ap.add_argument("--out", type=Path, help="PNG to write (default: benchmarks/<mode>_bf16.png)")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("benchmarks/plot.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    try:
        title, rows = read_table(args.results.read_text(), args.mode)
    except (OSError, ValueError) as e:
        print(f"{args.results}: {e}", file=sys.stderr)
        return 1
    if not rows:
        print(f"{args.results}: the {args.mode} table has no rows", file=sys.stderr)
        return 1
    out = args.out or HERE / f"{args.mode}_bf16.png"
    plot(title, rows, out, args.mode)
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
