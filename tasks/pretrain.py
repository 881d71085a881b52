"""Train a GPT-2 from scratch on a text file ("Let's build GPT"): text -> token ids on disk -> random windows ->
the training engine (training/engine.py: AdamW, or Muon with AdamW, with warmup and cosine decay, periodic loss
estimates, checkpoints, metrics) -> samples.

    tokenizer = tokenizer_for("gpt2" | folder)                     # "char" tokenizers are built from the corpus
    corpus = prepare_corpus("input.txt", "char", cache_dir)          # ids memory-mapped from cache_dir, 90/10 split
    x, y = get_batch(corpus.train, 12, 64, generator)               # (12, 64) inputs and next-token targets
    losses = estimate_loss(model, {"train": corpus.train, "val": corpus.val}, 20, 12, 64, generator)
    summary = train(PretrainConfig(data="input.txt", output_dir="out/char"))   # what run_pretrain.py runs
    text = sample_text(model, tokenizer, "ROMEO:", 200, temperature=0.8, top_k=200)

This module supplies the corpus, the batch source (RandomWindows), the loss and the evaluation; the engine does the
rest, as for fine-tuning: OUT/last (everything --resume needs) at every evaluation, OUT/best (the lowest val
estimate), OUT/metrics.jsonl and OUT/curves.png. A non-finite loss or gradient stops the run naming the step (the
checkpoints are the last good ones), or is skipped with --skip_nonfinite. Under torchrun every rank draws the same
global batch and trains on its rows inside DistributedDataParallel; rank 0 alone evaluates, writes checkpoints and
logs.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from config import GPT2Config, nanochat_preset
from models.bigram import BigramConfig, BigramLM, load_lm
from models.generation import process_logits
from models.gpt2 import GPT2LMHeadModel
from models.hub import data_dir, expand, load_tokenizer, not_found
from modules import draw
from modules.cross_entropy import cross_entropy
from tasks.char_tokenizer import VOCAB_FILE, CharTokenizer
from training import distributed as dist
from training.checkpoint import check_resume_settings, resolve
from training.engine import MicroBatch, Step, TrainConfig, autocast, check_architecture, fit, open_run
from training.steps import micro_weight

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


def default_corpus() -> Path:
    """The corpus of a run without --data: tiny shakespeare from the data folder (the project's data/, or
    $GPT2_SHARED_DIR/data when set)."""
    return data_dir() / "tinyshakespeare" / "input.txt"


def check_corpus_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(not_found("corpus file", path))
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
    return cross_entropy(logits.flatten(0, 1), y.flatten(), reduction=reduction)  # at least fp32, by blocks of rows


def estimate_loss(model, splits: dict[str, np.ndarray], eval_iters: int, batch_size: int, block_size: int,
                  generator: torch.Generator, dtype: str = "float32") -> dict[str, float]:
    """Mean loss over eval_iters random batches per split. The batches are drawn at once and run in large chunks:
    every batch has the same number of tokens, so the mean over all tokens is the mean of the batch means."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    rows = eval_iters * batch_size
    chunk = max(batch_size, min(rows, (1 << 24) // (block_size * model.config.vocab_size)))  # caps the logits' size
    losses = {}
    with torch.inference_mode(), autocast(device, dtype == "bfloat16", dtype == "float16"):
        for name, tokens in splits.items():
            x, y = get_batch(tokens, rows, block_size, generator, device)
            total = sum(next_token_loss(model, x[i: i + chunk], y[i: i + chunk], reduction="sum").double().cpu()
                        for i in range(0, rows, chunk))
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
        device = next(model.parameters()).device
        total += next_token_loss(model, x.to(device), y.to(device), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / count


# ---- model -----------------------------------------------------------------------------------------------------

# run_pretrain.py's architecture flags -> the GPT2Config field each sets. None (the default) leaves the field to the
# preset (--preset, --depth) or to GPT-2's choice.
VARIANT_FLAGS = {"activation": "activation_function", "norm": "norm", "norm_scale": "norm_scale",
                 "position_embedding": "position_embedding", "rope_theta": "rope_theta", "n_kv_head": "n_kv_head",
                 "qk_norm": "qk_norm", "bias": "bias", "tie_word_embeddings": "tie_word_embeddings",
                 "logit_softcap": "logit_softcap"}


def architecture_flags(args) -> dict[str, Any]:
    """The config fields the flags set explicitly: sizes, and the variant flags that were given."""
    sizes = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "n_positions") if getattr(args, k)}
    return {**sizes, **{field: getattr(args, flag) for flag, field in VARIANT_FLAGS.items()
                        if getattr(args, flag) is not None}}


def build_config(args, tokenizer) -> GPT2Config:
    """A preset (--preset gpt2, or --depth N: nanochat's GPT) or explicit sizes; explicit sizes and variant flags
    override the preset. The context n_positions defaults to --block_size (1024 with --preset, 2048 with --depth)."""
    if args.depth:
        base = GPT2Config.from_preset(f"nanochat-d{args.depth}")
    elif args.preset:
        base = GPT2Config.from_preset(args.preset)
    else:
        base = GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=args.block_size)
    eos = None if isinstance(tokenizer, CharTokenizer) else tokenizer.eos_token_id
    config = base.replace(vocab_size=len(tokenizer), resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                          attn_pdrop=args.dropout, bos_token_id=eos, eos_token_id=eos, **architecture_flags(args))
    check_block_size(args.block_size, config)
    return config


def check_block_size(block_size: int, config: GPT2Config) -> None:
    if block_size > config.n_positions:
        raise ValueError(f"--block_size {block_size} exceeds the model's context n_positions={config.n_positions}; "
                         f"lower --block_size or raise --n_positions")


# ---- the run ---------------------------------------------------------------------------------------------------

@dataclass
class PretrainConfig:
    """run_pretrain.py's flags as a dataclass (the Python API: `train(PretrainConfig(data="input.txt", ...))`); each
    field means what the flag of the same name does (see `python run_pretrain.py --help`)."""
    data: str | None = None  # None: the bundled tiny shakespeare (default_corpus())
    tokenizer: str = "char"
    val_fraction: float = 0.1
    data_dir: str | None = None
    arch: str = "gpt2"  # gpt2, or bigram: a table of next-token logits
    preset: str | None = None
    depth: int | None = None  # nanochat-d{depth}
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int = 64
    n_positions: int | None = None
    dropout: float = 0.0
    activation: str | None = None  # None: gelu_new, or the --depth preset's relu2 (so for every variant flag below)
    gradient_checkpointing: bool = False
    norm: str | None = None
    norm_scale: bool | None = None
    position_embedding: str | None = None
    rope_theta: float | None = None
    n_kv_head: int | None = None
    qk_norm: bool | None = None
    bias: bool | None = None
    tie_word_embeddings: bool | None = None
    logit_softcap: float | None = None
    max_iters: int = 2000
    batch_size: int = 12
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int | None = None
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    beta1: float = 0.9
    beta2: float = 0.99
    adam_eps: float = 1e-8
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    max_grad_norm: float = 1.0
    dtype: str = "float32"
    eval_interval: int = 250
    eval_iters: int = 20
    eval_full: bool = False
    log_interval: int = 50
    output_dir: str = "out/pretrain"
    resume: bool = False
    overwrite: bool = False
    skip_nonfinite: bool = False
    tensorboard: bool = False
    sample: bool = False
    model: str | None = None
    prompt: str | None = None
    max_new_tokens: int = 300
    num_samples: int = 1
    temperature: float = 0.8
    top_k: int = 200
    top_p: float | None = None
    quantize: str | None = None  # modules.quant.QUANTIZE_MODES: samples decode quantized (GPT-2 models)
    seed: int = 1337
    device: str = "cpu"
    threads: int = 0
    split_batch: bool = True
    compile: bool = False


# Settings that shape the saved state (optimizer moments, schedule, batches, model): --resume refuses a change to any of
# them. --max_iters may grow (the cosine then stretches to the new end unless --lr_decay_iters pins it); the
# architecture flags (sizes, --depth, --activation and the variants) are checked against the checkpoint's config
# where given (training/runfolder.py's ARCHITECTURE), and the tokenizer is the checkpoint's own.
RESUME_FIXED = ("val_fraction", "block_size", "dropout", "batch_size", "grad_accum", "optimizer", "lr", "muon_lr",
                "min_lr", "warmup_iters", "lr_decay_iters", "weight_decay", "decay_embeddings", "beta1", "beta2",
                "adam_eps", "max_grad_norm", "dtype", "seed")


def train_config(cfg: PretrainConfig) -> TrainConfig:
    """The engine's settings for a pretraining run: steps instead of epochs, a cosine from lr to min_lr, the best
    checkpoint by the lowest val loss estimate, a log line every log_interval steps."""
    return TrainConfig(output_dir=cfg.output_dir, epochs=0, max_iters=cfg.max_iters, batch_size=cfg.batch_size,
                       grad_accum=cfg.grad_accum, lr=cfg.lr, min_lr=cfg.min_lr, schedule="cosine",
                       warmup_steps=cfg.warmup_iters, decay_steps=cfg.lr_decay_iters or 0,
                       weight_decay=cfg.weight_decay, decay_embeddings=cfg.decay_embeddings,
                       betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, optimizer=cfg.optimizer,
                       muon_lr=cfg.muon_lr, max_grad_norm=cfg.max_grad_norm,
                       dtype=cfg.dtype, seed=cfg.seed, device=str(cfg.device), resume=cfg.resume,
                       overwrite=cfg.overwrite, eval_interval=cfg.eval_interval, eval_at_start=True,
                       log_interval=cfg.log_interval, print_logs=True, select_metric="val_loss", select_max=False,
                       eval_prefix="", skip_nonfinite=cfg.skip_nonfinite,
                       gradient_checkpointing=cfg.gradient_checkpointing, split_batch=cfg.split_batch, compile=cfg.compile,
                       tensorboard=cfg.tensorboard, threads=cfg.threads)


class RandomWindows:
    """Pretraining's batch source: every optimizer step draws grad_accum batches of random windows from the train
    split with one generator (the same on every rank: each rank takes its rows of the global batch). Its state is
    that generator's and the evaluation's (so evaluating never shifts the training stream)."""

    total_steps = 0  # the run is TrainConfig.max_iters steps long

    def __init__(self, tokens: np.ndarray, batch_size: int, block_size: int, grad_accum: int, seed: int,
                 device: str | torch.device):
        self.tokens, self.batch_size, self.block_size, self.grad_accum = tokens, batch_size, block_size, grad_accum
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self.eval_generator = torch.Generator().manual_seed(seed + 1)
        self.drawn = 0  # batches drawn
        self.rows = dist.shard(list(range(batch_size)))
        # this rank's rows of every batch, one of grad_accum micro-batches: the step's loss is the global batch's mean
        self.weight = micro_weight(len(self.rows), batch_size, grad_accum, dist.world_size())

    def next_step(self) -> Step:
        micro = []
        for _ in range(self.grad_accum):
            x, y = get_batch(self.tokens, self.batch_size, self.block_size, self.generator, self.device)
            x, y = x[self.rows[0]: self.rows[-1] + 1], y[self.rows[0]: self.rows[-1] + 1]
            micro.append(MicroBatch({"input_ids": x, "labels": y}, self.weight, x.numel()))
        self.drawn += self.grad_accum
        # epochs: windows' tokens drawn over the train split's (how many times it was seen, on average)
        return Step(micro, "step {step}", self.drawn * self.batch_size * self.block_size / len(self.tokens))

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "eval_generator": self.eval_generator.get_state(),
                "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.eval_generator.set_state(state["eval_generator"])
        self.drawn = state.get("drawn", 0)


def window_loss(model, batch: dict) -> torch.Tensor:
    return next_token_loss(model, batch["input_ids"], batch["labels"])


def setup(cfg: PretrainConfig, engine_cfg: TrainConfig):
    """(the Checkpoint that cfg.resume continues or None, corpus, model): the corpus encoded (or found in the cache),
    the model initialised from cfg.seed or loaded from the checkpoint (verified once, here)."""
    ck = open_run(engine_cfg)
    if ck is not None:
        saved = ck.state.get("run", {})
        saved_arch = saved.get("arch", "gpt2")
        if saved_arch != cfg.arch:  # named before any other setting: it decides what every other one means
            kind = "BigramLM" if saved_arch == "bigram" else "GPT2LMHeadModel"
            raise ValueError(f"--resume: {ck.path} holds a {kind}, not --arch {cfg.arch}")
        check_resume_settings(saved, run_settings(cfg), ck.path, extendable=("max_iters",))
    tokenizer = tokenizer_for(ck.path) if ck is not None else (
        "char" if cfg.tokenizer == "char" else tokenizer_for(cfg.tokenizer))
    cfg.data = cfg.data or str(default_corpus())
    with dist.main_first():  # under torchrun rank 0 encodes the corpus, the others then map the cached ids
        corpus = prepare_corpus(cfg.data, tokenizer, cfg.data_dir or Path(cfg.output_dir) / "data", cfg.val_fraction)
    check_split_sizes(corpus, cfg.block_size)
    if ck is not None:
        if ck.state["run"].get("corpus") != corpus.meta["sha256"]:
            raise ValueError(f"--resume: {cfg.data} is not the corpus the checkpoint {ck.path} was trained on")
        model = load_lm(ck.path)  # its kind (--arch) was checked against the saved run's above
        asked = architecture_flags(cfg)
        if cfg.depth:  # nanochat's sizes for that depth, unless a size flag says otherwise
            asked = {**{k: v for k, v in nanochat_preset(cfg.depth).items() if k in ("n_layer", "n_embd", "n_head")},
                     **asked}
        check_architecture(model.config, model.config.replace(**asked), ck.path)  # flags vs checkpoint
        check_block_size(cfg.block_size, model.config)
    else:
        torch.manual_seed(cfg.seed)
        if cfg.arch == "bigram":
            model = BigramLM(BigramConfig(vocab_size=len(corpus.tokenizer), n_positions=cfg.n_positions or cfg.block_size))
        else:
            model = GPT2LMHeadModel(build_config(cfg, corpus.tokenizer))
    if len(corpus.tokenizer) > model.config.vocab_size:  # ids past the embedding would fail mid-run (or on GPU, worse)
        raise ValueError(f"the tokenizer has {len(corpus.tokenizer)} tokens but the model's embedding only "
                         f"{model.config.vocab_size} rows ({ck.path if ck else 'new model'})")
    return ck, corpus, model.to(cfg.device).train()


def run_settings(cfg: PretrainConfig) -> dict:
    return {"arch": cfg.arch, **{k: getattr(cfg, k) for k in RESUME_FIXED + ("max_iters",)}}


def eval_line(record: dict, improved: bool, engine_cfg: TrainConfig) -> str:
    speed = (f"{record['ms_per_step']:.1f} ms/step | {record['tokens_per_s']:,.0f} tok/s" if "ms_per_step" in record
             else "- ms/step | - tok/s")
    saved = " | saved best/ and last/" if improved else " | saved last/" if record["step"] else ""
    return (f"step {record['step']:>6} | train {record['train_loss_estimate']:.4f} | val {record['val_loss']:.4f} | "
            f"best val {record.get('best_val_loss', record['val_loss']):.4f} | lr {record['lr']:.2e} | {speed}{saved}"
            + (f" | {record['skipped']} non-finite steps skipped" if record.get("skipped") else "")
            + (f" | {record['fp16_overflows']} fp16 overflow steps skipped" if record.get("fp16_overflows") else ""))


def train(cfg: PretrainConfig) -> dict[str, Any]:
    """Train as `cfg` says (run_pretrain.py's flags); returns a summary (losses, timings, checkpoint, sample)."""
    t_start = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    world = dist.world_size()
    if world > 1 and str(cfg.device).startswith("cuda"):
        cfg.device = str(dist.device(True))  # one GPU per process
    if cfg.batch_size < world:
        raise ValueError(f"--batch_size {cfg.batch_size} is smaller than the {world} processes sharing each batch")
    engine_cfg = train_config(cfg)
    ck, corpus, model = setup(cfg, engine_cfg)
    tokenizer = corpus.tokenizer
    batches = RandomWindows(corpus.train, cfg.batch_size, cfg.block_size, cfg.grad_accum, cfg.seed, cfg.device)
    splits = {"train": corpus.train, "val": corpus.val}

    def evaluate(m) -> dict:
        losses = estimate_loss(m, splits if not cfg.eval_full else {"train": corpus.train}, cfg.eval_iters,
                               cfg.batch_size, cfg.block_size, batches.eval_generator, cfg.dtype)
        if cfg.eval_full:  # every val token once, in consecutive windows: no sampling noise
            with autocast(cfg.device, cfg.dtype == "bfloat16", cfg.dtype == "float16"):
                losses["val"] = full_loss(m, corpus.val, cfg.block_size)
        return {"val_loss": losses["val"], "train_loss_estimate": losses["train"]}

    print(f"corpus {cfg.data}: {corpus.meta['num_tokens']:,} tokens ({len(corpus.train):,} train, "
          f"{len(corpus.val):,} val), vocab {len(tokenizer)}; model {model.num_parameters() / 1e6:.2f}M parameters, "
          + (f"{model.config.n_layer} layers, {model.config.n_head} heads, n_embd {model.config.n_embd}, "
             if hasattr(model, "gpt") else "a bigram table, ")
          + f"block {cfg.block_size}; ready in {time.perf_counter() - t_start:.1f} s")
    run_info = {**run_settings(cfg), "corpus": corpus.meta["sha256"]}
    result = fit(model, batches, window_loss, evaluate, engine_cfg, run_info, tokenizer=tokenizer, resume_from=ck,
                 report=eval_line)
    last = result["last_eval"]
    out = Path(cfg.output_dir)
    summary = {**result, "train_loss": last.get("train_loss_estimate"), "val_loss": last.get("val_loss"),
               "best_val": (result["best"] or {}).get("metrics", {}).get("val_loss", last.get("val_loss")),
               "checkpoint": str(out / "best") if (out / "best").is_dir() else None,
               "seconds": time.perf_counter() - t_start, "model": model, "tokenizer": tokenizer}
    if cfg.num_samples and cfg.max_new_tokens and result["main"]:
        gen = torch.Generator().manual_seed(cfg.seed)
        summary["samples"] = sample_text(model, tokenizer, cfg.prompt, cfg.max_new_tokens, cfg.temperature,
                                         cfg.top_k or None, cfg.top_p, cfg.num_samples, gen, cfg.quantize)
    return summary


# ---- sampling --------------------------------------------------------------------------------------------------

def default_prompt(tokenizer) -> str:
    if isinstance(tokenizer, CharTokenizer):
        return "\n" if "\n" in tokenizer.stoi else tokenizer.chars[0]
    return tokenizer.eos_token


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str | None, max_new_tokens: int, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None, num_samples: int = 1,
                generator: torch.Generator | None = None, quantize: str | None = None) -> list[str]:
    """Continue `prompt` num_samples times. Up to the model's context this is model.generate (KV cache); past it
    each new token is predicted from the last n_positions tokens, as nanoGPT does. quantize (one of
    modules.quant.QUANTIZE_MODES; GPT-2 models): the cached steps read quantized copies of the weights, one sample at a time (the only batch they are
    read at)."""
    if quantize is not None and not hasattr(model, "gpt"):
        raise ValueError(f"quantize={quantize!r} applies to GPT-2 models, not to {type(model).__name__}")
    if quantize is not None and num_samples > 1:  # one batch-1 call per sample, drawing on the same generator
        return [text for _ in range(num_samples) for text in sample_text(
            model, tokenizer, prompt, max_new_tokens, temperature, top_k, top_p, 1, generator, quantize)]
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
                             top_p=top_p, generator=generator, **({"quantize": quantize} if quantize else {}))
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens - max(first, 0)):
        logits = model(ids[:, -n_ctx:])["logits"][:, -1].float()
        probs = F.softmax(process_logits(logits, None, temperature, top_k, top_p), dim=-1)
        ids = torch.cat([ids, draw.multinomial(probs, generator)[:, None]], dim=1)  # torch.multinomial's token
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
