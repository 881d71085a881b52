"""End-to-end wall time of run_pretrain.py on tiny shakespeare with nanoGPT's documented CPU configuration.

nanoGPT: `python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
--log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0` reaches val loss 1.886 in about 93 s on this machine class (2 CPU cores).
run_pretrain.py's defaults are that configuration (char tokens, lr 1e-3 -> 1e-4, warmup 100, beta2 0.99, weight
decay 0.1, clip 1.0, eval every 250 steps over 20 batches per split).

Each repeat starts a fresh process (interpreter, imports, corpus encoding into an empty folder, training) and
times it from launch to the line with the final val loss (the estimate at step 2000, as nanoGPT reports it).
Afterwards, untimed, the final checkpoint's loss over the whole val split is computed as a more precise figure.
The machine is shared: the load average is printed before each run; report the best and the median.

    python bench/pretrain_shakespeare.py                          # 3 runs
    python bench/pretrain_shakespeare.py --repeats 5 -- --threads 1 --activation gelu
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from models.hub import data_dir, not_found  # noqa: E402

NANOGPT = {"val_loss": 1.886, "seconds": 93.0}
FINAL_EVAL = re.compile(r"^step +(\d+) \| train ([\d.]+) \| val ([\d.]+)")


def run_once(data: Path, extra: list[str], max_iters: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pretrain-bench-") as out:
        cmd = [sys.executable, str(ROOT / "run_pretrain.py"), "--data", str(data), "--output_dir", out,
               "--max_iters", str(max_iters), *extra]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        lines, to_val, val = [], None, None
        for line in proc.stdout:
            lines.append(line)
            m = FINAL_EVAL.match(line)
            if m and int(m.group(1)) == max_iters:
                to_val, val = time.perf_counter() - start, float(m.group(3))
        if proc.wait() != 0 or to_val is None:
            sys.stdout.write("".join(lines))
            raise SystemExit(f"run failed (exit {proc.returncode}): {' '.join(cmd)}")
        total = time.perf_counter() - start
        output = "".join(lines)
        ms = float(re.search(r"\| ([\d.]+) ms/step \| checkpoint", output).group(1))
        precise = precise_val_loss(Path(out), data)
        sample = output.split("---------- sample 1 ----------\n", 1)[-1] if "sample 1" in output else ""
    return dict(load=load, to_val=to_val, total=total, val=val, precise=precise, ms=ms, sample=sample, log=output)


def precise_val_loss(out_dir: Path, data: Path) -> float:
    """Loss of the last checkpoint over every token of the val split (untimed), computed in fp32 (a bf16 checkpoint
    too: bench/bf16_curve.py)."""
    from models.gpt2 import GPT2LMHeadModel
    from tasks import pretrain

    folder = out_dir / "last"  # the final weights
    tokenizer = pretrain.tokenizer_for(folder)
    corpus = pretrain.prepare_corpus(data, tokenizer, out_dir / "data")
    model = GPT2LMHeadModel.from_pretrained(folder).float()
    return pretrain.full_loss(model, corpus.val, model.config.n_positions)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("benchmark")
    g.add_argument("--data", default=str(data_dir() / "tinyshakespeare" / "input.txt"), help="corpus")
    g.add_argument("--repeats", type=int, default=3, help="fresh-process runs")
    g.add_argument("--max_iters", type=int, default=2000, help="training steps (nanoGPT's figure is for 2000)")
    g.add_argument("--show_log", action="store_true", help="print each run's full training log")
    g.add_argument("extra", nargs="*", help="after --: more run_pretrain.py flags, e.g. -- --threads 1")
    args = p.parse_args()
    print_machine_header()
    data = Path(args.data)
    if not data.is_file():
        raise SystemExit(not_found("corpus", data))

    runs = []
    for i in range(args.repeats):
        r = run_once(data, args.extra, args.max_iters)
        runs.append(r)
        if args.show_log:
            print(r["log"])
        print(f"run {i + 1}: load {r['load']:.2f} | {r['to_val']:.1f} s to final val loss ({r['total']:.1f} s with "
              f"sampling and exit) | val {r['val']:.4f} (estimate, 20 batches) | val {r['precise']:.4f} (whole "
              f"val split) | {r['ms']:.1f} ms/step", flush=True)
    times = [r["to_val"] for r in runs]
    best = min(runs, key=lambda r: r["to_val"])
    print(f"\nflags: {' '.join(args.extra) or '(defaults)'}")
    print(f"wall to final val loss: best {min(times):.1f} s, median {statistics.median(times):.1f} s over "
          f"{len(runs)} runs; {min(times) / NANOGPT['seconds']:.2f}x nanoGPT's {NANOGPT['seconds']:.0f} s")
    print(f"val loss at step {args.max_iters}: " + ", ".join(f"{r['val']:.4f}" for r in runs)
          + f" (nanoGPT {NANOGPT['val_loss']}); whole val split: " + ", ".join(f"{r['precise']:.4f}" for r in runs))
    print(f"sample from the fastest run:\n{best['sample']}")
    rec = Recorder("pretrain_shakespeare")
    rec.add("wall to final val loss, nanoGPT's CPU configuration" + (f" ({' '.join(args.extra)})" if args.extra else ""),
            {"ours s (median)": statistics.median(times), "ours s (best)": min(times), "nanoGPT s": NANOGPT["seconds"],
             "val (whole split)": statistics.median(r["precise"] for r in runs), "nanoGPT val": NANOGPT["val_loss"]},
            "s, loss", ratio=min(times) / NANOGPT["seconds"], ratio_of="ours' best time / nanoGPT's documented time",
            notes=f"{len(runs)} runs, {args.max_iters} steps; val estimates " + ", ".join(f"{r['val']:.4f}" for r in runs))
    rec.write()


if __name__ == "__main__":
    main()
