"""nn.Linear with one extra kernel choice: decoding a batch of single tokens on the CPU.

Decoding B > 1 sequences one token at a time multiplies a (B, 1, in) input by every weight matrix: a skinny GEMM
that reads the whole weight for a few rows. On CPUs torch's F.linear streams it slowly (measured over all 72 linear
layers of gpt2 at batch 8, cold caches, 2-core Zen 3: 4.4 GB/s), while the same product with the weight as the
left operand, (W @ x^T)^T, reads it at 6.3 GB/s. Same values up to float rounding; training and every other shape
take F.linear as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def weight_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (B, in) computed as (W @ x^T)^T: the faster form on CPUs for a few rows."""
    out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())  # (out, B)
    return out.t()


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[1] == 1 and x.shape[0] > 1 and x.is_cpu and not torch.is_grad_enabled():
            # Row-major like F.linear's output: a transposed view sends the next weight-first GEMM (out_dense after
            # the GELU) down MKL's slow path and the query to SDPA's math kernel.
            return weight_first(x[:, 0], self.weight, self.bias).contiguous()[:, None]  # (B, 1, out)
        return F.linear(x, self.weight, self.bias)
