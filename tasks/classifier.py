"""Sentiment classification (SST-5, CFIMDB): GPT2SentimentClassifier, its loss and predictions, and `run`, the
whole task (read, train, reload the best checkpoint, write the course's prediction files) that run_classifier.py calls:

    from tasks.classifier import ClassifierConfig, run
    run(ClassifierConfig(task="sst", model="random:n_layer=2,n_head=2,n_embd=64", fine_tune_mode="full-model",
                         lr=3e-4, epochs=1, output_dir="checkpoints/sst-small"))
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.hub import data_dir, tokenizer_for
from tasks import lora
from tasks.data import NUM_LABELS, check_vocab, collate, encode, load_sentiment, load_task_tokenizer
from tasks.evaluate import classification_metrics, write_predictions
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

MODES = ("last-linear-layer", "full-model")


class GPT2SentimentClassifier(nn.Module):
    """GPT-2 body + dropout + linear layer on the last real token's final hidden state -> (B, num_labels) logits.

    fine_tune_mode 'last-linear-layer' freezes the body (only the head learns); 'full-model' trains everything.
    head_dropout is the dropout before the linear layer; the body's own dropout is its config's (hidden_dropout_prob).
    """

    def __init__(self, gpt: nn.Module, num_labels: int, head_dropout: float = 0.3,
                 fine_tune_mode: str = "last-linear-layer"):
        super().__init__()
        if fine_tune_mode not in MODES:
            raise ValueError(f"fine_tune_mode must be one of {MODES}, got {fine_tune_mode!r}")
        self.num_labels = num_labels
        self.fine_tune_mode = fine_tune_mode
        self.gpt = gpt
        for p in self.gpt.parameters():
            p.requires_grad = fine_tune_mode == "full-model"
        self.dropout = nn.Dropout(head_dropout)
        self.classifier = nn.Linear(gpt.config.n_embd, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        last_token = self.gpt(input_ids, attention_mask)["last_token"]  # (B, C)
        return self.classifier(self.dropout(last_token))  # (B, num_labels)


def loss_fn(model: GPT2SentimentClassifier, batch: dict):
    logits = model(batch["input_ids"], batch["attention_mask"])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision up, float64 kept
    loss = F.cross_entropy(logits, batch["labels"])
    return loss, {"correct": int((logits.argmax(-1) == batch["labels"]).sum()), "count": len(batch["labels"])}


def predict_labels(model, input_ids, attention_mask) -> torch.Tensor:
    return model(input_ids, attention_mask).argmax(-1)


@dataclass
class ClassifierConfig(FineTuneConfig):
    """run_classifier.py's flags (see FineTuneConfig for the shared ones)."""
    fine_tune_mode: str | None = None  # last-linear-layer, or full-model (the default with lora_rank)
    head_dropout: float = 0.3
    tokenizer: str | None = None  # None: the --model folder's own tokenizer, else gpt2
    max_length: int | None = None
    task: str | None = None  # sst, cfimdb or both (default: both, or the one named by train)
    data_dir: str | None = None
    train: str | None = None
    dev: str | None = None
    test: str | None = None
    num_labels: int | None = None
    predictions_dir: str | None = None  # None: OUTPUT_DIR/predictions
    dev_out: str | None = None
    test_out: str | None = None
    skip_bad_rows: bool = False


def jobs(args) -> list[tuple]:
    """(task, train, dev, test, num_labels) for each dataset to run."""
    if args.train or args.dev:
        if not (args.train and args.dev):
            raise ValueError("--train and --dev go together")
        if args.task == "both":
            raise ValueError("--task both runs the course files; with --train give one --task or none")
        name = args.task or next((t for t in NUM_LABELS if t in Path(args.train).name.lower()), None)
        num_labels = args.num_labels or NUM_LABELS.get(name)
        if num_labels is None:
            raise ValueError(f"cannot tell the number of classes of {args.train}: pass --num_labels")
        return [(name or "custom", args.train, args.dev, args.test, num_labels)]
    folder = Path(args.data_dir) if args.data_dir else (Path("data") if Path("data/ids-sst-train.csv").is_file()
                                                        else data_dir() / "cs224n")
    tasks = ("sst", "cfimdb") if args.task in (None, "both") else (args.task,)
    return [(t, folder / f"ids-{t}-train.csv", folder / f"ids-{t}-dev.csv", folder / f"ids-{t}-test-student.csv",
             args.num_labels or NUM_LABELS[t]) for t in tasks]


def run(cfg: ClassifierConfig) -> list[dict | None]:
    """The whole of run_classifier.py: for each dataset (SST then CFIMDB, or the given files) train, reload the best
    dev checkpoint and write the course's prediction files. Returns each dataset's result."""
    cfg.fine_tune_mode = cfg.fine_tune_mode or ("full-model" if cfg.lora_rank else "last-linear-layer")
    device = start(cfg)  # output_dir defaults per task below
    mode = "lora" if cfg.lora_rank else cfg.fine_tune_mode  # names the default prediction files and checkpoints
    todo = jobs(cfg)
    if len(todo) > 1 and (cfg.dev_out or cfg.test_out):
        raise ValueError("--dev_out / --test_out name one file: use them with a single --task")
    plan = []
    for task, train_path, dev_path, test_path, num_labels in todo:
        out = Path(cfg.output_dir) / task if cfg.output_dir and len(todo) > 1 else cfg.output_dir
        out = str(out or f"checkpoints/{mode}-{task}")
        folder = predictions_folder(cfg.predictions_dir, out)  # the course's names, in the run's folder
        outputs = (cfg.dev_out or str(folder / f"{mode}-{task}-dev-out.csv"),
                   cfg.test_out or str(folder / f"{mode}-{task}-test-out.csv"))
        if not cfg.max_steps:  # a benchmark writes no predictions
            claim_outputs((outputs[0], outputs[1] if test_path else None), cfg.overwrite, cfg.resume)
        plan.append((task, train_path, dev_path, test_path, num_labels, out, outputs))
    return [run_dataset(cfg, task, train_path, dev_path, test_path, num_labels, dev_out=dev_out, test_out=test_out,
                        output_dir=out, device=device)
            for task, train_path, dev_path, test_path, num_labels, out, (dev_out, test_out) in plan]


def run_dataset(args, task: str, train_path: str, dev_path: str, test_path: str | None, num_labels: int,
                dev_out: str, test_out: str | None, output_dir: str, device: torch.device) -> dict | None:
    """Train on one dataset, reload the best dev checkpoint and write the dev (and test) prediction files."""
    print(f"== {task}: {num_labels} classes, fine-tune mode {args.fine_tune_mode}, train {train_path}")
    train_ex = load_sentiment(train_path, "train", num_labels, args.skip_bad_rows)
    dev_ex = load_sentiment(dev_path, "dev", num_labels, args.skip_bad_rows)
    test_ex = load_sentiment(test_path, "test", skip_bad_rows=args.skip_bad_rows) if test_path else None
    print(f"loaded {len(train_ex)} train, {len(dev_ex)} dev" + (f", {len(test_ex)} test" if test_ex else "") + " examples")

    seed_everything(args.seed)
    body = build_body(args.model, expect=args.expect, **body_overrides(args))
    model = GPT2SentimentClassifier(body, num_labels, args.head_dropout, args.fine_tune_mode)
    lora.apply_from_args(model, args)
    tokenizer_name = tokenizer_for(args.tokenizer, args.model)  # the model folder's own, else gpt2
    tokenizer = load_task_tokenizer(tokenizer_name)
    check_vocab(tokenizer, body.config.vocab_size)
    max_length = min(args.max_length or body.config.n_positions, body.config.n_positions)
    enc = {name: encode(ex, tokenizer, max_length, prompt=lambda e: e.text, what=name)
           for name, ex in (("train", train_ex), ("dev", dev_ex), ("test", test_ex)) if ex}
    pad = tokenizer.pad_token_id

    def evaluate(m):
        preds = predict_in_order(m, enc["dev"], args.eval_batch_size, pad, predict_labels, device, desc="dev")
        metrics = classification_metrics([e.label for e in enc["dev"]], preds, list(range(num_labels)))
        return {"acc": metrics["accuracy"], "f1": metrics["macro_f1"], "confusion": metrics["confusion_matrix"]}

    lr = args.lr if args.lr is not None else (1e-3 if args.fine_tune_mode == "last-linear-layer" else 1e-5)
    cfg = train_config(args, output_dir, lr, device)
    run_info = {"task": task, "model": args.model, "tokenizer": tokenizer_name, "train": str(train_path),
                "dev": str(dev_path), "num_labels": num_labels, "fine_tune_mode": args.fine_tune_mode,
                "hidden_dropout_prob": args.hidden_dropout_prob, "head_dropout": args.head_dropout, "max_length": max_length, "lr": lr,
                **{k: getattr(cfg, k) for k in ("epochs", "batch_size", "grad_accum", "weight_decay", "schedule",
                                                "warmup_ratio", "max_grad_norm", "bf16", "fp16", "seed")},
                **lora.run_info(args)}
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{n_trainable / 1e6:.2f}M trainable; lr {lr:g}; checkpoints in {output_dir}")
    result = train(model, len(enc["train"]), lambda idx: collate([enc["train"][i] for i in idx], pad), loss_fn,
                   evaluate, cfg, run_info, tokenizer=tokenizer)
    if args.max_steps or not dist.is_main():  # under torchrun rank 0 alone predicts and writes
        return result

    load_weights(model, Path(output_dir) / "best")
    preds = predict_in_order(model, enc["dev"], args.eval_batch_size, pad, predict_labels, device, args.bf16, "dev",
                             args.fp16)
    metrics = classification_metrics([e.label for e in enc["dev"]], preds, list(range(num_labels)))
    write_predictions(dev_out, [e.id for e in enc["dev"]], preds, "sentiment")
    print(f"{task} best epoch {result['best']['epoch']}: dev acc {metrics['accuracy']:.4f} macro-F1 "
          f"{metrics['macro_f1']:.4f}; confusion (rows gold, columns predicted): {metrics['confusion_matrix']}")
    print(f"wrote {dev_out}")
    if test_ex:
        test_preds = predict_in_order(model, enc["test"], args.eval_batch_size, pad, predict_labels, device,
                                      args.bf16, "test", args.fp16)
        write_predictions(test_out, [e.id for e in enc["test"]], test_preds, "sentiment")
        print(f"wrote {test_out}")
    if args.merge_lora:
        lora.write_merged(model, Path(output_dir) / "merged", tokenizer)
    return {"task": task, **metrics, "best_epoch": result["best"]["epoch"], "history": result["history"]}
