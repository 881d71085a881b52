"""Autocast for training and evaluation: the dtypes a run may ask for, and whether bf16 is fast on this device."""
from __future__ import annotations

import contextlib
import platform
import warnings

import torch

BF16_WEIGHTS = "bf16-weights"  # the weights themselves in bf16, fp32 masters in the optimizer, no autocast
DTYPES = ("float32", "bfloat16", "float16", BF16_WEIGHTS)


def bf16_matmul_is_fast(device: torch.device | str) -> bool:
    """False on CPUs without bf16 matrix instructions (AVX512-BF16 / AMX), where bf16 runs far slower than fp32.
    oneDNN runs bf16 products on any AVX512 CPU, in fp32 units (torch's `_is_mkldnn_bf16_supported()` is True on an
    Ice Lake Xeon, where a bf16-weights pretraining run took 2.3x fp32's time: docs/performance.md), so on x86 the
    CPU's flags decide (modules/rows.py's cpu_flags: /proc/cpuinfo, or GPT2_CPU_FLAGS), and oneDNN must have bf16
    kernels too (ONEDNN_MAX_CPU_ISA may hold it below AVX512); elsewhere (ARM's bf16) oneDNN's check alone."""
    if torch.device(device).type != "cpu":
        return True
    onednn, units = _onednn_bf16(), _bf16_units()
    return onednn if units is None else onednn and units


def _onednn_bf16() -> bool:
    """Whether oneDNN has bf16 kernels here (on x86: an AVX512 CPU, unless ONEDNN_MAX_CPU_ISA holds it lower)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def _bf16_units() -> bool | None:
    """Whether this x86 CPU has bf16 matrix instructions (avx512_bf16 or amx_bf16); None off x86."""
    from modules.rows import cpu_flags, has_cpu_flag

    if cpu_flags().startswith("flags"):
        return has_cpu_flag("avx512_bf16", "amx_bf16")
    if platform.machine().lower() in ("x86_64", "amd64"):  # x86 without /proc/cpuinfo: torch's cpuinfo
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return None


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
