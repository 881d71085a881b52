"""Parity with transformers as a recorded figure: runs `python -m models.parity` and records its worst differences.

    python bench/parity.py                       # gpt2 at random init (no hub needed); records bench/results/parity.jsonl
    python bench/parity.py --model gpt2-medium

The check itself is models/parity.py (left- and right-padded batches, every layer, the logits, greedy tokens); this
script keeps its verdict with the machine, commit and date, for the README's Results.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402

ROW = re.compile(r"^\s+(layer\s+\d+ output|final hidden state|logits)\s+([\d.e+-]+)\s+([\d.e+-]+)")
GREEDY = re.compile(r"^greedy generation, (\d+) new tokens x (\d+) left-padded prompts: (identical|DIFFERENT)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", help="a preset compared at random init (default gpt2)")
    args = parser.parse_args()
    print_machine_header()
    with tempfile.TemporaryDirectory(prefix="bench-parity-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "models.parity", args.model, "--random-init", "--random-dir", tmp],
                              cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout, end="")
    logits, hidden, greedy = 0.0, 0.0, None
    for line in proc.stdout.splitlines():
        if m := ROW.match(line):
            if m[1] == "logits":
                logits = max(logits, float(m[2]))
            else:
                hidden = max(hidden, float(m[3]))
        elif m := GREEDY.match(line):
            greedy = m
    if greedy is None or proc.returncode not in (0, 1):
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"models.parity failed (exit {proc.returncode})")
    rec = Recorder("parity")
    rec.add(f"{args.model} random init", {"logits max diff": logits, "hidden max relative": hidden}, "difference",
            target="logits within 1e-4; hidden states within 1e-4 relative", met=proc.returncode == 0,
            notes=f"{greedy[1]} greedy tokens of {greedy[2]} left-padded prompts "
                  f"{'identical' if greedy[3] == 'identical' else 'DIFFERENT'} to transformers'")
    rec.write()
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
