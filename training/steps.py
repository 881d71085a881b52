"""The decisions of one optimizer step and of an evaluation, as small functions the engine composes (and the tests
call directly): a micro-batch's weight, the gradient norm and clipping, the non-finite check, the update itself,
and whether an evaluation is the new best."""
from __future__ import annotations

import torch

from training.train_config import NonFiniteError

MAX_SKIPPED_IN_A_ROW = 20  # with skip_nonfinite: this many bad optimizer steps in a row means the run is broken


def improved(value: float, best: float | None, select_max: bool) -> bool:
    """Whether an evaluation's `value` beats `best` (None: no best yet). Strict: a tie keeps the earlier best."""
    return best is None or (value > best if select_max else value < best)


def micro_weight(part: float, whole: float, micro_batches: int, world: int = 1) -> float:
    """The factor on a micro-batch's mean loss: its share (`part` of the batch's `whole` rows or counted units)
    divided among the step's micro-batches, so one step's weights sum to 1 and its loss is the mean over its
    micro-batches, not their sum. Times `world` because DDP averages the ranks' gradients."""
    return world * part / max(whole, 1e-12) / micro_batches


def grad_norm(params: list[torch.nn.Parameter], max_norm: float = 0.0) -> torch.Tensor:
    """Total gradient norm before clipping, as a tensor (inf or nan if any gradient is); clips the gradients to
    max_norm when it is > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    # (torch's foreach default: its multi-tensor kernels on CPU and CUDA, a per-tensor loop on other devices)
    if max_norm:
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    return torch.nn.utils.get_total_norm(grads)


def nonfinite(step_loss: torch.Tensor, norm: torch.Tensor) -> tuple[bool, bool]:
    """(loss or gradient not finite, the loss itself not finite), with one read-back from the device when all is
    well. Each is checked on its own: a finite loss and norm whose sum overflows (two values above 1.7e38) are fine.
    (norm is 0-dim: on the CPU, as grad_norm's zero is, it combines with a loss on any device.)"""
    bad = not bool(torch.isfinite(step_loss) & torch.isfinite(norm))
    return bad, bad and not bool(torch.isfinite(step_loss))


def nonfinite_error(what: str, where: str, kept: str, bad_in_a_row: int, skipping: bool) -> NonFiniteError:
    advice = (f"{bad_in_a_row} bad steps in a row despite --skip_nonfinite: the run is diverging; " if skipping
              else "Pass --skip_nonfinite to skip such batches; ")
    return NonFiniteError(f"non-finite {what} at {where}: training stopped; {kept}. {advice}"
                          f"a lower --lr or --max_grad_norm may help")


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, scheduler,
                   threads: int | None = None) -> None:
    """The update (skipped by the scaler when fp16 overflowed), the scaler's and the schedule's step, then cleared
    gradients. threads: torch's threads for the update alone (the loop runs on one while it splits batches)."""
    if threads:
        torch.set_num_threads(threads)
    scaler.step(optimizer)
    if threads:
        torch.set_num_threads(1)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

