"""Forward and backward of one micro-batch, optionally cut row-wise across the CPU threads (split_batch)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from training import distributed as dist
from training.batches import MicroBatch
from training.train_config import TrainConfig


class LossOf(nn.Module):
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


class Backward:
    """Forward and backward of one micro-batch, optionally cut row-wise across `workers` threads that use one core
    each. Torch's intra-op threads synchronise at every operation, which on a small model costs more than the work
    they share (docs/performance.md, "Figures behind the code"); slices of a batch need no synchronisation
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

    def accumulate(self, micro: list[MicroBatch], scale: Callable[[torch.Tensor], torch.Tensor],
                   device: torch.device) -> tuple[torch.Tensor, dict, int]:
        """Backward of every micro-batch of one optimizer step, DDP all-reducing after the last only ->
        (the step's loss: summed over ranks it is the global batch's mean, its stats summed, real tokens)."""
        step_loss, stats, tokens = torch.zeros((), device=device), {}, 0
        world, last = dist.world_size(), len(micro) - 1
        for i, mb in enumerate(micro):
            with dist.no_sync(self.trainer, i < last):
                weighted, s = self(mb, scale)
            if mb.weight:  # a rank's empty slice of a short last batch adds nothing
                step_loss += weighted / world
                tokens += mb.tokens
                for k, v in s.items():
                    stats[k] = stats.get(k, 0) + v
        return step_loss, stats, tokens

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


def set_gradient_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn activation recomputation on or off in every module of `model` that has the switch (GPT2Model)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = enabled
