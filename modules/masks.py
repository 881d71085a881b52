"""The masks attention works with: positions from a padding mask, and the boolean causal + padding mask."""
from __future__ import annotations

import torch

from modules import transforms


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) 0/1 mask -> (B, S) positions counting real tokens only, so left padding does not shift them.
    Padding gets position 0 (its output is never used)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_attention_mask(attention_mask: torch.Tensor | None, num_new: int, num_cached: int) -> torch.Tensor | None:
    """2-D padding mask over cached + new tokens (B, S) -> bool (B, 1, T, S), True where a query may attend a key.

    Returns None when attention is plainly causal (no padding, and no cached tokens or a single new token), which
    lets SDPA take its fastest kernel. (Under torch.func's vmap the question is asked of every example's mask at once.)
    """
    if attention_mask is None or (num_cached == 0 or num_new == 1) and bool(transforms.unwrapped(attention_mask).all()):
        return None
    total = num_cached + num_new
    causal = torch.ones(num_new, total, dtype=torch.bool, device=attention_mask.device).tril(num_cached)
    mask = causal & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    # A padding query sees no real key; letting every query see itself keeps its softmax finite (no NaN that could
    # leak through 0 * NaN) without changing any real token's output.
    mask[..., num_cached:] |= torch.eye(num_new, dtype=torch.bool, device=mask.device)
    return mask
