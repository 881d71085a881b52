"""Benchmark results as data: every benchmark appends one JSON record per measured row to bench/results/<bench>.jsonl,
and `python -m bench.report` turns the records into the tables of README.md and docs/ (so no figure there is typed
by hand).

    from bench.results import Recorder
    rec = Recorder("compare_hf")                 # machine, commit, date and load are filled in per record
    rec.add("train fp32", {"ours": 281.4, "hf-sdpa": 244.0}, "tokens/s", ratio=1.15, target=">= 1.15x", met=True)
    rec.write()                                  # appends the rows to bench/results/compare_hf.jsonl

A record: {"bench", "row", "values": {contender: number}, "unit", "ratio", "ratio_of", "target", "met", "notes",
"machine": {"cpu", "class", "flags", "cores", "torch", "threads", "device", "core", "family", "model"}, "commit",
"date", "load", "source"} ("core": the core design, bench/machine.py's cpu_core, where known; from 2026-12-04).
`source` is "run" for a record a benchmark wrote, "transcribed" for a figure carried over from the docs of an earlier
commit (its run's commit was not recorded there). `GPT2_BENCH_RESULTS=<folder>` writes elsewhere (the tests do),
`GPT2_BENCH_RESULTS=off` writes nothing.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.machine import FLAGS, cpu_core, cpu_model_and_flags

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

# CPU classes, fastest instruction set first: which fast paths a record's figures could take
CLASSES = ("AMX", "AVX512-BF16", "AVX512", "AVX2", "other")


def cpu_class(flags) -> str:
    """The class of a CPU from its flags: AMX (amx_bf16), AVX512-BF16, AVX512 (avx512f), AVX2, or other."""
    flags = set(flags or ())
    for name, flag in (("AMX", "amx_bf16"), ("AVX512-BF16", "avx512_bf16"), ("AVX512", "avx512f"), ("AVX2", "avx2")):
        if flag in flags:
            return name
    return "other"


# Records from before the machine carried its core (bench/machine.py's cpu_core, 2026-12-04) and the docs' plots drawn
# then: the core each class was measured on here (their GEMM rates in the machines table tell them apart).
LEGACY_CORES = {"AVX2": "Zen 3", "AVX512-BF16": "Zen 4"}


def results_dir() -> Path | None:
    """Where records go: $GPT2_BENCH_RESULTS (a folder; 'off': nowhere), else bench/results/."""
    value = os.environ.get("GPT2_BENCH_RESULTS")
    if value == "off":
        return None
    return Path(value) if value else RESULTS


def machine_info(device: str = "cpu") -> dict:
    model, flags = cpu_model_and_flags()
    torch = sys.modules.get("torch")  # a benchmark that ran its contenders in subprocesses has not imported it
    try:
        version = torch.__version__ if torch is not None else importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    info = {"cpu": model, "class": cpu_class(flags), "flags": [f for f in FLAGS if flags and f in flags],
            "cores": os.cpu_count(), "torch": version,
            "threads": torch.get_num_threads() if torch is not None else None, "device": device}
    core = cpu_core()
    if core is not None:  # the core design under a model name that may not say it (bench/machine.py)
        info.update(core)
    if device.startswith("cuda") and torch is not None and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    if torch is not None:  # which CPU-dependent path each operation took (models/paths.py)
        info["paths"] = path_states()
    return info


def path_states() -> dict[str, str]:
    """{path: 'on' | 'off' | 'n/a', with why} for models/paths.py's matrix on this machine and these settings."""
    from models import paths

    return {s["path"]: f"{paths.here(s)}: {s['why']}" for s in paths.matrix()}


def current_commit() -> str | None:
    """The checkout's short commit, with '+changes' when tracked files differ from it; None outside a git checkout.
    The records (bench/results), the plots the benches draw (docs/images) and prose (docs/, any .md file) do not count:
    a bench that wrote its plot before its record, or ran while a page was being edited, ran the commit's code all
    the same."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/results", ":(exclude)docs", ":(exclude,glob)**/*.md"],  # no code
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


class Recorder:
    """Collects a benchmark's rows and appends them to bench/results/<bench>.jsonl (one O_APPEND write)."""

    def __init__(self, bench: str, device: str = "cpu"):
        self.bench, self.device = bench, device
        self.rows: list[dict] = []
        self.commit: str | None = None  # asked of git at the first row, not when a benchmark module is imported

    def add(self, row: str, values: dict[str, float], unit: str, *, ratio: float | None = None,
            ratio_of: str | None = None, target: str | None = None, met: bool | None = None,
            notes: str | None = None, load: float | None = None, **extra) -> dict:
        """One record; `load` is the machine's load average for it, by default the one now (a command that loads the
        machine itself, such as the test suite, passes the one before it started)."""
        if not values or not all(isinstance(v, (int, float)) for v in values.values()):
            raise ValueError(f"{self.bench} {row}: values must be a non-empty {{contender: number}}, got {values!r}")
        if self.commit is None:
            self.commit = current_commit()
        if load is None and hasattr(os, "getloadavg"):
            load = os.getloadavg()[0]
        record = {"bench": self.bench, "row": row, "values": {k: float(v) for k, v in values.items()}, "unit": unit,
                  "ratio": ratio, "ratio_of": ratio_of, "target": target, "met": met, "notes": notes, **extra,
                  "machine": machine_info(self.device), "commit": self.commit,
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
                  "load": None if load is None else round(load, 2), "source": "run"}
        self.rows.append(record)
        return record

    def note(self, text: str) -> None:
        """Append a note to the last row (tokens compared, a share of a limit)."""
        if self.rows:
            last = self.rows[-1]
            last["notes"] = f"{last['notes']}; {text}" if last.get("notes") else text

    def write(self) -> Path | None:
        folder = results_dir()
        if folder is None or not self.rows:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.bench}.jsonl"
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.rows).encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        print(f"{len(self.rows)} records appended to {path}", flush=True)
        self.rows = []
        return path


def load(folder: Path | None = None) -> list[dict]:
    """Every record under bench/results/ (or `folder`), in file order; a malformed line is an error naming it."""
    folder = folder or RESULTS
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON record ({error})") from None
            missing = {"bench", "row", "values", "unit", "machine", "date"} - set(record)
            if missing:
                raise ValueError(f"{path}:{number}: record lacks {sorted(missing)}")
            records.append(record)
    return records
