"""What each quantized form costs in quality: validation perplexity of a trained model with fp32 weights, with int8
weights (every linear layer and the LM head, per-row scales), with int4 weights (groups of 32 inputs), and with each
of them and the activations quantized to int8 (w8a8, w4a8: each input row in blocks of 32, as their integer products
see it; and every block run as a w8a8 / w4a8 prompt is, activations per tensor in 7 bits), and how many greedy
continuations keep their first tokens.

    # a small BPE model pretrained on tiny shakespeare, then its int8 and int4 quality
    python run_pretrain.py --tokenizer data/gpt2-tokenizer \
        --n_layer 2 --n_head 4 --n_embd 128 --n_positions 128 --block_size 64 --output_dir out/bpe-tiny
    python bench/int8_quality.py --model out/bpe-tiny/best --prompts 20 --new-tokens 32
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from models.gpt2 import GPT2LMHeadModel  # noqa: E402
from models.hub import data_dir, tokenizer_dir  # noqa: E402
from modules.linear import Linear  # noqa: E402
from modules.quant import quantize, quantize_activations, quantized_linear  # noqa: E402

MODES = ("int8", "int4", "w8a8", "w4a8")


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, block: int, mode: str | None = None) -> float:
    """exp(mean next-token loss) over consecutive blocks of `ids`; a mode: every linear layer and the LM head from
    their quantized weights (dequantized: the values the one-row kernel multiplies by), the embedding lookup as is;
    w8a8 / w4a8: each linear layer's input rows quantized too (quantize_activations: the values the integer products
    multiply), and the head's (quantized_linear does it for its weight)."""
    if mode:
        model = copy.deepcopy(model)
        for m in model.modules():
            if type(m) is Linear:
                m.weight.copy_(quantize(m.weight, mode).dequantize(m.weight.dtype))
                if mode.endswith("a8"):
                    m.register_forward_pre_hook(lambda mod, inp: (quantize_activations(inp[0]),))
    body, total, count = model.gpt, 0.0, 0
    head = quantize(body.lm_head_weight, mode) if mode else None
    for start in range(0, ids.numel() - block - 1, block):
        x = ids[start: start + block + 1][None]
        if mode:
            hidden = body(x[:, :-1])["last_hidden_state"]
            logits = body.logit_softcap(quantized_linear(hidden, head))  # several rows: the dequantized head
        else:
            logits = model(x[:, :-1])["logits"]
        total += F.cross_entropy(logits[0].float(), x[0, 1:], reduction="sum").item()
        count += block
    return math.exp(total / count)


@torch.no_grad()
def prompt_perplexity(model, ids: torch.Tensor, block: int, mode: str) -> float:
    """perplexity() with every block run as a w8a8 / w4a8 prompt is: the model's own forward within
    quantized_weights, so each linear layer takes the prompt's int8 GEMM (activations per tensor, 7 bits:
    modules/quant.py, prompt_product) where it runs here; the LM head in fp32 (a prompt's only head product is its
    last position's, which takes the decode head)."""
    from modules.linear import quantized_weights

    with quantized_weights(model, mode):
        return perplexity(model, ids, block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint folder (HF format) or a hub id")
    parser.add_argument("--data", default=str(data_dir() / "tinyshakespeare" / "input.txt"),
                        help="text whose last --val-fraction is the validation split")
    parser.add_argument("--tokenizer", default=str(tokenizer_dir()), help="tokenizer folder")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="tail of the text used for validation")
    parser.add_argument("--prompts", type=int, default=20, help="greedy continuations compared")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    args = parser.parse_args()
    print_machine_header()

    model = GPT2LMHeadModel.from_pretrained(args.model).eval()
    text = Path(args.data).read_text()
    tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    ids = torch.tensor(tok(text[int(len(text) * (1 - args.val_fraction)):])["input_ids"])
    block = min(model.config.n_positions, 256)
    print(f"model {args.model}: {model.num_parameters() / 1e6:.2f}M parameters; validation {ids.numel()} tokens; "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}; load {os.getloadavg()[0]:.1f}", flush=True)
    ppl = {"fp32": perplexity(model, ids, block)}
    for mode in MODES:
        ppl[mode] = perplexity(model, ids, block, mode)
    for mode in ("w8a8", "w4a8"):
        ppl[f"{mode} prompt"] = prompt_perplexity(model, ids, block, mode)
    print(f"perplexity fp32 {ppl['fp32']:.3f}" + "".join(
        f"  {mode} {ppl[mode]:.3f} ({100 * (ppl[mode] / ppl['fp32'] - 1):+.2f}%)" for mode in MODES)
        + " (int8 target: within 1%)", flush=True)
    from modules.quant import prompt_products_why_not

    prompt_path = prompt_products_why_not() or "oneDNN's int8 GEMM"
    print("as prompts (" + prompt_path + "):" + "".join(
        f"  {mode} {ppl[mode]:.3f} ({100 * (ppl[mode] / ppl['fp32'] - 1):+.2f}%)"
        for mode in ("w8a8 prompt", "w4a8 prompt")), flush=True)

    step = max(1, (ids.numel() - args.prompt_tokens) // args.prompts)
    prompts = [ids[i * step: i * step + args.prompt_tokens][None] for i in range(args.prompts)]
    fp32 = [model.generate(p, max_new_tokens=args.new_tokens)[0, args.prompt_tokens:] for p in prompts]
    same = {}
    for mode in MODES:
        same[mode], first_diff = 0, []
        for prompt, a in zip(prompts, fp32):
            b = model.generate(prompt, max_new_tokens=args.new_tokens, quantize=mode)[0, args.prompt_tokens:]
            same[mode] += bool(torch.equal(a, b))
            diff = (a != b).nonzero()
            first_diff.append(int(diff[0]) if diff.numel() else args.new_tokens)
        print(f"greedy {mode}: first {args.new_tokens} tokens identical to fp32's on {same[mode]} of {args.prompts} "
              f"prompts; tokens before the first difference: {first_diff}", flush=True)
    rec = Recorder("int8_quality")
    name = f"{Path(args.model).name} ({model.num_parameters() / 1e6:.1f}M)"
    greedy = {mode: f"greedy: first {args.new_tokens} tokens identical on {same[mode]} of {args.prompts} prompts"
              for mode in MODES}
    rec.add(f"perplexity, {name}", {"fp32": ppl["fp32"], "int8": ppl["int8"]}, "perplexity",
            ratio=ppl["int8"] / ppl["fp32"], ratio_of="int8 / fp32", target="within 1%",
            met=abs(ppl["int8"] / ppl["fp32"] - 1) <= 0.01,
            notes=f"{ids.numel()} validation tokens; {greedy['int8']}")
    rec.add(f"perplexity int4, {name}", {"fp32": ppl["fp32"], "int4": ppl["int4"]}, "perplexity",
            ratio=ppl["int4"] / ppl["fp32"], ratio_of="int4 / fp32",
            notes=f"{ids.numel()} validation tokens; groups of 32; {greedy['int4']}")
    for mode, weights in (("w8a8", "int8"), ("w4a8", "int4")):
        rec.add(f"perplexity {mode}, {name}", {"fp32": ppl["fp32"], weights: ppl[weights], mode: ppl[mode]},
                "perplexity", ratio=ppl[mode] / ppl["fp32"], ratio_of=f"{mode} / fp32",
                notes=f"{ids.numel()} validation tokens; activations int8 in blocks of 32; {greedy[mode]}; "
                      f"{mode} / {weights} (the same weights) {ppl[mode] / ppl[weights]:.4f}")
        prompt = f"{mode} prompt"
        rec.add(f"perplexity {prompt}, {name}", {"fp32": ppl["fp32"], prompt: ppl[prompt]}, "perplexity",
                ratio=ppl[prompt] / ppl["fp32"], ratio_of=f"{prompt} / fp32",
                notes=f"{ids.numel()} validation tokens, every block of {block} run as a {mode} prompt: {prompt_path} "
                      f"(activations per tensor in 7 bits; the LM head fp32)")
    rec.write()


if __name__ == "__main__":
    main()
