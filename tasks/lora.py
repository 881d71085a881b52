"""LoRA in the task CLIs: the --lora_* flags and their checks (made while parsing, before any data is read),
adapters on a task model, and the merged checkpoint written at the end. What a LoRA run's checkpoints hold (the
adapter in PEFT's format plus the task head, optimizer and training state, never the frozen base, which --model
already names) is the engine's part: training/runfolder.py.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from torch import nn

from models.lora import (
    DEFAULT_TARGETS,
    TARGET_NAMES,
    apply_lora,
    body_of,
    check_hyperparameters,
    merge_lora,
    resolve_targets,
)
from training.checkpoint import save_checkpoint

DEFAULT_TARGETS_FLAG = ",".join(DEFAULT_TARGETS)
DEFAULT_LR = 2e-4  # the LoRA paper's for GPT-2 (E2E); --lr overrides


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA (the body's weights stay frozen; adapters and the task head train)")
    g.add_argument("--lora_rank", type=int, default=0,
                   help=f"> 0: train LoRA adapters of this rank instead of the whole body (0: off); the default "
                        f"--lr is then {DEFAULT_LR:g}")
    g.add_argument("--lora_alpha", type=float, default=None,
                   help="adapter updates are scaled by alpha / rank (default: 2 x rank)")
    g.add_argument("--lora_dropout", type=float, default=0.0, help="dropout on the adapters' input, in [0, 1)")
    g.add_argument("--lora_targets", default=DEFAULT_TARGETS_FLAG,
                   help=f"comma-separated layers to adapt in every block, PEFT's names or ours: {', '.join(TARGET_NAMES)}")
    g.add_argument("--merge_lora", action="store_true",
                   help="at the end also write OUTPUT_DIR/merged: the best adapter merged into the base, as a whole "
                        "HF checkpoint (the task head beside it, as in full fine-tuning checkpoints)")


def check_lora_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuse bad or contradictory LoRA flags with parser.error, naming the problem; fill in the default alpha."""
    try:
        _check(args)
    except ValueError as e:
        parser.error(str(e))


def _check(args) -> None:
    if not args.lora_rank:
        given = [f for f, on in (("--merge_lora", args.merge_lora), ("--lora_alpha", args.lora_alpha is not None),
                                 ("--lora_dropout", args.lora_dropout != 0.0),
                                 ("--lora_targets", args.lora_targets != DEFAULT_TARGETS_FLAG)) if on]
        if given:
            raise ValueError(f"{', '.join(given)} without --lora_rank: give the adapters a rank (e.g. --lora_rank 8)")
        return
    args.lora_alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    if getattr(args, "lr", 0) is None:  # the tasks' defaults (1e-5) suit full fine-tuning; adapters start at 0
        args.lr = DEFAULT_LR
    check_hyperparameters(args.lora_rank, args.lora_alpha, args.lora_dropout)
    resolve_targets(args.lora_targets)
    if getattr(args, "fine_tune_mode", None) == "last-linear-layer":
        raise ValueError("--fine-tune-mode last-linear-layer keeps the whole body frozen and trains only the output "
                         "layer, so LoRA adapters in the body would never learn; a LoRA run trains the adapters and "
                         "the head with the base frozen: drop --fine-tune-mode (or use full-model) with --lora_rank")
    if getattr(args, "generate_only", False) or getattr(args, "baseline", None):
        raise ValueError("--lora_rank trains adapters; --generate_only and --baseline do not train (generate with "
                         "a merged checkpoint: --model OUTPUT_DIR/merged from a --merge_lora run)")


def apply_from_args(model: nn.Module, args) -> None:
    """Add the adapters the flags ask for to the task model's body (frozen); the task head is left trainable."""
    if not args.lora_rank:
        return
    apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets,
               dropout=args.lora_dropout, base_model=args.model)
    print(f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha:g}, dropout {args.lora_dropout:g} on "
          f"{', '.join(resolve_targets(args.lora_targets))}; the body's base weights are frozen")


def run_info(args) -> dict:
    """The LoRA settings a resumed run must share (nothing for full fine-tuning, so older runs still resume)."""
    if not args.lora_rank:
        return {}
    return {"lora": {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                     "targets": list(resolve_targets(args.lora_targets))}}


def write_merged(model: nn.Module, folder: str | Path, tokenizer=None) -> Path:
    """Merge the adapters into the base weights (in place: call at the end of a run) and write a whole checkpoint:
    the body in HF format, which transformers loads, and the task head as extra tensors, like full fine-tuning's."""
    body = body_of(model)
    merge_lora(model)
    prefix = next(name for name, m in model.named_modules() if m is body)
    head = {k: v for k, v in model.state_dict().items() if not (prefix and k.startswith(prefix + "."))} if prefix else {}
    folder = save_checkpoint(folder, body, extra_tensors=head, tokenizer=tokenizer,
                             state={"merged_lora_from": getattr(body, "lora_base_model", None)})
    print(f"wrote {folder}: the adapter merged into the base (a whole HF checkpoint)")
    return folder
