"""Decoding's products of a few rows by a weight, in modules/rows.cpp: 1 to 8 rows x (B, in) times a (out, in)
weight in fp32, bf16, int8 (per-row scales) or int4 (modules/quant.py's Int4Weight: a uint8 tensor of two values a
byte and (out, in / group) scales), each weight row read once for all rows; int8 and int4 also with the rows quantized
to int8 in blocks of 32 and multiplied in integers (prepared(..., int8_activations=True): quantize="w8a8" / "w4a8").

The kernel is compiled with the machine's own C++ compiler (-O3 -march=native -fopenmp) the first time it is used
on a machine (about two seconds), cached by source, compiler and CPU flags, and called through ctypes. Where it
cannot be built (no compiler, a CPU without AVX2 and FMA, not x86) or GPT2_ROWS_KERNEL=0 is set, `available()` is
False and callers keep torch's own products. Its sums run in another order than torch's: the results agree with
F.linear to float rounding.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("rows.cpp")
MAX_ROWS = 8
ACTIVATION_BLOCK = 32  # activation columns per int8 scale (rows.cpp's kQBlock)
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}  # uint8: int4, two values a byte
_library = None  # the loaded ctypes library; False once building or loading failed here


@functools.cache
def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()  # asked once: pays() runs in every decode product


def cpu_flags() -> str:
    """The CPU's flags line from /proc/cpuinfo (elsewhere platform.processor()): part of the kernel's cache key, and
    what modules/packed.py reads AMX from. GPT2_CPU_FLAGS (space-separated flags, as /proc/cpuinfo spells them) stands
    in for the CPU's own: with torch's and oneDNN's own caps (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) it makes this
    machine take another CPU class's paths (.ci/cpu_classes.py), and the kernels are built for those flags
    (native_target)."""
    emulated = os.environ.get(CPU_FLAGS_ENV)
    if emulated is not None:
        return "flags\t\t: " + " ".join(emulated.split())
    return _own_flags()


def has_cpu_flag(*names: str) -> bool:
    """Whether the CPU's flags (cpu_flags: GPT2_CPU_FLAGS where set) name any of `names` (as /proc/cpuinfo spells them:
    "amx_bf16", "avx512_bf16")."""
    flags = set(cpu_flags().split())
    return any(name in flags for name in names)


@functools.cache
def _own_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("GPT2_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "gpt2-cs224n", "kernels")
    return Path(root)


NATIVE = ("-march=native",)
AVX2 = ("-march=x86-64-v3", "-mno-avx512f")  # the AVX2 + FMA path, for testing it on a CPU that also has AVX512
CPU_FLAGS_ENV = "GPT2_CPU_FLAGS"
# the flags past AVX512's baseline (x86-64-v4) that the kernels' code is chosen by, and gcc's option for each
_EXTENSIONS = (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16"), ("amx_tile", "-mamx-tile"),
               ("amx_int8", "-mamx-int8"), ("amx_bf16", "-mamx-bf16"))


def native_target() -> tuple[str, ...]:
    """The build's target for this CPU: -march=native, or under GPT2_CPU_FLAGS the instruction sets those flags name
    (AVX2: x86-64-v3 without AVX512; AVX512: x86-64-v4 and the extensions listed), so a kernel built while this
    machine stands in for another CPU holds to that CPU's instructions."""
    if os.environ.get(CPU_FLAGS_ENV) is None:
        return NATIVE
    if not has_cpu_flag("avx512f"):
        return AVX2
    return ("-march=x86-64-v4", *(option for flag, option in _EXTENSIONS if has_cpu_flag(flag)))


CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def _inductor_default_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return default_cache_dir()
    except ImportError:  # another torch's layout: inductor's documented default
        return os.path.join(tempfile.gettempdir(), "torchinductor_" + os.environ.get("USER", "user"))


def keep_inductor_cache_apart() -> str | None:
    """Call before torch.compile. torch 2.13's inductor keys its on-disk cache without torch's CPU capability: what a
    process run with ATEN_CPU_CAPABILITY below the machine's (avx2 on an AVX512 CPU) compiles is served to later
    processes at the machine's own capability, which then crash in it ("free(): invalid pointer", "double free") or
    read wrong values, every run until the cache is deleted. So a process with ATEN_CPU_CAPABILITY set compiles into a
    folder of its own inside the cache directory it would use (TORCHINDUCTOR_CACHE_DIR, or inductor's default):
    `capability-<value>`. Returns that folder, or None where the variable is not set (nothing to keep apart)."""
    capability = os.environ.get(CAPABILITY_ENV, "").strip().lower()
    if not capability:
        return None
    name = "capability-" + "".join(c if c.isalnum() else "_" for c in capability)
    chosen = os.environ.get(INDUCTOR_CACHE_ENV) or _inductor_default_dir()
    if os.path.basename(os.path.normpath(chosen)) == name:
        return chosen  # kept apart already (an earlier call)
    apart = os.path.join(chosen, name)
    os.environ[INDUCTOR_CACHE_ENV] = apart
    return apart


@functools.cache
def inductor_why_not() -> str | None:
    """Why torch.compile's inductor cannot build C++ here (asked once a process, by compiling a trivial function into
    the cache keep_inductor_cache_apart chooses), or None. One cause seen: torch 2.13's C++ builder splits its command
    line with shlex, so a quote in the path torch is installed under (a venv in "a newcomer's clone") fails every
    compile with "No closing quotation"; the reason then names that path."""
    keep_inductor_cache_apart()
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(4))
    except Exception as err:  # noqa: BLE001  (whatever inductor raises: its reason is the answer)
        lines = [line.strip() for line in str(err).splitlines() if line.strip() and "TORCHDYNAMO" not in line]
        why = f"{type(err).__name__}: {' '.join(lines)[:200]}"
        if "No closing quotation" in why:
            why += (f" (torch's C++ builder splits its command with shlex; torch is installed under "
                    f"{Path(torch.__file__).parent}, whose quote breaks it)")
        return why
    return None


def _cache_key(source: Path, flags: str = "") -> str:
    """What a cached build (or the plan timed on it) depends on: the source, the flags, the compiler (its version,
    asked each time: an upgraded compiler at the same path builds anew), the CPU."""
    compiler = os.environ.get("CXX", "g++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    return hashlib.sha256(source.read_bytes() + flags.encode() + version.encode()
                          + cpu_flags().encode()).hexdigest()[:16]


def _build(target_flags: tuple[str, ...] = NATIVE, source: Path | None = None, extra: tuple[str, ...] = ()) -> Path:
    """Compile `source` (default rows.cpp) into the cache (once per source, flags, compiler and CPU); returns the
    shared library. modules/adamw.py builds its kernel here too."""
    source = source or SOURCE
    target_flags = native_target() if target_flags == NATIVE else target_flags
    compiler = os.environ.get("CXX", "g++")
    target = _cache_dir() / f"{source.stem}-{_cache_key(source, ' '.join(target_flags + extra))}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", *target_flags, *extra, "-fopenmp", "-shared", "-fPIC", "-std=c++17", str(source),
               "-o", str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a second process building at once ends with the same file
    return target


def pointer(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a kernel's ctypes argument (None: a null pointer)."""
    return None if t is None else t.data_ptr()


def library(target_flags: tuple[str, ...] = NATIVE):
    """The kernel built with `target_flags` and loaded (raises where it cannot be built)."""
    lib = ctypes.CDLL(str(_build(target_flags)))
    lib.rows_product.restype = ctypes.c_int
    lib.rows_product.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_int64]
    lib.rows_product_many.restype = ctypes.c_int
    lib.rows_product_many.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.rows_vector_width.restype = ctypes.c_int
    lib.rows_vnni.restype = ctypes.c_int
    lib.rows_qgemm_amx.restype = ctypes.c_int
    lib.rows_qgemm_amx.argtypes = [ctypes.c_int64]
    lib.rows_prefetch.restype = ctypes.c_int64
    lib.rows_prefetch.argtypes = [ctypes.c_int64]
    lib.rows_prefetch_kind.restype = ctypes.c_int64
    lib.rows_prefetch_kind.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.rows_gelu_tanh.restype = None
    lib.rows_gelu_tanh.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.rows_gelu_tanh_bf16.restype = None
    lib.rows_gelu_tanh_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int]
    lib.rows_gelu_tanh_backward.restype = None
    lib.rows_gelu_tanh_backward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int]
    lib.rows_round_bf16.restype = None
    lib.rows_round_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.rows_softmax.restype = None
    lib.rows_softmax.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 5, ctypes.c_float,
                                 ctypes.c_int]
    lib.rows_softmax_backward.restype = None
    lib.rows_softmax_backward.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 5,
                                          ctypes.c_float, ctypes.c_int]
    lib.rows_layernorm.restype = None
    lib.rows_layernorm.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 6, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_float, ctypes.c_int]
    lib.rows_layernorm_backward.restype = None
    lib.rows_layernorm_backward.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 8, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int]
    lib.rows_transpose16.restype = None
    lib.rows_transpose16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.rows_ce_lse.restype = None
    lib.rows_ce_lse.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int]
    lib.rows_ce_grad.restype = None
    lib.rows_ce_grad.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    for attend in (lib.rows_attend_prompt, lib.rows_attend_prompt_bf16):  # fp32 and bf16 (uint16 bits) tensors
        attend.restype = ctypes.c_int
        attend.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.rows_quantize.restype = ctypes.c_int
    lib.rows_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.rows_minmax.restype = ctypes.c_int
    lib.rows_minmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.rows_quantize_u7.restype = None
    lib.rows_quantize_u7.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_int]
    # the prompt's int8 products (w8a8 / w4a8 prompts of 9+ tokens): the packed weight's bytes, its packing, a product
    lib.rows_qgemm_bytes.restype = ctypes.c_int64
    lib.rows_qgemm_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.rows_qgemm_pack.restype = ctypes.c_int
    lib.rows_qgemm_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.rows_qgemm.restype = ctypes.c_int
    lib.rows_qgemm.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    # models/fast_step.py's whole decoding step (its layers argument: an array of its StepLayer structures)
    for step in (lib.gpt2_step, lib.gpt2_step_bf16):  # an fp32 model's and a bf16 model's (bf16 cache)
        step.restype = ctypes.c_int
        step.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_int]
    lib.gpt2_step_scratch.restype = ctypes.c_int64
    lib.gpt2_step_scratch.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    # and its prompt's pass (one fp32 sequence into an empty cache; its scratch: the step's for no cached keys)
    lib.gpt2_prompt_pass.restype = ctypes.c_int
    lib.gpt2_prompt_pass.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_float,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


def library_step(kind: str = "fp32", rows: int = 1):
    """The kernel a decoding step of `rows` rows takes for weight kind `kind` ('fp32', 'bf16', 'int8', 'int4', 'w8a8',
    'w4a8'), for models/fast_step.py and the decode loops' products: one row, the form the plan chose for the kind
    (timed on one-row products, which the memory bounds); 2-8 rows, the native build, as a prompt's products
    (prompt_library: bound by the arithmetic, where the native build has the wider registers and, on an AVX512-BF16
    CPU, bf16 pair products). Raises where the kernel is not available."""
    if not available():
        raise RuntimeError("the rows kernel is not available here (modules/rows.py)")
    return _library_of(kind, rows)


def _library_of(kind: str, rows: int):
    """library_step's choice, without its check: the plan's form for one row, the prompt's library for more."""
    return library_for(kind) if rows == 1 else prompt_library()


# ---- the plan: which build of the kernel reads each weight kind fastest on this CPU ---------------------------------
# On a CPU with AVX512 the kernel can be built in two forms: -march=native (512-bit vectors) and AVX2 (256-bit). Which
# reads a weight kind faster depends on the core, not on rules: on a 2-core Zen 4 (512-bit operations run as two
# halves) the AVX2 form decoded int8 at 144 tok/s against 129 and int4 at 132 against 149 (fp32 even), 2026-11-26.
# So the forms are timed once per machine, on weights bigger than the caches (as decoding reads them), and the
# choice is kept beside the kernel build (plan-<key>.json); GPT2_DECODE_PLAN=off keeps the native form,
# GPT2_DECODE_PLAN=avx2 (or native) forces that form for every kind.
# `python -m modules.rows` shows the plan, `python -m modules.rows --retime` times it again (a plan timed while the
# machine was busy is as noisy as any benchmark run then).
PLAN_ENV = "GPT2_DECODE_PLAN"
# the weight kinds timed (uint8: int4); w8a8 and w4a8 are the int8 and int4 weights times int8 activations (kinds
# 4 and 5), planned apart: their integer products are other code than the weight-only ones (VNNI's, where the native
# build has it), so the form that reads int8 weights fastest need not multiply them by int8 activations fastest
PLAN_KINDS = {"fp32": torch.float32, "int8": torch.int8, "int4": torch.uint8, "w8a8": torch.int8, "w4a8": torch.uint8,
              "bf16": torch.bfloat16}
_ACTIVATION_KINDS = {"w8a8", "w4a8"}
_PLANNED = {dtype: name for name, dtype in PLAN_KINDS.items() if name not in _ACTIVATION_KINDS}  # plan_kind's
_PLANNED_A8 = {dtype: name for name, dtype in PLAN_KINDS.items() if name in _ACTIVATION_KINDS}
FORMS = {"native": NATIVE, "avx2": AVX2}
MARGIN = 1.05  # another form is taken only when its median is at least 5% faster than the native one's, twice
# The products prefetch their weight stream this many bytes ahead (rows.cpp's kAhead, one distance a weight kind):
# the default, and the distances the plan times per kind in the native form; a kind takes another distance only
# where it read MARGIN faster there. An Ice Lake Xeon read 5-13% faster at 4096 than at 1024 (2026-11-28); a Zen 4
# read int4 1.12-1.40x and fp32 1.06-1.11x faster at 4096, but int8's LM head 0.89x (2026-11-29): one distance for
# every kind cost one of them.
PREFETCH_DEFAULT = 1024
PREFETCH_TIMED = (1024, 2048, 4096)
KIND_INDEX = {name: _KINDS[dtype] + (2 if name in _ACTIVATION_KINDS else 0) for name, dtype in PLAN_KINDS.items()}
# fp32 products of 9 to 128 rows without gradients (a short prompt's pass) may take the kernel (rows_product_many:
# the input rows packed in blocks, each weight element broadcast across a block, the weight streamed through once):
# the plan times that against torch's F.linear at these row counts and keeps the largest up to which every timed
# count was MARGIN faster, twice. gpt2's 48 block weights on a Zen 4 (2026-12-01, 2 threads, medians of 9; torch's
# product is MKL's sgemm): 21 ms against F.linear's 42 at 16 rows, 36 / 60 at 32, 71 / 83 at 64, 128 / 153 at 128,
# 201 / 201 at 192, 259 / 306 at 256, 515 / 481 at 512 (the previous form, rows_at's tiles 8 input rows a pass: 29,
# 47, 90 and 171 ms at 16-128 rows). Weights under PROMPT_MIN_WEIGHT values keep F.linear: a 128-wide model's
# products take microseconds, where the calls' own costs decide (1.35x slower sampling from the README's character
# model when the kernel took them in Python-side chunks of 8 rows). GPT2_PROMPT_KERNEL=0 keeps torch's product; =N
# takes the kernel up to N rows.
PROMPT_ROWS_TIMED = (16, 32, 64, 128)
PROMPT_MIN_WEIGHT = 1 << 18  # values (1 MiB of fp32): 1024 x 256 and up; gpt2's smallest weight is 768 x 768
PROMPT_ENV = "GPT2_PROMPT_KERNEL"
# the prompt's int8 GEMM (rows_qgemm) in AMX-INT8 tiles where the native build has them; "0" keeps VNNI (read by
# rows.cpp at each product)
AMX_ENV = "GPT2_PROMPT_AMX"
_plan: dict | None = None
_forms: dict[str, object] = {}
_prompt_lib: tuple | None = None  # prompt_library's: (the plan, the form, the library at that plan's distances)


def _plan_path() -> Path:
    return _cache_dir() / f"plan-{_cache_key(SOURCE, 'prompt rows ' + ' '.join(map(str, PROMPT_ROWS_TIMED)))}.json"


def time_forms(libs: dict[str, object], megabytes: int = 64, rounds: int = 7,
               kinds: list[str] | None = None) -> dict[str, dict[str, float]]:
    """GB/s of one-row products per weight kind (PLAN_KINDS, or those of `kinds`) and form: a chain of 3072 x 768
    weights (random bytes: the values do not change the work) of `megabytes` in all, more than a CPU's last cache,
    timed in interleaved rounds (median). A contender may be (lib, prefetch bytes): that distance is set before each
    of its timings (time_prefetch)."""
    import statistics
    import time

    out_f, in_f = 3072, 768
    results: dict[str, dict[str, float]] = {}
    for name, dtype in PLAN_KINDS.items():
        if kinds is not None and name not in kinds:
            continue
        kind = KIND_INDEX[name]
        cols = in_f // 2 if dtype == torch.uint8 else in_f  # int4: two values a byte
        count = max(1, megabytes * 2**20 // (out_f * cols * dtype.itemsize))
        weights = [torch.randn(out_f, in_f).to(dtype) if dtype.is_floating_point else
                   torch.randint(-100, 100, (out_f, cols), dtype=torch.int8).view(dtype) for _ in range(count)]
        scale = {torch.uint8: torch.rand(out_f, in_f // 32), torch.int8: torch.rand(out_f)}.get(dtype)
        x, y = torch.randn(in_f), torch.empty(out_f)
        times: dict[str, list[float]] = {form: [] for form in libs}
        for _ in range(rounds):
            for form, lib in libs.items():
                if isinstance(lib, tuple):
                    lib, ahead = lib
                    lib.rows_prefetch(ahead)
                start = time.perf_counter()
                for w in weights:
                    lib.rows_product(kind, 1, x.data_ptr(), in_f, w.data_ptr(),
                                     None if scale is None else scale.data_ptr(), None, y.data_ptr(), out_f,
                                     torch.get_num_threads(), 32)
                times[form].append(time.perf_counter() - start)
        total = sum(w.numel() * w.element_size() for w in weights)
        results[name] = {form: total / statistics.median(t) / 1e9 for form, t in times.items()}
    return results


def time_prompt_rows(lib, counts: tuple[int, ...] | list[int] = PROMPT_ROWS_TIMED, megabytes: int = 64,
                     rounds: int = 5, against: tuple[str, object] | None = None) -> dict[str, dict[str, float]]:
    """{row count (a string: the plan's JSON keys): {"kernel": GB/s, name: GB/s}}: the kernel `lib`'s product of
    many rows (many_rows) against `against` ((name, fn(x, weight, bias)); default torch's F.linear as "torch")
    (time_products). modules/onednn.py races it against oneDNN's."""
    import torch.nn.functional as F

    name, product = against or ("torch", F.linear)
    return time_products({"kernel": lambda x, w, b: many_rows(x, w, b, lib), name: product}, counts, megabytes,
                         rounds)


def time_products(products: dict, counts, megabytes: int, rounds: int) -> dict[str, dict[str, float]]:
    """{row count (a string): {name: GB/s}}: each of `products` (name -> fn(x, weight, bias), an fp32 product of
    F.linear's form) over a chain of 3072 x 768 and 768 x 3072 weights (`megabytes` in all, at least one of each) at
    each row count, in interleaved rounds (medians). The plan's prompt timing and modules/onednn.py's choice."""
    import statistics

    shapes = [(3072, 768), (768, 3072)]
    count = max(2, megabytes * 2**20 // (3072 * 768 * 4))
    weights = [torch.randn(*shapes[i % 2]) for i in range(count)]
    biases = [torch.randn(w.shape[0]) for w in weights]
    total = sum(w.numel() * 4 for w in weights)
    results = {}
    with torch.no_grad():
        for n in counts:
            xs = {768: torch.randn(n, 768), 3072: torch.randn(n, 3072)}
            contenders = {name: (lambda f=f: [f(xs[w.shape[1]], w, b) for w, b in zip(weights, biases)])
                          for name, f in products.items()}
            times = interleaved(contenders, rounds)
            results[str(n)] = {name: total / statistics.median(t) / 1e9 for name, t in times.items()}
    return results


def interleaved(contenders: dict, rounds: int) -> dict[str, list[float]]:
    """{name: seconds per round} of calling each contender once a round, the order reversed every other round (so a
    machine that slows down or speeds up within a round moves them alike); bench/hugepages.py times with it too."""
    import time

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in (list(contenders) if r % 2 == 0 else list(contenders)[::-1]):
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    return times


def choose_prompt_rows(takes: dict[str, str]) -> int:
    """The largest timed row count (takes: {rows: "kernel" or "torch", the faster by MARGIN}) up to which the kernel
    won at every timed count; MAX_ROWS (no chunks) where it did not at the smallest."""
    limit = MAX_ROWS
    for n in sorted(takes, key=int):
        if takes[n] != "kernel":
            break
        limit = int(n)
    return limit


def prompt_rows() -> int:
    """Up to how many rows fp32 products without gradients take the kernel (chunked_linear): GPT2_PROMPT_KERNEL
    if set (0: none beyond MAX_ROWS), else the plan's timing (MAX_ROWS where there is no plan: one form of the
    kernel, or none)."""
    setting = os.environ.get(PROMPT_ENV, "").strip()
    if setting and not setting.isdigit():
        raise ValueError(f"{PROMPT_ENV} must be a row count (0: torch's product beyond {MAX_ROWS} rows), "
                         f"got {setting!r}")
    if not available():  # no kernel here (or GPT2_ROWS_KERNEL=0): nothing to take, whatever the setting
        return MAX_ROWS
    return max(int(setting), MAX_ROWS) if setting else plan().get("prompt_rows", MAX_ROWS)


def takes_chunks(rows: int) -> bool:
    """Whether fp32 products of `rows` rows without gradients take the kernel (chunked_linear): MAX_ROWS < rows <=
    prompt_rows(). Past the largest count the plan times, with GPT2_PROMPT_KERNEL unset, the answer is no without
    asking the plan: a machine's first plan is timed for seconds, and an evaluation's long batches never take chunks."""
    if rows <= MAX_ROWS or (rows > PROMPT_ROWS_TIMED[-1] and not os.environ.get(PROMPT_ENV, "").strip()):
        return False
    return rows <= prompt_rows()


def many_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lib) -> torch.Tensor:
    """x (n, in) fp32 contiguous times a contiguous fp32 weight (out, in) (+ bias) -> (n, out) through `lib`'s
    rows_product_many: the input rows packed in blocks, each weight element broadcast across a block (rows.cpp)."""
    y = torch.empty(x.shape[0], weight.shape[0])
    if lib.rows_product_many(x.shape[0], x.data_ptr(), x.shape[1], weight.data_ptr(),
                             None if bias is None else bias.data_ptr(), y.data_ptr(), weight.shape[0],
                             torch.get_num_threads()) != 0:
        raise ValueError(f"the rows kernel's product of many rows takes at least one row, got {x.shape[0]}")
    return y


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for fp32 x (..., in) of any number of rows and a contiguous fp32 weight, through the
    kernel's product of many rows (many_rows; prompt_rows says where it pays); the same values to float rounding
    (another summation order)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous() \
            or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"chunked_linear takes fp32 x (..., in) and a contiguous fp32 weight (out, in), got "
                         f"{x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    flat = _fp32_contiguous(x.reshape(-1, x.shape[-1]))
    bias = _fp32_contiguous(bias)
    return many_rows(flat, weight, bias, prompt_library()).view(*x.shape[:-1], weight.shape[0])


def time_prefetch(lib, distances=PREFETCH_TIMED, **kwargs) -> dict[str, dict[str, float]]:
    """{kind: {distance: time_forms' GB/s}} for `lib` at each prefetch distance (as strings: the plan's JSON keys);
    the library is left at the default distance."""
    try:
        return time_forms({str(d): (lib, d) for d in distances}, **kwargs)
    finally:
        lib.rows_prefetch(PREFETCH_DEFAULT)


def choose_prefetch(speeds: dict[str, float]) -> int:
    """The distance that read fastest where it beat the default's speed by MARGIN, else the default (one kind's)."""
    return int(_faster(speeds, str(PREFETCH_DEFAULT)))


def prefetch_of(chosen: dict, kind: str) -> int:
    """A plan's distance for `kind`: its per-kind choice; the default for a kind it did not time or a plan without
    distances."""
    ahead = chosen.get("prefetch", {})
    return ahead if isinstance(ahead, int) else ahead.get(kind, PREFETCH_DEFAULT)


def machine_busy() -> str | None:
    """Why timing the forms now would measure other processes (the 1-minute load average above three quarters of
    the cores: a plan timed so read 0.3-1.2 GB/s for every form), or None."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"load average {load:.1f} on {cores} cores" if load > 0.75 * cores else None


def _faster(speeds: dict[str, float], baseline: str) -> str:
    """The fastest of `speeds` where it read at least MARGIN times the baseline's speed, else the baseline."""
    best = max(speeds, key=speeds.get)
    return best if speeds[best] >= MARGIN * speeds.get(baseline, 0.0) else baseline


def choose(speeds: dict[str, dict[str, float]]) -> dict[str, str]:
    """The form per kind: another form where it read at least MARGIN times the native one's speed, else native."""
    return {kind: _faster(by_form, "native") for kind, by_form in speeds.items()}


def plan_kind(dtype: torch.dtype, int8_activations: bool = False) -> str:
    """The plan's name for a weight dtype's products ('fp32', 'int8', 'int4', 'bf16'; 'w8a8' / 'w4a8' with int8
    activations; 'fp32' for a pair the kernel refuses, such as float weights with int8 activations: `prepared` says
    so after loading the library)."""
    return (_PLANNED_A8 if int8_activations else _PLANNED).get(dtype, "fp32")


def _confirmed(chosen: dict[str, str], baseline: str, time_again) -> tuple[dict[str, str], dict]:
    """`chosen` (kind -> the form or distance taken, a key of its speeds) with each change from `baseline` kept only
    where `time_again(kinds)`, a second timing of those kinds, shows it MARGIN faster too (`_faster`'s test); and that
    second timing ({} where nothing changed). One timing's 5% is within a host's noise: a Zen 4's plan took the AVX2
    form for fp32 at 35.8 GB/s against 31.7, and whole fp32 decodes then ran 0.86x the native form's speed."""
    doubted = [kind for kind, choice in chosen.items() if choice != baseline]
    again = time_again(doubted) if doubted else {}
    return {kind: _faster({c: again[kind][c] for c in (choice, baseline)}, baseline) if kind in again else choice
            for kind, choice in chosen.items()}, again


def plan() -> dict:
    """{'forms': {kind: form}, 'speeds': {kind: {form: GB/s}}, 'source': ...}: read from the cache, else timed now
    (where the CPU has AVX512: both forms exist) and cached; all native where there is one form or the plan is off."""
    global _plan
    if _plan is not None:
        return _plan
    native = {kind: "native" for kind in PLAN_KINDS}
    setting = os.environ.get(PLAN_ENV, "on")
    if setting == "off":
        _plan = {"forms": native, "speeds": {}, "source": f"{PLAN_ENV}=off"}
    elif setting in FORMS and available():  # one form forced for every kind (the AVX2 form tested on an AVX512 CPU)
        _plan = {"forms": {kind: setting for kind in PLAN_KINDS}, "speeds": {}, "source": f"{PLAN_ENV}={setting}"}
    elif not available() or _capability() != "AVX512":
        _plan = {"forms": native, "speeds": {}, "source": "one form of the kernel here"}
    else:
        path = _plan_path()
        try:
            _plan = json.loads(path.read_text())
        except (OSError, ValueError):
            if busy := machine_busy():  # timings now would be noise: native for this process, timed by a later one
                _plan = {"forms": native, "speeds": {}, "source": f"not timed: the machine is busy ({busy})"}
                return _plan
            libs = {"native": _load()}
            try:
                libs["avx2"] = _form("avx2")
                speeds = time_forms(libs)
            except Exception as err:  # the AVX2 form does not build: the native one for every kind
                _plan = {"forms": native, "speeds": {}, "source": f"not timed ({type(err).__name__}: {err})"}
                return _plan
            ahead = time_prefetch(libs["native"])
            forms, again = _confirmed(choose(speeds), "native", lambda kinds: time_forms(libs, kinds=kinds))
            distances, ahead_again = _confirmed(
                {kind: str(choose_prefetch(by_distance)) for kind, by_distance in ahead.items()}, str(PREFETCH_DEFAULT),
                lambda kinds: time_prefetch(libs["native"], kinds=kinds))
            prefetch = {kind: int(distance) for kind, distance in distances.items()}
            prompt_lib = libs["native"]  # (prompt_library's form)
            _set_prefetch(prompt_lib, {"prefetch": prefetch})  # the prompt's products read at the chosen distances
            prompt = time_prompt_rows(prompt_lib)
            takes, prompt_again = _confirmed({n: _faster(s, "torch") for n, s in prompt.items()}, "torch",
                                             lambda counts: time_prompt_rows(prompt_lib, [int(n) for n in counts]))
            prompt_limit = choose_prompt_rows(takes)
            _plan = {"forms": forms, "speeds": speeds, "prefetch": prefetch, "prefetch_speeds": ahead,
                     "prompt_rows": prompt_limit, "prompt_speeds": prompt,
                     "confirmed_by": {"speeds": again, "prefetch_speeds": ahead_again, "prompt_speeds": prompt_again},
                     "source": f"timed, cached in {path}"}
            write_timing(path, _plan)
    return _plan


def write_timing(path: Path, record: dict) -> None:
    """A timing's record (the plan, modules/onednn.py's choice) as JSON at `path`, atomically: another process timing
    at once ends with one whole file. Where the cache cannot be written its "source" says so, and the record holds for
    this process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError as err:
        record["source"] = f"timed, not cached ({err})"


def _form(form: str):
    if form == "native":
        return _load()
    if form not in _forms:
        _forms[form] = library(FORMS[form])
    return _forms[form]


def library_for(kind: str):
    """The loaded kernel in the form the plan chose for `kind` (the native form where the plan says so), each weight
    kind's prefetch distance set to the plan's (the default where the plan has none): a decoding step's products
    may be of several kinds."""
    chosen = plan()
    lib = _form(chosen["forms"].get(kind, "native"))
    _set_prefetch(lib, chosen)
    return lib


def prompt_library():
    """The kernel a prompt's products of many rows take (chunked_linear): the native build, or the form
    GPT2_DECODE_PLAN forces (the AVX2 form tested on an AVX512 CPU), at the plan's prefetch distances. Not the plan's
    fp32 form: that is timed on one-row products, where both forms read the memory alike within a host's noise (a
    Zen 4's plan once took the AVX2 form by 5%), while many rows are bound by the arithmetic, which the native
    AVX512 build does with twice the registers of twice the width (the AVX2 form's prompt products on a Zen 4 read
    11.0 GB/s at 16 rows and lost to F.linear from 64 rows, against 13.5 and 1.3-1.4x F.linear for the native one)."""
    global _prompt_lib
    setting = os.environ.get(PLAN_ENV, "on")
    form, chosen = setting if setting in FORMS and available() else "native", plan()
    if _prompt_lib is None or _prompt_lib[0] is not chosen or _prompt_lib[1] != form:  # once per plan and form, not
        lib = _form(form)  # once per product: a batched decode step takes 73 of them
        _set_prefetch(lib, chosen)
        _prompt_lib = (chosen, form, lib)
    return _prompt_lib[2]


def _set_prefetch(lib, chosen: dict) -> None:
    """Each weight kind's prefetch distance in `lib` set to the plan's (`prefetch_of`)."""
    for name, index in KIND_INDEX.items():
        lib.rows_prefetch_kind(index, prefetch_of(chosen, name))


def load_kernel(env: str, build, what: str, otherwise: str, usable=lambda: True):
    """`build()`'s loaded library, or False where `env` is "0", the machine is not x86-64 Linux, `usable()` is false,
    or the build fails (no compiler, a compiler error: a warning names `what` and what runs `otherwise`). The
    kernels here (rows.cpp, adamw.cpp, dropout.cpp) each load once through it."""
    if (os.environ.get(env, "1") == "0" or sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64")
            or not usable()):
        return False
    try:
        return build()
    except Exception as err:  # no compiler, a failed build: the caller's fallback from here on
        warnings.warn(f"{what} could not be built ({type(err).__name__}: {str(err)[:500]}); {otherwise}",
                      stacklevel=4)
        return False


def wrote(*tensors: torch.Tensor) -> None:
    """Leave tensors a kernel wrote through data_ptr() as torch leaves them after an in-place op: their version
    counters bumped. Caches of derived weights (modules/packed.py, modules/quant.py) key on the version, and autograd
    refuses a backward through a tensor changed since it was saved; a write torch cannot see would fool both."""
    torch.autograd.graph.increment_version(tensors)


def _load():
    global _library
    if _library is None:
        _library = load_kernel("GPT2_ROWS_KERNEL", library, "the decoding kernel modules/rows.cpp",
                               "decoding uses torch's products (slower)",
                               usable=lambda: _capability() in ("AVX2", "AVX512"))
    return _library


def available() -> bool:
    """Whether the kernel is built and loaded here (building it on the first call)."""
    return bool(_load())


def in_features(weight: torch.Tensor) -> int:
    """The input features a kernel weight takes: its columns, twice them for int4's bytes (uint8)."""
    return weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rows_linear takes these: CPU tensors, 1 to 8 rows of x's last dimension, a contiguous weight whose
    dtype the kernel reads, and x in fp32 or bf16."""
    return (x.is_cpu and weight.is_cpu and weight.dim() == 2 and weight.dtype in _KINDS and weight.is_contiguous()
            and x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] == in_features(weight)
            and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and not torch.is_grad_enabled() and available())


def pays(dtype: torch.dtype, rows: int) -> bool:
    """Where the kernel read the weights faster than torch's best product for that shape (bench/rows_kernel.py), in
    whole decodes (docs/performance.md). fp32, int8 and int4 with 1 to 8 rows wherever the kernel builds (AVX2 or
    AVX512): fp32 one row since row_dot reads each thread's rows as one stream (gpt2's LM head read cold 19.2-19.5
    GB/s against 16.2-17.1 for torch's row-blocked product on a Zen 4; on a Zen 3 whole greedy decodes with the
    head in the kernel were a few percent faster in an interleaved check, 2026-11-27, not a bench record); torch's
    one-row int8 loop read 1.7-2.4 GB/s on a Zen 3 against the kernel's 10-11, and torch has no product that reads
    4-bit weights, only the dequantized copy. bf16 with 1 to 8 rows: with AVX2 only torch's bf16 products read 1.7-11
    GB/s against the kernel's 7-13; on an AVX512-BF16 Zen 4, once the plan timed bf16 (the AVX2 form, 4096 bytes
    ahead), gpt2's whole greedy batch-8 decodes ran at 288 tok/s against 214 with torch's (W x^T)^T and 259 with
    F.linear (oneDNN's bf16 product), 2026-11-29."""
    capability = _capability()
    if not 1 <= rows <= MAX_ROWS or capability not in ("AVX2", "AVX512"):
        return False
    return dtype in (torch.float32, torch.bfloat16, torch.int8, torch.uint8)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """F.linear(x, weight * scale[:, None], bias) for x (..., in) with at most 8 rows -> (..., out) in x's dtype.
    int8 weights need their per-row fp32 `scale`; int4 weights (uint8, Int4Weight.q) their (out, in / group) group
    scales, which give the group. Check `applies(x, weight)` first. lib: a `library(...)` to use instead of the one
    loaded for this machine (tests of the AVX2 path)."""
    return run(prepared(weight, bias, scale, lib), x)


def run(call, x: torch.Tensor) -> torch.Tensor:
    """A `prepared` product on x (..., in), fp32 or bf16, any layout -> (..., out) in x's dtype."""
    y = call(_fp32_contiguous(x.reshape(-1, x.shape[-1])))  # no copy for contiguous fp32 rows
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])


def prepared(weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None, lib=None,
             int8_activations: bool = False, rows: int = 1):
    """The kernel's product for one weight with its lookups done once -> a function of x (..., in), fp32 and
    contiguous, with 1 to 8 rows, returning (..., out) fp32 (rows_linear makes one per call). The decode loop keeps
    one per layer: the checks and conversions cost about 8 us a call, 0.6 ms a gpt2 token. The function holds the
    tensors it points at, so the pointers stay valid; it reads their current values (in-place changes are seen), and
    is made again when a tensor is replaced (quantized_weights does so at every generate call).
    int8_activations (int8 and int4 weights, `in` a multiple of 32): the rows are quantized to int8 in blocks of 32
    columns first and multiplied in integers (quantize="w8a8" / "w4a8": modules/quant.py).
    rows: the row count the calls will have (a decode loop's batch), which picks the library as library_step does;
    lib overrides it."""
    if weight.dtype == torch.int8 and scale is None:
        raise ValueError("an int8 weight needs its per-row scale")
    if not weight.is_contiguous():
        raise ValueError("the weight must be contiguous (row-major)")
    out_features, n_in = weight.shape[0], in_features(weight)
    group = 0  # int4's group size; the other kinds ignore it
    if weight.dtype == torch.uint8:
        if scale is None or scale.dim() != 2 or scale.shape[0] != out_features or not scale.shape[1] \
                or n_in % scale.shape[1]:
            raise ValueError(f"an int4 weight of {out_features} rows and {n_in} features needs (out, in / group) "
                             f"group scales, got {None if scale is None else tuple(scale.shape)}")
        group = n_in // scale.shape[1]
        if group % 32:
            raise ValueError(f"the rows kernel reads int4 groups of a multiple of 32 values, got {group}")
    lib = lib or _library_of(plan_kind(weight.dtype, int8_activations), rows)
    bias, scale = _fp32_contiguous(bias), _fp32_contiguous(scale)
    kind = _KINDS[weight.dtype]
    if int8_activations:
        if weight.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"int8 activations take int8 or int4 weights, got {weight.dtype}")
        if n_in % ACTIVATION_BLOCK:
            raise ValueError(f"int8 activations are quantized in blocks of {ACTIVATION_BLOCK} columns: the weight "
                             f"takes {n_in} inputs, not a multiple of {ACTIVATION_BLOCK}")
        kind += 2  # 4: int8 x int8, 5: int4 x int8
    pointers = (weight.data_ptr(), None if scale is None else scale.data_ptr(), None if bias is None else bias.data_ptr())
    product = lib.rows_product

    def call(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.numel() // n_in, out_features)
        if product(kind, y.shape[0], x.data_ptr(), n_in, *pointers, y.data_ptr(), out_features,
                   torch.get_num_threads(), group) != 0:
            raise ValueError(f"the rows kernel takes 1 to {MAX_ROWS} rows, got {y.shape[0]}")
        return y.view(*x.shape[:-1], out_features)

    call.tensors = (weight, bias, scale)
    return call


def _fp32_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
        return t  # per call, so the no-op case costs no torch call
    return t.to(torch.float32).contiguous()


if __name__ == "__main__":  # python -m modules.rows [--retime]: the plan of this machine (--retime: time it again)
    if "--retime" in sys.argv[1:] and available():
        _plan_path().unlink(missing_ok=True)
    chosen = plan()
    print(f"rows kernel: {'available' if available() else 'not available'}; CPU capability {_capability()}; "
          f"plan ({chosen['source']}):")
    again = chosen.get("confirmed_by", {})

    def shown(by: dict[str, float], second: dict[str, float] | None) -> str:
        return "  ".join(f"{f} {v:.1f} GB/s" for f, v in by.items()) + (
            "; again: " + "  ".join(f"{f} {v:.1f}" for f, v in second.items()) if second else "")

    for kind, form in chosen["forms"].items():
        print(f"  {kind:<5} {form:<7} " + shown(chosen["speeds"].get(kind, {}), again.get("speeds", {}).get(kind)))
    timed = chosen.get("prefetch_speeds", {})
    for kind in PLAN_KINDS:
        print(f"  {kind:<5} prefetch {prefetch_of(chosen, kind)} bytes ahead" + (": native form, " if timed else "")
              + shown(timed.get(kind, {}), again.get("prefetch_speeds", {}).get(kind)))
    print(f"  fp32 products of {MAX_ROWS + 1} to {prompt_rows()} rows without gradients: the kernel's product of many "
          "rows, timed against F.linear (a prompt's rows: `python -m modules.onednn`)" if prompt_rows() > MAX_ROWS
          else f"  fp32 products of more than {MAX_ROWS} rows: torch's (F.linear, or oneDNN: "
               "`python -m modules.onednn`)")
    for n, by in chosen.get("prompt_speeds", {}).items():
        print(f"    {n} rows: " + shown(by, again.get("prompt_speeds", {}).get(n)))
