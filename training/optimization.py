"""The optimizer and learning-rate schedule a TrainConfig asks for."""
from __future__ import annotations

import torch
from torch import nn

from optimizer import AdamW, MuonWithAdamW, make_lr_scheduler, muon_param_groups, param_groups_for_weight_decay
from training import distributed as dist
from training.precision import bf16_matmul_is_fast
from training.train_config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, groups: list | None = None) -> torch.optim.Optimizer:
    """cfg.optimizer's optimizer over `groups` (default: the model's parameters split by the optimizer's rule)."""
    if cfg.optimizer == "adamw":
        groups = groups or param_groups_for_weight_decay(model, cfg.weight_decay, cfg.decay_embeddings)
        # on the CPU, each step in one pass over memory (modules/adamw.cpp); the moments equal torch's to the bit
        # bf16-weights: fp32 master copies and moments of the bf16 parameters, updated with them in the same pass
        return AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=torch.device(cfg.device).type == "cpu",
                     master_weights=cfg.bf16_weights)
    if cfg.optimizer == "muon":
        if cfg.bf16_weights:
            raise ValueError("--dtype bf16-weights keeps fp32 master weights in AdamW only: use --optimizer adamw, or "
                             "--dtype bfloat16 (autocast) with Muon")
        groups = groups or muon_param_groups(model, cfg.weight_decay, decay_embeddings=cfg.decay_embeddings)
        # torch.optim.Muon's Newton-Schulz runs in bf16, far slower than fp32 on CPUs without bf16 units
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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total: int):
    """Warmup (warmup_steps, or warmup_ratio of the `total` optimizer steps), then constant, or a linear or cosine
    decay to min_lr at decay_steps (default: the end of the run)."""
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total)
    return make_lr_scheduler(optimizer, warmup, cfg.decay_steps or total,
                             min_ratio=1.0 if cfg.schedule == "constant" else cfg.min_lr / cfg.lr,
                             schedule="linear" if cfg.schedule == "constant" else cfg.schedule)
