"""
Plot scaling runs: validation bpb against training FLOPs, one line per depth (and the best bpb at
each budget), from the CSVs written by runs/scaling_laws.sh and runs/miniseries.sh.

    python -m dev.plot_scaling ~/.cache/nanochat/scaling_laws.csv [more.csv ...] --out scaling.png

Needs the CSVs (columns depth, flops, val_bpb, and budget where the grid had one); matplotlib for the plot
(without it, the table of the best bpb per budget is all it prints).
"""

import csv
from collections import defaultdict

from dev import runs


def main(argv=None):
    parser = runs.argument_parser(__doc__)
    parser.add_argument("csvs", nargs="+", help="CSV files of runs/scaling_laws.sh or runs/miniseries.sh")
    parser.add_argument("--out", type=str, default="scaling.png", help="the plot (PNG)")
    args = parser.parse_args(argv)

    series = defaultdict(list)  # (file, depth) -> [(flops, bpb, budget)]
    for path in args.csvs:
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("val_bpb"):
                    flops = float(row["flops"])  # what the run did; scaling_laws.csv also has the budget asked for
                    series[(path, int(row["depth"]))].append((flops, float(row["val_bpb"]), float(row.get("budget") or flops)))
    if not series:
        raise SystemExit("plot_scaling: no rows with a val_bpb in " + ", ".join(args.csvs))

    best = {}
    for points in series.values():
        for _, bpb, budget in points:
            best[budget] = min(bpb, best.get(budget, float("inf")))
    print("best val bpb per FLOP budget:")
    for flops in sorted(best):
        print(f"  {flops:.3g}: {best[flops]:.4f}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib); the table above is all there is")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (path, depth), points in sorted(series.items(), key=lambda kv: kv[0][1]):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"d{depth}" + (f" ({path})" if len(args.csvs) > 1 else ""))
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
