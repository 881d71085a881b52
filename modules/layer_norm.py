"""GPT-2's LayerNorm in a bf16 CPU training step, forward and backward one pass each (modules/rows.cpp).

torch's CPU LayerNorm in bf16 (`--dtype bf16-weights`: bf16 weights and activations) computes in fp32 but sums the
weight's and bias's gradients over the rows less exactly, and its backward is slow: on gpt2 at 4 x 128 (512 rows of
768, 2 cores of an AMX Xeon) its weight and bias gradients were off by up to 1.6 and 2.7 from float64's (the sums of
512 rows; several times the true value where it is small), and a norm took 0.12 ms forward and 0.34 backward. In a
bf16 training step (gradients taken) the kernel computes the same function: a row's mean, then its variance about
the mean (two passes, as torch's), widened to fp32 once, the output rounded once to bf16; backward
dx = rstd (g - mean(g) - xh mean(g xh)) with g = dy w and xh the normalised row; the weight's and bias's gradients
summed in fp32 over fixed chunks of 32 rows, the chunks added in order in double (within one bf16 rounding of
float64's, and the same sums whatever the thread count). Measured there (through this module, interleaved): 0.13 ms
forward, 0.25 backward; a gpt2 4 x 128 bf16-weights step 0.985x the time with GPT2_FAST_LAYERNORM=0.

fp32 keeps torch's: its fp32 LayerNorm is as fast as the kernel's fp32 form (0.11 / 0.23 ms against 0.15 / 0.26 with
this autograd Function's overhead) and exact to fp32 rounding. The kernel's fp32 form stays for its tests, which hold
its arithmetic at fp32 precision. Everywhere else too (no gradient, so every evaluation and generation; fp16 or
float64; a weight in another dtype than the input, as under autocast's fp32 norms of bf16 activations; a
normalized_shape of more than one dimension; torch.compile; GPT2_FAST_LAYERNORM=0; no rows kernel) F.layer_norm.
tests/test_layer_norm.py holds values and gradients to float64 LayerNorm and to torch's.

`LayerNorm` is nn.LayerNorm (the same parameters, state dict and extra_repr) whose forward takes the kernel where it
applies; `modules.norms.make_norm` builds it for GPT-2's blocks and final norm.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from modules import rows, transforms
from modules.rows import pointer

ENV = "GPT2_FAST_LAYERNORM"
SMALL = 1 << 14  # values under which one thread does it all


def available() -> bool:
    """Whether a training step's LayerNorm may take the kernel here: GPT2_FAST_LAYERNORM not 0 and the kernel built."""
    return os.environ.get(ENV) != "0" and rows.available()


def _matches(p: torch.Tensor | None, x: torch.Tensor) -> bool:
    return p is None or (p.dtype == x.dtype and p.is_cpu and p.shape == x.shape[-1:])


def applies(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """A training step's LayerNorm over the last dimension of a CPU bf16 tensor, weight and bias (if any) in bf16,
    outside torch.compile and torch.func, where available()."""
    grads = x.requires_grad or any(p is not None and p.requires_grad for p in (weight, bias))
    return (grads and torch.is_grad_enabled() and x.is_cpu and x.dtype == torch.bfloat16
            and x.dim() >= 1 and tuple(normalized_shape) == tuple(x.shape[-1:]) and x.shape[-1] > 0
            and _matches(weight, x) and _matches(bias, x) and not transforms.active() and available())


def _threads(n: int) -> int:
    return 1 if n < SMALL else torch.get_num_threads()


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float) -> torch.Tensor:
        inputs = (x, weight, bias)
        x = x.contiguous()
        weight = None if weight is None else weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        C = x.shape[-1]
        R = x.numel() // C
        y = torch.empty_like(x)
        mean = torch.empty(R, dtype=torch.float32)
        rstd = torch.empty(R, dtype=torch.float32)
        rows._load().rows_layernorm(int(x.dtype == torch.bfloat16), x.data_ptr(), pointer(weight), pointer(bias),
                                    y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), R, C, eps, _threads(x.numel()))
        ctx.save_for_backward(*inputs, mean, rstd)  # the inputs themselves (not contiguous copies): see backward
        ctx.has_bias, ctx.eps = bias is not None, eps
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that can itself be differentiated
            return transforms.torch_backward(lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps),
                                             (x, weight, bias, ctx.eps), ctx.needs_input_grad, grad)
        x = x.contiguous()
        weight = None if weight is None else weight.contiguous()
        grad = grad.contiguous().to(x.dtype)
        C = x.shape[-1]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        db = x.new_empty(C) if ctx.has_bias and ctx.needs_input_grad[2] else None
        rows._load().rows_layernorm_backward(int(x.dtype == torch.bfloat16), grad.data_ptr(), x.data_ptr(),
                                             pointer(weight), mean.data_ptr(), rstd.data_ptr(), pointer(dx),
                                             pointer(dw), pointer(db), x.numel() // C, C, _threads(x.numel()))
        return dx, dw, db, None


def layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm: the kernel in a training step where it applies (see the module's docstring), else torch's."""
    if applies(x, normalized_shape, weight, bias):
        return _LayerNorm.apply(x, weight, bias, eps)
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose forward takes the kernel in a CPU training step (layer_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
