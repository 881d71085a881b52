"""The race of issue 13: reach nanoGPT's (or the GPT-2 baseline's) validation loss on tiny shakespeare in at most half
its time.

The baseline is run_pretrain.py's defaults, nanoGPT's CPU shakespeare-char configuration (4 layers, 4 heads, n_embd
128, block 64, batch 12, 2000 steps of AdamW, lr 1e-3 -> 1e-4 cosine). The target is nanoGPT's final validation loss
when --nanogpt runs it (below), else the baseline's, over the whole val split (every token once, in consecutive
windows: the 20-batch estimate moves by +-0.02 from seed to seed). Each contender runs in a fresh process with `--eval_full`, evaluating every --eval_interval steps; its time
to target is the training time (the steps, not the evaluations) up to the first evaluation at or below the target,
read from the run's metrics.jsonl. The data split and the loss definition are the same for every contender;
architecture, optimizer, schedule, batch and length are each contender's own.

    python bench/speedrun.py                               # every contender once, baseline first
    python bench/speedrun.py --only baseline best --repeats 2 --plot docs/speedrun.png --json docs/speedrun.json
    python bench/speedrun.py --nanogpt ../nanoGPT --plot docs/speedrun.png  # also nanoGPT itself (a git clone of it)

With --nanogpt DIR, nanoGPT's own train.py runs the same configuration (its README's CPU shakespeare-char command)
in a fresh process and a scratch folder: its data/shakespeare_char/prepare.py encodes the same input.txt (the same
sorted characters and 90/10 split as ours), and its training time is the sum of its logged per-iteration times
(iterations that also evaluated count at the median iteration time). Its final checkpoint is then converted into our
model (checked against nanoGPT's own forward on a batch) and evaluated over the whole val split like every other
contender; that loss becomes the target, as the issue asks where nanoGPT ran.

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

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from models.hub import data_dir  # noqa: E402
from training.precision import bf16_matmul_is_fast  # noqa: E402

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
# where the CPU has bf16 units (AVX512-BF16, AMX): on a Zen 4 its steps took 33-34 ms against fp32's 41 (200 steps
# each, twice, 2026-11-29); on an AVX2-only CPU bf16 products are emulated and far slower than fp32
CONTENDERS["best-adamw-bf16"] = ("best-adamw with bf16 weights and fp32 masters (--dtype bf16-weights; for bf16 units)",
                                 [*CONTENDERS["best-adamw"][1], "--dtype", "bf16-weights"])


def default_contenders() -> list[str]:
    """Every contender, less the bf16 ones on a CPU without bf16 units (there they would take many times fp32's time:
    `--only` still runs them)."""
    if bf16_matmul_is_fast("cpu"):
        return list(CONTENDERS)
    bf16 = [n for n, (_, flags) in CONTENDERS.items() if "bf16-weights" in flags]
    print(f"{', '.join(bf16)} left out: this CPU has no bf16 units (AVX512-BF16 / AMX); --only runs it anyway")
    return [n for n in CONTENDERS if n not in bf16]


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


NANOGPT_FLAGS = ["--device=cpu", "--compile=False", "--dtype=float32", "--eval_iters=20", "--log_interval=1",
                 "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                 "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=True"]  # README's CPU command
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py")  # what a run needs from a nanoGPT checkout


def run_nanogpt(repo: Path, data: Path, threads: int) -> dict:
    """nanoGPT's train.py on `data` in a scratch copy of its scripts -> the same record as run()."""
    import re
    import shutil

    missing = [f for f in NANOGPT_FILES if not (repo / f).is_file()]
    if missing:
        raise SystemExit(f"--nanogpt {repo}: not a nanoGPT checkout (missing {', '.join(missing)}); "
                         "git clone https://github.com/karpathy/nanoGPT")
    with tempfile.TemporaryDirectory(prefix="speedrun-nanogpt-") as tmp:
        work = Path(tmp)
        for f in NANOGPT_FILES:
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / f, work / f)
        shutil.copy(data, work / "data/shakespeare_char/input.txt")  # prepare.py downloads only when it is absent
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], cwd=work, check=True,
                       capture_output=True, env=env)
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_FLAGS,
                               "--out_dir=out"], cwd=work, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"nanoGPT failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        ms = {int(i): float(t) for i, t in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)}
        estimates = re.findall(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", proc.stdout, re.M)
        evaluated = {int(step) for step, _ in estimates}
        plain = statistics.median(t for i, t in ms.items() if i not in evaluated)
        steps = max(evaluated)  # the last checkpoint holds the weights after this many updates
        train_s = sum(plain if i in evaluated else ms[i] for i in range(steps)) / 1000
        val = nanogpt_whole_split_loss(work, data)
    return {"name": "nanogpt", "flags": NANOGPT_FLAGS, "load": load, "wall_s": wall, "curve": [(steps, train_s, val)],
            "final_val": val, "train_s": train_s, "steps": steps, "estimate": float(estimates[-1][1])}


def nanogpt_whole_split_loss(work: Path, data: Path) -> float:
    """nanoGPT's checkpoint (work/out/ckpt.pt) in our model -> its val loss over the whole split, as ours is taken.
    The conversion is checked against nanoGPT's own forward (its model.py, from the scratch copy) on one batch."""
    import torch

    from config import GPT2Config
    from models.gpt2 import GPT2LMHeadModel
    from models.loading import hf_to_ours
    from tasks.pretrain import full_loss, prepare_corpus

    ckpt = torch.load(work / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
    args = ckpt["model_args"]
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}  # saved under torch.compile or not
    config = GPT2Config(n_layer=args["n_layer"], n_head=args["n_head"], n_embd=args["n_embd"],
                        n_positions=args["block_size"], vocab_size=args["vocab_size"], bias=args["bias"],
                        activation_function="gelu", embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)  # nn.GELU()
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    # nanoGPT's names are GPT-2's; its nn.Linear weights are the transposes of GPT-2's Conv1D ones
    hf = {key: value.t() if key.endswith(conv1d) else value for key, value in state.items()}
    ours = GPT2LMHeadModel(config).eval()
    ours.gpt.load_state_dict(hf_to_ours(hf, config))

    sys.path.insert(0, str(work))
    try:
        from model import GPT, GPTConfig  # nanoGPT's model.py
    finally:
        sys.path.remove(str(work))
    theirs = GPT(GPTConfig(**args)).eval()
    theirs.load_state_dict(state)
    x = torch.randint(0, args["vocab_size"], (4, args["block_size"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (theirs(x, x)[0] - ours(x)["logits"]).abs().max().item()  # with targets: logits at every position
    if diff > 1e-4:
        raise SystemExit(f"nanoGPT -> ours conversion is wrong: logits differ by {diff:.2e}")
    corpus = prepare_corpus(data, "char", work / "ours-cache")
    return full_loss(ours, corpus.val, args["block_size"])


def time_to(result: dict, target: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first evaluation at or below `target`."""
    return next(((step, s) for step, s, val in result["curve"] if val <= target), None)


def plot(results: list[dict], target: float, path: Path, target_label: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in results:
        single = len(r["curve"]) == 1  # nanoGPT: its final checkpoint only, as a star
        ax.plot([s for _, s, _ in r["curve"]], [v for _, _, v in r["curve"]], marker="*" if single else "o",
                markersize=14 if single else 3, linestyle="none" if single else "-",
                label=f"{r['name']}: final {r['final_val']:.4f}" + (" (final checkpoint only)" if single else ""))
    ax.axhline(target, color="0.4", linestyle="--", linewidth=1, label=target_label)
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
    p.add_argument("--data", type=Path, default=data_dir() / "tinyshakespeare" / "input.txt")
    p.add_argument("--only", nargs="+", choices=sorted(CONTENDERS), help="contenders to run (the baseline always)")
    p.add_argument("--repeats", type=int, default=1, help="runs per contender (medians reported)")
    p.add_argument("--eval_interval", type=int, default=50, help="steps between whole-split evaluations")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout: also run nanoGPT itself; its final whole-split "
                   "val loss becomes the target")
    p.add_argument("--plot", type=Path, help="PNG of val loss against training time: nanoGPT, the baseline and the "
                   "two fastest contenders")
    p.add_argument("--json", type=Path, help="write every run's curve and timings here")
    args = p.parse_args()
    print_machine_header()
    names = ["baseline"] + [n for n in (args.only or default_contenders()) if n != "baseline"]
    names = (["nanogpt"] if args.nanogpt else []) + names
    runs: dict[str, list[dict]] = {n: [] for n in names}
    reference = "nanogpt" if args.nanogpt else "baseline"  # its final whole-split val loss is the target
    for repeat in range(args.repeats):
        for name in names:
            if name == "nanogpt":
                r = run_nanogpt(args.nanogpt, args.data, args.threads)
            else:
                r = run(name, CONTENDERS[name][1], args.data, args.eval_interval, args.threads)
            runs[name].append(r)
            target = runs[reference][0]["final_val"]
            hit = time_to(r, target)
            print(f"[{repeat + 1}/{args.repeats}] {name:10s} load {r['load']:.2f}: final val {r['final_val']:.4f} "
                  f"after {r['steps']} steps, {r['train_s']:.1f} s training ({r['wall_s']:.1f} s wall); first "
                  f"{reference}'s {target:.4f} " + (f"at step {hit[0]}, {hit[1]:.1f} s" if hit else "not reached")
                  + (f" (its own 20-batch estimate: {r['estimate']:.4f})" if name == "nanogpt" else ""), flush=True)
            if args.json:  # as it goes, so that an interrupted race keeps its runs
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"runs": runs}, indent=1))
    target = statistics.median(r["final_val"] for r in runs[reference])
    seconds = {n: statistics.median(r["train_s"] for r in runs[n]) for n in ("baseline", "nanogpt") if n in runs}
    print(f"\ntarget: {target:.4f} ({reference}'s final val loss over the whole split); training time: "
          + ", ".join(f"{n} {v:.1f} s" for n, v in seconds.items()) + "\n")
    vs = " | ".join(f"x {n}" for n in seconds)
    print(f"| contender | what it changes | final val | steps to target | training s to target | {vs} |")
    print("|---|---|---|---|---|" + "---|" * len(seconds))
    summary = []
    for name in names:
        hits = [time_to(r, target) for r in runs[name]]
        reached = [h for h in hits if h is not None]
        secs = statistics.median(h[1] for h in reached) if len(reached) == len(hits) else None
        steps = statistics.median(h[0] for h in reached) if reached else None
        final = statistics.median(r["final_val"] for r in runs[name])
        ratios = {n: secs / v if secs is not None else None for n, v in seconds.items()}
        summary.append({"name": name, "final_val": final, "seconds_to_target": secs, "steps_to_target": steps,
                        "ratio": ratios["baseline"], "ratios": ratios})
        what = "nanoGPT's train.py, its README's CPU command" if name == "nanogpt" else CONTENDERS[name][0]
        print(f"| {name} | {what} | {final:.4f} | {steps if steps is not None else 'not reached'} | "
              f"{f'{secs:.1f}' if secs is not None else '-'} | "
              + " | ".join(f"{r:.2f}" if r is not None else "-" for r in ratios.values()) + " |")
    rec = Recorder("speedrun")
    for s in summary:
        if s["seconds_to_target"] is not None:
            rec.add(f"time to {reference}'s val loss: {s['name']}", {
                "seconds to target": s["seconds_to_target"], "final val": s["final_val"],
                **{f"{n} s": v for n, v in seconds.items()}}, "s, loss",
                ratio=s["ratios"].get(reference), ratio_of=f"its time / {reference}'s training time",
                notes=f"target {target:.4f}; {args.repeats} repeats")
    rec.write()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": target, "reference": reference, "seconds": seconds,
                                         "baseline_seconds": seconds["baseline"], "summary": summary,
                                         "runs": runs}, indent=1))
    if args.plot:
        reached = [s for s in summary if s["name"] not in ("baseline", "nanogpt") and s["ratio"] is not None]
        fastest = [s["name"] for s in sorted(reached, key=lambda s: s["ratio"])[:2]]  # the two fastest contenders
        shown = [runs[n][0] for n in ("nanogpt", "baseline", *fastest) if n in runs]
        plot(shown, target, args.plot, f"target {target:.4f} ({reference}'s final)")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
