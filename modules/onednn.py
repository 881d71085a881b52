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
microseconds: the calls' own costs decide). So a prompt's pass and an evaluation's forward (the op has no autograd:
training's products are TrainingLinear's, below). GPT2_ONEDNN_LINEAR=0 keeps F.linear, =1 takes oneDNN without
timing; `python -m modules.onednn` shows both choices and their timings.

fp32 training takes the same library for its three products a layer (TrainingLinear: the forward, the input's
gradient g W and the weight's g^T x, oneDNN reading the transposed operands as strided views), where a timing of those
products found it faster, by its own choice (training_choice: GPT2_ONEDNN_TRAINING, a separate timing and cache, as
the backward's shapes are not the forward's). On a 2-core AMD EPYC Zen 5 (2026-12-04, 512 rows, medians, ms, MKL
against oneDNN): 768 -> 3072 forward 11.8 / 5.2, input gradient 11.4 / 6.0, weight gradient 11.6 / 6.1; gpt2's
50257 x 768 LM head 213 / 89, 194 / 121, 198 / 108: MKL's sgemm ran at 205-213 GFLOP/s there, oneDNN at 400-476.
MKL ran at the same rate held to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2: its AVX2 code on AMD's cores), and oneDNN held
to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) read 157-167 GFLOP/s against MKL's 176-190 in time_training: on an AVX2 CPU the
timing keeps F.linear.
Taken by modules/transposed.py's linear and head (the fallbacks of every Linear layer, the LM head and LoRA's frozen
base product) and the fused q/k/v product for fp32 inputs of more than 8 rows and weights of rows.PROMPT_MIN_WEIGHT+
values, in grad mode with a gradient to take, outside autocast, torch.compile and torch.func. Each product is
F.linear's to float rounding (oneDNN blocks the sums differently: in the tests within 1e-4 of values of about 30).
"""
from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.nn.functional as F

from modules import linear_backward, rows, transforms

ENV = "GPT2_ONEDNN_LINEAR"
TRAINING_ENV = "GPT2_ONEDNN_TRAINING"
PROMPT_ROWS = 256  # the rows of the products timed
TRAINING_ROWS = 256  # the rows of the training products timed
# the choices made in this process ({"takes": bool, "speeds": ..., "source": ...}), by their setting's name (ENV for
# the products without gradients, TRAINING_ENV for training's)
_choices: dict[str, dict] = {}


def has_inner_product() -> bool:
    """Whether torch has oneDNN's fp32 inner product here (x86 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available() -> bool:
    """has_inner_product() and GPT2_ONEDNN_LINEAR is not 0 (products without gradients)."""
    return os.environ.get(ENV) != "0" and has_inner_product()


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


def _forced(env: str) -> dict | None:
    """The choice a setting of `env` makes (0: F.linear's, 1: oneDNN's; oneDNN missing: F.linear's whatever the
    setting), or None where it is unset (timed). Any other value raises ValueError."""
    setting = os.environ.get(env, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{env} must be 0 (F.linear), 1 (oneDNN) or unset (timed), got {setting!r}")
    if setting == "0":
        return {"takes": False, "source": f"{env}=0"}
    if not has_inner_product():
        return {"takes": False, "source": "torch has no oneDNN inner product here"}
    return {"takes": True, "source": f"{env}=1"} if setting == "1" else None


def _cached_or_timed(path, timing) -> dict:
    """The timing cached at `path`; else, where the machine is quiet, `timing()`'s record ({"takes": ..., ...}),
    cached there; else F.linear's for this process (a busy machine's timings would be noise: a later one times)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if busy := rows.machine_busy():
        return {"takes": False, "source": f"not timed: the machine is busy ({busy})"}
    record = {**timing(), "source": f"timed, cached in {path}"}
    rows.write_timing(path, record)
    return record


def _choose(env: str, path, timing) -> dict:
    """The setting of `env` (_forced), else the choice made before in this process, else _cached_or_timed."""
    forced = _forced(env)
    if forced is not None:
        return forced
    if env not in _choices:
        _choices[env] = _cached_or_timed(path(), timing)
    return _choices[env]


def choice() -> dict:
    """{"takes": bool, "source": why, "speeds": the timings}: GPT2_ONEDNN_LINEAR, else the cached timing, else a
    timing now (cached), else (a busy machine, oneDNN missing) F.linear."""
    return _choose(ENV, _path, _time_choice)


def _time_choice() -> dict:
    """time_products twice and the decision; where oneDNN is taken and the plan gave the kernel short prompts, the
    kernel raced against oneDNN at those rows (kernel_rows)."""
    first = time_products()
    second = time_products()
    record = {"takes": decide(first, second), "speeds": [first, second]}
    planned = rows.plan().get("prompt_rows", rows.MAX_ROWS) if rows.available() else rows.MAX_ROWS
    if record["takes"] and planned > rows.MAX_ROWS:  # the plan gave the kernel short prompts: where it beats oneDNN
        counts = [n for n in rows.PROMPT_ROWS_TIMED if n <= planned]
        kernel = [time_kernel_rows(counts), time_kernel_rows(counts)]
        record.update(kernel_rows=kernel_limit(*kernel), kernel_speeds=kernel)
    return record


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
            and not transforms.active() and choice()["takes"])


# ---- training: the forward and both gradients ---------------------------------------------------------------------

class TrainingLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) in fp32 whose three products (forward, g W, g^T x) are oneDNN's inner product."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors  # g of any strides: oneDNN's op takes them (an expanded gradient too)
        return linear_backward.gradients(x, weight, grad, ctx.needs_input_grad, input_gradient, weight_gradient)


def input_gradient(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """g W for the output's gradient g (N, out) and weight (out, in), through oneDNN (the transpose a strided view)."""
    return linear(g, weight.t())


def weight_gradient(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g^T x for the output's gradient g (N, out) and the input x (N, in), through oneDNN (both as strided views)."""
    return linear(g.t(), x.t())


def time_training(rounds: int = 5, n: int = TRAINING_ROWS) -> dict[str, float]:
    """{"onednn": GFLOP/s, "torch": GFLOP/s} of a training step's three fp32 products (forward, input gradient,
    weight gradient) over a 3072 x 768 and a 768 x 3072 weight at n rows, in interleaved rounds (medians)."""
    import statistics

    shapes = [(3072, 768), (768, 3072)]
    cases = [(torch.randn(n, i), torch.randn(o, i), torch.randn(o), torch.randn(n, o)) for o, i in shapes]
    flop = sum(3 * 2 * n * w.numel() for _, w, _, _ in cases)

    def torch_step():
        for x, w, b, g in cases:
            F.linear(x, w, b), g @ w, g.t() @ x

    def onednn_step():
        for x, w, b, g in cases:
            linear(x, w, b), input_gradient(g, w), weight_gradient(g, x)

    with torch.no_grad():
        onednn_step(), torch_step()  # each library's first call builds its kernels
        times = rows.interleaved({"onednn": onednn_step, "torch": torch_step}, rounds)
    return {name: flop / statistics.median(t) / 1e9 for name, t in times.items()}


def _training_path():
    key = hashlib.sha256((rows.cpu_flags() + torch.__version__ + str(TRAINING_ROWS)).encode()).hexdigest()[:16]
    return rows._cache_dir() / f"onednn-training-{key}.json"


def training_choice() -> dict:
    """choice() for fp32 training's products: GPT2_ONEDNN_TRAINING (0: F.linear's, 1: oneDNN's), else the cached
    timing, else a timing now (time_training, twice; cached), else (a busy machine, oneDNN missing) F.linear's."""
    return _choose(TRAINING_ENV, _training_path, _time_training_choice)


def _time_training_choice() -> dict:
    first, second = time_training(), time_training()
    return {"takes": decide(first, second), "speeds": [first, second]}


def training_applies(x: torch.Tensor, weight: torch.Tensor, values: int | None = None) -> bool:
    """Whether an fp32 training product of x and weight takes TrainingLinear (the module's docstring): fp32 CPU
    tensors, more than rows.MAX_ROWS rows, a weight of rows.PROMPT_MIN_WEIGHT+ values (`values`, where weight stands
    for several multiplied as one: the fused q/k/v's), grad mode with x or the weight requiring a gradient, outside
    autocast and torch.compile, where training_choice() takes oneDNN."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and x.dim() >= 2
            and x.shape[:-1].numel() > rows.MAX_ROWS
            and (weight.numel() if values is None else values) >= rows.PROMPT_MIN_WEIGHT
            and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and not torch.is_autocast_enabled("cpu") and not transforms.active()
            and training_choice()["takes"])


if __name__ == "__main__":
    print(json.dumps({"no gradients": choice(), "training": training_choice()}, indent=1))
