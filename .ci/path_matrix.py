"""CI's path matrix (issue 52): the path-sensitive tests run with every CPU-dependent path of models/paths.py forced
off at once (every path's own test files, `Path.tests`: each must hold against the plain torch path), then
tests/test_paths.py once per path that can be forced on here; the suite itself runs each path as this machine takes
it by default. Prints path x setting x result and exits non-zero when any run failed.

    python .ci/path_matrix.py                   # the paths' test files all off; tests/test_paths.py each on
    python .ci/path_matrix.py tests/test_x.py   # other test files, both
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import paths  # noqa: E402


def run(env: dict[str, str], tests: list[str]) -> tuple[bool, str]:
    """pytest on `tests` with `env` set: (passed, its summary line)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    summary = re.sub(r", \d+ warnings?", "", lines[-1].strip("= ")) if lines else f"exit {proc.returncode}"
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n", flush=True)
    return proc.returncode == 0, summary


def main(tests: list[str], off_tests: list[str] | None = None) -> int:
    """tests: run once per path forced on; off_tests (default: tests): run once with every path forced off."""
    print(paths.table(), flush=True)
    states = {s["path"]: s for s in paths.matrix()}
    results: list[tuple[str, str, str]] = []
    all_off = {p.env: p.force_off for p in paths.ENV_FORCED}
    ok, summary = run(all_off, off_tests or tests)
    failed = not ok
    for p in paths.PATHS:
        off = f"{p.env}={p.force_off}" if p.env else p.force_off
        results.append((p.name, f"off ({off})", ("pass: " if ok else "FAIL: ") + summary if p.env else
                        "per test: each test runs both sides (" + ", ".join(p.tests) + ")"))
        s = states[p.name]
        if not s["can_run"]:
            results.append((p.name, "on", f"skipped: cannot run here ({s['why']})"))
        elif p.env and p.force_on and not s["taken"]:
            ok_on, summary_on = run({p.env: p.force_on}, tests)
            failed |= not ok_on
            results.append((p.name, f"on ({p.env}={p.force_on})", ("pass: " if ok_on else "FAIL: ") + summary_on))
        else:
            results.append((p.name, "on (this machine's default)", "the suite's run (python -m pytest)"))
    print(f"\npath matrix (off: {', '.join(off_tests or tests)}; on: {', '.join(tests)}):")
    for name, setting, result in results:
        print(f"  {name:<19} {setting:<44} {result}")
    return 1 if failed else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The path-sensitive tests with every CPU-dependent path forced off, "
                                                 "then each one forced on (docs/paths.md).")
    parser.add_argument("tests", nargs="*", help="test files (default: every path's own test files with all off, "
                                                 "tests/test_paths.py with each on)")
    given = parser.parse_args().tests
    sys.exit(main(given or ["tests/test_paths.py"], given or sorted({t for p in paths.PATHS for t in p.tests})))
