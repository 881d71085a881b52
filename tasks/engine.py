"""The training engine: one loop for fine-tuning (tasks/training.py) and pretraining (tasks/pretrain.py).

    result = fit(model, batches, loss_fn, evaluate_fn, TrainConfig(output_dir="out", lr=1e-3, ...), run_info)

A task supplies the model, a source of batches (`EpochBatches` below for a set of examples; pretraining's random
windows), a loss and an evaluation. The engine owns the rest:
- the step: the micro-batches of one optimizer step under autocast, DDP's no_sync until the last, fp16 loss scaling,
  unscaling, clipping, one read-back for the non-finite guard, the optimizer (AdamW, or Muon for the blocks'
  matrices with AdamW for the rest) and the schedule; with `split_batch` each micro-batch is cut row-wise across
  the CPU threads (one core each, gradients added in a fixed order);
- the cadence: a metrics record every `log_interval` steps, an evaluation where the batch source ends an epoch or
  every `eval_interval` steps, and at the end;
- checkpoints (tasks/checkpoint.py): OUT/last, everything an exact resume needs, at every evaluation and every
  `save_every` steps; OUT/best, the weights (with tokenizer and metrics), when the selected metric improves.
  `resume=True` continues OUT/last and ends with the weights of an uninterrupted run with the same settings; a
  changed setting in run_info is refused by name, only `epochs` / `max_iters` may grow;
- the guard: a non-finite loss or gradient stops the run (NonFiniteError naming the step; the checkpoints on disk are
  the last good ones), or with skip_nonfinite the step is skipped and counted;
- the record: OUT/metrics.jsonl (one JSON line per log interval and per evaluation; resumes append) and
  OUT/curves.png, refreshed at each evaluation (tasks/metrics.py). Under torchrun rank 0 alone evaluates and writes.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol

import torch
from torch import nn
from tqdm import tqdm

from optimizer import AdamW, MuonWithAdamW, make_lr_scheduler, muon_param_groups, param_groups_for_weight_decay
from tasks import distributed as dist
from tasks import lora
from tasks.checkpoint import (
    Checkpoint,
    CorruptCheckpointError,
    capture_rng,
    check_resume_settings,
    load_checkpoint,
    resolve,
    restore_rng,
    save_checkpoint,
)
from tasks.metrics import MetricsLog

CHECKPOINTS = ("best", "last")
MAX_SKIPPED_IN_A_ROW = 20  # with skip_nonfinite: this many bad optimizer steps in a row means the run is broken


@dataclass
class TrainConfig:
    """One training run's settings (fine-tuning or pretraining); every field has the meaning of the CLI flag of the
    same name."""
    output_dir: str
    epochs: int = 10  # passes over the data (a source of epochs: fine-tuning)
    max_iters: int = 0  # optimizer steps of the run (a source without epochs: pretraining)
    batch_size: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-5
    min_lr: float = 0.0  # where a decaying schedule ends
    schedule: str = "constant"  # constant (the course), linear or cosine decay after warmup
    warmup_ratio: float = 0.0  # fraction of all optimizer steps spent warming up ...
    warmup_steps: int | None = None  # ... or this many steps
    decay_steps: int = 0  # the step where the decay reaches min_lr (0: the end of the run)
    weight_decay: float = 0.0
    decay_embeddings: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6  # AdamW epsilon (the course's default)
    optimizer: str = "adamw"  # adamw, or muon: Muon for the blocks' matrices, AdamW (lr) for the rest
    muon_lr: float = 0.02  # Muon's peak lr; the schedule scales it as it scales lr
    max_grad_norm: float = 0.0  # 0 = no clipping (the course does not clip)
    dtype: str = "float32"  # autocast: float32 (none), bfloat16, or float16 with a gradient scaler
    seed: int = 11711
    device: str = "cpu"
    resume: bool = False
    overwrite: bool = False
    eval_interval: int = 0  # evaluate every N optimizer steps (0: where the batch source ends an epoch)
    eval_at_start: bool = False  # also evaluate before the first step
    log_interval: int = 50  # one metrics record every N optimizer steps
    print_logs: bool = False  # print each log record as a line (pretraining), else only the progress bar shows it
    save_every: int = 0  # also checkpoint OUT/last every N optimizer steps (0: at evaluations only)
    max_steps: int = 0  # benchmark: stop after N optimizer steps, no evaluation or checkpoint (0 = off)
    select_metric: str = "acc"  # the evaluation metric that picks OUT/best
    select_max: bool = True  # higher is better (False: lower, e.g. a validation loss)
    eval_prefix: str = "dev_"  # the evaluation's metrics are recorded as dev_acc, ...
    skip_nonfinite: bool = False  # skip (and count) steps with a non-finite loss or gradient instead of stopping
    gradient_checkpointing: bool = False  # recompute each block's activations in backward: less memory, more time
    split_batch: bool = False  # on a CPU, cut each micro-batch across the threads (dropout 0; exact for a loss that
    #                            averages over equally weighted rows, as pretraining's windows)
    compile: bool = False  # torch.compile the training forward and loss (the first steps compile; evaluation is eager)
    tensorboard: bool = False  # also write TensorBoard events to OUT/tensorboard
    plot: bool = True  # refresh OUT/curves.png at each evaluation

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    @property
    def fp16(self) -> bool:
        return self.dtype == "float16"


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or gradient; the message names the step."""


class ArchitectureMismatchError(ValueError):
    """A checkpoint whose shapes are not those of the model it is loaded into."""


# ---- what a batch source hands the engine ------------------------------------------------------------------------

class MicroBatch(NamedTuple):
    batch: dict  # tensors on the device
    weight: float  # multiplies the batch's mean loss: DDP's average over ranks then gives the step's mean loss
    tokens: int  # real (non-padding) tokens, for tokens/s


@dataclass
class Step:
    micro: list[MicroBatch]  # this rank's micro-batches of one optimizer step
    where: str  # names the step in messages; "{step}" becomes the optimizer step's number
    epoch: float  # epochs done after this step (fractional)
    ends_epoch: bool = False  # evaluate after this step


class BatchSource(Protocol):
    total_steps: int  # optimizer steps the schedule plans for (0: the run is as long as TrainConfig.max_iters)

    def next_step(self) -> Step | None: ...  # None: no more data (the last epoch ended)
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class EpochBatches:
    """A set of n examples: each epoch a seeded shuffle (a torch.Generator seeded with seed and epoch, so the order
    depends on nothing else and every rank sees it) cut into batches of batch_size, grad_accum batches per optimizer
    step (an epoch's last step may be short). make_batch(indices) -> dict of tensors; count_fn(batch) is what the
    loss averages over (default: the examples; e.g. the target tokens), so that the ranks' slices of a batch weigh
    as they would in one process. Position: the optimizer steps consumed (skipped ones too)."""

    def __init__(self, n: int, batch_size: int, grad_accum: int, epochs: int, seed: int,
                 make_batch: Callable[[list[int]], dict], device: torch.device | str = "cpu",
                 count_fn: Callable[[dict], float] | None = None):
        self.n, self.batch_size, self.grad_accum, self.epochs, self.seed = n, batch_size, grad_accum, epochs, seed
        self.make_batch, self.device, self.count_fn = make_batch, torch.device(device), count_fn
        self.batches_per_epoch = math.ceil(n / batch_size)
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / grad_accum)
        self.total_steps = epochs * self.steps_per_epoch
        self.position = 0
        self._order: tuple[int, list[list[int]]] | None = None

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            order = torch.randperm(self.n, generator=gen).tolist()
            self._order = (epoch, [order[i: i + self.batch_size] for i in range(0, self.n, self.batch_size)])
        return self._order[1]

    def next_step(self) -> Step | None:
        if self.position >= self.total_steps:
            return None
        epoch, group = divmod(self.position, self.steps_per_epoch)
        batches = self._batches(epoch)
        first = group * self.grad_accum
        chosen = batches[first: first + self.grad_accum]
        world, micro = dist.world_size(), []
        for indices in chosen:
            part = dist.shard(indices)
            # A rank whose slice is empty (a short last batch) still joins the gradient all-reduce, with weight 0.
            batch = {k: (v.to(self.device) if torch.is_tensor(v) else v)
                     for k, v in self.make_batch(part or indices[:1]).items()}
            count = (float(self.count_fn(batch)) if self.count_fn else len(part)) if part else 0.0
            total = dist.all_reduce_sum(count) if self.count_fn else len(indices)
            tokens = int(batch["attention_mask"].sum()) if part and "attention_mask" in batch else 0
            micro.append(MicroBatch(batch, world * count / max(total, 1e-12) / len(chosen), tokens))
        self.position += 1
        span = f"batch{'es' if len(chosen) > 1 else ''} {first + 1}" + (f"-{first + len(chosen)}" if len(chosen) > 1
                                                                        else "")
        return Step(micro, f"optimizer step {{step}} (epoch {epoch + 1}, {span} of {len(batches)})",
                    epoch + (group + 1) / self.steps_per_epoch, ends_epoch=group + 1 == self.steps_per_epoch)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


# ---- pieces of the step ------------------------------------------------------------------------------------------

def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """False on CPUs without bf16 matrix instructions (AVX512-BF16 / AMX), where bf16 runs far slower than fp32."""
    if torch.device(device).type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


DTYPES = ("float32", "bfloat16", "float16")


def autocast(device: torch.device | str, bf16: bool = False, fp16: bool = False):
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


def nonfinite_error(what: str, where: str, kept: str, bad_in_a_row: int, skipping: bool) -> NonFiniteError:
    advice = (f"{bad_in_a_row} bad steps in a row despite --skip_nonfinite: the run is diverging; " if skipping
              else "Pass --skip_nonfinite to skip such batches; ")
    return NonFiniteError(f"non-finite {what} at {where}: training stopped; {kept}. {advice}"
                          f"a lower --lr or --max_grad_norm may help")


class _LossOf(nn.Module):
    """The model and its loss as one module, so DistributedDataParallel sees the forward that loss_fn runs
    (loss_fn may call any method of the model, e.g. SonnetGPT.loss, which DDP's own forward would not see)."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: dict):
        result = self.loss_fn(self.model, batch)
        return result if isinstance(result, tuple) else (result, {})


def _rows(batch: dict) -> int:
    return next(v.shape[0] for v in batch.values() if torch.is_tensor(v))


class _Backward:
    """Forward and backward of one micro-batch, optionally cut row-wise across `workers` threads that use one core
    each. Torch's intra-op threads synchronise at every operation, which on a small model costs more than the work
    they share (tiny shakespeare's 4x128 model: 48 vs 85 ms per step); slices of a batch need no synchronisation
    until their gradients are added, in a fixed order so that runs repeat. Each slice's loss is weighted by its
    share of the rows (exact for losses that average over equally sized rows; with dropout the slices would race
    for the random generator, so the caller splits only without it)."""

    def __init__(self, trainer: nn.Module, params: list[torch.nn.Parameter], workers: int, amp_factory):
        self.trainer, self.params, self.workers, self.amp = trainer, params, workers, amp_factory
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="batch") if workers > 1 else None

    def __call__(self, mb: MicroBatch, scale: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Add the gradient of scale(weight * mean loss) and return (the weighted loss, detached; stats)."""
        rows = _rows(mb.batch)
        if self.pool is None or rows < 2:
            with self.amp():
                loss, stats = self.trainer(mb.batch)
            weighted = loss * mb.weight
            scale(weighted).backward()
            return weighted.detach(), stats
        bounds = [round(i * rows / self.workers) for i in range(self.workers + 1)]
        slices = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

        def work(index: int):
            a, b = slices[index]
            part = {k: (v[a:b] if torch.is_tensor(v) else v) for k, v in mb.batch.items()}
            with self.amp():
                loss, stats = self.trainer(part)
            weighted = loss * (mb.weight * (b - a) / rows)
            if index == 0:  # the first slice accumulates into .grad itself; the others return theirs to be added
                scale(weighted).backward()
                return weighted.detach(), stats, None
            return weighted.detach(), stats, torch.autograd.grad(scale(weighted), self.params, allow_unused=True)

        results = list(self.pool.map(work, range(len(slices))))
        for _, _, grads in results[1:]:  # in slice order, so that runs repeat
            pairs = [(p, g) for p, g in zip(self.params, grads) if g is not None]
            for p, g in pairs:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if pairs:
                torch._foreach_add_([p.grad for p, _ in pairs], [g for _, g in pairs])
        stats: dict = {}
        for _, s, _ in results:
            for k, v in s.items():
                stats[k] = stats.get(k, 0) + v
        return sum(r[0] for r in results), stats

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def split_workers(cfg: TrainConfig, model: nn.Module) -> int:
    """Threads to cut each micro-batch across: all of torch's with split_batch on a CPU in one process, unless
    dropout is on (its masks come from one generator that the threads would race for); else 1."""
    threads = torch.get_num_threads()
    if (not cfg.split_batch or cfg.compile or threads == 1 or dist.world_size() > 1
            or torch.device(cfg.device).type != "cpu"):
        return 1
    dropout = [m.p for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        print(f"dropout {max(dropout)}: not splitting batches across threads (the run would not repeat); "
              f"{threads} intra-op threads instead")
        return 1
    return threads


def build_optimizer(model: nn.Module, cfg: TrainConfig, groups: list | None = None) -> torch.optim.Optimizer:
    """cfg.optimizer's optimizer over `groups` (default: the model's parameters split by the optimizer's rule)."""
    if cfg.optimizer == "adamw":
        groups = groups or param_groups_for_weight_decay(model, cfg.weight_decay, cfg.decay_embeddings)
        return AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    if cfg.optimizer == "muon":
        groups = groups or muon_param_groups(model, cfg.weight_decay, decay_embeddings=cfg.decay_embeddings)
        # torch.optim.Muon's Newton-Schulz runs in bf16, which is 20x slower than fp32 on CPUs without bf16 units
        ns_dtype = torch.bfloat16 if bf16_matmul_is_fast(cfg.device) else torch.float32
        optimizer = MuonWithAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, muon_lr=cfg.muon_lr,
                                  ns_dtype=ns_dtype)
        muon = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
        rest = [p for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]]
        if dist.is_main():
            print(f"optimizer: Muon (lr {cfg.muon_lr:g}, Newton-Schulz in {str(ns_dtype).removeprefix('torch.')}) "
                  f"for {len(muon)} matrices ({sum(p.numel() for p in muon):,} weights), AdamW (lr {cfg.lr:g}) "
                  f"for {len(rest)} other tensors ({sum(p.numel() for p in rest):,})")
        return optimizer
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}: choose adamw or muon")


def grad_norm(params: list[torch.nn.Parameter], max_norm: float = 0.0) -> torch.Tensor:
    """Total gradient norm as a tensor (inf or nan if any gradient is); clips to max_norm when it is > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm:
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm, foreach=True)
    return torch.nn.utils.get_total_norm(grads, foreach=True)


def set_gradient_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn activation recomputation on or off in every module of `model` that has the switch (GPT2Model)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = enabled


# ---- checkpoints of a model, its head and its adapters ------------------------------------------------------------

ARCHITECTURE = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "norm",
                "norm_scale", "position_embedding", "rope_theta", "kv_heads", "qk_norm", "bias", "tie_word_embeddings",
                "logit_softcap")  # kv_heads: n_kv_head with None read as n_head


def check_architecture(saved, model_config, source) -> None:
    diff = {k: (getattr(saved, k, None), getattr(model_config, k, None)) for k in ARCHITECTURE
            if getattr(saved, k, None) != getattr(model_config, k, None)}
    if diff:
        pairs = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items())
        raise ArchitectureMismatchError(f"checkpoint {source} is a different architecture from the model "
                                        f"(checkpoint vs model): {pairs}")


def split_model(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """(part saved in HF format, names of the other tensors): the model itself if it has save_pretrained (an LM),
    else its `.gpt` body plus the head's parameters and buffers."""
    if hasattr(model, "save_pretrained"):
        return model, []
    return model.gpt, [k for k in model.state_dict() if not k.startswith("gpt.")]


def load_weights(model: nn.Module, folder: str | Path) -> Checkpoint:
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


def save_model(folder: Path, model: nn.Module, *, state: dict, optimizer=None, scheduler=None, tokenizer=None) -> None:
    body, head_keys = split_model(model)
    sd = model.state_dict()
    save_checkpoint(folder, lora.checkpoint_part(model) or body, optimizer=optimizer, scheduler=scheduler, state=state,
                    extra_tensors={k: sd[k] for k in head_keys}, tokenizer=tokenizer)


def exists(folder: Path) -> bool:
    try:
        resolve(folder)
        return True
    except FileNotFoundError:
        return False


RUN_FILES = ("metrics.jsonl", "curves.png", "tensorboard")


def remove_run(out: Path) -> None:
    """--overwrite: the old run's checkpoints (whatever state they are in) and its metrics go; other files stay."""
    if dist.is_main() and out.is_dir():
        doomed = [out / f"{p}{name}{s}" for name in CHECKPOINTS for p, s in (("", ""), (".", ".old"))]
        doomed += list(out.glob(".*.tmp-*")) + [out / name for name in RUN_FILES]
        existing = [f for f in doomed if f.exists()]
        for f in existing:
            shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink()
        if any(f.name.lstrip(".").split(".")[0] in CHECKPOINTS for f in existing):
            print(f"--overwrite: removed the checkpoints in {out}")
    dist.barrier()


def open_run(cfg: TrainConfig) -> Checkpoint | None:
    """The checkpoint that cfg.resume continues (OUT/last, verified), or None for a new run. A new run refuses an
    output folder that holds one (unless cfg.overwrite, which clears it first)."""
    out = Path(cfg.output_dir)
    if cfg.overwrite and not cfg.resume:
        remove_run(out)  # before looking: a broken checkpoint is cleared, not read
    found = next((name for name in ("last", "best") if exists(out / name)), None)
    if cfg.resume:
        if found != "last":
            raise FileNotFoundError(f"--resume: no checkpoint to continue in {out} (it has no last/)")
        try:
            return load_checkpoint(out / "last")
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e}; --resume cannot continue it: pass --overwrite to start afresh") from None
    if found and not cfg.max_steps:
        raise FileExistsError(f"{out / found} already holds a checkpoint: pass --resume to continue it or "
                              f"--overwrite to start again (or choose another --output_dir)")
    return None


# ---- meters ------------------------------------------------------------------------------------------------------

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


INTERVAL_RATES = ("train_loss", "ms_per_step", "tokens_per_s", "seconds")


def _rates(sums: dict) -> dict:
    """Train loss (and accuracy where the loss counts it), step time and throughput from a meter's merged sums."""
    steps, seconds = sums.get("steps", 0), max(sums.get("seconds", 0.0), 1e-9)
    record = {"train_loss": sums["loss"] / steps if steps else math.nan,
              "ms_per_step": 1000 * seconds / steps if steps else math.nan,
              "tokens_per_s": sums.get("tokens", 0) / seconds, "seconds": round(sums.get("seconds", 0.0), 3)}
    if sums.get("count"):
        record["train_acc"] = sums["correct"] / sums["count"]
    return record


# ---- the loop ----------------------------------------------------------------------------------------------------

def _rng_state(batches) -> dict:
    """RNG states to checkpoint: rank 0's, and every rank's under torchrun (a collective: all ranks call it)."""
    states = dist.gather_objects(capture_rng())
    return {"rng": states[0], **({"rank_rng": states} if len(states) > 1 else {}), "batches": batches.state_dict()}


def _restore_rng_state(state: dict, batches) -> None:
    ranks = state.get("rank_rng")
    restore_rng(ranks[dist.rank()] if ranks and dist.rank() < len(ranks) else state["rng"])
    batches.load_state_dict(state["batches"])


@dataclass
class RunState:
    """What a checkpoint of OUT/last holds besides weights, optimizer and schedule."""
    step: int = 0
    epoch: float = 0.0
    best: dict | None = None  # {"step", "epoch", "metrics"} of OUT/best
    last_eval: dict = field(default_factory=dict)  # the latest evaluation's record
    evaluated_at: int = -1  # the step of the latest evaluation (a skipped step must not evaluate twice)
    history: list = field(default_factory=list)  # every evaluation's record
    skipped: int = 0
    overflows: int = 0
    wall_s: float = 0.0  # seconds of training (steps and evaluations) over all sessions of the run
    log_sums: dict = field(default_factory=dict)
    eval_sums: dict = field(default_factory=dict)


def fit(model: nn.Module, batches: BatchSource, loss_fn: Callable, evaluate_fn: Callable[[nn.Module], dict],
        cfg: TrainConfig, run_info: dict, tokenizer=None, resume_from: Checkpoint | None = None,
        report: Callable[[dict, bool, TrainConfig], str] | None = None, optimizer_groups: list | None = None) -> dict:
    """Train `model` on `batches` and keep OUT/{last,best} and OUT/metrics.jsonl.

    loss_fn(model, batch) -> mean loss, or (mean loss, {name: summed stat}) such as {'correct', 'count'} (then the
    records carry train_acc); evaluate_fn(model) -> {metric: value} including cfg.select_metric (non-numbers, such
    as a confusion matrix, are kept in the returned history but not recorded). report(record, improved, cfg) -> the
    line printed after each evaluation (default: the fine-tuning summary line). resume_from: the OUT/last checkpoint
    when the caller has already loaded its weights into `model` (pretraining builds its model from it).
    Returns {'best', 'history', 'last_eval', 'step', 'steps_run', 'skipped', 'fp16_overflows', 'complete',
    'ms_per_step', 'tokens_per_s', 'seconds'} (the metrics on rank 0 only)."""
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    model.to(device)
    set_gradient_checkpointing(model, cfg.gradient_checkpointing)
    out = Path(cfg.output_dir)
    total = batches.total_steps or cfg.max_iters
    decay_to = cfg.decay_steps or total
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total)
    optimizer = build_optimizer(model, cfg, optimizer_groups)
    scheduler = make_lr_scheduler(optimizer, warmup, decay_to,
                                  min_ratio=1.0 if cfg.schedule == "constant" else cfg.min_lr / cfg.lr,
                                  schedule="linear" if cfg.schedule == "constant" else cfg.schedule)
    # fp16 gradients underflow without loss scaling; the scaler raises the scale while steps stay finite and halves
    # it (skipping the step) when they overflow. Disabled, it is a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16)
    main, world = dist.is_main(), dist.world_size()
    state = RunState()
    ck = resume_from if resume_from is not None else (open_run(cfg) if not cfg.max_steps else None)
    if ck is not None:
        if resume_from is None:
            load_weights(model, ck.path)
        check_resume_settings(ck.state.get("run", {}), run_info, ck.path, extendable=("epochs", "max_iters"))
        optimizer.load_state_dict(ck.optimizer)
        scheduler.load_state_dict(ck.scheduler)
        if ck.state.get("scaler"):
            scaler.load_state_dict(ck.state["scaler"])
        _restore_rng_state(ck.state, batches)
        state = RunState(**{k: v for k, v in ck.state.items() if k in RunState.__dataclass_fields__})
        if not main:  # the saved sums are already over all ranks: rank 0 carries them on
            state.log_sums, state.eval_sums = {}, {}
    dist.barrier()  # every rank has looked at OUT before rank 0 may write there
    log = MetricsLog(out, enabled=main and not cfg.max_steps, tensorboard=cfg.tensorboard, plot=cfg.plot)
    if ck is not None:
        log.log({"kind": "resume", "step": state.step, "wall_s": state.wall_s})
        print(f"resuming from {ck.path} at step {state.step}" + (f" (epoch {_epoch(state.epoch)})"
                                                                  if batches.total_steps else ""))
    if world > 1:
        print(f"distributed: {world} processes, each on its slice of every batch of {cfg.batch_size}")

    trainer = dist.wrap(_LossOf(model, loss_fn), device)  # DDP under torchrun; the model itself is trained either way
    if cfg.compile:
        trainer = torch.compile(trainer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    threads = torch.get_num_threads()
    workers = split_workers(cfg, model)
    step_fn = _Backward(trainer, params, workers, lambda: autocast(device, cfg.bf16, cfg.fp16))
    # While the batch is split, torch runs on one thread; Muon's Newton-Schulz products (about 2.5 GFLOP a step on
    # the 4x128 model: 55 ms on one thread, 44 on two) take every core for the optimizer step.
    step_threads = threads if workers > 1 and cfg.optimizer == "muon" else None
    log_meter, eval_meter = Meter(state.log_sums), Meter(state.eval_sums)
    start_step, bad_in_a_row, session_s = state.step, 0, 0.0
    bench = {"seconds": 0.0, "steps": 0, "batches": 0, "tokens": 0.0}

    def evaluate(initial: bool = False) -> None:
        """Evaluate, record, and checkpoint (not the evaluation before the first step: nothing has trained)."""
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        sums = eval_meter.merged()
        improved, record = False, None
        if main:  # rank 0 evaluates and writes; the others wait for it at the next collective
            with autocast(device, cfg.bf16, cfg.fp16):
                metrics = evaluate_fn(model)
            numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            value = numbers[cfg.select_metric]
            best = state.best["metrics"][cfg.select_metric] if state.best else None
            improved = best is None or (value > best if cfg.select_max else value < best)
            record = {"kind": "eval", "step": state.step, "epoch": _epoch(state.epoch),
                      "lr": scheduler.get_last_lr()[0], **(_rates(sums) if sums.get("steps") else {}),
                      **({"skipped": state.skipped} if state.skipped else {}),
                      **({"fp16_overflows": state.overflows} if state.overflows else {}),
                      **{f"{cfg.eval_prefix}{k}": v for k, v in numbers.items()}}
            if improved and not initial:
                state.best = {"step": state.step, "epoch": _epoch(state.epoch), "metrics": numbers}
            if state.best:
                record[f"best_{cfg.eval_prefix}{cfg.select_metric}"] = state.best["metrics"][cfg.select_metric]
            state.history.append({**record, **{f"{cfg.eval_prefix}{k}": v for k, v in metrics.items()}})
            state.last_eval = record
        state.evaluated_at = state.step
        eval_meter.reset()
        saved = not initial and save("best" if improved else None)
        state.wall_s += time.perf_counter() - t0
        if main:
            record["wall_s"] = round(state.wall_s, 3)
            log.log({k: v for k, v in record.items() if k not in INTERVAL_RATES})  # the train records carry those
            log.plot()
            line = (report or summary_line)(record, improved and saved, cfg)
            tqdm.write(line) if bar is not None else print(line, flush=True)
        torch.set_num_threads(1 if workers > 1 else threads)

    def save(best: str | None) -> bool:
        """OUT/best when `best`, and OUT/last (a collective: all ranks gather their RNG states)."""
        state.log_sums, state.eval_sums = log_meter.merged(), eval_meter.merged()
        rng = _rng_state(batches)
        if main:
            if best:
                save_model(out / "best", model, tokenizer=tokenizer,
                           state={"step": state.step, "epoch": state.epoch, "best": state.best, "run": run_info})
            full = {**vars(state), **rng, "scaler": scaler.state_dict(), "run": run_info}
            save_model(out / "last", model, state=full, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer)
        return True

    bar = None
    done = lambda: (cfg.max_iters and state.step >= cfg.max_iters)  # noqa: E731
    try:
        if cfg.eval_at_start and state.step == 0 and not cfg.max_steps:
            evaluate(initial=True)
        bar = tqdm(total=(cfg.max_steps or total), initial=min(state.step, cfg.max_steps or total), unit="step",
                   desc="training", dynamic_ncols=True, leave=False, disable=None if main else True)
        model.train()
        torch.set_num_threads(1 if workers > 1 else threads)
        while not done():
            step = batches.next_step()
            if step is None:
                break
            t0 = time.perf_counter()
            last_micro = len(step.micro) - 1
            step_loss, stats, tokens = torch.zeros((), device=device), {}, 0
            for i, mb in enumerate(step.micro):
                with dist.no_sync(trainer, i < last_micro):  # all-reduce once per optimizer step
                    weighted, s = step_fn(mb, scaler.scale)
                if mb.weight:
                    step_loss += weighted / world  # summed over ranks: the global batch's mean loss
                    tokens += mb.tokens
                    for k, v in s.items():
                        stats[k] = stats.get(k, 0) + v
            scaler.unscale_(optimizer)  # clip and check the true gradients (a no-op without fp16)
            norm = grad_norm(params, cfg.max_grad_norm)  # after DDP's all-reduce: the same on every rank
            bad = not bool(torch.isfinite(step_loss + norm.to(step_loss.device)))  # the step's one read-back
            loss_bad = bad and not bool(torch.isfinite(step_loss))
            stepped = False
            if cfg.fp16 and dist.any_rank(bad and not loss_bad):
                # an fp16 overflow at this loss scale, not a diverging run: the scaler lowers the scale, no step
                optimizer.zero_grad(set_to_none=True)
                scaler.update()
                state.overflows += 1
            elif dist.any_rank(bad):
                optimizer.zero_grad(set_to_none=True)
                where = step.where.format(step=state.step + 1)
                what = (f"loss {float(step_loss * world)}" if loss_bad else f"gradient norm {float(norm)}" if bad
                        else "loss or gradient on another rank")
                bad_in_a_row += 1
                if not cfg.skip_nonfinite or bad_in_a_row > MAX_SKIPPED_IN_A_ROW:
                    kept = (f"the last good checkpoint {resolve(out / 'last')} is kept" if exists(out / "last")
                            else "no checkpoint had been written yet")
                    raise nonfinite_error(what, where, kept, bad_in_a_row, cfg.skip_nonfinite)
                state.skipped += 1
                tqdm.write(f"warning: skipped {where}: non-finite {what} ({state.skipped} skipped so far)")
            else:
                bad_in_a_row, stepped = 0, True
                if step_threads:
                    torch.set_num_threads(step_threads)
                scaler.step(optimizer)
                if step_threads:
                    torch.set_num_threads(1)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                dt = time.perf_counter() - t0
                for meter in (log_meter, eval_meter):
                    meter.add(loss=step_loss, steps=1, tokens=tokens, seconds=dt, **stats)
                session_s += dt
                state.wall_s += dt
                bench["seconds"] += dt
                bench["steps"] += 1
                bench["batches"] += len(step.micro)
                bench["tokens"] += tokens
                bar.update()
            state.epoch = step.epoch
            if not stepped and not step.ends_epoch:
                continue
            if cfg.max_steps and state.step >= cfg.max_steps:
                return _benchmark_report(bench, getattr(batches, "steps_per_epoch", 0))
            if stepped and cfg.log_interval and state.step % cfg.log_interval == 0:
                sums = log_meter.merged()
                log_meter.reset()
                if main:
                    record = {"kind": "train", "step": state.step, "epoch": _epoch(state.epoch),
                              "lr": scheduler.get_last_lr()[0], **_rates(sums), "wall_s": round(state.wall_s, 3)}
                    log.log(record)
                    bar.set_postfix(loss=f"{record['train_loss']:.4f}")
                    if cfg.print_logs:
                        tqdm.write(f"step {state.step:>6} | loss {record['train_loss']:.4f} | lr {record['lr']:.2e} | "
                                   f"{record['ms_per_step']:.1f} ms/step | {record['tokens_per_s']:,.0f} tok/s")
            due = step.ends_epoch or (cfg.eval_interval and state.step % cfg.eval_interval == 0) or done()
            if due and state.evaluated_at != state.step:
                evaluate()
                model.train()
            elif stepped and cfg.save_every and state.step % cfg.save_every == 0:
                save(None)
        if cfg.max_steps:  # the data ran out before max_steps
            return _benchmark_report(bench, getattr(batches, "steps_per_epoch", 0))
        if state.evaluated_at != state.step:  # the data ended between evaluations
            evaluate()
    finally:
        if bar is not None:
            bar.close()
        step_fn.close()
        torch.set_num_threads(threads)
        log.close()
    steps_run = state.step - start_step
    complete = ck is not None and steps_run == 0
    if complete and main:
        where = (f"step {state.step} of --max_iters {cfg.max_iters}; its checkpoint is {resolve(out / 'last')}. "
                 f"Raise --max_iters" if cfg.max_iters else
                 f"{_epoch(state.epoch)} of {cfg.epochs} epochs; its checkpoints are {out / 'best'} and "
                 f"{out / 'last'}. Raise --epochs")
        print(f"the run in {out} is already complete: {where} to train it further")
    seconds = max(session_s, 1e-9)
    return {"best": state.best, "history": state.history, "last_eval": state.last_eval, "step": state.step,
            "steps_run": steps_run, "skipped": state.skipped, "fp16_overflows": state.overflows,
            "complete": bool(complete), "ms_per_step": 1000 * session_s / max(steps_run, 1),
            "tokens_per_s": bench["tokens"] / seconds, "seconds": time.perf_counter() - t_start, "main": main}


def _epoch(epoch: float) -> int | float:
    """Epochs done, as an int at an epoch's end."""
    return int(round(epoch)) if abs(epoch - round(epoch)) < 1e-9 else round(epoch, 4)


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


def _benchmark_report(bench: dict, steps_per_epoch: int) -> dict:
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
