"""The README's two commands, timed as a user runs them (after the install): the main job and the tests.

    python bench/commands.py                    # both, one run each; records in bench/results/commands.jsonl
    python bench/commands.py --only main --repeats 2

main: `python run_pretrain.py --output_dir <a fresh temporary folder> --overwrite` (the bundled tiny shakespeare)
from the project root (the README's command; only the output folder differs, so a run never touches checkpoints/):
wall time from launch to exit, ms/step and the val loss from its last line, the peak RSS of the process. tests:
`ruff check . && python -m pytest -q`, wall time and the counts from pytest's last line. Both record the CPU seconds
of the command and the processes it waited for (a shared machine moves the wall time of the same work by 10%; the
CPU time says whether the work changed). Each row is recorded with the machine, commit, date and the load before the
command ran (bench/results.py); `python -m bench.report` puts the latest per CPU class into the README's timing table.
"""
from __future__ import annotations

import argparse
import os
import re
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

DONE = re.compile(r"^done: step (\d+) \| val ([\d.]+) \| best val ([\d.]+) \| ([\d.]+) ms/step")
PYTEST_COUNTS = re.compile(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed)")


def timed(cmd: list[str]) -> tuple[float, float, float, subprocess.CompletedProcess]:
    """Wall seconds, the child's peak RSS in MB (this run's only: each run is a fresh child of a fresh shell), the CPU
    seconds (user + system) of the command and every process it waited for, output. On a shared machine the wall time
    of the same work moves 10% between runs; its CPU time says whether the work itself changed."""
    start = time.perf_counter()
    wrapper = [sys.executable, "-c", "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
               "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
               "print('peak-rss-kb', u.ru_maxrss, 'cpu-s', u.ru_utime + u.ru_stime, file=sys.stderr); "
               "sys.exit(p.returncode)", *cmd]
    proc = subprocess.run(wrapper, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    usage = re.search(r"peak-rss-kb (\d+) cpu-s ([\d.]+)", proc.stderr)
    if usage is None:
        return seconds, float("nan"), float("nan"), proc
    return seconds, int(usage.group(1)) / 1024, float(usage.group(2)), proc


def main_job(rec: Recorder) -> None:
    data = data_dir() / "tinyshakespeare" / "input.txt"  # the default corpus of run_pretrain.py
    if not data.exists():
        raise SystemExit(f"the main job needs its corpus: {not_found('corpus file', data)}")
    with tempfile.TemporaryDirectory(prefix="bench-main-job-") as out:
        load = os.getloadavg()[0]
        seconds, peak_mb, cpu, proc = timed([sys.executable, "run_pretrain.py", "--output_dir",
                                             str(Path(out) / "shakespeare-char"), "--overwrite"])
    done = next((DONE.match(line) for line in proc.stdout.splitlines() if DONE.match(line)), None)
    if proc.returncode != 0 or done is None:
        raise SystemExit(f"the main job failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    steps, val, best, ms = int(done[1]), float(done[2]), float(done[3]), float(done[4])
    print(f"main job: {seconds:.1f} s wall ({cpu:.0f} s of CPU), {ms:.1f} ms/step over {steps} steps, peak RSS "
          f"{peak_mb:.0f} MB, val {val:.4f}, best {best:.4f} (load {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end)", flush=True)
    rec.add("main job", {"wall s": seconds, "cpu s": cpu, "ms/step": ms, "peak RSS MB": peak_mb, "val": val,
                         "best val": best},
            "s, ms, MB, loss", notes=f"load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end", load=load)


def tests(rec: Recorder) -> None:
    load = os.getloadavg()[0]
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    if lint.returncode != 0:
        raise SystemExit(f"ruff check . failed:\n{lint.stdout[-2000:]}")
    seconds, _, cpu, proc = timed([sys.executable, "-m", "pytest", "-q"])
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in PYTEST_COUNTS.findall(last)}
    print(f"tests: {seconds:.0f} s wall (ruff included; pytest's CPU {cpu:.0f} s), exit {proc.returncode}: {last}",
          flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"the test suite failed:\n{proc.stdout[-3000:]}")
    # the record's load is the one before the run: the suite's own workers and subprocesses raise it to 3-4 by its end
    rec.add("test suite", {"wall s": seconds, "cpu s": cpu, **{k: float(v) for k, v in counts.items()}}, "s, tests",
            notes=f"load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end", load=load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=("main", "tests"), default=["main", "tests"])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each command (each recorded)")
    args = parser.parse_args()
    print_machine_header()
    rec = Recorder("commands")
    try:
        for _ in range(args.repeats):
            for what in args.only:
                (main_job if what == "main" else tests)(rec)
    finally:
        rec.write()


if __name__ == "__main__":
    main()
