"""The loss curve of a 2000-step pretraining run in bf16 against fp32's, with the seed-to-seed noise of fp32 beside it.

run_pretrain.py's defaults (nanoGPT's shakespeare-char configuration: 4 layers, 128 wide, 12 x 64 tokens a step,
2000 steps, eval every 250 steps over 20 batches per split) on tiny shakespeare, once per precision from the same
seed, and fp32 once more from another seed: the difference between the two fp32 runs is the noise a precision's
difference is judged against. Each run is a fresh process; its OUT/metrics.jsonl gives the curves (train loss every
--log_interval steps, val loss at each evaluation). The plot (train and val loss against steps, every run) goes to
--plot (default: the docs' plot of this CPU's class, `default_plot`); the final weights' loss over the whole val
split (in fp32), the differences and the verdict go to bench/results/bf16_curve.jsonl.

Precisions: fp32; bf16-weights (`--dtype bf16-weights`: bf16 weights, fp32 masters in AdamW, no autocast); bfloat16
(autocast over fp32 weights); bf16-weights+packed (bf16-weights with GPT2_PACKED_BF16=force: the evaluations' products
from oneDNN-packed weight copies, the path an AMX CPU takes by default, forced on any CPU whose oneDNN has bf16
kernels).

    python bench/bf16_curve.py                                   # fp32, fp32 (seed 2), bf16-weights, bfloat16
    python bench/bf16_curve.py --dtypes bf16-weights --max-iters 500 --plot /tmp/curve.png
    python bench/bf16_curve.py --dtypes bf16-weights+packed --plot /tmp/packed.png   # AMX's default, forced
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_core, cpu_model_and_flags, print_machine_header  # noqa: E402
from bench.pretrain_shakespeare import precise_val_loss  # noqa: E402
from bench.results import LEGACY_CORES, Recorder, cpu_class  # noqa: E402
from models.hub import data_dir, not_found  # noqa: E402

CORPUS = data_dir() / "tinyshakespeare" / "input.txt"
SEEDS = (1337, 2024)  # the runs' seed, and the second fp32 run's
FORCED = {"+packed": {"GPT2_PACKED_BF16": "force"}}  # a precision's suffix: the paths its run is forced onto


def run(dtype: str, seed: int, out: Path, max_iters: int, extra: list[str]) -> dict:
    """One pretraining run in a fresh process; its metrics records, wall time and final val loss."""
    env = dict(os.environ)
    for suffix, forced in FORCED.items():
        if dtype.endswith(suffix):
            env.update(forced)
    cmd = [sys.executable, str(ROOT / "run_pretrain.py"), "--data", str(CORPUS), "--output_dir", str(out),
           "--dtype", dtype.split("+")[0], "--seed", str(seed), "--max_iters", str(max_iters), "--num_samples", "0",
           "--overwrite", *extra]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r["kind"] == "eval" and "val_loss" in r]
    # "val": the final weights' loss over the whole val split, in fp32; the estimates average 20 random batches,
    # which differ between seeds
    return {"dtype": dtype, "seed": seed, "seconds": seconds, "load": load, "records": records,
            "estimate": evals[-1]["val_loss"], "step": evals[-1]["step"], "val": precise_val_loss(out, CORPUS)}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val, ax_diff) = plt.subplots(1, 3, figsize=(16, 4.4))
    base = {x["step"]: x["train_loss"] for x in runs[0]["records"] if x["kind"] == "train"}
    for r in runs:
        label = f"{r['dtype']} (seed {r['seed']})"
        train = [(x["step"], x["train_loss"]) for x in r["records"] if x["kind"] == "train"]
        val = [(x["step"], x["val_loss"]) for x in r["records"] if x["kind"] == "eval" and "val_loss" in x]
        style = "--" if r["seed"] != SEEDS[0] else "-"
        ax_train.plot(*zip(*train), style, label=label, linewidth=1.2)
        ax_val.plot(*zip(*val), style, marker="o", markersize=3, label=label, linewidth=1.2)
        if r is not runs[0]:
            ax_diff.plot([s for s, _ in train], [loss - base[s] for s, loss in train], style, label=label,
                         linewidth=1.2, color=ax_train.lines[-1].get_color())
    ax_train.set(title="train loss (mean over each log interval)", xlabel="step", ylabel="loss (nats/char)")
    ax_val.set(title="val loss (20 batches at each evaluation)", xlabel="step", ylabel="loss (nats/char)")
    ax_diff.axhline(0.0, color="black", linewidth=0.8)
    ax_diff.set(title=f"train loss minus {runs[0]['dtype']} (seed {runs[0]['seed']})'s", xlabel="step",
                ylabel="difference (nats/char)")
    for ax in (ax_train, ax_val, ax_diff):
        ax.grid(alpha=0.3)
        ax.legend()
    ax_train.set_ylim(top=min(4.3, ax_train.get_ylim()[1]))
    ax_val.set_ylim(top=min(4.3, ax_val.get_ylim()[1]))
    fig.suptitle("tiny shakespeare, run_pretrain.py defaults (4 x 128 wide, 12 x 64 tokens a step): fp32 vs bf16")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_plot(cls: str, core: str | None = None) -> Path:
    """The docs' plot for a CPU class: docs/images/bf16-loss-curve.png is the AVX512-BF16 one (docs/performance.md),
    every other class has its own (bf16-loss-curve-amx.png, ...), so a run on one class does not redraw another's;
    and a core other than the one a class's plot was drawn on (LEGACY_CORES: the Zen 4's AVX512-BF16) its own
    (bf16-loss-curve-zen5.png)."""
    suffix = "" if cls == "AVX512-BF16" else "-" + cls.lower()
    if core and LEGACY_CORES.get(cls, core) != core:
        suffix += "-" + core.lower().replace(" ", "")
    return ROOT / f"docs/images/bf16-loss-curve{suffix}.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bf16-weights", "bfloat16"],
                        choices=["bf16-weights", "bfloat16", "float16", "bf16-weights+packed"],
                        help="precisions compared with fp32")
    parser.add_argument("--max-iters", type=int, default=2000, help="steps of each run")
    parser.add_argument("--plot", default=str(default_plot(cpu_class(cpu_model_and_flags()[1]),
                                                           (cpu_core() or {}).get("core"))),
                        help="where the PNG goes (default: this CPU class's, or core's, plot in docs/images)")
    parser.add_argument("extra", nargs="*", help="more run_pretrain.py flags, after --")
    args = parser.parse_args()
    if not CORPUS.is_file():
        raise SystemExit(not_found("this benchmark's corpus", CORPUS))
    print_machine_header()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        plan = [("float32", SEEDS[0]), ("float32", SEEDS[1])] + [(d, SEEDS[0]) for d in args.dtypes]
        for i, (dtype, seed) in enumerate(plan):
            r = run(dtype, seed, Path(tmp) / f"run{i}", args.max_iters, args.extra)
            runs.append(r)
            print(f"{dtype:>13} seed {seed}: val {r['val']:.4f} over the whole val split after step {r['step']} "
                  f"(estimate {r['estimate']:.4f}; {r['seconds']:.0f} s, load {r['load']:.1f})", flush=True)
    plot(runs, Path(args.plot))
    Path(args.plot).with_suffix(".json").write_text(json.dumps(  # the curves, so the plot can be redrawn
        [{k: r[k] for k in ("dtype", "seed", "seconds", "val", "estimate")}
         | {"curve": [[x["step"], x["train_loss"]] for x in r["records"] if x["kind"] == "train"],
            "val_curve": [[x["step"], x["val_loss"]] for x in r["records"] if x["kind"] == "eval" and "val_loss" in x]}
         for r in runs], indent=0))
    print(f"plot: {args.plot}")
    fp32, other_seed = runs[0]["val"], runs[1]["val"]
    noise = abs(other_seed - fp32)
    rec = Recorder("bf16_curve")
    for r in runs[2:]:
        diff = abs(r["val"] - fp32)
        within = diff <= max(noise, 0.01 * fp32)  # seed-to-seed noise, or 1% where two seeds happen to agree closely
        print(f"{r['dtype']}: val {r['val']:.4f} vs fp32 {fp32:.4f}: {diff:.4f} apart; fp32 seed to seed "
              f"{noise:.4f}: {'within' if within else 'NOT within'} noise; {r['seconds']:.0f} s vs fp32 "
              f"{runs[0]['seconds']:.0f} s", flush=True)
        rec.add(f"val loss after {args.max_iters} steps, fp32 vs {r['dtype']}",
                {"fp32": fp32, r["dtype"]: r["val"], "fp32 other seed": other_seed}, "loss",
                target="within fp32's seed-to-seed difference (or 1%)", met=within, difference=diff, noise=noise,
                notes=f"run_pretrain.py defaults on tiny shakespeare; wall {r['seconds']:.0f} s vs fp32 "
                      f"{runs[0]['seconds']:.0f} s; plot {Path(args.plot).name}")
    rec.write()


if __name__ == "__main__":
    main()
