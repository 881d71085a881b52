"""AdamW's step as one pass over memory: the C++ kernel modules/adamw.cpp, for optimizer.AdamW(fused=True).

torch's CPU AdamW (and optimizer.AdamW's default path, which repeats torch's operations to the bit) reads and
writes every parameter, gradient and moment once per elementwise operation: for gpt2's 124M parameters about eight
passes over 2 GB a step. The kernel reads each element once and writes it once, on every core (OpenMP). It is built
like the decoding kernel (modules/rows.py: the machine's compiler, once, cached by source, compiler and CPU flags).
`available()` is False where it cannot be built (no compiler, not x86-64 Linux) or GPT2_FUSED_ADAMW=0 is set; the
optimizer then keeps its multi-tensor path. Every tensor a step writes (parameter, moments, a bf16 parameter beside
its master) has its version bumped as torch's in-place ops do (`rows.wrote`), so the derived-weight caches see the update.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from modules import rows

SOURCE = Path(__file__).with_name("adamw.cpp")
SMALL = 1 << 16  # elements under which a tensor is updated by one thread (a parallel region costs more than it saves)
_library = None  # the loaded ctypes library; False once building or loading failed here


def library(target_flags: tuple[str, ...] = rows.NATIVE):
    lib = ctypes.CDLL(str(rows._build(target_flags, SOURCE, ("-ffp-contract=off", "-fno-math-errno"))))
    lib.adamw_step_f32.restype = None
    lib.adamw_step_f32.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, *[ctypes.c_float] * 7, ctypes.c_int]
    lib.adamw_step_bf16_master.restype = None
    lib.adamw_step_bf16_master.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 5, *[ctypes.c_float] * 7, ctypes.c_int]
    return lib


def _load():
    global _library
    if _library is None:
        _library = rows.load_kernel("GPT2_FUSED_ADAMW", library, "the fused AdamW kernel modules/adamw.cpp",
                                    "AdamW(fused=True) runs the multi-tensor path")
    return _library


def available() -> bool:
    return bool(_load())


def applies(*tensors: torch.Tensor) -> bool:
    """CPU fp32 tensors of one shape, each contiguous (parameter, gradient, moments): what the kernel updates."""
    shape = tensors[0].shape
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and t.shape == shape for t in tensors)


def applies_master(master: torch.Tensor, low: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """An fp32 master copy of a bf16 parameter, its gradient (bf16) and fp32 moments, all contiguous on the CPU."""
    return (applies(master, *tensors[1:]) and low.is_cpu and low.dtype == tensors[0].dtype == torch.bfloat16
            and low.is_contiguous() and tensors[0].is_contiguous() and low.shape == tensors[0].shape == master.shape)


def _scalars(n: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             bias_correction1: float, bias_correction2_sqrt: float) -> tuple:
    """The kernels' trailing arguments, in their order: the update's seven constants and the thread count."""
    threads = 1 if n < SMALL else torch.get_num_threads()
    return (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt, eps, -lr / bias_correction1,
            threads)


def step(p, g, m, v, *, lib=None, **hyper) -> None:
    """One AdamW step of p (and its moments m, v) from gradient g, in place: the update of optimizer.AdamW.
    hyper: lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt."""
    lib = lib or _load()
    lib.adamw_step_f32(p.numel(), p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), *_scalars(p.numel(), **hyper))
    rows.wrote(p, m, v)


def step_master(master, low, g, m, v, *, lib=None, **hyper) -> None:
    """step() on the fp32 `master` from the bf16 gradient g, then low = master rounded to bf16, in one pass."""
    lib = lib or _load()
    lib.adamw_step_bf16_master(master.numel(), master.data_ptr(), low.data_ptr(), g.data_ptr(), m.data_ptr(),
                               v.data_ptr(), *_scalars(master.numel(), **hyper))
    rows.wrote(master, low, m, v)

