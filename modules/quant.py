"""Weight-only int8 and int4 for decoding: each Linear's weight as int8 with one fp32 scale per output row, or as
int4 with one fp32 scale per group of 32 inputs of a row; activations untouched (fp32 or bf16).

Decoding one token streams every weight once per token, so 1 byte per weight instead of 4 (fp32) reads 4x less,
half a byte (plus 4 bytes of scale per 32 weights: 0.625 bytes a weight) 6.4x less.

int8 (Int8Weight): symmetric per output row, scale = max|row| / 127, q = round(w / scale) in -127..127.

int4 (Int4Weight), symmetric per group: the weights of row o, columns g*G .. g*G + G - 1 (G = `group`, 32 by default,
a multiple of 32 that divides in_features) share scale[o, g] = max|those weights| / 7 (an all-zero group: 1), and
q = round(w / scale) in -7..7; -8, which the 4-bit two's complement also holds, is never written (symmetric) but
reads back as -8 * scale. Two values a byte, in blocks of 32 columns: byte k of block j of a row (packed column
16j + k) holds column 32j + k in its low nibble and column 32j + 16 + k in its high nibble, each a 4-bit two's
complement. So a block's 16 bytes unpack into two 16-value vectors (AVX512) or four 8-value ones (AVX2) of
consecutive columns (modules/rows.cpp: with AVX512 each nibble indexes a table of its group's 16 dequantized values;
with AVX2 it is shifted to the top of a 32-bit lane and back; llama.cpp's Q4_0 blocks are laid out the same way,
with fp16 scales). Shapes: q uint8 (out, in / 2), scale fp32 (out, in / G).

torch's own int8 kernels (torch._weight_int8pack_mm, torch._int_mm, fbgemm's dynamic quantized Linear) read the
weights far slower than fp32 F.linear at one row on the CPU (the measurements: docs/performance.md, "Figures behind
the code"). So products of 1 to 8 rows take modules/rows.cpp (AVX2 or AVX512, built with the machine's compiler on
first use), which reads int8, converts in registers and multiplies-adds, scaling once per row. Where it cannot run
(GPT2_ROWS_KERNEL=0, no compiler) but torch has SIMD, one row takes a loop compiled by inductor instead, which on AVX2
reads the weights four bytes to a word (`_gemv_packed`: twice the byte loop's speed there, still slower than fp32,
so it warns: memory, not time, is what int8 saves that way; inductor compiles on the first call per weight shape:
seconds to a minute). Anything else dequantizes the weight to the activation's dtype (correct, slower than the float
weights: modules.linear keeps int8 to one-row products).

torch has no product that reads 4-bit weights: 1 to 8 rows of int4 take modules/rows.cpp wherever it builds (x86
with AVX2 or AVX512), everything else the dequantized weight (decoding rows that find no kernel warn, once).

w8a8 and w4a8: the same int8 and int4 weights, and the activations quantized too, dynamically, at each product: each
row's columns in blocks of 32 (the layers' inputs must be multiples of 32), d = max|block| / 127, qx = round(x / d)
to nearest even (`quantize_activations`; llama.cpp's Q8_0 blocks quantize the activations the same way, with fp16
scales). The products are then integer multiply-adds (modules/rows.cpp: AVX2's vpmaddubsw), one conversion to float
per block of 32; so the result is F.linear(quantize_activations(x), weight.dequantize(), bias) to float rounding, and
where the kernel does not run that expression is what is computed, so the numbers are the mode's on every CPU.
The prompt of a w8a8 / w4a8 generate call (more rows than the rows kernel takes) multiplies integers too, in oneDNN's
int8 GEMM with the activations quantized per tensor to 7 bits (prompt_product, below).
What each form costs in quality: bench/int8_quality.py (docs/cpu-decoding.md).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from modules import hugepages
from modules import rows as row_kernel

QUANTIZE_MODES = ("int8", "int4", "w8a8", "w4a8")  # weight-only int8 / int4; the same with int8 activations
ACTIVATION_BLOCK = row_kernel.ACTIVATION_BLOCK  # activation columns per scale (w8a8, w4a8)
INT4_BLOCK = 32  # columns per packed block of 16 bytes; a group is whole blocks


class Int8Weight(NamedTuple):
    """A (out, in) weight as int8 rows `q` and fp32 per-row `scale` (out,): weight ~= q * scale[:, None].
    int8_activations: products quantize their inputs too (quantize="w8a8")."""
    q: torch.Tensor
    scale: torch.Tensor
    int8_activations: bool = False

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


class Int4Weight(NamedTuple):
    """A (out, in) weight as 4-bit values packed two a byte `q` (out, in / 2) uint8 and fp32 `scale` (out, in / group)
    per group of `group` columns (the layout: this module's docstring): weight ~= unpacked q * scale per group.
    int8_activations: products quantize their inputs too (quantize="w4a8")."""
    q: torch.Tensor
    scale: torch.Tensor
    group: int
    int8_activations: bool = False

    def values(self) -> torch.Tensor:
        """The 4-bit values as int8 (out, in), in column order."""
        out, half = self.q.shape
        b = self.q.view(torch.int8).view(out, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)  # (out, blocks, 1, 16)
        low, high = (b << 4) >> 4, b >> 4  # arithmetic shifts of int8: each nibble sign-extended
        return torch.cat([low, high], dim=2).view(out, 2 * half)  # (out, blocks, 2, 16) -> (out, in)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, n_in = self.q.shape[0], 2 * self.q.shape[1]
        w = self.values().to(torch.float32).view(out, n_in // self.group, self.group) * self.scale[:, :, None]
        return w.view(out, n_in).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


def _check_weight(weight: torch.Tensor, what: str) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"{what} quantization takes a 2-d (out, in) weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"{what} quantization takes a floating-point weight, got {weight.dtype}")
    return weight.detach().to(torch.float32)


def _symmetric(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales along w's last dimension, max|w| / levels (1 where all are zero), and q = round(w / scale) as int8."""
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax))
    return torch.round(w / scale[..., None]).clamp_(-levels, levels).to(torch.int8), scale


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8: scale = max|row| / 127 (an all-zero row keeps scale 1), q = round(w / s)."""
    q, scale = _symmetric(_check_weight(weight, "int8"), 127)
    return Int8Weight(q.contiguous(), scale.contiguous())


def quantize_int4(weight: torch.Tensor, group: int = 32) -> Int4Weight:
    """Symmetric group-wise int4 (the layout: this module's docstring): scale = max|group| / 7 (an all-zero group
    keeps scale 1), q = round(w / scale) in -7..7, packed two a byte. `group` must be a positive multiple of 32 that
    divides in_features."""
    w = _check_weight(weight, "int4")
    out, n_in = w.shape
    if group <= 0 or group % INT4_BLOCK:
        raise ValueError(f"int4 groups must be a positive multiple of {INT4_BLOCK} columns, got group={group}")
    if n_in % group:
        raise ValueError(f"int4 quantization needs in_features divisible by the group: {n_in} features, "
                         f"group {group}")
    q, scale = _symmetric(w.view(out, n_in // group, group), 7)  # (out, groups, group), (out, groups)
    b = q.view(out, n_in // INT4_BLOCK, 2, INT4_BLOCK // 2)  # [.., 0, k]: column k of a block, [.., 1, k]: 16 + k
    packed = (b[:, :, 0] & 0x0F) | (b[:, :, 1] << 4)  # int8 arithmetic: the high nibble's sign bits fall off
    return Int4Weight(packed.view(torch.uint8).reshape(out, n_in // 2).contiguous(), scale.contiguous(), group)


def _with_int8_activations(weight: Int8Weight | Int4Weight, mode: str) -> Int8Weight | Int4Weight:
    n_in = weight.q.shape[1] * (2 if isinstance(weight, Int4Weight) else 1)
    if n_in % ACTIVATION_BLOCK:
        raise ValueError(f"{mode} quantizes activations in blocks of {ACTIVATION_BLOCK} columns: this weight takes "
                         f"{n_in} inputs, not a multiple of {ACTIVATION_BLOCK} (use int{mode[1]}: weight-only)")
    return weight._replace(int8_activations=True)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4,  # the keys are QUANTIZE_MODES
              "w8a8": lambda w: _with_int8_activations(quantize_int8(w), "w8a8"),
              "w4a8": lambda w: _with_int8_activations(quantize_int4(w), "w4a8")}


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (..., in) as w8a8 / w4a8 products see it: each row's columns in blocks of 32, d = max|block| / 127 (0 for an
    all-zero block), round(x / d) to nearest even, times d again; in x's dtype (computed in fp32). `in` must be a
    multiple of 32. modules/rows.cpp quantizes the same way (rows_quantize: the tests compare both)."""
    if x.shape[-1] % ACTIVATION_BLOCK:
        raise ValueError(f"int8 activations are quantized in blocks of {ACTIVATION_BLOCK} columns, got "
                         f"{x.shape[-1]} features")
    blocks = x.to(torch.float32).reshape(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    return (q * d).reshape(x.shape).to(x.dtype)


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
                warnings.warn("int8 decoding on a CPU without AVX512 (torch reports AVX2) through inductor's loop, "
                              "not the rows kernel (modules/rows.cpp): it saves memory, not time; its one-row product "
                              "read 1.7-2.4 GB/s of int8 weights against the kernel's 10-11 on a 2-core Zen 3 "
                              "(bench/rows_kernel.py)", stacklevel=3)
            row_kernel.keep_inductor_cache_apart()
            _compiled_packed = torch.compile(_gemv_packed, dynamic=False)
        return _compiled_packed(rows, weight.q.view(torch.float32), weight.scale)
    if _compiled_gemv is None:
        row_kernel.keep_inductor_cache_apart()
        _compiled_gemv = torch.compile(_gemv, dynamic=False)
    return _compiled_gemv(rows, weight.q, weight.scale)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                compiled: bool | None = None, packed: bool | None = None) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) for x (..., in) -> (..., out) in x's dtype. With compiled=None, 1 to 8
    rows take modules/rows.cpp where it pays (rows.pays: AVX2 or AVX512 CPUs). Otherwise a single row takes the inductor
    kernel (compiled=None: where compiled_kernel_available()), in its word-packed form where `packed` (None:
    packed_form_chosen()) and in_features divides by 4; anything else the dequantized weight."""
    global _compiled_gemv
    if x.shape[-1] != weight.q.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the int8 weight takes {weight.q.shape[1]}")
    rows = x.reshape(-1, x.shape[-1])
    if weight.int8_activations:
        return _int8_activation_linear(x, rows, weight, bias)
    if compiled is None and row_kernel.pays(torch.int8, rows.shape[0]) and row_kernel.applies(rows, weight.q):
        return row_kernel.rows_linear(x, weight.q, bias, weight.scale)
    if compiled is None:
        compiled = x.is_cpu and compiled_kernel_available()
    if rows.shape[0] == 1 and compiled and _compiled_gemv is not False:  # False: inductor failed here, said once
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
        y = y + bias.to(y.dtype)  # an fp32 bias would promote bf16 rows to fp32
    return y.reshape(*x.shape[:-1], y.shape[-1])


_warned_int4 = False  # the no-kernel warning is given once a process


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight.dequantize(x.dtype), bias) for x (..., in) -> (..., out) in x's dtype: 1 to 8 rows take
    modules/rows.cpp where it runs (rows.pays: AVX2 or AVX512), anything else the dequantized weight (made at each
    call; a one-time warning where CPU decoding rows find no kernel)."""
    global _warned_int4
    if x.shape[-1] != 2 * weight.q.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the int4 weight takes {2 * weight.q.shape[1]}")
    rows = x.reshape(-1, x.shape[-1])
    if weight.int8_activations:
        return _int8_activation_linear(x, rows, weight, bias)
    if row_kernel.pays(torch.uint8, rows.shape[0]) and row_kernel.applies(rows, weight.q):
        return row_kernel.rows_linear(x, weight.q, bias, weight.scale)
    if not _warned_int4 and rows.shape[0] <= row_kernel.MAX_ROWS and not torch.is_grad_enabled():
        _warned_int4 = True
        warnings.warn(f"int4 decoding without the int4 kernel (modules/rows.cpp takes fp32 or bf16 rows on x86 CPUs "
                      f"with AVX2 and a C++ compiler; here {x.device.type} {x.dtype}, torch's CPU capability "
                      f"{torch.backends.cpu.get_cpu_capability()}, kernel built: {row_kernel.available()}): each "
                      "product dequantizes its weight, so the outputs are int4's but slower than the float weights",
                      stacklevel=2)
    y = F.linear(rows, weight.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _int8_activation_linear(x: torch.Tensor, rows: torch.Tensor, weight: Int8Weight | Int4Weight,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """w8a8 / w4a8: 1 to 8 rows in the rows kernel's integer products where it pays for the weight's format, else
    F.linear(quantize_activations(x), weight.dequantize(), bias): the same numbers, to float rounding."""
    if row_kernel.pays(weight.q.dtype, rows.shape[0]) and row_kernel.applies(rows, weight.q):
        return run_int8_activations(x, weight, bias)
    y = F.linear(quantize_activations(rows), weight.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def run_int8_activations(x: torch.Tensor, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None = None, lib=None):
    """The rows kernel's integer product of x (1 to 8 rows) and a w8a8 / w4a8 weight (lib: another build, tests)."""
    return row_kernel.run(row_kernel.prepared(weight.q, bias, weight.scale, lib, int8_activations=True), x)


def quantize(weight: torch.Tensor, mode: str) -> Int8Weight | Int4Weight:
    """`weight` in one of QUANTIZE_MODES ("int8": per-row scales, "int4": groups of 32; "w8a8", "w4a8": the same
    weights, their products quantizing the activations to int8 in blocks of 32)."""
    if mode not in QUANTIZERS:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {mode!r}")
    return QUANTIZERS[mode](weight)


def quantized_linear(x: torch.Tensor, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None = None):
    """F.linear(x, weight.dequantize(), bias) by the product int8_linear or int4_linear chooses."""
    return (int4_linear if isinstance(weight, Int4Weight) else int8_linear)(x, weight, bias)


def prepared_quantized(weight: Int8Weight | Int4Weight, bias: torch.Tensor | None = None):
    """`weight`'s one-row product prepared in the rows kernel (rows.prepared) where the kernel pays for its format on
    this CPU, else None. It takes fp32, contiguous CPU rows; other inputs go to quantized_linear."""
    if weight.q.is_cpu and row_kernel.pays(weight.q.dtype, 1) and row_kernel.available():
        return row_kernel.prepared(weight.q, bias, weight.scale, int8_activations=weight.int8_activations)
    return None


# where the copies are kept: cached_quantized's (layers; the LM head), prompt_product's (oneDNN's packed int8),
# prompt_packed's (the C++ prompt pass's packed int8)
CACHE_NAMES = ("_quantized_cache", "_quantized_head", "_prompt_cache", "_prompt_packed")


def cached_quantized(owner: nn.Module, weight: torch.Tensor, mode: str,
                     name: str = "_quantized_cache") -> Int8Weight | Int4Weight:
    """The `mode` copy of `weight` kept on `owner` (one copy: asking for another mode replaces it), quantized again
    only when the weight changed: new storage, or a write that bumps its version (torch's in-place ops under
    no_grad, optimizer steps, the fused AdamW kernel, load_state_dict, LoRA merges). A write through `.data`
    (`p.data.copy_(w)`) has a version counter of its own that the parameter's does not see: call `clear(model)`
    after one."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, mode)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, quantize(weight, mode))
        owner.__dict__[name] = cached
    return cached[1]


def cached_copies(owned: list[tuple[str, nn.Module, torch.Tensor]], mode: str,
                  name: str = "_quantized_cache") -> list[Int8Weight | Int4Weight]:
    """cached_quantized's `mode` copy for each (label, owner, weight), in order; where any copy was made anew, all of
    them packed into one mapping of 2 MiB pages (modules/hugepages.py: the decode steps stream them as they stream
    fp32 weights; nothing moves where huge pages are not available), their cache keys kept. A weight the mode cannot
    take raises ValueError naming its label ("layer h.0.mlp", "the LM head")."""
    fresh = False
    for label, owner, weight in owned:
        before = owner.__dict__.get(name)
        try:
            cached_quantized(owner, weight, mode, name)
        except ValueError as err:
            raise ValueError(f"quantize={mode!r}: {label}: {err}") from None
        fresh |= owner.__dict__[name] is not before
    cached = [owner.__dict__[name] for _, owner, _ in owned]
    if fresh:
        flat = [t for _, weight in cached for t in (weight.q, weight.scale)]
        placed = hugepages.pack(flat)
        if placed[0] is not flat[0]:
            cached = [(key, weight._replace(q=placed[2 * i], scale=placed[2 * i + 1]))
                      for i, (key, weight) in enumerate(cached)]
            for (_, owner, _), entry in zip(owned, cached):
                owner.__dict__[name] = entry
    return [weight for _, weight in cached]


def clear(model: nn.Module) -> int:
    """Drop every int8/int4 copy kept on `model`'s modules (made again at the next quantized decode); returns how
    many there were. Needed only after writes the version counters cannot see (see cached_quantized)."""
    dropped = 0
    for module in model.modules():
        for name in CACHE_NAMES:
            dropped += module.__dict__.pop(name, None) is not None
    return dropped


# ---- the prompt's products: int8 GEMMs (w8a8, w4a8) ------------------------------------------------------------------
# Within quantized_weights(model, "w8a8" / "w4a8"), products of more rows than the rows kernel takes (the prompt of a
# quantized generate call) multiply integers too, through oneDNN's int8 GEMM (torch.ops.onednn.qlinear_pointwise):
# the weight as int8 with its per-row scales (w4a8: the int4 weight dequantized and quantized again to int8 per row),
# the activations quantized per tensor, asymmetric, to 7 bits: lo = min(min(x), 0), hi = max(max(x), 0), a zero
# point zp = round(127 * -lo / (hi - lo)) and the least scale s that keeps both ends in 0..127, q = clamp(round(x / s)
# + zp, 0, 127) (x times the fp32 1 / s, rounded to nearest, ties to even). 7 bits, not 8: without VNNI (AVX2, AVX512
# before VNNI) oneDNN multiplies u8 x s8 with vpmaddubsw, whose 16-bit pair sums saturate for u8 values above 127
# (255 x 127 x 2 > 32767: measured wrong by thousands of units on a Zen 3), so the same 7 bits everywhere make the
# same numbers on every CPU. The result is F.linear((q - zp) * s, the int8 weight dequantized, bias) to float
# rounding (integer sums are exact). On a Zen 3 (AVX2, 2 threads) gpt2's shapes ran 1.3-2.2x faster than fp32
# F.linear at 16-512 rows. Each weight keeps oneDNN's packed int8 copy beside its rows-kernel copy (one more byte a
# weight). A prompt of 2 to fast_step.INT8_PROMPT_TOKENS tokens that the C++ prompt pass takes multiplies the same
# integers in the pass's own int8 GEMM (modules/rows.cpp rows_qgemm, on prompt_packed's copy, one more byte a weight:
# a model whose prompts are both shorter and longer holds both packed copies). A prompt with a NaN or infinite
# activation is multiplied in fp32 instead (its NaN reaches the output as fp32's would). GPT2_PROMPT_INT8=0 keeps the
# prompt on the float weights, as weight-only int8 and int4 always do.
PROMPT_ENV = "GPT2_PROMPT_INT8"
PROMPT_LEVELS = 127  # the activations' greatest quantized value (7 bits)


class PromptWeight(NamedTuple):
    packed: torch.Tensor  # oneDNN's reordered int8 weight (torch.ops.onednn.qlinear_prepack)
    scale: torch.Tensor  # fp32 (out,): the int8 weight's per-row scales (symmetric: no zero points, which oneDNN's
    # x86 int8 linear does not read: zero points of 3 gave the same outputs as none)


@functools.cache
def _onednn_int8() -> str | None:
    """Why torch's oneDNN int8 linear cannot run here, or None where it does (tried once on a small product)."""
    if not torch.backends.mkldnn.is_available():
        return "torch is built without oneDNN"
    try:
        w = torch.ops.onednn.qlinear_prepack(torch.ones(4, 32, dtype=torch.int8), None)
        y = torch.ops.onednn.qlinear_pointwise(torch.full((9, 32), 3, dtype=torch.uint8), 0.5, 1, w,
                                               torch.ones(4, dtype=torch.float32), None, None, 1.0, 0, torch.float32,
                                               "none", [], "")
    except Exception as err:  # noqa: BLE001  (an op missing from this build, a CPU oneDNN refuses)
        return f"torch's oneDNN int8 linear does not run here ({type(err).__name__}: {str(err)[:200]})"
    if not torch.equal(y, torch.full((9, 4), 32.0)):
        return "torch's oneDNN int8 linear gave a wrong result on a test product"
    return None


def prompt_products_why_not() -> str | None:
    """Why the prompt's int8 products are not taken here (GPT2_PROMPT_INT8=0, a CPU torch reports without SIMD,
    oneDNN's int8 linear missing or wrong), or None where they are."""
    if os.environ.get(PROMPT_ENV) == "0":
        return f"{PROMPT_ENV}=0"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return "CPU capability DEFAULT (no SIMD): oneDNN's int8 speed there is not measured"
    return _onednn_int8()


def prompt_scale(lo: float, hi: float) -> tuple[float, int]:
    """The per-tensor scale and zero point for activations whose least and greatest values are lo and hi (see above):
    the range widened to hold 0, then the zero point an integer and the scale the least that keeps lo and hi within
    0..127. An all-zero tensor: (1.0, 0)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi == lo:
        return 1.0, 0
    zp = round(PROMPT_LEVELS * -lo / (hi - lo))
    return max(hi / (PROMPT_LEVELS - zp) if zp < PROMPT_LEVELS else 0.0, -lo / zp if zp > 0 else 0.0), zp


def quantize_prompt_activations(x: torch.Tensor, lib=None) -> tuple[torch.Tensor, float, int] | None:
    """x (rows, in), fp32 and contiguous, quantized as the prompt's products take it: (q uint8 (rows, in), scale,
    zero point), or None where x holds a NaN or an infinity (or a range too small for an fp32 scale). In
    modules/rows.cpp (one pass for the range, one for the values) where it is built, else in torch: the same bits.
    lib: a loaded rows kernel to use, False for torch's ops (tests); default: this machine's kernel if built."""
    lib = row_kernel._load() if lib is None else lib
    n, threads = x.numel(), torch.get_num_threads()
    if lib:
        lo_hi = torch.empty(2, dtype=torch.float32)  # (not the default dtype: a user may have set float64)
        if lib.rows_minmax(x.data_ptr(), n, lo_hi.data_ptr(), threads):
            return None
        lo, hi = lo_hi.tolist()
    else:
        lo, hi = (v.item() for v in torch.aminmax(x))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None
    scale, zp = prompt_scale(lo, hi)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    if not torch.isfinite(inv):
        return None
    if lib:
        q = torch.empty(x.shape, dtype=torch.uint8)
        lib.rows_quantize_u7(x.data_ptr(), n, inv.item(), zp, q.data_ptr(), threads)
    else:
        q = torch.clamp(torch.round(x * inv) + zp, 0, PROMPT_LEVELS).to(torch.uint8)
    return q, scale, zp


def _as_int8(weight: Int8Weight | Int4Weight) -> Int8Weight:
    """The int8 weight the prompt's products read: int8 as is, int4 dequantized and quantized to int8 per row."""
    return weight if isinstance(weight, Int8Weight) else quantize_int8(weight.dequantize())


def _kept_key(layer: nn.Module):
    """The key of the quantized copy cached_quantized keeps on `layer`, or None where the layer's copy is not that
    one (made outside cached_quantized): a copy derived from it is then made without a cache entry."""
    kept = layer.__dict__.get("_quantized_cache")
    return kept[0] if kept is not None and kept[1] is layer.quantized else None


def prompt_weight(*weights: Int8Weight | Int4Weight) -> PromptWeight:
    """`weights` as the prompt's int8 GEMM reads them, their rows stacked (several layers that take the same input:
    one product): int8 per-row as is, int4 dequantized and quantized to int8."""
    w8 = [_as_int8(w) for w in weights]
    q, scale = torch.cat([w.q for w in w8]), torch.cat([w.scale.float() for w in w8])
    return PromptWeight(torch.ops.onednn.qlinear_prepack(q, None), scale)


def prompt_linear(x: torch.Tensor, weight: PromptWeight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x (..., in) fp32 on the CPU times the prepared weight, with x quantized per tensor (see above) -> (..., out)
    fp32; None where x holds a NaN or an infinity (the caller multiplies in fp32)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    quantized = quantize_prompt_activations(rows)
    if quantized is None:
        return None
    q, scale, zp = quantized
    if bias is not None:
        bias = bias.detach().float().contiguous()
    y = torch.ops.onednn.qlinear_pointwise(q, scale, zp, weight.packed, weight.scale, None, bias, 1.0, 0,
                                           torch.float32, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def prompt_takes(layers: Sequence[nn.Module], x: torch.Tensor) -> bool:
    """Whether the prompt's int8 GEMM takes x for `layers` (Linears within quantized_weights; any other module,
    a LoRA layer, is never taken): w8a8 / w4a8 copies, no gradient, x fp32 on the CPU, a prompt (2+ positions a
    sequence: (..., T, in) with T > 1) or more rows than the rows kernel takes (a batched step of 9+ rows), and the
    GEMM runs here. A decode step of 1-8 rows ((B, 1, in)) keeps the rows kernel's one-row copies (batch 1) or the
    float weights."""
    return (x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled()
            and (x.shape[:-1].numel() > row_kernel.MAX_ROWS or (x.dim() >= 2 and x.shape[-2] > 1))
            and all(getattr(layer, "quantized", None) is not None and layer.quantized.int8_activations
                    for layer in layers)  # getattr: a LoRA layer (modules/lora.py) has no quantized copy
            and prompt_products_why_not() is None)


def prompt_product(owner: nn.Module, layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor | None:
    """The prompt's int8 product of `layers` (Linears within quantized_weights that take the same input x: one
    layer, or a block's query, key and value as one GEMM, their outputs side by side) -> (..., sum of out), or None
    where it is not taken (prompt_takes; a non-finite activation): the caller then multiplies by the float weights.
    oneDNN's packed copy is kept on `owner` and made again when any layer's quantized copy is (its key is theirs);
    a layer whose quantized copy is not the one kept on it (made outside cached_quantized) leaves nothing cached.
    Stacking changes no number: each output is its own row's integer sum and scales."""
    if not prompt_takes(layers, x):
        return None
    keys = [_kept_key(layer) for layer in layers]
    key = None if None in keys else tuple(keys)
    cached = owner.__dict__.get("_prompt_cache")
    if cached is None or key is None or cached[0] != key:
        cached = (key, prompt_weight(*(layer.quantized for layer in layers)))
        if key is not None:
            owner.__dict__["_prompt_cache"] = cached
    bias = None if all(layer.bias is None for layer in layers) else torch.cat(
        [torch.zeros(layer.out_features) if layer.bias is None else layer.bias.detach().float() for layer in layers])
    return prompt_linear(x, cached[1], bias)


def prompt_packed(layer: nn.Module, lib=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A w8a8 / w4a8 layer's weight as the C++ prompt pass's int8 products read it (modules/rows.cpp,
    rows_qgemm_pack: tiles of 16 rows in interleaved pairs, each row's sum after them) -> (packed bytes, per-row
    scales fp32): the int8 weight oneDNN's path reads (prompt_weight's: w4a8 dequantized and quantized again to int8
    per row), so both multiply the same integers. Kept on the layer and made again when its quantized copy is (the
    copy's key, as prompt_product keeps oneDNN's); None for a layer without an int8-activation copy. lib: a loaded
    rows kernel (default: the prompt's); every build packs alike."""
    copy = getattr(layer, "quantized", None)
    if copy is None or not copy.int8_activations:
        return None
    key = _kept_key(layer)
    cached = layer.__dict__.get("_prompt_packed")
    if cached is not None and key is not None and cached[0] == key:
        return cached[1]
    lib = lib or row_kernel.prompt_library()
    w8 = _as_int8(copy)
    out, width = w8.q.shape
    packed = torch.empty(lib.rows_qgemm_bytes(out, width), dtype=torch.int8)
    if lib.rows_qgemm_pack(w8.q.contiguous().data_ptr(), out, width, packed.data_ptr()) != 0:
        raise ValueError(f"the prompt's int8 products take inputs in multiples of 4, this weight has {width}")
    made = (packed, w8.scale.float().reshape(-1).contiguous())
    if key is not None:
        layer.__dict__["_prompt_packed"] = (key, made)
    return made
