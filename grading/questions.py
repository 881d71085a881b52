"""What the grader asks each check: inputs and weights drawn here, in the grader's process, from a secret seed.

The check's process reads them from a file the grader writes (grading/sandbox.py) and answers with outputs only
(`ANSWERS`: name -> shape). The reference is computed from these tensors, never from anything the check returns, so a
submission cannot choose the question it answers (all-zero weights whose reference is zero, say). A fresh seed from
`secrets` per check: nothing of one check's question is visible to another, or knowable before the check runs.
"""
from __future__ import annotations

import math
import secrets

import torch

from grading.sandboxed import probes

B, T, D, H, L, V, P, HD = 3, probes.T, probes.D, probes.H, probes.L, probes.V, probes.P, probes.HD
INNER = 4 * D
LN_ROWS = 4  # rows of the small-variance input each LayerNorm is measured on (its eps)
GELU_POINTS = 101


def _lin(g, out, inp):
    return torch.randn(out, inp, generator=g) / math.sqrt(inp), 0.2 * torch.randn(out, generator=g)


def layer_weights(g, prefix="") -> dict:
    """One layer's weights under this project's names; LayerNorm gains near 1, every bias non-zero."""
    w = {}
    for name, out, inp in (("self_attention.query", D, D), ("self_attention.key", D, D),
                           ("self_attention.value", D, D), ("attention_dense", D, D), ("interm_dense", INNER, D),
                           ("out_dense", D, INNER)):
        w[f"{prefix}{name}.weight"], w[f"{prefix}{name}.bias"] = _lin(g, out, inp)
    for name in ("attention_layer_norm", "out_layer_norm"):
        w[f"{prefix}{name}.weight"] = 1 + 0.2 * torch.randn(D, generator=g)
        w[f"{prefix}{name}.bias"] = 0.2 * torch.randn(D, generator=g)
    return w


def measuring_inputs(g) -> dict:
    """A LayerNorm input of variance ~1e-6 (there eps moves the output a lot) and points to read the GELU at."""
    return {"ln.input": 1e-3 * torch.randn(LN_ROWS, D, generator=g),
            "gelu.input": torch.linspace(-4, 4, GELU_POINTS) + 0.01 * torch.rand(GELU_POINTS, generator=g)}


def dropout_mask(g, shape) -> torch.Tensor:
    return (torch.rand(shape, generator=g) >= probes.DROPOUT_P).float()


def attention(g) -> dict:
    q = {k[len("self_attention."):]: v for k, v in layer_weights(g).items() if k.startswith("self_attention.")}
    q["x"] = torch.randn(B, T, D, generator=g)
    # training mode: q and k for attention() directly, or an input whose first T features are a one-hot position
    q["train.q"], q["train.k"] = torch.randn(B, H, T, HD, generator=g), torch.randn(B, H, T, HD, generator=g)
    x1 = torch.randn(B, T, D, generator=g)
    x1[..., :T] = torch.eye(T)
    q["train.x"] = x1
    return q


def layer(g) -> dict:
    q = layer_weights(g)
    q["x"], q["add.input"], q["add.output"] = (torch.randn(B, T, D, generator=g) for _ in range(3))
    q["train.mask_attention"], q["train.mask_out"] = dropout_mask(g, (B, T, D)), dropout_mask(g, (B, T, D))
    return {**q, **measuring_inputs(g)}


def embeddings(g) -> dict:
    return {"word_embedding.weight": torch.randn(V, D, generator=g), "pos_embedding.weight": torch.randn(P, D, generator=g)}


def embed(g) -> dict:
    return {**embeddings(g), "ids": torch.randint(0, V, (B, T), generator=g).float()}


def model(g) -> dict:
    q = embeddings(g)
    for i in range(L):
        q.update(layer_weights(g, f"gpt_layers.{i}."))
    q["final_layer_norm.weight"] = 1 + 0.2 * torch.randn(D, generator=g)
    q["final_layer_norm.bias"] = 0.2 * torch.randn(D, generator=g)
    q["ids"] = torch.randint(0, V, (B, T), generator=g).float()
    q["head.input"] = torch.randn(B, T, D, generator=g)
    q["head.word_embedding"] = torch.randn(V, D, generator=g)  # a tied head's logits follow a new word_embedding
    return {**q, **measuring_inputs(g)}


def from_pretrained(g) -> dict:
    return {"ids": torch.randint(0, 1000, (B, T), generator=g).float()}


def adamw(g, steps=200) -> dict:
    q = {"init.0.weight": 0.5 * torch.randn(8, 4, generator=g), "init.0.bias": 0.5 * torch.randn(8, generator=g),
         "init.2.weight": 0.5 * torch.randn(2, 8, generator=g), "init.2.bias": 0.5 * torch.randn(2, generator=g)}
    x = torch.randn(steps, 16, 4, generator=g)
    q["x"], q["y"] = x, torch.stack([x[..., 0] * x[..., 1], x[..., 2] - x[..., 3]], dim=-1)
    return q


MAKE = {"attention": attention, "layer": layer, "embed": embed, "model": model, "from_pretrained": from_pretrained,
        "adamw": adamw}


def ask(check: str, seed: int | None = None) -> dict:
    """The check's inputs and weights (float32), from `seed` or, by default, a fresh secret one."""
    make = MAKE.get(check)
    if make is None:
        return {}
    g = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    return {k: v.float().contiguous() for k, v in make(g).items()}


def _model_answers() -> dict:
    a = {"last_hidden_state": (B, T, D), "last_token": (B, D), "logits": (B, T, V), "logits.tied": (B, T, V),
         "ln.final_layer_norm": (LN_ROWS, D)}
    for i in range(L):
        for n in ("attention_layer_norm", "out_layer_norm"):
            a[f"ln.gpt_layers.{i}.{n}"] = (LN_ROWS, D)
        a[f"gelu.gpt_layers.{i}"] = (GELU_POINTS,)
    return a


# What each check may answer: name -> shape (float32). Anything else is refused before it is compared.
ANSWERS = {
    "attention": {"forward.nopad": (B, T, D), "forward.right": (B, T, D), "forward.left": (B, T, D),
                  "attention.left": (B, T, D), "probs.eval": (B, H, T, T), "probs.train": (B, H, T, T)},
    "layer": {"forward.nopad": (B, T, D), "forward.right": (B, T, D), "forward.left": (B, T, D), "add": (B, T, D),
              "train": (B, T, D), "ln.attention_layer_norm": (LN_ROWS, D), "ln.out_layer_norm": (LN_ROWS, D),
              "gelu": (GELU_POINTS,)},
    "embed": {"embed": (B, T, D), "embed.train": (B, T, D)},
    "model": _model_answers(),
    "from_pretrained": {"last_hidden_state": (B, T, D), "last_token": (B, D)},  # + the checkpoint's weights' shapes
    "adamw": {"course.weight": (2, 3), "torch.0.weight": (8, 4), "torch.0.bias": (8,), "torch.2.weight": (2, 8),
              "torch.2.bias": (2,)},
}

# The course's interface: each graded output, the rubric part it serves, the function that returns it and the shape
# the course fixes for it (in its symbols: B batch, T tokens, C hidden size, V vocabulary). An output of another shape
# breaks the contract: that part scores 0, with a finding naming the shape (grading/checks.py). A key ending in "."
# covers every name that begins with it (the padding cases).
CONTRACTS = {
    "attention": {"forward.": ("forward", "CausalSelfAttention.forward", "(B, T, C)"),
                  "attention.left": ("attention", "attention()", "(B, T, C)")},
    "layer": {"forward.": ("forward", "GPT2Layer.forward", "(B, T, C)"), "add": ("add", "GPT2Layer.add", "(B, T, C)"),
              "train": ("training", "GPT2Layer.forward (training mode)", "(B, T, C)")},
    "embed": {"embed": ("embed", "GPT2Model.embed", "(B, T, C)"),
              "embed.train": ("training", "GPT2Model.embed (training mode)", "(B, T, C)")},
    "model": {"last_hidden_state": ("forward", "GPT2Model.forward()['last_hidden_state']", "(B, T, C)"),
              "last_token": ("forward", "GPT2Model.forward()['last_token']", "(B, C)"),
              "logits": ("hidden_state_to_token", "hidden_state_to_token", "(B, T, V)"),
              "logits.tied": ("hidden_state_to_token", "hidden_state_to_token", "(B, T, V)")},
}
# The heads unmerged, (B, h, T, hd): the shape the probe passes on as returned, so the grader can merge them to name
# the values' bugs as well as the broken contract (and accept attention()'s where forward() merges them itself).
UNMERGED = {"attention": {name: (B, H, T, HD) for name in ("forward.nopad", "forward.right", "forward.left",
                                                           "attention.left")}}


def contract(check: str, name: str) -> tuple[str, str, str] | None:
    """(part, function, shape in the course's symbols) of a graded output, or None for the grader's measurements."""
    for key, c in CONTRACTS.get(check, {}).items():
        if name == key or (key.endswith(".") and name.startswith(key)):
            return c
    return None
