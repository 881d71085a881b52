"""Every path whose choice depends on the CPU, in one list: what it serves, how to force it on and off, and whether
this machine takes it and why.

    python -m models.paths          # the matrix for this machine (every benchmark prints and records it)
    python -m models.paths --json   # the same, as JSON

A fast path chosen by CPU flags is a different program on each CPU class (AVX2, AVX512-BF16, AMX): each one here is
tested against the plain torch path on every machine where it can run, forced on where the CPU allows and off
everywhere (tests/test_paths.py; `.ci/run` runs the path-sensitive tests under each forced setting). `force_on` and
`force_off` are environment settings read when the path is first asked for in a process (set them before the run);
an empty `force_on` means there is nothing to force: the path is taken wherever it can run.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import torch

from models import decode_threads, fast_step
from modules import (
    adamw,
    cross_entropy,
    draw,
    dropout,
    fused_qkv,
    gelu,
    head_grad,
    hugepages,
    layer_norm,
    masked_softmax,
    onednn,
    packed,
    prompt_attention,
    quant,
    rmsnorm,
    transposed,
)
from modules import rows as row_kernel


@dataclass(frozen=True)
class Path:
    name: str
    serves: str  # the operation the path computes
    env: str  # the variable that forces it ("" where a call argument or the config chooses)
    force_on: str  # the value that forces it on where the CPU can run it ("" : nothing to force)
    force_off: str  # the value that turns it off
    runs_here: Callable[[], str | None]  # None where this CPU (and build) can run it, else why not
    default_here: Callable[[], tuple[bool, str]]  # whether a run with no setting takes it here, and why
    tests: tuple[str, ...]  # the test files that compare it with the plain path

    def state(self) -> dict:
        why_not = self.runs_here()
        taken, why = (False, why_not) if why_not else self.default_here()
        setting = os.environ.get(self.env) if self.env else None
        return {"path": self.name, "serves": self.serves, "can_run": why_not is None, "taken": taken, "why": why,
                "env": self.env, "force_on": self.force_on, "force_off": self.force_off, "setting": setting}


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _kernel(module, env: str, what: str) -> Callable[[], str | None]:
    """Why a kernel module's path cannot run (None: it can): switched off by `env`=0, or `module.available()` false
    (looked up at each call)."""
    def why_not() -> str | None:
        if os.environ.get(env) == "0":
            return f"{env}=0"
        return None if module.available() else f"{what} does not build or load here (needs x86-64 Linux and a C++ compiler)"
    return why_not


def _kernel_path(name: str, serves: str, module, what: str, where: str, tests: tuple[str, ...]) -> Path:
    """A path that is a C++ kernel `module` builds (module.available(), switched by module.ENV): nothing to force on,
    ENV=0 turns it off, taken wherever it runs (`where` says where that is); `what` names the kernel."""
    return Path(name, serves, module.ENV, "", "0", _kernel(module, module.ENV, what), lambda: (True, where),
                (*tests, "tests/test_paths.py"))


def _amx_default(env: str, amx: Callable[[], bool], measured: str, elsewhere: str) -> Callable[[], tuple[bool, str]]:
    """The default of a path measured faster on AMX only: on where `env`=force or the CPU has AMX-BF16 (`amx()`,
    looked up at each call), off elsewhere; `measured` says where the figures are, `elsewhere` what is known of the
    other CPUs."""
    def default() -> tuple[bool, str]:
        if os.environ.get(env) == "force":
            return True, f"{env}=force"
        if amx():
            return True, f"AMX-BF16: measured faster ({measured})"
        return False, f"no AMX: taken only when forced ({elsewhere})"
    return default


def _packed_runs() -> str | None:
    if os.environ.get(packed.ENV) == "0":
        return f"{packed.ENV}=0"
    return None if packed._bf16_kernels() else "oneDNN has no bf16 kernels on this CPU (needs AVX512-BF16 or AMX)"


def _transposed_runs() -> str | None:
    if os.environ.get(transposed.ENV) == "0":
        return f"{transposed.ENV}=0"
    return None if row_kernel.available() else ("the rows kernel (its transpose) does not build or load here (needs "
                                                "x86-64 Linux and a C++ compiler)")


def _head_grad_default() -> tuple[bool, str]:
    if transposed.available():
        return False, "the transposed products take the LM head here (AMX, or forced)"
    return True, ("bf16 CPU training steps' LM head of 2^24+ weight values (gpt2's weight gradient 1.3-1.7x faster on "
                  "a Zen 5)")


def _rows_runs() -> str | None:
    if os.environ.get("GPT2_ROWS_KERNEL") == "0":
        return "GPT2_ROWS_KERNEL=0"
    if _capability() not in ("AVX2", "AVX512"):
        return f"CPU capability {_capability()} (needs AVX2 or AVX512)"
    return None if row_kernel.available() else "the rows kernel does not build here"


def _rows_default() -> tuple[bool, str]:
    kinds = [name for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8),
                                      ("int4", torch.uint8)) if row_kernel.pays(dtype, 1)]
    return bool(kinds), f"one-row products in {', '.join(kinds) or 'no kind'} ({_capability()}: where it measured " \
                        f"faster than torch's)"


def _form_default() -> tuple[bool, str]:
    plan = row_kernel.plan()
    avx2 = sorted(kind for kind, form in plan["forms"].items() if form == "avx2")
    return bool(avx2), f"AVX2 form for {', '.join(avx2) or 'no kind'} (plan: {plan['source']})"


def _step_runs() -> str | None:
    if os.environ.get(fast_step.ENV) == "0":
        return f"{fast_step.ENV}=0"
    return _rows_runs()


def _prompt_pass_runs() -> str | None:
    if os.environ.get(fast_step.PROMPT_ENV) == "0":
        return f"{fast_step.PROMPT_ENV}=0"
    if os.environ.get(prompt_attention.ENV) == "0":
        return f"{prompt_attention.ENV}=0 (the pass's attention is that kernel's)"
    return _step_runs()


def _timed_threads(env: str, what: str) -> Callable[[], tuple[bool, str]]:
    """The default of a thread choice (models/decode_threads.py) that `env` can fix or turn off."""
    def default() -> tuple[bool, str]:
        fixed = decode_threads.fixed_threads(env)
        if fixed is None:
            return True, f"{what} timed per thread count (torch's count, its halves, 1)"
        return False, f"{env}={fixed}"
    return default


def _rows_take_int8() -> bool:
    """Whether one-row int8 products go to the rows kernel here (it pays for them and it is built)."""
    return row_kernel.pays(torch.int8, 1) and row_kernel.available()


def _int8_runs() -> str | None:
    if _rows_take_int8():
        return None
    if quant.compiled_kernel_available():
        return None
    return "neither the rows kernel (AVX2 or AVX512) nor inductor's compiled loop: int8 products dequantize"


def _int8_default() -> tuple[bool, str]:
    if _rows_take_int8():
        return True, f"generate(quantize='int8'): the rows kernel ({_capability()})"
    form = "word-packed" if quant.packed_form_chosen() else "byte"
    return True, f"generate(quantize='int8'): inductor's compiled {form} loop ({_capability()})"


def _a8_runs() -> str | None:
    if _rows_take_int8():
        return None
    return ("the rows kernel does not run here: w8a8 / w4a8 products are F.linear(quantize_activations(x), the "
            "dequantized weight)")


def _a8_default() -> tuple[bool, str]:
    what = f"generate(quantize='w8a8' or 'w4a8'): the rows kernel's integer products ({_capability()}"
    if not _rows_take_int8():
        return True, what + ")"
    forms = {kind: row_kernel.plan()["forms"].get(kind, "native") for kind in ("w8a8", "w4a8")}
    codes = {kind: "VNNI" if row_kernel.library_for(kind).rows_vnni() else "vpmaddubsw" for kind in forms}
    return True, what + ": " + ", ".join(f"{kind} {forms[kind]} build, {codes[kind]}" for kind in forms) + ")"


def _prompt_amx_runs() -> str | None:
    if os.environ.get(row_kernel.AMX_ENV) == "0":
        return f"{row_kernel.AMX_ENV}=0"
    if not row_kernel.available():
        return "the rows kernel does not build or load here"
    if not row_kernel.prompt_library().rows_qgemm_amx(64):
        return "no AMX-INT8 tiles in the prompt's build here (the CPU's flags, the compiler, or Linux's grant)"
    return None


def _huge_pages_runs() -> str | None:
    if os.environ.get(hugepages.ENV) == "0":
        return f"{hugepages.ENV}=0"
    if not hugepages.available():
        return f"no transparent huge pages to ask for here (THP mode {hugepages.mode() or 'unknown'})"
    return None


def _prompt_kernel_default() -> tuple[bool, str]:
    limit, prompt = row_kernel.prompt_rows(), onednn.kernel_rows()
    if limit <= row_kernel.MAX_ROWS:
        return False, "F.linear beyond 8 rows (the plan did not time the kernel faster, or there is no plan here)"
    how = "set" if os.environ.get(row_kernel.PROMPT_ENV) else "timed by the plan and the oneDNN choice"
    return True, f"9 to {limit} rows, a prompt's to {prompt} ({how})"


def _onednn_runs(env: str) -> Callable[[], str | None]:
    """runs_here of a oneDNN path switched by `env` (onednn-linear, onednn-training)."""
    def runs() -> str | None:
        if os.environ.get(env) == "0":
            return f"{env}=0"
        return None if onednn.has_inner_product() else "torch has no oneDNN inner product here"
    return runs


def _onednn_default(env: str, choose: str) -> Callable[[], tuple[bool, str]]:
    """default_here of a oneDNN path switched by `env` whose timing is onednn's function named `choose`."""
    def default() -> tuple[bool, str]:
        if os.environ.get(env) == "1":
            return True, f"{env}=1"
        chosen = getattr(onednn, choose)()
        return chosen["takes"], ("timed faster than F.linear here" if chosen["takes"] else
                                 f"F.linear ({chosen['source']})" if "busy" in chosen["source"] else
                                 "F.linear timed as fast here")
    return default


PATHS: tuple[Path, ...] = (
    Path("packed-bf16", "bf16 Linear of 64+ rows without gradients (evaluation, prompts): oneDNN-packed weights kept "
         "per layer (modules/packed.py)", packed.ENV, "force", "0", _packed_runs,
         _amx_default(packed.ENV, lambda: packed._amx_bf16(), "docs/performance.md",
                      "on a Zen 4, AVX512-BF16: 1.03-1.09x for 250 MB of copies; a Zen 5: 1.02x"),
         ("tests/test_packed.py", "tests/test_paths.py")),
    Path("transposed-products", "a bf16 CPU training step's LM head as (W h^T)^T and large linear layers' weight "
         "gradients from a row-major copy of the output's gradient, transposed by the rows kernel "
         "(modules/transposed.py), instead of F.linear's products", transposed.ENV, "force", "0", _transposed_runs,
         _amx_default(transposed.ENV, lambda: transposed._amx_bf16(), "modules/transposed.py",
                      "on a Zen 5, AVX512-BF16: 0.91x the step's speed"),
         ("tests/test_transposed.py", "tests/test_paths.py")),
    Path("head-grad-blocks", "a bf16 CPU training step's LM head weight gradient g^T h in blocks of 8192 vocabulary "
         "rows written into one gradient (modules/head_grad.py) instead of one product, which oneDNN runs slowly "
         "for an odd vocabulary", head_grad.ENV, "", "0",
         lambda: f"{head_grad.ENV}=0" if not head_grad.available() else None, _head_grad_default,
         ("tests/test_head_grad.py", "tests/test_paths.py")),
    Path("fused-qkv", "a training step's query, key and value projections as one product of the concatenated weights "
         "(modules/fused_qkv.py) instead of three F.linear calls: one launch forward and two backward instead of three "
         "and six on a GPU", fused_qkv.ENV, "", "0",
         lambda: f"{fused_qkv.ENV}=0" if not fused_qkv.available() else None,
         lambda: (True, "training steps (grad mode) of plain q/k/v Linear layers, any device, outside autocast"),
         ("tests/test_fused_qkv.py", "tests/test_paths.py")),
    Path("rows-kernel", "decoding's products of 1-8 rows, and a prompt's of 2-8 rows through the layers "
         "(modules/rows.cpp)", "GPT2_ROWS_KERNEL", "", "0",
         _rows_runs, _rows_default, ("tests/test_rows_kernel.py", "tests/test_fast_paths.py", "tests/test_paths.py")),
    Path("rows-avx2-form", "the rows kernel's AVX2 build instead of the native one (the decode plan's choice)",
         row_kernel.PLAN_ENV, "avx2", "native", _rows_runs, _form_default,
         ("tests/test_rows_kernel.py", "tests/test_decode_plan.py", "tests/test_paths.py")),
    Path("prompt-kernel", "fp32 products of 9-128 rows without gradients (a short prompt; a batched decode step "
         "of 9+ rows and its LM head) by weights of 2^18+ values: the rows kernel's product of many rows (input "
         "rows packed in blocks, weight elements broadcast), instead of F.linear, up to the row count the decode "
         "plan timed faster (modules/rows.py)",
         row_kernel.PROMPT_ENV, "128", "0", _rows_runs, _prompt_kernel_default,
         ("tests/test_prompt_kernel.py", "tests/test_paths.py")),
    Path("decode-step", "decoding batches of plain GPT-2 (generate, beam search; 1-8 rows, fp32 up to the rows "
         "prompt-kernel takes): each step in one C++ call (models/fast_step.py)", fast_step.ENV, "", "0", _step_runs,
         lambda: (True, "1-8 rows (fp32: more), fp32 or bf16, plain GPT-2 blocks"),
         ("tests/test_fast_step.py", "tests/test_paths.py")),
    Path("prompt-pass", "a short prompt's pass (generate, beam search: one fp32 sequence of plain GPT-2, no padding, "
         "up to the rows a prompt's products take the rows kernel) in one C++ call (models/fast_step.py)",
         fast_step.PROMPT_ENV, "", "0", _prompt_pass_runs,
         lambda: (True, f"one fp32 sequence of 1 to {onednn.kernel_rows()} tokens, plain GPT-2 blocks"),
         ("tests/test_prompt_pass.py", "tests/test_paths.py")),
    Path("huge-pages", "a loaded model's CPU parameters in one mapping of 2 MiB pages (madvise MADV_HUGEPAGE) "
         "instead of torch's 4 KiB ones: from_pretrained (modules/hugepages.py)", hugepages.ENV, "", "0",
         _huge_pages_runs, lambda: (True, f"from_pretrained's CPU weights (THP mode {hugepages.mode()})"),
         ("tests/test_hugepages.py", "tests/test_paths.py")),
    Path("decode-threads", "the decode steps' thread count chosen by timing them (models/decode_threads.py)",
         decode_threads.ENV, "auto", "off", lambda: None, _timed_threads(decode_threads.ENV, "decode steps"),
         ("tests/test_decode_threads.py", "tests/test_paths.py")),
    Path("prompt-threads", "a long prompt's thread count, block by block, chosen by timing the blocks "
         "(models/decode_threads.py, models/generation.py's prompt_threads)", decode_threads.PROMPT_ENV, "auto", "off",
         lambda: None, _timed_threads(decode_threads.PROMPT_ENV, "a long prompt's blocks"),
         ("tests/test_decode_threads.py", "tests/test_paths.py")),
    Path("train-threads", "fit's training steps' thread count (torch's intra-op threads, no batch split) chosen by "
         "timing them (models/decode_threads.py, training/engine.py's thread_choice)", decode_threads.TRAIN_ENV, "auto",
         "off", lambda: None, _timed_threads(decode_threads.TRAIN_ENV, "training steps"),
         ("tests/test_train_threads.py", "tests/test_paths.py")),
    Path("fused-adamw", "AdamW(fused=True) (fit's default on the CPU): one pass per fp32 tensor or bf16 master "
         "(modules/adamw.cpp)", "GPT2_FUSED_ADAMW", "", "0",
         _kernel(adamw, "GPT2_FUSED_ADAMW", "the fused AdamW kernel"),
         lambda: (True, "fp32 CPU parameters and bf16 ones with fp32 masters"),
         ("tests/test_optimizer.py", "tests/test_master_weights.py", "tests/test_paths.py")),
    _kernel_path("hashed-dropout", "CPU training dropout: a counter-hash mask in one pass, recomputed for backward "
                 "(modules/dropout.cpp)", dropout, "the dropout kernel", "fp32/bf16 CPU training, 0 < p < 1",
                 ("tests/test_dropout.py",)),
    _kernel_path("fused-rmsnorm", "RMSNorm and QK-norm in float32 on the CPU, forward and backward one pass each "
                 "(modules/rmsnorm.cpp) instead of torch's composite rms_norm", rmsnorm, "the RMSNorm kernel",
                 "float32 CPU tensors outside torch.compile and torch.func (bf16 is widened to float32 first)",
                 ("tests/test_rmsnorm.py",)),
    _kernel_path("fused-layernorm", "GPT-2's LayerNorm in a bf16 CPU training step, forward and backward one pass "
                 "each (modules/layer_norm.py, in modules/rows.cpp) instead of torch's layer_norm",
                 layer_norm, "the rows kernel (LayerNorm)",
                 "bf16 CPU training steps (bf16 weights) outside torch.compile and torch.func; fp32 steps, evaluation, "
                 "generation and autocast's fp32 norms of bf16 activations: torch's",
                 ("tests/test_layer_norm.py",)),
    _kernel_path("fused-gelu", "GPT-2's GELU (tanh form) on float32 or bf16 CPU tensors, in a training step forward "
                 "and backward one pass each, without a gradient (evaluation, prompts) the forward's pass "
                 "(modules/gelu.py, in modules/rows.cpp) instead of torch's gelu(approximate='tanh')",
                 gelu, "the rows kernel (GELU)",
                 "float32 and bf16 CPU tensors outside torch.compile and torch.func, training and evaluation alike",
                 ("tests/test_gelu.py",)),
    _kernel_path("fused-softmax", "the explicit attention's scale, mask and softmax in a float32 or bf16 CPU training "
                 "step, one pass forward and one backward (modules/masked_softmax.py, in modules/rows.cpp) instead of "
                 "torch's multiply, masked_fill and softmax", masked_softmax,
                 "the rows kernel (the attention's softmax)",
                 "CPU training steps on the explicit attention path (bf16, or attention dropout), a causal or "
                 "(B or 1, 1, T, K) mask; evaluation and generation: torch's", ("tests/test_masked_softmax.py",)),
    _kernel_path("fused-loss", "the LM loss's rows on the CPU (modules/cross_entropy.py): each row's log-sum-exp "
                 "forward and its softmax gradient backward in one C++ loop a row (modules/rows.cpp), fp32 or bf16 "
                 "logits, instead of torch's ops by blocks of rows", cross_entropy, "the rows kernel (the loss's rows)",
                 "contiguous fp32 and bf16 CPU logits of 2^21+ values (gpt2: 42+ tokens), in training and evaluation "
                 "alike; fp16 and smaller logits: torch's", ("tests/test_cross_entropy.py",)),
    Path("onednn-linear", "fp32 Linear (and the LM head) of 9+ rows without gradients past the prompt kernel's rows "
         "(prompts, evaluations) by weights of 2^18+ values: oneDNN's inner product instead of F.linear (MKL's "
         "sgemm), where it timed faster here (modules/onednn.py)", onednn.ENV, "1", "0", _onednn_runs(onednn.ENV),
         _onednn_default(onednn.ENV, "choice"),
         ("tests/test_onednn.py", "tests/test_paths.py")),
    Path("onednn-training", "fp32 training's products (a Linear's forward, input and weight gradients; the LM head's; "
         "the fused q/k/v's) of 9+ rows by weights of 2^18+ values: oneDNN's inner product instead of F.linear's "
         "autograd (MKL's sgemm), where a timing of the three found it faster here (modules/onednn.py)",
         onednn.TRAINING_ENV, "1", "0", _onednn_runs(onednn.TRAINING_ENV),
         _onednn_default(onednn.TRAINING_ENV, "training_choice"),
         ("tests/test_onednn_training.py", "tests/test_paths.py")),
    Path("prompt-attention", "causal attention of a prompt's pass (no cached tokens before it) in fp32 or bf16 "
         "without gradients: one rows-kernel call (modules/prompt_attention.py; bf16 summed in fp32, rounded once) "
         "instead of torch's SDPA", prompt_attention.ENV,
         "force", "0", _kernel(prompt_attention, prompt_attention.ENV, "the rows kernel (prompt attention)"),
         lambda: (True, "fp32 and bf16 (off AMX) CPU prompts and evaluations without gradients, full heads, head "
                        "size a multiple of the vector width"),
         ("tests/test_prompt_attention.py", "tests/test_paths.py")),
    Path("explicit-attention", "attention as scores/softmax/sum instead of torch's SDPA (modules/attention.py)", "",
         "config attn_implementation='eager'", "config attn_implementation='sdpa'", lambda: None,
         lambda: (True, "CPU training with attention dropout or bf16 (explicit_is_faster); SDPA otherwise"),
         ("tests/test_attention.py", "tests/test_fast_paths.py", "tests/test_paths.py")),
    Path("fast-draw", "sampling's draw of a token (generate, pretraining's samples): torch.multinomial's token and "
         "generator state without its logarithm per vocabulary entry (modules/draw.cpp)", draw.ENV, "", "0",
         _kernel(draw, draw.ENV, "the sampling draw kernel"),
         lambda: (True, "float32 CPU probabilities, a CPU generator (checked once against torch.multinomial)"),
         ("tests/test_draw.py", "tests/test_generation.py", "tests/test_paths.py")),
    Path("int8-copies", "generate(quantize='int8'): per-row int8 copies of every Linear, kept until a weight changes "
         "(modules/quant.py)", "", "generate(..., quantize='int8')", "quantize=None", _int8_runs, _int8_default,
         ("tests/test_quant.py", "tests/test_paths.py")),
    Path("int4-copies", "generate(quantize='int4'): 4-bit copies in groups of 32, read by the rows kernel",
         "", "generate(..., quantize='int4')", "quantize=None", _rows_runs,
         lambda: (True, "generate(quantize='int4'): the rows kernel"), ("tests/test_quant.py", "tests/test_paths.py")),
    Path("int8-activations", "generate(quantize='w8a8' / 'w4a8'): int8/int4 copies times activations quantized to "
         "int8 per 32 columns, integer products in the rows kernel (VNNI's vpdpbusd in the native build of an "
         "AVX512-VNNI CPU, vpmaddubsw otherwise: GPT2_DECODE_PLAN=avx2 takes that one there)", "",
         "generate(..., quantize='w8a8')", "quantize='int8' (weight-only)", _a8_runs, _a8_default,
         ("tests/test_int8_activations.py", "tests/test_quant.py", "tests/test_fast_step.py", "tests/test_paths.py")),
    Path("int8-prompt", f"the prompt of generate(quantize='w8a8' / 'w4a8'): 2 to {fast_step.INT8_PROMPT_TOKENS} "
         "tokens in the prompt pass's "
         "int8 GEMM (rows.cpp rows_qgemm, where prompt-pass runs), longer ones oneDNN's int8 GEMM in the layers (q / k "
         "/ v as one GEMM, GELU in the rows kernel); the activations quantized per tensor to 7 bits (modules/quant.py)",
         quant.PROMPT_ENV, "", "0",
         quant.prompt_products_why_not, lambda: (True, "w8a8 / w4a8 prompts of 2+ tokens: oneDNN's int8 linear runs "
                                                       "here (measured 1.3-2.2x fp32 F.linear on a Zen 3)"),
         ("tests/test_int8_activations.py", "tests/test_paths.py")),
    Path("prompt-amx", "int8-prompt's GEMM in the prompt pass (rows_qgemm) in AMX-INT8 tiles: tdpbusd adds 16 rows "
         "x 64 bytes of activations times 64 bytes x 16 outputs of the packed weight a step, 32 rows over a pair of "
         "weight tiles a pass, for inputs in multiples of 64; the VNNI form's epilogue, so its outputs to the bit",
         row_kernel.AMX_ENV, "", "0", _prompt_amx_runs,
         lambda: (True, "AMX-INT8 tiles: measured faster than VNNI's vpdpbusd at 8-128 rows (docs/cpu-decoding.md)"),
         ("tests/test_prompt_pass.py", "tests/test_paths.py")),
)
BY_NAME = {p.name: p for p in PATHS}
ENV_FORCED = tuple(p for p in PATHS if p.env)  # the paths a CI run can force through the environment


def here(state: dict) -> str:
    """A state's one word: 'on' (taken here), 'off' (can run, not taken) or 'n/a' (cannot run here)."""
    return "on" if state["taken"] else "off" if state["can_run"] else "n/a"


def matrix() -> list[dict]:
    """Each path's state on this machine (see Path.state)."""
    return [p.state() for p in PATHS]


def summary() -> str:
    """One line: each path taken or not here, for a benchmark's header."""
    return "; ".join(f"{s['path']} {'on' if s['taken'] else 'off'}" for s in matrix())


def table() -> str:
    rows = [f"{'path':<19} {'here':<5} why (force on / off)"]
    for s in matrix():
        env = s["env"]
        on = f"{env}={s['force_on']}" if env and s["force_on"] else (s["force_on"] or "-")
        off = f"{env}={s['force_off']}" if env else s["force_off"]
        rows.append(f"{s['path']:<19} {here(s):<5} {s['why']}  [on: {on}; off: {off}]")
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The CPU-dependent paths: which this machine takes, why, and how "
                                                 "to force each on and off (docs/paths.md).")
    parser.add_argument("--json", action="store_true", help="print the matrix as JSON")
    if parser.parse_args().json:
        print(json.dumps(matrix(), indent=1))
    else:
        from modules.rows import cpu_flags
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                 if f in cpu_flags().split()]
        print(f"CPU capability {_capability()}; flags: {' '.join(flags)}")
        print(table())
