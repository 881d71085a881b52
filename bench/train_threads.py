"""The training steps' thread choice (training/engine.py's thread_choice) against fixed thread counts, as a user runs
it: the course's fine-tuning command on gpt2's size,

    python run_classifier.py --task sst --fine-tune-mode full-model --model random: --max_steps 40 [--threads N]

(gpt2 at random init, SST-5's training batches bundled in data/, the CLI's defaults otherwise), each contender a
process of its own: the default (no --threads: the choice) and every fixed count it chooses among (the cores, their
halves, 1), in interleaved rounds, quiet or with --busy processes spinning beside every run. Each run's figure is the
real tokens a second of its --max_steps steps (the CLI's benchmark line: the first step, and the choice's trials,
included). Prints and records the medians, min-max over rounds, and the choice's ratio to the best fixed count
(target >= 0.97x, quiet and busy: the trials of a slower count are the only price).

    python bench/train_threads.py                      # quiet: fp32, and bf16-weights where bf16 products are fast
    python bench/train_threads.py --busy 1             # one process spinning on a core beside each run
    python bench/train_threads.py --dtypes fp32 --rounds 5 --max_steps 60
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import busy_suffix, print_machine_header, spin, stop  # noqa: E402
from bench.results import Recorder  # noqa: E402

TARGET = 0.97  # the choice's speed against the best fixed count's
LINE = re.compile(r"^benchmark: (\d+) optimizer steps .* in ([\d.]+) s: (\d+) tok/s, ([\d.]+) s/step")
DTYPES = {"fp32": "float32", "bf16": "bf16-weights"}


def command(dtype: str, threads: int | None, max_steps: int, out: str) -> list[str]:
    cmd = [sys.executable, str(ROOT / "run_classifier.py"), "--task", "sst", "--fine-tune-mode", "full-model",
           "--model", "random:", "--max_steps", str(max_steps), "--dtype", DTYPES[dtype], "--output_dir", out,
           "--overwrite"]
    return cmd + (["--threads", str(threads)] if threads else [])


def run_one(dtype: str, threads: int | None, max_steps: int) -> float:
    """One process: its real tokens a second over the steps (the CLI's benchmark line)."""
    with tempfile.TemporaryDirectory(prefix="train-threads-") as out:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("GPT2_TRAIN_THREADS", None)  # the default is the choice; a fixed count is --threads
        proc = subprocess.run(command(dtype, threads, max_steps, out), cwd=ROOT, env=env, capture_output=True,
                              text=True)
    found = [LINE.match(line) for line in proc.stdout.splitlines() if LINE.match(line)]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"run_classifier.py failed (exit {proc.returncode}, threads {threads}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return float(found[-1][3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=None,
                        help="default: fp32, and bf16 where the CPU has bf16 products (AVX512-BF16 or AMX)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every contender once, in turn")
    parser.add_argument("--max_steps", type=int, default=40, help="optimizer steps of each run")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on a core beside the runs")
    args = parser.parse_args()
    import torch

    from models.decode_threads import candidates
    from training.precision import bf16_matmul_is_fast

    print_machine_header()  # (after torch: with the paths this machine takes)

    dtypes = args.dtypes or (["fp32", "bf16"] if bf16_matmul_is_fast(torch.device("cpu")) else ["fp32"])
    fixed = candidates(torch.get_num_threads())  # the counts the choice picks among: the cores, their halves, 1
    names = ["choice"] + [f"fixed {n}" for n in fixed]
    rec = Recorder("train_threads")
    spinners = spin(args.busy) if args.busy else []
    if spinners:
        print(f"{args.busy} busy process{'es' if args.busy > 1 else ''} spinning beside the runs", flush=True)
    try:
        for dtype in dtypes:
            rates: dict[str, list[float]] = {name: [] for name in names}
            load = os.getloadavg()[0]
            for r in range(args.rounds):
                order = names if r % 2 == 0 else names[::-1]  # interleaved, alternating which goes first
                for name in order:
                    threads = None if name == "choice" else int(name.split()[1])
                    rates[name].append(run_one(dtype, threads, args.max_steps))
                    print(f"  round {r + 1} {dtype} {name}: {rates[name][-1]:.0f} tok/s", flush=True)
            medians = {name: statistics.median(v) for name, v in rates.items()}
            best_name = max((n for n in names if n != "choice"), key=medians.get)
            ratio = medians["choice"] / medians[best_name]
            spans = "; ".join(f"{n} {min(v):.0f}-{max(v):.0f}" for n, v in rates.items())
            met = ratio >= TARGET
            row = f"fine-tune sst gpt2 {dtype}{busy_suffix(args.busy)}"
            print(f"{row}: " + ", ".join(f"{n} {medians[n]:.0f}" for n in names) + f" tok/s (median of "
                  f"{args.rounds}); choice / {best_name} {ratio:.2f}x (target >= {TARGET}x: "
                  f"{'met' if met else 'NOT met'}); min-max {spans}", flush=True)
            rec.add(row, medians, "tokens/s", ratio=ratio, ratio_of=f"choice / {best_name}",
                    target=f">= {TARGET}x the best fixed count", met=met,
                    notes=f"median of {args.rounds} rounds, {args.max_steps} steps a run; min-max {spans}",
                    load=load, **({"busy": args.busy} if args.busy else {}))
    finally:
        stop(spinners)
        rec.write()


if __name__ == "__main__":
    main()
