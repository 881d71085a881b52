"""The norms a block can use: GPT-2's LayerNorm or RMSNorm (nanochat, Llama), chosen once when a layer is built."""
from __future__ import annotations

import torch
from torch import nn

from modules.layer_norm import LayerNorm
from modules.manual_backward import ManualLayerNorm
from modules.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) over the last dimension, times a learnable scale when `scale` (no mean is taken out,
    no shift is added). scale=False is nanochat's parameter-free norm."""

    def __init__(self, dim: int, eps: float = 1e-5, scale: bool = True):
        super().__init__()
        self.normalized_shape, self.eps = (dim,), eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Computed in float32 or wider (as Llama's RMSNorm; a no-op cast for float32 and float64 inputs), returned in
        x's dtype: under bf16 autocast or in a bf16 model the statistics keep full precision and the dtypes agree."""
        wide = torch.promote_types(x.dtype, torch.float32)
        weight = None if self.weight is None else self.weight.to(wide)
        return rms_norm(x.to(wide), weight, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, scale={self.weight is not None}"


def make_norm(config, dim: int | None = None) -> nn.Module:
    """The norm `config` asks for, over `dim` features (default n_embd): LayerNorm (GPT-2; learnable scale and, with
    bias, shift; modules/layer_norm.py's, which takes the rows kernel in a bf16 CPU training step) or RMSNorm (learnable
    scale with norm_scale)."""
    dim = dim or config.n_embd
    if config.backward == "manual":  # GPT-2 only (the config checks): the hand-derived LayerNorm
        return ManualLayerNorm(dim, eps=config.layer_norm_epsilon)
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=config.layer_norm_epsilon, scale=config.norm_scale)
    return LayerNorm(dim, eps=config.layer_norm_epsilon, elementwise_affine=config.norm_scale, bias=config.bias)
