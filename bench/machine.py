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


def machine_header(cpuinfo: str | None = None) -> str:
    model, flags = cpu_model_and_flags(cpuinfo)
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
