"""fp32 products of many rows without gradients through oneDNN's inner product, where it timed faster than F.linear
on this machine.

torch's F.linear runs fp32 products on the CPU through MKL's sgemm. torch also ships oneDNN, whose fp32 inner product
(`torch.ops.mkldnn._linear_pointwise`, the op its inductor's CPU fusions call) took gpt2's 48 block weights
1.4-1.5x less time on a 2-core Zen 4 from 16 rows up (2026-12-01, interleaved medians, ms: 35 against 54 at 16 rows,
77 / 109 at 64, 143 / 224 at 128, 254 / 371 at 256, 503 / 741 at 512, 907 / 1354 at 1024; the rows kernel 26, 79,
163, 315, 648, 1330), the same values to float rounding. Which library is faster depends on the CPU (MKL's kernels
are tuned for Intel's cores), so it is not assumed: the first call that could take it here times both on products of
PROMPT_ROWS rows over two gpt2-shaped weights (3072 x 768 and 768 x 3072: bound by the arithmetic), twice (about a
second), and takes oneDNN only where it was MARGIN faster both times; the answer is kept beside the rows kernel's
builds (keyed by the CPU's flags, torch's version and the rows kernel's source), so later processes read it. A busy
machine (rows.machine_busy) is not timed: F.linear for that process.
Where oneDNN is taken, the rows kernel's product of many rows keeps only the short prompts it was timed faster for
than oneDNN (the decode plan raced it against F.linear): the same timing races the two at the plan's row counts, twice,
and keeps the largest count up to which the kernel won both (kernel_rows). On a Zen 4 (2026-12-02, GB/s of the
chain, two runs) the kernel read 15.3 / 10.5 oneDNN's at 16 rows, 8.7 / 7.8 at 32, 4.3-4.6 / 4.5-4.9 at 64, 2.2-2.5 /
2.7-2.9 at 128; gpt2 generate calls of a 40 to 128-token prompt and one new token were 1.07-1.29x faster with oneDNN
past 16 rows than with the kernel up to 128 (48 tokens 0.92x).

Taken by modules.linear.Linear and the LM head (GPT2Model.hidden_state_to_token: an evaluation's logits of gpt2's
50257 x 768 head at 8 x 128 rows 514 against 766 ms) for fp32 inputs of more than 8 rows (the rows kernel's own
products below; 9 to rows.prompt_rows() rows its product of many rows where that was timed faster) on the CPU with
no gradient to take, by weights of at least rows.PROMPT_MIN_WEIGHT values (a small model's products take
microseconds: the calls' own costs decide). So a prompt's pass and an evaluation's forward; never training, whose
backward needs autograd (the op has none). GPT2_ONEDNN_LINEAR=0 keeps F.linear, =1 takes oneDNN without timing;
`python -m modules.onednn` shows the choice and its timings.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.nn.functional as F

from modules import rows

ENV = "GPT2_ONEDNN_LINEAR"
PROMPT_ROWS = 256  # the rows of the products timed
_choice: dict | None = None  # {"takes": bool, "speeds": ..., "source": ...}, once per process


def available() -> bool:
    """Whether torch has oneDNN's fp32 inner product here (x86 builds do) and GPT2_ONEDNN_LINEAR is not 0."""
    return (os.environ.get(ENV) != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through oneDNN's inner product (fp32, no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


def time_products(megabytes: int = 16, rounds: int = 5, n: int = PROMPT_ROWS) -> dict[str, float]:
    """{"onednn": GB/s, "torch": GB/s} of fp32 products of n rows over gpt2-shaped weights (`megabytes` in all;
    rows.time_products)."""
    return rows.time_products({"onednn": linear, "torch": F.linear}, [n], megabytes, rounds)[str(n)]


def decide(first: dict[str, float], second: dict[str, float]) -> bool:
    """oneDNN where both timings read it at least rows.MARGIN times torch's speed."""
    return all(rows._faster(t, "torch") == "onednn" for t in (first, second))


def time_kernel_rows(counts: list[int], megabytes: int = 64, rounds: int = 5) -> dict[str, dict[str, float]]:
    """{row count (a string): {"kernel": GB/s, "onednn": GB/s}}: the rows kernel's product of many rows (the
    plan's prompt library) against linear() over gpt2-shaped weights (rows.time_prompt_rows)."""
    return rows.time_prompt_rows(rows.prompt_library(), counts, megabytes, rounds, against=("onednn", linear))


def kernel_limit(first: dict[str, dict[str, float]], second: dict[str, dict[str, float]]) -> int:
    """The largest timed row count up to which the kernel read at least rows.MARGIN times oneDNN's speed in both
    timings; rows.MAX_ROWS where it did not at the smallest."""
    timings = (first, second)
    return rows.choose_prompt_rows({n: "kernel" if all(rows._faster(t[n], "onednn") == "kernel" for t in timings)
                                    else "onednn" for n in first})


def _path():
    key = hashlib.sha256((rows.cpu_flags() + torch.__version__ + str(PROMPT_ROWS)).encode()
                         + rows.SOURCE.read_bytes()).hexdigest()[:16]
    return rows._cache_dir() / f"onednn-linear-{key}.json"


def choice() -> dict:
    """{"takes": bool, "source": why, "speeds": the timings}: GPT2_ONEDNN_LINEAR, else the cached timing, else a
    timing now (cached), else (a busy machine, oneDNN missing) F.linear."""
    global _choice
    setting = os.environ.get(ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 (F.linear), 1 (oneDNN) or unset (timed), got {setting!r}")
    if not available():
        return {"takes": False, "source": f"{ENV}=0" if setting == "0" else "torch has no oneDNN inner product here"}
    if setting == "1":
        return {"takes": True, "source": f"{ENV}=1"}
    if _choice is not None:
        return _choice
    path = _path()
    try:
        _choice = json.loads(path.read_text())
        return _choice
    except (OSError, ValueError):
        pass
    if busy := rows.machine_busy():  # timings now would be noise: F.linear for this process, timed by a later one
        _choice = {"takes": False, "source": f"not timed: the machine is busy ({busy})"}
        return _choice
    first = time_products()
    second = time_products()
    _choice = {"takes": decide(first, second), "speeds": [first, second], "source": f"timed, cached in {path}"}
    planned = rows.plan().get("prompt_rows", rows.MAX_ROWS) if rows.available() else rows.MAX_ROWS
    if _choice["takes"] and planned > rows.MAX_ROWS:  # the plan gave the kernel short prompts: where it beats oneDNN
        counts = [n for n in rows.PROMPT_ROWS_TIMED if n <= planned]
        kernel = [time_kernel_rows(counts), time_kernel_rows(counts)]
        _choice.update(kernel_rows=kernel_limit(*kernel), kernel_speeds=kernel)
    rows.write_timing(path, _choice)
    return _choice


def kernel_rows() -> int:
    """Up to how many rows a prompt's fp32 products without gradients take the rows kernel's product of many rows:
    rows.prompt_rows() (the plan, or GPT2_PROMPT_KERNEL), lowered where oneDNN is taken past the kernel to the rows
    the kernel timed faster than oneDNN (choice()'s kernel_rows; GPT2_PROMPT_KERNEL set: its count stands). Batched
    decode steps keep rows.prompt_rows(): the C++ step around the kernel's products (models/fast_step.py) ran gpt2's
    24-row greedy decode 1.47x faster than decode_step through oneDNN (3.11 against 4.57 s, Zen 4, 2026-12-02)."""
    limit = rows.prompt_rows()
    if limit <= rows.MAX_ROWS or os.environ.get(rows.PROMPT_ENV, "").strip():
        return limit
    chosen = choice()
    return min(limit, chosen.get("kernel_rows", limit)) if chosen["takes"] else limit


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether modules.linear.Linear takes linear() for x times weight (the module's docstring)."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and x.dim() >= 2 and x.shape[:-1].numel() > rows.MAX_ROWS
            and weight.numel() >= rows.PROMPT_MIN_WEIGHT
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling() and choice()["takes"])


if __name__ == "__main__":
    print(json.dumps(choice(), indent=1))
