"""The attention's three projections in a training step as one product: q, k, v = x [Wq; Wk; Wv]^T + [bq; bk; bv].

The course's layout keeps query, key and value as three Linear layers (transformers' GPT-2 has one Conv1D, c_attn).
Three products cost three launches forward and six backward, plus the two additions that sum their input gradients
and three bias sums; on a GPU at gpt2's size, where a step is bound by kernel launches, that is about 10 of a block's
kernels. Here the forward concatenates the weights (and biases) into a temporary, multiplies once and keeps only x
and the three weights for backward (the concatenation is made again there, not kept: autograd through torch.cat and
F.linear would keep it, 7 MB a gpt2 layer in fp32, 30 MB a gpt2-xl one); backward multiplies once for x's gradient
and once for the weights', whose (3C, C) result is returned as three row blocks (views); on a CPU with AMX that
weight gradient is transpose(g) x, as modules/transposed.py computes the large layers' (a 2304 x 768 weight's on an AMX
Xeon: 1.16 against 1.27 ms at 512 rows, 4.4 against 6.6 at 2048). Each output element is the same sum as in the
separate products; the kernels may block them differently, so values agree to float rounding.

Measured 2026-12-04, gpt2 4 x 128, blocks of steps interleaved with GPT2_FUSED_QKV=0 in one process: on a 2-core
AMD EPYC Zen 5, bf16-weights 1.00x and fp32 0.99x the step's time (neutral: the three products ran at the rate of
one); on an H200 (fp32, torch's AdamW, a launch-bound step) 0.98-1.00x, inside that host's noise
(docs/gpu.md). A gpt2 training step has transformers' count of products with it (99 and 48 biased; 147 and 72 without).

Taken by CausalSelfAttention in grad mode, where a projection weight requires a gradient, for three plain Linear
layers (not LoRA's, none with hooks) of one dtype and device, with biases on all three or none, outside autocast
(whose casts F.linear's form keeps) and torch.compile (which fuses as it sees fit); GPT2_FUSED_QKV=0 turns it off.
Evaluation and generation keep their own paths.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from modules import linear_backward, onednn, transforms, transposed

ENV = "GPT2_FUSED_QKV"


def available() -> bool:
    return os.environ.get(ENV) != "0"


def applies(x: torch.Tensor, layers) -> bool:
    """Whether the three Linear `layers` (query, key, value) of an attention take the fused product for input x."""
    weights = [m.weight for m in layers]
    biases = [m.bias for m in layers]
    return (torch.is_grad_enabled() and any(w.requires_grad for w in weights) and available()
            and all(w.dim() == 2 and w.dtype == x.dtype and w.device == x.device for w in weights)
            and (all(b is None for b in biases) or all(b is not None and b.dtype == x.dtype for b in biases))
            and not _autocast(x.device.type) and not transforms.active()
            and not any(m._forward_hooks or m._forward_pre_hooks for m in layers))


def _autocast(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _split(gradient: torch.Tensor | None, sizes: tuple[int, ...], needs) -> tuple:
    """The three layers' parts of a concatenated gradient (None where not asked)."""
    if gradient is None:
        return (None,) * 3
    return tuple(part if need else None for part, need in zip(gradient.split(sizes), needs))


class QKVLinear(torch.autograd.Function):
    """(x, wq, wk, wv, bq, bk, bv, use_onednn) -> x [wq; wk; wv]^T + [bq; bk; bv] (biases all None or all tensors);
    use_onednn: the three products through oneDNN's inner product (fp32 training where it timed faster:
    modules/onednn.py), else torch's."""

    @staticmethod
    def forward(ctx, x, wq, wk, wv, bq, bk, bv, use_onednn=False):
        ctx.save_for_backward(x, wq, wk, wv)
        ctx.onednn = use_onednn
        bias = None if bq is None else torch.cat((bq, bk, bv))
        weight = torch.cat((wq, wk, wv))
        return onednn.linear(x, weight, bias) if use_onednn else F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, wq, wk, wv = ctx.saved_tensors
        needs = ctx.needs_input_grad
        sizes = (wq.shape[0], wk.shape[0], wv.shape[0])

        def amx_weight_gradient(g, rows):  # on AMX (modules/transposed.py) 2^20+ values from a row-major copy of g
            g_t = transposed.transpose(g) if transposed.weight_gradient_applies(g, sum(sizes) * rows.shape[1]) else g.t()
            return g_t @ rows  # g_t: g.t() in fp32

        weight = torch.cat((wq, wk, wv)) if needs[0] else None  # made again, not kept (the module's docstring)
        d_x, d_weight, d_bias = linear_backward.gradients(  # g W and g^T x through the forward's library
            x, weight, grad, (needs[0], any(needs[1:4]), any(needs[4:7])),
            onednn.input_gradient if ctx.onednn else None,
            onednn.weight_gradient if ctx.onednn else amx_weight_gradient)
        return (d_x, *_split(d_weight, sizes, needs[1:4]), *_split(d_bias, sizes, needs[4:7]), None)


def project(x: torch.Tensor, layers) -> torch.Tensor:
    """The three layers' outputs side by side (..., q + k + v features), as one product."""
    q, k, v = layers
    use_onednn = onednn.training_applies(x, q.weight, values=sum(m.weight.numel() for m in layers))
    return QKVLinear.apply(x, q.weight, k.weight, v.weight, q.bias, k.bias, v.bias, use_onednn)
