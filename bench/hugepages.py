"""Weights in 2 MiB pages against 4 KiB ones (modules/hugepages.py), on the machine at hand: one gpt2-size checkpoint
(random weights, seeded) loaded twice in one process, with GPT2_HUGE_PAGES=0 (torch's own allocations, its int8 /
int4 copies too) and as from_pretrained places it, then

- the weights' read speed: one row times each of the 72 block weights in turn (the decode step's products, the rows
  kernel, from Python), and one row times the LM head;
- greedy decoding, batch 1, a 16-token prompt + 64 new tokens, fp32 and each `quantize` form asked for;

each pair of contenders interleaved (the order swapped each round), the median of the rounds' paired ratios with
their min-max; the machine first.

    python bench/hugepages.py                       # 7 rounds, fp32 and int8
    python bench/hugepages.py --quantize none int8 int4 w8a8 --rounds 9
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.compare_engines import paired  # noqa: E402
from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from config import GPT2Config  # noqa: E402
from models.gpt2 import GPT2LMHeadModel  # noqa: E402
from modules import hugepages, rows  # noqa: E402


def block_weights(model) -> list[torch.Tensor]:
    found = []
    for layer in model.gpt.gpt_layers:
        attention = layer.self_attention
        found += [m.weight.detach() for m in (attention.query, attention.key, attention.value,
                                               layer.attention_dense, layer.interm_dense, layer.out_dense)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quantize", nargs="+", default=["none", "int8"],
                        help="decoding forms: none (fp32), int8, int4, w8a8, w4a8")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print_machine_header()
    if not hugepages.available():
        sys.exit(f"no transparent huge pages to ask for here (THP mode {hugepages.mode() or 'unknown'}, "
                 f"{hugepages.ENV}={os.environ.get(hugepages.ENV, 'unset')}): nothing to compare")
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)
        os.environ[hugepages.ENV] = "0"
        before = hugepages.huge_bytes()
        models = {"4k": GPT2LMHeadModel.from_pretrained(folder)}
        del os.environ[hugepages.ENV]
        models["2m"] = GPT2LMHeadModel.from_pretrained(folder)
    huge = (hugepages.huge_bytes() - before) / 2**20
    print(f"THP mode {hugepages.mode()}; this process's memory in huge pages after the loads: {huge:.0f} MiB "
          f"(the placed model's parameters: {sum(p.numel() * 4 for p in models['2m'].parameters()) / 2**20:.0f} MiB)")
    rec = Recorder("hugepages")
    common = dict(threads=torch.get_num_threads(), thp=hugepages.mode(), huge_mib=round(huge))
    torch.set_grad_enabled(False)

    if rows.available():
        lib = rows.library_for("fp32")
        for what, pick in (("72 block weights", block_weights), ("LM head", lambda m: [m.gpt.lm_head_weight.detach()])):
            calls = {}
            for name, model in models.items():
                weights = pick(model)
                products = [(rows.prepared(w, lib=lib), torch.randn(1, w.shape[1])) for w in weights]
                calls[name] = lambda products=products: [call(x) for call, x in products]
                size = sum(w.numel() * 4 for w in weights)
            times = rows.interleaved(calls, 3 * args.rounds)
            speed = {name: size / statistics.median(t) / 1e9 for name, t in times.items()}
            ratio, lo, hi = paired({"own": times["2m"], "env": times["4k"]})  # 4 KiB time / 2 MiB
            print(f"{what}, one row each (rows kernel): 4 KiB pages {speed['4k']:.1f} GB/s, 2 MiB {speed['2m']:.1f} "
                  f"GB/s: {ratio:.3f}x ({lo:.2f}-{hi:.2f})")
            rec.add(f"read {what}", speed, "GB/s of weights read", ratio=ratio,
                    ratio_of="2 MiB pages / 4 KiB pages (the median of the rounds' pairs)",
                    notes=f"pairs {lo:.3f}-{hi:.3f}; {3 * args.rounds} rounds", seconds=times, **common)

    ids = torch.arange(100, 116)[None]
    for form in args.quantize:
        quantize = None if form == "none" else form
        out = {}

        def decode(name, model):
            """One generate call; the 4 KiB model's with GPT2_HUGE_PAGES=0, so its int8 / int4 copies (made at its
            first call) stay in torch's allocations too."""
            if name == "4k":
                os.environ[hugepages.ENV] = "0"
            try:
                out[name] = model.generate(ids, max_new_tokens=64, do_sample=False, quantize=quantize)
            finally:
                os.environ.pop(hugepages.ENV, None)

        calls = {name: (lambda name=name, model=model: decode(name, model)) for name, model in models.items()}
        for call in calls.values():  # warm-up: the copies, the plan, the thread choice
            call()
        times = rows.interleaved(calls, args.rounds)
        rate = {name: 64 / statistics.median(t) for name, t in times.items()}
        ratio, lo, hi = paired({"own": times["2m"], "env": times["4k"]})  # 4 KiB time / 2 MiB
        same = torch.equal(out["4k"], out["2m"])
        print(f"decode b1 {form}: 4 KiB pages {rate['4k']:.1f} tok/s, 2 MiB {rate['2m']:.1f} tok/s: {ratio:.3f}x "
              f"({lo:.2f}-{hi:.2f}); the same tokens: {same}")
        rec.add(f"decode b1 {form}", rate, "new tokens/s", ratio=ratio,
                ratio_of="2 MiB pages / 4 KiB pages (the median of the rounds' pairs)",
                notes=f"pairs {lo:.3f}-{hi:.3f}; 16-token prompt + 64 new tokens; {args.rounds} rounds; "
                f"tokens {'identical' if same else 'DIFFER'}", seconds=times, **common)
    rec.write()
    print(f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
