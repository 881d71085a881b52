"""bf16 products of a CPU training step on AMX with one operand transposed first: the LM head's logits and the large
linear layers' weight gradients.

oneDNN's bf16 matrix products (torch's on the CPU) reorder their second operand into a blocked layout at every call,
and read a transposed first operand slowly; on a CPU with AMX, where the products themselves are fast, both show.
The rows kernel's transpose (modules/rows.cpp, rows_transpose16; torch's own transposing copy of a large bf16 matrix
is about 7x slower) turns each into a faster form:

- A linear layer's weight gradient: autograd's is `g^T x` with g^T a transposed view of the output's gradient; here g
  is transposed into a row-major copy first. Its forward, input gradient and bias gradient are F.linear's.
- The LM head: `F.linear(h, W)` hands W (gpt2's 50257 x 768: 77 MB in bf16) to oneDNN as the second operand, reordered
  at every call; here the logits are computed as `W @ h^T` (W read as it lies, only h^T reordered) and the (V, N)
  product transposed into the (N, V) logits. Its backward is the linear layers': dh = g W, dW = transpose(g) h.

Measured on a 2-core Xeon with AMX (2026-12-03, medians, ms):

    gpt2's head, rows                       8     64    128    512   2048
      F.linear(h, W)                      6.0   10.6   15.1   36.5  116.7
      W @ h^T, transposed                 2.4    6.6    9.2   24.8  104.1
    weight gradient, 512 / 2048 rows    768x768   2304x768   3072x768   768x3072   1024x1024
      g^T x (autograd's)                0.49/2.1   1.27/6.6   1.63/10.3  1.63/9.9  0.85/3.8
      transpose(g) x                    0.73/2.8   1.16/4.4   1.45/6.1   1.32/6.0  0.83/2.8

and gpt2's bf16-weights training step, one process, interleaved with GPT2_TRANSPOSED_PRODUCTS=0: 0.970x the time at
4 x 128, 0.940x at 8 x 256 (each part alone against its old form at 4 x 128: the head's product 0.978-0.985x, its
weight gradient 0.978x, the MLP's weight gradients 0.963-0.964x, also at 8 x 256). Smaller matrices gain nothing or lose (a
50257 x 128 head: 11.8 against 14.2 ms at 512 rows; a 768 x 768 weight's gradient above), so the head is taken for
weights of HEAD_MIN_WEIGHT values or more and HEAD_MIN_ROWS rows or more, the weight gradient for weights of
LINEAR_MIN_WEIGHT values or more (gpt2: the MLP's two; the attention's four keep autograd's). The logits are the
same sums in another order: one element in about 15,000 differs by one bf16 rounding from F.linear's, with the same
largest error against float64; the weight gradient likewise.

Taken where a gradient will be taken (grad mode on; the head: h or W requiring one; a linear layer: its weight
requiring one, so LoRA's frozen bases keep F.linear), for bf16 tensors on the CPU, outside torch.compile and torch.func,
with the rows kernel built, on CPUs whose flags show AMX-BF16 (where it was measured); GPT2_TRANSPOSED_PRODUCTS=0 turns
it off, =force takes it on any CPU the rows kernel builds on (how the tests check it on a CPU without AMX). Evaluation
and generation keep their own paths (modules/packed.py's on AMX).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from modules import head_grad, linear_backward, onednn, rows, transforms

ENV = "GPT2_TRANSPOSED_PRODUCTS"
HEAD_MIN_WEIGHT = 1 << 24  # values of the head's W: gpt2's has 38.6 M
HEAD_MIN_ROWS = 8
LINEAR_MIN_WEIGHT = 1 << 20  # values of a linear layer's weight: gpt2's MLP has 2.4 M, its attention's 0.6 M


@functools.cache
def _amx_bf16() -> bool:
    return rows.has_cpu_flag("amx_bf16")


def available() -> bool:
    """Whether the transposed products are used here: the rows kernel built and GPT2_TRANSPOSED_PRODUCTS not 0, on a
    CPU with AMX-BF16 or where GPT2_TRANSPOSED_PRODUCTS=force."""
    setting = os.environ.get(ENV)
    return setting != "0" and (setting == "force" or _amx_bf16()) and rows.available()


def head_applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 hidden (..., C) of HEAD_MIN_ROWS+ rows and a bf16 (V, C) weight of HEAD_MIN_WEIGHT+ values on the CPU,
    with a gradient to take, outside torch.compile and torch.func, where available()."""
    return (head_grad.bf16_training(hidden, weight) and (hidden.requires_grad or weight.requires_grad)
            and weight.numel() >= HEAD_MIN_WEIGHT and hidden.numel() >= HEAD_MIN_ROWS * hidden.shape[-1]
            and available())


def linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 x and a bf16 weight of LINEAR_MIN_WEIGHT+ values that requires a gradient, on the CPU, outside
    torch.compile, where available()."""
    return (head_grad.bf16_training(x, weight) and weight.requires_grad and weight.numel() >= LINEAR_MIN_WEIGHT
            and available())


def weight_gradient_applies(g: torch.Tensor, weight_values: int) -> bool:
    """Whether a bf16 CPU weight gradient g^T x of `weight_values` values is taken as transpose(g) x (a linear layer
    of LINEAR_MIN_WEIGHT+ values, where available()); modules/fused_qkv.py asks for its concatenated weight."""
    return (g.dtype == torch.bfloat16 and g.is_cpu and weight_values >= LINEAR_MIN_WEIGHT
            and not transforms.active() and available())


def transpose(x: torch.Tensor) -> torch.Tensor:
    """A contiguous (C, R) copy of a 2-D tensor of 16-bit values (R, C), through the rows kernel."""
    if x.dim() != 2 or x.element_size() != 2 or not x.is_cpu:
        raise ValueError(f"transpose takes a 2-D CPU tensor of 16-bit values, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    out = x.new_empty(x.shape[1], x.shape[0])
    rows._load().rows_transpose16(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


class TransposedGradLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) whose weight gradient is transpose(g) x (g: the output's gradient as (rows, out))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return linear_backward.gradients(x, weight, grad, ctx.needs_input_grad,
                                         weight_gradient=lambda g, rows: transpose(g) @ rows)


class TransposedHead(TransposedGradLinear):
    """logits (..., V) = hidden (..., C) W^T computed as (W hidden^T)^T (no bias: apply(hidden, W, None)); backward
    as TransposedGradLinear's."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: None) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return transpose(weight @ flat.t()).view(*hidden.shape[:-1], weight.shape[0])


def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(hidden, weight) (no bias; the LM head): the transposed product where it applies (AMX), else the
    weight gradient in blocks of vocabulary rows where that applies (bf16 training elsewhere: modules/head_grad.py),
    else torch's."""
    if head_applies(hidden, weight):
        return TransposedHead.apply(hidden, weight, None)
    if head_grad.applies(hidden, weight):
        return head_grad.BlockedGradHead.apply(hidden, weight)
    if onednn.training_applies(hidden, weight):  # fp32 training where oneDNN timed faster (modules/onednn.py)
        return onednn.TrainingLinear.apply(hidden, weight, None)
    return F.linear(hidden, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): the transposed weight gradient where it applies, else torch's."""
    if linear_applies(x, weight):
        return TransposedGradLinear.apply(x, weight, bias)
    if onednn.training_applies(x, weight):  # fp32 training where oneDNN timed faster (modules/onednn.py)
        return onednn.TrainingLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
