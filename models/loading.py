"""Hugging Face GPT-2 checkpoints <-> our GPT2Model.

The key map is data: OURS_TO_HF names every tensor of our body and the HF tensor it comes from. Two pure functions
convert whole state dicts (`hf_to_ours`, `ours_to_hf`); the rest finds files (hub id, HF folder, single weights file),
reads them safely, and writes our models back out in HF format.

HF quirks handled here: Conv1D stores weights as [in, out] (we transpose into nn.Linear's [out, in]); q, k and v are
one fused `c_attn` (we split it in three); checkpoints may carry the `transformer.` prefix, a tied `lm_head.weight`,
and the constant `attn.bias` / `attn.masked_bias` mask buffers of old releases (ignored).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from config import PRESETS, GPT2Config
from models.hub import expand

# Our GPT2Model key -> HF GPT2Model key. "{}" is the layer index.
OURS_TO_HF: dict[str, str] = {
    "word_embedding.weight": "wte.weight",
    "pos_embedding.weight": "wpe.weight",
    "final_layer_norm.weight": "ln_f.weight",
    "final_layer_norm.bias": "ln_f.bias",
    "gpt_layers.{}.attention_layer_norm.weight": "h.{}.ln_1.weight",
    "gpt_layers.{}.attention_layer_norm.bias": "h.{}.ln_1.bias",
    "gpt_layers.{}.attention_dense.weight": "h.{}.attn.c_proj.weight",
    "gpt_layers.{}.attention_dense.bias": "h.{}.attn.c_proj.bias",
    "gpt_layers.{}.out_layer_norm.weight": "h.{}.ln_2.weight",
    "gpt_layers.{}.out_layer_norm.bias": "h.{}.ln_2.bias",
    "gpt_layers.{}.interm_dense.weight": "h.{}.mlp.c_fc.weight",
    "gpt_layers.{}.interm_dense.bias": "h.{}.mlp.c_fc.bias",
    "gpt_layers.{}.out_dense.weight": "h.{}.mlp.c_proj.weight",
    "gpt_layers.{}.out_dense.bias": "h.{}.mlp.c_proj.bias",
}
# HF's fused attention input projection, split into our three projections in this order.
QKV_HF = "h.{}.attn.c_attn.{}"  # layer, weight|bias
QKV_OURS = ("gpt_layers.{}.self_attention.query.{}", "gpt_layers.{}.self_attention.key.{}",
            "gpt_layers.{}.self_attention.value.{}")
# HF Conv1D weights are [in, out]; these need a transpose either way.
CONV1D_HF = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# Constant causal-mask buffers saved by old transformers versions: not weights.
IGNORED_HF = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
HF_PREFIX = "transformer."
TIED_HF = "lm_head.weight"

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model: wrong keys, shapes, or an unreadable file."""


def _layer_keys(n_layer: int) -> Iterable[tuple[str, str]]:
    for ours, hf in OURS_TO_HF.items():
        if "{}" in ours:
            for i in range(n_layer):
                yield ours.format(i), hf.format(i)
        else:
            yield ours, hf


def _describe(keys: Iterable[str], limit: int = 10) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def strip_hf_state_dict(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the `transformer.` prefix, ignored buffers and the tied LM head (checking it really is tied)."""
    out = {}
    for key, value in hf_sd.items():
        key = key[len(HF_PREFIX):] if key.startswith(HF_PREFIX) else key
        if not IGNORED_HF.match(key):
            out[key] = value
    lm_head = out.pop(TIED_HF, None)
    wte = out.get("wte.weight")
    if lm_head is not None and wte is not None and lm_head.device.type != "meta" and not torch.equal(lm_head, wte):
        raise CheckpointError("checkpoint has an lm_head.weight that differs from wte.weight; only the tied LM head "
                              "of GPT-2 is supported")
    return out


def hf_to_ours(hf_sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """HF GPT-2 state dict (with or without `transformer.`) -> our GPT2Model state dict. Fails naming bad keys."""
    hf_sd = strip_hf_state_dict(hf_sd)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for ours, hf in _layer_keys(n_layer):
        if hf not in hf_sd:
            missing.append(hf)
            continue
        value = hf_sd[hf]
        out[ours] = value.t().contiguous() if CONV1D_HF.match(hf) else value
        used.add(hf)
    for i in range(n_layer):
        for kind in ("weight", "bias"):
            hf = QKV_HF.format(i, kind)
            if hf not in hf_sd:
                missing.append(hf)
                continue
            fused = hf_sd[hf].t() if kind == "weight" else hf_sd[hf]  # weight -> (3C, C); bias (3C,)
            if fused.shape[0] % 3:
                raise CheckpointError(f"{hf} has shape {tuple(hf_sd[hf].shape)}; its q/k/v dimension is not divisible by 3")
            for name, part in zip(QKV_OURS, fused.chunk(3, dim=0)):
                out[name.format(i, kind)] = part.contiguous()
            used.add(hf)
    unexpected = set(hf_sd) - used
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing keys: {_describe(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_describe(unexpected)}")
        raise CheckpointError(f"checkpoint does not match a {n_layer}-layer GPT-2: " + "; ".join(problems))
    return out


def ours_to_hf(our_sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Our GPT2Model state dict -> HF GPT2Model state dict (no prefix, no lm_head)."""
    out = {}
    for ours, hf in _layer_keys(n_layer):
        value = our_sd[ours]
        out[hf] = value.t().contiguous() if CONV1D_HF.match(hf) else value
    for i in range(n_layer):
        for kind in ("weight", "bias"):
            fused = torch.cat([our_sd[name.format(i, kind)] for name in QKV_OURS], dim=0)
            out[QKV_HF.format(i, kind)] = fused.t().contiguous() if kind == "weight" else fused
    return out


# ---- reading files ---------------------------------------------------------------------------------------------------

def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a .safetensors file, a pickled torch file (weights_only), or a sharded index (.index.json)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is not a valid sharded-checkpoint index ({e})") from None
        sd: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            sd.update(read_weights(path.parent / shard))
        return sd
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path}: the file is truncated or not a safetensors file ({e})") from None
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses arbitrary objects; a truncated zip fails to open
        message = str(e).lower()  # torch words it "Unsupported global" or "unsupported GLOBAL posix.system"
        if "allowed global" in message or "unsupported global" in message:
            raise CheckpointError(f"refusing to load {path}: it holds Python objects other than tensors, which could "
                                  "run code when unpickled (weights_only=True)") from None
        raise CheckpointError(f"cannot read {path}: the file is truncated or not a torch checkpoint ({e})") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return sd


def _find_weights_in_folder(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no weights in {folder}: expected one of {', '.join(WEIGHT_FILES)}")


def _download_from_hub(repo_id: str) -> tuple[Path, Path]:
    """config.json and the weights of a hub model, through the HF cache (works offline once cached)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:  # the local cache first: no network round trips (and no retries) when the model is already there
        config_path = Path(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except (LocalEntryNotFoundError, OSError):
        config_path = None
    try:
        if config_path is None:
            config_path = Path(hf_hub_download(repo_id, "config.json"))
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id!r} is neither a local path nor a model on the Hugging Face hub") from None
    except (LocalEntryNotFoundError, OSError) as e:
        raise FileNotFoundError(
            f"cannot get {repo_id!r} from the Hugging Face hub and it is not in the local cache "
            f"(offline?): {type(e).__name__}. Pass a local folder made with save_pretrained instead."
        ) from None
    for name in WEIGHT_FILES[:3]:
        try:
            weights = Path(hf_hub_download(repo_id, name, local_files_only=True))
        except (LocalEntryNotFoundError, OSError):
            try:
                weights = Path(hf_hub_download(repo_id, name))
            except (EntryNotFoundError, LocalEntryNotFoundError):
                continue
        if name.endswith(".index.json"):
            for shard in sorted(set(json.loads(weights.read_text())["weight_map"].values())):
                hf_hub_download(repo_id, shard)
        return config_path, weights
    raise FileNotFoundError(f"hub model {repo_id!r} has none of {', '.join(WEIGHT_FILES[:3])}")


def resolve_checkpoint(model: str | os.PathLike) -> tuple[Path | None, Path]:
    """-> (config.json or None, weights file) for a folder, a weights file or a hub id."""
    model = expand(model)  # a quoted `~/...` reaches us unexpanded
    path = Path(model)
    if path.is_dir():
        config = path / "config.json"
        return (config if config.is_file() else None), _find_weights_in_folder(path)
    if path.is_file():
        config = path.parent / "config.json"
        return (config if config.is_file() else None), path
    name = str(model)
    if name.startswith((".", "/", "~")) or os.sep in name and name.count("/") != 1 or path.suffix in (".bin", ".safetensors", ".pt"):
        raise FileNotFoundError(f"checkpoint not found: {model}")
    return _download_from_hub(name)


def infer_config(hf_sd: dict[str, torch.Tensor]) -> GPT2Config:
    """Config from tensor shapes, for a bare weights file. n_head is not in the shapes: match a preset."""
    sd = strip_hf_state_dict(hf_sd)
    if "wte.weight" not in sd or "wpe.weight" not in sd:
        raise CheckpointError("cannot infer a GPT-2 config: the weights have no wte.weight / wpe.weight")
    vocab, n_embd = sd["wte.weight"].shape
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"h\.(\d+)\.", k))}
    n_layer = max(layers) + 1 if layers else 0
    for preset in PRESETS.values():
        if preset["n_embd"] == n_embd and preset["n_layer"] == n_layer:
            return GPT2Config(vocab_size=vocab, n_positions=sd["wpe.weight"].shape[0], n_embd=n_embd, n_layer=n_layer,
                              n_head=preset["n_head"], n_inner=sd["h.0.mlp.c_fc.weight"].shape[1])
    raise CheckpointError(f"cannot infer the number of heads of a GPT-2 with n_embd={n_embd}, n_layer={n_layer} "
                          "from a bare weights file; put a config.json beside it or pass config=")


# ---- loading into models ---------------------------------------------------------------------------------------------

def load_pretrained(cls, model: str | os.PathLike, config: GPT2Config | None = None, dtype: torch.dtype | None = None,
                    expect: dict | None = None, **config_overrides):
    """Build `cls` (GPT2Model or GPT2LMHeadModel) with the weights of a hub id, HF folder or weights file."""
    config_path, weights_path = resolve_checkpoint(model)
    hf_sd = read_weights(weights_path)
    if config is None:
        config = GPT2Config.from_json_file(config_path) if config_path is not None else infer_config(hf_sd)
    if config_overrides:
        config = config.replace(**config_overrides)
    for name, value in (expect or {}).items():
        if value is not None and getattr(config, name) != value:
            raise CheckpointError(f"{model} has {name}={getattr(config, name)}, but {value} was asked for")
    our_sd = hf_to_ours(hf_sd, config.n_layer)
    del hf_sd

    with torch.device("meta"):  # no random init of weights that are about to be replaced
        instance = cls(config)
    body = instance.gpt if hasattr(instance, "gpt") else instance
    _check_shapes(body, our_sd, str(weights_path))
    instance.to_empty(device="cpu")
    body.load_state_dict(our_sd, strict=True, assign=True)
    body.position_ids = torch.arange(config.n_positions).unsqueeze(0)
    if dtype is not None:
        instance.to(dtype)
    return instance.eval()


def _check_shapes(body: torch.nn.Module, sd: dict[str, torch.Tensor], source: str) -> None:
    expected = body.state_dict()
    bad = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
           for k, v in sd.items() if k in expected and v.shape != expected[k].shape]
    if bad:
        raise CheckpointError(f"shape mismatch loading {source} (does config.json match the weights?): "
                              + "; ".join(bad[:10]) + (f" ... and {len(bad) - 10} more" if len(bad) > 10 else ""))


def save_pretrained(body: torch.nn.Module, save_directory: str | os.PathLike) -> None:
    """Write `body` (a GPT2Model) as config.json + model.safetensors in HF GPT2LMHeadModel layout.

    Each file is written to a temporary name, flushed to disk, then renamed over the old one, so an interruption
    never leaves a half-written file behind.
    """
    from safetensors.torch import save_file

    if any(getattr(m, "merged", True) is False for m in body.modules()):  # LoRALinear (modules/lora.py)
        raise CheckpointError("the model has unmerged LoRA adapters, which this format would silently drop: "
                              "models.lora.merge_lora(model) first for a full checkpoint, or save_adapter for "
                              "the adapter alone")
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_sd = ours_to_hf({k: v.detach() for k, v in body.state_dict().items()}, body.config.n_layer)
    hf_sd = {HF_PREFIX + k: v.contiguous().cpu() for k, v in hf_sd.items()}

    def write(name: str, writer) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        os.close(fd)
        try:
            writer(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, directory / name)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    write("model.safetensors", lambda p: save_file(hf_sd, p, metadata={"format": "pt"}))
    write("config.json", body.config.to_json_file)
