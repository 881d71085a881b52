"""CI's CPU classes: the path-sensitive tests run as each CPU class below this machine's own, on this machine.

A fast path chosen by CPU flags is a different program on each class (docs/paths.md), and CI runs on whichever class
it is given. Each class below the machine's is stood in for by capping what every layer reads: our code's flags
(GPT2_CPU_FLAGS: the paths' defaults, bf16's speed, the kernels built for that class's instruction sets), torch's
kernels (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA). On an AMX Xeon that is the AVX512-BF16 (Zen 4),
AVX512 (Ice Lake) and AVX2 (Zen 3) classes; on a Zen 3, none. What it cannot show: a lower class's own speed, and
code that runs only on a higher class than this machine's. Each class gets its own caches (our kernels', inductor's:
inductor's cache key misses torch's capability, and kernels compiled under ATEN_CPU_CAPABILITY=avx2 crashed a later
process at the machine's own capability).

    python .ci/cpu_classes.py                    # the paths' test files and tests/test_cpu_classes.py, per class
    python .ci/cpu_classes.py tests/test_x.py    # other test files
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from path_matrix import run  # noqa: E402  (pytest on the tests with an environment: (passed, its summary))

from bench.results import CLASSES as ORDER  # noqa: E402  (the CPU classes, fastest first)
from bench.results import cpu_class  # noqa: E402

# class -> (the CPU's flags as /proc/cpuinfo spells them, torch's capability, oneDNN's ISA cap); fastest first
CLASSES = {
    "AVX512-BF16": ("sse4_2 avx fma f16c avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni "
                    "avx512_bf16", "avx512", "AVX512_CORE_BF16"),
    "AVX512": ("sse4_2 avx fma f16c avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni", "avx512",
               "AVX512_CORE_VNNI"),
    "AVX2": ("sse4_2 avx fma f16c avx2 bmi2", "avx2", "AVX2"),
}


def below(own: str) -> list[str]:
    """The classes below `own` that CLASSES can stand in for."""
    return [c for c in ORDER[ORDER.index(own) + 1:] if c in CLASSES]


def class_env(name: str, caches: Path) -> dict[str, str]:
    flags, capability, isa = CLASSES[name]
    return {"GPT2_CPU_FLAGS": flags, "ATEN_CPU_CAPABILITY": capability, "ONEDNN_MAX_CPU_ISA": isa,
            "GPT2_KERNEL_CACHE": str(caches / "kernels"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}


def main(tests: list[str]) -> int:
    from bench.machine import cpu_core, cpu_model_and_flags

    model, flags = cpu_model_and_flags()
    core = (cpu_core() or {}).get("core")
    model += f" ({core})" if core else ""
    own = cpu_class(flags)
    classes = below(own)
    print(f"machine: {model}, class {own}; standing in for: {', '.join(classes) or 'none (nothing below it)'}",
          flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="cpu-classes-") as tmp:
        for name in classes:
            ok, summary = run(class_env(name, Path(tmp) / name), tests)
            failed |= not ok
            print(f"  as {name:<12} {'pass' if ok else 'FAIL'}: {summary}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The path-sensitive tests as each CPU class below this machine's.")
    parser.add_argument("tests", nargs="*", help="test files (default: every path's own test files and "
                                                 "tests/test_cpu_classes.py)")
    given = parser.parse_args().tests
    if not given:
        from models import paths

        given = sorted({t for p in paths.PATHS for t in p.tests} | {"tests/test_cpu_classes.py"})
    sys.exit(main(given))
