"""How positions enter the model, chosen once when it is built: GPT-2 adds a learned table of absolute positions to
the token embeddings (an nn.Embedding in models/gpt2.py); RoPE (nanochat, Llama) has no table and rotates each head's
q and k by angles proportional to the position, so attention scores depend on relative positions only.

The rotation follows transformers' Llama layout ("rotate half"): dimension i of a head pairs with i + head_dim / 2,
and the pair rotates by position * theta^(-2i / head_dim). Positions are the model's position ids (counted from the
attention mask), so left padding, the KV cache and beam search number tokens as they do for the learned table.
"""
from __future__ import annotations

import torch
from torch import nn

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (B, 1, T, hs): broadcast over the heads


class RotaryEmbedding(nn.Module):
    """position ids (B, T) -> (cos, sin) of every position's angles, (B, 1, T, hs), in float32.

    The frequencies are recomputed on each call (head_dim / 2 values) rather than kept in a buffer, so that
    model.to(bfloat16) cannot round them and a model built on the meta device needs no buffer filled in."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor) -> Rope:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)  # (hs/2,) as transformers computes it
        angles = position_ids[..., None].float() * inv_freq  # (B, T, hs/2)
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, hs): each angle serves a pair (i, i + hs/2)
        return angles.cos(), angles.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


class NoRotary(nn.Module):
    """Learned positions: no rotation to compute."""

    def forward(self, position_ids: torch.Tensor) -> None:
        return None


class NoPositionEmbedding(nn.Module):
    """RoPE models' place of the position table: positions enter attention as rotations, so nothing is added."""

    def forward(self, position_ids: torch.Tensor) -> int:
        return 0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, nh, T, hs) and k (B, n_kv, T, hs) by their positions' angles (in their dtype)."""
    cos, sin = (t.to(query.dtype) for t in rope)
    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def no_rotary(query: torch.Tensor, key: torch.Tensor, rope: None) -> tuple[torch.Tensor, torch.Tensor]:
    """Learned positions: q and k as they are."""
    return query, key
