"""Train a GPT-2 from scratch on a text file ("Let's build GPT"): text -> token ids on disk -> random windows ->
AdamW with warmup and cosine decay -> periodic loss estimate -> best-val checkpoint -> samples.

    tokenizer = tokenizer_for("gpt2" | folder)                     # "char" tokenizers are built from the corpus
    corpus = prepare_corpus("input.txt", "char", cache_dir)          # ids memory-mapped from cache_dir, 90/10 split
    x, y = get_batch(corpus.train, 12, 64, generator)               # (12, 64) inputs and next-token targets
    losses = estimate_loss(model, {"train": corpus.train, "val": corpus.val}, 20, 12, 64, generator)
    summary = train(args)                                           # the loop behind run_pretrain.py
    text = sample_text(model, tokenizer, "ROMEO:", 200, temperature=0.8, top_k=200)

Checkpoints: out_dir/best (lowest val loss) and out_dir/last (the latest evaluation that did not improve); each
evaluation writes exactly one of them, and --resume continues from whichever holds the later step. A non-finite loss
or gradient stops the run naming the step (the checkpoints are the last good ones), or is skipped with
--skip_nonfinite. Under torchrun every rank draws the same global batch and trains on its rows inside
DistributedDataParallel; rank 0 alone evaluates, writes checkpoints and logs.
"""
from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from config import GPT2Config
from models.bigram import BigramConfig, BigramLM, load_lm
from models.generation import process_logits
from models.gpt2 import GPT2LMHeadModel
from models.hub import expand, load_tokenizer
from optimizer import AdamW, make_lr_scheduler, param_groups_for_weight_decay
from tasks import distributed as dist
from tasks.char_tokenizer import VOCAB_FILE, CharTokenizer
from tasks.checkpoint import (
    capture_rng,
    check_resume_settings,
    load_checkpoint,
    read_step,
    resolve,
    restore_rng,
    save_checkpoint,
)
from tasks.training import MAX_SKIPPED_IN_A_ROW, check_architecture, nonfinite_error

CHUNK_BYTES = 1 << 22  # the corpus is read, checked and encoded 4 MiB at a time


# ---- tokenizers ------------------------------------------------------------------------------------------------

def tokenizer_for(spec: str | os.PathLike):
    """The tokenizer of a checkpoint folder holding char_vocab.json (a CharTokenizer), else a GPT-2 BPE tokenizer
    from models.hub.load_tokenizer (a hub id or folder; `gpt2` falls back to the shared copy offline)."""
    if (Path(expand(spec)) / VOCAB_FILE).is_file():
        return CharTokenizer.from_pretrained(expand(spec))
    return load_tokenizer(spec)


def encode(tokenizer, text: str) -> np.ndarray:
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode_array(text)
    return np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)


def tokenizer_id(tokenizer) -> str:
    """Identifies what a cached id file was encoded with: 'char' (its vocabulary is stored beside it) or a hash of
    the BPE tokenizer's full definition."""
    if isinstance(tokenizer, CharTokenizer):
        return "char"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return "bpe-" + hashlib.sha256(definition.encode()).hexdigest()[:12]


# ---- corpus: UTF-8 text -> ids in a memory-mapped file, encoded chunk by chunk ----------------------------------

def read_text_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """Decoded chunks of a UTF-8 file; invalid UTF-8 raises naming the line and byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(chunk_bytes)
            pending = decoder.getstate()[0]
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                line = newlines + e.object[: e.start].count(b"\n") + 1
                raise ValueError(f"{path}: not UTF-8 text at line {line} (byte {offset - len(pending) + e.start}): "
                                 f"{e.reason}") from None
            offset += len(raw)
            newlines += raw.count(b"\n")
            if text:
                yield text
            if not raw:
                return


def _bpe_split_point(buf: str) -> int:
    """An index where BPE may cut the text without changing its tokens: just before a newline that is followed by
    a non-space. GPT-2's pre-tokenizer makes such a newline a piece of its own, so the pieces on either side come
    out the same whether or not the text is cut there. 0 if there is no such place."""
    end = len(buf) - 1
    while (i := buf.rfind("\n", 0, end)) >= 0:
        if not buf[i + 1].isspace():
            return i
        end = i
    return 0


def _encoded_chunks(path: Path, tokenizer, chunk_bytes: int) -> Iterator[tuple[np.ndarray, int]]:
    """(ids, characters consumed) per chunk of the file."""
    if isinstance(tokenizer, CharTokenizer):  # every character is one token: any cut is safe
        for text in read_text_chunks(path, chunk_bytes):
            yield tokenizer.encode_array(text), len(text)
        return
    buf = ""
    for text in read_text_chunks(path, chunk_bytes):
        buf += text
        cut = _bpe_split_point(buf) if len(buf) >= chunk_bytes else 0
        if cut:
            yield encode(tokenizer, buf[:cut]), cut
            buf = buf[cut:]
    if buf:
        yield encode(tokenizer, buf), len(buf)


@dataclass
class Corpus:
    tokens: np.ndarray  # all ids, memory-mapped (uint16 or uint32)
    num_train: int  # tokens[:num_train] is the train split, the rest val
    tokenizer: Any
    meta: dict

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.num_train]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.num_train:]


def check_corpus_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus file not found: {path}")
    if not path.is_file():
        raise ValueError(f"corpus path {path} is not a file")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"corpus file {path} is not readable")
    if path.stat().st_size == 0:
        raise ValueError(f"corpus file {path} is empty")
    return path


def prepare_corpus(path: str | os.PathLike, tokenizer, cache_dir: str | os.PathLike, val_fraction: float = 0.1,
                   chunk_bytes: int = CHUNK_BYTES) -> Corpus:
    """Encode `path` once into cache_dir (keyed on the file's SHA-256 and the tokenizer) and map it.

    tokenizer: "char" builds the vocabulary from the corpus (sorted set of its characters); a CharTokenizer or an
    HF tokenizer encodes with that vocabulary. The first (1 - val_fraction) of the ids are the train split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    path = check_corpus_file(path)
    # Pass 1: hash, check the UTF-8, collect the characters (never more than a chunk in memory).
    sha, chars, num_chars = hashlib.sha256(), set(), 0
    for text in read_text_chunks(path, chunk_bytes):
        sha.update(text.encode("utf-8", errors="surrogatepass"))
        num_chars += len(text)
        if tokenizer == "char" or isinstance(tokenizer, CharTokenizer):
            chars.update(text)
    if tokenizer == "char":
        tokenizer = CharTokenizer(sorted(chars))
    elif isinstance(tokenizer, CharTokenizer) and not chars <= set(tokenizer.chars):
        missing = "".join(sorted(chars - set(tokenizer.chars)))
        raise ValueError(f"corpus {path} has characters the checkpoint's vocabulary lacks: {missing!r}")
    digest, tok_id = sha.hexdigest(), tokenizer_id(tokenizer)
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{path.stem}-{tok_id}-{digest[:16]}"
    bin_path, meta_path = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json"
    meta = _read_meta(meta_path, bin_path, digest, tok_id, tokenizer)
    if meta is None:
        meta = _encode_to_file(path, tokenizer, bin_path, meta_path, dtype, digest, tok_id, num_chars, chunk_bytes)
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["num_tokens"],))
    return Corpus(tokens, int(len(tokens) * (1 - val_fraction)), tokenizer, meta)


def _read_meta(meta_path: Path, bin_path: Path, digest: str, tok_id: str, tokenizer) -> dict | None:
    """The cache's metadata if the id file is complete and was made from this corpus and vocabulary."""
    if not meta_path.is_file() or not bin_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    complete = bin_path.stat().st_size == meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    same = meta["sha256"] == digest and meta["tokenizer"] == tok_id
    same_vocab = not isinstance(tokenizer, CharTokenizer) or meta.get("chars") == tokenizer.chars
    return meta if complete and same and same_vocab else None


def _encode_to_file(path, tokenizer, bin_path, meta_path, dtype, digest, tok_id, num_chars, chunk_bytes) -> dict:
    tmp = bin_path.with_name(f".{bin_path.name}.tmp-{os.getpid()}")
    num_tokens = 0
    with open(tmp, "wb") as f, tqdm(total=num_chars, unit="char", unit_scale=True, desc=f"tokenizing {path.name}",
                                    leave=False, disable=None) as bar:
        for ids, consumed in _encoded_chunks(path, tokenizer, chunk_bytes):
            ids.astype(dtype).tofile(f)
            num_tokens += len(ids)
            bar.update(consumed)
    os.replace(tmp, bin_path)
    meta = {"corpus": str(path.resolve()), "sha256": digest, "tokenizer": tok_id, "dtype": np.dtype(dtype).name,
            "num_tokens": num_tokens, "vocab_size": len(tokenizer)}
    if isinstance(tokenizer, CharTokenizer):
        meta["chars"] = tokenizer.chars
    tmp_meta = meta_path.with_name(f".{meta_path.name}.tmp-{os.getpid()}")
    tmp_meta.write_text(json.dumps(meta, ensure_ascii=False))
    os.replace(tmp_meta, meta_path)  # written last: its presence marks a complete id file
    return meta


def check_split_sizes(corpus: Corpus, block_size: int) -> None:
    for name, split in (("train", corpus.train), ("val", corpus.val)):
        if len(split) <= block_size:
            raise ValueError(f"the {name} split has {len(split)} tokens ({corpus.meta['num_tokens']} in the corpus), "
                             f"too few for one window of block_size={block_size} plus its target; use a longer text, "
                             f"a smaller --block_size or another --val_fraction")


# ---- batches and loss ------------------------------------------------------------------------------------------

def get_batch(tokens: np.ndarray, batch_size: int, block_size: int, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs tokens[i : i + T] and targets tokens[i + 1 : i + T + 1], gathered in one indexing op."""
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator).numpy()
    windows = torch.from_numpy(tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    return (x.to(device), y.to(device)) if torch.device(device).type != "cpu" else (x, y)


def next_token_loss(model: GPT2LMHeadModel, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of every position's prediction against its target (all T positions, as nanoGPT counts)."""
    logits = model(x)["logits"]  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction=reduction)


def autocast(device: str | torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, dtype))


# ---- the step: flat parameters, batches split across threads --------------------------------------------------

class FlatParams:
    """Each optimizer group's parameters re-seated as views into one flat tensor, with one flat gradient.

    AdamW then updates one tensor per group (each of its passes is one kernel instead of one per parameter),
    clipping takes one norm per group and zeroing the gradients is one fill: on a small model these per-tensor
    costs are a large part of a step. Autograd accumulates into the gradient views in place.
    """

    def __init__(self, groups: list[dict]):
        self.groups, self.params, self.flat = [], [], []
        for group in groups:
            params = group["params"]
            if not params:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            flat.grad = torch.zeros_like(flat)
            offset = 0
            for p in params:
                p.data = flat[offset: offset + p.numel()].view_as(p)
                p.grad = flat.grad[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flat.append(flat)
            self.params += params
            rest = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            self.groups.append({**rest, "params": [flat], "param_names": [f"flat{len(self.flat) - 1}"]})

    def grad_list(self) -> list[torch.Tensor]:
        return [flat.grad for flat in self.flat]

    def zero_grad(self) -> None:
        for flat in self.flat:
            flat.grad.zero_()

    @contextlib.contextmanager
    def unshared(self):
        """Parameters with storage of their own while inside (safetensors refuses tensors that share memory)."""
        views = [p.data for p in self.params]
        for p in self.params:
            p.data = p.data.clone()
        try:
            yield
        finally:
            for p, view in zip(self.params, views):
                p.data = view


class BatchRunner:
    """Forward and backward passes over a batch, optionally split row-wise across `workers` threads that each use
    one core. Torch's own intra-op threads synchronise at every operation, which on a small model costs more than
    the work they share; slices of the batch need no synchronisation until their gradients are added (in a fixed
    order, so runs repeat exactly). Autocast and inference mode are per thread, so each worker enters them itself.
    """

    def __init__(self, model, params: list[torch.nn.Parameter], workers: int = 1, device="cpu", dtype="float32"):
        self.model, self.params, self.workers, self.device, self.dtype = model, params, workers, device, dtype
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="batch") if workers > 1 else None

    def _map(self, fn, x: torch.Tensor, y: torch.Tensor) -> list:
        """fn(index, rows of x, rows of y) for each slice, in the workers; results in slice order."""
        if self.pool is None:
            return [fn(0, x, y)]
        slices = zip(x.tensor_split(self.workers), y.tensor_split(self.workers))
        return list(self.pool.map(lambda job: fn(job[0], *job[1]), enumerate(slices)))

    def backward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0,
                 scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
        """Add d(scale * mean loss)/d(params) to the gradients (times the fp16 loss scale when a scaler is given);
        return the mean loss (detached, unscaled)."""
        n = y.numel()
        scaled = scaler.scale if scaler is not None else (lambda loss: loss)

        def work(index, xs, ys):
            with autocast(self.device, self.dtype):
                loss = next_token_loss(self.model, xs, ys, reduction="sum")
            if index == 0:  # the first slice accumulates into .grad itself; the others return theirs to be added
                scaled(loss * (scale / n)).backward()
                return loss.detach(), None
            return loss.detach(), torch.autograd.grad(scaled(loss * (scale / n)), self.params)

        results = self._map(work, x, y)
        for _, grads in results[1:]:
            torch._foreach_add_([p.grad for p in self.params], grads)
        return sum(loss for loss, _ in results) / n

    @torch.inference_mode()
    def loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def work(_, xs, ys):
            with torch.inference_mode(), autocast(self.device, self.dtype):
                return next_token_loss(self.model, xs, ys, reduction="sum").double().cpu()

        return sum(self._map(work, x, y))


def estimate_loss(model, splits: dict[str, np.ndarray], eval_iters: int, batch_size: int, block_size: int,
                  generator: torch.Generator, runner: BatchRunner | None = None) -> dict[str, float]:
    """Mean loss over eval_iters random batches per split. The batches are drawn at once and run in large chunks:
    every batch has the same number of tokens, so the mean over all tokens is the mean of the batch means."""
    runner = runner or BatchRunner(model, [])
    was_training = model.training
    model.eval()
    rows = eval_iters * batch_size
    chunk = max(batch_size, min(rows, (1 << 24) // (block_size * model.config.vocab_size)))  # caps the logits' size
    losses = {}
    for name, tokens in splits.items():
        x, y = get_batch(tokens, rows, block_size, generator, runner.device)
        total = sum(runner.loss_sum(x[i: i + chunk], y[i: i + chunk]) for i in range(0, rows, chunk))
        losses[name] = float(total) / (rows * block_size)
    model.train(was_training)
    return losses


@torch.inference_mode()
def full_loss(model, tokens: np.ndarray, block_size: int, batch_size: int = 64) -> float:
    """Loss over a whole split in consecutive windows (every token but the first predicted once): a precise figure
    to put beside the random-batch estimate."""
    was_training = model.training
    model.eval()
    n = (len(tokens) - 1) // block_size
    windows = torch.from_numpy(np.asarray(tokens[: n * block_size + 1]).astype(np.int64))
    total, count = 0.0, 0
    for i in range(0, n, batch_size):
        rows = range(i, min(n, i + batch_size))
        x = torch.stack([windows[r * block_size: (r + 1) * block_size] for r in rows])
        y = torch.stack([windows[r * block_size + 1: (r + 1) * block_size + 1] for r in rows])
        total += next_token_loss(model, x, y, reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / count


# ---- model -----------------------------------------------------------------------------------------------------

def build_config(args, tokenizer) -> GPT2Config:
    """A preset (--preset gpt2) or explicit sizes; explicit sizes override the preset. The context n_positions
    defaults to --block_size (1024 with a preset)."""
    sizes = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "n_positions") if getattr(args, k)}
    base = GPT2Config.from_preset(args.preset) if args.preset else GPT2Config(n_layer=4, n_head=4, n_embd=128,
                                                                               n_positions=args.block_size)
    eos = None if isinstance(tokenizer, CharTokenizer) else tokenizer.eos_token_id
    config = base.replace(vocab_size=len(tokenizer), resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                          attn_pdrop=args.dropout, activation_function=args.activation, bos_token_id=eos,
                          eos_token_id=eos, **sizes)
    check_block_size(args.block_size, config)
    return config


def check_block_size(block_size: int, config: GPT2Config) -> None:
    if block_size > config.n_positions:
        raise ValueError(f"--block_size {block_size} exceeds the model's context n_positions={config.n_positions}; "
                         f"lower --block_size or raise --n_positions")


# ---- the training loop -----------------------------------------------------------------------------------------

CHECKPOINTS = ("best", "last")


# Flags that shape the saved state (optimizer moments, schedule, batches, model): --resume refuses a change to any of
# them. --max_iters may grow (the cosine then stretches to the new end unless --lr_decay_iters pins it); the
# architecture flags are checked against the checkpoint's config, and the tokenizer is the checkpoint's own.
RESUME_FIXED = ("val_fraction", "block_size", "dropout", "activation", "batch_size", "grad_accum", "learning_rate",
                "min_lr", "warmup_iters", "lr_decay_iters", "weight_decay", "decay_embeddings", "beta1", "beta2",
                "adam_eps", "grad_clip", "dtype", "seed")


def find_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint in out_dir (best or last) with the later step, or None. Only the steps are read."""
    found = []
    for name in CHECKPOINTS:
        with contextlib.suppress(FileNotFoundError):
            folder = resolve(out_dir / name)
            found.append((read_step(folder), folder))
    return max(found)[1] if found else None


def remove_checkpoints(out_dir: Path) -> None:
    """--overwrite: the old run's best/ and last/ go (whatever state they are in), or a later --resume could pick
    the old run's step. The id cache stays."""
    if dist.is_main():
        folders = [out_dir / f"{prefix}{name}{suffix}" for name in CHECKPOINTS for prefix, suffix in (("", ""), (".", ".old"))]
        folders += list(out_dir.glob(".*.tmp-*")) if out_dir.is_dir() else []
        existing = [f for f in folders if f.exists()]
        for folder in existing:
            shutil.rmtree(folder, ignore_errors=True)
        if existing:
            print(f"--overwrite: removed the checkpoints in {out_dir}")
    dist.barrier()


def setup(args):
    """(out_dir, the Checkpoint that --resume continues or None, corpus, model): the corpus encoded (or found in the
    cache), the model initialised from --seed or loaded from the checkpoint (verified once, here)."""
    out_dir = Path(args.out_dir)
    if getattr(args, "overwrite", False) and not args.resume:
        remove_checkpoints(out_dir)  # before looking: a broken checkpoint is cleared, not read
    resume_from = find_checkpoint(out_dir)
    if resume_from and not args.resume:
        raise FileExistsError(f"{out_dir} already holds a checkpoint ({resume_from.name}); pass --resume to continue "
                              f"it, --overwrite to start again, or choose another --out_dir")
    if args.resume and not resume_from:
        raise FileNotFoundError(f"--resume: no checkpoint (best/ or last/) in {out_dir}")
    ck = load_checkpoint(resume_from) if resume_from else None
    if ck is not None:
        saved_arch, arch = ck.state.get("args", {}).get("arch", "gpt2"), getattr(args, "arch", "gpt2")
        if saved_arch != arch:  # named before any other setting: it decides what every other one means
            kind = "BigramLM" if saved_arch == "bigram" else "GPT2LMHeadModel"
            raise ValueError(f"--resume: {ck.path} holds a {kind}, not --arch {arch}")
        check_resume_settings(ck.state.get("args", {}), {k: getattr(args, k) for k in RESUME_FIXED + ("max_iters",)},
                              ck.path, extendable=("max_iters",))
    tokenizer = tokenizer_for(ck.path) if ck is not None else (
        "char" if args.tokenizer == "char" else tokenizer_for(args.tokenizer))
    with dist.main_first():  # under torchrun rank 0 encodes the corpus, the others then map the cached ids
        corpus = prepare_corpus(args.data, tokenizer, args.data_dir or out_dir / "data", args.val_fraction)
    check_split_sizes(corpus, args.block_size)
    if ck is not None:
        model = load_lm(ck.path)  # its kind (--arch) was checked against the saved run's above
        asked = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "n_positions") if getattr(args, k)}
        check_architecture(model.config, model.config.replace(**asked), ck.path)  # flags vs checkpoint
        check_block_size(args.block_size, model.config)
    else:
        torch.manual_seed(args.seed)
        if getattr(args, "arch", "gpt2") == "bigram":
            config = BigramConfig(vocab_size=len(corpus.tokenizer), n_positions=args.n_positions or args.block_size)
            model = BigramLM(config)
        else:
            model = GPT2LMHeadModel(build_config(args, corpus.tokenizer))
    if len(corpus.tokenizer) > model.config.vocab_size:  # ids past the embedding would fail mid-run (or on GPU, worse)
        raise ValueError(f"the tokenizer has {len(corpus.tokenizer)} tokens but the model's embedding only "
                         f"{model.config.vocab_size} rows ({resume_from or 'new model'})")
    if hasattr(model, "gpt"):  # a bigram table has no blocks to recompute
        model.gpt.gradient_checkpointing = getattr(args, "gradient_checkpointing", False)
    return out_dir, ck, corpus, model.to(args.device).train()


def train(args) -> dict[str, Any]:
    """Train as `args` (run_pretrain.py's flags) say; returns a summary (losses, timings, checkpoint, sample)."""
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    main, world, rank = dist.is_main(), dist.world_size(), dist.rank()
    if world > 1 and str(args.device).startswith("cuda"):
        args.device = str(dist.device(True))  # one GPU per process
    if args.batch_size < world:
        raise ValueError(f"--batch_size {args.batch_size} is smaller than the {world} processes sharing each batch")
    out_dir, ck, corpus, model = setup(args)
    tokenizer = corpus.tokenizer
    workers = batch_workers(args, model.config)
    flat = FlatParams(param_groups_for_weight_decay(model, args.weight_decay, args.decay_embeddings))
    optimizer = AdamW(flat.groups, lr=args.learning_rate, betas=(args.beta1, args.beta2), eps=args.adam_eps)
    scheduler = make_lr_scheduler(optimizer, args.warmup_iters, args.lr_decay_iters or args.max_iters,
                                  min_ratio=args.min_lr / args.learning_rate)
    # Separate generators for training and evaluation batches, so evaluating never shifts the training stream.
    train_gen, eval_gen = torch.Generator().manual_seed(args.seed), torch.Generator().manual_seed(args.seed + 1)
    step, best_val, skipped, overflows = 0, math.inf, 0, 0
    # fp16 needs loss scaling (its gradients underflow otherwise); with other dtypes the scaler does nothing.
    scaler = torch.amp.GradScaler(torch.device(args.device).type, enabled=args.dtype == "float16")
    losses: dict[str, float] = {}
    if ck is not None:
        if ck.state["corpus"]["sha256"] != corpus.meta["sha256"]:
            raise ValueError(f"--resume: {args.data} is not the corpus the checkpoint {ck.path} was trained on")
        optimizer.load_state_dict(ck.optimizer)
        scheduler.load_state_dict(ck.scheduler)
        step, best_val, skipped = ck.state["step"], ck.state["best_val"], ck.state.get("skipped", 0)
        overflows = ck.state.get("overflows", 0)
        if ck.state.get("scaler"):
            scaler.load_state_dict(ck.state["scaler"])
        ranks = ck.state.get("rank_rng")
        restore_rng(ranks[rank] if ranks and rank < len(ranks) else ck.state["rng"], train_gen)
        eval_gen.set_state(ck.state["eval_rng"])
        losses = dict(ck.state.get("losses", {}))
        print(f"resuming from {ck.path} at step {step} (best val {best_val:.4f})")
    if scaler.is_enabled():  # make the scale tensor now: the batch threads would race to create it lazily
        scaler.scale(torch.ones((), device=args.device))
    dist.barrier()  # every rank has looked for checkpoints before rank 0 may write one
    start_step = step
    print(f"corpus {args.data}: {corpus.meta['num_tokens']:,} tokens ({len(corpus.train):,} train, "
          f"{len(corpus.val):,} val), vocab {len(tokenizer)}; model {model.num_parameters() / 1e6:.2f}M parameters, "
          + (f"{model.config.n_layer} layers, {model.config.n_head} heads, n_embd {model.config.n_embd}, "
             if hasattr(model, "gpt") else "a bigram table, ")
          + f"block {args.block_size}; {_threads_note(workers)}; ready in {time.perf_counter() - t_start:.1f} s")

    splits = {"train": corpus.train, "val": corpus.val}
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum
    trained = dist.wrap(model, torch.device(args.device))  # DDP under torchrun (averages the flat gradients)
    runner = BatchRunner(trained, flat.params, workers, args.device, args.dtype)
    eval_runner = runner if trained is model else BatchRunner(model, flat.params, 1, args.device, args.dtype)
    # This rank's rows of each global batch, and the weight that turns DDP's average into the global batch's mean.
    rows = dist.shard(list(range(args.batch_size)))
    weight = world * len(rows) / args.batch_size
    log_meter, eval_meter, total_time = Meter(), Meter(), 0.0
    bad_in_a_row, evaluated = 0, (start_step if ck is not None else -1)  # a skipped step must not evaluate twice
    bar = tqdm(total=args.max_iters, initial=step, desc="training", unit="step", leave=False,
               disable=None if main else True)
    while True:
        if (step % args.eval_interval == 0 or step == args.max_iters) and step != evaluated:
            saved, evaluated = "", step
            if main:  # rank 0 evaluates and writes; the others wait for it at the next collective
                losses = estimate_loss(model, splits, args.eval_iters, args.batch_size, args.block_size, eval_gen,
                                       eval_runner)
                improved, best_val = losses["val"] < best_val, min(best_val, losses["val"])
            if step > 0:  # each evaluation writes one checkpoint: best/ if val improved, else last/
                rngs = dist.gather_objects(capture_rng(train_gen))
                if main:
                    saved = "best" if improved else "last"
                    state = {"step": step, "best_val": best_val, "losses": losses, "rng": rngs[0],
                             **({"rank_rng": rngs} if world > 1 else {}), "skipped": skipped,
                             "overflows": overflows, "scaler": scaler.state_dict(),
                             "eval_rng": eval_gen.get_state(), "args": _plain(vars(args)),
                             "corpus": {k: corpus.meta[k] for k in ("sha256", "tokenizer", "num_tokens")}}
                    with flat.unshared():
                        save_checkpoint(out_dir / saved, model, optimizer=optimizer, scheduler=scheduler,
                                        state=state, tokenizer=tokenizer)
            if main:
                tqdm.write(f"step {step:>6} | train {losses['train']:.4f} | val {losses['val']:.4f} | best val "
                           f"{best_val:.4f} | lr {scheduler.get_last_lr()[0]:.2e} | "
                           f"{eval_meter.speed(tokens_per_step)}" + (f" | saved {saved}/" if saved else "")
                           + (f" | {skipped} non-finite steps skipped" if skipped else "")
                           + (f" | {overflows} fp16 overflow steps skipped" if overflows else ""))
            eval_meter.reset()
        if step >= args.max_iters:
            break
        t0 = time.perf_counter()
        flat.zero_grad()
        step_loss = torch.zeros((), device=args.device)
        for micro in range(args.grad_accum):
            x, y = get_batch(corpus.train, args.batch_size, args.block_size, train_gen, args.device)
            x, y = x[rows[0]: rows[-1] + 1], y[rows[0]: rows[-1] + 1]
            with dist.no_sync(trained, micro + 1 < args.grad_accum):  # all-reduce once per optimizer step
                step_loss += runner.backward(x, y, weight / args.grad_accum, scaler if scaler.is_enabled() else None
                                             ) * (weight / world)
        scaler.unscale_(optimizer)  # clip and check the true gradients (a no-op without fp16)
        norm = (torch.nn.utils.clip_grad_norm_(flat.flat, args.grad_clip, foreach=True) if args.grad_clip
                else torch.nn.utils.get_total_norm(flat.grad_list()))
        bad = not bool(torch.isfinite(step_loss + norm))  # one read-back per step (the norm is after DDP's average)
        if scaler.is_enabled() and dist.any_rank(bad and bool(torch.isfinite(step_loss))):
            scaler.update()  # an fp16 overflow at this loss scale, not a diverging run: lower the scale, no step
            overflows += 1
            continue
        if dist.any_rank(bad):
            bad_in_a_row += 1
            what = (f"loss {float(step_loss)}" if not torch.isfinite(step_loss) else
                    f"gradient norm {float(norm)}" if bad else "loss or gradient on another rank")
            where = f"step {step + 1}"
            if not args.skip_nonfinite or bad_in_a_row > MAX_SKIPPED_IN_A_ROW:
                bar.close()
                found = find_checkpoint(out_dir)
                kept = f"the last good checkpoint {found} is kept" if found else "no checkpoint had been written yet"
                raise nonfinite_error(what, where, kept, bad_in_a_row, args.skip_nonfinite,
                                      "a lower --learning_rate or --grad_clip may help")
            skipped += 1
            if main:
                tqdm.write(f"warning: skipped {where}: non-finite {what} ({skipped} skipped so far)")
            continue
        bad_in_a_row = 0
        log_meter.loss += step_loss.cpu()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step += 1
        dt = time.perf_counter() - t0
        total_time += dt
        log_meter.tick(dt)
        eval_meter.tick(dt)
        bar.update()
        if step % args.log_interval == 0:  # the only place the loss itself is read back
            dist.all_reduce_sum(log_meter.loss)  # the global batches' loss (each rank added its weighted share)
            tqdm.write(f"step {step:>6} | loss {log_meter.loss.item() / (log_meter.steps * args.grad_accum):.4f} | "
                       f"lr {scheduler.get_last_lr()[0]:.2e} | {log_meter.speed(tokens_per_step)}")
            log_meter.reset()
    bar.close()

    steps_run = step - start_step
    complete = ck is not None and steps_run == 0
    if complete and main:
        print(f"the run in {out_dir} is already complete: step {step} of --max_iters {args.max_iters}; its "
              f"checkpoint is {find_checkpoint(out_dir)}. Raise --max_iters to train it further")
    summary = {"main": main, "complete": complete, "step": step, "train_loss": losses.get("train"), "val_loss": losses.get("val"), "best_val": best_val,
               "steps_run": steps_run, "skipped": skipped, "fp16_overflows": overflows,
               "checkpoint": str(out_dir / "best") if (out_dir / "best").is_dir() else None,
               "ms_per_step": 1000 * total_time / max(steps_run, 1),
               "tokens_per_s": tokens_per_step * steps_run / max(total_time, 1e-9),
               "seconds": time.perf_counter() - t_start, "model": model, "tokenizer": tokenizer}
    if args.num_samples and args.max_new_tokens and main:
        gen = torch.Generator().manual_seed(args.seed)
        summary["samples"] = sample_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature,
                                         args.top_k or None, args.top_p, args.num_samples, gen)
    return summary


def batch_workers(args, config: GPT2Config) -> int:
    """How many threads split each batch: all of them with --split_batch, unless dropout is on (its masks come from
    one random generator that threads would race for, and the run would not repeat); then torch's intra-op threads."""
    threads = torch.get_num_threads()
    dropout = max(config.resid_pdrop, config.embd_pdrop, config.attn_pdrop)
    if dist.world_size() > 1:  # each process already has its own core(s) and slice of the batch
        return 1
    if not args.split_batch or threads == 1 or args.batch_size == 1 or torch.device(args.device).type != "cpu":
        return 1
    if dropout > 0:
        print(f"dropout {dropout}: not splitting batches across threads (the run would not repeat); "
              f"{threads} intra-op threads instead")
        return 1
    torch.set_num_threads(1)
    return min(threads, args.batch_size)


def _threads_note(workers: int) -> str:
    if workers > 1:
        return f"each batch split across {workers} threads"
    return f"{torch.get_num_threads()} intra-op thread(s)"


class Meter:
    """Training loss (kept as a tensor, read at log time only), steps and seconds since the last reset."""

    def __init__(self):
        self.loss = torch.zeros(())
        self.reset()

    def reset(self) -> None:
        self.loss.zero_()
        self.steps, self.seconds = 0, 0.0

    def tick(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds

    def speed(self, tokens_per_step: int) -> str:
        if not self.steps:
            return "- ms/step | - tok/s"
        return (f"{1000 * self.seconds / self.steps:.1f} ms/step | "
                f"{tokens_per_step * self.steps / self.seconds:,.0f} tok/s")


def _plain(d: dict) -> dict:
    """Flags as plain values (the checkpoint's training state loads with weights_only=True)."""
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in d.items()}


# ---- sampling --------------------------------------------------------------------------------------------------

def default_prompt(tokenizer) -> str:
    if isinstance(tokenizer, CharTokenizer):
        return "\n" if "\n" in tokenizer.stoi else tokenizer.chars[0]
    return tokenizer.eos_token


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str | None, max_new_tokens: int, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None, num_samples: int = 1,
                generator: torch.Generator | None = None) -> list[str]:
    """Continue `prompt` num_samples times. Up to the model's context this is model.generate (KV cache); past it
    each new token is predicted from the last n_positions tokens, as nanoGPT does."""
    if temperature <= 0 or (top_k is not None and top_k < 0) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"need temperature > 0, top_k >= 0, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    prompt = default_prompt(tokenizer) if prompt is None else prompt
    ids = torch.as_tensor(encode(tokenizer, prompt), dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty; pass some text or leave --prompt out for the default")
    device = next(model.parameters()).device
    n_ctx = model.config.n_positions
    if ids.numel() > n_ctx:
        warnings.warn(f"the prompt has {ids.numel()} tokens, more than the model's context of {n_ctx}: keeping its "
                      f"last {n_ctx}", stacklevel=2)
        ids = ids[-n_ctx:]
    ids = ids.to(device).repeat(num_samples, 1)
    first = min(max_new_tokens, n_ctx - ids.shape[1])
    if first > 0:
        ids = model.generate(ids, max_new_tokens=first, do_sample=True, temperature=temperature, top_k=top_k,
                             top_p=top_p, generator=generator)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens - max(first, 0)):
        logits = model(ids[:, -n_ctx:])["logits"][:, -1].float()
        probs = F.softmax(process_logits(logits, None, temperature, top_k, top_p), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    model.train(was_training)
    return [tokenizer.decode(row.tolist()) for row in ids]


def load_for_sampling(folder: str | os.PathLike, tokenizer_spec: str | None = None):
    """(model, tokenizer) from a checkpoint or model folder; tokenizer_spec when the folder holds no tokenizer."""
    folder = resolve(folder)
    has_tokenizer = (folder / VOCAB_FILE).is_file() or (folder / "tokenizer_config.json").is_file()
    if not has_tokenizer and tokenizer_spec in (None, "char"):
        raise FileNotFoundError(f"{folder} holds no tokenizer ({VOCAB_FILE} or tokenizer files); pass --tokenizer")
    tokenizer = tokenizer_for(folder if has_tokenizer else tokenizer_spec)
    model = load_lm(folder).eval()  # a GPT-2 or a bigram table (--arch bigram)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the model in {folder} only "
                         f"{model.config.vocab_size}")
    return model, tokenizer
