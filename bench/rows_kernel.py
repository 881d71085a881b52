"""The few-rows decoding kernel (modules/rows.cpp) against torch's products, in GB/s of weights read: 1, 4 and 8 rows
times gpt2's two MLP shapes, fp32, bf16, int8 and int4 weights (int8 and int4 also times int8 activations: "rows a8",
quantize="w8a8" / "w4a8"'s integer products). Each round multiplies by 48 different weights (about the
size of gpt2's, so caches do not hold them), contenders interleaved, the median of the rounds; the machine first.

    python bench/rows_kernel.py                   # 2 threads (torch's default here), 7 rounds
    python bench/rows_kernel.py --threads 1 --repeats 9
    python bench/rows_kernel.py --dtypes int8 int4 --rows 1   # the integer products against weight-only
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from modules import rows  # noqa: E402
from modules.linear import blocked_linear, weight_first  # noqa: E402
from modules.quant import int8_linear, quantize_int4, quantize_int8, run_int8_activations  # noqa: E402

DTYPES = ("fp32", "bf16", "int8", "int4")
SHAPES = [(3072, 768), (768, 3072)]  # gpt2's MLP in and out projections (out, in)
WEIGHTS = 48


def contenders(dtype: str, batch: int) -> dict:
    if dtype in ("int8", "int4"):
        found = {"rows": lambda x, q: rows.rows_linear(x, q.q, None, q.scale),
                 "rows a8": lambda x, q: run_int8_activations(x, q)}  # q's int8_activations flag is not read
        if batch == 1 and dtype == "int8":  # the inductor loop the kernel replaced (compiled on its first call)
            found["inductor"] = lambda x, q: int8_linear(x, q, compiled=True)
        return found
    return {"F.linear": F.linear, "blocked": blocked_linear, "weight_first": weight_first,
            "rows": lambda x, w: rows.rows_linear(x, w)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--repeats", type=int, default=7, help="rounds; each times every contender, order rotating")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="weight kinds timed")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8], help="input rows (1-8)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_machine_header()
    if not rows.available():
        sys.exit("the rows kernel cannot be built on this machine (see modules/rows.py)")
    print(f"rows kernel vector width {rows.library().rows_vector_width()} floats; GB/s of weights read (median of "
          f"{args.repeats} rounds over {WEIGHTS} weights)")
    torch.set_grad_enabled(False)
    rec = Recorder("rows_kernel")
    for dtype in args.dtypes:
        for batch in args.rows:
            for out_f, in_f in SHAPES:
                g = torch.Generator().manual_seed(0)
                weights = [torch.randn(out_f, in_f, generator=g) for _ in range(WEIGHTS)]
                x = torch.randn(batch, in_f, generator=g)
                if dtype == "bf16":
                    weights, x = [w.bfloat16() for w in weights], x.bfloat16()
                if dtype in ("int8", "int4"):
                    weights = [(quantize_int8 if dtype == "int8" else quantize_int4)(w) for w in weights]
                nbytes = weights[0].nbytes if dtype in ("int8", "int4") else out_f * in_f * weights[0].element_size()
                fns = contenders(dtype, batch)
                for fn in fns.values():  # warm up (and compile) once
                    fn(x, weights[0])
                times = {name: [] for name in fns}
                names = list(fns)
                for r in range(args.repeats):
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        start = time.perf_counter()
                        for w in weights:
                            fns[name](x, w)
                        times[name].append(time.perf_counter() - start)
                rates = "  ".join(f"{name} {WEIGHTS * nbytes / statistics.median(t) / 1e9:5.1f}"
                                  for name, t in times.items())
                print(f"{dtype:<5} rows {batch}  {out_f:>4} x {in_f:<4}  {rates}", flush=True)
                gbs = {name: WEIGHTS * nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
                others = [v for k, v in gbs.items() if not k.startswith("rows")]
                if others:
                    ratio = dict(ratio=gbs["rows"] / max(others), ratio_of="the kernel / the best of torch's products")
                else:  # int4: torch has no product that reads it
                    ratio = dict(ratio=gbs["rows a8"] / gbs["rows"], ratio_of="int8 activations / weight-only")
                rec.add(f"{dtype} rows {batch} {out_f} x {in_f}", gbs, "GB/s of weights read", **ratio)
    rec.write()


if __name__ == "__main__":
    main()
