"""A model's weights in transparent huge pages (2 MiB) on Linux.

Decoding reads every weight from memory once a token. In the kernel's 4 KiB pages a CPU's stream prefetchers stop
at each page's end and every 4 KiB costs a TLB entry; in 2 MiB pages neither happens. On a Zen 4 (2026-11-29, 2
threads, interleaved): gpt2's 72 block weights, one row times each in turn, read 27.6 GB/s in 4 KiB pages and 39.2
GB/s in 2 MiB ones; the same bytes as one weight 29.6 against 52.3 (bench/hugepages.py measures it on the machine at
hand). torch gives its tensors huge pages only when THP_MEM_ALLOC_ENABLE=1 is set before its first allocation, and
Linux's default THP mode ("madvise") gives them only to memory that asks for them.

`place(model)` copies a model's parameters into one anonymous mapping that asks for huge pages (madvise
MADV_HUGEPAGE before any page is touched), in the order the model lists them, each 64-byte aligned, and points each
parameter at its place there: the same Parameter objects, values, dtypes, shapes and strides; their storage changes,
as after `model.to(...)`. `from_pretrained` does this for CPU models (models/loading.py); GPT2_HUGE_PAGES=0 keeps
torch's own allocations. Where the kernel gives no transparent huge pages (THP "never", not Linux, no madvise) nothing
moves. `pack(tensors)` does the same for other tensors: the int8 / int4 copies of modules/quant.py, packed once a
generate call has made them (modules/linear.py's quantized_weights, the LM head's in models/generation.py).
"""
from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import torch

ENV = "GPT2_HUGE_PAGES"
HUGE = 2 << 20  # bytes: x86-64's transparent huge page
ALIGN = 64  # each tensor's start: a cache line
MIN_BYTES = HUGE  # less than one huge page in all gains nothing: pack() and place() leave such tensors
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS = Path("/proc/self/smaps_rollup")


def mode() -> str:
    """The kernel's THP mode ('always', 'madvise' or 'never'; the bracketed word of THP_MODE), '' where unknown."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def available() -> bool:
    """Whether weights can be asked into huge pages here: Linux with madvise(MADV_HUGEPAGE), THP not 'never', and
    GPT2_HUGE_PAGES not '0'."""
    return (os.environ.get(ENV, "1") != "0" and sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")
            and mode() in ("always", "madvise"))


def arena(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` whose start is 2 MiB aligned, in an anonymous mapping advised
    MADV_HUGEPAGE before any page is touched (the tensor keeps the mapping alive)."""
    mapping = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    return whole[start:start + nbytes]


def _span(t: torch.Tensor) -> int:
    """Bytes of storage `t`'s elements reach from its first (its strides' extent)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _view(block: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor over block[offset:] (a uint8 block of whole 64-byte lines, offset one of them) with `like`'s dtype,
    shape and strides, holding `like`'s values."""
    start = block.storage_offset() + offset  # bytes from the mapping's start (as_strided counts from there)
    out = block.view(like.dtype).as_strided(like.shape, like.stride(), start // like.element_size())
    out.copy_(like)
    return out


def _takes(t: torch.Tensor, views: bool) -> bool:
    """A tensor place() can move: on the CPU, dense, not overlapping itself, and (unless `views`) not a view into a
    larger storage (a flat parameter buffer's views keep theirs)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and t.numel() > 0
            and torch._debug_has_internal_overlap(t) == 0
            and (views or (t.untyped_storage().nbytes() == _span(t) and t.storage_offset() == 0)))


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int | None], int]:
    """Each tensor's byte offset in one block (None for a tensor place() cannot move), each 64-byte aligned, and the
    block's size."""
    offsets, total = [], 0
    for t in tensors:
        takes = _takes(t, views=True)
        offsets.append(total if takes else None)
        total += -(-_span(t) // ALIGN) * ALIGN if takes else 0
    return offsets, total


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (their dtypes, shapes and strides) packed in order into one mapping of huge pages, each
    64-byte aligned, where available() and they span MIN_BYTES or more in all (tensors place() cannot move are
    returned as they are); else `tensors` themselves."""
    if not available():
        return list(tensors)
    offsets, total = _layout(tensors)
    if total < MIN_BYTES:
        return list(tensors)
    block = arena(total)
    with torch.no_grad():
        return [t if offset is None else _view(block, offset, t) for t, offset in zip(tensors, offsets)]


def place(module: torch.nn.Module, views: bool = False) -> int:
    """Move `module`'s CPU parameters into huge pages (see the module's docstring) -> bytes moved (0 where not
    available() or less than one huge page in all would move). Gradients, optimizer states and buffers stay where
    they are, and so does a parameter that is not dense or (unless `views`: a model just loaded, whose q/k/v biases
    are slices of one checkpoint tensor) a view into a larger storage, such as a flat parameter buffer's. One
    parameter at a time, each old storage freed as its parameter leaves it where nothing else holds it: loading
    gpt2 (475 MiB) peaked at 1.34x the memory of torch's own allocations (1.69x when the whole model was copied
    before any parameter moved), and took 0.4-0.8 s longer (the kernel zeroing fresh 2 MiB pages; 0.04 s where
    they were at hand)."""
    if not available():
        return 0
    params = [p for p in module.parameters() if _takes(p.data, views)]
    offsets, total = _layout([p.data for p in params])
    if total < MIN_BYTES:
        return 0
    block = arena(total)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            p.data = _view(block, offset, p.data)
    return total


def huge_bytes() -> int:
    """This process's memory in transparent huge pages (AnonHugePages of /proc/self/smaps_rollup), bytes; 0 where
    unknown."""
    try:
        for line in SMAPS.read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
