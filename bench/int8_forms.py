"""Greedy batch-1 decoding of gpt2 (124M, random init) in fp32 and with quantize="int8" in both forms of the
compiled one-row loop (modules/quant.py): int8 bytes, and bytes read four to a float word (the form chosen on
AVX2-only CPUs). Interleaved rounds, medians; the machine first.

    python bench/int8_forms.py                      # 64 new tokens, 5 rounds
    python bench/int8_forms.py --new-tokens 128 --repeats 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench.compare_hf as compare  # noqa: E402
from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from modules import quant  # noqa: E402

MODES = ("fp32", "int8-bytes", "int8-packed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per generation (16-token prompt)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (each times every mode, order rotating)")
    args = parser.parse_args()
    print_machine_header()
    model = compare.build("ours", "gpt2", compare.hf_reference("gpt2", 0)).eval()
    ids, mask = compare.prompts(1, 0)
    chosen = quant.packed_form_chosen

    def run(mode: str):
        if mode == "fp32":
            return model.generate(ids, mask, max_new_tokens=args.new_tokens)
        quant.packed_form_chosen = lambda: mode == "int8-packed"
        try:
            return model.generate(ids, mask, max_new_tokens=args.new_tokens, quantize="int8")
        finally:
            quant.packed_form_chosen = chosen

    outs = {}
    for mode in MODES:  # first calls compile the loops (seconds per weight shape)
        start = time.perf_counter()
        outs[mode] = run(mode)[0, ids.shape[1]:]
        print(f"{mode:12s} first call {time.perf_counter() - start:.1f} s", flush=True)
    lead = lambda a, b: int((a == b).int().cumprod(0).sum())  # noqa: E731
    print(f"leading tokens equal: int8-bytes vs int8-packed {lead(outs['int8-bytes'], outs['int8-packed'])}, "
          f"fp32 vs int8-bytes {lead(outs['fp32'], outs['int8-bytes'])} (of {args.new_tokens})")
    rates = {mode: [] for mode in MODES}
    load = os.getloadavg()[0]
    for r in range(args.repeats):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            start = time.perf_counter()
            run(mode)
            rates[mode].append(args.new_tokens / (time.perf_counter() - start))
    print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f}; packed form chosen on this CPU: {chosen()}")
    for mode, v in rates.items():
        print(f"{mode:12s} {statistics.median(v):6.1f} tok/s (median; rounds {', '.join(f'{x:.1f}' for x in v)})")
    medians = {mode: statistics.median(v) for mode, v in rates.items()}
    rec = Recorder("int8_forms")
    rec.add("greedy b1, gpt2: fp32 and the two int8 loops", medians, "new tokens/s",
            ratio=max(medians["int8-bytes"], medians["int8-packed"]) / medians["fp32"],
            ratio_of="the faster int8 loop / fp32", notes=f"packed form chosen on this CPU: {chosen()}; leading tokens "
            f"equal fp32 vs int8-bytes {lead(outs['fp32'], outs['int8-bytes'])} of {args.new_tokens}")
    rec.write()


if __name__ == "__main__":
    main()
