"""bf16 inference on CPUs with AMX: linear layers with their weights kept in oneDNN's blocked layout.

`F.linear` on bf16 CPU tensors hands the weight to oneDNN, which reorders it into the blocked layout its AMX kernels
read, at every call. For bf16 inputs of at least MIN_ROWS rows without gradients (an evaluation forward, a long
prompt), ours keeps that reordered copy instead: made on first use, made again when the weight changes (new storage,
or an in-place update that bumps its version, the fused AdamW kernel's included; edits through `.data` do not,
so call `clear(model)` or `modules.linear.clear_derived_weights(model)` after them: docs/paths.md). The
attention's query, key and value weights are packed as one (3 C, C) weight, one product instead of three.

Cost: a second copy of every weight used so (gpt2 in bf16: about 250 MB), kept for the modules (not in them:
copy.deepcopy of a model sees none). Outputs: the same
oneDNN products in another layout, equal to F.linear's for a layer (the fused q/k/v product may round differently).
Taken only on CPUs whose flags show AMX-BF16, where it was measured (docs/performance.md); GPT2_PACKED_BF16=0 turns
it off, GPT2_PACKED_BF16=force turns it on wherever oneDNN has bf16 kernels (AVX512-BF16 CPUs too: how
tests/test_packed.py checks its outputs on a CPU without AMX). On a Zen 4 (AVX512-BF16) forcing it measured 1.05-1.09x
for gpt2's bf16 forward at 8 x 128 and 1.03x at 1 x 512 (interleaved in one process, three runs, outputs bitwise
equal; 2026-11-29): not worth its 250 MB of copies by default there. Decoding (one row per step) is not affected:
it takes modules/rows.py's kernel or torch's products.
"""
from __future__ import annotations

import functools
import os
import weakref

import torch
from torch import nn

from modules.rows import has_cpu_flag

MIN_ROWS = 64
ENV = "GPT2_PACKED_BF16"
# module -> {name: (key, packed weight, bias)}. Outside the modules: oneDNN's packed tensors are opaque (no storage),
# so copy.deepcopy(model) would fail on them; a copied model simply packs again.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _amx_bf16() -> bool:
    return has_cpu_flag("amx_bf16") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def _bf16_kernels() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def available() -> bool:
    """Whether packed bf16 products are used here: a CPU with AMX-BF16 and GPT2_PACKED_BF16 not 0, or any CPU with
    oneDNN bf16 kernels where GPT2_PACKED_BF16=force."""
    setting = os.environ.get(ENV, "1")
    return _bf16_kernels() if setting == "force" else setting != "0" and _amx_bf16()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 x of MIN_ROWS or more rows and a bf16 weight, on the CPU, without gradients, where available()."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu and weight.is_cpu
            and not torch.is_grad_enabled() and x.numel() >= MIN_ROWS * x.shape[-1] and available())


def weights(owner: nn.Module, parts: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...], name: str,
            rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The packed weight of `parts` stacked along the output dimension, and their biases concatenated, kept for
    `owner` under `name` and made again when any of them changed. rows: a row count oneDNN picks its layout for."""
    key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in (*parts, *biases) if t is not None)
    kept_here = _KEPT.setdefault(owner, {})
    cached = kept_here.get(name)
    if cached is None or cached[0] != key:
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)
        bias, present = None, [b is not None for b in biases]
        if any(present) and not all(present):
            raise ValueError("packed parts must all have a bias or none")
        if all(present):
            bias = biases[0] if len(biases) == 1 else torch.cat(biases)
            bias = bias.detach().contiguous()
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows), bias)
        kept_here[name] = cached
    return cached[1], cached[2]


def product(owner: nn.Module, name: str, x: torch.Tensor, parts: tuple[torch.Tensor, ...],
            biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """x (..., in) times `parts` stacked along the output dimension, plus their biases -> (..., out), through the
    packed copy kept for `owner` under `name` (see `weights`; oneDNN's row hint: x's second-to-last dimension)."""
    weight, bias = weights(owner, parts, biases, name, x.shape[-2])
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def kept(model: nn.Module) -> list[str]:
    """The names of the packed copies kept for `model`'s modules, sorted."""
    return sorted(name for module in model.modules() for name in _KEPT.get(module, {}))


def clear(model: nn.Module) -> int:
    """Drop every packed copy kept for `model`'s modules (their memory); returns how many there were."""
    dropped = 0
    for module in model.modules():
        dropped += len(_KEPT.pop(module, {}))
    return dropped
