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
output_dir/last and ends with the same weights as an uninterrupted run with the same settings. The resume rule (both
loops): a changed setting in run_info is refused, naming it; only `epochs` may grow, to train a finished run further
(a decaying schedule is then recomputed for the new length).

Guards: a non-finite loss or gradient stops the run (NonFiniteError naming the step; the checkpoints on disk are
the last good ones), or with skip_nonfinite the batch is skipped and counted. Under torchrun (tasks/distributed.py)
each rank trains on its slice of every batch inside DistributedDataParallel; rank 0 alone evaluates and writes.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
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
from models.gpt2 import GPT2Model
from models.loading import load_pretrained
from optimizer import AdamW, make_lr_scheduler, param_groups_for_weight_decay
from tasks import distributed as dist
from tasks import lora
from tasks.checkpoint import capture_rng, check_resume_settings, load_checkpoint, resolve, restore_rng, save_checkpoint


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
    fp16: bool = False  # fp16 autocast with a gradient scaler (for GPUs without bf16)
    seed: int = 11711
    device: str = "cpu"
    resume: bool = False
    overwrite: bool = False
    save_every: int = 0  # also checkpoint every N optimizer steps (0 = epoch ends only)
    max_steps: int = 0  # benchmark: stop after N optimizer steps, no evaluation or checkpoint (0 = off)
    select_metric: str = "acc"  # dev metric that picks the best checkpoint (higher is better)
    skip_nonfinite: bool = False  # skip (and count) batches with a non-finite loss or gradient instead of stopping
    gradient_checkpointing: bool = False  # recompute each block's activations in backward: less memory, more time


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or gradient; the message names the step."""


MAX_SKIPPED_IN_A_ROW = 20  # with skip_nonfinite: this many bad optimizer steps in a row means the run is broken


def nonfinite_error(what: str, where: str, kept: str, bad_in_a_row: int, skipping: bool,
                    remedy: str) -> NonFiniteError:
    """The error that stops a run at a non-finite loss or gradient (both training loops word it alike)."""
    advice = (f"{bad_in_a_row} bad steps in a row despite --skip_nonfinite: the run is diverging; " if skipping
              else "Pass --skip_nonfinite to skip such batches; ")
    return NonFiniteError(f"non-finite {what} at {where}: training stopped; {kept}. {advice}{remedy}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def add_model_args(group, model_help: str = "hub id, HF folder, weights file, or random:key=value,...") -> None:
    """The course's --model_size and our --model, for every task CLI."""
    group.add_argument("--model_size", choices=("gpt2", "gpt2-medium", "gpt2-large"), default="gpt2",
                       help="official checkpoint to start from when --model is not given (course flag)")
    group.add_argument("--model", help=f"{model_help} (default: --model_size)")
    group.add_argument("--hidden_dropout_prob", type=float, default=None,
                       help="the body's residual and embedding dropout, as GPT2Config(hidden_dropout_prob=...) "
                            "(default: the checkpoint's)")


def start(args, output_dir: str | None = None) -> torch.device:
    """Common start of the task CLIs: --model defaults to --model_size, whose dimensions the checkpoint must then
    have (the course's d / l / num_heads check, args.expect); a default --output_dir; the torchrun process group
    (a no-op without torchrun); the device."""
    size = PRESETS[args.model_size]
    args.expect = None if args.model else {k: size[k] for k in ("n_embd", "n_layer", "n_head")}
    args.model = args.model or args.model_size
    args.output_dir = args.output_dir or output_dir
    dist.init(args.threads, "cuda" if args.use_gpu and torch.cuda.is_available() else "cpu")
    return pick_device(args.use_gpu, args.threads)


def pick_device(use_gpu: bool, threads: int = 0) -> torch.device:
    if threads:
        torch.set_num_threads(threads)
    device = dist.device(use_gpu)  # cuda:LOCAL_RANK under torchrun
    if device.type == "cpu":
        print("CUDA is not available: running on CPU" if use_gpu else "running on CPU")
    return device


def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """False on CPUs without bf16 matrix instructions (AVX512-BF16 / AMX), where bf16 runs far slower than fp32."""
    if torch.device(device).type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def autocast(device: torch.device | str, bf16: bool, fp16: bool = False):
    """bf16 or fp16 autocast on `device` (parameters stay fp32), or nothing."""
    device = torch.device(device)
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 exclude each other: pick one")
    if bf16 and not bf16_matmul_is_fast(device):
        warnings.warn("--bf16 on a CPU without bf16 matrix instructions (no AVX512-BF16/AMX): bf16 matmuls run much "
                      "slower than fp32 here; drop --bf16 for speed", stacklevel=2)
    if bf16 or fp16:
        return torch.autocast(device.type, dtype=torch.bfloat16 if bf16 else torch.float16)
    return contextlib.nullcontext()


def body_overrides(args) -> dict:
    """Config fields the task CLIs' flags change on the loaded body (--hidden_dropout_prob)."""
    return {} if args.hidden_dropout_prob is None else {"hidden_dropout_prob": args.hidden_dropout_prob}


def build_body(spec: str, cls=None, expect: dict | None = None, **overrides):
    """A GPT-2 body (or `cls`, e.g. GPT2LMHeadModel) from a hub id, a folder, a weights file, or
    `random:[PRESET,]k=v,...` for a randomly initialised model (e.g. random:n_layer=4,n_head=4,n_embd=256; the
    vocabulary stays 50257 so the GPT-2 tokenizer fits). `expect` ({'n_embd': 768, ...}) is the course's
    d / l / num_heads check, made on the checkpoint's config before its weights load; `overrides` change
    non-architecture fields such as dropout."""

    cls = cls or GPT2Model
    if not spec.startswith("random:"):
        return load_pretrained(cls, spec, expect=expect, **overrides)
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
    if not lora.load_if_adapter(model, ck.path):  # a LoRA run's checkpoint holds the adapter, not the frozen base
        loaded = type(body).from_pretrained(ck.path)
        check_architecture(loaded.config, body.config, ck.path)
        body.load_state_dict(loaded.state_dict())
    if set(ck.extra_tensors) != set(head_keys):
        raise ValueError(f"checkpoint {ck.path} holds head tensors {sorted(ck.extra_tensors)}, "
                         f"the model expects {sorted(head_keys)}")
    if head_keys:
        model.load_state_dict(ck.extra_tensors, strict=False)
    return ck


ARCHITECTURE = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function")


class ArchitectureMismatchError(ValueError):
    """A checkpoint whose shapes are not those of the model it is loaded into."""


def check_architecture(saved, model_config, source) -> None:
    diff = {k: (getattr(saved, k, None), getattr(model_config, k, None)) for k in ARCHITECTURE
            if getattr(saved, k, None) != getattr(model_config, k, None)}
    if diff:
        pairs = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items())
        raise ArchitectureMismatchError(f"checkpoint {source} is a different architecture from the model "
                                        f"(checkpoint vs model): {pairs}")


def _save(folder: Path, model, *, state, optimizer=None, scheduler=None, tokenizer=None) -> None:
    body, head_keys = split_model(model)
    sd = model.state_dict()
    save_checkpoint(folder, lora.checkpoint_part(model) or body, optimizer=optimizer, scheduler=scheduler, state=state,
                    extra_tensors={k: sd[k] for k in head_keys}, tokenizer=tokenizer)


class _LossOf(nn.Module):
    """The model and its loss as one module, so DistributedDataParallel sees the forward that loss_fn runs
    (loss_fn may call any method of the model, e.g. SonnetGPT.loss, which DDP's own forward would not see)."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: dict):
        return self.loss_fn(self.model, batch)


def _rng_state() -> dict:
    """RNG states to checkpoint: rank 0's, and every rank's under torchrun (a collective: all ranks call it)."""
    states = dist.gather_objects(capture_rng())
    return {"rng": states[0], **({"rank_rng": states} if len(states) > 1 else {})}


def _restore_rng_state(state: dict) -> None:
    ranks = state.pop("rank_rng", None)
    rng = state.pop("rng")
    restore_rng(ranks[dist.rank()] if ranks and dist.rank() < len(ranks) else rng)


def _merged_sums(sums: dict) -> dict:
    """Training sums over all ranks (a collective); the seconds are rank 0's wall time, not a sum."""
    per_rank = dist.gather_objects(sums)
    merged = {k: sum(s.get(k, 0.0) for s in per_rank) for k in sorted(set().union(*per_rank))}
    if "seconds" in per_rank[0]:
        merged["seconds"] = per_rank[0]["seconds"]
    return merged


def grad_norm(model: nn.Module, max_norm: float = 0.0) -> float:
    """Total gradient norm (inf or nan if any gradient is); clips to max_norm when it is > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.nn.utils.get_total_norm([p.grad for p in params]))


def train(model: nn.Module, n_train: int, make_batch: Callable[[list[int]], dict], loss_fn: Callable,
          evaluate_fn: Callable[[nn.Module], dict], cfg: TrainConfig, run_info: dict, tokenizer=None,
          count_fn: Callable[[dict], float] | None = None) -> dict:
    """Train and keep output_dir/{last,best}. make_batch(indices) -> dict of tensors (with 'attention_mask' to
    count tokens); loss_fn(model, batch) -> loss, or (loss, {name: summed stat}) such as {'correct', 'count'};
    evaluate_fn(model) -> {metric: value} including cfg.select_metric. count_fn(batch): what loss_fn averages over
    (default: the batch's examples; e.g. its target tokens), so that under torchrun the ranks' slices weigh as they
    would in one process. Returns the best metrics and history (on rank 0; other ranks get no metrics)."""
    device = torch.device(cfg.device)
    model.to(device)
    set_gradient_checkpointing(model, cfg.gradient_checkpointing)
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
        check_resume_settings(ck.state["run"], run_info, ck.path, extendable=("epochs",))
        optimizer.load_state_dict(ck.optimizer)
        scheduler.load_state_dict(ck.scheduler)
        state = ck.state
        state["run"] = run_info  # --epochs may have grown
        _restore_rng_state(state)
        if state["epoch"] >= cfg.epochs:
            print(f"the run in {out} is already complete: {state['epoch']} of {cfg.epochs} epochs; its checkpoints "
                  f"are {out / 'best'} and {out / 'last'}. Raise --epochs to train it further")
        else:
            print(f"resuming from {ck.path}: epoch {state['epoch'] + 1}, batch {state['batch']}, step {state['step']}")
    elif not cfg.max_steps and _exists(out / "last") and not cfg.overwrite:
        raise FileExistsError(f"{out / 'last'} already holds a checkpoint: pass --resume to continue it or "
                              f"--overwrite to start again (or choose another --output_dir)")
    dist.barrier()  # every rank has looked at output_dir/last before rank 0 may write it
    state.setdefault("skipped", 0)
    main, world = dist.is_main(), dist.world_size()
    trainer = dist.wrap(_LossOf(model, loss_fn), device)  # DDP under torchrun; the model itself is trained either way
    if world > 1:
        print(f"distributed: {world} processes, each on its slice of every batch of {cfg.batch_size}")

    amp = autocast(device, cfg.bf16, cfg.fp16)
    # fp16 gradients underflow without loss scaling; the scaler raises the scale while steps stay finite and halves
    # it (skipping the step) when they overflow. Disabled, it is a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16)
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    state.setdefault("overflows", 0)
    bench = {"seconds": 0.0, "batches": 0, "tokens": 0.0}  # this process's throughput, for --max_steps
    bad_in_a_row = 0
    for epoch in range(state["epoch"], cfg.epochs):
        # The order depends only on (seed, epoch), so a resumed run (and every rank) sees the same batches.
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        batches = [order[i : i + cfg.batch_size] for i in range(0, n_train, cfg.batch_size)]
        sums = state["sums"] if state["batch"] and main else {}  # saved sums are already over all ranks
        pending: dict[str, float] = {}  # this optimizer step's sums, kept only if the step is
        nonfinite = None
        model.train()
        start = time.perf_counter()
        bar = tqdm(total=len(batches), initial=state["batch"], desc=f"train {epoch + 1}/{cfg.epochs}",
                   dynamic_ncols=True, leave=False, disable=not main)
        for b in range(state["batch"], len(batches)):
            part = dist.shard(batches[b])
            # A rank whose slice is empty (a short last batch) still joins the gradient all-reduce, with weight 0.
            batch = {k: (v.to(device) if torch.is_tensor(v) else v)
                     for k, v in make_batch(part or batches[b][:1]).items()}
            group_start = b - b % cfg.grad_accum
            group_size = min(cfg.grad_accum, len(batches) - group_start)  # the last group may be short
            last_of_group = b + 1 - group_start == group_size
            count = (float(count_fn(batch)) if count_fn else len(part)) if part else 0.0
            total = dist.all_reduce_sum(count) if count_fn else len(batches[b])
            weight = world * count / max(total, 1e-12)  # DDP averages over ranks: this makes it the global mean
            with dist.no_sync(trainer, not last_of_group):
                with amp:
                    result = trainer(batch)
                loss, stats = result if isinstance(result, tuple) else (result, {})
                scaler.scale(loss * weight / group_size).backward()
            if part:
                value = loss.item()
                if not math.isfinite(value) and nonfinite is None:
                    nonfinite = f"loss {value}"
                tokens = int(batch["attention_mask"].sum())  # real (non-padding) tokens
                bench["tokens"] += tokens
                for k, v in {"loss": value * len(part), "examples": len(part), "tokens": tokens, **stats}.items():
                    pending[k] = pending.get(k, 0) + float(v)
            bench["batches"] += 1
            bar.update(1)
            if not last_of_group:
                continue
            scaler.unscale_(optimizer)  # clip and check the true gradients (a no-op without fp16)
            norm = grad_norm(model, cfg.max_grad_norm)  # after DDP's all-reduce: the same on every rank
            if cfg.fp16 and nonfinite is None and dist.any_rank(not math.isfinite(norm)):
                # an fp16 overflow at this loss scale, not a diverging run: the scaler lowers the scale, no step
                optimizer.zero_grad(set_to_none=True)
                scaler.update()
                state["overflows"] += 1
                pending = {}
                continue
            if nonfinite is None and not math.isfinite(norm):
                nonfinite = f"gradient norm {norm}"
            if dist.any_rank(nonfinite is not None):
                optimizer.zero_grad(set_to_none=True)
                where = (f"optimizer step {state['step'] + 1} (epoch {epoch + 1}, batch{'es' if group_size > 1 else ''}"
                         f" {group_start + 1}{f'-{b + 1}' if group_size > 1 else ''} of {len(batches)})")
                what = nonfinite or "loss or gradient on another rank"
                bad_in_a_row += 1
                if not cfg.skip_nonfinite or bad_in_a_row > MAX_SKIPPED_IN_A_ROW:
                    bar.close()
                    kept = (f"the last good checkpoint {resolve(out / 'last')} is kept" if _exists(out / "last")
                            else "no checkpoint had been written yet")
                    raise nonfinite_error(what, where, kept, bad_in_a_row, cfg.skip_nonfinite,
                                          "a lower --lr or --max_grad_norm may help")
                state["skipped"] += 1
                print(f"warning: skipped {where}: non-finite {what} ({state['skipped']} skipped so far)", flush=True)
                pending, nonfinite = {}, None
                continue
            bad_in_a_row = 0
            for k, v in pending.items():
                sums[k] = sums.get(k, 0) + v
            pending = {}
            if sums.get("examples"):
                bar.set_postfix(loss=f"{sums['loss'] / sums['examples']:.4f}")
            scaler.step(optimizer)
            scaler.update()
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
                state.update(epoch=epoch, batch=b + 1, sums=_merged_sums(sums), scaler=scaler.state_dict())
                rng = _rng_state()
                if main:
                    _save(out / "last", model, state={**state, **rng}, optimizer=optimizer, scheduler=scheduler,
                          tokenizer=tokenizer)
        bar.close()

        sums = _merged_sums(sums)
        improved = False
        if main:  # rank 0 evaluates and writes; the others wait for it at the next collective
            with amp:
                metrics = evaluate_fn(model)
            value = metrics[cfg.select_metric]
            improved = state["best"] is None or value > state["best"]["metrics"][cfg.select_metric]
            seconds = max(sums.get("seconds", 0.0), 1e-9)
            record = {"epoch": epoch + 1, "train_loss": sums["loss"] / sums["examples"] if sums.get("examples")
                      else math.nan, "seconds": seconds, "tokens_per_sec": sums.get("tokens", 0) / seconds,
                      "lr": scheduler.get_last_lr()[0],
                      **({"train_acc": sums["correct"] / sums["count"]} if sums.get("count") else {}),
                      **({"skipped": state["skipped"]} if state["skipped"] else {}),
                      **({"fp16_overflows": state["overflows"]} if state["overflows"] else {}),
                      **{f"dev_{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}}
            state["history"].append(record)
            if improved:
                state["best"] = {"epoch": epoch + 1, "metrics": {k: v for k, v in metrics.items()
                                                                  if isinstance(v, (int, float))}}
                _save(out / "best", model, state={"best": state["best"], "run": run_info}, tokenizer=tokenizer)
        state.update(epoch=epoch + 1, batch=0, sums={}, scaler=scaler.state_dict())
        rng = _rng_state()
        if main:
            _save(out / "last", model, state={**state, **rng}, optimizer=optimizer, scheduler=scheduler,
                  tokenizer=tokenizer)
            print(summary_line(record, cfg.epochs, improved), flush=True)
    return {"best": state["best"], "history": state["history"], "skipped": state["skipped"]}


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
            f"{r['tokens_per_sec']:.0f} tok/s"
            + (f" | {r['skipped']} non-finite steps skipped" if r.get("skipped") else "")
            + (f" | {r['fp16_overflows']} fp16 overflow steps skipped" if r.get("fp16_overflows") else "")
            + (" | best, saved" if improved else ""))


def _benchmark_report(bench: dict, steps: int, batches_per_epoch: int) -> dict:
    per_batch = bench["seconds"] / bench["batches"]
    report = {"steps": steps, "batches": bench["batches"], "seconds": bench["seconds"], "tokens": bench["tokens"],
              "tokens_per_sec": bench["tokens"] / bench["seconds"], "seconds_per_batch": per_batch,
              "epoch_seconds_extrapolated": per_batch * batches_per_epoch}
    print(f"benchmark: {steps} optimizer steps ({bench['batches']} batches, {bench['tokens']:.0f} real tokens) in "
          f"{bench['seconds']:.1f} s: {report['tokens_per_sec']:.0f} tok/s, {per_batch:.2f} s/batch; "
          f"an epoch of {batches_per_epoch} batches would take about {report['epoch_seconds_extrapolated'] / 60:.1f} min")
    return report


def set_gradient_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn activation recomputation on or off in every GPT2Model inside `model` (the task heads wrap one)."""
    for module in model.modules():
        if isinstance(module, GPT2Model):
            module.gradient_checkpointing = enabled


def run_cli(job: Callable[[], object]) -> int:
    """A CLI's exit code: 0 when job() returns; 1 with one `error: ...` line for the failures users cause (bad
    files or flags, an existing run without --resume, a non-finite loss). The torchrun process group is left either way."""
    try:
        job()
    except (ValueError, OSError, NonFiniteError) as e:  # OSError covers FileNotFoundError and FileExistsError
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        dist.cleanup()
    return 0


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
    g.add_argument("--fp16", action="store_true", help="fp16 autocast with a gradient scaler, for GPUs without bf16 "
                   "(parameters and optimizer stay fp32; overflowing steps are skipped and counted)")
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
    g.add_argument("--skip_nonfinite", action="store_true", help="skip (and count) optimizer steps whose loss or "
                   "gradient is not finite, instead of stopping the run there")
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward: "
                   "less memory for longer sequences or bigger batches, about 15%% more time per step")


def train_config(args, output_dir: str, lr: float, device: torch.device) -> TrainConfig:
    for name in ("epochs", "batch_size", "grad_accum", "eval_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    return TrainConfig(output_dir=output_dir, epochs=args.epochs, batch_size=args.batch_size, lr=lr,
                       weight_decay=args.weight_decay, grad_accum=args.grad_accum, schedule=args.schedule,
                       warmup_ratio=args.warmup_ratio, max_grad_norm=args.max_grad_norm, bf16=args.bf16,
                       fp16=getattr(args, "fp16", False),
                       seed=args.seed, device=str(device), resume=args.resume, overwrite=args.overwrite,
                       save_every=args.save_every, max_steps=args.max_steps,
                       skip_nonfinite=getattr(args, "skip_nonfinite", False),
                       gradient_checkpointing=getattr(args, "gradient_checkpointing", False))


@torch.no_grad()
def predict_in_order(model: nn.Module, encoded, batch_size: int, pad_id: int, predict_fn: Callable,
                     device: torch.device | str, bf16: bool = False, desc: str = "eval",
                     fp16: bool = False) -> list[int]:
    """predict_fn(model, batch) -> (B,) labels for each example of `encoded`, returned in its order. Batches are
    formed longest-first so they carry little padding (outputs do not depend on padding)."""
    from tasks.data import iterate_batches, length_sorted

    was_training = model.training
    model.eval()
    order = length_sorted(encoded)
    preds: list[int] = [0] * len(encoded)
    position = 0
    with autocast(device, bf16, fp16):
        for batch in tqdm(iterate_batches(encoded, batch_size, order, pad_id), desc=desc, leave=False,
                          total=math.ceil(len(encoded) / batch_size), dynamic_ncols=True):
            out = predict_fn(model, batch["input_ids"].to(device), batch["attention_mask"].to(device)).tolist()
            for p in out:
                preds[order[position]] = int(p)
                position += 1
    model.train(was_training)
    return preds
