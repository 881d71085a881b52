"""Hugging Face GPT-2 checkpoints <-> our GPT2Model.

The key map is data: OURS_TO_HF names every tensor of our body and the HF tensor it comes from. Two pure functions
convert whole state dicts (`hf_to_ours`, `ours_to_hf`); the rest finds files (hub id, HF folder, single weights file),
reads them safely, and writes our models back out in HF format.

HF quirks handled here: Conv1D stores weights as [in, out] (we transpose into nn.Linear's [out, in]); q, k and v are
one fused `c_attn` (we split it in three); checkpoints may carry the `transformer.` prefix, a tied `lm_head.weight`,
and the constant `attn.bias` / `attn.masked_bias` mask buffers of old releases (ignored).

Variants (config.py) keep this layout and drop or add tensors: no `wpe` with RoPE, no biases with bias=False, norms
without weights with norm_scale=False (and without `.bias` as RMSNorms), `attn.q_norm` / `attn.k_norm` with
qk_norm, a top-level `lm_head.weight` when untied (as transformers saves an untied GPT-2); under grouped-query
attention `c_attn` fuses q (C) with the smaller k and v (n_kv_head * head_dim each). transformers' GPT-2 loads the
folders of the variants it can run (untied head, ReLU^2); GPT2Config.to_hf names what it cannot.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode

from config import PRESETS, GPT2Config
from models.hub import HubUnavailableError, expand, hub_reachable
from modules import hugepages

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
    "gpt_layers.{}.self_attention.q_norm.weight": "h.{}.attn.q_norm.weight",  # qk_norm with norm_scale
    "gpt_layers.{}.self_attention.k_norm.weight": "h.{}.attn.k_norm.weight",
    "lm_head.weight": "lm_head.weight",  # untied LM head (top level in HF files: no `transformer.` prefix)
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
LM_HEAD_HF = "lm_head.weight"

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model: wrong keys, shapes, or an unreadable file."""


def _present(ours: str, config: GPT2Config) -> bool:
    """Whether a model of `config` has the tensor `ours` (a key of OURS_TO_HF or QKV_OURS): GPT-2 has all but the
    q/k norms and the untied head; variants drop some and add those."""
    if ours.startswith("pos_embedding."):
        return config.position_embedding == "learned"
    if ours.startswith("lm_head."):
        return not config.tie_word_embeddings
    if ".q_norm." in ours or ".k_norm." in ours:
        return config.qk_norm and config.norm_scale
    if "layer_norm." in ours:
        return config.norm_scale and (ours.endswith(".weight") or config.norm == "layernorm" and config.bias)
    return ours.endswith(".weight") or config.bias  # Linear layers


def _as_config(config: GPT2Config | int) -> GPT2Config:
    """An int is the layer count of a plain GPT-2 (the only other field the key map reads is none of its sizes)."""
    return GPT2Config(n_layer=config) if isinstance(config, int) else config


def _layer_keys(config: GPT2Config) -> Iterable[tuple[str, str]]:
    for ours, hf in OURS_TO_HF.items():
        if not _present(ours, config):
            continue
        if "{}" in ours:
            for i in range(config.n_layer):
                yield ours.format(i), hf.format(i)
        else:
            yield ours, hf


def _describe(keys: Iterable[str], limit: int = 10) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def strip_hf_state_dict(hf_sd: dict[str, torch.Tensor], tied: bool = True) -> dict[str, torch.Tensor]:
    """Drop the `transformer.` prefix and ignored buffers; with a tied head, drop `lm_head.weight` too (checking it
    really is tied). An untied head's `lm_head.weight` stays, under that name."""
    out = {}
    for key, value in hf_sd.items():
        key = key[len(HF_PREFIX):] if key.startswith(HF_PREFIX) else key
        if not IGNORED_HF.match(key):
            out[key] = value
    if not tied:
        return out
    lm_head = out.pop(LM_HEAD_HF, None)
    wte = out.get("wte.weight")
    if lm_head is not None and wte is not None and lm_head.device.type != "meta" and not torch.equal(lm_head, wte):
        raise CheckpointError("checkpoint has an lm_head.weight that differs from wte.weight, but the config ties the "
                              "LM head to the token embedding (an untied head needs tie_word_embeddings=False)")
    return out


def hf_to_ours(hf_sd: dict[str, torch.Tensor], config: GPT2Config | int) -> dict[str, torch.Tensor]:
    """HF GPT-2 state dict (with or without `transformer.`) -> our GPT2Model state dict, for a model of `config`
    (an int: a GPT-2 of that many layers). Fails naming missing and unexpected keys."""
    config = _as_config(config)
    hf_sd = strip_hf_state_dict(hf_sd, tied=config.tie_word_embeddings)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for ours, hf in _layer_keys(config):
        if hf not in hf_sd:
            missing.append(hf)
            continue
        value = hf_sd[hf]
        out[ours] = value.t().contiguous() if CONV1D_HF.match(hf) else value
        used.add(hf)
    for i in range(config.n_layer):
        sizes = None  # q, k, v output sizes, read from the fused weight: (C, kv, kv) with kv = C except under GQA
        for kind in ("weight", "bias"):
            if not _present(QKV_OURS[0].format(i, kind), config):
                continue
            hf = QKV_HF.format(i, kind)
            if hf not in hf_sd:
                missing.append(hf)
                continue
            used.add(hf)
            fused = hf_sd[hf].t() if kind == "weight" else hf_sd[hf]  # weight -> (C + 2 kv, C); bias (C + 2 kv,)
            if kind == "weight":
                kv, odd = divmod(fused.shape[0] - fused.shape[-1], 2)  # kv = C, or less under grouped-query attention
                sizes = (fused.shape[-1], kv, kv) if fused.dim() == 2 and kv > 0 and not odd else None
            elif sizes is None:  # the weight is missing or malformed, and reported so
                continue
            if sizes is None or fused.shape[0] != sum(sizes):
                raise CheckpointError(f"{hf} has shape {tuple(hf_sd[hf].shape)}, which does not split into q (C) and "
                                      f"equal k and v parts")
            for name, part in zip(QKV_OURS, fused.split(sizes, dim=0)):
                out[name.format(i, kind)] = part.contiguous()
    unexpected = set(hf_sd) - used
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing keys: {_describe(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_describe(unexpected)}")
        raise CheckpointError(f"checkpoint does not match a {config.n_layer}-layer {_kind(config)}: " + "; ".join(problems))
    return out


def _kind(config: GPT2Config) -> str:
    variants = config.variant_fields()
    return "GPT-2" if not variants else f"GPT-2 variant ({', '.join(f'{v}={getattr(config, v)!r}' for v in variants)})"


def ours_to_hf(our_sd: dict[str, torch.Tensor], config: GPT2Config | int) -> dict[str, torch.Tensor]:
    """Our GPT2Model state dict -> HF GPT2Model state dict (no prefix; `lm_head.weight` only when untied)."""
    config = _as_config(config)
    out = {}
    for ours, hf in _layer_keys(config):
        value = our_sd[ours]
        out[hf] = value.t().contiguous() if CONV1D_HF.match(hf) else value
    for i in range(config.n_layer):
        for kind in ("weight", "bias"):
            if _present(QKV_OURS[0].format(i, kind), config):
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
    what = (f"cannot get {repo_id!r} from the Hugging Face hub: it does not answer (offline?) and the local cache "
            f"does not hold it")
    hint = ("Load a local model instead: a folder made with save_pretrained, such as checkpoints/random-gpt2, the "
            "random-init gpt2 that `python -m models.parity` saves there")
    try:
        if config_path is None:
            if not hub_reachable():  # one probe per process instead of five retries per file
                raise HubUnavailableError(what, hint)
            config_path = Path(hf_hub_download(repo_id, "config.json"))
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id!r} is neither a local path nor a model on the Hugging Face hub") from None
    except HubUnavailableError:
        raise
    except (LocalEntryNotFoundError, OSError) as e:
        raise HubUnavailableError(f"{what} ({type(e).__name__})", hint) from None
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

class _NoInitDraws(TorchFunctionMode):
    """Leaves out the fills and random draws of module construction (torch.nn.init's functions and the tensor methods
    they use) on meta tensors, passing every other call on. A meta tensor holds no values, so each of these is a no-op
    there, except that torch runs normal_ on a meta tensor through its Python reference, whose first call imports
    torch._dynamo: 1.5 s of every process that loads a checkpoint (nn.Embedding draws its weight as it is built)."""

    SKIPPED = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED or getattr(func, "__module__", None) == "torch.nn.init":
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_modules():
    """Modules built inside are on the meta device with no init work: shapes only, for weights about to be assigned
    (load_state_dict(..., assign=True))."""
    with torch.device("meta"), _NoInitDraws():
        yield


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
    our_sd = hf_to_ours(hf_sd, config)
    del hf_sd

    with meta_modules():  # no init of weights that are about to be replaced
        instance = cls(config)
    body = instance.gpt if hasattr(instance, "gpt") else instance
    _check_shapes(body, our_sd, str(weights_path))
    instance.to_empty(device="cpu")
    body.load_state_dict(our_sd, strict=True, assign=True)
    del our_sd  # the parameters hold the tensors now: hugepages.place frees each as it moves it
    body.position_ids = torch.arange(config.n_positions).unsqueeze(0)
    if dtype is not None:
        instance.to(dtype)
    hugepages.place(instance, views=True)  # decoding streams the weights: 2 MiB pages read them faster (Linux)
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
    hf_sd = ours_to_hf({k: v.detach() for k, v in body.state_dict().items()}, body.config)
    hf_sd = {(k if k == LM_HEAD_HF else HF_PREFIX + k): v.contiguous().cpu() for k, v in hf_sd.items()}

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
