"""The training loop the tasks share, and the pieces every task CLI needs (model spec, device, common flags).

A task supplies the model, a way to make batches, a loss and an evaluation:

    result = train(model, n_train, make_batch=lambda idx: collate([train[i] for i in idx], pad_id),
                   loss_fn=lambda model, batch: F.cross_entropy(model(...), batch["labels"]),
                   evaluate_fn=lambda model: {"acc": ...}, cfg=TrainConfig(...), run_info={...})

Per epoch: a seeded shuffle (torch.Generator seeded with seed and epoch, so the order does not depend on anything
else), gradient accumulation, optional bf16 autocast, our AdamW with a warmup/decay schedule, then the evaluation
with one summary line. Checkpoints (tasks/checkpoint.py) go to output_dir/last (body in HF format, the task's other
weights as extra tensors, optimizer, scheduler, counters, RNG states) at every epoch end and every `save_every`
optimizer steps, and to output_dir/best when the selected dev metric improves. `resume=True` continues from
output_dir/last and ends with the same weights as an uninterrupted run with the same settings.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from config import PRESETS, GPT2Config
from optimizer import AdamW, make_lr_scheduler, param_groups_for_weight_decay
from tasks.checkpoint import capture_rng, load_checkpoint, resolve, restore_rng, save_checkpoint


@dataclass
class TrainConfig:
    output_dir: str
    epochs: int = 10
    batch_size: int = 8
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_accum: int = 1  # micro-batches per optimizer step
    schedule: str = "constant"  # constant (the course), linear or cosine decay after warmup
    warmup_ratio: float = 0.0  # fraction of all optimizer steps spent warming up
    max_grad_norm: float = 0.0  # 0 = no clipping (the course does not clip)
    bf16: bool = False
    seed: int = 11711
    device: str = "cpu"
    resume: bool = False
    overwrite: bool = False
    save_every: int = 0  # also checkpoint every N optimizer steps (0 = epoch ends only)
    max_steps: int = 0  # benchmark: stop after N optimizer steps, no evaluation or checkpoint (0 = off)
    select_metric: str = "acc"  # dev metric that picks the best checkpoint (higher is better)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device(use_gpu: bool, threads: int = 0) -> torch.device:
    if threads:
        torch.set_num_threads(threads)
    if use_gpu and torch.cuda.is_available():
        return torch.device("cuda")
    print("CUDA is not available: running on CPU" if use_gpu else "running on CPU")
    return torch.device("cpu")


def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """False on CPUs without bf16 matrix instructions (AVX512-BF16 / AMX), where bf16 runs far slower than fp32."""
    if torch.device(device).type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def autocast(device: torch.device | str, bf16: bool):
    device = torch.device(device)
    if bf16 and not bf16_matmul_is_fast(device):
        warnings.warn("--bf16 on a CPU without bf16 matrix instructions (no AVX512-BF16/AMX): bf16 matmuls run much "
                      "slower than fp32 here; drop --bf16 for speed", stacklevel=2)
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def build_body(spec: str, cls=None, dims: dict | None = None, **overrides):
    """A GPT-2 body (or `cls`, e.g. GPT2LMHeadModel) from a hub id, a folder, a weights file, or
    `random:[PRESET,]k=v,...` for a randomly initialised model (e.g. random:n_layer=4,n_head=4,n_embd=256; the
    vocabulary stays 50257 so the GPT-2 tokenizer fits). `dims` is the course's d / l / num_heads check of
    GPT2Model.from_pretrained; `overrides` change non-architecture fields such as dropout."""
    from models.gpt2 import GPT2Model

    cls = cls or GPT2Model
    if not spec.startswith("random:"):
        return cls.from_pretrained(spec, **(dims or {}), **overrides)
    fields: dict = {}
    for item in filter(None, spec[len("random:"):].split(",")):
        if "=" not in item:
            if item not in PRESETS:
                raise ValueError(f"{spec!r}: {item!r} is neither key=value nor a preset ({sorted(PRESETS)})")
            fields.update(PRESETS[item])
            continue
        key, value = item.split("=", 1)
        fields[key.strip()] = _number(value.strip())
    return cls(GPT2Config(**{**fields, **overrides}))


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def split_model(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """(part saved in HF format, names of the other tensors): the model itself if it has save_pretrained (an LM),
    else its `.gpt` body plus the head's parameters and buffers."""
    if hasattr(model, "save_pretrained"):
        return model, []
    return model.gpt, [k for k in model.state_dict() if not k.startswith("gpt.")]


def load_weights(model: nn.Module, folder: str | Path):
    """Load a checkpoint folder's weights into `model` (verified against its manifest); returns the Checkpoint."""
    ck = load_checkpoint(folder)
    body, head_keys = split_model(model)
    loaded = type(body).from_pretrained(ck.path)
    body.load_state_dict(loaded.state_dict())
    if set(ck.extra_tensors) != set(head_keys):
        raise ValueError(f"checkpoint {ck.path} holds head tensors {sorted(ck.extra_tensors)}, "
                         f"the model expects {sorted(head_keys)}")
    if head_keys:
        model.load_state_dict(ck.extra_tensors, strict=False)
    return ck


def _save(folder: Path, model, *, state, optimizer=None, scheduler=None, tokenizer=None) -> None:
    body, head_keys = split_model(model)
    sd = model.state_dict()
    save_checkpoint(folder, body, optimizer=optimizer, scheduler=scheduler, state=state,
                    extra_tensors={k: sd[k] for k in head_keys}, tokenizer=tokenizer)


def train(model: nn.Module, n_train: int, make_batch: Callable[[list[int]], dict], loss_fn: Callable,
          evaluate_fn: Callable[[nn.Module], dict], cfg: TrainConfig, run_info: dict, tokenizer=None) -> dict:
    """Train and keep output_dir/{last,best}. make_batch(indices) -> dict of tensors (with 'attention_mask' to
    count tokens); loss_fn(model, batch) -> loss, or (loss, {name: summed stat}) such as {'correct', 'count'};
    evaluate_fn(model) -> {metric: value} including cfg.select_metric. Returns the best metrics and history."""
    device = torch.device(cfg.device)
    model.to(device)
    out = Path(cfg.output_dir)
    batches_per_epoch = math.ceil(n_train / cfg.batch_size)
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.grad_accum)
    total_steps = cfg.epochs * steps_per_epoch
    optimizer = AdamW(param_groups_for_weight_decay(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = make_lr_scheduler(optimizer, round(cfg.warmup_ratio * total_steps), total_steps,
                                  min_ratio=1.0 if cfg.schedule == "constant" else 0.0,
                                  schedule="linear" if cfg.schedule == "constant" else cfg.schedule)
    state = {"epoch": 0, "batch": 0, "step": 0, "best": None, "history": [], "sums": {}, "run": run_info}
    if cfg.resume:
        ck = load_weights(model, out / "last")
        changed = {k: (ck.state["run"].get(k), v) for k, v in run_info.items() if ck.state["run"].get(k) != v}
        if changed:
            raise ValueError(f"cannot resume {out / 'last'}: these settings differ from the interrupted run "
                             f"(then, now): {changed}")
        optimizer.load_state_dict(ck.optimizer)
        scheduler.load_state_dict(ck.scheduler)
        state = ck.state
        restore_rng(state.pop("rng"))
        print(f"resuming from {ck.path}: epoch {state['epoch'] + 1}, batch {state['batch']}, step {state['step']}")
    elif not cfg.max_steps and _exists(out / "last") and not cfg.overwrite:
        raise FileExistsError(f"{out / 'last'} already holds a checkpoint: pass --resume to continue it or "
                              f"--overwrite to start again (or choose another --output_dir)")

    amp = autocast(device, cfg.bf16)
    bench = {"seconds": 0.0, "batches": 0, "tokens": 0.0}  # this process's throughput, for --max_steps
    for epoch in range(state["epoch"], cfg.epochs):
        # The order depends only on (seed, epoch), so a resumed run sees the same batches.
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        batches = [order[i : i + cfg.batch_size] for i in range(0, n_train, cfg.batch_size)]
        sums = state["sums"] if state["batch"] else {}
        model.train()
        start = time.perf_counter()
        bar = tqdm(total=len(batches), initial=state["batch"], desc=f"train {epoch + 1}/{cfg.epochs}",
                   dynamic_ncols=True, leave=False)
        for b in range(state["batch"], len(batches)):
            batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in make_batch(batches[b]).items()}
            group_start = b - b % cfg.grad_accum
            group_size = min(cfg.grad_accum, len(batches) - group_start)  # the last group may be short
            with amp:
                result = loss_fn(model, batch)
            loss, stats = result if isinstance(result, tuple) else (result, {})
            (loss / group_size).backward()
            tokens = int(batch["attention_mask"].sum())  # real (non-padding) tokens
            bench["tokens"] += tokens
            bench["batches"] += 1
            for k, v in {"loss": loss.item() * len(batches[b]), "examples": len(batches[b]), "tokens": tokens,
                         **stats}.items():
                sums[k] = sums.get(k, 0) + float(v)
            bar.update(1)
            bar.set_postfix(loss=f"{sums['loss'] / sums['examples']:.4f}")
            if b + 1 - group_start < group_size:
                continue
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            elapsed, start = time.perf_counter() - start, time.perf_counter()
            sums["seconds"] = sums.get("seconds", 0.0) + elapsed
            bench["seconds"] += elapsed
            if cfg.max_steps and state["step"] >= cfg.max_steps:
                bar.close()
                return _benchmark_report(bench, state["step"], batches_per_epoch)
            if cfg.save_every and state["step"] % cfg.save_every == 0 and b + 1 < len(batches):
                state.update(epoch=epoch, batch=b + 1, sums=sums)
                _save(out / "last", model, state={**state, "rng": capture_rng()}, optimizer=optimizer,
                      scheduler=scheduler, tokenizer=tokenizer)
        bar.close()

        with amp:
            metrics = evaluate_fn(model)
        value = metrics[cfg.select_metric]
        improved = state["best"] is None or value > state["best"]["metrics"][cfg.select_metric]
        record = {"epoch": epoch + 1, "train_loss": sums["loss"] / sums["examples"],
                  "seconds": sums["seconds"], "tokens_per_sec": sums["tokens"] / sums["seconds"],
                  "lr": scheduler.get_last_lr()[0], **({"train_acc": sums["correct"] / sums["count"]}
                                                       if "correct" in sums else {}),
                  **{f"dev_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}}
        state["history"].append(record)
        if improved:
            state["best"] = {"epoch": epoch + 1, "metrics": {k: v for k, v in metrics.items()
                                                              if isinstance(v, (int, float))}}
            _save(out / "best", model, state={"best": state["best"], "run": run_info}, tokenizer=tokenizer)
        state.update(epoch=epoch + 1, batch=0, sums={})
        _save(out / "last", model, state={**state, "rng": capture_rng()}, optimizer=optimizer, scheduler=scheduler,
              tokenizer=tokenizer)
        print(summary_line(record, cfg.epochs, improved), flush=True)
    return {"best": state["best"], "history": state["history"]}


def _exists(folder: Path) -> bool:
    try:
        resolve(folder)
        return True
    except FileNotFoundError:
        return False


def summary_line(r: dict, epochs: int, improved: bool) -> str:
    train = f"train loss {r['train_loss']:.4f}" + (f" acc {r['train_acc']:.4f}" if "train_acc" in r else "")
    dev = " ".join(f"{k[4:]} {v:.4f}" for k, v in r.items() if k.startswith("dev_"))
    return (f"epoch {r['epoch']}/{epochs} | {train} | dev {dev} | lr {r['lr']:.2e} | {r['seconds']:.1f} s, "
            f"{r['tokens_per_sec']:.0f} tok/s" + (" | best, saved" if improved else ""))


def _benchmark_report(bench: dict, steps: int, batches_per_epoch: int) -> dict:
    per_batch = bench["seconds"] / bench["batches"]
    report = {"steps": steps, "batches": bench["batches"], "seconds": bench["seconds"], "tokens": bench["tokens"],
              "tokens_per_sec": bench["tokens"] / bench["seconds"], "seconds_per_batch": per_batch,
              "epoch_seconds_extrapolated": per_batch * batches_per_epoch}
    print(f"benchmark: {steps} optimizer steps ({bench['batches']} batches, {bench['tokens']:.0f} real tokens) in "
          f"{bench['seconds']:.1f} s: {report['tokens_per_sec']:.0f} tok/s, {per_batch:.2f} s/batch; "
          f"an epoch of {batches_per_epoch} batches would take about {report['epoch_seconds_extrapolated'] / 60:.1f} min")
    return report


def add_training_args(parser: argparse.ArgumentParser, epochs: int, batch_size: int, lr_help: str) -> None:
    """The flags every task CLI shares (the course's names where the course has them)."""
    g = parser.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=epochs, help=f"passes over the training data (course: {epochs})")
    g.add_argument("--batch_size", type=int, default=batch_size, help=f"examples per micro-batch (course: {batch_size})")
    g.add_argument("--lr", type=float, default=None, help=lr_help)
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW decoupled weight decay (course: 0)")
    g.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--schedule", choices=("constant", "linear", "cosine"), default="constant",
                   help="learning-rate decay after warmup (course: constant)")
    g.add_argument("--warmup_ratio", type=float, default=0.0, help="fraction of optimizer steps spent warming up")
    g.add_argument("--max_grad_norm", type=float, default=0.0, help="clip gradients to this norm (0: no clipping)")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast for training and evaluation; parameters and "
                   "optimizer stay fp32. Fast on GPUs and CPUs with AVX512-BF16/AMX, much slower on AVX2-only CPUs")
    g.add_argument("--seed", type=int, default=11711, help="seed of initialisation, shuffling and dropout")
    g.add_argument("--use_gpu", action="store_true", help="use CUDA if available")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default; on a busy "
                                                          "machine 1 can be much faster than oversubscribing)")
    g.add_argument("--output_dir", default=None, help="checkpoint folder: last/ and best/ (HF format + state)")
    g.add_argument("--resume", action="store_true", help="continue the interrupted run in --output_dir exactly")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if --output_dir has a checkpoint")
    g.add_argument("--save_every", type=int, default=0, help="also checkpoint every N optimizer steps (0: epoch ends)")
    g.add_argument("--max_steps", type=int, default=0,
                   help="benchmark: stop after N optimizer steps, print throughput and exit (no eval, no files)")
    g.add_argument("--eval_batch_size", type=int, default=32, help="batch size for dev/test prediction")


def train_config(args, output_dir: str, lr: float, device: torch.device) -> TrainConfig:
    for name in ("epochs", "batch_size", "grad_accum", "eval_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    return TrainConfig(output_dir=output_dir, epochs=args.epochs, batch_size=args.batch_size, lr=lr,
                       weight_decay=args.weight_decay, grad_accum=args.grad_accum, schedule=args.schedule,
                       warmup_ratio=args.warmup_ratio, max_grad_norm=args.max_grad_norm, bf16=args.bf16,
                       seed=args.seed, device=str(device), resume=args.resume, overwrite=args.overwrite,
                       save_every=args.save_every, max_steps=args.max_steps)


@torch.no_grad()
def predict_in_order(model: nn.Module, encoded, batch_size: int, pad_id: int, predict_fn: Callable,
                     device: torch.device | str, bf16: bool = False, desc: str = "eval") -> list[int]:
    """predict_fn(model, batch) -> (B,) labels for each example of `encoded`, returned in its order. Batches are
    formed longest-first so they carry little padding (outputs do not depend on padding)."""
    from tasks.data import iterate_batches, length_sorted

    was_training = model.training
    model.eval()
    order = length_sorted(encoded)
    preds: list[int] = [0] * len(encoded)
    position = 0
    with autocast(device, bf16):
        for batch in tqdm(iterate_batches(encoded, batch_size, order, pad_id), desc=desc, leave=False,
                          total=math.ceil(len(encoded) / batch_size), dynamic_ncols=True):
            out = predict_fn(model, batch["input_ids"].to(device), batch["attention_mask"].to(device)).tolist()
            for p in out:
                preds[order[position]] = int(p)
                position += 1
    model.train(was_training)
    return preds
