"""Mutation score per module with mutmut 3 (issue #40): how many small slips in a module (a flipped comparison, an
off-by-one, a dropped argument) the tests catch.

Each module runs on its own: a scratch copy of the project under mutants/by-module/<module>/ whose pyproject.toml keeps
[tool.mutmut] (pyproject.toml) but mutates only that module and selects only the test files of MODULE_TESTS; mutmut
records which of those tests call each function and runs just those tests per mutant. One record per module goes to
bench/results/mutation.jsonl: killed / survived / equivalent / timeout / no tests / skipped counts, the killed share,
the run time and every survivor with its diff line. Killed share = (killed + timeout + segfault) / (mutants -
equivalent ones): bench/mutation_equivalents.toml lists the survivors that cannot change behaviour, each with its
reason. A scratch copy is kept, so a second run only tests mutants not yet tested (--fresh starts over; --retest,
after new tests, tests the survivors again).

    pip install -r requirements-dev.txt
    nice -n 19 python bench/mutation.py                              # every module of MODULE_TESTS, smallest first
    nice -n 19 python bench/mutation.py optimizer.py modules/norms.py
    python bench/mutation.py --list                                  # the modules and their test files

Workers: one (--max-children 1), with one torch thread each (OMP_NUM_THREADS=1): the machine stays usable beside it.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "mutants" / "by-module"
EQUIVALENTS = ROOT / "bench" / "mutation_equivalents.toml"

# The modules to mutate (pyproject.toml's only_mutate; smallest first) and the test files that pin each one.
MODULE_TESTS = {
    "modules/norms.py": ["tests/test_variants.py", "tests/test_float64.py", "tests/test_survivors.py"],
    "tasks/char_tokenizer.py": ["tests/test_char_tokenizer.py", "tests/test_survivors.py"],
    "modules/lora.py": ["tests/test_lora.py", "tests/test_onednn_training.py", "tests/test_survivors.py"],
    "modules/packed.py": ["tests/test_packed.py", "tests/test_survivors_40.py"],
    "modules/quant.py": ["tests/test_quant.py", "tests/test_int8_activations.py", "tests/test_prompt_pass.py",
                         "tests/test_hugepages.py"],
    "modules/linear.py": ["tests/test_fast_paths.py", "tests/test_quant.py", "tests/test_prompt_kernel.py",
                          "tests/test_onednn.py", "tests/test_packed.py", "tests/test_int8_activations.py",
                          "tests/test_survivors_40.py", "tests/test_paths.py", "tests/test_transforms.py"],
    "modules/adamw.py": ["tests/test_optimizer.py", "tests/test_master_weights.py", "tests/test_paths.py"],
    "modules/dropout.py": ["tests/test_dropout.py", "tests/test_paths.py", "tests/test_double_backward.py"],
    "modules/draw.py": ["tests/test_draw.py", "tests/test_paths.py"],
    "modules/rmsnorm.py": ["tests/test_rmsnorm.py", "tests/test_variants.py", "tests/test_paths.py",
                           "tests/test_double_backward.py"],
    "modules/gelu.py": ["tests/test_gelu.py", "tests/test_paths.py", "tests/test_double_backward.py"],
    "modules/masked_softmax.py": ["tests/test_masked_softmax.py", "tests/test_paths.py",
                                  "tests/test_double_backward.py"],
    "modules/cross_entropy.py": ["tests/test_cross_entropy.py", "tests/test_paths.py", "tests/test_double_backward.py"],
    "modules/layer_norm.py": ["tests/test_layer_norm.py", "tests/test_paths.py", "tests/test_double_backward.py"],
    "modules/transposed.py": ["tests/test_transposed.py", "tests/test_head_grad.py", "tests/test_fused_qkv.py",
                              "tests/test_onednn_training.py", "tests/test_paths.py", "tests/test_double_backward.py"],
    "modules/head_grad.py": ["tests/test_head_grad.py", "tests/test_paths.py", "tests/test_double_backward.py"],
    "modules/fused_qkv.py": ["tests/test_fused_qkv.py", "tests/test_onednn_training.py", "tests/test_paths.py",
                             "tests/test_double_backward.py"],
    "modules/linear_backward.py": ["tests/test_double_backward.py", "tests/test_onednn_training.py",
                                   "tests/test_transposed.py", "tests/test_head_grad.py"],
    "modules/transforms.py": ["tests/test_transforms.py", "tests/test_double_backward.py"],
    "modules/hugepages.py": ["tests/test_hugepages.py", "tests/test_paths.py"],
    "modules/onednn.py": ["tests/test_onednn.py", "tests/test_onednn_training.py", "tests/test_paths.py",
                          "tests/test_double_backward.py"],
    "modules/prompt_attention.py": ["tests/test_prompt_attention.py", "tests/test_paths.py"],
    "models/fast_step.py": ["tests/test_fast_step.py", "tests/test_prompt_pass.py", "tests/test_paths.py"],
    "models/decode_threads.py": ["tests/test_decode_threads.py", "tests/test_train_threads.py"],
    "models/paths.py": ["tests/test_paths.py"],
    "optimizer.py": ["tests/test_optimizer.py", "tests/test_muon.py", "tests/test_master_weights.py",
                     "tests/test_survivors_40.py"],
    "modules/attention.py": ["tests/test_attention.py", "tests/test_variants.py", "tests/test_model.py",
                             "tests/test_fast_paths.py", "tests/test_survivors_40.py", "tests/test_int8_activations.py",
                             "tests/test_fused_qkv.py", "tests/test_prompt_attention.py"],
    "modules/rows.py": ["tests/test_rows_kernel.py", "tests/test_decode_plan.py", "tests/test_survivors.py",
                        "tests/test_fast_step.py", "tests/test_int8_activations.py", "tests/test_prompt_kernel.py",
                        "tests/test_cpu_classes.py"],
    "models/beam_search.py": ["tests/test_beam_search.py", "tests/test_cuda.py"],
    "models/generation.py": ["tests/test_generation.py", "tests/test_beam_search.py", "tests/test_survivors.py",
                             "tests/test_quant.py", "tests/test_fast_step.py", "tests/test_decode_threads.py",
                             "tests/test_cuda.py", "tests/test_prompt_kernel.py", "tests/test_prompt_pass.py"],
    "training/steps.py": ["tests/test_engine_parts.py"],
    "training/batches.py": ["tests/test_engine_parts.py", "tests/test_task_data.py"],
    "training/runfolder.py": ["tests/test_engine_parts.py", "tests/test_checkpoint.py", "tests/test_runfolder.py"],
    "training/checkpoint.py": ["tests/test_checkpoint.py"],
    "grading/questions.py": ["tests/test_grading_questions.py", "tests/test_grading_tolerance.py",
                             "tests/test_grading_forge.py"],
    "grading/checks.py": ["tests/test_grading_checks.py", "tests/test_grading_questions.py",
                          "tests/test_grading_tolerance.py", "tests/test_grading_forge.py",
                          "tests/test_grading_report.py"],
}

# mutmut's exit-code table, folded into the counts reported (mutmut.stats.status_by_exit_code)
RETESTED = ("survived", "timeout", "suspicious", "no tests")  # --retest: the results new tests can change
COUNTED = ("killed", "survived", "equivalent", "timeout", "no tests", "skipped", "suspicious", "segfault", "not checked")


def status_of(code: int | None) -> str:
    """mutmut's status of a mutant's exit code, where a test process killed by a signal mutmut's table leaves out
    (SIGABRT from glibc's heap checks, SIGBUS, SIGFPE, SIGILL: a kernel handed a wrong size or dtype) is a crash like
    its SIGSEGV ("segfault"), not "suspicious"."""
    from mutmut.stats import status_by_exit_code

    if code is not None and code < 0 and code not in status_by_exit_code:
        return "segfault"
    return status_by_exit_code[code]


def equivalents(module: str | None = None) -> list[dict]:
    """bench/mutation_equivalents.toml: survivors that cannot change behaviour, each with its reason. An entry names
    the mutated function (mutmut's name without the number) and the mutation's diff line, so it follows the mutant
    when mutmut renumbers; an entry whose diff no longer matches a survivor is reported as stale."""
    entries = tomllib.loads(EQUIVALENTS.read_text()).get("equivalent", []) if EQUIVALENTS.exists() else []
    return [e for e in entries if module is None or e["module"] == module]


def function_of(mutant: str) -> str:
    """'training.steps.x_optimizer_step__mutmut_3' -> 'training.steps.x_optimizer_step'."""
    return mutant.rpartition("__mutmut_")[0]


def mutmut_settings() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def toml_value(value) -> str:
    """Strings, numbers, booleans and lists of them are written alike in JSON and TOML."""
    return json.dumps(value)


def prepare(module: str, fresh: bool) -> Path:
    """The scratch copy for one module: the sources, tests and also_copy files, and a pyproject.toml narrowed to it."""
    work = SCRATCH / module.replace("/", "__").removesuffix(".py")
    if fresh and work.exists():
        shutil.rmtree(work)
    settings = mutmut_settings()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in [*settings["source_paths"], *settings.get("also_copy", []), "tests"]:
        src, dst = ROOT / name, work / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
        elif src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    # mutmut keeps its own copy of the sources under mutants/ and makes it again for changed .py files only: any
    # other source (modules/rows.cpp, which the kernel is built from) is refreshed here, or a run after a change to
    # it would test the new Python against the old kernel (a segfault where a signature changed)
    copied = work / "mutants"
    for name in settings["source_paths"] if copied.exists() else []:
        src = ROOT / name
        for path in (src.rglob("*") if src.is_dir() else [src]):
            if path.is_file() and path.suffix not in (".py", ".pyc"):
                dst = copied / path.relative_to(ROOT)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dst)
    settings = dict(settings, only_mutate=[module], pytest_add_cli_args_test_selection=MODULE_TESTS[module])
    text = (ROOT / "pyproject.toml").read_text().split("[tool.mutmut]")[0]
    text += "[tool.mutmut]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items())
    (work / "pyproject.toml").write_text(text)
    return work


def survivor_diffs(work: Path, module: str, names: list[str]) -> dict[str, str]:
    """name -> the mutated line ('-old / +new'), from mutmut's own diff of each survivor, in one process."""
    if not names:
        return {}
    code = ("import json, sys\nfrom mutmut.mutation.diff_apply import get_diff_for_mutant\n"
            "names, path = json.loads(sys.argv[1]), sys.argv[2]\n"
            "print(json.dumps({n: get_diff_for_mutant(n, path=path) for n in names}))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(names), module], cwd=work, capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        return {n: "(diff unavailable)" for n in names}
    diffs = json.loads(out.stdout.strip().splitlines()[-1])
    return {n: " / ".join(line.strip() for line in d.splitlines()[2:] if line[:1] in "-+") for n, d in diffs.items()}


def run_mutmut(command: list[str], work: Path, env: dict, log: Path, mode: str, budget: float | None):
    """One `mutmut run` in the scratch copy, its output to `log` (mode "w" or "a") -> (exit code, stopped at the
    budget). Its own session: a budget stops mutmut, its fork server and worker together; results so far are saved
    per mutant, the rest stay "not checked"."""
    with open(log, mode) as out:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            return proc.returncode, True
    return proc.returncode, False


def run_module(module: str, args) -> dict:
    work = prepare(module, args.fresh)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GPT2_BENCH_RESULTS="off",
               GPT2_DECODE_PLAN="off", PYTHONDONTWRITEBYTECODE="1")
    mutmut = Path(sys.executable).parent / "mutmut"
    command = [str(mutmut), "run", "--max-children", str(args.max_children)]
    meta = work / "mutants" / (module + ".meta")
    checked_before = 0  # a kept scratch copy: mutmut tests only the mutants without a result
    retested = []
    if meta.exists():
        before = json.loads(meta.read_text())["exit_code_by_key"]
        checked_before = sum(c is not None for c in before.values())
        if args.retest:  # new tests since: run the survivors (and timeouts) again, named, which mutmut always reruns
            retested = [n for n, c in before.items() if c is not None and status_of(c) in RETESTED]
            if not retested:
                print(f"{module}: no survivors to test again")
            command += retested
    start = time.perf_counter()
    log = work / "mutmut-run.log"
    returncode, stopped = run_mutmut(command, work, env, log, "w", args.budget)
    if retested and not stopped and returncode == 0:  # a named run tests only those: then any mutant without a
        # result (a function changed since, so mutmut made its mutants anew) gets one
        if any(c is None for c in json.loads(meta.read_text())["exit_code_by_key"].values()):
            left_s = None if args.budget is None else max(1.0, args.budget - (time.perf_counter() - start))
            returncode, stopped = run_mutmut(command[:4], work, env, log, "a", left_s)
    seconds = time.perf_counter() - start
    if not meta.exists():
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{module}: mutmut wrote no results (exit {returncode}); {log}:\n{tail}")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    if returncode != 0 and not stopped and all(c is None for c in codes.values()):
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{module}: mutmut stopped before testing a mutant (exit {returncode}); {log}:\n{tail}")
    status = {name: status_of(code) for name, code in codes.items()}
    counts = Counter(status.values())
    survivors = sorted((n for n, s in status.items() if s == "survived"), key=lambda n: int(n.rpartition("_")[2]))
    survivors = sorted(survivors, key=function_of)
    diffs = survivor_diffs(work, module, survivors)
    known = {(e["mutant"], e["diff"]): e["reason"] for e in equivalents(module)}
    key = {n: (function_of(n), diffs.get(n, "")) for n in survivors}  # what an equivalents entry names
    equivalent = [{"mutant": n, "diff": key[n][1], "reason": known[key[n]]} for n in survivors if key[n] in known]
    used = {key[e["mutant"]] for e in equivalent}
    stale = [{"mutant": m, "diff": d} for (m, d) in known if (m, d) not in used]
    survivors = [n for n in survivors if key[n] not in known]
    counts["survived"] -= len(equivalent)
    counts["equivalent"] = len(equivalent)
    total = len(status)
    scored = total - len(equivalent)  # equivalent mutants cannot be killed: they are left out of the score
    # a mutant that makes the tests hang (timeout) or crash the test process (segfault) is caught too
    detected = counts["killed"] + counts["timeout"] + counts["segfault"]
    tested = scored - counts["no tests"] - counts["skipped"] - counts["not checked"]
    return {"module": module, "counts": {k: counts[k] for k in COUNTED}, "total": total, "tested": tested,
            "killed_share": detected / scored if scored else None,
            "killed_share_tested": detected / tested if tested else None,
            "equivalents": equivalent, "stale_equivalents": stale,
            "seconds": seconds, "checked_before": checked_before, "retested": len(retested), "stopped": stopped,
            "exit_code": returncode,
            "tests": MODULE_TESTS[module],
            "survivors": [{"mutant": n, "diff": diffs.get(n, "")} for n in survivors]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("mutation run")
    group.add_argument("modules", nargs="*", help="modules to mutate, as paths (default: all of MODULE_TESTS in order)")
    group.add_argument("--max-children", type=int, default=1, help="mutmut's parallel workers")
    group.add_argument("--budget", type=float, default=None,
                       help="seconds per module, then mutmut is stopped and the untested mutants count as not checked")
    group.add_argument("--fresh", action="store_true", help="delete the module's scratch copy and results first")
    group.add_argument("--retest", action="store_true",
                       help="after adding tests: test the kept copy's survivors and timeouts again (new tests are "
                            "picked up; killed mutants stay killed)")
    group.add_argument("--list", action="store_true", help="print the modules and their test files, run nothing")
    args = parser.parse_args()
    if args.list:
        for module, tests in MODULE_TESTS.items():
            print(f"{module:26s} {' '.join(tests)}")
        return
    unknown = [m for m in args.modules if m not in MODULE_TESTS]
    if unknown:
        parser.error(f"not in MODULE_TESTS: {unknown}")
    print_machine_header()
    import mutmut

    for module in args.modules or list(MODULE_TESTS):
        r = run_module(module, args)
        c = r["counts"]
        share = f"{r['killed_share']:.1%}" if r["killed_share"] is not None else "-"
        print(f"{module}: {r['total']} mutants, killed {c['killed']}, survived {c['survived']}, equivalent "
              f"{c['equivalent']}, timeout {c['timeout']}, no tests {c['no tests']}, skipped {c['skipped']}, "
              f"suspicious {c['suspicious']}; killed share {share}; "
              f"{r['seconds']:.0f} s (mutmut exit {r['exit_code']}{', stopped at the budget' if r['stopped'] else ''})")
        for s in r["survivors"]:
            print(f"  survived {s['mutant']}: {s['diff']}")
        for s in r["stale_equivalents"]:
            print(f"  stale entry in {EQUIVALENTS.name} (no survivor matches it): {s['mutant']}: {s['diff']}")
        rec = Recorder("mutation")
        rec.add(module, {k: c[k] for k in COUNTED if c[k] or k in ("killed", "survived", "timeout", "skipped")},
                "mutants", ratio=r["killed_share"],
                ratio_of="(killed + timeout + segfault) / (all mutants - equivalent ones)",
                notes=f"mutmut {mutmut.__version__}, {args.max_children} worker(s), {r['seconds']:.0f} s this run"
                      f"{' (stopped at the budget: the rest not checked)' if r['stopped'] else ''}"
                      f"{f', {before} mutants checked by earlier runs' if (before := r['checked_before']) else ''}"
                      f"{f', {n} survivors tested again with new tests' if (n := r['retested']) else ''}; "
                      f"tests: {' '.join(r['tests'])}",
                seconds=round(r["seconds"], 1), checked_before=r["checked_before"], retested=r["retested"],
                stopped=r["stopped"],
                killed_share_tested=r["killed_share_tested"],
                survivors=r["survivors"], equivalents=r["equivalents"], mutmut=mutmut.__version__, tests=r["tests"])
        rec.write()


if __name__ == "__main__":
    main()
