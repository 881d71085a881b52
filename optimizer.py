"""Hand-written AdamW, the weight-decay grouping rule and learning-rate schedules.

A training loop puts the pieces together like this:

    groups = param_groups_for_weight_decay(model, weight_decay=0.01)
    optimizer = AdamW(groups, lr=3e-4)
    scheduler = make_lr_scheduler(optimizer, warmup_steps=100, total_steps=10_000, min_ratio=0.1)
    for batch in loader:
        loss = model(...)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
"""

import functools
import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

__all__ = [
    "AdamW",
    "param_groups_for_weight_decay",
    "warmup_cosine",
    "warmup_linear",
    "make_lr_scheduler",
]


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019).

    For each parameter theta with gradient g_t at its t-th step (t = 1, 2, ...)::

        theta <- theta * (1 - lr * weight_decay)           # decoupled decay, applied first
        m_t    = beta1 * m_{t-1} + (1 - beta1) * g_t         # first moment  (state 'exp_avg')
        v_t    = beta2 * v_{t-1} + (1 - beta2) * g_t**2      # second moment (state 'exp_avg_sq')
        m_hat  = m_t / (1 - beta1**t)                        # bias correction, only if correct_bias
        v_hat  = v_t / (1 - beta2**t)
        theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)

    These are the operations of ``torch.optim.AdamW`` in the same order and rounding, so the two agree to the last
    bit on torch 2.13 (the tests ask for 1e-6). As in PyTorch and Hugging Face, and unlike the paper (which scales
    the decay by the schedule multiplier alone), the decay is multiplied by the current learning rate.
    With ``correct_bias=False`` the moments are used as they are (``m_hat = m_t``, ``v_hat = v_t``), which makes the
    first steps smaller because both moments start at zero.

    ``eps`` is added after the bias correction of ``v``, as in Kingma & Ba's Algorithm 1. The CS224N reference
    weights were made with the variant that adds it before (step size ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)``,
    denominator ``sqrt(v_t) + eps``); after that check's 1000 steps the two differ by 1.8e-5, inside its tolerance
    (atol 1e-6 + rtol 1e-4; 77% of it at the worst entry). No one ordering matches both exactly; we follow torch.

    Parameters are updated in their own dtype: bf16 parameters get bf16 moments and no fp32 master copy. For mixed
    precision keep fp32 parameters and run the forward pass under ``torch.autocast``.

    State per parameter: ``'step'`` (a float32 CPU scalar tensor, as torch keeps it), ``'exp_avg'``, ``'exp_avg_sq'``,
    so state dicts load into ``torch.optim.AdamW`` and back.

    Args:
        params: parameters or parameter groups (dicts with a ``'params'`` key and per-group overrides).
        lr: learning rate (>= 0).
        betas: decay rates of the two moment averages, each in [0, 1).
        eps: added to the denominator for numerical stability (>= 0). The course default 1e-6, not torch's 1e-8.
        weight_decay: decoupled decay coefficient (>= 0).
        correct_bias: divide the moments by ``1 - beta**t``.
        foreach: update all tensors of a (device, dtype) with multi-tensor ``torch._foreach_*`` kernels; ``False``
            runs the plain per-parameter loop (same numbers, easier to step through in a debugger).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        *,
        foreach: bool = True,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias,
                        foreach=foreach)
        super().__init__(params, defaults)  # calls add_param_group, which validates each group

    def __setstate__(self, state: dict) -> None:
        # Also reached by load_state_dict: groups saved by another optimizer (torch.optim.AdamW) lack our keys.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_hyperparameters(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Update every parameter that has a gradient; parameters whose ``.grad`` is None are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            _adamw_group_step(group, self.state)
        return loss


def _adamw_group_step(group: dict, state: dict) -> None:
    """One AdamW step of the parameters of `group` that have gradients (`state`: the optimizer's, by parameter).
    A function rather than a method so that MuonWithAdamW runs the same code on its AdamW groups."""
    params, grads, exp_avgs, exp_avg_sqs, steps = _adamw_gather(group, state)
    if not params:
        return
    beta1, beta2 = group["betas"]
    hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                 weight_decay=group["weight_decay"], correct_bias=group["correct_bias"])
    # Steps are CPU scalars (as in torch), so bump them one by one and hand the kernels plain Python ints.
    for step in steps:
        step.add_(1)
    update = _adamw_foreach if group["foreach"] else _adamw_loop
    update(params, grads, exp_avgs, exp_avg_sqs, [int(s.item()) for s in steps], **hyper)


def _adamw_gather(group: dict, state: dict):
    """Collect the tensors of one group that have gradients, creating their state on first sight."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients (use torch.optim.SparseAdam)")
        if torch.is_complex(p):
            raise RuntimeError("AdamW does not support complex parameters")
        s = state[p]
        if not s:
            s["step"] = torch.tensor(0.0)
            s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        steps.append(s["step"])
    return params, grads, exp_avgs, exp_avg_sqs, steps


def _check_hyperparameters(group: dict) -> None:
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    betas = group["betas"]
    if not lr >= 0.0:  # `not >=` also rejects NaN
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas} (need two values)")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta} (must be in [0, 1))")


def _bias_corrections(step: int, beta1: float, beta2: float, correct_bias: bool) -> tuple[float, float]:
    """(1 - beta1**t, sqrt(1 - beta2**t)), or (1, 1) without bias correction."""
    if not correct_bias:
        return 1.0, 1.0
    return 1 - beta1**step, (1 - beta2**step) ** 0.5


def _adamw_loop(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, correct_bias):
    """The update one parameter at a time: the docstring's equations, line for line."""
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)  # m = beta1 * m + (1 - beta1) * g
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1, bias_correction2_sqrt = _bias_corrections(t, beta1, beta2, correct_bias)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias_correction1)


# Bytes per tensor in a block of the multi-tensor update on CPU. Updating all tensors at once, as torch's foreach
# AdamW does, creates the temporary `denom` for the whole model (500 MB for GPT-2 small); the allocator returns such
# large buffers to the OS, so every step takes fresh zeroed pages again (120k page faults, 0.38 s of system time per
# step against 0.46 s of arithmetic, measured with one thread). Blocks of at most 16 MiB per tensor keep temporaries
# small enough for the allocator to recycle (glibc keeps up to 32 MiB in its heap), yet large enough that each op
# is still a few big multi-threaded kernels. Blocks are views and the arithmetic is elementwise: the numbers do not
# change.
BLOCK_BYTES = 16 << 20


def _adamw_foreach(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, correct_bias):
    """The same update as `_adamw_loop`, each line one multi-tensor kernel over a block of tensors."""
    for p, g, m, v, bias_correction1, bias_correction2_sqrt in _blocks(
        params, grads, exp_avgs, exp_avg_sqs, steps, beta1, beta2, correct_bias
    ):
        if weight_decay != 0:
            torch._foreach_mul_(p, 1 - lr * weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = torch._foreach_sqrt(v)
        if correct_bias:
            torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(p, m, denom, [-lr / bc1 for bc1 in bias_correction1])
        del denom


def _blocks(params, grads, exp_avgs, exp_avg_sqs, steps, beta1, beta2, correct_bias):
    """Yield lists (params, grads, exp_avgs, exp_avg_sqs, bias_correction1, bias_correction2_sqrt) that share a
    device and dtype. On CPU, contiguous tensors are cut into flat views and packed into blocks of at most
    BLOCK_BYTES per tensor; elsewhere each (device, dtype) is one block (GPU foreach kernels are already fused)."""
    by_device_dtype: dict[tuple, list] = {}
    for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        by_device_dtype.setdefault((p.device, p.dtype), []).append((p, g, m, v, t))

    for (device, dtype), members in by_device_dtype.items():
        limit = max(1, BLOCK_BYTES // dtype.itemsize) if device.type == "cpu" else math.inf  # in elements
        block, block_numel = [[], [], [], [], [], []], 0
        for p, g, m, v, t in members:
            corrections = _bias_corrections(t, beta1, beta2, correct_bias)
            tensors = (p, g, m, v)
            if p.numel() > limit and all(x.is_contiguous() for x in tensors):
                flat = [x.view(-1) for x in tensors]
                pieces = [[x[i : i + limit] for x in flat] for i in range(0, p.numel(), limit)]
            else:
                pieces = [tensors]
            for piece in pieces:
                if block_numel and block_numel + piece[0].numel() > limit:
                    yield block
                    block, block_numel = [[], [], [], [], [], []], 0
                for column, item in zip(block, (*piece, *corrections)):
                    column.append(item)
                block_numel += piece[0].numel()
        if block_numel:
            yield block


# ----------------------------------------------------------------------------------------------------------------
# Which parameters decay


def param_groups_for_weight_decay(model: nn.Module, weight_decay: float, decay_embeddings: bool = False) -> list[dict]:
    """Split a model's trainable parameters into a decaying and a non-decaying group.

    The rule: a parameter decays if it has two or more dimensions (the weight matrices of Linear layers, HF Conv1D,
    attention projections) and is not the weight of an ``nn.Embedding`` (unless ``decay_embeddings``). Biases,
    LayerNorm weights and other 1-D gains, and embeddings do not decay. A tied parameter (our GPT-2's LM head shares
    ``word_embedding.weight``) appears once; if any of its owners is an embedding, it counts as an embedding.
    Parameters with ``requires_grad=False`` are left out.

    Returns ``[{'params', 'param_names', 'weight_decay': weight_decay}, {... 'weight_decay': 0.0}]`` in the model's
    parameter order (both groups are always present, possibly empty); pass it to any torch optimizer.
    """
    embedding_types = (nn.Embedding, nn.EmbeddingBag)
    embedded: set[int] = set()  # ids of parameters owned by an embedding module
    if not decay_embeddings:
        for module in model.modules():
            if isinstance(module, embedding_types):
                embedded.update(id(p) for p in module.parameters(recurse=False))

    decay = {"params": [], "param_names": [], "weight_decay": weight_decay}
    no_decay = {"params": [], "param_names": [], "weight_decay": 0.0}
    for name, p in model.named_parameters():  # yields each shared tensor once, under its first name
        if not p.requires_grad:
            continue
        group = decay if p.ndim >= 2 and id(p) not in embedded else no_decay
        group["params"].append(p)
        group["param_names"].append(name)
    return [decay, no_decay]


# ----------------------------------------------------------------------------------------------------------------
# Learning-rate schedules: multipliers of the base learning rate, for torch.optim.lr_scheduler.LambdaLR.
# `step` counts optimizer steps from 0; the multiplier at `step` is used by the (step + 1)-th optimizer.step().


def _warmup_then(decay_shape: Callable[[float], float], step: int, warmup_steps: int, total_steps: int,
                 min_ratio: float) -> float:
    if warmup_steps < 0 or total_steps < warmup_steps:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps  # linear ramp that reaches 1 on the last warmup step, never 0
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / (total_steps - warmup_steps)  # 0 -> 1 over the decay phase
    return min_ratio + (1.0 - min_ratio) * decay_shape(progress)


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _linear(progress: float) -> float:
    return 1.0 - progress


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Linear warmup over `warmup_steps`, then half a cosine from 1 down to `min_ratio` at `total_steps`, then flat."""
    return _warmup_then(_cosine, step, warmup_steps, total_steps, min_ratio)


def warmup_linear(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Linear warmup over `warmup_steps`, then a straight line from 1 to `min_ratio` at `total_steps`, then flat."""
    return _warmup_then(_linear, step, warmup_steps, total_steps, min_ratio)


SCHEDULES = {"cosine": warmup_cosine, "linear": warmup_linear}


def make_lr_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.0,
                      schedule: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying ``warmup_cosine`` or ``warmup_linear``; call ``scheduler.step()`` after each optimizer step.

    When resuming, build the scheduler before loading the optimizer's state dict: LambdaLR's constructor sets the
    groups' learning rate to the step-0 value, and the loaded state then restores the saved one.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {sorted(SCHEDULES)}")
    multiplier = functools.partial(SCHEDULES[schedule], warmup_steps=warmup_steps, total_steps=total_steps,
                                   min_ratio=min_ratio)
    multiplier(0)  # validate the arguments now rather than on first use
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
