"""Hand-written AdamW and Muon, the rules that group a model's parameters for them, and learning-rate schedules.

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

Muon for the transformer blocks' matrices and AdamW for the rest, as one optimizer the same loop drives:

    groups = muon_param_groups(model, weight_decay=0.1)
    optimizer = MuonWithAdamW(groups, lr=3e-4, muon_lr=0.02)
"""

import functools
import math
import sys
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

__all__ = [
    "AdamW",
    "Muon",
    "MuonWithAdamW",
    "muon_param_groups",
    "orthogonalize",
    "param_groups_for_weight_decay",
    "warmup_cosine",
    "warmup_linear",
    "make_lr_scheduler",
]


def _without_dynamo_import(name: str):
    """torch.optim.Optimizer's method `name`, called without its ``torch._disable_dynamo`` wrapper while
    ``torch._dynamo`` is not imported. The wrapper's only job is to keep torch.compile from tracing the method, and its
    first call imports torch._dynamo to say so: 2 s of CPU in every process that builds an optimizer (a quarter of a
    small training run's start on an Ice Lake Xeon). Nothing can be tracing while the compiler is not loaded; once it
    is, the wrapped method is called as torch defines it."""

    @functools.wraps(getattr(torch.optim.Optimizer, name))
    def method(self, *args, **kwargs):
        wrapped = getattr(torch.optim.Optimizer, name)
        plain = wrapped if "torch._dynamo" in sys.modules else getattr(wrapped, "__wrapped__", wrapped)
        return plain(self, *args, **kwargs)
    return method


class _GroupwiseOptimizer(torch.optim.Optimizer):
    """What AdamW, Muon and MuonWithAdamW share: each parameter group is checked when it is added, takes the
    defaults it lacks when a state dict is loaded (groups saved by torch.optim.AdamW or torch.optim.Muon lack our
    keys, such as ``foreach`` or ``ns_dtype``), and steps with its own kind's update."""

    zero_grad = _without_dynamo_import("zero_grad")
    state_dict = _without_dynamo_import("state_dict")
    load_state_dict = _without_dynamo_import("load_state_dict")
    _add_param_group = _without_dynamo_import("add_param_group")

    def group_defaults(self, group: dict) -> dict:
        return self.defaults

    def check_group(self, group: dict) -> None:
        raise NotImplementedError

    def group_step(self, group: dict) -> None:
        raise NotImplementedError

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # also reached by load_state_dict
        for group in self.param_groups:
            for key, value in self.group_defaults(group).items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict) -> None:
        self._add_param_group(param_group)
        self.check_group(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """Update every parameter that has a gradient; parameters whose ``.grad`` is None are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self.group_step(group)
        return loss


class AdamW(_GroupwiseOptimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019).

    For each parameter theta with gradient g_t at its t-th step (t = 1, 2, ...)::

        theta <- theta * (1 - lr * weight_decay)           # decoupled decay, applied first
        m_t    = beta1 * m_{t-1} + (1 - beta1) * g_t         # first moment  (state 'exp_avg')
        v_t    = beta2 * v_{t-1} + (1 - beta2) * g_t**2      # second moment (state 'exp_avg_sq')
        m_hat  = m_t / (1 - beta1**t)                        # bias correction, only if correct_bias
        v_hat  = v_t / (1 - beta2**t)
        theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)

    These are the operations of ``torch.optim.AdamW`` in the same order and rounding, so the two agree to the last
    bit on torch 2.13 (the tests ask for equality: tests/tolerances.py). As in PyTorch and Hugging Face, and unlike
    the paper (which scales the decay by the schedule multiplier alone), the decay is multiplied by the current
    learning rate.
    With ``correct_bias=False`` the moments are used as they are (``m_hat = m_t``, ``v_hat = v_t``), which makes the
    first steps smaller because both moments start at zero.

    ``eps`` is added after the bias correction of ``v``, as in Kingma & Ba's Algorithm 1. The CS224N reference
    weights were made with the variant that adds it before (step size ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)``,
    denominator ``sqrt(v_t) + eps``); after that check's 1000 steps the two differ by 1.8e-5, inside its tolerance
    (atol 1e-6 + rtol 1e-4; 77% of it at the worst entry). No one ordering matches both exactly; we follow torch.

    Parameters are updated in their own dtype by default, as torch's: bf16 parameters get bf16 moments and no fp32
    master copy, so updates smaller than a bf16 rounding step are lost. ``master_weights=True`` keeps an fp32 copy of
    each bf16 or fp16 parameter (state ``'master'``) with fp32 moments: the update is the one above applied to the
    master with the gradient widened to fp32, and the parameter is then the master rounded to its dtype. That is
    bf16 training without autocast (the forward and backward run on the bf16 weights, with no per-step casts).

    State per parameter: ``'step'`` (a float32 CPU scalar tensor, as torch keeps it), ``'exp_avg'``, ``'exp_avg_sq'``,
    so state dicts load into ``torch.optim.AdamW`` and back.

    Args:
        params: parameters or parameter groups (dicts with a ``'params'`` key and per-group overrides).
        lr: learning rate (>= 0).
        betas: decay rates of the two moment averages, each in [0, 1).
        eps: added to the denominator for numerical stability (>= 0). The course default 1e-6, not torch's 1e-8.
        weight_decay: decoupled decay coefficient (>= 0).
        correct_bias: divide the moments by ``1 - beta**t``.
        master_weights: fp32 master copies (and fp32 moments) for bf16 and fp16 parameters, see above; fp32
            parameters are unaffected. Its state dicts load into ``torch.optim.AdamW`` only without masters.
        foreach: update all tensors of a (device, dtype) with multi-tensor ``torch._foreach_*`` kernels; ``False``
            runs the plain per-parameter loop (same numbers, easier to step through in a debugger).
        fused: update each contiguous fp32 CPU parameter in one pass over memory with the C++ kernel
            ``modules/adamw.cpp`` (built on first use like the decoding kernel; 2-4x faster on gpt2, whose step is
            bound by memory traffic). The same operations in the same order, but not always the same rounding as
            torch's vectorised kernels: parameters agree with torch's to a few float32 ulps (tests/tolerances.py,
            ADAMW_FUSED_VS_TORCH), not to the bit. Other tensors (bf16, GPU, non-contiguous) and machines where the
            kernel cannot be built take the ``foreach`` path. ``GPT2_FUSED_ADAMW=0`` turns the kernel off. With
            ``master_weights`` a bf16 parameter's step (master, moments, and the rounding back to bf16) is one
            pass too.
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
        fused: bool = False,
        master_weights: bool = False,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias,
                        foreach=foreach, fused=fused, master_weights=master_weights)
        super().__init__(params, defaults)  # calls add_param_group, which validates each group

    def check_group(self, group: dict) -> None:
        _check_hyperparameters(group)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state tensor to its parameter's dtype, which would round the fp32
        masters and moments of bf16 parameters to bf16: those are put back from `state_dict` in fp32."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for param_id, p in zip(saved_group["params"], group["params"]):
                if _keeps_master(group, p) and param_id in saved:
                    for key in _MASTER_STATE:
                        if key in saved[param_id]:
                            self.state[p][key] = saved[param_id][key].to(device=p.device, dtype=torch.float32,
                                                                         copy=True)

    def group_step(self, group: dict) -> None:
        _adamw_group_step(group, self.state)


_LOW_PRECISION = (torch.bfloat16, torch.float16)  # the parameter dtypes master_weights keeps an fp32 copy of
_MASTER_STATE = ("master", "exp_avg", "exp_avg_sq")


def _keeps_master(group: dict, p: Tensor) -> bool:
    """Whether `group` keeps an fp32 master copy (and fp32 moments) of parameter p."""
    return bool(group.get("master_weights")) and p.dtype in _LOW_PRECISION


def _adamw_group_step(group: dict, state: dict) -> None:
    """One AdamW step of the parameters of `group` that have gradients (`state`: the optimizer's, by parameter).
    A function rather than a method so that MuonWithAdamW runs the same code on its AdamW groups."""
    params, grads, exp_avgs, exp_avg_sqs, steps, lows = _adamw_gather(group, state)
    if not params:
        return
    beta1, beta2 = group["betas"]
    hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                 weight_decay=group["weight_decay"], correct_bias=group["correct_bias"])
    # Steps are CPU scalars (as in torch), so bump them one by one and hand the kernels plain Python ints.
    for step in steps:
        step.add_(1)
    counts = [int(s.item()) for s in steps]
    if group.get("fused"):  # None in groups saved by torch.optim.AdamW: not fused
        params, grads, exp_avgs, exp_avg_sqs, counts, lows = _adamw_fused(params, grads, exp_avgs, exp_avg_sqs,
                                                                          counts, lows, **hyper)
        if not params:
            return
    grads = [g if low is None else g.float() for g, low in zip(grads, lows)]  # masters step on fp32 gradients
    update = _adamw_foreach if group["foreach"] else _adamw_loop
    update(params, grads, exp_avgs, exp_avg_sqs, counts, **hyper)
    for master, low in zip(params, lows):
        if low is not None:
            low.copy_(master)


def _adamw_fused(params, grads, exp_avgs, exp_avg_sqs, steps, lows, *, lr, beta1, beta2, eps, weight_decay,
                 correct_bias):
    """Update the tensors the fused kernel takes (modules/adamw.py); return the lists of those it left."""
    from modules import adamw as fused_kernel  # here, so that optimizer.py alone needs only torch

    if not fused_kernel.available():
        return params, grads, exp_avgs, exp_avg_sqs, steps, lows
    left = [], [], [], [], [], []
    for p, g, m, v, t, low in zip(params, grads, exp_avgs, exp_avg_sqs, steps, lows):
        corrections = _bias_corrections(t, beta1, beta2, correct_bias)
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     bias_correction1=corrections[0], bias_correction2_sqrt=corrections[1])
        if low is None and fused_kernel.applies(p, g, m, v):
            fused_kernel.step(p, g, m, v, **hyper)
        elif low is not None and fused_kernel.applies_master(p, low, g, m, v):
            fused_kernel.step_master(p, low, g, m, v, **hyper)
        else:
            for column, item in zip(left, (p, g, m, v, t, low)):
                column.append(item)
    return left


def _adamw_gather(group: dict, state: dict):
    """Collect the tensors of one group that have gradients, creating their state on first sight. Where the group
    keeps masters, params holds a parameter's fp32 master and lows the parameter itself (else None)."""
    params, grads, exp_avgs, exp_avg_sqs, steps, lows = [], [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients (use torch.optim.SparseAdam)")
        if torch.is_complex(p):
            raise RuntimeError("AdamW does not support complex parameters")
        s = state[p]
        master = _keeps_master(group, p)
        if not s:
            s["step"] = torch.tensor(0.0)
            dtype = torch.float32 if master else p.dtype
            s["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if master and "master" not in s:  # first step, or state saved without masters: start from the parameter
            s["master"] = p.detach().float()
            s["exp_avg"], s["exp_avg_sq"] = s["exp_avg"].float(), s["exp_avg_sq"].float()
        params.append(s["master"] if master else p)
        lows.append(p if master else None)
        grads.append(p.grad)
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        steps.append(s["step"])
    return params, grads, exp_avgs, exp_avg_sqs, steps, lows


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
# AdamW does, creates the temporary `denom` for the whole model; the allocator returns such large buffers to the OS,
# so every step takes fresh zeroed pages again, a cost close to the arithmetic's (docs/performance.md, "Figures behind
# the code"). Blocks of at most 16 MiB per tensor keep temporaries small enough for the allocator to recycle (glibc
# keeps up to 32 MiB in its heap), yet large enough that each op is still a few big multi-threaded kernels. Blocks
# are views and the arithmetic is elementwise: the numbers do not change.
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
# Muon: orthogonalised momentum for the hidden matrices; AdamW for everything else


# torch.optim.Muon's defaults, from Keller Jordan's Muon (https://kellerjordan.github.io/posts/muon/).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # a, b, c of the quintic a*x + b*x^3 + c*x^5 applied to singular values
NS_EPS = 1e-7  # floor of the Frobenius norm the update is divided by (a zero update stays zero, not NaN)
NS_STEPS = 5
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def orthogonalize(update: Tensor, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  ns_steps: int = NS_STEPS, eps: float = NS_EPS, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Newton-Schulz iteration towards U V^T, where U S V^T = update (the nearest semi-orthogonal matrix).

    Each step maps X -> a X + b (X X^T) X + c (X X^T)^2 X, which applies p(s) = a s + b s^3 + c s^5 to every
    singular value s and leaves U and V alone. Dividing by the Frobenius norm first puts every s in [0, 1]. The
    coefficients are tuned for speed, not convergence: five steps push every s of a well-conditioned matrix into
    about [0.7, 1.15] (bf16 rounding widens that a little) rather than to 1, which trains as well as the exact
    U V^T (Jordan's post). Returns a matrix of `dtype`, the dtype the iteration runs in: bf16 in torch.optim.Muon,
    fast on GPUs but far slower than fp32 on CPUs without bf16 units.
    """
    a, b, c = ns_coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # iterate on the wide orientation: the Gram matrix X X^T is then the smaller square
    # Out of place: `update.to(dtype)` returns `update` itself when the dtypes agree, and that may be the momentum
    # buffer (nesterov=False), which an in-place division would corrupt.
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T  # (m, m), m = the shorter side
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's step size for a (rows, cols) matrix. The orthogonalised update has singular values near 1, so the RMS
    of its entries is about 1 / sqrt(max(rows, cols)), whatever the gradient's scale; the adjustment sets it:

    - "original" (or None, Jordan's): lr * sqrt(max(1, rows / cols)), an RMS of about 1 / sqrt(cols) for an
      nn.Linear weight (out, in): the same for every matrix of a given fan-in, tall or wide.
    - "match_rms_adamw" (Moonshot, "Muon is Scalable for LLM Training"): lr * 0.2 * sqrt(max(rows, cols)), an RMS
      of 0.2 * lr, about that of an AdamW update, so learning rate and weight decay tuned for AdamW carry over.
    """
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    raise ValueError(f"Invalid adjust_lr_fn: {adjust_lr_fn!r} (choose from None, {', '.join(map(repr, ADJUST_LR_FNS))})")


class Muon(_GroupwiseOptimizer):
    """Muon (MomentUm Orthogonalized by Newton-Schulz; Jordan et al. 2024) for 2-D parameters.

    For each matrix theta (rows, cols) with gradient g_t::

        B_t     = momentum * B_{t-1} + (1 - momentum) * g_t          # state 'momentum_buffer', starts at 0
        U_t     = (1 - momentum) * g_t + momentum * B_t               # Nesterov; without it U_t = B_t
        O_t     = orthogonalize(U_t)                                  # Newton-Schulz, ~ the nearest U V^T
        theta  <- theta * (1 - lr * weight_decay)                     # decoupled decay, with the unadjusted lr
        theta  <- theta - adjusted_lr(lr, adjust_lr_fn, shape) * O_t

    torch's docstring writes the momentum as a sum (B_t = momentum * B_{t-1} + g_t, U_t = g_t + momentum * B_t);
    its code, and this class, keep the average above, which is the same up to the factor 1 - momentum that the
    orthogonalisation divides away (except within eps of zero). These are the operations of ``torch.optim.Muon`` in
    the same order and dtypes, so the two agree to the last bit on torch 2.13 (the tests ask for equality: tests/tolerances.py), and state
    dicts load into each other.

    Muon is for the hidden layers' matrices: embeddings, the output head, gains and biases belong to AdamW
    (``muon_param_groups`` splits a model so, ``MuonWithAdamW`` runs both as one optimizer). A parameter that is not
    2-D is refused when it is added.

    Args (names and defaults of torch.optim.Muon):
        params: 2-D parameters, named parameters, or parameter groups (dicts with a ``'params'`` key and overrides).
        lr: learning rate (>= 0); the adjusted step size is ``adjusted_lr(lr, adjust_lr_fn, shape)``.
        weight_decay: decoupled decay coefficient (>= 0), multiplied by the current (unadjusted) lr.
        momentum: the momentum average's decay, in [0, 1).
        nesterov: orthogonalise the Nesterov look-ahead mix of gradient and momentum rather than the momentum.
        ns_coefficients: (a, b, c) of the Newton-Schulz polynomial.
        eps: floor of the norm the update is divided by before the iteration (> 0).
        ns_steps: Newton-Schulz iterations, in [0, 100).
        adjust_lr_fn: None or "original" (Jordan's), or "match_rms_adamw" (Moonshot's); see ``adjusted_lr``.
        ns_dtype: (ours, keyword only) the dtype the iteration runs in; torch's is bf16. Use float32 on CPUs without
            bf16 matrix units, where bf16 matmuls are far slower (more precise, not bit-equal to torch).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict] | Iterable[tuple[str, Tensor]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        ns_dtype=ns_dtype)
        super().__init__(params, defaults)  # calls add_param_group, which validates each group

    def check_group(self, group: dict) -> None:
        _check_muon_group(group)

    def group_step(self, group: dict) -> None:
        _muon_group_step(group, self.state)


def _check_muon_group(group: dict) -> None:
    lr, weight_decay, momentum, eps = group["lr"], group["weight_decay"], group["momentum"], group["eps"]
    if not lr >= 0.0:  # `not >=` also rejects NaN
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum value: {momentum} (must be in [0, 1))")
    if not eps > 0.0:
        raise ValueError(f"Invalid eps value: {eps} (must be > 0: it keeps a zero update from dividing by zero)")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(f"Invalid ns_coefficients: {group['ns_coefficients']} (need three values a, b, c)")
    ns_steps = group["ns_steps"]
    if not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"Invalid ns_steps: {ns_steps} (must be an integer in [0, 100))")
    if group["adjust_lr_fn"] not in (None, *ADJUST_LR_FNS):
        raise ValueError(f"Invalid adjust_lr_fn: {group['adjust_lr_fn']!r} (choose from None, "
                         f"{', '.join(map(repr, ADJUST_LR_FNS))})")
    if not (isinstance(group["ns_dtype"], torch.dtype) and group["ns_dtype"].is_floating_point):
        raise ValueError(f"Invalid ns_dtype: {group['ns_dtype']} (need a floating torch.dtype)")
    names = group.get("param_names") or [f"#{i} of its group" for i in range(len(group["params"]))]
    for name, p in zip(names, group["params"]):
        if p.ndim != 2:
            raise ValueError(f"Muon updates 2-D matrices only, but parameter {name} has shape {tuple(p.shape)}: give "
                             f"it to AdamW instead (muon_param_groups(model, ...) splits a model that way)")


def _muon_group_step(group: dict, state: dict) -> None:
    """One Muon step of the parameters of `group` that have gradients (the class docstring's equations)."""
    lr, weight_decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        if torch.is_complex(p):
            raise RuntimeError("Muon does not support complex parameters")
        g = p.grad
        s = state[p]
        if not s:
            s["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        buf = s["momentum_buffer"]
        buf.lerp_(g, 1 - momentum)  # B = momentum * B + (1 - momentum) * g
        update = g.lerp(buf, momentum) if group["nesterov"] else buf  # (1 - momentum) * g + momentum * B
        update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
        p.mul_(1 - lr * weight_decay)
        p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


class MuonWithAdamW(_GroupwiseOptimizer):
    """Muon for the parameter groups marked ``'use_muon': True``, AdamW for those marked False, as one optimizer.

    One torch Optimizer (not two side by side) so that everything that drives an optimizer drives this one:
    ``LambdaLR`` multiplies every group's lr by the same schedule (Muon's and AdamW's peaks keep their ratio),
    ``GradScaler.unscale_`` / ``step`` see all the gradients, and ``state_dict`` / ``load_state_dict`` hold both
    kinds (per-parameter state as in ``Muon`` and ``AdamW``). Each group carries its own kind's hyperparameters,
    with the defaults below; ``eps`` means AdamW's denominator epsilon in AdamW groups and Newton-Schulz's norm
    floor (``ns_eps``) in Muon groups, as in the two classes.

        groups = muon_param_groups(model, weight_decay=0.1)
        optimizer = MuonWithAdamW(groups, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, muon_lr=0.02)

    Args:
        params: groups, each with ``'params'`` and ``'use_muon'`` (muon_param_groups makes them).
        lr, betas, eps, correct_bias, foreach: AdamW groups' defaults (see ``AdamW``).
        weight_decay: both kinds' default decay coefficient (decoupled, times each group's current lr).
        muon_lr: Muon groups' default lr (Jordan's 0.02). It is larger than AdamW's because under the "original"
            adjustment an update's entries have an RMS of about muon_lr / sqrt(fan_in) (muon_lr / 11 at width 128),
            where AdamW's are a sizeable fraction of its lr.
        momentum, nesterov, ns_coefficients, ns_eps, ns_steps, adjust_lr_fn, ns_dtype: Muon groups' defaults (see
            ``Muon``; ``ns_eps`` is its ``eps``).
    """

    def __init__(
        self,
        params: Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        *,
        muon_lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        foreach: bool = True,
    ):
        self.kind_defaults = {
            True: dict(lr=muon_lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients, eps=ns_eps,
                       ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype),
            False: dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias,
                        foreach=foreach),
        }
        super().__init__(params, {})  # no shared defaults: add_param_group fills in each group's kind's

    def group_defaults(self, group: dict) -> dict:
        return self.kind_defaults[group["use_muon"]]

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict) or param_group.get("use_muon") not in (True, False):
            raise ValueError("MuonWithAdamW takes parameter groups (dicts) that each say 'use_muon': True (hidden 2-D "
                             "matrices) or False (AdamW: embeddings, heads, gains, biases); "
                             "muon_param_groups(model, weight_decay) makes them")
        for key, value in self.group_defaults(param_group).items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)  # checks the group as its kind

    def check_group(self, group: dict) -> None:
        (_check_muon_group if group["use_muon"] else _check_hyperparameters)(group)

    def group_step(self, group: dict) -> None:
        (_muon_group_step if group["use_muon"] else _adamw_group_step)(group, self.state)


def muon_param_groups(model: nn.Module, weight_decay: float, *, blocks: str = "gpt_layers",
                      decay_embeddings: bool = False) -> list[dict]:
    """Split a model's trainable parameters between AdamW and Muon (for ``MuonWithAdamW``).

    Muon takes the hidden matrices: the 2-D parameters inside the module(s) named ``blocks`` (GPT-2's
    ``gpt_layers``: each block's q/k/v, attention output and MLP weights), which are not embeddings. AdamW takes
    the rest, grouped as ``param_groups_for_weight_decay`` does: the embeddings (and so GPT-2's LM head, tied to
    the word embedding: once), an untied or task head (decayed), LayerNorm gains and biases (not decayed).
    Parameters with ``requires_grad=False`` are left out. Muon's matrices decay by ``weight_decay`` too.

    Returns ``[AdamW decay, AdamW no-decay, Muon]``, each ``{'params', 'param_names', 'weight_decay', 'use_muon'}``
    (possibly empty), in the model's parameter order. AdamW's groups come first so that the first group's lr, which
    the engine records as "lr", is --lr's schedule with either optimizer.
    """
    embedded = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                for p in m.parameters(recurse=False)}
    containers = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == blocks]
    hidden = {id(p) for m in containers for p in m.parameters() if p.ndim == 2 and id(p) not in embedded}
    if not hidden:
        raise ValueError(f"{type(model).__name__} has no 2-D parameters inside a module named {blocks!r}: Muon needs "
                         f"the hidden matrices (pass blocks= the name of the transformer blocks' ModuleList)")
    decay, no_decay = param_groups_for_weight_decay(model, weight_decay, decay_embeddings)
    muon = {"params": [], "param_names": [], "weight_decay": weight_decay, "use_muon": True}
    rest = {"params": [], "param_names": [], "weight_decay": weight_decay, "use_muon": False}
    for name, p in zip(decay["param_names"], decay["params"]):  # every hidden matrix is a decaying 2-D parameter
        group = muon if id(p) in hidden else rest
        group["params"].append(p)
        group["param_names"].append(name)
    return [rest, {**no_decay, "use_muon": False}, muon]


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
