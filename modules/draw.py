"""Sampling's draw of one token per row: the token torch.multinomial(probs, 1, generator=g) draws, and the generator
left where torch leaves it, without torch's 50,257 logarithms a row (modules/draw.cpp says how).

    tokens = draw.multinomial(probs, generator)   # == torch.multinomial(probs, 1, generator=generator).squeeze(1)

On a 2-core Zen 4 torch.multinomial takes 1.3-1.4 ms for one row of gpt2's vocabulary (its logarithms ~1.0), ~6% of
a sampled gpt2 token; the kernel about 0.2 ms, from one non-zero probability to 50,257 (`python bench/sampling.py`
times sampling's whole work per token).
It runs for contiguous CPU float32 probabilities (1 or 2 dims) and a CPU generator (None: torch's default one, as
torch.multinomial takes). Anything else, rows torch would refuse (NaN, infinity, negative, all zero: torch raises its
own error), GPT2_FAST_DRAW=0, no compiler, or a torch whose draws the kernel does not reproduce (checked once a
process against torch.multinomial on a scratch generator) runs torch.multinomial itself. Like any reader of
`get_state()`, it is not for a generator another thread draws from at the same moment.
"""
from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import torch

from modules import rows

SOURCE = Path(__file__).with_name("draw.cpp")
ENV = "GPT2_FAST_DRAW"
_library = None  # the loaded library; False once it could not be built, or disagreed with torch, here


def library(target_flags: tuple[str, ...] = rows.NATIVE):
    lib = ctypes.CDLL(str(rows._build(target_flags, SOURCE, ("-ffp-contract=off",))))
    lib.draw_tokens.restype = ctypes.c_int
    lib.draw_tokens.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p]
    return lib


def agrees(lib) -> bool:
    """Whether the kernel draws torch.multinomial's tokens and leaves the generator in torch's state, on three rows
    (all 700 probabilities positive; the first 50 only, as top-p leaves a row; a single one), from a fresh seed (its
    first twist pending) and from an odd position (a token's two words split by a twist inside the first row)."""
    probs = torch.arange(3 * 700, dtype=torch.float32).view(3, 700).remainder(97) + 1  # 1 to 97, no zeros
    probs[1, 50:] = 0.0
    probs[2, 1:] = 0.0
    for seed, skip in ((1, 0), (2, 1001)):
        theirs, ours = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for g in (theirs, ours):
            torch.empty(skip).uniform_(generator=g)
        expected = torch.multinomial(probs, 1, generator=theirs).squeeze(1)
        tokens = _draw(lib, probs, ours)
        if tokens is None or not torch.equal(tokens, expected):
            return False
        if not torch.equal(ours.get_state(), theirs.get_state()):
            return False
    return True


def _load():
    global _library
    if _library is None:
        _library = rows.load_kernel(ENV, library, "the sampling draw kernel modules/draw.cpp",
                                    "sampling draws with torch.multinomial")
        if _library and not agrees(_library):
            warnings.warn(f"the sampling draw kernel modules/draw.cpp does not reproduce torch {torch.__version__}'s "
                          "multinomial here; sampling draws with torch.multinomial", stacklevel=3)
            _library = False
    return _library


def available() -> bool:
    return bool(_load())


def _draw(lib, probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """The kernel's tokens for contiguous 2-D float32 rows (the generator advanced), or None where torch must draw
    (nothing changed then)."""
    state = generator.get_state()
    out = torch.empty(probs.shape[0], dtype=torch.long)
    code = lib.draw_tokens(probs.data_ptr(), probs.shape[0], probs.shape[1], probs.shape[1], state.data_ptr(),
                           out.data_ptr())
    if code != 0:
        return None
    generator.set_state(state)
    return out


def applies(probs: torch.Tensor, generator: torch.Generator | None) -> bool:
    # contiguous: torch draws in the order of memory (empty_like keeps a permuted tensor's strides)
    return (probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() in (1, 2)
            and probs.is_contiguous() and probs.numel() > 0 and not probs.requires_grad
            and (generator is None or generator.device.type == "cpu") and available())


def multinomial(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """torch.multinomial(probs, 1, generator=generator) without its sample dimension: (B, V) -> (B,), (V,) -> ()."""
    if applies(probs, generator):
        tokens = _draw(_load(), probs.reshape(-1, probs.shape[-1]), generator or torch.default_generator)
        if tokens is not None:
            return tokens.reshape(probs.shape[:-1])
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
