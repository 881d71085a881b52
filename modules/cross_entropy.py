"""Cross-entropy over a large vocabulary, a few rows at a time (the LM loss on the CPU).

F.cross_entropy on (N, V) logits builds whole (N, V) tensors: the fp32 copy of bf16 logits, the log-softmax, and
in backward a zero-filled gradient of the log-probabilities, its softmax backward and the cast back; for gpt2 at
4 x 128 tokens each is 103 MB, so the loss reads and writes about a gigabyte a step. Here the forward keeps one
number per row (its log-sum-exp) and the backward recomputes softmax(z) = exp(z - lse) a few rows at a time, in
fp32 while the rows are in cache, writing the gradient once in the logits' dtype:

    L = (1/n) sum_i (lse(z_i) - z_i[y_i]),  n = rows whose target is not ignore_index (reduction "mean")
    dL/dz_i = (softmax(z_i) - onehot(y_i)) * g / n for counted rows, 0 for the others.

The same values as F.cross_entropy up to the order of the additions in fp32; gradients come in the logits' dtype
(fp32 arithmetic, rounded once). Where the rows kernel is built (modules/rows.cpp, AVX2 or AVX512 x86-64 Linux) and
GPT2_FAST_LOSS is not 0, fp32 and bf16 logits take its row loops instead of torch's ops on blocks of rows: the
forward reads each row twice (its maximum, its sum of exps, one polynomial exp a value), the backward once, writing
the gradient directly (gpt2's 512 x 50257 logits, 2 cores of an AMX Xeon: bf16 loss and backward 30.1 -> 16.0 ms,
fp32 34.3 -> 16.7); its exp is within 2 ulp, so the loss and gradients agree with torch's to a few fp32 roundings
(tests/test_cross_entropy.py). A row holding a NaN or an infinity gives torch's NaN or infinity. The blocks of
torch's ops against F.cross_entropy, gpt2 loss and backward alone, 508 x 50257: fp32 46.6 -> 46.0 ms, bf16 logits
57.7 -> 37.9 ms with freed memory kept; 116.7 -> 81.8 and 151.0 -> 59.9 ms with glibc's default malloc, where the
whole-tensor path also faults in fresh pages (docs/performance.md). Used on the CPU for fp32, bf16 and fp16 logits
of at least MIN_ELEMENTS; float64 logits, smaller ones, other devices and torch.compile take F.cross_entropy.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from modules import rows as row_kernel
from modules import transforms

ENV = "GPT2_FAST_LOSS"

CHUNK_ELEMENTS = 1 << 19  # fp32 elements per block of rows: 2 MB, a core's L2 on the Xeon this was measured on
# Smaller logits stay with F.cross_entropy: they fit in cache whole, and the blocks' Python loop and autograd.Function
# cost more than they save (the README's char model, 384 x 65 logits a slice: 28.10 -> 28.60 and 29.40 -> 29.54 ms
# a step with blocks, one thread, in one process).
MIN_ELEMENTS = 1 << 21


def rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def available() -> bool:
    """Whether the loss's rows may take the rows kernel here: GPT2_FAST_LOSS not 0 and the kernel built."""
    return os.environ.get(ENV) != "0" and row_kernel.available()


def kernel_takes(logits: torch.Tensor) -> bool:
    """Contiguous fp32 or bf16 CPU logits, where available(): the kernel's row loops (else torch's ops by blocks)."""
    return logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous() and available()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Sum or mean cross-entropy of logits (N, V) against targets (N,) (ignore_index rows left out), computed by
    blocks of rows in fp32; saves the logits, the targets and one log-sum-exp per row."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, mean: bool) -> torch.Tensor:
        rows = rows_per_chunk(logits.shape[1])
        with torch.autocast(logits.device.type, enabled=False):
            lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
            if kernel_takes(logits):
                row_kernel._load().rows_ce_lse(int(logits.dtype == torch.bfloat16), logits.data_ptr(),
                                               logits.shape[0], logits.shape[1], lse.data_ptr(),
                                               torch.get_num_threads())
            else:
                for start in range(0, logits.shape[0], rows):
                    torch.logsumexp(logits[start:start + rows].float(), dim=-1, out=lse[start:start + rows])
            counted = targets != ignore_index
            safe = torch.where(counted, targets, 0).unsqueeze(1)  # ignored rows pick column 0, then count for 0
            picked = logits.gather(1, safe).squeeze(1).float()
            total = ((lse - picked) * counted).sum()
            n = counted.sum()
            ctx.save_for_backward(logits, safe, counted, lse, n)
            ctx.mean = mean
            return total / n if mean else total  # nan when nothing is counted, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, safe, counted, lse, n = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that can itself be differentiated
            def reference(logits):
                total = ((torch.logsumexp(logits.float(), -1) - logits.gather(1, safe).squeeze(1).float())
                         * counted).sum()
                return total / n if ctx.mean else total

            return (*transforms.torch_backward(reference, (logits,), (True,), grad_loss), None, None, None)
        rows = rows_per_chunk(logits.shape[1])
        with torch.autocast(logits.device.type, enabled=False):
            scale = grad_loss.float() / n if ctx.mean else grad_loss.float()
            weight = torch.where(counted, scale, 0.0).unsqueeze(1)  # (N, 1): 0 for ignored rows, even when n is 0
            if kernel_takes(logits):
                grad = torch.empty_like(logits)
                weight = weight.contiguous()
                targets = safe.to(torch.int64).contiguous()
                row_kernel._load().rows_ce_grad(int(logits.dtype == torch.bfloat16), logits.data_ptr(), lse.data_ptr(),
                                                targets.data_ptr(), weight.data_ptr(), grad.data_ptr(), logits.shape[0],
                                                logits.shape[1], torch.get_num_threads())
                return grad, None, None, None
            minus_one = torch.full((min(rows, logits.shape[0]), 1), -1.0, dtype=torch.float32, device=logits.device)
            grad = torch.empty_like(logits)
            for start in range(0, logits.shape[0], rows):
                block = slice(start, start + rows)
                # softmax of the block's rows; a new fp32 tensor (fp32 logits' .float() would be the logits themselves)
                p = torch.sub(logits[block], lse[block].unsqueeze(1)).exp_()
                p.scatter_add_(1, safe[block], minus_one[: p.shape[0]])
                grad[block] = p.mul_(weight[block])
        return grad, None, None, None


def applies(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and logits.numel() >= MIN_ELEMENTS and not transforms.active())


def check_shapes(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Logits (N, V) and targets (N,), or a ValueError naming both shapes."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy wants logits (N, V) and targets (N,), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(logits.float(), targets, ignore_index=..., reduction=...) for logits (N, V) and class
    indices (N,), computed at least in fp32 (float64 kept): chunked on the CPU (see the module's docstring), whole
    elsewhere and for reduction "none"."""
    check_shapes(logits, targets)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if reduction == "none" or not applies(logits):
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # .float() would round float64 down
        return F.cross_entropy(wide, targets, ignore_index=ignore_index, reduction=reduction)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= logits.shape[1]))
    if bool(bad.any()):
        raise ValueError(f"targets must be class indices in [0, {logits.shape[1]}) or ignore_index "
                         f"({ignore_index}); got {targets[bad][0].item()}")
    return ChunkedCrossEntropy.apply(logits, targets, ignore_index, reduction == "mean")
