"""What the hand-derived backward passes cost or buy: GPT2Config(backward="manual") against autograd (with SDPA, the
default, and with the course's explicit "eager" attention), one training step (forward, cross-entropy, backward,
AdamW) of the nanoGPT CPU configuration (4 layers, 4 heads, n_embd 128, vocab 65, batch 12, block 64) and of the
same model with block 256, where the attention matrices dominate what a backward pass keeps.

    python bench/manual_backward.py                       # both blocks, 30 rounds, 1 thread
    python bench/manual_backward.py --blocks 64 --rounds 50 --threads 2

Time: the contenders take turns, one step each per round (order rotating), and the median per contender is
reported, so load from other processes spreads over all of them alike. Memory: the bytes autograd holds for the
backward pass at the end of a forward (every tensor saved by any op or Function, parameters excluded, each storage
counted once), and the peak RSS of a fresh process that runs 20 steps of one contender.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from config import GPT2Config  # noqa: E402
from models.gpt2 import GPT2LMHeadModel  # noqa: E402
from optimizer import AdamW  # noqa: E402

CONTENDERS = {
    "autograd (sdpa)": dict(backward="autograd", attn_implementation="sdpa"),
    "autograd (eager)": dict(backward="autograd", attn_implementation="eager"),
    "manual": dict(backward="manual"),
}


def build(name: str, block: int, batch: int):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=65, n_positions=block, n_layer=4, n_head=4, n_embd=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, **CONTENDERS[name])
    model = GPT2LMHeadModel(cfg).train()
    opt = AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(65, (batch, block), generator=g), torch.randint(65, (batch, block), generator=g)
    return model, opt, x, y


def loss_of(model, x, y):
    return model.cross_entropy(model(x)["logits"].flatten(0, 1), y.flatten())  # the model's own CE (manual or not)


def step(model, opt, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    return loss.item()


def saved_bytes(model, x, y) -> int:
    """Bytes kept for backward by one forward (parameters excluded; a storage counted once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, x, y)
    del loss
    return sum(seen.values())


def rss_child(name: str, block: int, batch: int) -> None:
    model, opt, x, y = build(name, block, batch)
    for _ in range(20):
        step(model, opt, x, y)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 256], help="sequence lengths to measure")
    p.add_argument("--batch", type=int, default=12, help="windows per step")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (each contender one step per round)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--rss_child", nargs=3, metavar=("NAME", "BLOCK", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_child:
        return rss_child(args.rss_child[0], int(args.rss_child[1]), int(args.rss_child[2]))
    print_machine_header()
    print(f"uptime: {os.popen('uptime').read().strip()}; torch {torch.__version__}, {args.threads} thread(s)")
    rec = Recorder("manual_backward")
    for block in args.blocks:
        runs = {name: build(name, block, args.batch) for name in CONTENDERS}
        losses = {name: [step(*r)] for name, r in runs.items()}  # warm-up step (first-call costs)
        times = {name: [] for name in CONTENDERS}
        names = list(CONTENDERS)
        for i in range(args.rounds):
            for name in names[i % len(names):] + names[: i % len(names)]:
                t0 = time.perf_counter()
                losses[name].append(step(*runs[name]))
                times[name].append(time.perf_counter() - t0)
        drift = max(abs(a - b) for a, b in zip(losses["manual"], losses["autograd (sdpa)"]))
        print(f"\nbatch {args.batch} x block {block} (after {args.rounds + 1} steps the manual and autograd losses "
              f"differ by at most {drift:.1e})")
        print("| contender | step, median ms (min-max) | saved for backward, MB | peak RSS, MB (fresh process) |")
        print("|---|---|---|---|")
        for name in CONTENDERS:
            model, _, x, y = runs[name]
            child = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--rss_child", name,
                                    str(block), str(args.batch)], capture_output=True, text=True, check=True)
            rss = json.loads(child.stdout)["peak_rss_mb"]
            ms = [1000 * t for t in times[name]]
            print(f"| {name} | {statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f}) | "
                  f"{saved_bytes(model, x, y) / 2**20:.1f} | {rss:.0f} |")
            rec.add(f"batch {args.batch} x block {block}: {name}", {
                "step ms (median)": statistics.median(ms), "saved for backward MB": saved_bytes(model, x, y) / 2**20,
                "peak RSS MB": rss}, "ms, MB", notes=f"manual vs autograd losses within {drift:.1e}")
    rec.write()
    print(f"\nuptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    main()
