"""One GPT-2 transformer block: pre-LayerNorm attention and MLP, each added back to the residual stream.

The variants are chosen here, once: the norm (LayerNorm or RMSNorm), the MLP activation (GELU, ReLU, ReLU^2),
biases on or off; attention builds its own (grouped-query heads, q/k norm, rotary positions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.attention import CausalSelfAttention, KVCache
from modules.dropout import Dropout
from modules.gelu import gelu_new  # GPT-2's GELU, the tanh form (the rows kernel's on the CPU: modules/gelu.py)
from modules.linear import Linear as DecodeLinear
from modules.manual_backward import ManualLinear, gelu_tanh
from modules.norms import make_norm
from modules.positions import Rope


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """ReLU squared (Primer; nanochat's MLP)."""
    return F.relu(x).square()


# Named functions, not lambdas: a layer holds one, and a whole model must pickle (torch.save(model)).
ACTIVATION_FNS = {"gelu_new": gelu_new, "gelu_pytorch_tanh": gelu_new, "gelu": F.gelu, "relu": F.relu,
                  "relu2": relu_squared}


class GPT2Layer(nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        manual = config.backward == "manual"  # hand-derived backward passes, same parameters and forward
        Linear = ManualLinear if manual else DecodeLinear
        # Multi-head attention.
        self.self_attention = CausalSelfAttention(config, layer_idx)
        self.attention_dense = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attention_layer_norm = make_norm(config)  # LayerNorm, or RMSNorm (config.norm)
        self.attention_dropout = Dropout(config.resid_pdrop)
        # Feed forward.
        self.interm_dense = Linear(config.n_embd, config.inner_dim, bias=config.bias)
        self.interm_af = gelu_tanh if manual else ACTIVATION_FNS[config.activation_function]
        self.out_dense = Linear(config.inner_dim, config.n_embd, bias=config.bias)
        self.out_layer_norm = make_norm(config)
        self.out_dropout = Dropout(config.resid_pdrop)

    def add(self, input: torch.Tensor, output: torch.Tensor, dense_layer: nn.Linear, dropout: nn.Dropout) -> torch.Tensor:
        """Residual connection: project the sublayer output, drop out, add to the input."""
        return input + dropout(dense_layer(output))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, rope: Rope | None = None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); attention_mask and rope as in CausalSelfAttention.forward."""
        attn = self.self_attention(self.attention_layer_norm(hidden_states), attention_mask, kv_cache, rope)
        hidden_states = self.add(hidden_states, attn, self.attention_dense, self.attention_dropout)
        mlp = self.interm_af(self.interm_dense(self.out_layer_norm(hidden_states)))
        return self.add(hidden_states, mlp, self.out_dense, self.out_dropout)
