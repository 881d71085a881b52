"""The rungs of "Let's build GPT", each a small model composed from this project's modules.

    bigram        a (V, V) table of next-token logits (models/bigram.py)
    one_head      + token and position embeddings, one causal self-attention head as wide as the model, LM head
    multi_head    several heads, concatenated (n_head heads of n_embd / n_head)
    feed_forward  + a position-wise feed-forward layer (Linear(C, C) and an activation) after attention
    blocks        n_layer such blocks stacked
    residual      + residual connections; attention gets an output projection, the feed-forward layer its 4x
                    inner width and projection back (the MLP of GPT2Layer)
    layernorm     + pre-LayerNorm before each sublayer and after the last block
    dropout       + dropout on attention probabilities and on each residual branch (the lecture's last model,
                    which tasks/ladder.py calls "scaled" when it trains it at the lecture's scaled-up sizes)

Each rung is a model of its own, built once; nothing in the GPT-2 model changes, and the forward pass is the same
four lines for every rung (what differs is which modules the blocks were built from).

Two styles. style="gpt2" (the default): GPT-2's choices, tanh GELU, q/k/v with biases, N(0, 0.02) init.
style="lecture": the lecture's, ReLU, q/k/v without biases, scores scaled by 1/sqrt(n_embd) (its Head uses
the input's width C, not the head size), and PyTorch's default init (N(0, 1) embeddings, Kaiming-uniform Linear).
The init is the difference that matters: with N(0, 0.02) the lecture's rungs without LayerNorm (n_embd 32, 5000
steps at lr 1e-3) end 0.09-0.24 nats worse; with LayerNorm the small init does slightly better (docs/learning-path.md).
"""
from __future__ import annotations

import torch
from torch import nn

from config import GPT2Config
from models.bigram import BigramConfig, BigramLM
from modules.attention import CausalSelfAttention

RUNGS = ("bigram", "one_head", "multi_head", "feed_forward", "blocks", "residual", "layernorm", "dropout")
STYLES = {  # per style: (activation, q/k/v biases, scores scaled by the head size (else by n_embd), init)
    "gpt2": dict(activation="gelu", qkv_bias=True, attn_scale="head", init="gpt2"),
    "lecture": dict(activation="relu", qkv_bias=False, attn_scale="width", init="torch"),
}
ACTIVATIONS = {"gelu": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}


class Residual(nn.Module):
    """x + branch(x): the residual stream that lets gradients reach early blocks unchanged."""

    def __init__(self, *layers: nn.Module):
        super().__init__()
        self.branch = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


def _attention(config: GPT2Config, style: dict) -> CausalSelfAttention:
    attention = CausalSelfAttention(config.replace(bias=style["qkv_bias"]))  # bias here: q/k/v only
    if style["attn_scale"] == "width":  # the lecture's Head: wei = q @ k^T * C**-0.5 with C = n_embd
        attention.scale = config.n_embd ** -0.5
    return attention


def _block(rung: int, config: GPT2Config, style: dict) -> nn.Sequential:
    """One block of rung `rung` (an index into RUNGS, >= 1): attention, then (from feed_forward on) the MLP."""
    C, p, act = config.n_embd, config.resid_pdrop, ACTIVATIONS[style["activation"]]
    heads = config.replace(n_head=1) if rung == RUNGS.index("one_head") else config
    if rung < RUNGS.index("feed_forward"):
        return nn.Sequential(_attention(heads, style))
    if rung < RUNGS.index("residual"):
        return nn.Sequential(_attention(heads, style), nn.Linear(C, C), act())
    norm = (lambda: nn.LayerNorm(C, eps=config.layer_norm_epsilon)) if rung >= RUNGS.index("layernorm") else nn.Identity
    drop = (lambda: nn.Dropout(p)) if rung >= RUNGS.index("dropout") else nn.Identity
    return nn.Sequential(
        Residual(norm(), _attention(heads, style), nn.Linear(C, C), drop()),
        Residual(norm(), nn.Linear(C, config.inner_dim), act(),
                 nn.Linear(config.inner_dim, C), drop()),
    )


class LadderLM(nn.Module):
    """Token + position embeddings -> blocks -> (final LayerNorm) -> LM head. forward(ids) -> {'logits': (B, T, V)}."""

    def __init__(self, rung: str, config: GPT2Config, style: str | dict = "gpt2"):
        super().__init__()
        if rung not in RUNGS[1:]:
            raise ValueError(f"unknown rung {rung!r}; LadderLM builds one of {RUNGS[1:]} (bigram is BigramLM)")
        style = resolve_style(style)
        index = RUNGS.index(rung)
        self.rung, self.config, self.style = rung, config, style
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.n_positions, config.n_embd)
        n_blocks = config.n_layer if index >= RUNGS.index("blocks") else 1
        self.blocks = nn.Sequential(*[_block(index, config, style) for _ in range(n_blocks)])
        self.final_norm = (nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
                           if index >= RUNGS.index("layernorm") else nn.Identity())
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)
        if style["init"] == "gpt2":  # else PyTorch's defaults, as each module set them
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


def resolve_style(style: str | dict) -> dict:
    """A style name from STYLES, or a dict that changes some of its entries: {"base": "lecture", "init": "gpt2"}."""
    changes = dict(style) if isinstance(style, dict) else {"base": style}
    base = changes.pop("base", "gpt2")
    if base not in STYLES:
        raise ValueError(f"unknown style {base!r}; choose from {sorted(STYLES)}")
    resolved = STYLES[base] | {k: v for k, v in changes.items() if v is not None}
    choices = {"activation": set(ACTIVATIONS), "qkv_bias": {True, False}, "attn_scale": {"head", "width"},
               "init": {"gpt2", "torch"}}
    for key, value in resolved.items():
        if key not in choices or value not in choices[key]:
            raise ValueError(f"style {key}={value!r}: the style keys and their values are {choices}")
    return resolved


def build_rung(rung: str, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
               dropout: float = 0.2, style: str | dict = "gpt2") -> nn.Module:
    """The model of one rung. dropout is used by the last rung only (the earlier ones have none)."""
    style = resolve_style(style)
    if rung == "bigram":
        model = BigramLM(BigramConfig(vocab_size=vocab_size, n_positions=block_size))
        if style["init"] == "torch":  # nn.Embedding's own N(0, 1), as the lecture's bigram.py starts
            nn.init.normal_(model.token_embedding_table.weight)
        return model
    p = dropout if rung == "dropout" else 0.0
    config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_layer=n_layer, n_head=n_head,
                        n_embd=n_embd, resid_pdrop=p, attn_pdrop=p, embd_pdrop=0.0)
    return LadderLM(rung, config, style)
