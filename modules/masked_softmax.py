"""The attention's scale, mask and softmax in a CPU training step, one pass forward and one backward (modules/rows.cpp).

The course's explicit attention computes, for scores S = q k^T (B, nh, T, K):

    P = softmax(masked_fill(scale * S, hidden, lowest))

torch runs that as three passes over the (B, nh, T, K) scores forward (the scale's multiply, masked_fill's copy,
softmax) and three backward (softmax's, masked_fill's, the multiply's), each writing a new tensor. In a training step
(gradients taken; fp32 or bf16 scores: autocast and `--dtype bf16-weights` alike) the kernel does the same in one pass
each way: a row widened to fp32 once, hidden keys left out (P = 0; a row that sees no key gives 1/K everywhere and a
zero gradient, as masked_fill and softmax give them), its exps by one polynomial exp a value (within 2 ulp), divided
by their sum and rounded once to the scores' dtype; backward dS = scale P (dP - sum P dP). gpt2 at 4 x 128, bf16, 2
cores of an AMX Xeon: see docs/performance.md. Everywhere else (no gradient, a mask other than (B or 1, 1, T, K),
fp16 or float64, torch.compile, GPT2_FAST_SOFTMAX=0, no rows kernel) torch's ops, as before.
"""
from __future__ import annotations

import os

import torch

from modules import rows, transforms

ENV = "GPT2_FAST_SOFTMAX"


def available() -> bool:
    """Whether the training step's softmax may take the kernel here: GPT2_FAST_SOFTMAX not 0 and the kernel built."""
    return os.environ.get(ENV) != "0" and rows.available()


def applies(scores: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Scores (B, nh, T, K) of a training step on the CPU, fp32 or bf16, with no mask (causal) or a bool mask
    (B or 1, 1, T, K), outside torch.compile and torch.func, where available()."""
    if not (scores.requires_grad and torch.is_grad_enabled() and scores.is_cpu and scores.dim() == 4
            and scores.dtype in (torch.float32, torch.bfloat16) and not transforms.active()):
        return False
    if mask is not None:
        B, _, T, K = scores.shape
        if not (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == 1
                and tuple(mask.shape[2:]) == (T, K)):
            return False
    elif scores.shape[2] > scores.shape[3]:  # more queries than keys: no causal reading of it
        return False
    return available()


def _call(fn, *tensors, mask: torch.Tensor | None, scale: float) -> None:
    """fn (rows_softmax or its backward) on `tensors`, all of the scores' shape (B, nh, T, K) and dtype."""
    B, H, T, K = tensors[0].shape
    mask_ptr, stride = None, 0
    if mask is not None:
        mask_ptr, stride = mask.data_ptr(), (T * K if mask.shape[0] > 1 else 0)
    fn(int(tensors[0].dtype == torch.bfloat16), *(t.data_ptr() for t in tensors), mask_ptr, stride, B, H, T, K,
       scale, torch.get_num_threads())


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
        scores = scores.contiguous()
        mask = None if mask is None else mask.contiguous().view(torch.uint8)
        probs = torch.empty_like(scores)
        _call(rows._load().rows_softmax, scores, probs, mask=mask, scale=scale)
        ctx.save_for_backward(probs, mask)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: softmax's rule in torch's ops, itself differentiable (probs,
            # saved as this Function's output, leads back through it); masked keys have probability 0: gradient 0
            grad = grad.to(probs.dtype)
            return ctx.scale * probs * (grad - (grad * probs).sum(-1, keepdim=True)), None, None
        grad = grad.contiguous().to(probs.dtype)
        out = torch.empty_like(probs)
        _call(rows._load().rows_softmax_backward, probs, grad, out, mask=mask, scale=ctx.scale)
        return out, None, None


def masked_softmax(scores: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(masked_fill(scale * scores, ~mask, lowest)) over the last dimension (mask None: causal, key k visible
    from query t when k <= t + K - T), in the scores' dtype: the kernel where it applies, else torch's ops."""
    if applies(scores, mask):
        return _MaskedSoftmax.apply(scores, scale, mask)
    scores = scores * scale
    if mask is None:
        T, K = scores.shape[-2:]
        mask = torch.ones(T, K, dtype=torch.bool, device=scores.device).tril(K - T)
    return torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1)
