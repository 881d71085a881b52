"""LoRA for our GPT-2, with adapters in PEFT's format both ways.

    apply_lora(model, rank=8, alpha=16, targets=("attention", "mlp"), dropout=0.0)   # freezes the body
    save_adapter(model, "out/adapter")     # adapter_config.json + adapter_model.safetensors, as PEFT writes them
    load_adapter(model, "out/adapter")     # ours or one PEFT trained on transformers' GPT-2
    merge_lora(model); unmerge_lora(model)

`model` is a GPT2Model, a GPT2LMHeadModel, or a task model wrapping one body (`.gpt`); only the body is adapted and
frozen, so a task head stays trainable.

The q/k/v mapping. transformers fuses q, k and v into one Conv1D `c_attn` (C -> 3C); a PEFT adapter on it is one
lora_A (r, C) and one lora_B (3C, r), i.e. delta W_q, W_k, W_v = s * B_q A, s * B_k A, s * B_v A with the row blocks
B_q, B_k, B_v of lora_B and a *shared* A. We use exactly that: our query/key/value LoRALinear share one lora_A
Parameter and each own its block of lora_B. It is a bijection with PEFT's c_attn adapter at the same rank (same
parameters, same gradients, so a run here is the run PEFT would make on transformers), where independent A's per
projection would need a rank-3r block-diagonal c_attn adapter to save and could not take PEFT's back without turning
into that larger form. A subset of q/k/v (e.g. query and value, the LoRA paper's choice) is saved as a c_attn adapter
whose other blocks of lora_B are zero. What PEFT can express and we cannot (DoRA, LoRA biases, bias training,
modules_to_save, adapters on the embeddings or lm_head, ...) is refused by name when loading.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from models.gpt2 import GPT2Model
from models.loading import meta_modules
from modules.lora import LoRALinear

QKV = ("self_attention.query", "self_attention.key", "self_attention.value")
# transformers' GPT-2 module (PEFT's name for it, inside h.{i}) -> our Linear(s) inside gpt_layers.{i}.
PEFT_MODULES: dict[str, tuple[str, ...]] = {
    "attn.c_attn": QKV,
    "attn.c_proj": ("attention_dense",),
    "mlp.c_fc": ("interm_dense",),
    "mlp.c_proj": ("out_dense",),
}
OUR_LINEARS = QKV + ("attention_dense", "interm_dense", "out_dense")
# Names accepted in `targets` -> our Linears. PEFT's module names, ours, and groups.
TARGET_NAMES: dict[str, tuple[str, ...]] = {
    "c_attn": QKV, "attn.c_attn": QKV, "qkv": QKV,
    "query": QKV[:1], "key": QKV[1:2], "value": QKV[2:],
    "c_proj": ("attention_dense", "out_dense"), "attn.c_proj": ("attention_dense",), "attention_dense": ("attention_dense",),
    "c_fc": ("interm_dense",), "mlp.c_fc": ("interm_dense",), "interm_dense": ("interm_dense",),
    "mlp.c_proj": ("out_dense",), "out_dense": ("out_dense",),
    "attention": QKV + ("attention_dense",), "mlp": ("interm_dense", "out_dense"), "all": OUR_LINEARS,
}
DEFAULT_TARGETS = ("attention", "mlp")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.transformer."  # PEFT on transformers.GPT2LMHeadModel, what users load into
PEFT_KEY = re.compile(r"^base_model\.model\.(?:transformer\.)?h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                      r"\.lora_([AB])\.weight$")
# PEFT config fields whose non-default values change the model in ways LoRALinear does not represent.
UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "target_parameters", "trainable_token_indices",
               "layer_replication", "alora_invocation_tokens", "use_qalora", "use_bdlora", "megatron_config")


class AdapterError(ValueError):
    """An adapter that does not fit the model, or a PEFT feature this LoRA cannot represent exactly."""


def body_of(model: nn.Module) -> GPT2Model:
    if isinstance(model, GPT2Model):
        return model
    bodies = [m for m in model.modules() if isinstance(m, GPT2Model)]
    if len(bodies) != 1:
        raise TypeError(f"expected a GPT2Model, GPT2LMHeadModel or a task model holding one body, got "
                        f"{type(model).__name__} with {len(bodies)} GPT2Model inside")
    return bodies[0]


def resolve_targets(targets) -> tuple[str, ...]:
    """Target names (a list, or one comma-separated string) -> our Linear names, in layer order."""
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else [str(t).strip() for t in targets]
    unknown = [t for t in names if t not in TARGET_NAMES]
    if unknown or not names:
        raise ValueError(f"LoRA target{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown)) or '(none)'} "
                         f"name{'' if len(unknown) > 1 else 's'} no layer; valid targets: {', '.join(TARGET_NAMES)}")
    chosen = {linear for t in names for linear in TARGET_NAMES[t]}
    return tuple(n for n in OUR_LINEARS if n in chosen)


def check_hyperparameters(rank, alpha, dropout) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not alpha > 0 or not math.isfinite(alpha):
        raise ValueError(f"LoRA alpha must be positive, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def _wrap(body: GPT2Model, layer: int, linears: tuple[str, ...], rank: int, alpha: float, dropout: float,
          use_rslora: bool = False) -> None:
    """Replace our Linears `linears` of one layer by LoRALinear; those of q/k/v share one lora_A."""
    shared = None
    for name in linears:
        parent_name, attr = f"gpt_layers.{layer}.{name}".rsplit(".", 1)
        parent = body.get_submodule(parent_name)
        wrapped = LoRALinear(getattr(parent, attr), rank, alpha, dropout, shared if name in QKV else None, use_rslora)
        wrapped.train(parent.training)  # a model in eval mode must not start dropping out its new adapters
        if name in QKV:
            shared = wrapped.lora_A
        setattr(parent, attr, wrapped)


def apply_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, targets=DEFAULT_TARGETS, dropout: float = 0.0,
               base_model: str | None = None) -> nn.Module:
    """Freeze the body's weights and add trainable LoRA adapters to `targets` in every layer (see TARGET_NAMES).
    base_model: what the body was loaded from, recorded in saved adapters (PEFT's base_model_name_or_path)."""
    check_hyperparameters(rank, alpha, dropout)
    linears = resolve_targets(targets)
    body = body_of(model)
    if has_lora(body):
        raise ValueError("the model already has LoRA adapters")
    body.requires_grad_(False)
    for i in range(body.config.n_layer):
        _wrap(body, i, linears, rank, alpha, dropout)
    body.lora_base_model = base_model
    return model


def merge_lora(model: nn.Module, unload: bool = False) -> nn.Module:
    """Add each adapter's s * B A into its base weight (forward then skips the adapters; unmerge_lora undoes it).
    unload=True also removes the adapters, leaving a plain GPT-2 with the merged weights."""
    for name, m in lora_modules(model).items():
        m.merge()
        if unload:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, m.to_linear())
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    for m in lora_modules(model).values():
        m.unmerge()
    return model


# ---- PEFT format -----------------------------------------------------------------------------------------------

def to_peft(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Our adapters -> (PEFT state dict, PEFT LoraConfig fields). Pure: the model is not changed."""
    body = body_of(model)
    tensors, rank, alpha, rslora, dropout = {}, {}, {}, set(), set()
    for i, layer in enumerate(body.gpt_layers):
        for peft_name, ours in PEFT_MODULES.items():
            mods = [layer.get_submodule(n) for n in ours]
            lora = [m for m in mods if isinstance(m, LoRALinear)]
            if not lora:
                continue
            first = lora[0]
            if any(m.lora_A is not first.lora_A or (m.rank, m.alpha, m.use_rslora) != (first.rank, first.alpha,
                                                                                      first.use_rslora) for m in lora):
                raise AdapterError(f"layer {i}: q/k/v adapters must share lora_A, rank and alpha to form PEFT's "
                                   f"c_attn adapter")
            B = torch.cat([m.lora_B.detach() if isinstance(m, LoRALinear) else
                           first.lora_B.new_zeros(m.out_features, first.rank) for m in mods])  # (out, r)
            module = f"h.{i}.{peft_name}"
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = first.lora_A.detach().contiguous().cpu()
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B.contiguous().cpu()
            rank[module], alpha[module] = first.rank, first.alpha
            rslora.add(first.use_rslora)
            dropout.add(first.lora_dropout.p)
    if not tensors:
        raise AdapterError("the model has no LoRA adapters to save")
    if len(rslora) > 1:
        raise AdapterError("adapters mix rsLoRA and plain scaling, which one PEFT config cannot express")
    r = Counter(rank.values()).most_common(1)[0][0]
    a = Counter(alpha.values()).most_common(1)[0][0]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": getattr(body, "lora_base_model", None),
        "r": r, "lora_alpha": _number(a), "lora_dropout": max(dropout), "use_rslora": rslora.pop(),
        "target_modules": _target_modules(set(rank), body.config.n_layer),
        "rank_pattern": {m: v for m, v in rank.items() if v != r},
        "alpha_pattern": {m: _number(v) for m, v in alpha.items() if v != a},
        "fan_in_fan_out": True,  # transformers' GPT-2 uses Conv1D ([in, out] weights); PEFT sets this for it
        "bias": "none", "inference_mode": True, "init_lora_weights": True,
    }
    return tensors, config


def _number(x: float):
    return int(x) if float(x).is_integer() else x


def _target_modules(modules: set[str], n_layer: int):
    """PEFT target_modules: module names when every layer has the same targets, else a regex of the exact modules."""
    kinds = sorted({m.split(".", 2)[2] for m in modules})
    if modules == {f"h.{i}.{k}" for i in range(n_layer) for k in kinds}:
        short = {"attn.c_attn": "c_attn", "mlp.c_fc": "c_fc"}
        names = [short.get(k, k) for k in kinds]
        if "attn.c_proj" in names and "mlp.c_proj" in names:  # PEFT's "c_proj" matches both
            names = [n for n in names if not n.endswith("c_proj")] + ["c_proj"]
        return names
    return r"(?:.*\.)?(?:" + "|".join(re.escape(m) for m in sorted(modules)) + ")"


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def from_peft(tensors: dict[str, torch.Tensor], config: dict, n_layer: int, source: str = "adapter") -> dict:
    """PEFT LoRA state dict + config -> {(layer, peft module): (A, B, rank, alpha, use_rslora)}; refuses what our
    LoRALinear cannot represent exactly, by name."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{source} is a {config.get('peft_type')} adapter; only LoRA is supported")
    bad = [f for f in UNSUPPORTED if config.get(f)] + (["bias=" + repr(config["bias"])]
                                                       if config.get("bias", "none") != "none" else [])
    if bad:
        raise AdapterError(f"{source} uses PEFT features this LoRA cannot represent exactly: {', '.join(bad)}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, value in tensors.items():
        m = PEFT_KEY.match(key)
        if m is None:
            unknown.append(key)
        else:
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    if unknown:
        raise AdapterError(f"{source} holds tensors that are not LoRA A/B of GPT-2's c_attn, c_proj or c_fc (e.g. "
                           f"adapters on the embeddings or lm_head, DoRA magnitudes, biases): {', '.join(sorted(unknown)[:5])}"
                           + (f" ... and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    out = {}
    for (layer, module), ab in sorted(pairs.items()):
        name = f"h.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{source}: {name} has lora_{next(iter(ab))} without its partner")
        if layer >= n_layer:
            raise AdapterError(f"{source} adapts {name}, but the model has {n_layer} layers (h.0 to h.{n_layer - 1})")
        A, B = ab["A"], ab["B"]
        rank = _pattern_value(config.get("rank_pattern"), f"transformer.{name}", config.get("r", 8))
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != rank or B.shape[1] != rank:
            raise AdapterError(f"{source}: {name} lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not have the "
                               f"rank {rank} its config gives")
        alpha = _pattern_value(config.get("alpha_pattern"), f"transformer.{name}", config.get("lora_alpha", 8))
        out[(layer, module)] = (A, B, rank, float(alpha), bool(config.get("use_rslora", False)))
    if not out:
        raise AdapterError(f"{source} holds no LoRA tensors")
    return out


# ---- files ---------------------------------------------------------------------------------------------------------

def save_adapter(model: nn.Module, directory: str | os.PathLike, base_model: str | None = None) -> Path:
    """Write adapter_config.json + adapter_model.safetensors as PEFT does, for transformers' GPT2LMHeadModel."""
    from safetensors.torch import save_file

    tensors, config = to_peft(model)
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, write in ((WEIGHTS_FILE, lambda p: save_file(tensors, p, metadata={"format": "pt"})),
                        (CONFIG_FILE, lambda p: Path(p).write_text(json.dumps(config, indent=2, sort_keys=True)))):
        tmp = directory / f".{name}.tmp-{os.getpid()}"
        write(tmp)
        os.replace(tmp, directory / name)  # a reader sees the old file or the new, never a part
    return directory


def save_base(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Write the frozen base under the adapters (the adapters left out) as a whole HF checkpoint, for a base that
    nothing else can rebuild, such as a random init: PEFT loads an adapter only onto its base
    (base_model_name_or_path). Unmerged adapters only: a merged model's weights are no longer the base's."""
    body = body_of(model)
    if any(m.merged for m in lora_modules(body).values()):
        raise ValueError("the adapters are merged into the weights: unmerge_lora(model) before saving the base")
    keep = {k: v for k, v in body.state_dict().items() if ".lora_" not in k}
    with meta_modules():  # the base's tensors are shared with the model, not copied
        base = GPT2Model(body.config)
    base.load_state_dict(keep, strict=True, assign=True)
    base.save_pretrained(directory)
    return Path(directory)


def read_adapter(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {directory}: not a PEFT adapter folder")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{config_path} is not valid JSON ({e})") from None
    if (directory / WEIGHTS_FILE).is_file():
        from models.loading import read_weights
        tensors = read_weights(directory / WEIGHTS_FILE)
    elif (directory / "adapter_model.bin").is_file():
        from models.loading import read_weights
        tensors = read_weights(directory / "adapter_model.bin")
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} (or adapter_model.bin) in {directory}")
    return tensors, config


@torch.no_grad()
def load_adapter(model: nn.Module, directory: str | os.PathLike, dropout: float | None = None) -> nn.Module:
    """Load a PEFT LoRA adapter (ours or one trained with PEFT on transformers' GPT-2) into `model`.

    Without adapters, the model gets the adapter's (its body is frozen, as apply_lora does); with adapters already
    (resuming a run), their layout, ranks and scalings must be the file's, and the values are copied in place, so an
    optimizer holding the Parameters keeps them. dropout: for further training (default: the adapter's)."""
    body = body_of(model)
    tensors, config = read_adapter(directory)
    adapters = from_peft(tensors, config, body.config.n_layer, str(directory))
    if any(m.merged for m in lora_modules(body).values()):
        raise AdapterError("the model's adapters are merged: unmerge_lora(model) before loading another adapter")
    dropout = config.get("lora_dropout", 0.0) if dropout is None else dropout
    fresh = not has_lora(body)
    if fresh:
        check_hyperparameters(int(config.get("r", 8)), float(config.get("lora_alpha", 8)), dropout)
    else:
        _check_same_layout(body, adapters, str(directory))
    for (layer, module), (A, B, rank, _, _) in adapters.items():  # every check before anything changes
        linears = [body.get_submodule(f"gpt_layers.{layer}.{n}") for n in PEFT_MODULES[module]]
        out = sum(m.out_features for m in linears)
        if A.shape[1] != linears[0].in_features or B.shape[0] != out:
            raise AdapterError(f"{directory} was made for another base shape: h.{layer}.{module}.lora_A "
                               f"{tuple(A.shape)} / lora_B {tuple(B.shape)}, but this model needs "
                               f"({rank}, {linears[0].in_features}) / ({out}, {rank})")
        for linear, B_part in zip(linears, B.split([m.out_features for m in linears])):
            if not fresh and not isinstance(linear, LoRALinear) and bool(B_part.any()):
                raise AdapterError(f"{directory}: h.{layer}.{module} changes a projection this model's LoRA does not "
                                   f"adapt (gpt_layers.{layer}.{linear_name(body, linear)}); apply_lora with that target")
    if fresh:
        body.requires_grad_(False)
    for (layer, module), (A, B, rank, alpha, rslora) in adapters.items():
        ours = PEFT_MODULES[module]
        if fresh:
            _wrap(body, layer, ours, rank, alpha, dropout, rslora)
        linears = [body.get_submodule(f"gpt_layers.{layer}.{n}") for n in ours]
        for linear, B_part in zip(linears, B.split([m.out_features for m in linears])):
            if isinstance(linear, LoRALinear):
                linear.lora_A.copy_(A)
                linear.lora_B.copy_(B_part)
    if fresh:
        body.lora_base_model = config.get("base_model_name_or_path")
    return model


def _check_same_layout(body: GPT2Model, adapters: dict, source: str) -> None:
    have = set(_modules_of(body))
    given = {f"h.{layer}.{module}" for layer, module in adapters}
    if have != given:
        raise AdapterError(f"{source} adapts other modules than the model's LoRA: only in the file: "
                           f"{sorted(given - have)[:5]}, only in the model: {sorted(have - given)[:5]}")
    for (layer, module), (_, _, rank, alpha, rslora) in adapters.items():
        m = next(x for x in (body.get_submodule(f"gpt_layers.{layer}.{n}") for n in PEFT_MODULES[module])
                 if isinstance(x, LoRALinear))
        if (m.rank, m.alpha, m.use_rslora) != (rank, alpha, rslora):
            raise AdapterError(f"{source}: h.{layer}.{module} has rank {rank}, alpha {alpha:g}, rsLoRA {rslora}; the "
                               f"model's LoRA there has rank {m.rank}, alpha {m.alpha:g}, rsLoRA {m.use_rslora}")


def linear_name(body: GPT2Model, linear: nn.Module) -> str:
    return next(n for n, m in body.gpt_layers.named_modules() if m is linear).split(".", 1)[1]


def _modules_of(body: GPT2Model):
    for i, layer in enumerate(body.gpt_layers):
        for peft_name, ours in PEFT_MODULES.items():
            if any(isinstance(layer.get_submodule(n), LoRALinear) for n in ours):
                yield f"h.{i}.{peft_name}"
