"""A run's folder: OUT/last (everything an exact resume needs) and OUT/best (the weights, with tokenizer and metrics),
each a checkpoint folder of training/checkpoint.py; what a new run, a resumed one and --overwrite do with the folder;
the weights of a model, its task head and its LoRA adapters (models/lora.py; the --lora_* flags are tasks/lora.py's)
in and out of a checkpoint."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from models.lora import CONFIG_FILE, body_of, has_lora, load_adapter, save_adapter, save_base
from training import distributed as dist
from training.checkpoint import (
    Checkpoint,
    CorruptCheckpointError,
    capture_rng,
    check_resume_settings,
    load_checkpoint,
    resolve,
    restore_rng,
    save_checkpoint,
)
from training.train_config import ArchitectureMismatchError, TrainConfig

CHECKPOINTS = ("best", "last")
RUN_FILES = ("metrics.jsonl", "curves.png", "tensorboard")

ARCHITECTURE = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "norm",
                "norm_scale", "position_embedding", "rope_theta", "kv_heads", "qk_norm", "bias", "tie_word_embeddings",
                "logit_softcap")  # kv_heads: n_kv_head with None read as n_head


def check_architecture(saved, model_config, source) -> None:
    diff = {k: (getattr(saved, k, None), getattr(model_config, k, None)) for k in ARCHITECTURE
            if getattr(saved, k, None) != getattr(model_config, k, None)}
    if diff:
        pairs = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items())
        raise ArchitectureMismatchError(f"checkpoint {source} is a different architecture from the model "
                                        f"(checkpoint vs model): {pairs}")


def split_model(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """(part saved in HF format, names of the other tensors): the model itself if it has save_pretrained (an LM),
    else its `.gpt` body plus the head's parameters and buffers."""
    if hasattr(model, "save_pretrained"):
        return model, []
    return model.gpt, [k for k in model.state_dict() if not k.startswith("gpt.")]


def load_weights(model: nn.Module, folder: str | Path) -> Checkpoint:
    """Load a checkpoint folder's weights into `model` (verified against its manifest); returns the Checkpoint."""
    ck = load_checkpoint(folder)
    body, head_keys = split_model(model)
    if not load_if_adapter(model, ck.path):  # a LoRA run's checkpoint holds the adapter, not the frozen base
        loaded = type(body).from_pretrained(ck.path)
        check_architecture(loaded.config, body.config, ck.path)
        body.load_state_dict(loaded.state_dict())
    if set(ck.extra_tensors) != set(head_keys):
        raise ValueError(f"checkpoint {ck.path} holds head tensors {sorted(ck.extra_tensors)}, "
                         f"the model expects {sorted(head_keys)}")
    if head_keys:
        model.load_state_dict(ck.extra_tensors, strict=False)
    return ck


def save_model(folder: Path, model: nn.Module, *, state: dict, optimizer=None, scheduler=None, tokenizer=None) -> None:
    body, head_keys = split_model(model)
    sd = model.state_dict()
    save_checkpoint(folder, checkpoint_part(model) or body, optimizer=optimizer, scheduler=scheduler, state=state,
                    extra_tensors={k: sd[k] for k in head_keys}, tokenizer=tokenizer)


# ---- a LoRA model's checkpoint: its adapter (PEFT's format), never the frozen base --------------------------------

BASE_DIR = "base"  # OUTPUT_DIR/base: the frozen base of a LoRA run on a random init, which --model cannot rebuild


class _AdapterWriter:
    """What save_checkpoint writes for a LoRA model: its adapter, in PEFT's format, in place of the whole model.
    On a `random:` base the adapter's base_model_name_or_path names OUTPUT_DIR/base, where the base weights are
    written (once per process, so a run restarted with --overwrite writes its own), so PEFT can load the adapter."""

    def __init__(self, model: nn.Module):
        self.model = model

    def save_pretrained(self, directory) -> None:
        body = body_of(self.model)
        spec = str(getattr(body, "lora_base_model", None) or "")
        if not spec.startswith("random:"):
            save_adapter(self.model, directory)
            return
        base = (Path(directory).parent / BASE_DIR).resolve()  # directory is a temporary sibling of last/ and best/
        if getattr(body, "lora_base_saved", None) != base:
            save_base(self.model, base)
            body.lora_base_saved = base
        save_adapter(self.model, directory, base_model=str(base))


def checkpoint_part(model: nn.Module) -> _AdapterWriter | None:
    """What save_checkpoint writes in place of the body: the adapter writer of a LoRA model, None for a model without
    adapters."""
    return _AdapterWriter(model) if has_lora(model) else None


def load_if_adapter(model: nn.Module, folder: Path) -> bool:
    """Load a LoRA checkpoint's adapter into `model` and return True, or return False for a whole-model checkpoint
    into a model without adapters. A mix of the two is an error naming the fix."""
    is_adapter, lora = (Path(folder) / CONFIG_FILE).is_file(), has_lora(model)
    if is_adapter and not lora:
        raise ValueError(f"checkpoint {folder} holds a LoRA adapter, not a whole model: give the --lora_* flags it "
                         f"was trained with (its {CONFIG_FILE} lists them)")
    if lora and not is_adapter:
        raise ValueError(f"checkpoint {folder} holds a whole model, but this run trains LoRA adapters (--lora_rank)")
    if lora:
        load_adapter(model, folder)
    return lora


def exists(folder: Path) -> bool:
    try:
        resolve(folder)
        return True
    except FileNotFoundError:
        return False


def remove_run(out: Path) -> None:
    """--overwrite: the old run's checkpoints (whatever state they are in) and its metrics go; other files stay."""
    if dist.is_main() and out.is_dir():
        doomed = [out / f"{p}{name}{s}" for name in CHECKPOINTS for p, s in (("", ""), (".", ".old"))]
        doomed += list(out.glob(".*.tmp-*")) + [out / name for name in RUN_FILES]
        existing = [f for f in doomed if f.exists()]
        for f in existing:  # a link goes, not what it points to (rmtree refuses links, and ignore_errors hid that)
            shutil.rmtree(f, ignore_errors=True) if f.is_dir() and not f.is_symlink() else f.unlink()
        if any(f.name.lstrip(".").split(".")[0] in CHECKPOINTS for f in existing):
            print(f"--overwrite: removed the checkpoints in {out}")
    dist.barrier()


def open_run(cfg: TrainConfig) -> Checkpoint | None:
    """The checkpoint that cfg.resume continues (OUT/last, verified), or None for a new run. A new run refuses an
    output folder that holds one (unless cfg.overwrite, which clears it first)."""
    out = Path(cfg.output_dir)
    if cfg.overwrite and not cfg.resume:
        remove_run(out)  # before looking: a broken checkpoint is cleared, not read
    found = next((name for name in ("last", "best") if exists(out / name)), None)
    if cfg.resume:
        if found != "last":
            raise FileNotFoundError(f"--resume: no checkpoint to continue in {out} (it has no last/)")
        try:
            return load_checkpoint(out / "last")
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e}; --resume cannot continue it: pass --overwrite to start afresh") from None
    if found and not cfg.max_steps:
        raise FileExistsError(f"{out / found} already holds a checkpoint: pass --resume to continue it or "
                              f"--overwrite to start again (or choose another --output_dir)")
    return None


# ---- what OUT/last holds besides weights, optimizer and schedule --------------------------------------------------

@dataclass
class RunState:
    """What a checkpoint of OUT/last holds besides weights, optimizer and schedule."""
    step: int = 0
    epoch: float = 0.0
    best: dict | None = None  # {"step", "epoch", "metrics"} of OUT/best
    last_eval: dict = field(default_factory=dict)  # the latest evaluation's record
    evaluated_at: int = -1  # the step of the latest evaluation (a skipped step must not evaluate twice)
    history: list = field(default_factory=list)  # every evaluation's record
    skipped: int = 0
    overflows: int = 0
    wall_s: float = 0.0  # seconds of training (steps and evaluations) over all sessions of the run
    log_sums: dict = field(default_factory=dict)
    eval_sums: dict = field(default_factory=dict)


def rng_state(batches) -> dict:
    """RNG states to checkpoint: rank 0's, and every rank's under torchrun (a collective: all ranks call it)."""
    states = dist.gather_objects(capture_rng())
    return {"rng": states[0], **({"rank_rng": states} if len(states) > 1 else {}), "batches": batches.state_dict()}


def restore_rng_state(state: dict, batches) -> None:
    ranks = state.get("rank_rng")
    restore_rng(ranks[dist.rank()] if ranks and dist.rank() < len(ranks) else state["rng"])
    batches.load_state_dict(state["batches"])


def resume_run(ck: Checkpoint, model: nn.Module, optimizer, scheduler, scaler, batches, run_info: dict,
               weights_loaded: bool) -> RunState:
    """Continue OUT/last: its weights (unless the caller built the model from it), optimizer, schedule, loss scale,
    RNG states and batch position; a changed setting in run_info is refused by name (epochs / max_iters may grow)."""
    if not weights_loaded:
        load_weights(model, ck.path)
    check_resume_settings(ck.state.get("run", {}), run_info, ck.path, extendable=("epochs", "max_iters"))
    optimizer.load_state_dict(ck.optimizer)
    scheduler.load_state_dict(ck.scheduler)
    if ck.state.get("scaler"):
        scaler.load_state_dict(ck.state["scaler"])
    restore_rng_state(ck.state, batches)
    state = RunState(**{k: v for k, v in ck.state.items() if k in RunState.__dataclass_fields__})
    if not dist.is_main():  # the saved sums are already over all ranks: rank 0 carries them on
        state.log_sums, state.eval_sums = {}, {}
    return state


def save_run(out: Path, model: nn.Module, state: RunState, run_info: dict, best: bool, optimizer, scheduler, scaler,
             batches, tokenizer=None) -> None:
    """OUT/best when `best`, and OUT/last (a collective: all ranks gather their RNG states; rank 0 writes)."""
    rng = rng_state(batches)
    if not dist.is_main():
        return
    if best:
        save_model(out / "best", model, tokenizer=tokenizer,
                   state={"step": state.step, "epoch": state.epoch, "best": state.best, "run": run_info})
    full = {**vars(state), **rng, "scaler": scaler.state_dict(), "run": run_info}
    save_model(out / "last", model, state=full, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer)
