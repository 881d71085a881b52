"""What a batch source hands the engine (a Step of MicroBatches), the BatchSource protocol, and EpochBatches: a set
of examples in a seeded shuffle per epoch (fine-tuning). Pretraining's source is tasks/pretrain.py's RandomWindows."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import torch

from training import distributed as dist
from training.steps import micro_weight


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

    def epoch_order(self, epoch: int) -> list[int]:
        """The example indices of `epoch` (from 0) in the order they are trained."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return torch.randperm(self.n, generator=gen).tolist()

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._order is None or self._order[0] != epoch:
            order = self.epoch_order(epoch)
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
            micro.append(MicroBatch(batch, micro_weight(count, total, len(chosen), world), tokens))
        self.position += 1
        span = f"batch{'es' if len(chosen) > 1 else ''} {first + 1}" + (f"-{first + len(chosen)}" if len(chosen) > 1
                                                                        else "")
        return Step(micro, f"optimizer step {{step}} (epoch {epoch + 1}, {span} of {len(batches)})",
                    epoch + (group + 1) / self.steps_per_epoch, ends_epoch=group + 1 == self.steps_per_epoch)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
