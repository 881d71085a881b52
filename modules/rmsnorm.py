"""RMSNorm's forward and backward in one pass each on the CPU (the C++ kernel modules/rmsnorm.cpp).

torch's `F.rms_norm` has no fused CPU kernel: it runs as six elementwise passes forward and autograd's dozen back.
On the race's model (4 x 128, 12 x 64 tokens, 2 cores of an Ice Lake Xeon) each of a step's 17 norms (RMSNorm and
QK-norm) cost about 0.8 ms forward and backward, against LayerNorm's 0.22 ms. `rms_norm` here computes the same
function with the kernel where it applies (a float32 CPU tensor, grad mode or not, outside torch.compile and torch.func,
the kernel built, GPT2_FAST_RMSNORM not 0) and with `F.rms_norm` anywhere else. The two agree to float32 rounding (the
sums run in another order); tests/test_rmsnorm.py holds them to 1e-5 relative, values and gradients, and checks the
backward against autograd's in float64 terms.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from modules import rows, transforms
from modules.rows import pointer

SOURCE = Path(__file__).with_name("rmsnorm.cpp")
ENV = "GPT2_FAST_RMSNORM"
SMALL = 1 << 15  # elements under which one thread does the whole norm
_library = None  # the loaded library; False once it could not be built here


def library(target_flags: tuple[str, ...] = rows.NATIVE):
    lib = ctypes.CDLL(str(rows._build(target_flags, SOURCE)))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rmsnorm_forward.restype = None
    lib.rmsnorm_forward.argtypes = [i64, i64, p, p, ctypes.c_float, p, p, ctypes.c_int]
    lib.rmsnorm_backward.restype = None
    lib.rmsnorm_backward.argtypes = [i64, i64, p, p, p, p, p, p, ctypes.c_int]
    return lib


def _load():
    global _library
    if _library is None:
        _library = rows.load_kernel(ENV, library, "the RMSNorm kernel modules/rmsnorm.cpp", "RMSNorm runs torch's")
    return _library


def available() -> bool:
    return bool(_load())


def _threads(n: int) -> int:
    return 1 if n < SMALL else torch.get_num_threads()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        lib = _load()
        inputs = (x, weight)
        x = x.contiguous()
        w = None if weight is None else weight.contiguous()
        dim = x.shape[-1]  # > 0 (applies())
        rows_ = x.numel() // dim
        y = torch.empty_like(x)
        rstd = x.new_empty(rows_)
        lib.rmsnorm_forward(rows_, dim, x.data_ptr(), pointer(w), eps, y.data_ptr(), rstd.data_ptr(),
                            _threads(x.numel()))
        ctx.save_for_backward(*inputs, rstd)  # the inputs themselves (not contiguous copies): see backward
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lib = _load()
        x, w, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that can itself be differentiated
            return transforms.torch_backward(lambda x, w, eps: F.rms_norm(x, x.shape[-1:], w, eps),
                                             (x, w, ctx.eps), ctx.needs_input_grad, grad)
        x = x.contiguous()
        w = None if w is None else w.contiguous()
        grad = grad.contiguous()
        dim = x.shape[-1]
        dx = torch.empty_like(x)
        dw = torch.empty_like(w) if w is not None and ctx.needs_input_grad[1] else None  # no rows: zeros (the kernel)
        lib.rmsnorm_backward(x.numel() // dim, dim, grad.data_ptr(), x.data_ptr(), pointer(w), rstd.data_ptr(),
                             dx.data_ptr(), pointer(dw), _threads(x.numel()))
        return (dx if ctx.needs_input_grad[0] else None), dw, None


def applies(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """A float32 CPU tensor (and weight) outside torch.compile and torch.func, with the kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0
            and not x.is_sparse and (weight is None or (weight.dtype == torch.float32 and weight.device.type == "cpu"
                                                        and weight.shape == x.shape[-1:]))
            and not transforms.active() and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * weight: the kernel where it applies (see the module's docstring), else
    `F.rms_norm`."""
    if applies(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
