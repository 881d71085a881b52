"""The learning path of "Let's build GPT", runnable: train every rung on the same data, then print a table of their
validation losses and plot them.

    # the lecture's own settings and architectures, its reported losses beside ours (each rung a minute or less)
    python -m tasks.ladder --preset lecture --data data/tinyshakespeare/input.txt
    # its scaled-up model (batch 64, block 256, n_embd 384, 6 heads, 6 layers, dropout 0.2): a GPU job
    python -m tasks.ladder --preset lecture --data input.txt --rungs scaled --device cuda
    # the same budget for every rung (nanoGPT's CPU scale: block 64, batch 12, 4 layers, 4 heads, n_embd 128,
    # lr 1e-3 -> 1e-4 cosine, beta2 0.99, GPT-2's init and GELU)
    python -m tasks.ladder --data data/tinyshakespeare/input.txt --max_iters 2000
    # one change against the lecture preset: its rungs with GPT-2's N(0, 0.02) init
    python -m tasks.ladder --preset lecture --data input.txt --init gpt2 --rungs multi_head feed_forward

Every rung starts from the same seed, sees the same training batches in the same order and is evaluated on the same
random batches (the curves; --eval_iters of them, 200 in the lecture) and on the whole val split in consecutive
windows. A flag given explicitly overrides the preset's value. Results go to OUT_DIR/ladder.json (rewritten after
each rung) and OUT_DIR/ladder.png.
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

LADDER = RUNGS + ("scaled",)  # "scaled": the dropout rung at the lecture's scaled-up sizes (--preset lecture only)
ADDS = {
    "bigram": "next-token logit table",
    "one_head": "+ position embeddings, one self-attention head",
    "multi_head": "several heads",
    "feed_forward": "+ feed-forward layer",
    "blocks": "several blocks",
    "residual": "+ residual connections (with projections)",
    "layernorm": "+ pre-LayerNorm",
    "dropout": "+ dropout",
    "scaled": "+ dropout, scaled up",
}
# The validation losses the lecture reports (Karpathy, "Let's build GPT: from scratch, in code, spelled out", 2023);
# bigram and one head are said as "about"; the stacked blocks without residuals get no number.
LECTURE_LOSS = {"bigram": 2.5, "one_head": 2.4, "multi_head": 2.28, "feed_forward": 2.24, "residual": 2.08,
                "layernorm": 2.06, "scaled": 1.48}
# The lecture's settings: gpt.py's hyperparameters at n_embd 32, torch.optim.AdamW with its defaults (weight decay
# 0.01 on every parameter, betas (0.9, 0.999), eps 1e-8), a constant learning rate, no clipping; its architectures.
PRESETS = {
    "lecture": dict(n_embd=32, block_size=8, batch_size=32, max_iters=5000, lr=1e-3, min_lr=1e-3, warmup_iters=0,
                    bigram_lr=1e-2, bigram_iters=3000, n_head=4, n_layer=3, dropout=0.2, eval_iters=200,
                    eval_interval=500, weight_decay=0.01, decay="all", beta2=0.999, max_grad_norm=0.0,
                    style="lecture", rungs=["bigram", "one_head", "multi_head", "feed_forward", "blocks", "residual",
                                            "layernorm"]),
}
# gpt.py's last model, the lecture's 1.48: the dropout rung at these sizes (a GPU job: see --device); a flag given
# explicitly wins (--max_iters 10 times a few steps of it on a CPU)
SCALED = dict(batch_size=64, block_size=256, n_embd=384, n_head=6, n_layer=6, dropout=0.2, lr=3e-4, max_iters=5000)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="lecture: the lecture's settings and architectures per rung, its losses beside ours")
    g = p.add_argument_group("data")
    g.add_argument("--data", required=True, help="UTF-8 text file (character-level tokens)")
    g.add_argument("--val_fraction", type=float, default=0.1, help="last fraction of the characters held out for val")
    g = p.add_argument_group("model (every rung at these sizes)")
    g.add_argument("--rungs", nargs="+", choices=LADDER, default=list(RUNGS), help="rungs to train, in ladder order")
    g.add_argument("--n_layer", type=int, default=4, help="blocks, from the 'blocks' rung on")
    g.add_argument("--n_head", type=int, default=4, help="attention heads, from the 'multi_head' rung on")
    g.add_argument("--n_embd", type=int, default=128, help="model width")
    g.add_argument("--block_size", type=int, default=64, help="context, and tokens per training window")
    g.add_argument("--dropout", type=float, default=0.2, help="dropout of the last rung (the lecture's 0.2)")
    g.add_argument("--style", choices=("gpt2", "lecture"), default="gpt2",
                   help="gpt2: tanh GELU, q/k/v biases, scores / sqrt(head size), N(0, 0.02) init; lecture: ReLU, "
                        "no q/k/v biases, scores / sqrt(n_embd), PyTorch's default init")
    g.add_argument("--init", choices=("gpt2", "torch"), help="override the style's init")
    g.add_argument("--activation", choices=("gelu", "relu"), help="override the style's activation")
    g.add_argument("--qkv_bias", action=argparse.BooleanOptionalAction, help="override the style's q/k/v biases")
    g.add_argument("--attn_scale", choices=("head", "width"), help="override the style's score scale")
    g = p.add_argument_group("optimization (the same for every rung)")
    g.add_argument("--max_iters", type=int, default=2000, help="optimizer steps per rung")
    g.add_argument("--bigram_iters", type=int, help="optimizer steps of the bigram rung (default: --max_iters)")
    g.add_argument("--batch_size", type=int, default=12, help="windows per step")
    g.add_argument("--lr", "--learning_rate", dest="lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--bigram_lr", type=float, default=1e-2,
                   help="peak learning rate of the bigram rung (the lecture's bigram.py: a table needs larger steps)")
    g.add_argument("--min_lr", type=float, default=1e-4,
                   help="floor of the cosine decay of --lr (every rung decays by the same ratio; = --lr: constant)")
    g.add_argument("--warmup_iters", type=int, default=100, help="linear warmup steps")
    g.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--decay", choices=("matrices", "all"), default="matrices",
                   help="which parameters decay: weight matrices only (nanoGPT) or all (torch.optim.AdamW(params))")
    g.add_argument("--beta2", type=float, default=0.99, help="AdamW beta2 (torch's default: 0.999)")
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
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    chosen = _preset_of(argv)
    if chosen in PRESETS:
        parser.set_defaults(**PRESETS[chosen])  # explicit flags still win
    args = parser.parse_args(argv)
    args.explicit = _explicit(argv)
    if chosen in PRESETS and "lr" in args.explicit and "min_lr" not in args.explicit:  # keep the preset's schedule
        args.min_lr = args.lr * PRESETS[chosen]["min_lr"] / PRESETS[chosen]["lr"]
    for name in ("n_layer", "n_head", "n_embd", "block_size", "max_iters", "batch_size", "eval_interval",
                 "eval_iters"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.bigram_iters is not None and args.bigram_iters <= 0:
        parser.error(f"--bigram_iters must be > 0, got {args.bigram_iters}")
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
    if not 0 <= args.beta2 < 1:
        parser.error(f"--beta2 must be in [0, 1), got {args.beta2}")
    if "scaled" in args.rungs and args.preset != "lecture":
        parser.error("--rungs scaled is the lecture's scaled-up model: use it with --preset lecture")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device")
    args.rungs = [r for r in LADDER if r in args.rungs]  # ladder order, each once
    return args


def _explicit(argv) -> list[str]:
    """The flags given on the command line (not filled in by a default or the preset)."""
    quiet = build_parser()
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    return sorted(vars(quiet.parse_args(argv)))


def _preset_of(argv) -> str | None:
    # The preset decides the other flags' defaults, so it is read before the real parse.
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--preset")
    return first.parse_known_args(argv)[0].preset


def rung_settings(args, rung: str) -> argparse.Namespace:
    """The settings one rung trains with: the flags, the bigram's own lr and steps, the scaled rung's sizes."""
    s = argparse.Namespace(**vars(args))
    if rung == "bigram":
        s.lr, s.max_iters = args.bigram_lr, args.bigram_iters or args.max_iters
    if rung == "scaled":
        vars(s).update({k: v for k, v in SCALED.items() if k not in args.explicit})
    s.min_lr = s.lr * args.min_lr / args.lr  # every rung decays by the same ratio
    s.warmup_iters = min(args.warmup_iters, s.max_iters)
    return s


def build(rung: str, vocab: int, s: argparse.Namespace) -> torch.nn.Module:
    style = {"base": s.style, "init": s.init, "activation": s.activation, "qkv_bias": s.qkv_bias,
             "attn_scale": s.attn_scale}
    return build_rung("dropout" if rung == "scaled" else rung, vocab, s.block_size, s.n_layer, s.n_head, s.n_embd,
                      s.dropout, style)


def optimizer_for(model, s: argparse.Namespace):
    """AdamW and its schedule for one rung: eps 1e-8 and beta1 0.9 as torch.optim.AdamW's defaults (the lecture's
    optimizer), the flags' lr, beta2 and weight decay (on every parameter, or on the matrices only)."""
    groups = (param_groups_for_weight_decay(model, s.weight_decay) if s.decay == "matrices" else
              [{"params": list(model.parameters()), "weight_decay": s.weight_decay}])
    optimizer = AdamW(groups, lr=s.lr, betas=(0.9, s.beta2), eps=1e-8)
    return optimizer, make_lr_scheduler(optimizer, s.warmup_iters, s.max_iters, s.min_lr / s.lr)


def train_rung(model, corpus, s: argparse.Namespace) -> dict:
    """Train one rung; returns its curve of (step, train, val) estimates, whole-split val loss and timings."""
    optimizer, scheduler = optimizer_for(model, s)
    params = [p for p in model.parameters() if p.requires_grad]
    train_gen = torch.Generator().manual_seed(s.seed)
    eval_gen = torch.Generator().manual_seed(s.seed + 1)
    splits = {"train": corpus.train, "val": corpus.val}
    curve, train_seconds = [], 0.0
    model.train()
    for step in range(s.max_iters + 1):
        if step % s.eval_interval == 0 or step == s.max_iters:
            losses = estimate_loss(model, splits, s.eval_iters, s.batch_size, s.block_size, eval_gen)
            curve.append((step, losses["train"], losses["val"]))
            print(f"  step {step:>5} | train {losses['train']:.4f} | val {losses['val']:.4f}", flush=True)
        if step == s.max_iters:
            break
        t0 = time.perf_counter()
        x, y = get_batch(corpus.train, s.batch_size, s.block_size, train_gen, s.device)
        loss = next_token_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if s.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
        optimizer.step()
        scheduler.step()
        if s.device != "cpu":
            torch.cuda.synchronize()  # so that the step time is the GPU's, not the launch queue's
        train_seconds += time.perf_counter() - t0
    if not torch.isfinite(torch.tensor(curve[-1][2])):
        raise FloatingPointError(f"rung {getattr(model, 'rung', 'bigram')}: the val loss is {curve[-1][2]}; "
                                 f"try a lower --lr")
    return {"curve": curve, "val_full": full_loss(model, corpus.val, s.block_size),
            "train_seconds": train_seconds, "ms_per_step": 1000 * train_seconds / s.max_iters,
            "settings": {k: getattr(s, k) for k in ("max_iters", "batch_size", "block_size", "n_embd", "n_head",
                                                    "n_layer", "lr", "eval_iters")}}


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.output_dir)
    corpus = prepare_corpus(args.data, "char", out_dir / "data", args.val_fraction)
    for rung in args.rungs:
        check_split_sizes(corpus, rung_settings(args, rung).block_size)
    vocab = len(corpus.tokenizer)
    print(f"corpus {args.data}: {corpus.meta['num_tokens']:,} characters ({len(corpus.train):,} train, "
          f"{len(corpus.val):,} val), vocab {vocab}; {torch.get_num_threads()} threads; {args.device}")
    settings = {k: v for k, v in vars(args).items() if k not in ("rungs", "no_plot")}
    results = {"settings": settings, "corpus": {k: corpus.meta[k] for k in ("num_tokens", "sha256")} |
               {"train": len(corpus.train), "val": len(corpus.val), "vocab": vocab}, "rungs": {}}
    out_dir.mkdir(parents=True, exist_ok=True)
    for rung in args.rungs:
        s = rung_settings(args, rung)
        torch.manual_seed(args.seed)
        model = build(rung, vocab, s).to(args.device)
        print(f"rung {rung}: {describe(rung, s)} ({model.num_parameters():,} parameters; {s.max_iters} steps x "
              f"{s.batch_size} x {s.block_size}, lr {s.lr:g})", flush=True)
        result = train_rung(model, corpus, s)
        result["params"] = model.num_parameters()
        results["rungs"][rung] = result
        print(f"rung {rung}: val loss {result['curve'][-1][2]:.4f} ({s.eval_iters} batches), whole split "
              f"{result['val_full']:.4f} | {result['ms_per_step']:.1f} ms/step", flush=True)
        (out_dir / "ladder.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    if not args.no_plot:
        plot(results, out_dir / "ladder.png")
        print(f"plot: {out_dir / 'ladder.png'}")
    return results


def describe(rung: str, s) -> str:
    """What the rung adds, with its sizes: the lecture names its rungs by head size and count."""
    hs = s.n_embd // s.n_head
    return {"one_head": f"+ position embeddings, one head of size {s.n_embd}",
            "multi_head": f"{s.n_head} heads of size {hs}",
            "blocks": f"{s.n_layer} blocks", "residual": f"+ residual connections ({s.n_layer} blocks, projections)",
            "scaled": f"+ dropout {s.dropout}; n_embd {s.n_embd}, {s.n_head} heads, {s.n_layer} blocks, "
                      f"block {s.block_size}"}.get(rung, ADDS[rung])


def table(results: dict) -> str:
    lecture = results["settings"].get("preset") == "lecture"
    head = "| rung | adds | parameters | steps x batch x block | val loss ({n} batches) | "
    head += "lecture | difference | " if lecture else ""
    head += "val loss, whole split | train ({n} batches) | ms/step |"
    n = results["settings"]["eval_iters"]
    rows = [head.format(n=n), "|" + "---|" * (head.count("|") - 1)]
    for rung, r in results["rungs"].items():
        _, train, val = r["curve"][-1]
        s = argparse.Namespace(**(results["settings"] | r["settings"]))
        row = (f"| {rung} | {describe(rung, s)} | {r['params']:,} | {s.max_iters} x {s.batch_size} x {s.block_size} "
               f"| **{val:.4f}** | ")
        if lecture:
            ref = LECTURE_LOSS.get(rung)
            row += f"{ref:.2f} | {val - ref:+.3f} | " if ref is not None else "- | - | "
        rows.append(row + f"{r['val_full']:.4f} | {train:.4f} | {r['ms_per_step']:.1f} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rungs = list(results["rungs"])
    lecture = results["settings"].get("preset") == "lecture"
    n = results["settings"]["eval_iters"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    est = [results["rungs"][r]["curve"][-1][2] for r in rungs]
    full = [results["rungs"][r]["val_full"] for r in rungs]
    x = list(range(len(rungs)))
    # dots, not bars: a bar's length reads as the value, so bars would need an axis from zero, which squeezes the
    # differences between rungs (tenths of a nat) into slivers; a dot's position is honest on a zoomed axis
    step = 0.22 if lecture else 0.15
    at = [-step, 0.0] if lecture else [-step / 2, step / 2]  # each group of dots centred on its tick
    groups = [([i + at[0] for i in x], est, "o", f"ours, {n} random batches", "tab:blue"),
              ([i + at[1] for i in x], full, "s", "ours, whole val split", "tab:cyan")]
    shown = []
    if lecture:
        shown = [(i, LECTURE_LOSS[r]) for i, r in zip(x, rungs) if r in LECTURE_LOSS]
        groups.append(([i + step for i, _ in shown], [v for _, v in shown], "D", "the lecture", "tab:orange"))
    for xs, ys, marker, label, colour in groups:
        left.plot(xs, ys, linestyle="none", marker=marker, markersize=7, label=label, color=colour)
        for xv, yv in zip(xs, ys):
            left.annotate(f"{yv:.3f}", (xv, yv), xytext=(0, 6), textcoords="offset points", ha="center",
                          fontsize=7, rotation=90)
    every = est + full + [v for _, v in shown]
    left.set_xticks(x, rungs, rotation=30, ha="right")
    left.set_xlim(-0.6, len(rungs) - 0.4)
    left.set_ylabel("val loss (nats per character)")
    left.set_ylim(min(every) - 0.1, max(every) + 0.25)  # room above for the value labels
    left.grid(True, axis="y", alpha=0.3)
    left.set_title("validation loss per rung")
    left.legend(fontsize=8, loc="upper right")
    for rung in rungs:
        steps, _, val = zip(*results["rungs"][rung]["curve"])
        right.plot(steps, val, marker=".", label=rung)
    right.set_xlabel("step")
    right.set_ylabel(f"val loss estimate ({n} random batches)")
    right.set_ylim(min(every) - 0.1, max(every) + 0.6)
    right.set_title("val loss during training")
    right.legend(fontsize=8)
    s = results["settings"]
    if lecture:
        title = (f"Let's build GPT, the lecture's settings: bigram {s['bigram_iters'] or s['max_iters']} steps at lr "
                 f"{s['bigram_lr']:g}; attention rungs {s['max_iters']} steps x {s['batch_size']} x {s['block_size']}, "
                 f"n_embd {s['n_embd']}, lr {s['lr']:g} constant, AdamW (torch defaults)")
    else:
        title = (f"Let's build GPT, rung by rung, the same budget: {s['max_iters']} steps x {s['batch_size']} x "
                 f"{s['block_size']} tokens, n_embd {s['n_embd']}, {s['n_layer']} blocks, {s['n_head']} heads")
    fig.suptitle(title, fontsize=10)
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
