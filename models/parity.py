"""Compare our GPT-2 with transformers' on the same weights: every layer's hidden states, the logits, and greedy
generations, on a fixed batch with padding on either side. Exits non-zero past the tolerance it prints.

    python -m models.parity gpt2                      # official weights (hub or its local cache)
    python -m models.parity path/to/hf_folder         # any GPT-2 saved with save_pretrained
    python -m models.parity gpt2 --random-init        # no hub: a random-init gpt2-size reference, made and saved here

When MODEL is a preset name that cannot be had from the hub or its cache, the check falls back to --random-init
(with a notice) unless --no-fallback is given.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from config import PRESETS, GPT2Config
from models.gpt2 import GPT2LMHeadModel, position_ids_from_mask
from models.hub import expand, load_tokenizer, tokenizer_dir

SENTENCES = [
    "Shall I compare thee to a summer's day?",
    "The quick brown fox jumps over the lazy dog, and then it naps in the warm afternoon sun.",
    "Hello",
    "GPT-2 is a transformer language model trained on WebText.",
]


def make_random_reference(preset: str, directory: Path, seed: int = 0) -> Path:
    """Save a random-init transformers GPT-2 of a preset's size: the files official weights come in."""
    import transformers

    if (directory / "config.json").is_file() and (directory / "model.safetensors").is_file():
        return directory
    torch.manual_seed(seed)
    config = GPT2Config.from_preset(preset).to_hf()
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def pick_tokenizer(name: str | None, model: str):
    """The tokenizer asked for, else the model folder's own, else GPT-2's (the bundled copy first, to spare the
    hub's retries offline); None when none loads (the comparison then uses random ids)."""
    candidates = [name] if name else [model, str(tokenizer_dir()), "gpt2"]
    for candidate in candidates:
        folder = Path(expand(candidate))
        if not name and folder.is_dir() and not any((folder / f).is_file() for f in ("tokenizer.json", "vocab.json")):
            continue  # a weights-only folder: AutoTokenizer would build an empty tokenizer from it
        try:
            tokenizer = load_tokenizer(candidate)
        except Exception:
            continue
        if len(tokenizer) > 1:
            return tokenizer
    return None


def make_batch(tokenizer, vocab_size: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of different lengths, padded on `side`."""
    if tokenizer is not None and len(tokenizer) <= vocab_size:
        rows = [tokenizer(s)["input_ids"] for s in SENTENCES]
    else:  # a model with its own vocabulary: fixed pseudo-random ids
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (11, 20, 1, 14)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def capture_layers(layers) -> tuple[list[torch.Tensor], list]:
    outputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o[0] if isinstance(o, tuple) else o))
             for layer in layers]
    return outputs, hooks


@torch.no_grad()
def compare(ours, hf, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[str, float, float]]:
    """-> rows (name, max |ours - hf| over real tokens, that divided by max |hf|)."""
    ours_layers, h1 = capture_layers(ours.gpt.gpt_layers)
    hf_layers, h2 = capture_layers(hf.transformer.h)
    try:
        ours_out = ours(ids, mask)
        hf_out = hf(ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), output_hidden_states=True)
    finally:
        for h in h1 + h2:
            h.remove()
    real = mask.bool()
    pairs = [(f"layer {i:2d} output", a, b) for i, (a, b) in enumerate(zip(ours_layers, hf_layers))]
    pairs.append(("final hidden state", ours_out_hidden(ours, ids, mask), hf_out.hidden_states[-1]))
    pairs.append(("logits", ours_out["logits"], hf_out.logits))
    rows = []
    for name, a, b in pairs:
        diff = (a - b)[real].abs().max().item()
        rows.append((name, diff, diff / max(b[real].abs().max().item(), 1e-12)))
    return rows


def ours_out_hidden(ours, ids, mask):
    return ours.gpt(ids, mask)["last_hidden_state"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="gpt2", help="hub id (gpt2, gpt2-medium, ...) or a local HF folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the test prompts (default: the model's, "
                   "data/gpt2-tokenizer, then the hub's gpt2)")
    p.add_argument("--atol", type=float, default=1e-4, help="largest allowed |logit difference| (fp32)")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest allowed hidden-state difference relative to the largest |hidden value| of that layer")
    p.add_argument("--max-new-tokens", type=int, default=20, help="greedy tokens compared per prompt")
    p.add_argument("--random-init", action="store_true", help="compare on a random-init model of MODEL's preset size")
    p.add_argument("--no-fallback", action="store_true", help="fail instead of using --random-init when the hub is unreachable")
    p.add_argument("--random-dir", type=Path, default=Path("checkpoints"), help="where random-init references are saved")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    model = args.model
    preset = model.split("/")[-1]
    if args.random_init and preset not in PRESETS:
        p.error(f"--random-init needs a preset name ({', '.join(PRESETS)}), got {model!r}")
    t0 = time.perf_counter()
    compared = f"weights from {model}"  # said on the verdict line, so a random-init check is not taken for more
    try:
        if args.random_init:
            raise FileNotFoundError("random init requested")
        ours = GPT2LMHeadModel.from_pretrained(model)
    except FileNotFoundError as e:
        if preset not in PRESETS or (args.no_fallback and not args.random_init):
            print(f"error: {e}", file=sys.stderr)
            return 2
        compared = f"random-init {preset}, as --random-init asked"
        if not args.random_init:
            print(f"note: {e}\nnote: comparing on a random-init {preset} instead (same code path as official weights)")
            compared = f"random-init {preset}, the official weights could not be fetched"
        model = str(make_random_reference(preset, args.random_dir / f"random-{preset}"))
        ours = GPT2LMHeadModel.from_pretrained(model)
    hf = transformers.GPT2LMHeadModel.from_pretrained(model, attn_implementation="eager").eval()
    tokenizer = pick_tokenizer(args.tokenizer, model)
    cfg = ours.config
    print(f"model: {model}  ({cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd}, vocab {cfg.vocab_size}; "
          f"{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M parameters; loaded in {time.perf_counter() - t0:.1f}s)")
    print(f"reference: transformers {transformers.__version__} GPT2LMHeadModel (eager attention), torch {torch.__version__}")

    ok = True
    for side in ("left", "right"):
        ids, mask = make_batch(tokenizer, cfg.vocab_size, side)
        rows = compare(ours, hf, ids, mask)
        print(f"\n{side}-padded batch {tuple(ids.shape)}, lengths {mask.sum(1).tolist()}:")
        print(f"  {'tensor':<20} {'max |diff|':>12} {'relative':>10}")
        for name, diff, rel in rows:
            bad = diff > args.atol if name == "logits" else rel > args.rtol
            ok &= not bad
            print(f"  {name:<20} {diff:12.3e} {rel:10.2e}{'  FAIL' if bad else ''}")

    ids, mask = make_batch(tokenizer, cfg.vocab_size, "left")
    n = min(args.max_new_tokens, cfg.n_positions - ids.shape[1])
    ours_gen = ours.generate(ids, mask, max_new_tokens=n)
    hf_gen = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None, min_new_tokens=n)
    same = ours_gen.shape == hf_gen.shape and torch.equal(ours_gen, hf_gen)
    ok &= same
    print(f"\ngreedy generation, {n} new tokens x {ids.shape[0]} left-padded prompts: "
          f"{'identical' if same else 'DIFFERENT'}")
    if tokenizer is not None and len(tokenizer) <= cfg.vocab_size:
        print(f"  ours: {tokenizer.decode(ours_gen[0, ids.shape[1]:])!r}")
    print(f"\ntolerance: logits atol {args.atol:g}, hidden states rtol {args.rtol:g} -> {'PASS' if ok else 'FAIL'} "
          f"({compared})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
