"""Does keeping the parameters in one flat tensor per optimizer group pay? The engine's training step on nanoGPT's
tiny shakespeare model (4 layers, 4 heads, n_embd 128, batch 12 x 64, char vocabulary), timed in one process with
the parameters as they are (the engine) and re-seated as views into flat tensors (what tasks/pretrain.py did before
the engine: one AdamW tensor per group, one clipping norm, gradients zeroed by one fill), in alternating blocks.

    python bench/flat_params.py                  # 2 threads, the batch split across them as the engine does
    python bench/flat_params.py --no-split --blocks 15 --steps 20

Both contenders run the same forward and backward (`training.backward.Backward`) and our foreach AdamW; only the
parameter layout and what follows from it differ. Prints the median ms per step of each and their ratio.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
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
from optimizer import AdamW, param_groups_for_weight_decay  # noqa: E402
from tasks.pretrain import window_loss  # noqa: E402
from training.backward import Backward, LossOf  # noqa: E402
from training.batches import MicroBatch  # noqa: E402
from training.steps import grad_norm  # noqa: E402


def flatten(groups: list[dict]) -> tuple[list[dict], list[torch.Tensor]]:
    """Each group's parameters re-seated as views into one flat tensor with one flat gradient."""
    flat_groups, flats = [], []
    for group in groups:
        params = group["params"]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        flat.grad = torch.zeros_like(flat)
        offset = 0
        for p in params:
            p.data = flat[offset: offset + p.numel()].view_as(p)
            p.grad = flat.grad[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        flats.append(flat)
        flat_groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                            "params": [flat]})
    return flat_groups, flats


class Contender:
    def __init__(self, flat: bool, workers: int, seed: int = 0):
        torch.manual_seed(seed)
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        groups = param_groups_for_weight_decay(self.model, 0.1)
        self.params = [p for g in groups for p in g["params"]]
        self.flat = None
        if flat:
            groups, self.flat = flatten(groups)
        self.optimizer = AdamW(groups, lr=1e-3, betas=(0.9, 0.99), eps=1e-8)
        self.backward = Backward(LossOf(self.model, window_loss), self.params, workers, contextlib.nullcontext)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> float:
        x = torch.randint(65, (12, 64), generator=self.gen)
        y = torch.randint(65, (12, 64), generator=self.gen)
        loss, _ = self.backward(MicroBatch({"input_ids": x, "labels": y}, 1.0, x.numel()), lambda t: t)
        norm = (torch.nn.utils.clip_grad_norm_(self.flat, 1.0, foreach=True) if self.flat is not None
                else grad_norm(self.params, 1.0))
        bool(torch.isfinite(loss + norm))  # the engine's one read-back per step
        self.optimizer.step()
        if self.flat is not None:
            for f in self.flat:
                f.grad.zero_()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=10, help="alternating blocks per contender")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the batch is split across them)")
    p.add_argument("--no-split", action="store_true", help="torch's intra-op threads instead of the split")
    args = p.parse_args()
    print_machine_header()
    torch.set_num_threads(args.threads)
    workers = 1 if args.no_split else args.threads
    if workers > 1:
        torch.set_num_threads(1)  # as the engine does while it splits
    contenders = {"engine (per-parameter tensors)": Contender(False, workers),
                  "flat parameters": Contender(True, workers)}
    for c in contenders.values():  # warm up
        for _ in range(5):
            c.step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for block in range(args.blocks):
        names = list(contenders)[:: 1 if block % 2 == 0 else -1]  # alternate who goes first
        for name in names:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                contenders[name].step()
            times[name].append(1000 * (time.perf_counter() - t0) / args.steps)
    print(f"load {os.getloadavg()[0]:.2f}; {args.threads} threads, {'split batch' if workers > 1 else 'intra-op'}; "
          f"{args.blocks} blocks of {args.steps} steps each")
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:32s} median {medians[name]:6.2f} ms/step  (blocks: {', '.join(f'{v:.1f}' for v in t)})")
    a, b = medians.values()
    print(f"engine / flat: {a / b:.3f} (> 1.10 would mean flat parameters pay 10% or more)")
    rec = Recorder("flat_params")
    rec.add(f"step, {args.threads} threads, {'split batch' if workers > 1 else 'intra-op'}", medians, "ms/step (median)",
            ratio=a / b, ratio_of="engine / flat parameters", notes=f"{args.blocks} blocks of {args.steps} steps")
    rec.write()


if __name__ == "__main__":
    main()
