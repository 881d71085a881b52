"""One GPT-2 transformer block: pre-LayerNorm attention and MLP, each added back to the residual stream."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.attention import CausalSelfAttention, KVCache
from modules.linear import Linear as DecodeLinear
from modules.manual_backward import ManualLayerNorm, ManualLinear, gelu_tanh

ACTIVATION_FNS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's GELU is the tanh approximation
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Layer(nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        manual = config.backward == "manual"  # hand-derived backward passes, same parameters and forward
        Linear, LayerNorm = (ManualLinear, ManualLayerNorm) if manual else (DecodeLinear, nn.LayerNorm)
        # Multi-head attention.
        self.self_attention = CausalSelfAttention(config, layer_idx)
        self.attention_dense = Linear(config.n_embd, config.n_embd)
        self.attention_layer_norm = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attention_dropout = nn.Dropout(config.resid_pdrop)
        # Feed forward.
        self.interm_dense = Linear(config.n_embd, config.inner_dim)
        self.interm_af = gelu_tanh if manual else ACTIVATION_FNS[config.activation_function]
        self.out_dense = Linear(config.inner_dim, config.n_embd)
        self.out_layer_norm = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.out_dropout = nn.Dropout(config.resid_pdrop)

    def add(self, input: torch.Tensor, output: torch.Tensor, dense_layer: nn.Linear, dropout: nn.Dropout) -> torch.Tensor:
        """Residual connection: project the sublayer output, drop out, add to the input."""
        return input + dropout(dense_layer(output))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); attention_mask as in CausalSelfAttention.forward."""
        attn = self.self_attention(self.attention_layer_norm(hidden_states), attention_mask, kv_cache)
        hidden_states = self.add(hidden_states, attn, self.attention_dense, self.attention_dropout)
        mlp = self.interm_af(self.interm_dense(self.out_layer_norm(hidden_states)))
        return self.add(hidden_states, mlp, self.out_dense, self.out_dropout)
