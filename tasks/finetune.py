"""Fine-tuning on a set of examples (the classifier, paraphrase and sonnet tasks), on the engine, and the pieces every
task CLI needs (model spec, device, the shared flags).

A task supplies the model, a way to make batches, a loss and an evaluation:

    result = train(model, n_train, make_batch=lambda idx: collate([train[i] for i in idx], pad_id),
                   loss_fn=lambda model, batch: F.cross_entropy(model(...), batch["labels"]),
                   evaluate_fn=lambda model: {"acc": ...}, cfg=TrainConfig(...), run_info={...})

Per epoch a seeded shuffle cut into batches (training/batches.py's EpochBatches), an evaluation at each epoch's end with
one summary line, OUT/best when the selected dev metric improves; everything else (the step, checkpoints and exact
resume, the non-finite guard, DDP, metrics.jsonl and curves.png) is the engine's (training/engine.py).
"""
from __future__ import annotations

import argparse
import math
import random
import shlex
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from config import PRESETS, GPT2Config
from models.gpt2 import GPT2Model
from models.loading import load_pretrained
from tasks.lora import DEFAULT_TARGETS_FLAG
from training import distributed as dist
from training.engine import DTYPES, EpochBatches, NonFiniteError, TrainConfig, autocast, fit


@dataclass
class FineTuneConfig:
    """The flags every task CLI shares (model, training, LoRA) as a dataclass: the Python API of the tasks
    (`tasks.classifier.run(ClassifierConfig(task="sst", ...))`). Each field means what the flag of the same name does;
    the task configs below add their own, and tests/test_task_cli.py holds the fields and the CLIs' flags equal."""
    # model
    model_size: str = "gpt2"
    model: str | None = None  # hub id, HF folder, weights file or random:k=v,... (default: model_size)
    hidden_dropout_prob: float | None = None
    # training
    epochs: int = 10
    batch_size: int = 8
    lr: float | None = None  # None: the task's default
    weight_decay: float = 0.0
    grad_accum: int = 1
    schedule: str = "constant"
    warmup_ratio: float = 0.0
    max_grad_norm: float = 0.0
    dtype: str | None = None  # float32, bfloat16 or float16 (None: float32, or what bf16 / fp16 say)
    bf16: bool = False
    fp16: bool = False
    seed: int = 11711
    device: str | None = None  # None: cpu, or cuda with use_gpu
    use_gpu: bool = False
    threads: int = 0
    output_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    save_every: int = 0
    log_interval: int = 50
    tensorboard: bool = False
    max_steps: int = 0
    eval_batch_size: int = 32
    skip_nonfinite: bool = False
    gradient_checkpointing: bool = False
    compile: bool = False
    # LoRA
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: str = DEFAULT_TARGETS_FLAG
    merge_lora: bool = False
    expect: dict | None = field(default=None, repr=False)  # set by start(): the --model_size dimensions to check


def train(model: nn.Module, n_train: int, make_batch: Callable[[list[int]], dict], loss_fn: Callable,
          evaluate_fn: Callable[[nn.Module], dict], cfg: TrainConfig, run_info: dict, tokenizer=None,
          count_fn: Callable[[dict], float] | None = None) -> dict:
    """Train for cfg.epochs over n_train examples and keep OUT/{last,best}. make_batch(indices) -> dict of tensors
    (with 'attention_mask' to count tokens); loss_fn(model, batch) -> loss, or (loss, {name: summed stat}) such as
    {'correct', 'count'}; evaluate_fn(model) -> {metric: value} including cfg.select_metric. count_fn(batch): what
    loss_fn averages over (default: the batch's examples; e.g. its target tokens), so that under torchrun the ranks'
    slices weigh as they would in one process. Returns the engine's summary: best metrics and history (on rank 0)."""
    batches = EpochBatches(n_train, cfg.batch_size, cfg.grad_accum, cfg.epochs, cfg.seed, make_batch, cfg.device,
                           count_fn)
    return fit(model, batches, loss_fn, evaluate_fn, cfg, run_info, tokenizer=tokenizer)


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
    use_gpu = args.use_gpu or str(args.device or "").startswith("cuda")
    dist.init(args.threads, "cuda" if use_gpu and torch.cuda.is_available() else "cpu")
    return pick_device(use_gpu, args.threads)


def pick_device(use_gpu: bool, threads: int = 0) -> torch.device:
    if threads:
        torch.set_num_threads(threads)
    device = dist.device(use_gpu)  # cuda:LOCAL_RANK under torchrun
    if device.type == "cpu":
        print("CUDA is not available: running on CPU" if use_gpu else "running on CPU")
    return device


def resolve_dtype(args) -> str:
    """--dtype, or the course-style --bf16 / --fp16 switches (which then set args.dtype); conflicting ones are an
    error naming them."""
    asked = [d for d, on in (("bfloat16", args.bf16), ("float16", getattr(args, "fp16", False))) if on]
    if len(asked) > 1:
        raise ValueError("--bf16 and --fp16 exclude each other: pick one")
    if asked and args.dtype not in (None, asked[0]):
        raise ValueError(f"--dtype {args.dtype} and --{'bf16' if asked[0] == 'bfloat16' else 'fp16'} disagree: "
                         f"pick one")
    args.dtype = args.dtype or (asked[0] if asked else "float32")
    args.bf16, args.fp16 = args.dtype == "bfloat16", args.dtype == "float16"
    return args.dtype


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


def offline_recipe(script: str, build_parser: Callable[[], argparse.ArgumentParser], argv: list[str],
                   recipe: list[tuple[str, ...]]) -> str:
    """The command a task CLI suggests when its hub model cannot be had: the user's own command (argv) with its
    --model / --model_size replaced by the recipe's --model, and each other group of recipe flags added where the
    user set none of the settings it sets, so every flag the user gave (--task, --lora_rank, --epochs...) is kept."""
    user = _given(build_parser, argv)
    kept, args = [], iter(argv)
    for arg in args:
        if arg in ("--model", "--model_size"):
            next(args, None)  # its value
        elif not arg.startswith(("--model=", "--model_size=")):
            kept.append(arg)
    added = [arg for group in recipe if group[0] == "--model" or not _given(build_parser, list(group)) & user
             for arg in group]
    return shlex.join(["python", script, *kept, *added])


def _given(build_parser: Callable[[], argparse.ArgumentParser], argv: list[str]) -> set[str]:
    """The settings (argparse dests) that argv sets: parsed again with every default suppressed."""
    parser = build_parser()
    for action in parser._actions:  # (set_defaults would put the SUPPRESS string itself into the namespace)
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def add_training_args(parser: argparse.ArgumentParser, epochs: int, batch_size: int, lr_help: str) -> None:
    """The flags every task CLI shares (the course's names where the course has them)."""
    g = parser.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=epochs, help=f"passes over the training data (course: {epochs})")
    g.add_argument("--batch_size", type=int, default=batch_size, help=f"examples per micro-batch (course: {batch_size})")
    g.add_argument("--lr", "--learning_rate", dest="lr", type=float, default=None, help=lr_help)
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW decoupled weight decay (course: 0)")
    g.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--schedule", choices=("constant", "linear", "cosine"), default="constant",
                   help="learning-rate decay after warmup (course: constant)")
    g.add_argument("--warmup_ratio", type=float, default=0.0, help="fraction of optimizer steps spent warming up")
    g.add_argument("--max_grad_norm", "--grad_clip", dest="max_grad_norm", type=float, default=0.0,
                   help="clip gradients to this norm (0: no clipping)")
    add_precision_args(g)
    g.add_argument("--seed", type=int, default=11711, help="seed of initialisation, shuffling and dropout")
    add_device_args(g, default=None)
    g.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's count for evaluation, and for training steps that count or "
                        "fewer, chosen by timing the steps: a busy core makes fewer faster; N: exactly N, and a run "
                        "that repeats to the last digit)")
    g.add_argument("--output_dir", "--out_dir", dest="output_dir", default=None,
                   help="run folder: checkpoints last/ and best/ (HF format + state), metrics.jsonl, curves.png")
    g.add_argument("--resume", action="store_true", help="continue the interrupted run in --output_dir exactly")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if --output_dir has a checkpoint")
    g.add_argument("--save_every", type=int, default=0, help="also checkpoint every N optimizer steps (0: epoch ends)")
    g.add_argument("--log_interval", type=int, default=50, help="a metrics.jsonl record every N optimizer steps")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to OUTPUT_DIR/tensorboard")
    g.add_argument("--max_steps", type=int, default=0,
                   help="benchmark: stop after N optimizer steps, print throughput and exit (no eval, no files)")
    g.add_argument("--eval_batch_size", type=int, default=32, help="batch size for dev/test prediction")
    g.add_argument("--skip_nonfinite", action="store_true", help="skip (and count) optimizer steps whose loss or "
                   "gradient is not finite, instead of stopping the run there")
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward: "
                   "less memory for longer sequences or bigger batches, about 15%% more time per step")
    g.add_argument("--compile", action="store_true", help="torch.compile the training forward and loss (the first "
                   "steps compile; on CPUs it needs a C++ compiler)")


def add_precision_args(g) -> None:
    """--dtype, and the switches --bf16 / --fp16 that name the same choices (the course's style)."""
    g.add_argument("--dtype", choices=DTYPES, default=None, help="autocast for training and evaluation (default "
                   "float32: none); parameters and optimizer stay fp32. bfloat16 is fast on GPUs and CPUs with "
                   "AVX512-BF16/AMX, much slower on AVX2-only CPUs; float16 adds a gradient scaler (overflowing "
                   "steps are skipped and counted). bf16-weights: no autocast, the model's weights themselves in "
                   "bf16 with fp32 master copies and moments in AdamW (no per-step casts; faster than bfloat16 on "
                   "CPUs with bf16 units; checkpoints are saved in bf16, the masters in the optimizer state)")
    g.add_argument("--bf16", action="store_true", help="the same as --dtype bfloat16")
    g.add_argument("--fp16", action="store_true", help="the same as --dtype float16 (GPUs without bf16)")


def add_device_args(g, default: str | None) -> None:
    g.add_argument("--device", default=default, help="torch device: cpu, cuda, cuda:1 (default: cpu, or cuda with "
                                                     "--use_gpu)")
    g.add_argument("--use_gpu", action="store_true", help="use CUDA if available (the course's flag)")


def train_config(args, output_dir: str, lr: float, device: torch.device) -> TrainConfig:
    for name in ("epochs", "batch_size", "grad_accum", "eval_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    return TrainConfig(output_dir=output_dir, epochs=args.epochs, batch_size=args.batch_size, lr=lr,
                       weight_decay=args.weight_decay, grad_accum=args.grad_accum, schedule=args.schedule,
                       warmup_ratio=args.warmup_ratio, max_grad_norm=args.max_grad_norm, dtype=resolve_dtype(args),
                       log_interval=args.log_interval, tensorboard=args.tensorboard,
                       seed=args.seed, device=str(device), resume=args.resume, overwrite=args.overwrite,
                       save_every=args.save_every, max_steps=args.max_steps,
                       skip_nonfinite=getattr(args, "skip_nonfinite", False),
                       gradient_checkpointing=args.gradient_checkpointing, compile=args.compile,
                       threads=getattr(args, "threads", 0))


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
