"""Standing in for another CPU class (GPT2_CPU_FLAGS, .ci/cpu_classes.py): the flags our code reads, the instruction
sets our kernels are built for, and whether bf16 counts as fast, follow the emulated flags; and bf16 counts as fast
only with bf16 matrix instructions, not wherever oneDNN runs bf16 (any AVX512 CPU)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import need_inductor

from modules import rows
from training import precision

ZEN3 = "fpu sse2 avx fma avx2"
ICE_LAKE = "avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni"
ZEN4 = "avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"


@pytest.fixture
def emulate(monkeypatch):
    def set_flags(flags: str | None):
        if flags is None:
            monkeypatch.delenv(rows.CPU_FLAGS_ENV, raising=False)
        else:
            monkeypatch.setenv(rows.CPU_FLAGS_ENV, flags)
    return set_flags


def test_cpu_flags_stand_in_for_the_cpus_own(emulate):
    emulate("  avx2   fma ")
    assert rows.cpu_flags() == "flags\t\t: avx2 fma"  # the shape of /proc/cpuinfo's line: callers split it
    emulate("")
    assert rows.cpu_flags().split() == ["flags", ":"]  # a CPU with none of the flags
    emulate(None)
    assert rows.cpu_flags() != "flags\t\t: avx2 fma"


@pytest.mark.parametrize("flags, target", [
    (ZEN3, ("-march=x86-64-v3", "-mno-avx512f")),
    (ICE_LAKE, ("-march=x86-64-v4", "-mavx512vnni")),
    (ZEN4, ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16")),
    (SAPPHIRE_RAPIDS, ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16")),
    (None, ("-march=native",)),
])
def test_the_kernels_are_built_for_the_emulated_instruction_sets(emulate, flags, target):
    emulate(flags)
    assert rows.native_target() == target


@pytest.mark.parametrize("flags, fast", [(ZEN3, False), (ICE_LAKE, False), (ZEN4, True), (SAPPHIRE_RAPIDS, True),
                                         ("avx2 avx512f amx_bf16", True)])
def test_bf16_is_fast_only_with_bf16_matrix_instructions(emulate, monkeypatch, flags, fast):
    monkeypatch.setattr(precision, "_onednn_bf16", lambda: True)  # oneDNN runs bf16 on any AVX512 CPU (Ice Lake too)
    emulate(flags)
    assert precision.bf16_matmul_is_fast("cpu") is fast
    monkeypatch.setattr(precision, "_onednn_bf16", lambda: False)  # oneDNN held below AVX512 (ONEDNN_MAX_CPU_ISA)
    assert precision.bf16_matmul_is_fast("cpu") is False
    assert precision.bf16_matmul_is_fast("meta") is True  # off the CPU: the device's own units


def test_off_x86_onednns_check_decides(monkeypatch):
    monkeypatch.setattr(rows, "cpu_flags", lambda: "aarch64")  # no x86 flags line (an ARM CPU: platform.processor())
    monkeypatch.setattr(precision.platform, "machine", lambda: "aarch64")
    for onednn in (True, False):
        monkeypatch.setattr(precision, "_onednn_bf16", lambda onednn=onednn: onednn)
        assert precision.bf16_matmul_is_fast("cpu") is onednn


def test_x86_without_proc_cpuinfo_asks_torchs_cpuinfo(monkeypatch):
    monkeypatch.setattr(rows, "cpu_flags", lambda: "Intel64 Family 6 Model 143")  # Windows' platform.processor()
    monkeypatch.setattr(precision.platform, "machine", lambda: "AMD64")
    monkeypatch.setattr(precision, "_onednn_bf16", lambda: True)
    for bf16, amx, fast in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda bf16=bf16: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert precision.bf16_matmul_is_fast("cpu") is fast


def _ci_classes():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / ".ci" / "cpu_classes.py"
    spec = importlib.util.spec_from_file_location("ci_cpu_classes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_stands_in_for_each_class_below_the_machines_own(tmp_path):
    ci = _ci_classes()
    assert ci.below("AMX") == ["AVX512-BF16", "AVX512", "AVX2"]
    assert ci.below("AVX512-BF16") == ["AVX512", "AVX2"] and ci.below("AVX2") == [] and ci.below("other") == []
    from bench.results import cpu_class

    for name in ci.CLASSES:  # each class's flags read back as that class, and its kernels built for it
        env = ci.class_env(name, tmp_path / name)
        assert cpu_class(env["GPT2_CPU_FLAGS"].split()) == name
        assert env["GPT2_KERNEL_CACHE"] != ci.class_env("AVX2", tmp_path / "AVX2")["GPT2_KERNEL_CACHE"] or \
            name == "AVX2"  # a cache of its own: inductor's key misses torch's capability
        assert env["ATEN_CPU_CAPABILITY"] == ("avx2" if name == "AVX2" else "avx512")


@pytest.fixture
def inductor_env(monkeypatch, tmp_path):
    """No cache directory chosen, inductor's default under tmp_path (it follows TMPDIR)."""
    monkeypatch.delenv(rows.INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(rows.tempfile, "tempdir", None)  # gettempdir() caches its answer: ask TMPDIR again
    return tmp_path


def test_inductor_cache_kept_apart_wherever_a_capability_is_set(inductor_env, monkeypatch):
    default = rows._inductor_default_dir()
    assert default.startswith(str(inductor_env))
    monkeypatch.delenv(rows.CAPABILITY_ENV, raising=False)
    assert rows.keep_inductor_cache_apart() is None
    assert os.environ.get(rows.INDUCTOR_CACHE_ENV) in (None, default)  # importing inductor sets its default
    monkeypatch.setenv(rows.CAPABILITY_ENV, " AVX2 ")
    apart = os.path.join(default, "capability-avx2")
    assert rows.keep_inductor_cache_apart() == apart
    assert os.environ[rows.INDUCTOR_CACHE_ENV] == apart
    assert rows.keep_inductor_cache_apart() == apart  # a second call (quant's, then fit's) does not nest it
    assert os.environ[rows.INDUCTOR_CACHE_ENV] == apart
    own = str(inductor_env / "mine")
    monkeypatch.setenv(rows.INDUCTOR_CACHE_ENV, own)  # a directory of the user's: the folder inside it
    monkeypatch.setenv(rows.CAPABILITY_ENV, "avx512/x")
    assert rows.keep_inductor_cache_apart() == os.path.join(own, "capability-avx512_x")
    monkeypatch.setenv(rows.CAPABILITY_ENV, "")
    monkeypatch.delenv(rows.INDUCTOR_CACHE_ENV)
    assert rows.keep_inductor_cache_apart() is None
    assert rows.INDUCTOR_CACHE_ENV not in os.environ


_INT8_ROW = """
import torch
from modules import quant
torch.manual_seed(0)
weight = quant.quantize(torch.randn(256, 128), "int8")
x = torch.randn(1, 128)
got = quant.int8_linear(x, weight, compiled=True, packed=False)
want = quant.int8_linear(x, weight, compiled=False)
print(torch.backends.cpu.get_cpu_capability(), float((got - want).abs().max()))
"""


def test_a_lower_capabilitys_compile_does_not_reach_the_machines_processes(inductor_env):
    """The crash keep_inductor_cache_apart prevents, end to end: quant's compiled int8 loop built in a process run as
    AVX2, then the same loop in a process at the machine's own capability (AVX512): without the guard the second
    process loaded the first's kernel and died ("free(): invalid pointer")."""
    need_inductor()
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"needs a capability above AVX2 to stand below (torch's: "
                    f"{torch.backends.cpu.get_cpu_capability()})")
    env = {k: v for k, v in os.environ.items() if k not in (rows.CAPABILITY_ENV, rows.INDUCTOR_CACHE_ENV)}
    root = Path(__file__).resolve().parents[1]
    for capability in ("avx2", None):
        run_env = dict(env, **({rows.CAPABILITY_ENV: capability} if capability else {}))
        done = subprocess.run([sys.executable, "-c", _INT8_ROW], cwd=root, env=run_env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        reported, diff = done.stdout.split()[-2:]
        assert reported == (capability or "avx512").upper()
        assert float(diff) < 1e-3
    assert (Path(rows._inductor_default_dir()) / "capability-avx2").is_dir()


def fit_with_compile(out: Path) -> dict:
    """fit() of a tiny LM for two steps with --compile (the callers stand torch.compile in)."""
    from test_engine_parts import lm_batches, lm_loss, run_cfg, tiny_lm, token_rows

    from training.engine import fit
    return fit(tiny_lm(), lm_batches(token_rows(4), 2), lm_loss, lambda model: {"acc": 0.0},
               run_cfg(out, compile=True), {})


def test_fit_compiles_into_the_capabilitys_own_cache(monkeypatch, inductor_env):
    """--compile under ATEN_CPU_CAPABILITY: the cache directory is chosen before torch.compile sees the model (torch
    stood in by a recorder: no compile time)."""
    monkeypatch.setenv(rows.CAPABILITY_ENV, "avx2")
    monkeypatch.setattr("training.engine.compile_why_not", lambda device: None)
    chosen = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: chosen.append(os.environ[rows.INDUCTOR_CACHE_ENV])
                        or module)
    fit_with_compile(inductor_env)
    assert chosen == [os.path.join(rows._inductor_default_dir(), "capability-avx2")]


def test_has_cpu_flag_reads_whole_flags_of_the_stand_in(emulate):
    emulate("avx2 avx512_bf16x amx_tile")
    assert rows.has_cpu_flag("amx_tile") and rows.has_cpu_flag("amx_bf16", "amx_tile")
    assert not rows.has_cpu_flag("avx512_bf16")  # a whole flag, not a prefix of another
    assert not rows.has_cpu_flag("amx_bf16") and not rows.has_cpu_flag()


@pytest.fixture
def fresh_inductor_answer():
    rows.inductor_why_not.cache_clear()
    yield
    rows.inductor_why_not.cache_clear()


def test_inductor_why_not_names_the_quoted_path_it_breaks_on(monkeypatch, fresh_inductor_answer):
    def shlex_fails(fn, **kw):
        raise ValueError("No closing quotation\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
    monkeypatch.setattr(torch, "compile", shlex_fails)
    why = rows.inductor_why_not()
    assert why.startswith("ValueError: No closing quotation (torch's C++ builder splits its command with shlex")
    assert str(Path(torch.__file__).parent) in why and "TORCHDYNAMO" not in why
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    assert rows.inductor_why_not() == why  # asked once a process
    rows.inductor_why_not.cache_clear()
    assert rows.inductor_why_not() is None


def test_fit_trains_eagerly_with_a_warning_where_inductor_cannot_build(monkeypatch, tmp_path):
    monkeypatch.setattr("training.engine.compile_why_not", lambda device: "ValueError: No closing quotation")
    monkeypatch.setattr(torch, "compile", lambda *a, **kw: pytest.fail("compiled although inductor cannot build"))
    with pytest.warns(UserWarning, match=r"--compile: torch.compile cannot build its C\+\+ here \(ValueError: No "
                                         r"closing quotation\); training eagerly instead"):
        result = fit_with_compile(tmp_path)
    assert result["steps_run"] == 2


def test_compile_is_checked_where_inductor_builds_cpu_code(monkeypatch):
    from training import engine
    monkeypatch.setattr(engine, "inductor_why_not", lambda: "the reason")
    assert engine.compile_why_not(torch.device("cpu")) == "the reason"
    assert engine.compile_why_not(torch.device("meta")) is None  # another device: not inductor's C++ (triton on GPUs)
