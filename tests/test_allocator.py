"""training/allocator.py: keep_freed_memory() makes glibc's malloc keep a freed big tensor's pages (the process's RSS
stays up after the tensor is freed) where by default they go back to the system; GPT2_KEEP_FREED_MEMORY=0 leaves
malloc alone; fit() applies it when it trains on the CPU. The malloc settings are per process: each case runs in a
fresh interpreter."""
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                                reason="keep_freed_memory tunes glibc's malloc (Linux with glibc only)")

FREE_A_BIG_TENSOR = """
import sys
import torch
from training.allocator import keep_freed_memory, in_effect

def rss_mb():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024

applied = keep_freed_memory() if sys.argv[1] == 'keep' else False
assert in_effect() == applied
torch.ones(4096).sum()  # torch's first operation loads what it needs (a CUDA build of torch: about 6 MB more)
before = rss_mb()
big = torch.ones(64 * 2**20 // 4)  # 64 MB, every page touched
held = rss_mb()
del big
print(applied, held - before, rss_mb() - before)
"""


def run(*args: str, env: dict | None = None) -> list[str]:
    import os

    done = subprocess.run([sys.executable, "-c", FREE_A_BIG_TENSOR, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_freed_big_tensor_keeps_its_pages_only_when_kept():
    applied, held, after = run("default")
    assert applied == "False" and int(held) >= 60 and int(after) < 8  # glibc unmaps it at once
    applied, held, after = run("keep")
    assert applied == "True" and int(held) >= 60 and int(after) >= 60  # kept for the next tensor


def test_the_environment_variable_turns_it_off():
    applied, _, after = run("keep", env={"GPT2_KEEP_FREED_MEMORY": "0"})
    assert applied == "False" and int(after) < 8


def test_fit_keeps_freed_memory_when_it_trains_on_the_cpu(tmp_path, monkeypatch):
    from test_engine_parts import lm_batches, lm_loss, run_cfg, tiny_lm, token_rows

    from training import engine

    calls = []
    monkeypatch.setattr(engine, "keep_freed_memory", lambda: calls.append(1) or True)
    engine.fit(tiny_lm(), lm_batches(token_rows(2), 2), lm_loss, lambda m: {"acc": 0.0}, run_cfg(tmp_path), {})
    assert calls == [1]
