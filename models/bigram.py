"""The bigram language model ("Let's build GPT", first step): a table of next-token logits indexed by the current
token. It is the floor every corpus gets before any context is used: its best possible loss is the conditional
entropy of the next token given the current one, which the counts of the training text give in closed form.

    model = BigramLM(BigramConfig(vocab_size=65, n_positions=64))
    logits = model(ids)["logits"]                       # (B, T, V): row t depends on ids[:, t] only
    model.save_pretrained(folder); BigramLM.from_pretrained(folder)
    load_lm(folder)                                     # a BigramLM or a GPT2LMHeadModel, whichever the folder holds
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.generation import process_logits
from modules import draw

MODEL_TYPE = "bigram"


@dataclass(kw_only=True)
class BigramConfig:
    vocab_size: int
    n_positions: int = 1024  # unused by the model (no positions); sampling feeds it windows of this length
    # The training loop reads these to decide whether batches may be split across threads: a table has no dropout.
    resid_pdrop: ClassVar[float] = 0.0
    embd_pdrop: ClassVar[float] = 0.0
    attn_pdrop: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BigramConfig.{name} must be a positive integer, got {value!r}")

    def replace(self, **changes: Any) -> "BigramConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"a bigram model has no {sorted(unknown)} (it has no layers, heads or width)")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, "architectures": ["BigramLM"], **dataclasses.asdict(self)}


class BigramLM(nn.Module):
    def __init__(self, config: BigramConfig):
        super().__init__()
        self.config = config
        self.token_embedding_table = nn.Embedding(config.vocab_size, config.vocab_size)  # row i: logits after token i
        nn.init.normal_(self.token_embedding_table.weight, std=0.02)  # near-uniform start, loss about ln(V)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """input_ids (B, T) -> {'logits': (B, T, V), 'loss': mean CE against targets (B, T) or None}."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"input_ids must be an integer (batch, seq_len) tensor, got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must be in [0, {self.config.vocab_size}), got values from "
                             f"{int(input_ids.min())} to {int(input_ids.max())}")
        logits = self.token_embedding_table(input_ids)  # (B, T, V)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"logits": logits, "loss": loss}

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
                 do_sample: bool = True, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append max_new_tokens tokens to each row (B, T) -> (B, T + new); only the last token matters."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("a bigram model needs no padding: pass prompts of one length without a mask")
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self.token_embedding_table(ids[:, -1])  # (B, V)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision up, float64 kept
            if do_sample:
                probs = F.softmax(process_logits(logits, None, temperature, top_k, top_p), dim=-1)
                nxt = draw.multinomial(probs, generator)[:, None]  # torch.multinomial's token
            else:
                nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  folder / "model.safetensors", metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, **_ignored) -> "BigramLM":
        from safetensors.torch import load_file

        folder = Path(folder)
        d = _read_config(folder)
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{folder} holds a {d.get('model_type')!r} model, not a bigram model")
        model = cls(BigramConfig(vocab_size=d["vocab_size"], n_positions=d["n_positions"]))
        model.load_state_dict(load_file(folder / "model.safetensors"))  # strict: a missing or extra key raises
        return model


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in {folder}") from None


def is_bigram(folder: str | os.PathLike) -> bool:
    return (Path(folder) / "config.json").is_file() and _read_config(Path(folder)).get("model_type") == MODEL_TYPE


def load_lm(folder: str | os.PathLike):
    """The language model saved in `folder`: a BigramLM or a GPT2LMHeadModel."""
    if is_bigram(folder):
        return BigramLM.from_pretrained(folder)
    from models.gpt2 import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder)
