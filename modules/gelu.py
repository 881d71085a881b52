"""GPT-2's GELU (the tanh form) on the CPU in one pass (modules/rows.cpp): forward and backward in training, and the
forward alone in evaluation and generation.

torch's CPU `gelu(approximate="tanh")` evaluates tanh with a library call a value, forward and again backward. On
the race's model (4 x 128, 12 x 64 tokens: a 12 x 64 x 512 activation a layer, 2 cores of an Ice Lake Xeon) that
was about 1.1 ms forward and 1.2 ms backward a layer, against 0.4 and 0.6 for the exact GELU. The kernel writes
GELU(v) = v / (1 + e^(-2u)) with one polynomial exp a value (rows.cpp's, which the decode step also uses), and its
derivative from the same exp. Without a gradient (gpt2's 8 x 128 x 3072 activation, Zen 5, 2 threads, 2026-12-05):
torch's fp32 2.5 ms, the kernel 1.0; bf16 2.1 against 0.6.

`gelu_new` takes the kernel on a float32 or bf16 CPU tensor (bf16: each value widened to fp32, GELU or its derivative
in fp32, rounded back to bf16 once, as torch's bf16 op does), outside torch.compile and torch.func, with the rows
kernel built and GPT2_FAST_GELU not 0: as the autograd Function below when a gradient will be taken through it (grad
mode on and the input requiring one: a training step), else as one call into a new tensor (evaluation, a prompt's
pass, generation's steps outside the decode kernel). Everywhere else torch's `gelu(approximate="tanh")`. The kernel
is within 2e-7 relative of the exact tanh GELU (float64), closer than torch's float32 (1.2e-5 on tiny values) and than
transformers' `gelu_new` (the tanh formula in torch's ops); tests/test_gelu.py holds values and gradients to it and to
torch. In bf16 the rounding decides: 1.3% of values land one bf16 step from the exact value rounded (torch's bf16 op:
6.7%), and below v = -5, where torch's tanh form gives 0, the kernel gives GELU's tiny values.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from modules import rows, transforms

ENV = "GPT2_FAST_GELU"
SMALL = 1 << 14  # values under which one thread does it all
_on: bool | None = None  # the kernel's switch and build, read once


def available() -> bool:
    """Whether training's GELU takes the kernel here: GPT2_FAST_GELU not 0 and the rows kernel built."""
    global _on
    if _on is None:
        _on = os.environ.get(ENV) != "0" and rows.available()
    return _on


def applies(x: torch.Tensor) -> bool:
    """Whether gelu_new runs x through the kernel's autograd Function: a gradient taken through it (see the module's
    docstring)."""
    return x.requires_grad and torch.is_grad_enabled() and takes(x)


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel takes x, with or without a gradient: a float32 or bf16 CPU tensor, outside torch.compile
    and torch.func, where available()."""
    return (x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and not transforms.active()
            and available())


def _threads(n: int) -> int:
    return 1 if n < SMALL else torch.get_num_threads()


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that can itself be differentiated
            return transforms.torch_backward(lambda x: F.gelu(x, approximate="tanh"), (x,), (True,), grad)[0]
        x = x.contiguous()
        grad = grad.contiguous().to(x.dtype)
        dx = torch.empty_like(x)
        if x.dtype == torch.bfloat16:
            rows._load().rows_gelu_tanh_bf16(x.data_ptr(), grad.data_ptr(), dx.data_ptr(), x.numel(),
                                              _threads(x.numel()))
        else:
            rows._load().rows_gelu_tanh_backward(x.data_ptr(), grad.data_ptr(), dx.data_ptr(), x.numel(),
                                                 _threads(x.numel()))
        return dx


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh form (GPT-2's "gelu_new"): the kernel where it takes x (with autograd's Function in a training
    step), else torch's."""
    if applies(x):
        return _GELU.apply(x)
    return forward(x) if takes(x) else F.gelu(x, approximate="tanh")


def forward(x: torch.Tensor) -> torch.Tensor:
    """The kernel's GELU of x (a tensor it takes) into a new tensor, without autograd."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.dtype == torch.bfloat16:
        rows._load().rows_gelu_tanh_bf16(x.data_ptr(), None, y.data_ptr(), x.numel(), _threads(x.numel()))
    else:
        rows._load().rows_gelu_tanh(x.data_ptr(), y.data_ptr(), x.numel(), _threads(x.numel()))
    return y
