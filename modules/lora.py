"""LoRA (Hu et al. 2021): a frozen nn.Linear plus a trainable low-rank update, y = x W^T + b + s * (drop(x) A^T) B^T.

LoRALinear *is* an nn.Linear (it keeps the wrapped layer's `weight` and `bias` Parameters under the same names), so a
model's state-dict keys, its HF converter and its forward pass are unchanged; the adapter adds `lora_A` (r, in) and
`lora_B` (out, r). Initialised as PEFT does (A Kaiming-uniform, B zero), so a new adapter starts as the identity.
Several LoRALinear may share one `lora_A` Parameter: that is how q/k/v represent transformers' fused `c_attn` adapter.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modules import transposed
from modules.linear import Linear


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 lora_A: nn.Parameter | None = None, use_rslora: bool = False):
        nn.Module.__init__(self)  # no fresh weights: adopt the base layer's Parameters
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha, self.use_rslora = rank, float(alpha), use_rslora
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank  # PEFT's rule, rsLoRA included
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        if lora_A is None:
            lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
            nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5))  # nn.Linear's init, as PEFT's default
        if lora_A.shape != (rank, self.in_features):
            raise ValueError(f"a shared lora_A has shape {tuple(lora_A.shape)}, expected {(rank, self.in_features)}")
        self.lora_A = lora_A
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        self.lora_dropout = nn.Dropout(dropout)
        self.merged = False  # True while W holds W + s * B A (forward then skips the adapter)

    def delta_weight(self) -> torch.Tensor:
        """s * B A: (out, in), the change the adapter makes to the weight."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the frozen base: in fp32 training, oneDNN's products where they timed faster (modules/onednn.py)
        out = transposed.linear(x, self.weight, self.bias)
        if self.merged:
            return out
        h = F.linear(self.lora_dropout(x) if self.lora_dropout.p else x, self.lora_A)  # (..., r)
        # out + s * h B^T as one GEMM with the add and the scaling fused: two fewer passes over the (..., out)
        # activations, which is most of what the adapter costs beyond the base layer.
        return torch.addmm(out.flatten(0, -2), h.flatten(0, -2), self.lora_B.t(), alpha=self.scaling).view_as(out)

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            self.weight += self.delta_weight().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight -= self.delta_weight().to(self.weight.dtype)
            self.merged = False

    def to_linear(self) -> nn.Linear:
        """The model's own Linear (modules/linear.py, with its decoding kernels and int8/int4 copies, as a layer
        loaded from a checkpoint has) holding the current weight (merged or base), sharing its Parameters."""
        linear = Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"alpha={self.alpha:g}, merged={self.merged}")
