"""Sonnet generation (CS224N): the course's sonnet files, SonnetGPT, chrF, and `run` (the task run_sonnet.py calls).

    sonnets = read_sonnets("data/cs224n/sonnets.txt")             # 131 strings
    texts = complete_sonnets(model, tokenizer, prompts, Decoding(), batch_size=16)
    score = chrf(texts, gold)                                               # sacrebleu CHRF() corpus score

File format (the course's SonnetsDataset): a header, then sonnets each introduced by a line holding only its number.
The text is split on `\\n\\s*\\d+\\s*\\n`, the piece before the first number (the header) is dropped and each sonnet is
stripped; CRLF files read as LF (Python's universal newlines, as the course's open() does). Prompt files hold the
first 3 lines of each sonnet. Generated files are `--Generated Sonnets-- \\n\\n` then `\\n{index}\\n{sonnet}\\n\\n` per
sonnet, each sonnet being the prompt followed by the generated lines.
"""
from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from models.gpt2 import GPT2LMHeadModel
from models.hub import data_dir, not_found, tokenizer_for
from tasks import lora
from tasks.data import Encoded, check_vocab, collate, load_task_tokenizer
from tasks.finetune import (
    FineTuneConfig,
    body_overrides,
    build_body,
    resolve_dtype,
    seed_everything,
    start,
    train,
    train_config,
)
from tasks.outputs import claim_outputs, predictions_folder
from training import distributed as dist
from training.engine import autocast, load_weights

# The course splits on \n\s*\d+\s*\n; the lookahead leaves the closing newline unconsumed, so two number lines in a
# row give an (refused) empty sonnet instead of the second number becoming the first line of a sonnet.
NUMBER_LINE = re.compile(r"\n\s*\d+\s*(?=\n)")
HEADER = "--Generated Sonnets-- "


class SonnetFileError(ValueError):
    """A sonnet file that cannot be used as it is; the message names the file and the line."""


# ---------------------------------------------------------------------------------------------------------------
# Files


def parse_sonnets(text: str, source: str = "<text>") -> list[str]:
    # A leading newline lets a file that opens with a number line keep its first sonnet (its header is empty); a
    # trailing one makes a number line at the very end a (refused) empty sonnet, not a line of the one before.
    padded = "\n" + text + "\n"
    pieces = NUMBER_LINE.split(padded)[1:]
    if not pieces:
        raise SonnetFileError(f"{source}: no numbered sonnets (each sonnet must follow a line holding only its number)")
    sonnets = [p.strip() for p in pieces]
    for m, sonnet in zip(NUMBER_LINE.finditer(padded), sonnets):
        if not sonnet:
            number = re.search(r"\d+", m.group())
            line = padded.count("\n", 0, m.start() + number.start())  # padded's extra newline makes this 1-based
            raise SonnetFileError(f"{source}, line {line}: sonnet {number.group()} is empty")
    return sonnets


def read_sonnets(path: str | Path) -> list[str]:
    """The sonnets of a course file, header dropped, each stripped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(not_found("sonnet file", path))
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a byte-order mark
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n") + 1
        raise SonnetFileError(f"{path}, line {line}: not UTF-8 text ({e.reason})") from None
    return parse_sonnets(text.replace("\r\n", "\n").replace("\r", "\n"), str(path))  # universal newlines


def write_sonnets(path: str | Path, sonnets: list[str]) -> None:
    """Write the course's generated-sonnets file. A sonnet holding a number-only line would not read back as one
    sonnet (the number splits it), so that is reported here; the grader then refuses the file's sonnet count."""
    for i, s in enumerate(sonnets):
        m = NUMBER_LINE.search("\n" + s.strip() + "\n")
        if m:
            print(f"warning: sonnet {i} holds the number-only line {m.group().strip()!r}: {path} will not read back "
                  f"as {len(sonnets)} sonnets")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"{HEADER}\n\n")
        for i, s in enumerate(sonnets):
            f.write(f"\n{i}\n{s}\n\n")


def check_pairs(prompts: list[str], gold: list[str], prompt_path, gold_path) -> None:
    """Dev prompts and gold sonnets must come in the same order, each gold sonnet starting with its prompt."""
    if len(prompts) != len(gold):
        raise SonnetFileError(f"{prompt_path} holds {len(prompts)} prompts but {gold_path} {len(gold)} sonnets")
    for i, (p, g) in enumerate(zip(prompts, gold)):
        if not " ".join(g.split()).startswith(" ".join(p.split())):
            raise SonnetFileError(f"prompt {i} of {prompt_path} is not the start of sonnet {i} of {gold_path}: "
                                  f"{p.splitlines()[0]!r} vs {g.splitlines()[0]!r}")


# ---------------------------------------------------------------------------------------------------------------
# chrF


def chrf(hypotheses: list[str], references: list[str]) -> float:
    """The course's score: sacrebleu CHRF() defaults (character 6-grams, beta 2), one corpus score, 0-100."""
    from sacrebleu.metrics import CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} generated sonnets but {len(references)} references")
    return float(CHRF().corpus_score(list(hypotheses), [list(references)]).score)


def score_file(pred_path: str | Path, gold_path: str | Path) -> dict:
    """chrF of a generated-sonnets file against a gold file. Unlike the course's test_sonnet (which cut both to the
    shorter), different counts are an error: a split or missing sonnet would silently pair the wrong texts."""
    generated, gold = read_sonnets(pred_path), read_sonnets(gold_path)
    if len(generated) != len(gold):
        raise SonnetFileError(f"{pred_path} holds {len(generated)} sonnets but {gold_path} holds {len(gold)}")
    return {"chrf": chrf(generated, gold), "n": len(gold)}


# ---------------------------------------------------------------------------------------------------------------
# The model


@dataclass
class Decoding:
    """How to continue a prompt (the course's defaults: sampling, temperature 1.2, top-p 0.9, 128 new tokens)."""
    max_new_tokens: int = 128
    do_sample: bool = True
    temperature: float = 1.2
    top_p: float | None = 0.9
    top_k: int | None = None
    repetition_penalty: float = 1.0
    num_beams: int = 1  # > 1: beam search (deterministic; temperature, top-k and top-p do not apply)
    length_penalty: float = 1.0  # beam search only
    seed: int = 11711  # seeds the sampling generator of each complete_sonnets call
    quantize: str | None = None  # modules.quant.QUANTIZE_MODES: quantized decoding, one prompt at a time


class SonnetGPT(nn.Module):
    """A GPT-2 language model (GPT2LMHeadModel, its LM head tied to the token embedding) for sonnets.

    forward(input_ids, attention_mask) -> (B, T, vocab) logits, as the course's; `loss` is next-token cross-entropy
    over real tokens only; `generate` continues left-padded prompts with the KV cache (sampling, greedy, or beam
    search). `gpt` is the GPT-2 body, as in the course.
    """

    def __init__(self, lm: GPT2LMHeadModel):
        super().__init__()
        self.lm = lm

    @property
    def gpt(self):
        return self.lm.gpt

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm(input_ids, attention_mask)["logits"]

    def loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of each real token given those before it (padding neither predicts nor is predicted)."""
        return self.lm(input_ids, attention_mask, labels=input_ids)["loss"]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 128,
                 do_sample: bool = True, temperature: float = 1.2, top_p: float | None = 0.9, top_k: int | None = None,
                 repetition_penalty: float = 1.0, num_beams: int = 1, length_penalty: float = 1.0,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 generator: torch.Generator | None = None, quantize: str | None = None) -> torch.Tensor:
        """(B, prompt_len + new) token ids; prompts left-padded. num_beams > 1 runs beam search (do_sample=False)."""
        extra = {"quantize": quantize} if quantize is not None else {}  # beam search refuses the argument
        return self.lm.generate(input_ids, attention_mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
                                pad_token_id=pad_token_id, generator=generator, num_beams=num_beams,
                                length_penalty=length_penalty, **extra)

    def save_pretrained(self, folder) -> None:
        self.lm.save_pretrained(folder)

    @classmethod
    def from_pretrained(cls, model, **kwargs) -> "SonnetGPT":
        return cls(GPT2LMHeadModel.from_pretrained(model, **kwargs))


def encode_sonnets(sonnets: list[str], tokenizer, max_length: int, what: str = "") -> list[Encoded]:
    """Token ids of each sonnet followed by EOS, so the model learns where a sonnet ends and generation stops there
    (the course taught it only through EOS padding counted in its loss). Longer sonnets are cut, with a note."""
    ids = [x + [tokenizer.eos_token_id] for x in tokenizer(sonnets, add_special_tokens=False)["input_ids"]]
    cut = sum(len(x) > max_length for x in ids)
    if cut:
        print(f"truncated {cut} of {len(ids)} {what} sonnets to {max_length} tokens (longest {max(map(len, ids))})")
    return [Encoded(str(i), x[:max_length], None) for i, x in enumerate(ids)]


def predicted_tokens(batch: dict) -> int:
    """Targets SonnetGPT.loss averages over: real tokens that follow a real token."""
    mask = batch["attention_mask"]
    return int((mask[:, 1:] & mask[:, :-1]).sum())


@torch.no_grad()
def mean_loss(model: SonnetGPT, encoded: list[Encoded], pad_id: int, batch_size: int, device) -> float:
    """Token-weighted mean next-token loss over the encoded sonnets (dropout off)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for first in range(0, len(encoded), batch_size):
        batch = collate(encoded[first: first + batch_size], pad_id)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        n = predicted_tokens(batch)  # targets that count
        total += float(model.loss(ids, mask)) * n
        count += n
    model.train(was_training)
    return total / count


@torch.no_grad()
def complete_sonnets(model: SonnetGPT, tokenizer, prompts: list[str], decoding: Decoding, batch_size: int = 16,
                     device="cpu") -> list[str]:
    """Continue each prompt; returns prompt + continuation as text (EOS dropped), in the prompts' order.

    Prompts go through the model in batches, left-padded and decoded together with the KV cache; under greedy or
    beam search the result equals decoding each prompt alone. Sampling draws from one generator seeded with
    decoding.seed, so the same call repeats the same text. decoding.quantize ("int8", "int4") decodes one prompt at
    a time (batch_size 1), the only batch where the quantized weights are read.
    """
    if decoding.quantize is not None:
        if decoding.num_beams > 1:
            raise ValueError(f"quantize={decoding.quantize!r} applies to greedy and sampled decoding, not to beam "
                             f"search (num_beams {decoding.num_beams})")
        batch_size = 1
    eos = tokenizer.eos_token_id
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    limit = model.config.n_positions - decoding.max_new_tokens
    if limit < 1:
        raise ValueError(f"max_new_tokens {decoding.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {model.config.n_positions} tokens: use at most {model.config.n_positions - 1}")
    for i, x in enumerate(encoded):
        if not x or len(x) > limit:
            raise ValueError(f"prompt {i} has {len(x)} tokens; with max_new_tokens {decoding.max_new_tokens} the "
                             f"model's context of {model.config.n_positions} allows 1 to {limit}")
    generator = torch.Generator(device=device).manual_seed(decoding.seed) if decoding.do_sample else None
    texts = []
    for first in range(0, len(encoded), batch_size):
        chunk = encoded[first: first + batch_size]
        batch = collate([Encoded(str(i), x, None) for i, x in enumerate(chunk)], eos, side="left")
        width = batch["input_ids"].shape[1]
        out = model.generate(batch["input_ids"].to(device), batch["attention_mask"].to(device),
                             max_new_tokens=decoding.max_new_tokens, do_sample=decoding.do_sample and decoding.num_beams == 1,
                             temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k,
                             repetition_penalty=decoding.repetition_penalty, num_beams=decoding.num_beams,
                             length_penalty=decoding.length_penalty, eos_token_id=eos, pad_token_id=eos,
                             generator=generator, quantize=decoding.quantize).cpu()
        for row, x in enumerate(chunk):
            new = out[row, width:].tolist()
            new = new[: new.index(eos)] if eos in new else new
            texts.append(tokenizer.decode(x + new))
    return texts


def baseline_sonnets(prompts: list[str], kind: str, train_sonnets: list[str], seed: int) -> list[str]:
    """'prompts': each prompt alone. 'random_sonnet': each prompt followed by a random training sonnet's lines after
    its first three, so the text has a sonnet's length (seeded choice)."""
    if kind == "prompts":
        return list(prompts)
    if kind != "random_sonnet":
        raise ValueError(f"unknown baseline {kind!r} (prompts, random_sonnet)")
    rng = random.Random(seed)
    return [p + "\n" + "\n".join(rng.choice(train_sonnets).splitlines()[3:]) for p in prompts]


# ---------------------------------------------------------------------------------------------------------------
# The task


def decoding_from_args(args) -> Decoding:
    return Decoding(max_new_tokens=args.max_new_tokens, do_sample=not args.greedy and args.num_beams == 1,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None,
                    repetition_penalty=args.repetition_penalty, num_beams=args.num_beams,
                    length_penalty=args.length_penalty, seed=args.seed, quantize=getattr(args, "quantize", None))


def describe(d: Decoding) -> str:
    if d.num_beams > 1:
        how = f"beam search, {d.num_beams} beams, length penalty {d.length_penalty:g}"
    elif d.do_sample:
        how = (f"sampling, temperature {d.temperature:g}, top-p {d.top_p if d.top_p is not None else 1:g}"
               + (f", top-k {d.top_k}" if d.top_k else "") + f", seed {d.seed}")
    else:
        how = "greedy"
    rep = f", repetition penalty {d.repetition_penalty:g}" if d.repetition_penalty != 1.0 else ""
    quant = f", {d.quantize} weights, one prompt at a time" if d.quantize else ""
    return f"{how}{rep}{quant}, up to {d.max_new_tokens} new tokens"


def course_file(name: str) -> str:
    """data/NAME if it is there (the course's layout, run from its folder), else data_dir()'s copy of the course's
    file (the project's data/cs224n, or $GPT2_SHARED_DIR's)."""
    local = Path("data") / name
    return str(local if local.is_file() else data_dir() / "cs224n" / name)


@dataclass
class SonnetConfig(FineTuneConfig):
    """run_sonnet.py's flags (see FineTuneConfig for the shared ones)."""
    tokenizer: str | None = None  # None: the --model folder's own tokenizer, else gpt2
    max_length: int | None = None
    sonnet_path: str = field(default_factory=lambda: course_file("sonnets.txt"))
    held_out_sonnet_path: str = field(default_factory=lambda: course_file("sonnets_held_out.txt"))
    predictions_dir: str | None = None  # None: OUTPUT_DIR/predictions
    sonnet_out: str | None = None  # None: PREDICTIONS_DIR/generated_sonnets.txt
    dev_sonnet_path: str = field(default_factory=lambda: course_file("sonnets_held_out_dev.txt"))
    dev_gold_path: str = field(default_factory=lambda: course_file("TRUE_sonnets_held_out_dev.txt"))
    dev_out: str | None = None  # None: PREDICTIONS_DIR/generated_sonnets_dev.txt
    temperature: float = 1.2
    top_p: float = 0.9
    top_k: int = 0
    greedy: bool = False
    num_beams: int = 1
    length_penalty: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128
    quantize: str | None = None  # modules.quant.QUANTIZE_MODES, with generate_only
    generate_only: bool = False
    baseline: str | None = None  # prompts or random_sonnet: no model


def run(args: SonnetConfig) -> dict:
    """The whole of run_sonnet.py (the Python API: `run(SonnetConfig(model=..., epochs=1, ...))`)."""
    device = start(args, default_output_dir(args))
    folder = predictions_folder(args.predictions_dir, args.output_dir)  # the course's names, in the run's folder
    args.dev_out = args.dev_out or str(folder / "generated_sonnets_dev.txt")
    args.sonnet_out = args.sonnet_out or str(folder / "generated_sonnets.txt")
    if not args.max_steps:  # a benchmark writes no predictions
        claim_outputs((args.dev_out, args.sonnet_out), args.overwrite, args.resume,
                      trains=not (args.baseline or args.generate_only))
    return run_on(args, device)


def default_output_dir(args) -> str:
    """The run's folder when --output_dir is not given. Runs that do not train are named by what they write, so a
    decoding or a baseline does not land in (nor is refused by) a fine-tuning run's folder."""
    if args.baseline:
        return f"checkpoints/sonnet-baseline-{args.baseline}" + (f"-seed{args.seed}" if args.baseline == "random_sonnet"
                                                                 else "")
    if args.generate_only:
        d = decoding_from_args(args)
        how = f"beam{d.num_beams}" if d.num_beams > 1 else "sample" if d.do_sample else "greedy"
        return f"checkpoints/sonnet-generate-{how}" + (f"-{d.quantize}" if d.quantize else "")
    return "checkpoints/sonnet-lora" if args.lora_rank else "checkpoints/sonnet"


def run_on(args, device: torch.device) -> dict:
    """Fine-tune on the training sonnets keeping the best dev-chrF epoch (or --generate_only / --baseline), then
    write the dev and held-out generations and grade the dev file."""
    train_sonnets = read_sonnets(args.sonnet_path)
    dev_prompts, dev_gold = read_sonnets(args.dev_sonnet_path), read_sonnets(args.dev_gold_path)
    check_pairs(dev_prompts, dev_gold, args.dev_sonnet_path, args.dev_gold_path)
    test_prompts = read_sonnets(args.held_out_sonnet_path)
    print(f"loaded {len(train_sonnets)} training sonnets, {len(dev_prompts)} dev prompts with gold, "
          f"{len(test_prompts)} held-out prompts")
    decoding = decoding_from_args(args)

    if args.baseline:
        dev_texts = baseline_sonnets(dev_prompts, args.baseline, train_sonnets, args.seed)
        test_texts = baseline_sonnets(test_prompts, args.baseline, train_sonnets, args.seed)
        return _finish(args, dev_texts, test_texts, f"baseline {args.baseline}")

    seed_everything(args.seed)
    model = SonnetGPT(build_body(args.model, cls=GPT2LMHeadModel, expect=args.expect, **body_overrides(args)))
    lora.apply_from_args(model, args)
    tokenizer_name = tokenizer_for(args.tokenizer, args.model)  # the model folder's own, else gpt2
    tokenizer = load_task_tokenizer(tokenizer_name)
    check_vocab(tokenizer, model.config.vocab_size)
    model.to(device)
    max_length = min(args.max_length or model.config.n_positions, model.config.n_positions)
    enc_train = encode_sonnets(train_sonnets, tokenizer, max_length, "training")
    enc_dev = encode_sonnets(dev_gold, tokenizer, max_length, "dev")
    pad = tokenizer.pad_token_id
    print(f"model {args.model}: {model.lm.num_parameters() / 1e6:.1f}M parameters; decoding: {describe(decoding)}")

    def generate_all(m, prompts):
        return complete_sonnets(m, tokenizer, prompts, decoding, args.eval_batch_size, device)

    if not args.generate_only:
        def evaluate(m):
            return {"chrf": chrf(generate_all(m, dev_prompts), dev_gold),
                    "loss": mean_loss(m, enc_dev, pad, args.eval_batch_size, device)}

        def loss_fn(m, batch):
            return m.loss(batch["input_ids"], batch["attention_mask"])

        lr = args.lr if args.lr is not None else 1e-5
        cfg = train_config(args, args.output_dir, lr, device)
        cfg.select_metric = "chrf"
        run_info = {"task": "sonnet", "model": args.model, "tokenizer": tokenizer_name, "train": str(args.sonnet_path),
                    "dev": str(args.dev_sonnet_path), "max_length": max_length, "lr": lr,
                    "hidden_dropout_prob": args.hidden_dropout_prob, "decoding": asdict(decoding),
                    **{k: getattr(cfg, k) for k in ("epochs", "batch_size", "grad_accum", "weight_decay", "schedule",
                                                    "warmup_ratio", "max_grad_norm", "bf16", "fp16", "seed")},
                    **lora.run_info(args)}
        print(f"fine-tuning: lr {lr:g}, {cfg.epochs} epochs of {len(enc_train)} sonnets; "
              f"checkpoints in {args.output_dir}")
        result = train(model, len(enc_train), lambda idx: collate([enc_train[i] for i in idx], pad), loss_fn, evaluate,
                       cfg, run_info, tokenizer=tokenizer, count_fn=predicted_tokens)
        if args.max_steps or not dist.is_main():  # under torchrun rank 0 alone generates and writes
            return result
        load_weights(model, Path(args.output_dir) / "best")
        print(f"best epoch {result['best']['epoch']}: dev chrF {result['best']['metrics']['chrf']:.2f}")
    resolve_dtype(args)  # --generate_only reaches here without train_config
    with autocast(device, args.bf16, args.fp16):
        dev_texts, test_texts = generate_all(model, dev_prompts), generate_all(model, test_prompts)
    if args.merge_lora:
        lora.write_merged(model, Path(args.output_dir) / "merged", tokenizer)
    return _finish(args, dev_texts, test_texts, describe(decoding))


def _finish(args, dev_texts: list[str], test_texts: list[str], what: str) -> dict:
    write_sonnets(args.dev_out, dev_texts)
    write_sonnets(args.sonnet_out, test_texts)
    graded = score_file(args.dev_out, args.dev_gold_path)
    print(f"dev chrF {graded['chrf']:.2f} over {graded['n']} sonnets ({what}); wrote {args.dev_out} and "
          f"{args.sonnet_out}")
    print(f"--- first dev sonnet ---\n{dev_texts[0]}")
    return graded
