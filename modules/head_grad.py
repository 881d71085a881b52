"""The LM head's weight gradient in blocks of vocabulary rows: a bf16 CPU training step off AMX.

Autograd takes the head's weight gradient as one product, dW = g^T h: (V, N) from the logits' gradient g (N, V) and
the hidden states h (N, C). gpt2's V = 50257 is odd, and oneDNN's bf16 product for that shape runs far below the
rate of the step's other products; the same product cut into blocks of BLOCK_ROWS vocabulary rows, each written into
its rows of one gradient, runs at their rate. Each element is the same sum of N products (the blocks only split the
rows of the output), and the blocks give the unblocked product's bits on every shape measured (the tests compare them
for equality).

Measured on a 2-core AMD EPYC Zen 5 (AVX512-BF16, no AMX), 2026-12-04, freed memory kept as fit() keeps it, medians:

    rows N (tokens)                 64     128     512    1024    2048
      g^T h, one product (ms)       8.5    14.9    78.5   115.1   233.6
      blocks of 8192 rows (ms)      5.8    11.0    46.9    85.3   173.7

The one product's rate also differs between processes (54-59 ms in some, 73-79 in others, at 512 rows; the inputs'
alignment does not decide it); the blocks' does not. gpt2's bf16-weights training step at 4 x 128, blocks of 3 steps
interleaved with GPT2_HEAD_GRAD_BLOCKS=0 in one process, 4 processes: 1.006x, 0.970x, 0.968x and 0.981x the time,
the slowest round of each 0.93-0.96x. A vocabulary padded to a multiple of 64 (50304) runs at the blocks' rate
unblocked. fp32 products gain nothing (gpt2's head at 512 rows: 182 against 183 ms) and keep F.linear's.

Taken by GPT2Model's LM head for bf16 hidden states and a bf16 weight of HEAD_MIN_WEIGHT+ values that requires a
gradient, on the CPU, outside torch.compile and torch.func, where modules/transposed.py does not take the head (AMX);
GPT2_HEAD_GRAD_BLOCKS=0 turns it off. Its forward, and the hidden states' gradient g W, are F.linear's.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from modules import linear_backward, transforms

ENV = "GPT2_HEAD_GRAD_BLOCKS"
BLOCK_ROWS = 8192  # vocabulary rows a block: 8192 x 768 bf16 = 12 MB of gradient
HEAD_MIN_WEIGHT = 1 << 24  # values of the head's weight: gpt2's has 38.6 M; the char model's 65 x 384 stays unblocked


def available() -> bool:
    return os.environ.get(ENV) != "0"


def bf16_training(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 x and a bf16 2-D weight on the CPU, in grad mode, outside torch.compile and torch.func: the products of a
    bf16 CPU training step, the only ones this module and modules/transposed.py take."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu and weight.is_cpu
            and weight.dim() == 2 and torch.is_grad_enabled() and not transforms.active())


def applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 CPU hidden states and a bf16 (V, C) weight of HEAD_MIN_WEIGHT+ values that requires a gradient, with
    grad mode on, outside torch.compile and torch.func, where available()."""
    return (bf16_training(hidden, weight) and weight.requires_grad and weight.numel() >= HEAD_MIN_WEIGHT
            and available())


def weight_gradient(g: torch.Tensor, h: torch.Tensor, block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """g^T h for g (N, V) and h (N, C): a (V, C) tensor, computed block_rows rows of V at a time."""
    out = h.new_empty(g.shape[1], h.shape[1])
    for start in range(0, g.shape[1], block_rows):
        torch.mm(g[:, start:start + block_rows].t(), h, out=out[start:start + block_rows])
    return out


class BlockedGradHead(torch.autograd.Function):
    """F.linear(hidden, weight) (no bias) whose weight gradient is weight_gradient(g, hidden)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        return F.linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight = ctx.saved_tensors
        return linear_backward.gradients(hidden, weight, grad, ctx.needs_input_grad,
                                         weight_gradient=weight_gradient)[:2]
