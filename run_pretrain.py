"""Train a GPT-2 from scratch on a text file, then sample from it ("Let's build GPT").

    # nanoGPT's CPU configuration on tiny shakespeare (every default below is that configuration, the corpus too:
    # data/tinyshakespeare/input.txt, bundled with the project):
    python run_pretrain.py --output_dir out/shakespeare-char
    # continue an interrupted run exactly where its last checkpoint left off
    python run_pretrain.py --output_dir out/shakespeare-char --resume
    # Muon for the blocks' matrices (lr 0.02), AdamW for embeddings, LM head, LayerNorms and biases (lr 1e-3)
    python run_pretrain.py --output_dir out/char-muon --optimizer muon
    # GPT-2 BPE tokens, a preset size with a shorter context, gradient accumulation
    python run_pretrain.py --data corpus.txt --tokenizer gpt2 --preset gpt2 --n_positions 256 --block_size 256 \\
        --batch_size 8 --grad_accum 4 --output_dir out/corpus-bpe
    # two processes sharing each batch (DDP; gloo on CPU, nccl on GPUs): the same weights as one process
    torchrun --standalone --nproc_per_node=2 run_pretrain.py --output_dir out/shakespeare-char-ddp
    # a modern variant: nanochat's GPT at depth 4 (RMSNorm, RoPE, ReLU^2, q/k norm, no biases, untied soft-capped
    # head), or GPT-2 with some of its parts swapped
    python run_pretrain.py --output_dir out/nanochat-d4 --depth 4
    python run_pretrain.py --output_dir out/rope-gqa \
        --position_embedding rope --n_kv_head 1 --norm rmsnorm --activation relu2 --no-bias
    # the bigram baseline of the same corpus (a next-token table; the lecture trains it with lr 1e-2)
    python run_pretrain.py --arch bigram --lr 1e-2 --min_lr 1e-3 --output_dir out/shakespeare-bigram
    # sample from a saved checkpoint
    python run_pretrain.py --sample --model out/shakespeare-char/best --prompt "ROMEO:" --max_new_tokens 500 \\
        --temperature 0.8 --top_k 200 --num_samples 3
    # the same with weight-only int8 weights (GPT-2 models; faster on CPUs with AVX2 or better, close to fp32's text)
    python run_pretrain.py --sample --model out/shakespeare-char/best --prompt "ROMEO:" --quantize int8

The checkpoint folders (OUTPUT_DIR/best, OUTPUT_DIR/last) are Hugging Face model folders with their tokenizer
(char_vocab.json, or the BPE tokenizer's files) and training state; the token ids live once in OUTPUT_DIR/data.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from config import ACTIVATIONS, NORMS, POSITION_EMBEDDINGS, PRESETS
from modules.quant import QUANTIZE_MODES
from tasks.finetune import add_device_args, add_precision_args, resolve_dtype


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", help="UTF-8 text file to train on (default: tiny shakespeare, bundled in "
                                  "data/tinyshakespeare/input.txt; $GPT2_SHARED_DIR/data/... when that is set)")
    g.add_argument("--tokenizer", default="char",
                   help="'char' (vocabulary = the corpus's characters), 'gpt2' or a folder with a GPT-2 BPE tokenizer")
    g.add_argument("--val_fraction", type=float, default=0.1, help="last fraction of the token ids held out for val")
    g.add_argument("--data_dir", help="cache for the encoded ids (default: OUT_DIR/data)")
    g = p.add_argument_group("model (random init)")
    g.add_argument("--arch", choices=("gpt2", "bigram"), default="gpt2",
                   help="gpt2, or bigram: a table of next-token logits (the floor of 'Let's build GPT'; no sizes)")
    g.add_argument("--preset", choices=sorted(PRESETS), help="start from a GPT-2 size (n_positions 1024)")
    g.add_argument("--depth", type=_positive(int),
                   help="start from nanochat's GPT of this many layers (preset nanochat-d{depth}: width 64 * depth "
                        "rounded up to heads of 128, n_positions 2048, RMSNorm without scale, RoPE theta 1e5, ReLU^2, "
                        "q/k norm, no biases, untied head, logits capped at 15); the flags below override it")
    g.add_argument("--n_layer", type=_positive(int), help="transformer blocks (default 4, or the preset's)")
    g.add_argument("--n_head", type=_positive(int), help="attention heads (default 4, or the preset's)")
    g.add_argument("--n_embd", type=_positive(int), help="model width (default 128, or the preset's)")
    g.add_argument("--block_size", type=_positive(int), default=64, help="tokens per training window")
    g.add_argument("--n_positions", type=_positive(int), help="model context (default: --block_size; 1024 with a preset)")
    g.add_argument("--dropout", type=float, default=0.0, help="residual, embedding and attention dropout")
    g.add_argument("--activation", choices=ACTIVATIONS,
                   help="MLP activation (default: GPT-2's tanh GELU gelu_new, or --depth's relu2): exact 'gelu' as "
                        "nanoGPT, 'relu2' (ReLU squared) as nanochat")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="recompute activations in backward: less memory for big models or long blocks, more time")
    g = p.add_argument_group("architecture variants (left out: GPT-2's choice, or the --depth preset's)")
    g.add_argument("--norm", choices=NORMS, help="the norm of every block and the final one: layernorm (GPT-2) or "
                   "rmsnorm (nanochat, Llama)")
    g.add_argument("--norm_scale", action=argparse.BooleanOptionalAction,
                   help="a learnable scale in the norms (GPT-2: on; --no-norm_scale: nanochat's parameter-free norm)")
    g.add_argument("--position_embedding", choices=POSITION_EMBEDDINGS,
                   help="learned: GPT-2's table added to the embeddings; rope: rotary q and k (needs an even head size)")
    g.add_argument("--rope_theta", type=_positive(float), help="RoPE base (default 10000; --depth: 100000)")
    g.add_argument("--n_kv_head", type=_positive(int), help="key/value heads, each shared by n_head / n_kv_head query "
                   "heads (grouped-query attention; 1: multi-query; default n_head)")
    g.add_argument("--qk_norm", action=argparse.BooleanOptionalAction, help="RMSNorm of every head's q and k")
    g.add_argument("--bias", action=argparse.BooleanOptionalAction,
                   help="biases in the Linear layers and LayerNorms (GPT-2: on; --no-bias: none, as nanoGPT's option)")
    g.add_argument("--tie_word_embeddings", action=argparse.BooleanOptionalAction,
                   help="the LM head is the token embedding (GPT-2: on; --no-tie_word_embeddings: a head of its own)")
    g.add_argument("--logit_softcap", type=_positive(float),
                   help="soft-cap the logits to (-c, c) as c * tanh(logits / c) (nanochat: 15; default off)")
    g = p.add_argument_group("optimization")
    g.add_argument("--max_iters", type=_non_negative_int, default=2000, help="optimizer steps")
    g.add_argument("--batch_size", type=_positive(int), default=12, help="windows per micro-batch")
    g.add_argument("--grad_accum", type=_positive(int), default=1, help="micro-batches per optimizer step")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="adamw, or muon: Muon (orthogonalised momentum) for the blocks' weight matrices and AdamW "
                        "(--lr) for the embeddings, LM head, LayerNorms and biases")
    g.add_argument("--lr", "--learning_rate", dest="lr", type=_positive(float), default=1e-3,
                   help="peak learning rate (of AdamW's parameters under --optimizer muon)")
    g.add_argument("--muon_lr", type=_positive(float), default=0.02,
                   help="Muon's peak learning rate (--optimizer muon); the schedule scales it by the same factor as "
                        "--lr, down to --muon_lr * --min_lr / --lr")
    g.add_argument("--min_lr", type=float, default=1e-4, help="floor the cosine decays to")
    g.add_argument("--warmup_iters", type=_non_negative_int, default=100, help="linear warmup steps")
    g.add_argument("--lr_decay_iters", type=_positive(int), help="step where the cosine reaches --min_lr (default --max_iters)")
    g.add_argument("--weight_decay", type=float, default=0.1, help="decoupled weight decay of matrices (AdamW's, and Muon's with --optimizer muon)")
    g.add_argument("--decay_embeddings", action="store_true", help="decay the embeddings too (nanoGPT does)")
    g.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--beta2", type=float, default=0.99, help="AdamW beta2")
    g.add_argument("--adam_eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--max_grad_norm", "--grad_clip", dest="max_grad_norm", type=float, default=1.0,
                   help="clip the gradient norm to this (0: off)")
    add_precision_args(g)
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval_interval", type=_positive(int), default=250, help="estimate train/val loss every N steps")
    g.add_argument("--eval_iters", type=_positive(int), default=20, help="random batches per split per estimate")
    g.add_argument("--eval_full", action="store_true", help="val loss over the whole val split at each evaluation "
                   "(consecutive windows, every token once) instead of --eval_iters random batches")
    g.add_argument("--log_interval", type=_positive(int), default=50, help="print the training loss every N steps")
    g.add_argument("--output_dir", "--out_dir", dest="output_dir", default="out/pretrain",
                   help="checkpoints best/ and last/, metrics.jsonl, curves.png and the id cache")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output_dir, with the "
                   "run's own settings (a changed one is refused, naming it; --max_iters may be raised to train further)")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh, deleting the checkpoints already in --output_dir (the id cache is kept)")
    g.add_argument("--skip_nonfinite", action="store_true", help="skip (and count) steps whose loss or gradient is "
                   "not finite, instead of stopping the run there")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to OUTPUT_DIR/tensorboard")
    g = p.add_argument_group("sampling (after training, or from a checkpoint with --sample)")
    g.add_argument("--sample", action="store_true", help="only sample from --model (no training)")
    g.add_argument("--model", help="checkpoint or model folder for --sample (default OUT_DIR/best)")
    g.add_argument("--prompt", help="text to continue (default: newline for char models, <|endoftext|> for BPE)")
    g.add_argument("--max_new_tokens", type=_non_negative_int, default=300, help="tokens to generate per sample")
    g.add_argument("--num_samples", type=_non_negative_int, default=1, help="samples to print")
    g.add_argument("--temperature", type=_positive(float), default=0.8, help="softmax temperature")
    g.add_argument("--top_k", type=_non_negative_int, default=200, help="keep the k most likely tokens (0: all)")
    g.add_argument("--top_p", type=float, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--quantize", choices=QUANTIZE_MODES,
                   help="decode the samples with int8 or int4 copies of a GPT-2's weights, one sample at a time; "
                        "w8a8 / w4a8: and int8 activations (int4, w8a8, w4a8: n_embd a multiple of 32)")
    g = p.add_argument_group("system")
    g.add_argument("--seed", type=int, default=1337, help="seeds init, batches and sampling")
    add_device_args(g, default="cpu")
    g.add_argument("--threads", type=_non_negative_int, default=0,
                   help="CPU threads (0: torch's default, one per core; steps that do not split the batch run on that "
                        "count or fewer, chosen by timing them; N: exactly N, and a run that repeats to the last digit)")
    g.add_argument("--compile", action="store_true", help="torch.compile the training forward and loss (the first "
                   "steps compile; on CPUs it needs a C++ compiler; turns --split_batch off)")
    g.add_argument("--split_batch", action=argparse.BooleanOptionalAction, default=True,
                   help="split each batch across the threads, one core each, rather than parallelising every "
                        "operation (needs dropout 0; off under torchrun, where processes split the batch)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.min_lr <= args.lr:
        parser.error(f"--min_lr must be in [0, --lr], got {args.min_lr}")
    if args.warmup_iters > (args.lr_decay_iters or args.max_iters):
        parser.error(f"--warmup_iters {args.warmup_iters} is longer than the schedule (--lr_decay_iters, default "
                     f"--max_iters: {args.lr_decay_iters or args.max_iters})")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.quantize and args.arch == "bigram":
        parser.error("--quantize applies to GPT-2 models, not to --arch bigram (a lookup table, nothing to multiply)")
    if args.preset and args.depth:
        parser.error("--preset (a GPT-2 size) and --depth (nanochat's GPT) both choose the model: pass one of them")
    if args.arch == "bigram":
        given = [f"--{k}" for k in ("preset", "depth", "n_layer", "n_head", "n_embd") if getattr(args, k)]
        from tasks.pretrain import VARIANT_FLAGS

        given += [f"--{k}" for k in VARIANT_FLAGS if getattr(args, k) is not None]
        given += ["--dropout"] * bool(args.dropout) + ["--gradient_checkpointing"] * args.gradient_checkpointing
        given += ["--optimizer muon"] * (args.optimizer == "muon")
        if given:
            parser.error(f"--arch bigram is a (vocab x vocab) table: {', '.join(given)} do(es) not apply to it")
    try:
        resolve_dtype(args)
    except ValueError as e:
        parser.error(str(e))
    if args.use_gpu and args.device == "cpu":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --output_dir and --overwrite deletes it: pass one of them")
    return args


def config_from_args(args: argparse.Namespace):
    """The parsed flags as tasks.pretrain.PretrainConfig (the course-style switches folded into --dtype / --device)."""
    from tasks.pretrain import PretrainConfig

    return PretrainConfig(**{k: v for k, v in vars(args).items() if k not in ("bf16", "fp16", "use_gpu")})


def main(argv=None) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    from tasks import pretrain
    from training import distributed

    if args.sample:
        model, tokenizer = pretrain.load_for_sampling(args.model or os.path.join(args.output_dir, "best"),
                                                      args.tokenizer)
        gen = torch.Generator().manual_seed(args.seed)
        samples = pretrain.sample_text(model.to(args.device), tokenizer, args.prompt, args.max_new_tokens,
                                       args.temperature, args.top_k or None, args.top_p, args.num_samples, gen,
                                       quantize=args.quantize)
        summary = {"samples": samples}
    else:
        distributed.init(args.threads, args.device)  # a no-op unless launched by torchrun
        try:
            summary = pretrain.train(config_from_args(args))
        finally:
            distributed.cleanup()
        if not summary["main"]:  # a rank other than 0 under torchrun: rank 0 reports
            return summary
        if summary["val_loss"] is not None:
            print(f"done: step {summary['step']} | val {summary['val_loss']:.4f} | best val {summary['best_val']:.4f} | "
                  f"{summary['ms_per_step']:.1f} ms/step | checkpoint {summary['checkpoint']}")
    for i, text in enumerate(summary.get("samples", [])):
        print(f"---------- sample {i + 1} ----------\n{text}")
    if not args.sample:  # the last lines say where everything went
        print(files_line(args.output_dir, summary.get("checkpoint")))
    return summary


def files_line(output_dir, checkpoint: str | None) -> str:
    """The run's files: the best checkpoint (and how to sample from it), the metrics log and the curves."""
    from training.metrics import FILENAME

    out = Path(output_dir)
    parts = [f"checkpoint {checkpoint} (sample: python run_pretrain.py --sample --model {checkpoint})"] \
        if checkpoint else []
    parts += [f"{what} {out / name}" for what, name in (("metrics", FILENAME), ("curves", "curves.png"))
              if (out / name).is_file()]
    return "files: " + "; ".join(parts)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError, FloatingPointError) as e:  # bad input or a non-finite loss: one line, exit 1
        sys.exit(f"error: {e}")
