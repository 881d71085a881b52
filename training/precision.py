"""Autocast for training and evaluation: the dtypes a run may ask for, and whether bf16 is fast on this device."""
from __future__ import annotations

import contextlib
import warnings

import torch

BF16_WEIGHTS = "bf16-weights"  # the weights themselves in bf16, fp32 masters in the optimizer, no autocast
DTYPES = ("float32", "bfloat16", "float16", BF16_WEIGHTS)


def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """False on CPUs without bf16 matrix instructions (AVX512-BF16 / AMX), where bf16 runs far slower than fp32."""
    if torch.device(device).type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def autocast(device: torch.device | str, bf16: bool = False, fp16: bool = False):
    """bf16 or fp16 autocast on `device` (parameters stay fp32), or nothing."""
    device = torch.device(device)
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 exclude each other: pick one")
    if bf16 and not bf16_matmul_is_fast(device):
        warnings.warn("--bf16 on a CPU without bf16 matrix instructions (no AVX512-BF16/AMX): bf16 matmuls run much "
                      "slower than fp32 here; drop --bf16 for speed", stacklevel=2)
    if bf16 or fp16:
        return torch.autocast(device.type, dtype=torch.bfloat16 if bf16 else torch.float16)
    return contextlib.nullcontext()
