"""The race of issue 13: reach the GPT-2 baseline's validation loss on tiny shakespeare in at most half its time.

The baseline is run_pretrain.py's defaults, nanoGPT's CPU shakespeare-char configuration (4 layers, 4 heads, n_embd
128, block 64, batch 12, 2000 steps of AdamW, lr 1e-3 -> 1e-4 cosine). The target is its final validation loss over
the whole val split (every token once, in consecutive windows: the 20-batch estimate moves by +-0.02 from seed to
seed). Each contender runs in a fresh process with `--eval_full`, evaluating every --eval_interval steps; its time
to target is the training time (the steps, not the evaluations) up to the first evaluation at or below the target,
read from the run's metrics.jsonl. The data split and the loss definition are the same for every contender;
architecture, optimizer, schedule, batch and length are each contender's own.

    python bench/speedrun.py                               # every contender once, baseline first
    python bench/speedrun.py --only baseline best --repeats 2 --plot docs/speedrun.png --json docs/speedrun.json

The machine is shared: the load average is printed with each run; compare contenders run close together.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.hub import shared_dir  # noqa: E402

# name -> (what it changes, run_pretrain.py flags on top of the defaults)
CONTENDERS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("GPT-2 (learned positions, LayerNorm, GELU, tied head), AdamW, 2000 steps", []),
    "relu2": ("ReLU^2 MLP instead of tanh-GELU", ["--activation", "relu2"]),
    "rmsnorm": ("RMSNorm without bias, no Linear biases", ["--norm", "rmsnorm", "--no-bias"]),
    "rope": ("rotary positions, QK-norm", ["--position_embedding", "rope", "--qk_norm"]),
    "muon": ("Muon for the hidden matrices (AdamW for the rest)", ["--optimizer", "muon"]),
    "lr3e-3": ("AdamW at lr 3e-3 (-> 3e-4)", ["--lr", "3e-3", "--min_lr", "3e-4"]),
    "best": ("ReLU^2, RMSNorm, no bias, RoPE + QK-norm, Muon; a 500-step schedule",
             ["--activation", "relu2", "--norm", "rmsnorm", "--no-bias", "--position_embedding", "rope",
              "--qk_norm", "--optimizer", "muon", "--max_iters", "500"]),
    "best-adamw": ("ReLU^2, RMSNorm, no bias, RoPE + QK-norm, AdamW lr 3e-3; an 800-step schedule",
                   ["--activation", "relu2", "--norm", "rmsnorm", "--no-bias", "--position_embedding", "rope",
                    "--qk_norm", "--lr", "3e-3", "--min_lr", "3e-4", "--max_iters", "800"]),
}


def run(name: str, flags: list[str], data: Path, eval_interval: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"speedrun-{name}-") as out:
        cmd = [sys.executable, str(ROOT / "run_pretrain.py"), "--data", str(data), "--output_dir", out,
               "--num_samples", "0", "--eval_full", "--eval_interval", str(eval_interval),
               "--log_interval", str(eval_interval), *(["--threads", str(threads)] if threads else []), *flags]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    trained, curve = 0.0, []  # (step, training seconds so far, whole-split val loss)
    seconds_at = {0: 0.0}
    for r in records:
        if r["kind"] == "train":
            trained += r["seconds"]
            seconds_at[r["step"]] = trained
        elif r["kind"] == "eval":
            curve.append((r["step"], seconds_at.get(r["step"], trained), r["val_loss"]))
    return {"name": name, "flags": flags, "load": load, "wall_s": wall, "curve": curve,
            "final_val": curve[-1][2], "train_s": curve[-1][1], "steps": curve[-1][0]}


def time_to(result: dict, target: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first evaluation at or below `target`."""
    return next(((step, s) for step, s, val in result["curve"] if val <= target), None)


def plot(results: list[dict], target: float, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in results:
        ax.plot([s for _, s, _ in r["curve"]], [v for _, _, v in r["curve"]], marker="o", markersize=3,
                label=f"{r['name']}: final {r['final_val']:.4f}")
    ax.axhline(target, color="0.4", linestyle="--", linewidth=1, label=f"target {target:.4f} (baseline's final)")
    ax.set_ylim(target - 0.15, target + 0.8)
    ax.set_xlabel("training time (s, evaluations excluded)")
    ax.set_ylabel("val loss, whole split")
    ax.set_title("tiny shakespeare (char): val loss against training time, 2 CPU cores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=shared_dir() / "data" / "tinyshakespeare" / "input.txt")
    p.add_argument("--only", nargs="+", choices=sorted(CONTENDERS), help="contenders to run (the baseline always)")
    p.add_argument("--repeats", type=int, default=1, help="runs per contender (medians reported)")
    p.add_argument("--eval_interval", type=int, default=50, help="steps between whole-split evaluations")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--plot", type=Path, help="PNG of val loss against training time: the baseline and the best")
    p.add_argument("--json", type=Path, help="write every run's curve and timings here")
    args = p.parse_args()
    names = ["baseline"] + [n for n in (args.only or CONTENDERS) if n != "baseline"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names:
            r = run(name, CONTENDERS[name][1], args.data, args.eval_interval, args.threads)
            runs[name].append(r)
            target = runs["baseline"][0]["final_val"]
            hit = time_to(r, target)
            print(f"[{repeat + 1}/{args.repeats}] {name:10s} load {r['load']:.2f}: final val {r['final_val']:.4f} "
                  f"after {r['steps']} steps, {r['train_s']:.1f} s training ({r['wall_s']:.1f} s wall); first "
                  f"baseline's {target:.4f} " + (f"at step {hit[0]}, {hit[1]:.1f} s" if hit else "not reached"),
                  flush=True)
            if args.json:  # as it goes, so that an interrupted race keeps its runs
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"runs": runs}, indent=1))
    target = statistics.median(r["final_val"] for r in runs["baseline"])
    base_s = statistics.median(r["train_s"] for r in runs["baseline"])
    print(f"\ntarget: {target:.4f} (the baseline's final val loss over the whole split); baseline training time "
          f"{base_s:.1f} s\n")
    print("| contender | what it changes | final val | steps to target | training s to target | x baseline |")
    print("|---|---|---|---|---|---|")
    summary = []
    for name in names:
        hits = [time_to(r, target) for r in runs[name]]
        reached = [h for h in hits if h is not None]
        secs = statistics.median(h[1] for h in reached) if len(reached) == len(hits) else None
        steps = statistics.median(h[0] for h in reached) if reached else None
        final = statistics.median(r["final_val"] for r in runs[name])
        summary.append({"name": name, "final_val": final, "seconds_to_target": secs, "steps_to_target": steps,
                        "ratio": secs / base_s if secs is not None else None})
        print(f"| {name} | {CONTENDERS[name][0]} | {final:.4f} | {steps if steps is not None else 'not reached'} | "
              f"{f'{secs:.1f}' if secs is not None else '-'} | {f'{secs / base_s:.2f}' if secs is not None else '-'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": target, "baseline_seconds": base_s, "summary": summary,
                                         "runs": runs}, indent=1))
    if args.plot:
        reached = [s for s in summary if s["name"] != "baseline" and s["ratio"] is not None]
        best = min(reached, key=lambda s: s["ratio"])["name"] if reached else None
        shown = [runs["baseline"][0]] + ([runs[best][0]] if best else [])
        plot(shown, target, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
