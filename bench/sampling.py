"""Sampling's work per token on gpt2's vocabulary (50,257): the logit filters and the draw, ours against torch's plain
path and transformers' warpers, then sampled generation with each, on the machine at hand.

1. One row of logits, temperature 1.2 and top-p 0.9 (the course's sonnet settings), the token drawn from a seeded
   generator: ours (top_p_filter from the largest probabilities, modules/draw.py's draw), torch's plain path
   (top_p_filter(fast_sort=False): torch.sort, then torch.multinomial) and transformers' TemperatureLogitsWarper +
   TopPLogitsWarper + torch.multinomial (what its generate does per token). Rows of random logits at several spreads,
   so the nucleus runs from a few tokens to thousands (its median size reported).
2. generate(do_sample=True, temperature=1.2, top_p=0.9), batch 1, a 16-token prompt + 64 new tokens, a gpt2-size model
   at random init with its final LayerNorm scaled by each --sharpen (random weights give nearly flat distributions:
   x4 leaves a nucleus of ~14k tokens, x8 ~130; the sizes are reported), ours against the same call with torch's
   plain sampling; the tokens must be equal.

Contenders interleaved (the order reversed every other round), medians and the paired ratios' min-max, the machine
first; records to bench/results/sampling.jsonl.

    python bench/sampling.py                 # 15 rounds of the per-token work, 7 of generation
    python bench/sampling.py --rounds 31 --generate-rounds 9 --sharpen 6 12
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper  # noqa: E402

from bench.compare_engines import paired  # noqa: E402
from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from config import GPT2Config  # noqa: E402
from models import generation  # noqa: E402
from models.gpt2 import GPT2LMHeadModel  # noqa: E402
from modules import draw  # noqa: E402
from modules.rows import interleaved  # noqa: E402

TEMPERATURE, TOP_P = 1.2, 0.9


def ours(logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    probs = F.softmax(generation.process_logits(logits, None, TEMPERATURE, None, TOP_P), dim=-1)
    return draw.multinomial(probs, g)


def torch_plain(logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    filtered = generation.top_p_filter(logits / TEMPERATURE, TOP_P, fast_sort=False)
    return torch.multinomial(F.softmax(filtered, dim=-1), 1, generator=g).squeeze(1)


WARPERS = (TemperatureLogitsWarper(TEMPERATURE), TopPLogitsWarper(TOP_P))


def transformers_warpers(logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    for warp in WARPERS:
        logits = warp(None, logits)
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g).squeeze(1)


class PlainSampling:
    """generate's sampling as torch's plain path: top-p through torch.sort, the draw by torch.multinomial."""

    def __enter__(self):
        self.saved = generation.top_p_filter, draw._library
        real = generation.top_p_filter
        generation.top_p_filter = lambda logits, p, fast_sort=True: real(logits, p, fast_sort=False)
        draw._library = False
        return self

    def __exit__(self, *exc):
        generation.top_p_filter, draw._library = self.saved


def generate_pair(model, sharpen: float, rounds: int, rec: Recorder, common: dict) -> None:
    """Sampled generation, batch 1, 16 + 64 tokens: ours against the same call with torch's plain sampling."""
    ids = torch.arange(100, 116)[None]
    sizes = []
    real_filter = generation.top_p_filter

    def counting(logits, p, fast_sort=True):
        out = real_filter(logits, p, fast_sort)
        sizes.append(int(out.isfinite().sum()))
        return out

    generation.top_p_filter = counting
    model.generate(ids, max_new_tokens=64, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P,
                   generator=torch.Generator().manual_seed(0))
    generation.top_p_filter = real_filter
    nucleus = statistics.median(sizes)
    out = {}

    def decode(name):
        with PlainSampling() if name == "torch" else contextlib.nullcontext():
            out[name] = model.generate(ids, max_new_tokens=64, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P,
                                       generator=torch.Generator().manual_seed(0))

    calls = {name: (lambda name=name: decode(name)) for name in ("ours", "torch")}
    for call in calls.values():  # warm-up: the plan, the thread choice
        call()
    times = interleaved(calls, rounds)
    rate = {name: 64 / statistics.median(t) for name, t in times.items()}
    ratio, lo, hi = paired({"own": times["ours"], "env": times["torch"]})
    same = torch.equal(out["ours"], out["torch"])
    print(f"generate, sampled, batch 1, 16 + 64 tokens (final LayerNorm x{sharpen:g}: nucleus median {nucleus:.0f}, "
          f"{min(sizes)}-{max(sizes)}): ours {rate['ours']:.1f} tok/s, with torch's sampling {rate['torch']:.1f}: "
          f"{ratio:.3f}x ({lo:.2f}-{hi:.2f}); the same tokens: {same}")
    rec.add(f"generate sampled b1, gpt2 size, nucleus {nucleus:.0f}", rate, "new tokens/s", ratio=ratio,
            ratio_of="ours / the same call with torch's plain sampling (the median of the rounds' pairs)",
            notes=f"pairs {lo:.3f}-{hi:.3f}; 16-token prompt + 64 new tokens; random weights, final LayerNorm "
                  f"x{sharpen:g}: nucleus median {nucleus:.0f} ({min(sizes)}-{max(sizes)}); {rounds} rounds; "
                  f"tokens {'identical' if same else 'DIFFER'}",
            seconds=times, nucleus=nucleus, **common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the per-token work (each 20 tokens)")
    parser.add_argument("--generate-rounds", type=int, default=7)
    parser.add_argument("--sharpen", type=float, nargs="+", default=[4.0, 8.0],
                        help="the final LayerNorm's scales in part 2 (4: a nucleus of ~14k tokens, 8: ~130)")
    parser.add_argument("--spreads", type=float, nargs="+", default=[2.0, 4.0, 8.0],
                        help="standard deviations of part 1's random logits")
    args = parser.parse_args()
    print_machine_header()
    print(f"the draw kernel: {'built' if draw.available() else 'not available (torch.multinomial)'}")
    rec = Recorder("sampling")
    common = dict(threads=torch.get_num_threads(), temperature=TEMPERATURE, top_p=TOP_P)
    contenders = {"ours": ours, "torch": torch_plain, "transformers": transformers_warpers}

    for spread in args.spreads:
        rows = torch.randn(20, 1, 50257, generator=torch.Generator().manual_seed(int(spread * 10))) * spread
        nucleus = statistics.median(int(generation.top_p_filter(r / TEMPERATURE, TOP_P).isfinite().sum())
                                    for r in rows)
        drawn = {}

        def call(name):
            g = torch.Generator().manual_seed(1)
            drawn[name] = [int(contenders[name](r, g)) for r in rows]

        times = interleaved({name: (lambda name=name: call(name)) for name in contenders}, args.rounds)
        ms = {name: 1e3 * statistics.median(t) / len(rows) for name, t in times.items()}
        vs_torch = paired({"own": times["ours"], "env": times["torch"]})
        vs_hf = paired({"own": times["ours"], "env": times["transformers"]})
        same = drawn["ours"] == drawn["torch"] == drawn["transformers"]
        print(f"logits spread {spread:g} (nucleus median {nucleus:.0f} tokens): ours {ms['ours']:.3f} ms a token, "
              f"torch {ms['torch']:.3f}, transformers {ms['transformers']:.3f}: {vs_torch[0]:.2f}x torch's "
              f"({vs_torch[1]:.2f}-{vs_torch[2]:.2f}), {vs_hf[0]:.2f}x transformers'; the same tokens: {same}")
        rec.add(f"sampling work per token, gpt2 vocabulary, nucleus {nucleus:.0f}", ms, "ms a token (median)",
                ratio=vs_torch[0], ratio_of="torch's plain path time / ours (the median of the rounds' pairs)",
                notes=f"pairs {vs_torch[1]:.2f}-{vs_torch[2]:.2f}; transformers' warpers / ours {vs_hf[0]:.2f}x "
                      f"({vs_hf[1]:.2f}-{vs_hf[2]:.2f}); logits N(0, {spread:g}^2), 20 rows a round, {args.rounds} "
                      f"rounds; tokens {'identical' if same else 'DIFFER'}",
                seconds=times, nucleus=nucleus, **common)

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
        model = GPT2LMHeadModel.from_pretrained(folder).eval()
    norm = model.gpt.final_layer_norm
    weight, bias = norm.weight.detach().clone(), norm.bias.detach().clone()
    for sharpen in args.sharpen:
        with torch.no_grad():
            norm.weight.copy_(weight * sharpen)
            norm.bias.copy_(bias * sharpen)
        generate_pair(model, sharpen, args.generate_rounds, rec, common)
    rec.write()
    print(f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
