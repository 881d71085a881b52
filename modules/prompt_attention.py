"""Causal attention of a prompt in one kernel call (modules/rows.cpp, `rows_attend_prompt`): for inference in fp32 or
bf16 on the CPU, where torch's SDPA runs the flash kernel for CPUs.

A prompt's pass (generate's prefill, an evaluation's forward) attends each query to the keys up to itself. The
kernel takes one head's block of 16 queries (AVX512; 8 in the AVX2 build) a task, reads only the keys up to the
block's last query, and keeps the scores of the block's queries for one key in one vector (one query a lane), so the
softmax and the weighted sum of the values run without horizontal sums (the comment above `rows_attend_prompt`).
gpt2's 12 layers at 512 tokens on a Zen 4 (2 threads, 2026-12-01): 34 ms against SDPA's 70-80. The same values to
float rounding (another summation order; exp by a polynomial within 2 float roundings): tests/test_prompt_attention.py
holds it to SDPA and to float64. bf16 tensors (a bf16 model's evaluation or prompt): every value widened to fp32, the
sums, softmax and weighted sum in fp32, the output rounded to bf16 once, as SDPA's bf16 CPU kernel does; gpt2's 12
layers at 8 x 128 tokens on a Zen 5 (2 threads, 2026-12-05): SDPA's bf16 kernel 3.2-4.0 ms a layer, this 1.9.

Taken by `CausalSelfAttention.forward` where SDPA would run causal attention over the new tokens alone (no cached
tokens before them, no mask): query, key and value of one dtype, fp32 or bf16 (bf16 off AMX: there torch's bf16
SDPA can multiply in AMX's tiles, and no AMX machine has timed the kernel against it; GPT2_PROMPT_ATTENTION=force
takes it there too), on the CPU, no gradient to take
(grad mode off, or nothing requiring one), as many key/value heads as query heads, a head size that is a multiple of
the vector width (every GPT-2 size's 64), the last dimension contiguous, outside torch.compile and torch.func, the
rows kernel built, and GPT2_PROMPT_ATTENTION not 0. Anywhere else SDPA (or the explicit path where the model takes
it) runs as before.
"""
from __future__ import annotations

import os

import torch

from modules import rows, transforms

ENV = "GPT2_PROMPT_ATTENTION"
MAX_HEAD = 256  # rows.cpp's kMaxHead: the largest head size the kernel takes
KERNELS = {torch.float32: "rows_attend_prompt", torch.bfloat16: "rows_attend_prompt_bf16"}  # rows.cpp's, by dtype


def available() -> bool:
    """Whether the kernel is switched on (GPT2_PROMPT_ATTENTION not 0) and built here."""
    return os.environ.get(ENV) != "0" and rows.available()


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether attend() takes these (B, H, T, hs) tensors (see the module's docstring for the rest of the rule)."""
    tensors = (query, key, value)
    return (query.dtype in KERNELS
            and all(t.dtype == query.dtype and t.device.type == "cpu" and t.dim() == 4 and t.stride(-1) == 1
                    for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and query.shape == key.shape == value.shape and query.shape[2] > 1
            and not transforms.active() and available() and takes_head(query.shape[3])
            and (query.dtype == torch.float32 or os.environ.get(ENV) == "force" or not rows.has_cpu_flag("amx_bf16")))


def takes_head(size: int) -> bool:
    """Whether the kernel takes heads of `size` values: a multiple of its vector width, at most MAX_HEAD (the
    kernel built here)."""
    return size % rows._load().rows_vector_width() == 0 and size <= MAX_HEAD


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, lib=None) -> torch.Tensor:
    """Causal attention of query over key and value, each (B, H, T, hs) with the last dimension contiguous ->
    (B, T, H * hs), as `F.scaled_dot_product_attention(..., is_causal=True, scale=scale)` then
    `.transpose(1, 2).flatten(2)`, in their dtype (fp32 or bf16, all three the same). lib: the kernel's build
    (default the native one; tests pass the AVX2 form)."""
    dtypes = {t.dtype for t in (query, key, value)}
    if len(dtypes) != 1 or query.dtype not in KERNELS:
        raise ValueError(f"the prompt attention kernel takes query, key and value all float32 or all bfloat16, got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}")
    B, H, T, hs = query.shape
    out = torch.empty(B, T, H * hs, dtype=query.dtype)
    strides = [torch.tensor(t.stride()[:3], dtype=torch.int64) for t in (query, key, value)]
    lib = lib or rows._load()
    kernel = getattr(lib, KERNELS[query.dtype])
    if kernel(query.data_ptr(), key.data_ptr(), value.data_ptr(), *(s.data_ptr() for s in strides), B, H, T, hs, scale,
              out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"the prompt attention kernel takes head sizes that are multiples of "
                         f"{lib.rows_vector_width()} up to {MAX_HEAD}, got {hs}")
    return out
