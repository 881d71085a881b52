"""Training checkpoints that survive crashes: a folder per checkpoint, replaced atomically, verified on load.

A checkpoint folder holds the model in HF format (config.json + model.safetensors, loadable by transformers),
optional extra tensors (e.g. a task head) in extra.safetensors, the training state (optimizer, scheduler, counters,
RNG states) in training_state.pt, optional tokenizer files, and manifest.json, written last, with each file's size
and SHA-256. A folder without a valid manifest is incomplete or corrupt and is refused with a clear error.

Replacing `out/last` writes `out/.last.tmp-<pid>` first, fsyncs it, moves the old folder to `out/.last.old`, moves
the new one in, then deletes the old one. A crash at any moment leaves either the old or the new checkpoint whole;
`resolve` finds whichever survived.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "manifest.json"
STATE = "training_state.pt"
EXTRA = "extra.safetensors"


class CorruptCheckpointError(ValueError):
    """A checkpoint folder that is incomplete, truncated or altered."""


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def capture_rng(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA, where present) RNG states (tensors and plain values only, so weights_only loading accepts them)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.copy()), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def restore_rng(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save_checkpoint(directory: str | os.PathLike, model=None, *, optimizer=None, scheduler=None,
                    state: dict[str, Any] | None = None, extra_tensors: dict[str, torch.Tensor] | None = None,
                    tokenizer=None) -> Path:
    """Atomically (re)write the checkpoint folder `directory`.

    model: anything with save_pretrained(dir) (our GPT-2 body or LM). state: counters, metrics, RNG (plain values and
    tensors). tokenizer: anything with save_pretrained(dir) (an HF tokenizer or our CharTokenizer).
    """
    from safetensors.torch import save_file

    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f".{final.name}.old")
    for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by a process killed while saving
        if stale == tmp or not _pid_alive(stale.name.rsplit("-", 1)[-1]):
            shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    if model is not None:
        model.save_pretrained(tmp)
    if extra_tensors:
        save_file({k: v.detach().contiguous().cpu() for k, v in extra_tensors.items()}, tmp / EXTRA,
                  metadata={"format": "pt"})
    training_state = {"state": state or {}}
    if optimizer is not None:
        training_state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        training_state["scheduler"] = scheduler.state_dict()
    torch.save(training_state, tmp / STATE)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in files + [tmp / MANIFEST]:
        fsync_path(p)
    fsync_path(tmp)

    if old.exists() and not final.exists():  # an earlier replacement was interrupted: old is the good one
        os.replace(old, final)
    elif old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)
    return final


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def resolve(directory: str | os.PathLike) -> Path:
    """The checkpoint folder to read: `directory`, or the previous one if a crash interrupted its replacement."""
    final = Path(directory)
    if final.is_dir():
        return final
    old = final.with_name(f".{final.name}.old")
    if old.is_dir():
        return old
    raise FileNotFoundError(f"no checkpoint at {final}")


def verify(directory: str | os.PathLike) -> Path:
    """Check every file against the manifest; raise CorruptCheckpointError naming what is wrong."""
    folder = resolve(directory)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CorruptCheckpointError(f"checkpoint {folder} is incomplete: no {MANIFEST} (was the save interrupted?)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"checkpoint {folder}: {MANIFEST} is not valid JSON ({e})") from None
    for name, meta in manifest.items():
        path = folder / name
        if not path.is_file():
            raise CorruptCheckpointError(f"checkpoint {folder} is missing {name}")
        if path.stat().st_size != meta["bytes"]:
            raise CorruptCheckpointError(f"checkpoint {folder}: {name} has {path.stat().st_size} bytes, "
                                         f"expected {meta['bytes']} (truncated?)")
        if _sha256(path) != meta["sha256"]:
            raise CorruptCheckpointError(f"checkpoint {folder}: {name} does not match its checksum (corrupted)")
    return folder


@dataclass
class Checkpoint:
    path: Path
    state: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def load_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """Verify and read the training state of a checkpoint folder (the model is loaded with from_pretrained(path))."""
    from safetensors.torch import load_file

    folder = verify(directory)
    try:
        training_state = torch.load(folder / STATE, map_location="cpu", weights_only=True)
    except Exception as e:
        if "unsupported global" in str(e).lower():  # torch's weights-only refusal of a class not allowed
            raise CorruptCheckpointError(f"refusing to load {folder / STATE}: it holds Python objects other than "
                                         "tensors and plain values, which could run code when unpickled "
                                         "(weights_only=True)") from None
        raise CorruptCheckpointError(f"checkpoint {folder}: cannot read {STATE} ({e})") from None
    extra = load_file(folder / EXTRA) if (folder / EXTRA).is_file() else {}
    return Checkpoint(folder, training_state["state"], training_state.get("optimizer"),
                      training_state.get("scheduler"), extra)


def check_resume_settings(saved: dict[str, Any], now: dict[str, Any], source, extendable: tuple[str, ...] = ()) -> None:
    """The one resume rule of both training loops: a setting that changes what the saved state means (data, model,
    optimizer, batch, schedule shape, seed, ...) must be as it was, and the error names each one that is not;
    the `extendable` ones (the schedule's length: epochs, max_iters) may grow, to train a run further."""
    # (a setting the saved run did not record, from an older version of a loop, is not compared)
    changed = {k: (saved[k], v) for k, v in now.items() if k not in extendable and k in saved and saved[k] != v}
    shrunk = {k: (saved.get(k), now[k]) for k in extendable
              if k in now and saved.get(k) is not None and now[k] < saved[k]}
    if changed or shrunk:
        parts = [f"{k} was {a!r}, now {b!r}" for k, (a, b) in changed.items()]
        parts += [f"{k} was {a!r}, now {b!r} (it may only grow)" for k, (a, b) in shrunk.items()]
        raise ValueError(f"cannot resume {source}: these settings differ from the saved run's: {'; '.join(parts)}. "
                         f"Pass the run's own settings (only {', '.join(extendable) or 'none'} may be raised), or "
                         f"start a new run")


def read_step(directory: str | os.PathLike) -> int:
    """The saved step counter of a checkpoint, read without verifying the folder or loading its tensors (the file
    is memory-mapped), to choose between checkpoints; the chosen one is verified when it is loaded."""
    folder = resolve(directory)
    try:
        state = torch.load(folder / STATE, map_location="cpu", weights_only=True, mmap=True)["state"]
        return int(state["step"])
    except Exception as e:
        raise CorruptCheckpointError(f"checkpoint {folder}: cannot read its step from {STATE} ({e}); "
                                     f"pass --overwrite to start afresh") from None
