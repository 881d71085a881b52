"""Paraphrase detection (Quora) as a cloze: ParaphraseGPT, the course's prompts, its loss and predictions, and
`run`, the whole task that run_paraphrase.py calls.

The model reads a prompt and is trained to put the token "yes" (GPT-2 id 8505) or "no" (3919) next: logits over
the vocabulary at the last real token (the LM head tied to the token embedding), cross-entropy against the answer's
token id, and predictions restricted to the two answers. Prediction files use 8505 / 3919, as the course grades.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.hub import data_dir, tokenizer_for
from tasks import lora
from tasks.data import (
    Example,
    check_vocab,
    collate,
    encode,
    load_paraphrase,
    load_task_tokenizer,
    single_token_id,
    split_head,
)
from tasks.evaluate import NO_ID, YES_ID, classification_metrics, write_predictions
from tasks.finetune import (
    FineTuneConfig,
    body_overrides,
    build_body,
    predict_in_order,
    seed_everything,
    start,
    train,
    train_config,
)
from tasks.outputs import claim_outputs, predictions_folder
from training import distributed as dist
from training.engine import load_weights

MODES = ("full-model", "last-linear-layer")


def prompt_for_train(ex: Example) -> str:
    """The course's train/dev prompt (its missing closing quote after question 2 included)."""
    s1, s2 = ex.text
    return f'Question 1: "{s1}"\nQuestion 2: "{s2}\nAre these questions asking the same thing?\n'


def prompt_for_test(ex: Example) -> str:
    """The course's test prompt (different from train/dev's)."""
    s1, s2 = ex.text
    return f'Is "{s1}" a paraphrase of "{s2}"? Answer "yes" or "no": '


class ParaphraseGPT(nn.Module):
    """GPT-2 body whose tied LM head scores the next token after the prompt: forward -> (B, vocab) logits.

    yes_id / no_id are the tokenizer's ids of "yes" and "no" (8505 / 3919 for GPT-2). fine_tune_mode
    'last-linear-layer' trains only the output layer (tied to the token embedding, so the input embedding moves
    with it; an untied body's lm_head alone) and freezes the rest; 'full-model' (the course's setting) trains
    everything.
    """

    def __init__(self, gpt: nn.Module, yes_id: int = YES_ID, no_id: int = NO_ID, fine_tune_mode: str = "full-model"):
        super().__init__()
        if fine_tune_mode not in MODES:
            raise ValueError(f"fine_tune_mode must be one of {MODES}, got {fine_tune_mode!r}")
        self.gpt = gpt
        self.yes_id, self.no_id = yes_id, no_id
        head = "lm_head.weight" if getattr(gpt, "lm_head", None) is not None else "word_embedding.weight"
        for name, p in self.gpt.named_parameters():
            p.requires_grad = fine_tune_mode == "full-model" or name == head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        last_token = self.gpt(input_ids, attention_mask)["last_token"]  # (B, C)
        return self.gpt.hidden_state_to_token(last_token)  # (B, vocab)

    def predict(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) token ids, each yes_id or no_id: the likelier of the two answers."""
        logits = self(input_ids, attention_mask)
        return torch.where(logits[:, self.yes_id] > logits[:, self.no_id], self.yes_id, self.no_id)


def loss_fn(model: ParaphraseGPT, batch: dict):
    """Cross-entropy over the whole vocabulary against the answer token (yes_id for 1, no_id for 0)."""
    logits = model(batch["input_ids"], batch["attention_mask"])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision up, float64 kept
    targets = torch.where(batch["labels"] == 1, model.yes_id, model.no_id)
    picked = torch.where(logits[:, model.yes_id] > logits[:, model.no_id], model.yes_id, model.no_id)
    return F.cross_entropy(logits, targets), {"correct": int((picked == targets).sum()), "count": len(targets)}


def to_course_codes(preds: list[int], model: ParaphraseGPT) -> list[int]:
    """Token ids of the model's tokenizer -> the course's 8505 (yes) / 3919 (no), whatever the tokenizer."""
    return [YES_ID if p == model.yes_id else NO_ID for p in preds]


@dataclass
class ParaphraseConfig(FineTuneConfig):
    """run_paraphrase.py's flags (see FineTuneConfig for the shared ones)."""
    fine_tune_mode: str = "full-model"
    tokenizer: str | None = None  # None: the --model folder's own tokenizer, else gpt2
    max_length: int | None = None
    train: str = "data/quora-train.csv"
    dev: str | None = None
    test: str | None = None
    split_dev: int = 0
    predictions_dir: str | None = None  # None: OUTPUT_DIR/predictions
    dev_out: str | None = None  # None: PREDICTIONS_DIR/para-dev-output.csv
    test_out: str | None = None  # None: PREDICTIONS_DIR/para-test-output.csv
    test_prompt: str = "test"
    skip_bad_rows: bool = False


def run(args: ParaphraseConfig) -> dict:
    """The whole of run_paraphrase.py (the Python API: `run(ParaphraseConfig(train=..., split_dev=16000, ...))`)."""
    device = start(args, "checkpoints/paraphrase-lora" if args.lora_rank else "checkpoints/paraphrase")
    folder = predictions_folder(args.predictions_dir, args.output_dir)  # the course's names, in the run's folder
    args.dev_out = args.dev_out or str(folder / "para-dev-output.csv")
    args.test_out = args.test_out or str(folder / "para-test-output.csv")
    if not args.max_steps:  # a benchmark writes no predictions
        claim_outputs((args.dev_out, args.test_out if args.test else None), args.overwrite, args.resume)
    return run_on(args, device)


def bundled_pairs_hint() -> str:
    """What to add to the error for a training file that is not there: the bundled Quora pairs, when they are there
    (the course's data/quora-*.csv files are not shipped with the project)."""
    pairs = data_dir() / "quora" / "quora-dev-minbert.csv"
    if not pairs.is_file():
        return ""
    return (f"; the data folder holds labelled Quora pairs, one file that --split_dev cuts into train and dev "
            f"(--skip_bad_rows: 2 rows are malformed): --train {pairs} --split_dev 16000 --skip_bad_rows")


def run_on(args, device: torch.device) -> dict:
    """Train, reload the best dev checkpoint, write the dev (and test) prediction files."""
    try:
        train_ex = load_paraphrase(args.train, "train", args.skip_bad_rows)
    except FileNotFoundError as e:  # read_table's "data file not found: PATH", with where the data is
        raise FileNotFoundError(f"{e}{bundled_pairs_hint()}") from None
    if args.split_dev:
        if args.dev:
            raise ValueError("give either --dev or --split_dev, not both")
        train_ex, dev_ex = split_head(train_ex, args.split_dev, args.train)
        print(f"split {args.train}: first {len(train_ex)} examples train, the other {len(dev_ex)} dev")
    elif args.dev:
        dev_ex = load_paraphrase(args.dev, "dev", args.skip_bad_rows)
    else:
        raise ValueError("no dev data: give --dev (course: --para_dev) or --split_dev N")
    test_ex = load_paraphrase(args.test, "test", args.skip_bad_rows) if args.test else None
    print(f"loaded {len(train_ex)} train, {len(dev_ex)} dev" + (f", {len(test_ex)} test" if test_ex else "") + " pairs")

    seed_everything(args.seed)
    body = build_body(args.model, expect=args.expect, **body_overrides(args))
    tokenizer_name = tokenizer_for(args.tokenizer, args.model)  # the model folder's own, else gpt2
    tokenizer = load_task_tokenizer(tokenizer_name)
    check_vocab(tokenizer, body.config.vocab_size)
    model = ParaphraseGPT(body, single_token_id(tokenizer, "yes"), single_token_id(tokenizer, "no"),
                          args.fine_tune_mode)
    lora.apply_from_args(model, args)
    max_length = min(args.max_length or body.config.n_positions, body.config.n_positions)
    # Truncate on the left so the end of the prompt, where the answer goes, is kept.
    enc = {"train": encode(train_ex, tokenizer, max_length, prompt_for_train, "left", "train"),
           "dev": encode(dev_ex, tokenizer, max_length, prompt_for_train, "left", "dev")}
    if test_ex:
        prompt = prompt_for_test if args.test_prompt == "test" else prompt_for_train
        enc["test"] = encode(test_ex, tokenizer, max_length, prompt, "left", "test")
    pad = tokenizer.pad_token_id
    dev_gold = [model.yes_id if e.label == 1 else model.no_id for e in enc["dev"]]
    labels = [model.no_id, model.yes_id]
    predict = ParaphraseGPT.predict

    def evaluate(m):
        preds = predict_in_order(m, enc["dev"], args.eval_batch_size, pad, predict, device, desc="dev")
        metrics = classification_metrics(dev_gold, preds, labels)
        return {"acc": metrics["accuracy"], "f1": metrics["macro_f1"], "confusion": metrics["confusion_matrix"]}

    lr = args.lr if args.lr is not None else 1e-5
    cfg = train_config(args, args.output_dir, lr, device)
    run_info = {"task": "para", "model": args.model, "tokenizer": tokenizer_name, "train": str(args.train),
                "dev": str(args.dev), "split_dev": args.split_dev, "fine_tune_mode": args.fine_tune_mode,
                "hidden_dropout_prob": args.hidden_dropout_prob, "max_length": max_length, "lr": lr,
                **{k: getattr(cfg, k) for k in ("epochs", "batch_size", "grad_accum", "weight_decay", "schedule",
                                                "warmup_ratio", "max_grad_norm", "bf16", "fp16", "seed")},
                **lora.run_info(args)}
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{n_trainable / 1e6:.2f}M trainable; lr {lr:g}; yes/no token ids {model.yes_id}/{model.no_id}; "
          f"checkpoints in {args.output_dir}")
    result = train(model, len(enc["train"]), lambda idx: collate([enc["train"][i] for i in idx], pad), loss_fn,
                   evaluate, cfg, run_info, tokenizer=tokenizer)
    if args.max_steps or not dist.is_main():  # under torchrun rank 0 alone predicts and writes
        return result

    load_weights(model, Path(args.output_dir) / "best")
    preds = predict_in_order(model, enc["dev"], args.eval_batch_size, pad, predict, device, args.bf16, "dev",
                             args.fp16)
    metrics = classification_metrics(dev_gold, preds, labels)
    write_predictions(args.dev_out, [e.id for e in enc["dev"]], to_course_codes(preds, model), "paraphrase")
    print(f"para best epoch {result['best']['epoch']}: dev acc {metrics['accuracy']:.4f} macro-F1 "
          f"{metrics['macro_f1']:.4f}; confusion (rows gold no/yes, columns predicted): {metrics['confusion_matrix']}")
    print(f"wrote {args.dev_out}")
    if test_ex:
        test_preds = predict_in_order(model, enc["test"], args.eval_batch_size, pad, predict, device, args.bf16,
                                      "test", args.fp16)
        write_predictions(args.test_out, [e.id for e in enc["test"]], to_course_codes(test_preds, model),
                          "paraphrase")
        print(f"wrote {args.test_out}")
    if args.merge_lora:
        lora.write_merged(model, Path(args.output_dir) / "merged", tokenizer)
    return {"task": "para", **metrics, "best_epoch": result["best"]["epoch"], "history": result["history"]}
