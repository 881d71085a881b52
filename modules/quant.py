"""Weight-only int8 for decoding: each Linear's weight as int8 with one fp32 scale per output row (symmetric,
scale = max|row| / 127), activations untouched (fp32 or bf16).

Decoding one token streams every weight once per token, so 1 byte per weight instead of 4 (fp32) reads 4x less.
torch's own int8 kernels (torch._weight_int8pack_mm, torch._int_mm, fbgemm's dynamic quantized Linear) read the
weights far slower than fp32 F.linear at one row on the CPU (the measurements: docs/performance.md, "Figures behind
the code"). So one-row products take a kernel of ours that reads int8, converts in registers and multiplies-adds,
scaling once per row: on AVX512 CPUs modules/rows.cpp (built with the machine's compiler on first use); elsewhere
with SIMD (torch's capability AVX2) a loop compiled by inductor, which on AVX2 reads the weights four bytes to a
word (`_gemv_packed`: twice the byte loop's speed there, still slower than fp32, so it warns: memory, not time, is
what int8 saves on such a CPU; inductor compiles on the first call per weight shape: seconds to a minute).
Without a working compiler, and for several rows, the weight is dequantized to the activation's dtype (correct,
slower than the float weights: modules.linear keeps int8 to one-row products).
"""
from __future__ import annotations

import sys
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from modules import rows as row_kernel

QUANTIZE_MODES = ("int8",)


class Int8Weight(NamedTuple):
    """A (out, in) weight as int8 rows `q` and fp32 per-row `scale` (out,): weight ~= q * scale[:, None]."""
    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8: scale = max|row| / 127 (an all-zero row keeps scale 1), q = round(w / s)."""
    if weight.dim() != 2:
        raise ValueError(f"int8 quantization takes a 2-d (out, in) weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"int8 quantization takes a floating-point weight, got {weight.dtype}")
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def _gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (1, in) times int8 q (out, in) -> (1, out) in fp32: written as a broadcast product and a sum so inductor
    fuses it into one loop that reads each int8 weight once (the eager form would build an (out, in) product)."""
    return (x.to(torch.float32)[:, None, :] * q.to(torch.float32)).sum(-1) * scale


def _gemv_packed(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """_gemv with the int8 weights read four to a 32-bit word: `packed` is q's bytes viewed as float32 (out, in/4),
    so the loop loads full float vectors; byte k of word j (little-endian) is q[:, 4j + k], sign-extended by shifts.
    AVX2 builds of torch's vector library load int8 and int32 vectors through a temporary buffer, which made the
    byte form slower than fp32 on an AVX2-only CPU (docs/performance.md)."""
    words = packed.view(torch.int32)  # (out, in/4)
    xt = x.to(torch.float32).view(-1, 4).t()  # (4, in/4): xt[k, j] = x[0, 4j + k]
    acc = xt[0] * ((words << 24) >> 24).to(torch.float32)
    for k in range(1, 4):
        acc = acc + xt[k] * ((words << (24 - 8 * k)) >> 24).to(torch.float32)
    return (acc.sum(-1) * scale)[None]


_compiled_gemv = None  # torch.compile(_gemv), made on first use; False once it failed here (eager from then on)
_compiled_packed = None  # torch.compile(_gemv_packed), likewise


def packed_form_chosen() -> bool:
    """Where the word-packed loop is used: CPUs whose best vector width torch reports as AVX2 (little-endian);
    with AVX512 the byte loop is kept (its measurement: docs/performance.md, "Figures behind the code")."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2" and sys.byteorder == "little"


def compiled_kernel_available() -> bool:
    """The one-row kernel needs SIMD to pay (torch's CPU capability AVX2 or better) and inductor's compiler."""
    return _compiled_gemv is not False and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def _compiled_product(rows: torch.Tensor, weight: "Int8Weight", packed: bool) -> torch.Tensor:
    global _compiled_gemv, _compiled_packed
    if packed and weight.q.shape[1] % 4 == 0:
        if _compiled_packed is None:
            if packed_form_chosen():
                warnings.warn("int8 decoding on a CPU without AVX512 (torch reports AVX2): the int8 kernel saves "
                              "memory, not time, here; gpt2 greedy batch 1 measured 22.5 tok/s int8 against 33.7 fp32 on "
                              "a 2-core Zen 3 (docs/performance.md)", stacklevel=3)
            _compiled_packed = torch.compile(_gemv_packed, dynamic=False)
        return _compiled_packed(rows, weight.q.view(torch.float32), weight.scale)
    if _compiled_gemv is None:
        _compiled_gemv = torch.compile(_gemv, dynamic=False)
    return _compiled_gemv(rows, weight.q, weight.scale)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                compiled: bool | None = None, packed: bool | None = None) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) for x (..., in) -> (..., out) in x's dtype. With compiled=None, 1 to 8
    rows take modules/rows.cpp where it pays (rows.pays: AVX512 CPUs). Otherwise a single row takes the inductor
    kernel (compiled=None: where compiled_kernel_available()), in its word-packed form where `packed` (None:
    packed_form_chosen()) and in_features divides by 4; anything else the dequantized weight."""
    global _compiled_gemv
    if x.shape[-1] != weight.q.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the int8 weight takes {weight.q.shape[1]}")
    rows = x.reshape(-1, x.shape[-1])
    if compiled is None and row_kernel.pays(torch.int8, rows.shape[0]) and row_kernel.applies(rows, weight.q):
        return row_kernel.rows_linear(x, weight.q, bias, weight.scale)
    if compiled is None:
        compiled = x.is_cpu and compiled_kernel_available()
    if rows.shape[0] == 1 and compiled:
        try:
            y = _compiled_product(rows, weight, packed_form_chosen() if packed is None else packed)
        except Exception as err:  # no working C++ compiler, inductor unavailable: keep decoding, eagerly
            warnings.warn(f"int8 decoding: the compiled kernel failed ({type(err).__name__}: {err}); "
                          "using dequantized weights instead (slower)", stacklevel=2)
            _compiled_gemv = False
            return int8_linear(x, weight, bias, compiled=False)
        y = y.to(x.dtype)
    else:
        y = F.linear(rows, weight.dequantize(x.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def prepared_int8(weight: Int8Weight, bias: torch.Tensor | None = None):
    """`weight`'s one-row product prepared in the rows kernel (rows.prepared) where the kernel pays for int8 on this
    CPU, else None. It takes fp32, contiguous CPU rows; other inputs go to int8_linear."""
    if weight.q.is_cpu and row_kernel.pays(torch.int8, 1) and row_kernel.available():
        return row_kernel.prepared(weight.q, bias, weight.scale)
    return None


def cached_int8(owner: nn.Module, weight: torch.Tensor, name: str = "_int8_cache") -> Int8Weight:
    """The int8 copy of `weight` kept on `owner`, quantized again only when the weight changed (new storage or an
    in-place update: training steps and load_state_dict are seen)."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, quantize_int8(weight))
        owner.__dict__[name] = cached
    return cached[1]

