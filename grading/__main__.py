"""Grade CS224N "Build GPT-2" submissions against this project's reference GPT-2.

    python -m grading path/to/submission --gradescope results.json --json report.json
    python -m grading path/to/submission --predictions path/to/submission/predictions --gold ../shared/data/cs224n
    python -m grading --batch submissions/ --csv scores.csv --jobs 2
    python -m grading --batch gradescope_export.zip --csv scores.csv --jobs 2   # Gradescope's "Export Submissions"
    python -m grading package autograder.zip --rubric my_rubric.json             # the zip Gradescope takes
    python -m grading --example /tmp/example [--bug no_scale]                    # a sample submission to grade

Each check runs the submission's code in its own sandboxed process (see grading/sandbox.py); the comparison with
the reference runs here. Exit codes: 0 whenever grading ran, whatever the score; 2 for bad arguments or missing
reference files; 1 when the sandbox itself could not run (the results file is written all the same); 3 when this
Python lacks a package of the course's environment (nothing graded; the message names the install command).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from grading import example
from grading.checks import BUGS as DIAGNOSES
from grading.environment import EXIT_ENVIRONMENT, GraderEnvironmentError, check_environment
from grading.grader import CHECKS, DEFAULT_RUBRIC, Grader, RubricError, load_rubric
from grading.report import gradescope, table, write_json
from grading.sandbox import Limits


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m grading", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("submission", nargs="?", help="a submission folder in the course's layout")
    g = p.add_argument_group("outputs")
    g.add_argument("--gradescope", metavar="FILE", help="write Gradescope's results.json here")
    g.add_argument("--json", metavar="FILE", help="write the full report (every part, error and note) here")
    g = p.add_argument_group("what to grade")
    g.add_argument("--rubric", default=str(DEFAULT_RUBRIC), help="points per check and part, tolerances (JSON)")
    g.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    g.add_argument("--predictions", metavar="DIR", help="the submission's prediction files (course file names)")
    g.add_argument("--gold", metavar="DIR", help="folder with the course's dev files for --predictions")
    g.add_argument("--shared", metavar="DIR", help="shared data folder (default ../shared or $GPT2_SHARED_DIR)")
    g.add_argument("--allow-package", action="append", default=[], metavar="NAME",
                   help="a package outside the course's environment the staff allow (repeatable; also the rubric's "
                        "allow_packages): its import is then no finding against the student")
    g = p.add_argument_group("sandbox")
    g.add_argument("--timeout", type=float, default=60.0, help="wall-clock seconds per check (default 60)")
    g.add_argument("--submission-timeout", type=float, default=300.0,
                   help="wall-clock seconds for all of a submission's checks together (default 300): the checks left "
                        "when it is spent score 0 and say so")
    g.add_argument("--memory", type=int, default=3072, help="MiB per check: address space of each process beyond the interpreter's, and the total of all its processes (tmpfs and shared memory included) where a cgroup can be made")
    g = p.add_argument_group("batch")
    g.add_argument("--batch", metavar="DIR|ZIP", help="grade every folder in DIR (one CSV row each), or Gradescope's "
                   "'Export Submissions' folder or zip (submission_metadata.yml: rows keyed by student ids and names)")
    g.add_argument("--export", action="store_true", help="with --batch: the path is Gradescope's export (its "
                   "submission_metadata.yml at its top or in one of its folders); without it an export is recognised "
                   "by its top only (the metadata there, or in the one folder the path holds), never by what a "
                   "student's folder holds")
    g.add_argument("--csv", metavar="FILE", help="the batch's scores (readable by you only; required with --batch)")
    g.add_argument("--jobs", type=int, default=1, help="submissions graded in parallel (default 1)")
    g.add_argument("--reports", metavar="DIR", help="where each submission's report is kept as it finishes (default: "
                   "beside the CSV, <csv name>-reports/); a rerun grades only what is not there")
    g.add_argument("--report", metavar="DIR", help="also write the class report: DIR/index.html (scores, the bugs "
                   "ranked, similar pairs, a page per student; opens from disk)")
    g.add_argument("--starter", metavar="DIR", help="the course's starter code: what every student was given is no "
                   "evidence of copying (with --report)")
    g = p.add_argument_group("a sample submission (to try the grader)")
    g.add_argument("--example", metavar="DIR", help="write a small correct submission in the course's layout into DIR "
                   "(new or empty), then print the command that grades it")
    g.add_argument("--bug", nargs="?", const="no_scale", choices=sorted(example.BUGS), metavar="NAME",
                   help="with --example: give it one bug the grader names (--bug without a NAME: no_scale); one "
                        "per check: " + "; ".join(f"{name} ({check}: {DIAGNOSES[name]})"
                                                  for name, (check, _) in example.BUGS.items()))
    g.add_argument("--overwrite", action="store_true", help="with --example: write into DIR even if it is not empty "
                   "(the example's files are replaced, other files are left alone)")
    args = p.parse_args(argv)
    if args.example is not None:
        if args.submission or args.batch:
            p.error("--example writes a submission; give it alone (then grade DIR in a second command)")
        return args
    if args.bug or args.overwrite:
        p.error("--bug and --overwrite go with --example DIR")
    if (args.batch is None) == (args.submission is None):
        p.error("give either a SUBMISSION_DIR or --batch DIR (or --example DIR to write a sample submission)")
    if args.batch and not args.csv:
        p.error("--batch needs --csv FILE")
    if not args.batch and (args.report or args.reports or args.starter or args.export):
        p.error("--report, --reports, --starter and --export go with --batch")
    if args.starter and not args.report:
        p.error("--starter is for the class report's similarity table: give --report DIR too")
    if args.jobs < 1 or args.timeout <= 0 or args.submission_timeout <= 0 or args.memory < 256:
        p.error("--jobs must be >= 1, --timeout and --submission-timeout > 0 and --memory >= 256")
    args.checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    unknown = set(args.checks) - set(CHECKS)
    if unknown or not args.checks:
        p.error(f"unknown check(s) {sorted(unknown)}; choose from {','.join(CHECKS)}")
    for flag in ("submission", "batch", "predictions", "gold", "shared", "starter"):
        value = getattr(args, flag)
        if value is not None and not Path(value).is_dir() and not (flag == "batch" and Path(value).is_file()
                                                                   and value.endswith(".zip")):
            p.error(f"{flag} folder not found: {value}")
    bad = [n for n in args.allow_package if not n.isidentifier()]
    if bad:
        p.error(f"--allow-package takes a module name as imported (e.g. loralib), got {bad}")
    if args.predictions and not args.gold:
        p.error("--predictions needs --gold DIR")
    return args


def package(argv) -> int:
    from grading.gradescope import build_package

    p = argparse.ArgumentParser(prog="python -m grading package",
                                description="Write the autograder zip Gradescope takes (setup.sh, run_autograder, the "
                                            "grading code, pinned requirements, the rubric).")
    p.add_argument("zip", help="where to write the zip (e.g. autograder.zip)")
    p.add_argument("--rubric", default=None, help="points per check and part (default grading/rubric.json)")
    p.add_argument("--allow-package", action="append", default=[], metavar="NAME",
                   help="a package outside the course's environment the staff allow (repeatable)")
    p.add_argument("--shared", metavar="DIR", help="where the course's optimizer_test.npy lives (data/cs224n/)")
    args = p.parse_args(argv)
    try:
        out = build_package(args.zip, args.rubric, args.shared, args.allow_package)
    except RubricError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): upload it as the assignment's autograder "
          "(Configure Autograder > Zip file upload)")
    return 0


def write_example(args) -> int:
    """--example DIR [--bug NAME] [--overwrite]: write the sample submission and say how to grade it."""
    import shlex

    folder = Path(args.example)
    if folder.exists() and not folder.is_dir():
        print(f"error: --example {folder}: that is a file, not a folder", file=sys.stderr)
        return 2
    entries = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if entries and not args.overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        print(f"error: --example {folder} is not empty ({len(entries)} entries: {shown}); choose a new or empty "
              "folder, or add --overwrite to write the example's files over what is there", file=sys.stderr)
        return 2
    example.write_example(folder, args.bug)
    files = ", ".join(rel for rel, _ in example.FILES.values())
    if args.bug:
        check, replace = example.BUGS[args.bug]
        where = ", ".join(example.FILES[key][0] for key in replace)
        print(f"wrote a course-layout submission with one bug to {folder}: {args.bug}, {DIAGNOSES[args.bug]} "
              f"(in {where}); the {check} check should lose points and name it")
    else:
        print(f"wrote a correct course-layout submission to {folder} ({files}); it should get full marks")
    print(f"next: python -m grading {shlex.quote(str(folder))}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["package"]:
        return package(argv[1:])
    args = parse_args(argv)
    if args.example is not None:
        return write_example(args)
    try:
        rubric = load_rubric(args.rubric)
    except RubricError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.allow_package:
        rubric["allow_packages"] = sorted(set(rubric.get("allow_packages", [])) | set(args.allow_package))
    try:
        check_environment()
    except GraderEnvironmentError as e:  # the grader's gap, not the students': grade nothing
        print(f"error: {e}", file=sys.stderr)
        for path in (args.gradescope, args.json):
            if path:
                write_json(path, {"score": 0, "execution_time": 0, "tests": [],
                                  "output": f"The grader's environment is incomplete ({e}); not a grade."})
        return EXIT_ENVIRONMENT
    limits = Limits(timeout=args.timeout, mem_mb=args.memory, submission_timeout=args.submission_timeout)
    if args.batch:
        from grading.batch import batch

        return batch(args, rubric, limits)
    try:
        with Grader(rubric, limits, args.shared) as grader:
            report = grader.grade(args.submission, args.checks, args.predictions, args.gold)
    except Exception as e:  # noqa: BLE001  (the results file is written whatever happened)
        print(f"error: the grader could not run: {type(e).__name__}: {e}", file=sys.stderr)
        failure = {"score": 0, "execution_time": 0, "tests": [],
                   "output": f"The grader could not run ({type(e).__name__}: {e}); please contact the course staff."}
        for path in (args.gradescope, args.json):
            if path:
                write_json(path, failure)
        return 1
    print(table(report))
    print(f"graded in {report.seconds:.1f} s")
    if args.gradescope:
        write_json(args.gradescope, gradescope(report))
    if args.json:
        write_json(args.json, report.to_dict())
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
