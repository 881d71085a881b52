"""Standing in for another CPU class (GPT2_CPU_FLAGS, .ci/cpu_classes.py): the flags our code reads, the instruction
sets our kernels are built for, and whether bf16 counts as fast, follow the emulated flags; and bf16 counts as fast
only with bf16 matrix instructions, not wherever oneDNN runs bf16 (any AVX512 CPU)."""
from __future__ import annotations

import pytest

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
    import torch

    monkeypatch.setattr(rows, "cpu_flags", lambda: "Intel64 Family 6 Model 143")  # Windows' platform.processor()
    monkeypatch.setattr(precision.platform, "machine", lambda: "AMD64")
    monkeypatch.setattr(precision, "_onednn_bf16", lambda: True)
    for bf16, amx, fast in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda bf16=bf16: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert precision.bf16_matmul_is_fast("cpu") is fast


def _ci_classes():
    import importlib.util
    from pathlib import Path

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
