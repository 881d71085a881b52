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


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[1] == 1 and x.shape[0] > 1 and x.is_cpu and not torch.is_grad_enabled():
            rows = x[:, 0].t()  # (in, B)
            out = torch.mm(self.weight, rows) if self.bias is None else torch.addmm(self.bias[:, None], self.weight, rows)
            return out.t()[:, None]  # (B, 1, out)
        return F.linear(x, self.weight, self.bias)
