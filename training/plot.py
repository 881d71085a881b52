"""Overlay the curves of several training runs in one figure: one colour per run, the panels of each run's own
curves.png (losses, eval metrics, learning rate, tokens/s), read from each run folder's metrics.jsonl.

    python -m training.plot checkpoints/sst-lr1e-3 checkpoints/sst-lr3e-4                  # -> ./curves.png
    python -m training.plot runs/a runs/b --labels "lr 1e-3" "lr 3e-4" --out compare.png
    python -m training.plot runs/a runs/b --keys val_loss dev_acc --x wall_s --out dev.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from training.metrics import metrics_file, plot_records, read_metrics


def plot_runs(run_dirs: list, out, labels=None, keys=None, x: str = "step") -> Path:
    """Draw the runs (folders holding metrics.jsonl, or the files) in one figure at `out`; labels default to the
    folder names (the paths as given where two names clash); keys: only these series. Raises FileNotFoundError for a
    missing run and ValueError when labels do not match the runs or there is nothing to draw."""
    paths = [metrics_file(d) for d in run_dirs]
    for d, path in zip(run_dirs, paths):
        if not Path(d).exists():
            raise FileNotFoundError(f"no such run folder: {d}")
        if not path.is_file():
            raise FileNotFoundError(f"{d} has no {path.name}")
    if labels is None:
        names = [p.parent.name or str(p.parent) for p in paths]
        labels = names if len(set(names)) == len(names) else [str(p.parent) for p in paths]
    elif len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [(label, read_metrics(p)) for label, p in zip(labels, paths)]
    written = plot_records(runs, out, keys=keys, x=x)
    if written is None:
        raise ValueError(f"nothing to plot against {x}: no train or eval values in {', '.join(map(str, paths))}")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", default="curves.png", help="the PNG to write (default: curves.png here)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the folder names)")
    parser.add_argument("--keys", nargs="+", help="draw only these series, e.g. val_loss dev_acc (default: all)")
    parser.add_argument("--x", choices=("step", "wall_s"), default="step",
                        help="x axis: optimizer steps or wall-clock seconds since the run began (default: step)")
    args = parser.parse_args(argv)
    try:
        out = plot_runs(args.runs, args.out, labels=args.labels, keys=args.keys, x=args.x)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
