"""GPT-2 configuration: Hugging Face field names, CS224N course aliases, the four official size presets.

    cfg = GPT2Config.from_preset("gpt2-medium")
    cfg = GPT2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)   # course names work too
    cfg.n_embd == cfg.hidden_size == 64
    hf_cfg = cfg.to_hf()                      # transformers.GPT2Config
    cfg = GPT2Config.from_json_file("config.json")   # an HF config.json
    cfg = GPT2Config.from_preset("nanochat-d12")     # a modern variant: RMSNorm, RoPE, ReLU^2, untied head, ...

Beyond GPT-2 the config describes the variants of nanochat's GPT (and Llama-style models): the norm, the MLP
activation, rotary positions, grouped-query attention, q/k norm, biases, an untied LM head and a logit soft-cap.
Every variant field defaults to GPT-2's choice, so a plain config is GPT-2 bit for bit, and a config.json records a
variant field only where it differs (a GPT-2 config.json stays what transformers writes).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

# Architecture of the four official checkpoints (everything else is shared: vocab 50257, context 1024).
PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

NANOCHAT_PRESET = re.compile(r"nanochat-d(\d+)")


def nanochat_preset(depth: int) -> dict[str, Any]:
    """nanochat's GPT of `depth` layers, sized by nanochat's own rule (karpathy/nanochat scripts/base_train.py,
    build_model_meta, with its defaults --aspect-ratio 64 --head-dim 128 --max-seq-len 2048): the width depth * 64,
    rounded up to a multiple of the head size 128; n_head = width / 128 (so the head size is exactly 128); as many
    key/value heads as query heads (n_kv_head=None, so it follows an overridden n_head). The architecture is
    nanochat/gpt.py's where this config can say it: RMSNorm without a learnable scale (F.rms_norm with eps=None,
    float32's machine epsilon), a 4x ReLU^2 MLP, RoPE with theta 100000, q/k RMSNorm, no biases, no dropout, an
    untied LM head and logits soft-capped at 15.

    Not modelled (nanochat's extras beyond these variants): value embeddings, per-layer residual and x0 scalars,
    smear, backout, sliding-window layers, the norm after the token embedding, the 1.2 scale of q and k, its init
    (zero output projections, uniform matrices), vocabulary padding. The vocabulary stays GPT-2's (nanochat trains
    its own 32768-token tokenizer); a caller sets vocab_size to its tokenizer's.
    """
    if not isinstance(depth, int) or depth <= 0:
        raise ValueError(f"nanochat depth must be a positive integer, got {depth!r}")
    head_dim = 128
    width = math.ceil(depth * 64 / head_dim) * head_dim
    return dict(n_layer=depth, n_embd=width, n_head=width // head_dim, n_kv_head=None, n_positions=2048,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, norm="rmsnorm", norm_scale=False,
                layer_norm_epsilon=2.0 ** -23, activation_function="relu2", position_embedding="rope",
                rope_theta=100000.0, qk_norm=True, bias=False, tie_word_embeddings=False, logit_softcap=15.0)


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


ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "relu2")  # relu2: ReLU squared (nanochat, Primer)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
BACKWARDS = ("autograd", "manual")
NORMS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope")
# The model_type of a config.json whose model transformers' GPT-2 cannot run (GPT2Config.hf_incompatibilities): its
# Auto classes then refuse the folder instead of building a GPT-2 with half the weights missing.
VARIANT_MODEL_TYPE = "gpt2-variant"
# Architecture fields beyond transformers' GPT2Config; each defaults to GPT-2's choice.
VARIANT_FIELDS = ("norm", "norm_scale", "position_embedding", "rope_theta", "n_kv_head", "qk_norm", "bias",
                  "logit_softcap")


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
    # Variants (nanochat's GPT, Llama); the defaults are GPT-2.
    norm: str = "layernorm"  # every norm of the model (per block, final): "layernorm" or "rmsnorm" (no mean, no shift)
    norm_scale: bool = True  # the norms have a learnable scale (False: nanochat's parameter-free RMSNorm)
    position_embedding: str = "learned"  # "learned": GPT-2's table added to the embeddings; "rope": rotary q and k
    rope_theta: float = 10000.0  # RoPE base: pair i of a head rotates by position * rope_theta^(-2i / head_dim)
    n_kv_head: int | None = None  # key/value heads, shared by n_head / n_kv_head query heads each; None: n_head
    qk_norm: bool = False  # RMSNorm of every head's q and k before attention (scale as norm_scale)
    bias: bool = True  # biases in the Linear layers and LayerNorms (nanoGPT's meaning; False: none anywhere)
    tie_word_embeddings: bool = True  # the LM head is the token embedding (GPT-2); False: a separate lm_head
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (nanochat: 15); None: off
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
        self._check_variants()

    def _check_variants(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"GPT2Config.norm must be one of {NORMS}, got {self.norm!r}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"GPT2Config.position_embedding must be one of {POSITION_EMBEDDINGS}, "
                             f"got {self.position_embedding!r}")
        for name in ("norm_scale", "qk_norm", "bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPT2Config.{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 0:
            raise ValueError(f"GPT2Config.rope_theta must be a positive number, got {self.rope_theta!r}")
        cap = self.logit_softcap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf):
            raise ValueError(f"GPT2Config.logit_softcap must be a positive number or None, got {cap!r}")
        kv = self.n_kv_head
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0):
            raise ValueError(f"GPT2Config.n_kv_head must be a positive integer or None, got {kv!r}")
        if kv is not None and self.n_head % kv != 0:
            raise ValueError(f"GPT2Config.n_head ({self.n_head}) must be divisible by n_kv_head ({kv}): each key/value "
                             f"head serves the same number of query heads")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"GPT2Config(position_embedding='rope') needs an even head size, but n_embd / n_head = "
                             f"{self.n_embd} / {self.n_head} = {self.head_dim}: RoPE rotates pairs of dimensions")
        if self.backward == "manual" and self.variant_fields():
            raise ValueError(f"GPT2Config(backward='manual') has hand-derived backward passes for GPT-2's layers only; "
                             f"{', '.join(self.variant_fields())} need(s) backward='autograd'")

    def variant_fields(self) -> list[str]:
        """The variant fields (VARIANT_FIELDS and tie_word_embeddings) that differ from GPT-2's choice."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        names = VARIANT_FIELDS + ("tie_word_embeddings",)
        return [name for name in names if getattr(self, name) != defaults[name]]

    def hf_incompatibilities(self) -> list[str]:
        """What transformers' GPT-2 cannot represent (each names its field); empty when to_hf() can export it.
        An untied head and ReLU^2 it can (tie_word_embeddings=False, activation_function='relu2')."""
        reasons = {
            "norm": f"norm={self.norm!r}: its blocks use LayerNorm",
            "norm_scale": "norm_scale=False: its LayerNorms have a learnable scale and shift",
            "position_embedding": f"position_embedding={self.position_embedding!r}: it has a learned position table only",
            "n_kv_head": f"n_kv_head={self.n_kv_head} (n_head={self.n_head}): it has as many key/value heads as query heads",
            "qk_norm": "qk_norm=True: it has no q/k norm",
            "bias": "bias=False: its Linear layers (Conv1D) and LayerNorms always have biases",
            "logit_softcap": f"logit_softcap={self.logit_softcap}: it has no logit soft-cap",
        }
        differ = set(self.variant_fields()) - {"rope_theta", "tie_word_embeddings"}  # theta alone changes nothing
        if "n_kv_head" in differ and self.kv_heads == self.n_head:
            differ.remove("n_kv_head")
        return [reasons[name] for name in VARIANT_FIELDS if name in differ]

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head (GPT-2's multi-head attention) when it is None."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    # ---- constructors --------------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "GPT2Config":
        """One of PRESETS (the official GPT-2 sizes), or nanochat-d{depth} (nanochat_preset)."""
        key = name.split("/")[-1]  # accept "openai-community/gpt2-xl"
        if m := NANOCHAT_PRESET.fullmatch(key):
            return cls(**{**nanochat_preset(int(m.group(1))), **overrides})
        if key not in PRESETS:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose one of {sorted(PRESETS)} or nanochat-d{{depth}}")
        return cls(**{**PRESETS[key], **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPT2Config":
        """From an HF config dict (config.json): known fields are used, the rest kept in `extra`."""
        d = dict(d)
        if d.get("model_type", "gpt2") not in ("gpt2", VARIANT_MODEL_TYPE):
            raise ValueError(f"not a GPT-2 config: model_type is {d['model_type']!r}")
        if d.get("add_cross_attention"):
            raise ValueError("GPT-2 configs with add_cross_attention=True (encoder-decoder use) are not supported")
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
        """An HF-style config.json dict that `transformers.GPT2Config` reads. Variant fields are written only where
        they differ from GPT-2's choice; a variant transformers' GPT-2 cannot run (to_hf says which) is marked
        model_type 'gpt2-variant', which its Auto classes refuse."""
        runtime = ("extra", "attn_implementation", "backward")  # choices of this process, not of the checkpoint
        default_variants = set(VARIANT_FIELDS) - set(self.variant_fields())
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in runtime and f.name not in default_variants}
        out = {**self.extra, **d}
        model_type = VARIANT_MODEL_TYPE if self.hf_incompatibilities() else "gpt2"
        out.update(model_type=model_type, architectures=["GPT2LMHeadModel"], activation_function=self.activation_function)
        # the official files' field, which transformers no longer writes and llama.cpp's convert_hf_to_gguf.py reads
        out["n_ctx"] = self.n_positions
        return out

    def to_json_file(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    def to_hf(self, **overrides: Any):
        """transformers.GPT2Config of this model; a variant transformers' GPT-2 cannot run raises ValueError naming
        the field(s) (hf_incompatibilities), rather than exporting a config that would build another model."""
        import transformers

        if reasons := self.hf_incompatibilities():
            raise ValueError("transformers' GPT-2 cannot represent this config: " + "; ".join(reasons))
        d = {k: v for k, v in self.to_dict().items() if k not in ("model_type", "architectures", *VARIANT_FIELDS)}
        d.update(overrides)
        return transformers.GPT2Config(**d)

    def replace(self, **changes: Any) -> "GPT2Config":
        return dataclasses.replace(self, **canonical_fields(changes))
