"""The rungs of "Let's build GPT", each a small model composed from this project's modules.

    bigram        a (V, V) table of next-token logits (models/bigram.py)
    one_head      + token and position embeddings, one causal self-attention head as wide as the model, LM head
    multi_head    several heads, concatenated (n_head heads of n_embd / n_head)
    feed_forward  + a position-wise feed-forward layer (Linear(C, C) and GELU) after attention
    blocks        n_layer such blocks stacked
    residual      + residual connections; attention gets an output projection, the feed-forward layer its 4x
                    inner width and projection back (the MLP of GPT2Layer)
    layernorm     + pre-LayerNorm before each sublayer and after the last block
    dropout       + dropout on attention probabilities and on each residual branch

Each rung is a model of its own, built once; nothing in the GPT-2 model changes, and the forward pass is the same
four lines for every rung (what differs is which modules the blocks were built from). The lecture uses ReLU and
bias-free heads; here the activation is GPT-2's tanh GELU and the heads are CausalSelfAttention (with biases).
"""
from __future__ import annotations

import torch
from torch import nn

from config import GPT2Config
from models.bigram import BigramConfig, BigramLM
from modules.attention import CausalSelfAttention

RUNGS = ("bigram", "one_head", "multi_head", "feed_forward", "blocks", "residual", "layernorm", "dropout")


class Residual(nn.Module):
    """x + branch(x): the residual stream that lets gradients reach early blocks unchanged."""

    def __init__(self, *layers: nn.Module):
        super().__init__()
        self.branch = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


def _block(rung: int, config: GPT2Config) -> nn.Sequential:
    """One block of rung `rung` (an index into RUNGS, >= 1): attention, then (from feed_forward on) the MLP."""
    C, p = config.n_embd, config.resid_pdrop
    heads = config.replace(n_head=1) if rung == RUNGS.index("one_head") else config
    if rung < RUNGS.index("feed_forward"):
        return nn.Sequential(CausalSelfAttention(heads))
    if rung < RUNGS.index("residual"):
        return nn.Sequential(CausalSelfAttention(heads), nn.Linear(C, C), nn.GELU(approximate="tanh"))
    norm = (lambda: nn.LayerNorm(C, eps=config.layer_norm_epsilon)) if rung >= RUNGS.index("layernorm") else nn.Identity
    drop = (lambda: nn.Dropout(p)) if rung >= RUNGS.index("dropout") else nn.Identity
    return nn.Sequential(
        Residual(norm(), CausalSelfAttention(heads), nn.Linear(C, C), drop()),
        Residual(norm(), nn.Linear(C, config.inner_dim), nn.GELU(approximate="tanh"),
                 nn.Linear(config.inner_dim, C), drop()),
    )


class LadderLM(nn.Module):
    """Token + position embeddings -> blocks -> (final LayerNorm) -> LM head. forward(ids) -> {'logits': (B, T, V)}."""

    def __init__(self, rung: str, config: GPT2Config):
        super().__init__()
        if rung not in RUNGS[1:]:
            raise ValueError(f"unknown rung {rung!r}; LadderLM builds one of {RUNGS[1:]} (bigram is BigramLM)")
        index = RUNGS.index(rung)
        self.rung, self.config = rung, config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.n_positions, config.n_embd)
        n_blocks = config.n_layer if index >= RUNGS.index("blocks") else 1
        self.blocks = nn.Sequential(*[_block(index, config) for _ in range(n_blocks)])
        self.final_norm = (nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
                           if index >= RUNGS.index("layernorm") else nn.Identity())
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)
        self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        T = input_ids.shape[1]
        if T > self.config.n_positions:
            raise ValueError(f"sequence length {T} exceeds the position table of {self.config.n_positions}")
        x = self.token_embedding(input_ids) + self.position_embedding.weight[:T]  # (B, T, C)
        return {"logits": self.lm_head(self.final_norm(self.blocks(x)))}  # (B, T, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _init_weights(module: nn.Module) -> None:
    # GPT-2's init (N(0, 0.02), zero biases) for every rung, so rungs differ by architecture, not by init.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_rung(rung: str, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
               dropout: float = 0.2) -> nn.Module:
    """The model of one rung. dropout is used by the last rung only (the earlier ones have none)."""
    if rung == "bigram":
        return BigramLM(BigramConfig(vocab_size=vocab_size, n_positions=block_size))
    p = dropout if rung == "dropout" else 0.0
    config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_layer=n_layer, n_head=n_head,
                        n_embd=n_embd, resid_pdrop=p, attn_pdrop=p, embd_pdrop=0.0)
    return LadderLM(rung, config)
