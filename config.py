"""GPT-2 configuration: Hugging Face field names, CS224N course aliases, the four official size presets.

    cfg = GPT2Config.from_preset("gpt2-medium")
    cfg = GPT2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)   # course names work too
    cfg.n_embd == cfg.hidden_size == 64
    hf_cfg = cfg.to_hf()                      # transformers.GPT2Config
    cfg = GPT2Config.from_json_file("config.json")   # an HF config.json
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# Architecture of the four official checkpoints (everything else is shared: vocab 50257, context 1024).
PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# Course (BERT-style) name -> the HF field(s) it stands for. Reading an alias reads the first field; constructing,
# `replace`-ing or assigning with it writes all of them. hidden_dropout_prob is the course's one dropout for the
# embeddings and the residual branches, so it sets both resid_pdrop and embd_pdrop, through every path.
ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("n_embd",),
    "num_hidden_layers": ("n_layer",),
    "num_attention_heads": ("n_head",),
    "intermediate_size": ("n_inner",),
    "max_position_embeddings": ("n_positions",),
    "hidden_dropout_prob": ("resid_pdrop", "embd_pdrop"),
    "attention_probs_dropout_prob": ("attn_pdrop",),
    "layer_norm_eps": ("layer_norm_epsilon",),
}


def canonical_fields(kwargs: dict[str, Any], hf_wins: bool = False) -> dict[str, Any]:
    """`kwargs` with every course alias replaced by its HF field(s). An alias given together with one of its fields
    raises TypeError, or with hf_wins=True (reading a config.json) leaves that field as given."""
    out = {k: v for k, v in kwargs.items() if k not in ALIASES}
    for course, targets in ALIASES.items():
        if course not in kwargs:
            continue
        for target in targets:
            if target in kwargs:
                if hf_wins:
                    continue
                raise TypeError(f"GPT2Config got both {course!r} and its HF name {target!r}")
            out[target] = kwargs[course]
    return out


class _Alias:
    """Descriptor for a course alias (see ALIASES): reads its first HF field, writes all of them."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.targets = name, ALIASES[name]
        self.__doc__ = f"Course alias of {' and '.join(self.targets)}."

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.targets[0])

    def __set__(self, obj, value) -> None:
        for target in self.targets:
            setattr(obj, target, value)


ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
BACKWARDS = ("autograd", "manual")


@dataclass(kw_only=True, init=False)
class GPT2Config:
    """GPT-2's hyperparameters under their HF names; the course's names (ALIASES) work wherever a field name does:
    as constructor keywords, in `replace`, in a config.json, and as attributes."""

    vocab_size: int = 50257
    n_positions: int = 1024  # longest sequence the position table covers
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    activation_function: str = "gelu_new"  # GPT-2 uses the tanh approximation of GELU
    resid_pdrop: float = 0.1  # dropout on each residual branch (attention and MLP output)
    embd_pdrop: float = 0.1  # dropout on token + position embeddings
    attn_pdrop: float = 0.1  # dropout on attention probabilities
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02  # std of N(0, std) init; residual projections get std / sqrt(2 * n_layer)
    scale_attn_weights: bool = True  # divide scores by sqrt(head_dim)
    scale_attn_by_inverse_layer_idx: bool = False  # also divide by (layer index + 1); off in official GPT-2
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None  # informational; padding is given by the attention mask, never by this id
    attn_implementation: str = "sdpa"  # "sdpa" (F.scaled_dot_product_attention) or "eager" (explicit softmax)
    backward: str = "autograd"  # "manual": hand-derived backward passes (modules/manual_backward.py), same forward
    # HF fields we read but do not change behaviour on (kept so configs round-trip).
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    # Course aliases: plain class attributes (not dataclass fields), so they are neither stored nor compared.
    hidden_size = _Alias()
    num_hidden_layers = _Alias()
    num_attention_heads = _Alias()
    max_position_embeddings = _Alias()
    hidden_dropout_prob = _Alias()
    attention_probs_dropout_prob = _Alias()
    layer_norm_eps = _Alias()

    @property
    def intermediate_size(self) -> int:
        """Course alias of n_inner that reads the effective MLP width (n_inner may be None: 4 * n_embd)."""
        return self.inner_dim

    @intermediate_size.setter
    def intermediate_size(self, value: int | None) -> None:
        self.n_inner = value

    def __init__(self, **kwargs: Any) -> None:
        """Keyword-only: the fields above under their HF names or the course aliases in ALIASES."""
        kwargs = canonical_fields(kwargs)
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = set(kwargs) - set(fields)
        if unknown:
            raise TypeError(f"GPT2Config got unknown field(s) {sorted(unknown)}")
        for name, f in fields.items():
            if name in kwargs:
                value = kwargs[name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive integer, got {value!r}")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner <= 0):
            raise ValueError(f"GPT2Config.n_inner must be a positive integer or None, got {self.n_inner!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPT2Config.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"each head gets n_embd / n_head dimensions"
            )
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"GPT2Config.{name} must be in [0, 1), got {p!r}")
        if self.layer_norm_epsilon <= 0:
            raise ValueError(f"GPT2Config.layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"GPT2Config.activation_function must be one of {ACTIVATIONS}, got {self.activation_function!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"GPT2Config.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {self.attn_implementation!r}"
            )
        if self.backward not in BACKWARDS:
            raise ValueError(f"GPT2Config.backward must be one of {BACKWARDS}, got {self.backward!r}")
        if self.backward == "manual" and self.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT2Config(backward='manual') has a hand-derived backward for the tanh GELU only; "
                             f"activation_function={self.activation_function!r} needs backward='autograd'")

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    # ---- constructors --------------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "GPT2Config":
        key = name.split("/")[-1]  # accept "openai-community/gpt2-xl"
        if key not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[key], **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPT2Config":
        """From an HF config dict (config.json): known fields are used, the rest kept in `extra`."""
        d = dict(d)
        if d.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"not a GPT-2 config: model_type is {d['model_type']!r}")
        if d.get("add_cross_attention"):
            raise ValueError("GPT-2 configs with add_cross_attention=True (encoder-decoder use) are not supported")
        if d.get("tie_word_embeddings") is False:
            raise ValueError("GPT-2 configs with tie_word_embeddings=False are not supported: the LM head is tied")
        if d.get("reorder_and_upcast_attn"):
            raise ValueError("reorder_and_upcast_attn=True is not supported")
        if isinstance(d.get("eos_token_id"), list):
            raise ValueError(f"a list of eos_token_id is not supported: {d['eos_token_id']}")
        d.pop("_attn_implementation", None)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        d = canonical_fields(d, hf_wins=True)  # a config.json with both names keeps the HF one
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "GPT2Config":
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "GPT2Config":
        return cls.from_dict(hf_config.to_dict())

    # ---- export --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """An HF-style config.json dict that `transformers.GPT2Config` reads."""
        runtime = ("extra", "attn_implementation", "backward")  # choices of this process, not of the checkpoint
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in runtime}
        out = {**self.extra, **d}
        out.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], activation_function=self.activation_function)
        out["tie_word_embeddings"] = True
        return out

    def to_json_file(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    def to_hf(self, **overrides: Any):
        import transformers

        d = {k: v for k, v in self.to_dict().items() if k not in ("model_type", "architectures")}
        d.update(overrides)
        return transformers.GPT2Config(**d)

    def replace(self, **changes: Any) -> "GPT2Config":
        return dataclasses.replace(self, **canonical_fields(changes))
