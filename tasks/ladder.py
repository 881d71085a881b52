"""The learning path of "Let's build GPT", runnable: train every rung on the same data, split and token budget, then
print a table of their validation losses and plot them.

    # nanoGPT's CPU scale (block 64, batch 12, 4 layers, 4 heads, n_embd 128, lr 1e-3 -> 1e-4 cosine, beta2 0.99)
    python -m tasks.ladder --data ../shared/data/tinyshakespeare/input.txt --max_iters 2000
    # a shorter budget, some rungs only
    python -m tasks.ladder --data corpus.txt --max_iters 300 --rungs bigram one_head residual

Every rung starts from the same seed, sees the same training batches in the same order and is evaluated on the same
random batches (the curves) and on the whole val split in consecutive windows (the table). Results go to
OUT_DIR/ladder.json (rewritten after each rung) and OUT_DIR/ladder.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from models.ladder import RUNGS, build_rung
from optimizer import AdamW, make_lr_scheduler, param_groups_for_weight_decay
from tasks.pretrain import check_split_sizes, estimate_loss, full_loss, get_batch, next_token_loss, prepare_corpus

ADDS = {
    "bigram": "next-token logit table",
    "one_head": "+ position embeddings, one self-attention head",
    "multi_head": "several heads",
    "feed_forward": "+ feed-forward layer",
    "blocks": "several blocks",
    "residual": "+ residual connections (with projections)",
    "layernorm": "+ pre-LayerNorm",
    "dropout": "+ dropout",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", required=True, help="UTF-8 text file (character-level tokens)")
    g.add_argument("--val_fraction", type=float, default=0.1, help="last fraction of the characters held out for val")
    g = p.add_argument_group("model (every rung at these sizes)")
    g.add_argument("--rungs", nargs="+", choices=RUNGS, default=list(RUNGS), help="rungs to train, in ladder order")
    g.add_argument("--n_layer", type=int, default=4, help="blocks, from the 'blocks' rung on")
    g.add_argument("--n_head", type=int, default=4, help="attention heads, from the 'multi_head' rung on")
    g.add_argument("--n_embd", type=int, default=128, help="model width")
    g.add_argument("--block_size", type=int, default=64, help="context, and tokens per training window")
    g.add_argument("--dropout", type=float, default=0.2, help="dropout of the last rung (the lecture's 0.2)")
    g = p.add_argument_group("optimization (the same for every rung)")
    g.add_argument("--max_iters", type=int, default=2000, help="optimizer steps per rung")
    g.add_argument("--batch_size", type=int, default=12, help="windows per step")
    g.add_argument("--lr", "--learning_rate", dest="lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--bigram_lr", type=float, default=1e-2,
                   help="peak learning rate of the bigram rung (the lecture's bigram.py: a table needs larger steps)")
    g.add_argument("--min_lr", type=float, default=1e-4,
                   help="floor of the cosine decay of --lr (the bigram decays by the same ratio)")
    g.add_argument("--warmup_iters", type=int, default=100, help="linear warmup steps")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW decay of weight matrices")
    g.add_argument("--max_grad_norm", "--grad_clip", dest="max_grad_norm", type=float, default=1.0,
                   help="gradient norm clip (0: off)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval_interval", type=int, default=250, help="estimate train/val loss every N steps (the curves)")
    g.add_argument("--eval_iters", type=int, default=20, help="random batches per split per estimate")
    g.add_argument("--output_dir", "--out_dir", dest="output_dir", default="runs/ladder",
                   help="ladder.json, ladder.png and the encoded corpus")
    g.add_argument("--no_plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    g.add_argument("--seed", type=int, default=1337, help="seeds init and batches (the same for every rung)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("n_layer", "n_head", "n_embd", "block_size", "max_iters", "batch_size", "eval_interval",
                 "eval_iters"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.n_embd % args.n_head:
        parser.error(f"--n_embd {args.n_embd} must be divisible by --n_head {args.n_head}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.lr <= 0 or args.bigram_lr <= 0:
        parser.error("--lr and --bigram_lr must be > 0")
    if not 0 <= args.min_lr <= args.lr:
        parser.error(f"--min_lr must be in [0, --lr], got {args.min_lr}")
    if not 0 <= args.warmup_iters <= args.max_iters:
        parser.error(f"--warmup_iters must be in [0, --max_iters], got {args.warmup_iters}")
    args.rungs = [r for r in RUNGS if r in args.rungs]  # ladder order, each once
    return args


def train_rung(model, corpus, args, lr: float) -> dict:
    """Train one rung; returns its curve of (step, train, val) estimates, whole-split val loss and timings."""
    optimizer = AdamW(param_groups_for_weight_decay(model, args.weight_decay), lr=lr, betas=(0.9, 0.99), eps=1e-8)
    scheduler = make_lr_scheduler(optimizer, args.warmup_iters, args.max_iters, args.min_lr / args.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    train_gen = torch.Generator().manual_seed(args.seed)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    splits = {"train": corpus.train, "val": corpus.val}
    curve, train_seconds = [], 0.0
    model.train()
    for step in range(args.max_iters + 1):
        if step % args.eval_interval == 0 or step == args.max_iters:
            losses = estimate_loss(model, splits, args.eval_iters, args.batch_size, args.block_size, eval_gen)
            curve.append((step, losses["train"], losses["val"]))
            print(f"  step {step:>5} | train {losses['train']:.4f} | val {losses['val']:.4f}", flush=True)
        if step == args.max_iters:
            break
        t0 = time.perf_counter()
        x, y = get_batch(corpus.train, args.batch_size, args.block_size, train_gen)
        loss = next_token_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        train_seconds += time.perf_counter() - t0
    if not torch.isfinite(torch.tensor(curve[-1][2])):
        raise FloatingPointError(f"rung {getattr(model, 'rung', 'bigram')}: the val loss is {curve[-1][2]}; "
                                 f"try a lower --lr")
    return {"curve": curve, "val_full": full_loss(model, corpus.val, args.block_size),
            "train_seconds": train_seconds, "ms_per_step": 1000 * train_seconds / max(args.max_iters, 1)}


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.output_dir)
    corpus = prepare_corpus(args.data, "char", out_dir / "data", args.val_fraction)
    check_split_sizes(corpus, args.block_size)
    vocab = len(corpus.tokenizer)
    print(f"corpus {args.data}: {corpus.meta['num_tokens']:,} characters ({len(corpus.train):,} train, "
          f"{len(corpus.val):,} val), vocab {vocab}; {args.max_iters} steps x {args.batch_size} x {args.block_size} "
          f"tokens per rung; {torch.get_num_threads()} threads")
    settings = {k: v for k, v in vars(args).items() if k not in ("rungs", "no_plot")}
    results = {"settings": settings, "corpus": {k: corpus.meta[k] for k in ("num_tokens", "sha256")} |
               {"train": len(corpus.train), "val": len(corpus.val), "vocab": vocab}, "rungs": {}}
    out_dir.mkdir(parents=True, exist_ok=True)
    for rung in args.rungs:
        torch.manual_seed(args.seed)
        model = build_rung(rung, vocab, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
        print(f"rung {rung}: {ADDS[rung]} ({model.num_parameters():,} parameters)", flush=True)
        lr = args.bigram_lr if rung == "bigram" else args.lr
        result = train_rung(model, corpus, args, lr)
        result["params"] = model.num_parameters()
        results["rungs"][rung] = result
        print(f"rung {rung}: val loss (whole split) {result['val_full']:.4f} | {result['ms_per_step']:.1f} ms/step",
              flush=True)
        (out_dir / "ladder.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    if not args.no_plot:
        plot(results, out_dir / "ladder.png")
        print(f"plot: {out_dir / 'ladder.png'}")
    return results


def table(results: dict) -> str:
    rows = ["| rung | adds | parameters | val loss, whole split | val estimate (last) | train estimate (last) "
            "| ms/step |", "|---|---|---|---|---|---|---|"]
    for rung, r in results["rungs"].items():
        _, train, val = r["curve"][-1]
        rows.append(f"| {rung} | {ADDS[rung]} | {r['params']:,} | **{r['val_full']:.4f}** | {val:.4f} | {train:.4f} "
                    f"| {r['ms_per_step']:.1f} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rungs = list(results["rungs"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    vals = [results["rungs"][r]["val_full"] for r in rungs]
    bars = left.bar(range(len(rungs)), vals, color="tab:blue")
    left.bar_label(bars, fmt="%.3f", fontsize=8)
    left.set_xticks(range(len(rungs)), rungs, rotation=30, ha="right")
    left.set_ylabel("val loss (nats per character), whole split")
    left.set_ylim(min(vals) - 0.3, max(vals) + 0.15)
    left.set_title("validation loss per rung")
    for rung in rungs:
        steps, _, val = zip(*results["rungs"][rung]["curve"])
        right.plot(steps, val, marker=".", label=rung)
    right.set_xlabel("step")
    right.set_ylabel(f"val loss estimate ({results['settings']['eval_iters']} random batches)")
    right.set_ylim(top=max(vals) + 0.6)
    right.set_title("val loss during training")
    right.legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"Let's build GPT, rung by rung: {s['max_iters']} steps x {s['batch_size']} x {s['block_size']} "
                 f"tokens, n_embd {s['n_embd']}, {s['n_layer']} blocks, {s['n_head']} heads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return run(parse_args(argv))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError, FloatingPointError) as e:
        sys.exit(f"error: {e}")
