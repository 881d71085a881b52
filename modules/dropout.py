"""Dropout whose training-mode mask costs one pass over memory on the CPU (the C++ kernel modules/dropout.cpp).

`Dropout` is an `nn.Dropout` (same constructor, `p`, `inplace`, repr, eval-mode identity, isinstance checks and
state dicts): the course's names (`attention_dropout`, `out_dropout`, `embed_dropout`, the attention's `dropout`)
hold it. In training mode on a CPU fp32 or bf16 tensor it keeps each element with probability 1 - p and scales it
by 1 / (1 - p), as torch's does, but its mask is a hash of the element's index and a seed drawn from torch's
generator: `torch.manual_seed` makes runs repeat, activation checkpointing (which restores the generator) recomputes
the same mask, and backward recomputes the mask from the seed instead of keeping a byte per element. The masks are
not torch's: a model trained with them draws different dropout than `nn.Dropout` from the same seed (statistically
the same: tests/test_dropout.py). Anything else (another device or dtype, p = 0 or 1, inplace, under torch.compile,
GPT2_FAST_DROPOUT=0, no compiler) runs torch's dropout.

gpt2 training step 4 x 128 on a 2-core Zen 4: torch's dropouts cost ~280 ms of a 2.9 s fp32 step and ~130 ms of a
1.45 s bf16 one (docs/performance.md has the measured rows).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from modules import rows, transforms

SOURCE = Path(__file__).with_name("dropout.cpp")
ENV = "GPT2_FAST_DROPOUT"
SMALL = 1 << 15  # elements under which one thread draws the whole mask
_library = None  # the loaded library; False once it could not be built here


def library(target_flags: tuple[str, ...] = rows.NATIVE):
    lib = ctypes.CDLL(str(rows._build(target_flags, SOURCE)))
    args = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float,
            ctypes.c_int]
    for name in ("dropout_f32", "dropout_bf16"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = args
    lib.dropout_mask.restype = None
    lib.dropout_mask.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32]
    return lib


def _load():
    global _library
    if _library is None:
        _library = rows.load_kernel(ENV, library, "the dropout kernel modules/dropout.cpp", "dropout runs torch's")
    return _library


def available() -> bool:
    return bool(_load())


def threshold(p: float) -> int:
    """The 32-bit hash value under which an element is dropped: p of the 2^32 values."""
    return min(round(p * 2**32), 2**32 - 1)


def draw_seed() -> int:
    """A 63-bit seed from torch's default CPU generator (so torch.manual_seed and checkpointing govern it)."""
    return int(torch.empty((), dtype=torch.int64).random_())


def apply_mask(x: torch.Tensor, p: float, seed: int, lib=None) -> torch.Tensor:
    """x * mask / (1 - p) with the mask of `seed` (a new contiguous tensor of x's shape)."""
    lib = lib or _load()
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    kernel = lib.dropout_f32 if x.dtype == torch.float32 else lib.dropout_bf16
    kernel(n, x.data_ptr(), y.data_ptr(), seed, threshold(p), 1.0 / (1.0 - p),
           1 if n < SMALL else torch.get_num_threads())
    return y


def keep_mask(n: int, p: float, seed: int, lib=None) -> torch.Tensor:
    """The mask of `seed` for n elements: True where kept."""
    lib = lib or _load()
    keep = torch.empty(n, dtype=torch.uint8)
    lib.dropout_mask(n, keep.data_ptr(), seed, threshold(p))
    return keep.bool()


class _HashedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        ctx.p, ctx.seed = p, seed
        return apply_mask(x, p, seed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the same product in torch's ops, itself differentiable
            keep = keep_mask(grad.numel(), ctx.p, ctx.seed).view(grad.shape)
            return grad * keep * (1.0 / (1.0 - ctx.p)), None, None
        return apply_mask(grad, ctx.p, ctx.seed), None, None


def applies(x: torch.Tensor) -> bool:
    """A CPU fp32/bf16 tensor outside torch.compile and torch.func, with the kernel built."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and not x.is_sparse
            and not transforms.active() and available())


class Dropout(nn.Dropout):
    """nn.Dropout with the one-pass hashed mask in CPU training (see the module's docstring); torch's elsewhere."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.training and 0.0 < self.p < 1.0 and not self.inplace and applies(input):
            return _HashedDropout.apply(input, self.p, draw_seed())
        return super().forward(input)
