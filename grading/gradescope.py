"""Gradescope: the autograder zip, what runs inside it, and the "Export Submissions" layout for grading a class.

    python -m grading package autograder.zip --rubric my_rubric.json   # upload the zip as the assignment's autograder
    AUTOGRADER_ROOT=/tmp/ag python -m grading.gradescope run            # what run_autograder does (root as a setting)

Gradescope unpacks the zip into /autograder/source, runs setup.sh once when the image is built, and run_autograder
per submission: it reads /autograder/submission and must leave /autograder/results/results.json. Every path out of
run() writes that file, a grader-side failure included (with the reason, and a non-zero exit so the staff see it).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from grading.environment import EXIT_ENVIRONMENT, GraderEnvironmentError, check_environment
from models.hub import data_dir

ROOT = Path(__file__).resolve().parents[1]
ROOT_ENV = "AUTOGRADER_ROOT"  # the /autograder root is a setting, so the zip can be run anywhere (tests, a laptop)
# what the grader imports from the project: its own package and the reference model's code (and training/, which the
# tasks/ modules shipped beside tasks/evaluate.py import)
SOURCES = ("grading", "models", "modules", "tasks", "training", "config.py", "optimizer.py", "requirements.txt",
           "LICENSE")
METADATA = "submission_metadata.yml"
LAYOUT_MARK = Path("models") / "gpt2.py"

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once while building the autograder image (Ubuntu, as root, with network).
set -euo pipefail
cd "$(dirname "$0")"
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PY="${PYTHON:-}"
if [ -z "$PY" ] && [ -x "$ROOT/venv/bin/python" ]; then PY="$ROOT/venv/bin/python"; fi
# Already importable (a prepared image, or a test unpacking the zip offline): nothing to install.
if [ -n "$PY" ] && "$PY" -m grading.environment --quiet; then
  echo "setup.sh: the course's packages are importable; skipping pip"
  exit 0
fi
# Python 3.11 in a venv of its own: Gradescope's Ubuntu images ship an older python3.
if ! command -v python3.11 >/dev/null 2>&1; then
  apt-get update
  apt-get install -y software-properties-common
  add-apt-repository -y ppa:deadsnakes/ppa
  apt-get update
  apt-get install -y python3.11 python3.11-venv
fi
python3.11 -m venv "$ROOT/venv"
PY="$ROOT/venv/bin/python"
# CPU wheels of torch from PyTorch's index (Gradescope's runners have no GPU); everything else from PyPI.
"$PY" -m pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt
"$PY" -m grading.environment
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this per submission; AUTOGRADER_ROOT (default /autograder) lets it run elsewhere.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
SOURCE="${AUTOGRADER_SOURCE:-$ROOT/source}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/venv/bin/python" ]; then PY="$ROOT/venv/bin/python"; else PY=python3; fi
fi
export HF_HUB_OFFLINE=1
# The grader's code closed to every other uid: a container without CAP_SYS_ADMIN has no mount namespace to hide it
# from the checks (each check runs under a uid of its own and must not read or run the grader's references).
chmod 0700 "$SOURCE" 2>/dev/null || true
rc=1
if cd "$SOURCE"; then
  "$PY" -m grading.gradescope run --root "$ROOT"
  rc=$?
fi
# The Python side writes results.json on every path it controls; this covers an interpreter that never started.
if [ ! -s "$ROOT/results/results.json" ]; then
  mkdir -p "$ROOT/results"
  printf '{"score": 0, "tests": [], "output": "The autograder itself failed to start (exit %s): this is not your grade; the course staff have been told."}\\n' "$rc" > "$ROOT/results/results.json"
fi
exit $rc
"""


# ---- the zip --------------------------------------------------------------------------------------------------------

def build_package(out: str | os.PathLike, rubric: str | os.PathLike | None = None, shared: str | None = None,
                  allow_packages=()) -> Path:
    """Write the autograder zip: setup.sh and run_autograder at its root, the grading code and pinned requirements,
    the rubric (validated now, not on the first submission) and the course's optimizer_test.npy when found."""
    import json

    from grading.grader import DEFAULT_RUBRIC, load_rubric

    rubric_data = load_rubric(rubric or DEFAULT_RUBRIC)  # raises RubricError naming the problem
    if allow_packages:
        rubric_data["allow_packages"] = sorted(set(rubric_data.get("allow_packages", [])) | set(allow_packages))
    npy = (Path(shared) / "data" if shared else data_dir()) / "cs224n" / "optimizer_test.npy"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o100755 << 16  # executable once unpacked
            z.writestr(info, text)
        for src in SOURCES:
            path = ROOT / src
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                         and "__pycache__" not in p.parts and p.suffix != ".pyc")
            for f in files:
                z.write(f, f.relative_to(ROOT).as_posix())
        z.writestr("rubric.json", json.dumps(rubric_data, indent=1) + "\n")
        if npy.is_file():
            z.write(npy, "shared/data/cs224n/optimizer_test.npy")
    os.replace(tmp, out)
    return out


# ---- inside Gradescope ----------------------------------------------------------------------------------------------

def find_layout(folder: Path, depth: int = 3) -> Path | None:
    """The folder holding the course's layout (models/gpt2.py): the upload itself, or a folder it was zipped in."""
    if (folder / LAYOUT_MARK).is_file():
        return folder
    if depth == 0:
        return None
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()
                      and not p.name.startswith((".", "__MACOSX"))):
        found = find_layout(sub, depth - 1)
        if found is not None:
            return found
    return None


def failure(reason: str, seconds: float = 0.0) -> dict:
    return {"score": 0, "execution_time": round(seconds, 2), "tests": [],
            "output": f"{reason}\n\nThis is not a grade of your code: the course staff will regrade once it is fixed."}


def protections(report_sandbox: dict) -> dict:
    """Which of the sandbox's protections held for this run, as the check's process reported them (the uid it ran
    under, not the one it was meant to get: without CAP_SYS_ADMIN it falls back to the grader's)."""
    network = str(report_sandbox.get("network", "unknown"))
    uid = report_sandbox.get("uid")
    return {"network_isolated": network == "isolated" or network.startswith("isolated "),
            "network": network, "own_uid": isinstance(uid, int) and uid != os.getuid(), "uid": uid,
            "python": report_sandbox.get("python", ""), "grader_code": report_sandbox.get("grader_code", ""),
            "limits": "RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NPROC, no core files; wall-clock kill of the "
                      "check's process group"}


def run(root: str | os.PathLike) -> int:
    """Grade root/submission into root/results/results.json; returns the exit code (0 when graded)."""
    from grading.report import write_json

    root = Path(root)
    results = root / "results" / "results.json"
    start = time.monotonic()
    try:
        check_environment()
    except GraderEnvironmentError as e:
        print(f"error: {e}", file=sys.stderr)
        write_json(results, failure(f"The autograder's environment is incomplete: {e}"))
        return EXIT_ENVIRONMENT
    try:
        from grading.grader import Grader, load_rubric
        from grading.report import gradescope
        from grading.sandbox import Limits

        source = Path(__file__).resolve().parents[1]
        rubric = load_rubric(source / "rubric.json") if (source / "rubric.json").is_file() else load_rubric()
        submission = root / "submission"
        layout = find_layout(submission) if submission.is_dir() else None
        if layout is None:
            out = failure("", time.monotonic() - start)
            out["output"] = (f"No models/gpt2.py found in your submission (looked in {submission} and three levels "
                             "of folders below): upload the course's layout (models/, modules/, optimizer.py, ...).")
            write_json(results, out)
            return 0  # graded: the submission lacks the layout, a student-side 0 with its reason
        shared = source / "shared" if (source / "shared").is_dir() else None
        with Grader(rubric, Limits(), str(shared) if shared else None) as grader:
            report = grader.grade(layout)
        out = gradescope(report)
        held = protections(report.sandbox)
        out["output"] += ("\nSandbox: network " + ("isolated" if held["network_isolated"] else
                                                  f"NOT isolated ({held['network']})")
                          + ("; own uid per check" if held["own_uid"] else "; checks ran under the grader's uid (no namespaces "
                                                                    "or not root: writes outside a check's folder "
                                                                    "are not refused)"))
        out["extra_data"] = {"sandbox": held, "environment": report.environment}
        write_json(results, out)
        return 0
    except Exception as e:  # noqa: BLE001  (Gradescope needs a results file whatever happened)
        print(f"error: the grader could not run: {type(e).__name__}: {e}", file=sys.stderr)
        write_json(results, failure(f"The grader could not run ({type(e).__name__}: {e}).", time.monotonic() - start))
        return 1


# ---- Gradescope's "Export Submissions" ------------------------------------------------------------------------------

UNPACK_MAX_BYTES = 16 * 2**30  # an export's files unpacked, in all (a class of 200 at the 100 MiB upload cap: 20 GB)
UNPACK_MAX_ENTRIES = 1_000_000  # an export's files and folders
UNPACK_MAX_PARTS = 48  # folders a member's name may go down (the sandbox looks 32 below a submission's layout)


def _visible(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if not p.name.startswith((".", "__MACOSX"))]


def _metadata_dir(folder: Path, lenient: bool = False) -> Path | None:
    """The export's top: `folder` itself when it holds the metadata, or the one folder it holds (a zip's or a
    download's wrapping) when that does. Never a folder among others: a student's folder that holds the metadata
    must not make a batch of plain folders an export. `lenient` (--export: the staff say it is one): also the one
    sub-folder holding the metadata among others."""
    if (folder / METADATA).is_file():
        return folder
    inside = _visible(folder)
    if len(inside) == 1 and inside[0].is_dir() and not inside[0].is_symlink() and (inside[0] / METADATA).is_file():
        return inside[0]
    if lenient:
        subs = [p for p in inside if p.is_dir() and (p / METADATA).is_file()]
        return subs[0] if len(subs) == 1 else None
    return None


def export_marks(folder: Path) -> str:
    """What in a folder of a plain-folder batch looks like an export's top ('' when nothing does)."""
    if (folder / METADATA).exists() or (folder / METADATA).is_symlink():
        return f"{METADATA}"
    found = [p.name for p in _visible(folder) if p.is_dir() and not p.is_symlink() and (p / METADATA).exists()]
    return f"{found[0]}/{METADATA}" if found else ""


def _zip_top(names: list[str]) -> bool:
    """A zip is an export when the metadata is at its top, or at the top of the one folder everything is in."""
    parts = [n.replace("\\", "/").strip("/").split("/") for n in names]
    if [METADATA] in parts:
        return True
    tops = {p[0] for p in parts if p[0] and not p[0].startswith((".", "__MACOSX"))}
    return len(tops) == 1 and [*tops, METADATA] in parts


def is_export(path: str | os.PathLike) -> bool:
    path = Path(path)
    if path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return _zip_top(z.namelist())
    return path.is_dir() and _metadata_dir(path) is not None


def unpack_export(path: Path, dest: Path) -> dict[tuple, list[str]]:
    """Unpack an export zip member by member: the whole capped (UNPACK_MAX_BYTES, UNPACK_MAX_ENTRIES: a clear error
    before anything is written), a member that goes more than UNPACK_MAX_PARTS folders down or cannot be written
    left out, never an abort. Returns what was left out, keyed by the member's folders."""
    left = {}
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        total = sum(i.file_size for i in infos)
        if len(infos) > UNPACK_MAX_ENTRIES or total > UNPACK_MAX_BYTES:
            raise ValueError(f"{path}: {len(infos)} entries, {total / 2**30:.1f} GiB unpacked: more than an export may "
                             f"hold here ({UNPACK_MAX_ENTRIES} entries, {UNPACK_MAX_BYTES >> 30} GiB: "
                             "grading.gradescope.UNPACK_MAX_ENTRIES / UNPACK_MAX_BYTES); unpack it yourself and give "
                             "the folder to --batch")
        for info in infos:
            parts = tuple(p for p in info.filename.replace("\\", "/").split("/") if p not in ("", ".", ".."))
            why = None
            if len(parts) > UNPACK_MAX_PARTS:
                why = f"more than {UNPACK_MAX_PARTS} folders deep"
            else:
                try:
                    z.extract(info, dest)  # zipfile drops absolute paths and '..' from member names
                except Exception as e:  # noqa: BLE001  (one bad member is left out and said, never an abort)
                    why = f"{type(e).__name__}: {e}"[:200]
            if why:
                left.setdefault(parts[:3], []).append(why)
    return left


def read_export(path: str | os.PathLike, unpack_to: str | os.PathLike | None = None) -> list[dict]:
    """Submissions of an export (folder or zip): [{'folder', 'submission', 'sids', 'names', 'emails'}], sorted.

    submission_metadata.yml maps each submission's folder name to {':submitters': [{':name', ':sid', ':email'}],
    ...} (Ruby symbols as keys); a group submission has several submitters. A folder without metadata still grades.
    Members of a zip that were not unpacked are named in their submission's `unpack` list."""
    import yaml

    from grading.sandbox import shown

    path = Path(path)
    left = {}
    if path.is_file():
        dest = Path(unpack_to or tempfile.mkdtemp(prefix="grading-export-"))
        left = unpack_export(path, dest)
        path = dest
    base = _metadata_dir(path, lenient=True)
    if base is None:
        raise ValueError(f"{path} is not a Gradescope export: no {METADATA} at its top or one folder down")
    try:
        meta = yaml.safe_load((base / METADATA).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{base / METADATA} is not valid YAML: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{base / METADATA} should map submission folders to their metadata, got {type(meta).__name__}")
    rows = []
    for folder in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "__MACOSX"))):
        entry = meta.get(folder.name) or {}
        people = (entry.get(":submitters") or entry.get("submitters") or []) if isinstance(entry, dict) else []
        people = [p for p in people if isinstance(p, dict)] if isinstance(people, list) else []

        def field(key, people=people):
            return "; ".join(str(p.get(f":{key}", p.get(key, "")) or "") for p in people)

        rel = tuple(folder.relative_to(path).parts)
        skipped = [w for parts, whys in left.items() if parts[:len(rel)] == rel for w in whys]
        rows.append({"folder": str(folder), "submission": shown(folder.name), "sids": field("sid"),
                     "names": field("name"), "emails": field("email"),
                     "unpack": [f"unpacking the export: {len(skipped)} entries of this submission left out "
                                f"({'; '.join(sorted(set(skipped))[:3])})"] if skipped else []})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grading.gradescope", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="grade ROOT/submission into ROOT/results/results.json (run_autograder)")
    r.add_argument("--root", default=os.environ.get(ROOT_ENV, "/autograder"), help=f"default ${ROOT_ENV} or /autograder")
    args = p.parse_args(argv)
    return run(args.root)


if __name__ == "__main__":
    sys.exit(main())
