"""What a run reports: step sums (Meter), the rates of a metrics record, the lines printed after a log interval and
after an evaluation, and the --max_steps benchmark report."""
from __future__ import annotations

import math
from typing import Any

from training import distributed as dist
from training.train_config import TrainConfig

INTERVAL_RATES = ("train_loss", "ms_per_step", "tokens_per_s", "seconds")  # in train records, left out of eval ones


class Meter:
    """Sums over steps since the last reset, kept as tensors where they are tensors (read at report time only)."""

    def __init__(self, sums: dict | None = None):
        self.sums: dict[str, Any] = dict(sums or {})

    def add(self, **values) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0) + v

    def merged(self) -> dict[str, float]:
        """Plain sums over all ranks (a collective: all ranks call it); seconds are rank 0's wall time."""
        plain = {k: float(v) for k, v in self.sums.items()}
        per_rank = dist.gather_objects(plain)
        merged = {k: sum(s.get(k, 0.0) for s in per_rank) for k in sorted(set().union(*per_rank))}
        if "seconds" in per_rank[0]:
            merged["seconds"] = per_rank[0]["seconds"]
        return merged

    def reset(self) -> None:
        self.sums = {}


def rates(sums: dict) -> dict:
    """Train loss (and accuracy where the loss counts it), step time and throughput from a meter's merged sums."""
    steps, seconds = sums.get("steps", 0), max(sums.get("seconds", 0.0), 1e-9)
    record = {"train_loss": sums["loss"] / steps if steps else math.nan,
              "ms_per_step": 1000 * seconds / steps if steps else math.nan,
              "tokens_per_s": sums.get("tokens", 0) / seconds, "seconds": round(sums.get("seconds", 0.0), 3)}
    if sums.get("count"):
        record["train_acc"] = sums["correct"] / sums["count"]
    return record


def epoch_number(epoch: float) -> int | float:
    """Epochs done, as an int at an epoch's end."""
    return int(round(epoch)) if abs(epoch - round(epoch)) < 1e-9 else round(epoch, 4)


def log_line(record: dict) -> str:
    """The line a train record prints with print_logs (pretraining)."""
    return (f"step {record['step']:>6} | loss {record['train_loss']:.4f} | lr {record['lr']:.2e} | "
            f"{record['ms_per_step']:.1f} ms/step | {record['tokens_per_s']:,.0f} tok/s")


def summary_line(r: dict, improved: bool, cfg: TrainConfig) -> str:
    """The fine-tuning line after each evaluation (an epoch)."""
    train = f"train loss {r.get('train_loss', math.nan):.4f}" + (f" acc {r['train_acc']:.4f}" if "train_acc" in r
                                                                else "")
    dev = " ".join(f"{k[len(cfg.eval_prefix):]} {v:.4f}" for k, v in r.items() if k.startswith(cfg.eval_prefix))
    return (f"epoch {math.ceil(r['epoch'] - 1e-9)}/{cfg.epochs} | {train} | dev {dev} | lr {r['lr']:.2e} | "
            f"{r.get('seconds', 0.0):.1f} s, {r.get('tokens_per_s', 0):.0f} tok/s"
            + (f" | {r['skipped']} non-finite steps skipped" if r.get("skipped") else "")
            + (f" | {r['fp16_overflows']} fp16 overflow steps skipped" if r.get("fp16_overflows") else "")
            + (" | best, saved" if improved else ""))


def benchmark_report(bench: dict, steps_per_epoch: int) -> dict:
    """--max_steps: throughput of the steps run (bench: seconds, steps, batches, tokens), printed and returned."""
    per_step = bench["seconds"] / max(bench["steps"], 1)
    report = {"steps": bench["steps"], "seconds": bench["seconds"], "tokens": bench["tokens"],
              "tokens_per_sec": bench["tokens"] / max(bench["seconds"], 1e-9), "seconds_per_step": per_step,
              "epoch_seconds_extrapolated": per_step * steps_per_epoch}
    print(f"benchmark: {bench['steps']} optimizer steps ({bench['batches']} batches, {bench['tokens']:.0f} real "
          f"tokens) in "
          f"{bench['seconds']:.1f} s: {report['tokens_per_sec']:.0f} tok/s, {per_step:.2f} s/step"
          + (f"; an epoch of {steps_per_epoch} steps would take about "
             f"{report['epoch_seconds_extrapolated'] / 60:.1f} min" if steps_per_epoch else ""))
    return report
