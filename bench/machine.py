"""The header every benchmark prints first, so a pasted table always carries its machine: CPU model, cores, the
instruction-set flags that decide the fast paths, the date and the load.

    from bench.machine import print_machine_header
    print_machine_header()   # machine: AMD EPYC ..., 2 cores; avx2 avx512f avx512_bf16 avx512_vnni, no amx; ...

And the benchmarks' `--busy N` (a machine with N cores taken by other processes): `spin(N)` starts the processes,
`stop(...)` ends them, and `busy_suffix(N)` is what each row measured so carries after its name.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

# the flags that pick a kernel here: AVX2 vs AVX512 fp32, native bf16 (AVX512-BF16, AMX), int8 dot products (VNNI)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_model_and_flags(cpuinfo: str | None = None) -> tuple[str, set[str] | None]:
    """The CPU's model name and its flags from /proc/cpuinfo (flags None where that file is absent: not Linux)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    model = flags = None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    return model or platform.processor() or platform.machine(), flags


# The core design behind a (vendor, family, model): a cloud's CPUs often say only "AMD EPYC" or "Intel(R) Xeon(R)
# Processor", and the same flags run at different speeds on different cores (a Zen 4 runs its 512-bit vectors in two
# 256-bit halves, a Zen 5 whole: twice the bf16 GEMM on the same flags). AMD: family 25 is Zen 3 or Zen 4 by model,
# 26 is Zen 5; Intel family 6 by model.
AMD_FAMILY_25_ZEN4 = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))
INTEL_FAMILY_6 = {0x55: "Skylake-SP", 0x6A: "Ice Lake", 0x6C: "Ice Lake", 0x8F: "Sapphire Rapids",
                  0xCF: "Emerald Rapids", 0xAD: "Granite Rapids", 0xAE: "Granite Rapids"}


def cpu_core(cpuinfo: str | None = None) -> dict | None:
    """{"core": name or None, "family": int, "model": int} of the first CPU in /proc/cpuinfo; None where it says no
    family (not Linux, not x86). The name is None for a (vendor, family, model) not known here."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return None
    vendor, name = fields.get("vendor_id", ""), None
    if vendor == "AuthenticAMD" and family == 25:
        name = "Zen 4" if any(model in r for r in AMD_FAMILY_25_ZEN4) else "Zen 3"
    elif vendor == "AuthenticAMD" and family == 26:
        name = "Zen 5"
    elif vendor == "GenuineIntel" and family == 6:
        name = INTEL_FAMILY_6.get(model)
    return {"core": name, "family": family, "model": model}


def machine_header(cpuinfo: str | None = None) -> str:
    model, flags = cpu_model_and_flags(cpuinfo)
    core = cpu_core(cpuinfo)
    if core is not None:
        model += f" ({core['core'] + ', ' if core['core'] else ''}family {core['family']} model {core['model']})"
    if flags is None:
        isa = "flags unknown (no /proc/cpuinfo)"
    else:
        have = [f for f in FLAGS if f in flags]
        lacks = [f for f in FLAGS if f not in flags]
        isa = " ".join(have) + (", no " + " ".join(lacks) if lacks else "")
    torch = sys.modules.get("torch")  # named only when the benchmark already imported it (no import cost here)
    version = f"; torch {torch.__version__}, {torch.get_num_threads()} threads" if torch is not None else ""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"machine: {model}, {os.cpu_count()} cores; {isa}{version}; {now}; load average {load}"


def print_machine_header() -> None:
    """The machine line, and where the benchmark imported torch, the CPU-dependent paths this machine takes
    (models/paths.py: `python -m models.paths` says why)."""
    print(machine_header(), flush=True)
    if "torch" in sys.modules:
        from models import paths

        print(f"paths: {paths.summary()}", flush=True)


def spin(count: int) -> list[subprocess.Popen]:
    """`count` processes each spinning on a core, until `stop`."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(spinners: list[subprocess.Popen]) -> None:
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


def busy_suffix(busy: int) -> str:
    """What a row measured with `busy` spinning processes beside it carries after its name ('' for none)."""
    return f", {busy} busy process{'es' if busy > 1 else ''} beside it" if busy else ""
