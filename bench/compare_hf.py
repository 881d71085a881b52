"""Ours against transformers.GPT2LMHeadModel (sdpa and eager) on the same CPU, in the same run, on the same weights.

The gpt2 (124M) preset at random init: one transformers model is initialised with a fixed seed and every contender
(ours, HF sdpa, HF eager) gets its weights. Each measurement times one unit of work per contender in turn, rotating
the order, `--repeats` times, and reports medians, so load from other processes on a shared machine hits all
contenders alike. Ratios are ours / the best transformers contender in the same dtype; targets (issue 25): training,
forward and batch 8 against transformers in the same dtype (bf16 training also against ours in fp32), greedy batch 1
as a share of the read-bandwidth limit, int8 against transformers fp32.

Sections (`--only`, several allowed; default all):
  train          training step (forward, backward, AdamW step), batch 4 x 128, fp32 and bf16 autocast (fp32
                 master weights), with each contender's model FLOPs utilisation (MFU: 6 x parameters + attention
                 FLOPs a token, against the GEMM peak measured here in the dtype in use); plus the loss after
                 --loss-steps steps of fp32 vs bf16 from the same start
  train-run      training steps as each user runs them (issue 42), at each --train-shapes (4 x 128, 8 x 256):
                 ours as fit() trains (fused AdamW; bf16 = `--dtype bf16-weights`: bf16 weights, fp32 masters, no
                 autocast), transformers as its Trainer does (torch's fused AdamW; bf16 = autocast), with MFU
  forward        inference forward (logits at every position), batch 8 x 128, fp32 and bf16 weights
  generate       greedy, 16-token prompts + 64 new tokens, batch 1 and batch 8 (left-padded), fp32 and bf16 weights;
                 greedy b1 also as % of the memory-bandwidth limit (weight bytes per step / measured read bandwidth);
                 fp32 only: sampling b1 (top-p 0.9, temperature 0.8; and ours' sampling / ours' greedy speed), beam
                 search b1 (4 beams, no EOS: both do 64 steps; tokens compared), time to first token of a 512-token
                 prompt (prefill + first token, batch 1)
  memory         peak RSS of each of the above, each in a fresh subprocess (VmHWM, reset after the model is built)
  xl             gpt2-xl (1.5B) at random init in bf16: greedy tokens/s and peak RSS, in a subprocess
  checkpointing  gpt2-medium training step with and without gradient checkpointing: step time and peak RSS

    python bench/compare_hf.py                                  # everything, torch's default thread count
    python bench/compare_hf.py --only forward generate --repeats 7
    python bench/compare_hf.py --only generate --dtypes fp32 --generate-rows sample beam4 ttft
    python bench/compare_hf.py --only train --loss-steps 20 --threads 2
    python bench/compare_hf.py --only train-run --keep-freed-memory   # as each user runs it (fit() keeps freed memory)
    python bench/compare_hf.py --only memory checkpointing
    python bench/compare_hf.py --only train-run --keep-freed-memory --busy 1   # with a core busy (its own rows)
    python bench/compare_hf.py --skip-xl --compile              # also time torch.compile'd ours (forward, train)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from bench.machine import busy_suffix, print_machine_header, spin, stop  # noqa: E402
from bench.results import Recorder  # noqa: E402
from config import GPT2Config  # noqa: E402
from models.gpt2 import GPT2LMHeadModel  # noqa: E402
from models.hub import data_dir, tokenizer_dir  # noqa: E402
from models.loading import hf_to_ours  # noqa: E402
from modules import onednn  # noqa: E402
from modules.rows import keep_inductor_cache_apart  # noqa: E402
from training.allocator import in_effect as allocator_in_effect  # noqa: E402
from training.allocator import keep_freed_memory  # noqa: E402
from training.precision import bf16_matmul_is_fast  # noqa: E402

SECTIONS = ("train", "train-run", "forward", "generate", "memory", "xl", "checkpointing")
# (case, dtype) -> [(ratio, minimum)] (issue 25; beam and time to first token: issue 15). Ratios: "same" = ours / the
# best transformers contender in the same dtype, "ours-fp32" = ours / ours in fp32 on the same case.
TARGETS = {("train", "fp32"): [("same", 1.15)], ("train", "bf16"): [("same", 1.3), ("ours-fp32", 1.8)],
           ("forward", "fp32"): [("same", 1.0)], ("forward", "bf16"): [("same", 1.3)],
           ("generate b8", "fp32"): [("same", 2.0)], ("generate b8", "bf16"): [("same", 2.0)],
           ("beam4 b1", "fp32"): [("same", 1.5)], ("ttft p512", "fp32"): [("same", 1.0)]}
# training as each user runs it (issue 42): fp32 >= 1.3x transformers; bf16 >= 1.5x transformers' bf16 and >= 2x ours fp32
TRAIN_RUN_SHAPES = ("4x128", "8x256")
for _shape in TRAIN_RUN_SHAPES:
    TARGETS[(f"train as run {_shape}", "fp32")] = [("same", 1.3)]
    TARGETS[(f"train as run {_shape}", "bf16")] = [("same", 1.5), ("ours-fp32", 2.0)]
MFU_TARGET = 0.80  # the fp32 training step's share of the measured fp32 GEMM peak (issue 42)
BANDWIDTH_TARGETS = {"fp32": 0.70, "bf16": 0.60}  # greedy b1: ours' share of the read-bandwidth limit (issue 25)
INT8_TARGET = 2.5  # greedy b1 with quantize="int8" against the best transformers fp32 (issue 25)
GENERATE_ROWS = ("b1", "b8", "sample", "beam4", "ttft", "int8")  # greedy b1 and b8, and the fp32-only rows below
SAMPLING = dict(temperature=0.8, top_p=0.9)  # the sampling row's settings (transformers' default top_k=50 is off)
SAMPLING_VS_GREEDY = 0.9  # target: ours' sampling at least this fraction of ours' greedy speed
PROMPT_LENGTHS_B8 = [16, 13, 10, 16, 7, 12, 15, 9]  # the batch-8 prompts, left-padded to 16
DEVICE = torch.device("cpu")  # --device; the inputs and every contender live there
CPU_ONLY_SECTIONS = ("memory", "xl", "checkpointing")  # they measure the process's RSS
RECORDS = Recorder("compare_hf")  # every printed row also goes to bench/results/compare_hf.jsonl (bench/results.py)


# ---- models and inputs -------------------------------------------------------------------------------------------

def hf_reference(preset: str, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict of a random-init transformers model: the weights every contender gets."""
    torch.manual_seed(seed)
    with _default_dtype(dtype):
        hf = transformers.GPT2LMHeadModel(GPT2Config.from_preset(preset).to_hf())
    return hf.state_dict()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build big models directly in bf16 instead of via an fp32 copy
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(impl: str, preset: str, state: dict | None, dtype: torch.dtype = torch.float32):
    """impl 'ours', 'hf-sdpa' or 'hf-eager' with the given weights (None: its own random init)."""
    config = GPT2Config.from_preset(preset)
    with _default_dtype(dtype):
        if impl == "ours":
            model = GPT2LMHeadModel(config)
            if state is not None:
                model.gpt.load_state_dict(hf_to_ours(state, config.n_layer))
        else:
            model = transformers.GPT2LMHeadModel(config.to_hf(attn_implementation=impl.split("-")[1]))
            if state is not None:
                model.load_state_dict(state, strict=False)  # the tied lm_head may be absent
            model.generation_config.eos_token_id = None  # like ours without eos_token_id: always max_new_tokens
            model.generation_config.pad_token_id = config.eos_token_id
    return model.to(device=DEVICE, dtype=dtype)


def training_batch(batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids of tinyshakespeare (GPT-2 tokenizer) when the data folder has them, else random ids."""
    text, tok = data_dir() / "tinyshakespeare" / "input.txt", tokenizer_dir()
    if text.exists() and tok.exists():
        ids = transformers.AutoTokenizer.from_pretrained(tok)(text.read_text()[:200_000])["input_ids"]
        return torch.tensor(ids[: batch * length]).view(batch, length).to(DEVICE)
    return torch.randint(0, 50257, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def prompts(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, 16) ids and mask; batch 8 uses PROMPT_LENGTHS_B8, padded on the left."""
    lengths = [16] if batch == 1 else PROMPT_LENGTHS_B8[:batch]
    ids = torch.randint(0, 50257, (len(lengths), 16), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, 16 - n:] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


# ---- one unit of work per case ------------------------------------------------------------------------------------

def _is_ours(model) -> bool:
    return isinstance(getattr(model, "_orig_mod", model), GPT2LMHeadModel)  # torch.compile wraps the module


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    if _is_ours(model):
        return model(ids, labels=ids)["loss"]
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def make_train_step(model, ids: torch.Tensor, bf16: bool, optimizer: str):
    """A closure doing one training step; the same torch AdamW (foreach) for everyone unless --optimizer ours."""
    model.train()
    if optimizer == "ours" and _is_ours(model):
        from optimizer import AdamW

        opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, eps=1e-6, weight_decay=0.01, foreach=True)
    return _train_step(model, ids, opt, autocast=bf16)


def _train_step(model, ids: torch.Tensor, opt, autocast: bool, threads=None):
    """A closure doing one training step of `model` on `ids` with `opt`, under bf16 autocast or not. threads: a
    models.decode_threads.DecodeThreads that chooses the step's thread count as fit() does (training/engine.py's
    thread_choice: forward and backward timed, the update on the chosen count); torch's count is restored after each
    call, so the contenders interleaved with it keep theirs."""
    def step() -> float:
        if threads is not None:
            threads.step()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model, ids)
        loss.backward()
        if threads is not None:
            threads.stop(work=ids.numel())
        opt.step()
        if threads is not None:
            torch.set_num_threads(threads.original)
        return loss.item()

    return step


def make_run_step(model, ids: torch.Tensor, bf16: bool):
    """One training step as each user runs it. Ours as fit() trains: optimizer.AdamW(fused=True), the steps' thread
    count chosen by timing them, and for bf16 `--dtype bf16-weights` (the weights in bf16, fp32 masters in the
    optimizer, no autocast). transformers as its
    Trainer does by default: torch.optim.AdamW(fused=True) (Trainer's adamw_torch_fused), bf16 autocast over fp32
    weights (Trainer's --bf16)."""
    model.train()
    ours = _is_ours(model)
    if ours:
        from optimizer import AdamW

        if bf16:
            model.to(torch.bfloat16)
        from training.engine import steps_choice

        opt = AdamW(model.parameters(), lr=3e-4, eps=1e-6, weight_decay=0.01, fused=True, master_weights=bf16)
        # fit()'s thread choice (GPT2_TRAIN_THREADS, as fit reads it); the key is this closure's alone
        threads = steps_choice(("compare_hf", id(model), tuple(ids.shape), bf16), active=DEVICE.type == "cpu")
        step = _train_step(model, ids, opt, autocast=False, threads=threads)
        step.threads = threads  # the count it ends on goes into the row's notes (section_train_run)
        return step
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, eps=1e-6, weight_decay=0.01, fused=True)
    return _train_step(model, ids, opt, autocast=bf16)


def make_forward(model, ids: torch.Tensor):
    model.eval()

    @torch.no_grad()
    def forward():
        if _is_ours(model):
            return model(ids)["logits"]
        return model(input_ids=ids, use_cache=False).logits

    return forward


def make_generate(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, mode: str = "greedy", seed: int = 0):
    """mode 'greedy', 'sample' (SAMPLING settings; torch's default generator seeded before each call: ours draws
    transformers' tokens from the same seed), 'beam4' (4 beams,
    transformers' defaults for length_penalty and early_stopping, which ours shares) or 'int8' (ours' greedy with
    quantize="int8")."""
    model.eval()
    kwargs = {"greedy": dict(do_sample=False), "int8": dict(do_sample=False, quantize="int8"),
              "sample": dict(do_sample=True, **SAMPLING),
              "beam4": dict(do_sample=False, num_beams=4, length_penalty=1.0, early_stopping=False)}[mode]

    def generate():
        if mode == "sample":
            torch.manual_seed(seed)
        if _is_ours(model):
            return model.generate(ids, mask, max_new_tokens=new_tokens, **kwargs)
        extra = dict(top_k=0) if mode == "sample" else {}  # transformers' generation config adds top_k=50
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **kwargs, **extra)

    return generate


# ---- timing -------------------------------------------------------------------------------------------------------

def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # a GPU call returns before its kernels finish


def time_contenders(fns: dict, repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function; calls interleave, the order rotating every round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            _sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


class Report:
    """Collects rows of (case, dtype, tokens/s per contender) and prints them with ratios and targets."""

    def __init__(self):
        self.rows: list[dict] = []
        self.hf_fp32: dict[str, float] = {}  # case -> best transformers fp32 tokens/s
        self.ours_fp32: dict[str, float] = {}  # case -> ours' fp32 tokens/s

    def add(self, case: str, dtype: str, rates: dict[str, float], unit: str) -> None:
        hf = {k: v for k, v in rates.items() if k.startswith("hf")}
        ours = rates.get("ours")
        if dtype == "fp32" and hf:
            self.hf_fp32[case] = max(hf.values())
        if dtype == "fp32" and ours:
            self.ours_fp32[case] = ours
        row = dict(case=case, dtype=dtype, unit=unit, rates=rates)
        if hf and ours:
            row["vs_same_dtype"] = ours / max(hf.values())
        if case in self.hf_fp32 and ours:
            row["vs_hf_fp32"] = ours / self.hf_fp32[case]
        if ours and case in self.ours_fp32:
            row["vs_ours_fp32"] = ours / self.ours_fp32[case]
        ratios = {"same": row.get("vs_same_dtype"), "ours-fp32": row.get("vs_ours_fp32")}
        checks = [(what, ratios[what], minimum) for what, minimum in TARGETS.get((case, dtype), [])
                  if ratios[what] is not None]
        if checks:
            row["target"] = "; ".join(f"{'ours/ours-fp32' if what == 'ours-fp32' else 'ours/best-HF'} >= {minimum}x: "
                                      f"{'met' if value >= minimum else 'NOT met'}" for what, value, minimum in checks)
        self.rows.append(row)
        self.print_row(row)
        targets = "; ".join(f"{'ours fp32' if what == 'ours-fp32' else 'transformers'} >= {minimum}x"
                            for what, _, minimum in checks)
        RECORDS.add(f"{case} {dtype}", rates, unit, ratio=row.get("vs_same_dtype"),
                    ratio_of="ours / best transformers, same dtype" if "vs_same_dtype" in row else None,
                    target=targets or None, met=all(v >= m for _, v, m in checks) if checks else None,
                    vs_hf_fp32=row.get("vs_hf_fp32") if dtype != "fp32" else None,
                    vs_ours_fp32=row.get("vs_ours_fp32") if dtype != "fp32" else None)

    @staticmethod
    def print_row(row: dict) -> None:
        rates = "  ".join(f"{k} {v:8.1f}" if v >= 10 else f"{k} {v:8.3f}" for k, v in row["rates"].items())
        extra = ""
        if "vs_same_dtype" in row:
            extra += f"  ours/best-HF {row['vs_same_dtype']:.2f}x"
        if "vs_hf_fp32" in row and row["dtype"] != "fp32":
            extra += f"  ours/best-HF-fp32 {row['vs_hf_fp32']:.2f}x"
        if row.get("vs_ours_fp32") and row["dtype"] != "fp32":
            extra += f"  ours/ours-fp32 {row['vs_ours_fp32']:.2f}x"
        if "target" in row:
            extra += f"  (target {row['target']})"
        load = os.getloadavg()[0]
        print(f"{row['case']:<12} {row['dtype']:<5} {row['unit']:<12} {rates}{extra}  [load {load:.1f}]", flush=True)


def contenders(args, state: dict, dtype: torch.dtype, bf16_row: bool, compile_ours: bool = False) -> dict:
    """Ours and the transformers models, built in `dtype`; bf16 rows may leave transformers out (--skip-hf-bf16)."""
    impls = ["ours"] + ([] if bf16_row and args.skip_hf_bf16 else [f"hf-{i}" for i in args.hf_impls])
    models = {impl: build(impl, "gpt2", state, dtype) for impl in impls}
    if compile_ours:
        keep_inductor_cache_apart()
        models["ours+compile"] = torch.compile(copy.deepcopy(models["ours"]))
    return models


# ---- sections -----------------------------------------------------------------------------------------------------

def section_train(args, state: dict, report: Report) -> None:
    ids = training_batch(4, 128, args.seed)
    for bf16 in [d == "bf16" for d in args.dtypes]:
        torch.manual_seed(args.seed)
        models = contenders(args, state, torch.float32, bf16, args.compile)  # fp32 master weights under autocast
        fns = {name: make_train_step(m, ids, bf16, args.optimizer) for name, m in models.items()}
        sec = time_contenders(fns, args.repeats)
        rates = {k: ids.numel() / v for k, v in sec.items()}
        report.add("train", "bf16" if bf16 else "fp32", rates, "tokens/s")
        _print_utilisation(models["ours"], ids, rates, torch.bfloat16 if bf16 else torch.float32)
        del fns
    if args.loss_steps and "bf16" in args.dtypes:
        losses = {}
        for bf16 in (False, True):
            torch.manual_seed(args.seed)  # same dropout masks in both runs
            step = make_train_step(build("ours", "gpt2", state), ids, bf16, args.optimizer)
            for _ in range(args.loss_steps):
                loss = step()
            losses["bf16" if bf16 else "fp32"] = loss
        rel = abs(losses["bf16"] - losses["fp32"]) / losses["fp32"]
        RECORDS.add(f"train loss after {args.loss_steps} steps, fp32 vs bf16", losses, "loss", target="<= 2%",
                    met=rel <= 0.02, difference=rel)
        print(f"train loss after {args.loss_steps} steps (ours, same batch, same start): fp32 {losses['fp32']:.4f}  "
              f"bf16 autocast {losses['bf16']:.4f}  difference {100 * rel:.2f}% (target <= 2%: "
              f"{'met' if rel <= 0.02 else 'NOT met'})", flush=True)


def section_train_run(args, state: dict, report: Report) -> None:
    """Training steps as each user runs them (make_run_step), at each --train-shapes shape, fp32 then bf16."""
    for shape in args.train_shapes:
        batch, length = (int(x) for x in shape.split("x"))
        ids = training_batch(batch, length, args.seed)
        for bf16 in [d == "bf16" for d in args.dtypes]:
            torch.manual_seed(args.seed)
            models = contenders(args, state, torch.float32, bf16)  # ours turns itself bf16 in make_run_step
            fns = {name: make_run_step(m, ids, bf16) for name, m in models.items()}
            sec = time_contenders(fns, args.repeats)
            rates = {k: ids.numel() / v for k, v in sec.items()}
            report.add(f"train as run {shape}", "bf16" if bf16 else "fp32", rates, "tokens/s")
            mfu = _print_utilisation(models["ours"], ids, rates, torch.bfloat16 if bf16 else torch.float32)
            _print_thread_choice(fns["ours"])
            if not bf16 and mfu is not None:
                met = mfu >= MFU_TARGET
                RECORDS.rows[-1]["mfu_target"], RECORDS.rows[-1]["mfu_met"] = MFU_TARGET, met
                print(f"{'':<12} {'':<5} MFU target >= {100 * MFU_TARGET:.0f}%: {'met' if met else 'NOT met'}",
                      flush=True)
            del fns, models


def section_forward(args, state: dict, report: Report) -> None:
    ids = torch.randint(0, 50257, (8, 128), generator=torch.Generator().manual_seed(args.seed)).to(DEVICE)
    for dtype in _dtypes(args):
        models = contenders(args, state, dtype, dtype == torch.bfloat16, args.compile and dtype == torch.float32)
        sec = time_contenders({k: make_forward(m, ids) for k, m in models.items()}, args.repeats)
        report.add("forward", _name(dtype), {k: ids.numel() / v for k, v in sec.items()}, "tokens/s")


def section_generate(args, state: dict, report: Report) -> None:
    rows = args.generate_rows
    for dtype in _dtypes(args):
        models = contenders(args, state, dtype, dtype == torch.bfloat16)
        for batch in [b for b in (1, 8) if f"b{b}" in rows]:
            ids, mask = prompts(batch, args.seed)
            fns = {k: make_generate(m, ids, mask, args.new_tokens) for k, m in models.items()}
            int8 = batch == 1 and dtype == torch.float32 and "int8" in rows
            if int8:  # timed in the same rounds as the fp32 contenders; its first call compiles the kernels
                fns["ours-int8"] = make_generate(models["ours"], ids, mask, args.new_tokens, "int8")
            outs = {k: fn() for k, fn in fns.items()}
            sec = time_contenders(fns, args.repeats, warmup=0)
            rates = {k: batch * args.new_tokens / v for k, v in sec.items()}
            report.add(f"generate b{batch}", _name(dtype), rates, "new tokens/s")
            _print_match(outs, "greedy")
            if batch == 1:
                _print_bandwidth_share(models["ours"], rates)
            if int8:
                _print_int8(models["ours"], rates, outs)
        if dtype == torch.float32:
            _generate_fp32_extras(args, models, report, rows)


def _generate_fp32_extras(args, models: dict, report: Report, rows: list[str]) -> None:
    """Sampling and beam search at batch 1, and the time to the first token of a long prompt (issue 15)."""
    n, (ids, mask) = args.new_tokens, prompts(1, args.seed)
    if "sample" in rows:
        fns = {k: make_generate(m, ids, mask, n, "sample", args.seed) for k, m in models.items()}
        outs = {k: fn() for k, fn in fns.items()}
        fns["ours-greedy"] = make_generate(models["ours"], ids, mask, n)  # in the same rounds: the ratio below
        sec = time_contenders(fns, args.repeats)
        report.add("sample b1", "fp32", {k: n / v for k, v in sec.items()}, "new tokens/s")
        _print_match(outs, "sampled")
        vs_greedy = sec["ours-greedy"] / sec["ours"]
        print(f"{'':<12} {'':<5} ours sampling / ours greedy speed {vs_greedy:.2f} (target >= {SAMPLING_VS_GREEDY}: "
              f"{'met' if vs_greedy >= SAMPLING_VS_GREEDY else 'NOT met'}); top-p {SAMPLING['top_p']}, temperature "
              f"{SAMPLING['temperature']}", flush=True)
    if "beam4" in rows:
        fns = {k: make_generate(m, ids, mask, n, "beam4") for k, m in models.items()}
        outs = {k: fn() for k, fn in fns.items()}
        sec = time_contenders(fns, args.repeats, warmup=0)
        report.add("beam4 b1", "fp32", {k: n / v for k, v in sec.items()}, "new tokens/s")
        _print_match(outs, "beam-search")
    if "ttft" in rows:
        long_ids = torch.randint(0, 50257, (1, 512), generator=torch.Generator().manual_seed(args.seed)).to(DEVICE)
        fns = {k: make_generate(m, long_ids, torch.ones_like(long_ids), 1) for k, m in models.items()}
        outs = {k: fn() for k, fn in fns.items()}
        sec = time_contenders(fns, 3 * args.repeats)  # short calls: more rounds
        report.add("ttft p512", "fp32", {k: 1 / v for k, v in sec.items()}, "1/s")
        print(f"{'':<12} {'':<5} time to first token: " + "  ".join(f"{k} {v:.3f} s" for k, v in sec.items()),
              flush=True)
        _print_match(outs, "first-token")


def train_flops_per_token(model, seq_len: int) -> float:
    """A training step's FLOPs per token: 6 per parameter (forward 2, backward 4; the tied embedding counted once,
    as the LM head's product) plus the attention's scores and weighted sum, 12 x layers x T x C (PaLM's appendix B)."""
    config = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "pos_embedding" not in name)
    return 6 * n + 12 * config.n_layer * seq_len * config.n_embd


def _print_utilisation(ours, ids: torch.Tensor, rates: dict, dtype: torch.dtype) -> float | None:
    """Model FLOPs utilisation (MFU): each contender's model arithmetic per second as a share of the GEMM peak
    measured on this machine for the dtype its products run in (fp32, or bf16 under autocast)."""
    if DEVICE.type != "cpu":
        return
    # the best of the header's measurement and one taken now, beside the rows: on a shared machine a peak measured
    # while another process ran would understate it (and overstate the utilisation)
    peak = _GEMM[dtype] = max(_GEMM.get(dtype, 0.0), gemm_gflops(dtype))
    per_token = train_flops_per_token(ours, ids.shape[1])
    mfu = {k: v * per_token / 1e9 / peak for k, v in rates.items()}
    name = _name(dtype)
    print(f"{'':<12} {'':<5} model FLOPs {per_token * ids.numel() / 1e12:.2f} T a step ({per_token / 1e6:.0f} M a token); "
          f"{name} GEMM peak measured here {peak:.0f} GFLOP/s; utilisation (MFU): "
          + "  ".join(f"{k} {100 * v:.0f}%" for k, v in mfu.items()), flush=True)
    RECORDS.note(f"MFU ours {100 * mfu['ours']:.0f}% of the {name} GEMM peak measured here ({peak:.0f} GFLOP/s; "
                 f"{per_token / 1e6:.0f} MFLOP a token)")
    RECORDS.rows[-1]["mfu"] = mfu
    return mfu["ours"]


def thread_choice_note(step) -> str | None:
    """The thread count ours' steps (make_run_step) ended on, of the most it chose from: a row taken on fewer threads
    than the cores (fit's choice, timed: a core it found busy) says so. None where nothing was chosen."""
    return threads_note(getattr(step, "threads", None))


def threads_note(threads) -> str | None:
    """thread_choice_note's words for a DecodeThreads (steps_choice's) or None; bench/compare_llmc.py's worker too."""
    if threads is None or not threads.options:
        return None
    return f"ours' steps ended on {threads.best} of {threads.options[0]} threads (fit's choice, timed)"


def _print_thread_choice(step) -> None:
    note = thread_choice_note(step)
    if note:
        print(f"{'':<12} {'':<5} {note}", flush=True)
        RECORDS.note(note)


def _print_match(outs: dict, what: str) -> None:
    ref = next((k for k in outs if k.startswith("hf")), None)
    if ref:
        same = (outs["ours"] == outs[ref]).all(1).float().mean().item()
        print(f"{'':<12} {'':<5} {what} rows identical to {ref}: {100 * same:.0f}%", flush=True)
        RECORDS.note(f"{what} rows identical to {ref}: {100 * same:.0f}%")


def _print_bandwidth_share(ours, rates: dict) -> None:
    """Greedy b1 reads every weight once per token (the position embedding: one row; the token embedding: once, as
    the LM head): tokens/s x those bytes, as a share of the read bandwidth measured here."""
    step_bytes = sum(p.numel() * p.element_size() for name, p in ours.named_parameters() if "pos_embedding" not in name)
    limit = read_bandwidth() * 1e9 / step_bytes
    shares = "  ".join(f"{k} {100 * v / limit:.0f}%" for k, v in rates.items())
    dtype = "bf16" if next(ours.parameters()).dtype == torch.bfloat16 else "fp32"
    target, share = BANDWIDTH_TARGETS.get(dtype), rates["ours"] / limit
    verdict = f" (target ours >= {100 * target:.0f}%: {'met' if share >= target else 'NOT met'})" if target else ""
    RECORDS.note(f"ours {100 * share:.0f}% of the read-bandwidth limit (best transformers "
                 f"{100 * max((v for k, v in rates.items() if k.startswith('hf')), default=0) / limit:.0f}%)"
                 + (f", target >= {100 * target:.0f}%" if target else ""))
    print(f"{'':<12} {'':<5} of the bandwidth limit ({step_bytes / 1e6:.0f} MB of weights per token at "
          f"{read_bandwidth():.1f} GB/s: {limit:.1f} tokens/s): {shares}{verdict}", flush=True)


def _print_int8(ours, rates: dict, outs: dict) -> None:
    """The int8 row: speed against the best transformers fp32, its share of the bandwidth limit for int8 weights,
    the greedy tokens against ours' fp32, and the memory of the int8 copies kept on the model."""
    from modules.linear import Linear

    best_hf = max((v for k, v in rates.items() if k.startswith("hf")), default=None)
    copies = [m.__dict__["_quantized_cache"][1] for m in ours.modules()
              if isinstance(m, Linear) and "_quantized_cache" in m.__dict__]
    head = ours.gpt.__dict__["_quantized_head"][1]
    int8_bytes = sum(w.nbytes for w in copies + [head])
    other = sum(p.numel() * p.element_size() for m in ours.modules() if not isinstance(m, (Linear, torch.nn.Embedding))
                for p in m.parameters(recurse=False))  # layer norms and such; an embedding gives one row a token
    limit = read_bandwidth() * 1e9 / (int8_bytes + other)
    same = (outs["ours-int8"] == outs["ours"]).all(1).float().mean().item()
    ratio = f"ours-int8/best-HF-fp32 {rates['ours-int8'] / best_hf:.2f}x (target >= {INT8_TARGET}x: " \
        f"{'met' if rates['ours-int8'] / best_hf >= INT8_TARGET else 'NOT met'})  " if best_hf else ""
    if best_hf:
        RECORDS.add("generate b1 int8", {"ours-int8": rates["ours-int8"], "best transformers fp32": best_hf},
                    "new tokens/s", ratio=rates["ours-int8"] / best_hf, ratio_of="ours int8 / best transformers fp32",
                    target=f"transformers fp32 >= {INT8_TARGET}x", met=rates["ours-int8"] / best_hf >= INT8_TARGET,
                    vs_ours_fp32=rates["ours-int8"] / rates["ours"],
                    notes=f"{100 * rates['ours-int8'] / limit:.0f}% of the int8 read-bandwidth limit; greedy tokens "
                          f"equal to ours fp32: {100 * same:.0f}% of rows")
    print(f"{'':<12} {'int8':<5} {ratio}ours-int8/ours-fp32 {rates['ours-int8'] / rates['ours']:.2f}x; "
          f"{100 * rates['ours-int8'] / limit:.0f}% of the int8 bandwidth limit ({limit:.1f} tokens/s); greedy "
          f"tokens equal to ours fp32: {100 * same:.0f}% of rows; int8 copies kept: {int8_bytes / 1e6:.0f} MB "
          f"[load {os.getloadavg()[0]:.1f}]", flush=True)


def _dtypes(args) -> list[torch.dtype]:
    return [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes]


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


# ---- memory: one fresh subprocess per measurement ------------------------------------------------------------------

def run_child(spec: dict, threads: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)] + (["--threads", str(threads)] if threads else [])
    cmd += ["--keep-freed-memory"] if allocator_in_effect() else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(spec: dict) -> None:
    """Build one model, warm up once, reset the peak RSS, run `steps` units of work, print JSON."""
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    case = spec["case"]
    # Training keeps fp32 master weights (bf16 means autocast); inference converts the weights.
    model = build(spec["impl"], spec["preset"], None, torch.float32 if case == "train" else dtype)
    if case == "train":
        if spec.get("checkpointing"):
            model.gpt.gradient_checkpointing = True
        fn = make_train_step(model, training_batch(4, 128, 0), dtype == torch.bfloat16, "torch")
        tokens = 4 * 128
    elif case == "forward":
        ids = torch.randint(0, 50257, (8, 128))
        fn, tokens = make_forward(model, ids), ids.numel()
    else:  # "generate bN"
        batch = int(case.split("b")[1])
        ids, mask = prompts(batch, 0)
        fn, tokens = make_generate(model, ids, mask, spec["new_tokens"]), batch * spec["new_tokens"]
    baseline = _rss_mb("VmRSS")
    fn()  # warm-up: allocator pools, optimizer state, lazily built buffers
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    for _ in range(spec.get("steps", 1)):
        fn()
    seconds = (time.perf_counter() - start) / spec.get("steps", 1)
    print(json.dumps(dict(model_mb=baseline, peak_mb=_rss_mb("VmHWM"), tokens_per_s=tokens / seconds)))


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def section_memory(args) -> None:
    print("peak RSS in a fresh process per row: 'model' = RSS with the model built (before any step); 'peak' = the "
          "highest RSS during one step after a warm-up step; 'work' = peak - model", flush=True)
    cases = [("train", "fp32"), ("train", "bf16"), ("forward", "fp32"), ("forward", "bf16"),
             ("generate b1", "fp32"), ("generate b8", "fp32"), ("generate b1", "bf16")]
    for case, dtype in [c for c in cases if c[1] in args.dtypes]:
        cells, peaks = [], {}
        for impl in ["ours"] + [f"hf-{i}" for i in args.hf_impls]:
            r = run_child(dict(case=case, dtype=dtype, impl=impl, preset="gpt2", new_tokens=args.new_tokens),
                          args.threads)
            peaks[impl] = r["peak_mb"]
            cells.append(f"{impl} model {r['model_mb']:6.0f} peak {r['peak_mb']:6.0f} work {r['peak_mb'] - r['model_mb']:6.0f}")
        print(f"{case:<12} {dtype:<5} MB  " + "  |  ".join(cells), flush=True)
        hf = [v for k, v in peaks.items() if k.startswith("hf")]
        RECORDS.add(f"peak RSS {case} {dtype}", peaks, "MB", ratio=peaks["ours"] / min(hf) if hf else None,
                    ratio_of="ours / smallest transformers" if hf else None)


def section_xl(args) -> None:
    print(f"gpt2-xl (1.5B) at random init, bf16 weights, greedy, 16-token prompt + {args.xl_new_tokens} new tokens, "
          "each in a fresh process:", flush=True)
    rates, peaks = {}, {}
    for impl in ("ours", "hf-sdpa"):
        r = run_child(dict(case="generate b1", dtype="bf16", impl=impl, preset="gpt2-xl", new_tokens=args.xl_new_tokens),
                      args.threads)
        rates[impl], peaks[impl] = r["tokens_per_s"], r["peak_mb"]
        print(f"  {impl:<8} {r['tokens_per_s']:6.2f} new tokens/s   model {r['model_mb'] / 1024:5.2f} GiB   "
              f"peak {r['peak_mb'] / 1024:5.2f} GiB", flush=True)
    RECORDS.add("gpt2-xl generate b1 bf16", rates, "new tokens/s", ratio=rates["ours"] / rates["hf-sdpa"],
                ratio_of="ours / transformers sdpa", notes="peak RSS MB: " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))


def section_checkpointing(args) -> None:
    print("gpt2-medium training step, batch 4 x 128, fp32, ours, each in a fresh process:", flush=True)
    results = {}
    for on in (False, True):
        r = run_child(dict(case="train", dtype="fp32", impl="ours", preset="gpt2-medium", checkpointing=on), args.threads)
        results[on] = r
        print(f"  gradient checkpointing {'on ' if on else 'off'}  {r['tokens_per_s']:6.1f} tokens/s   "
              f"peak {r['peak_mb']:6.0f} MB   work {r['peak_mb'] - r['model_mb']:6.0f} MB", flush=True)
    saved = (results[False]["peak_mb"] - results[True]["peak_mb"])
    RECORDS.add("gpt2-medium train fp32, gradient checkpointing", {
        "off": results[False]["tokens_per_s"], "on": results[True]["tokens_per_s"]}, "tokens/s",
        ratio=results[True]["tokens_per_s"] / results[False]["tokens_per_s"], ratio_of="on / off",
        notes=f"peak RSS off {results[False]['peak_mb']:.0f} MB, on {results[True]['peak_mb']:.0f} MB")
    print(f"  checkpointing saves {saved:.0f} MB of peak RSS and costs "
          f"{100 * (results[False]['tokens_per_s'] / results[True]['tokens_per_s'] - 1):.0f}% more time per step",
          flush=True)


# ---- machine -------------------------------------------------------------------------------------------------------

def gemm_gflops(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """GFLOP/s of a 1024 x 768 x 3072 product in `dtype`, each library timed for `seconds`: torch's matmul and, for
    fp32 on the CPU, oneDNN's inner product, the faster of the two (MKL's sgemm, torch's fp32 product, ran at half
    oneDNN's rate on an AMD Zen 5: the peak is the machine's, not one library's; modules/onednn.py)."""
    a, b = torch.randn(1024, 768, dtype=dtype, device=DEVICE), torch.randn(768, 3072, dtype=dtype, device=DEVICE)
    products = [lambda: a @ b]
    if dtype == torch.float32 and DEVICE.type == "cpu" and onednn.has_inner_product():
        products.append(lambda: onednn.linear(a, b.t()))
    best = 0.0
    for product in products:
        product()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            product()
            n += 1
        _sync()
        best = max(best, n * 2 * 1024 * 768 * 3072 / (time.perf_counter() - start) / 1e9)
    return best


_READ_BANDWIDTH: list[float] = []
_GEMM: dict[torch.dtype, float] = {}  # GFLOP/s of a 1024 x 768 x 3072 product per dtype, measured once


def read_bandwidth() -> float:
    """Memory read bandwidth in GB/s (measured once): the best of several sums of a 512 MB fp32 tensor."""
    if not _READ_BANDWIDTH:
        x, best = torch.ones(128 * 2**20, device=DEVICE), float("inf")
        for _ in range(7):
            start = time.perf_counter()
            x.sum().item()
            best = min(best, time.perf_counter() - start)
        _READ_BANDWIDTH.append(x.numel() * x.element_size() / best / 1e9)
    return _READ_BANDWIDTH[0]


def describe_machine() -> None:
    print_machine_header()  # the host CPU, its flags, the date and the load; on cuda the GPU follows
    if DEVICE.type == "cuda":
        props = torch.cuda.get_device_properties(DEVICE)
        print(f"device: {props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, torch "
              f"{torch.__version__}, transformers {transformers.__version__}; TF32 matmul "
              f"{'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}", flush=True)
        return
    caps = torch.backends.cpu.get_cpu_capability()
    native_bf16 = bf16_matmul_is_fast(DEVICE)  # the CPU's bf16 units (oneDNN also runs bf16 without them)
    malloc = "freed memory kept for reuse (--keep-freed-memory), for every contender" if allocator_in_effect() \
        else "glibc's default"
    print(f"torch's CPU capability {caps}, native bf16 GEMM: {'yes' if native_bf16 else 'no'}; transformers "
          f"{transformers.__version__}; malloc: {malloc}", flush=True)
    fp32, bf16 = (_GEMM.setdefault(dtype, gemm_gflops(dtype)) for dtype in (torch.float32, torch.bfloat16))
    print(f"matmul 1024x768x3072: fp32 {fp32:.0f} GFLOP/s (the faster of torch's and oneDNN's), bf16 {bf16:.0f} "
          f"GFLOP/s; memory reads (sum of 512 MB) "
          f"{read_bandwidth():.1f} GB/s", flush=True)
    RECORDS.add("machine", {"fp32 GEMM GFLOP/s": fp32, "bf16 GEMM GFLOP/s": bf16, "reads GB/s": read_bandwidth()},
                "GFLOP/s, GB/s", notes=f"torch CPU capability {caps}; native bf16 GEMM {'yes' if native_bf16 else 'no'}"
                f"; transformers {transformers.__version__}; malloc: {malloc}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = parser.add_argument_group("what to measure")
    g.add_argument("--only", nargs="+", choices=SECTIONS, default=None, help="sections to run (default: all)")
    g.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"],
                   help="precisions to run (bf16 rows take long on CPUs without bf16 matrix instructions)")
    g.add_argument("--hf-impls", nargs="+", choices=("sdpa", "eager"), default=["sdpa", "eager"],
                   help="transformers attention implementations to compare against")
    g.add_argument("--skip-hf-bf16", action="store_true",
                   help="time only ours in bf16 rows (the same-dtype ratios and their targets are then not printed; "
                        "transformers bf16 takes minutes per call on CPUs without bf16 matrix instructions)")
    g.add_argument("--skip-xl", action="store_true",
                   help="skip the gpt2-xl section (about 4 GB per process, minutes per run)")
    g.add_argument("--compile", action="store_true", help="also time torch.compile(ours) for forward and train")
    g.add_argument("--optimizer", choices=("torch", "ours"), default="torch",
                   help="training optimizer for ours: torch.optim.AdamW(foreach) as for HF, or optimizer.AdamW")
    g.add_argument("--train-shapes", nargs="+", default=list(TRAIN_RUN_SHAPES),
                   help="batch x length of the train-run section's steps")
    g.add_argument("--keep-freed-memory", action="store_true",
                   help="glibc malloc keeps freed memory for reuse (training/allocator.py, what fit() does when training "
                        "on the CPU) in this process, so for every contender alike; default: glibc's own behaviour")
    g = parser.add_argument_group("how")
    g.add_argument("--repeats", type=int, default=5, help="timed calls per contender (the median is reported)")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random-init weights and of the inputs")
    g.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the RSS sections memory, xl and "
                   "checkpointing are skipped; timings synchronise the GPU)")
    g.add_argument("--new-tokens", type=int, default=64, help="new tokens per greedy generation")
    g.add_argument("--generate-rows", nargs="+", choices=GENERATE_ROWS, default=list(GENERATE_ROWS),
                   help="rows of the generate section (a long section on a shared machine: run the rows apart)")
    g.add_argument("--loss-steps", type=int, default=20, help="steps of the fp32 vs bf16 loss check (0: skip)")
    g.add_argument("--xl-new-tokens", type=int, default=32, help="new tokens per gpt2-xl generation")
    g.add_argument("--busy", type=int, default=0,
                   help="processes spinning on a core each while the sections run (the machine's GEMM and read "
                        "figures are measured before they start); the rows are recorded apart, named '<row>, N busy "
                        "process(es) beside it'")
    g.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one memory measurement
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    if args.keep_freed_memory and not keep_freed_memory():
        raise SystemExit("--keep-freed-memory: not available here (needs glibc on Linux; GPT2_KEEP_FREED_MEMORY=0 "
                         "turns it off)")
    if args.child:
        return child_main(json.loads(args.child))
    global DEVICE, RECORDS
    DEVICE = torch.device(args.device)
    RECORDS = Recorder("compare_hf", args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    sections = [s for s in (args.only or SECTIONS) if not (s == "xl" and args.skip_xl)]
    if DEVICE.type != "cpu":
        skipped = [s for s in sections if s in CPU_ONLY_SECTIONS]
        sections = [s for s in sections if s not in CPU_ONLY_SECTIONS]
        if skipped:
            print(f"skipping {', '.join(skipped)} on {DEVICE.type}: they measure this process's CPU memory")
    describe_machine()
    state = hf_reference("gpt2", args.seed)
    report = Report()
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)  # kill (or a timeout) still writes the rows measured so far
    spinners, measured = [], len(RECORDS.rows)  # the rows before this are the machine's (measured quiet)
    try:
        if args.busy:
            spinners = spin(args.busy)
            print(f"{args.busy} busy process{'es' if args.busy > 1 else ''} spinning beside the sections", flush=True)
        for name in sections:
            print(f"\n== {name} ==", flush=True)
            if name in ("train", "train-run", "forward", "generate"):
                globals()[f"section_{name.replace('-', '_')}"](args, state, report)
            else:
                globals()[f"section_{name}"](args)
    finally:  # the rows measured so far, also when a later section fails or is interrupted
        stop(spinners)
        if args.busy:  # recorded apart from the quiet rows: bench/report.py shows them as rows of their own
            for record in RECORDS.rows[measured:]:
                record["row"] += busy_suffix(args.busy)
                record["busy"] = args.busy
        RECORDS.write()
    print(f"\ndone in {time.perf_counter() - started:.0f} s; load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
