"""Grade a whole class: every submission of a folder or of Gradescope's export, a CSV row each, a report each.

    python -m grading --batch submissions/ --csv scores.csv --jobs 2 [--report class/ --starter starter/]

Each finished submission's report is written at once (atomically) to the reports folder (default: beside the CSV,
`<csv name>-reports/`), named by a key of the submission's content, the grader's own code and the rubric, checks
and limits. A rerun of the same command (after a crash, `kill -9`, a lost connection) grades only the submissions
without a report under their key and writes the same CSV; a changed submission, rubric or grader is graded again.
Identical submissions (the same files) are graded once. batch.log in the reports folder says which submissions were
graded and which were taken from an earlier run.
"""
from __future__ import annotations

import csv
import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path

from grading import sandbox
from grading.grader import Grader
from grading.report import atomic_open, stable_diagnosis, write_json
from grading.sandbox import shown

GRADING = Path(__file__).resolve().parent
FORMAT = 1  # of a stored report; a change makes earlier reports stale


def grader_version() -> str:
    """A hash of the grader's own code (grading/*.py, and grading/sandboxed/*.py: what runs in the sandbox) and its
    default rubric."""
    h = hashlib.sha256()
    for path in sorted(GRADING.glob("*.py")) + sorted(GRADING.glob("sandboxed/*.py")) + [GRADING / "rubric.json"]:
        h.update(path.relative_to(GRADING).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def content_hash(folder: Path, max_files: int = 2000, max_mb: int = 100) -> str:
    """A hash of exactly what the sandbox copies of `folder` (grading.sandbox.plan_copy, with the batch's limits):
    each kept entry's relative name (any bytes) and its bytes, or for a link inside the submission its resolved
    target; and the count and bytes of what is left out, by reason. Two submissions share a record only when what
    runs is the same; a change to anything that is copied changes the key."""
    from grading.sandbox import plan_copy

    plan = plan_copy(folder, max_files, max_mb)
    h = hashlib.sha256()
    for rel, _size, link in plan.files:
        name = os.fsencode(rel)
        if link is not None:
            h.update(b"L%d:" % len(name) + name + os.fsencode(link) + b"\0")
            continue
        h.update(b"F%d:" % len(name) + name)
        n = 0
        try:
            with open(os.path.join(folder, rel), "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
                    n += len(block)
        except OSError as e:
            h.update(f"unreadable: {e.errno}".encode())
        h.update(b"%d\0" % n)
    h.update(json.dumps({"skipped": plan.skipped, "findings": plan.findings}, sort_keys=True).encode())
    return h.hexdigest()


def report_key(content: str, version: str, rubric: dict, checks, limits) -> str:
    spec = json.dumps({"format": FORMAT, "content": content, "grader": version, "rubric": rubric,
                       "checks": list(checks), "limits": asdict(limits)}, sort_keys=True, default=str)
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


# ---- the workers ---------------------------------------------------------------------------------------------------

_GRADER: Grader | None = None
# The fork servers the batch's process lent its pool (grading.sandbox.lend), and the counter that gives worker i the
# i-th: a forked worker inherits both; a worker the pool spawned afresh (no fork) sees none and starts its own.
_LENT: tuple[list, object] | None = None


def _init_worker(rubric, limits, shared):
    from multiprocessing.util import Finalize

    global _GRADER
    _GRADER = Grader(rubric, limits, shared)
    if _LENT is not None:
        servers, counter = _LENT
        with counter.get_lock():
            i, counter.value = counter.value, counter.value + 1
        if i < len(servers):
            _GRADER.sandbox.borrow(*servers[i])
    # pool workers leave by os._exit (no atexit): close the sandbox first, its fork server killed rather than kept
    Finalize(_GRADER, _GRADER.close, kwargs={"keep_warm": False}, exitpriority=10)


def _grade_one(folder: str, checks, store: str, key: str, name: str) -> dict:
    """Grade one submission (the folder its key was made of: its layout's), write its record to store/key.json at
    once and say so in store/batch.log (from here, not from the batch's process: a batch killed between the two
    still has a log that names each graded submission)."""
    started = time.time()
    try:
        report = _GRADER.grade(folder, checks)
        record = {"key": key, "format": FORMAT, "report": report.to_dict(), "error": "",
                  "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started))}
        write_json(Path(store) / f"{key}.json", record, private=True)
        log_line(Path(store) / "batch.log", "graded", submission=name, key=key,
                 score=f"{report.total:g}/{report.max_total:g}", seconds=f"{report.seconds:.1f}")
    except Exception as e:  # noqa: BLE001  (one broken submission is a row, never an abort; not stored: regraded)
        record = {"key": key, "format": FORMAT, "report": None, "error": f"{type(e).__name__}: {e}"}
    return record


# ---- rows ----------------------------------------------------------------------------------------------------------

def csv_fields(checks) -> list[str]:
    return ["submission", "sids", "names", "emails", "score", "max_score", *checks, "seconds", "environment", "notes",
            "error"]


def row(entry: dict, record: dict) -> dict:
    """The CSV row of one submission: the export's keys and what its report says."""
    out = {k: entry.get(k, "") for k in ("submission", "sids", "names", "emails")}
    report = record.get("report")
    unpacked = "; ".join(entry.get("unpack", []))
    if not report:
        out["error"] = record.get("error") or "not graded"
        out["notes"] = unpacked
        return out
    out.update(score=round(report["score"], 4), max_score=report["max_score"], seconds=round(report["seconds"], 1))
    out.update({c["name"]: round(c["score"], 4) for c in report["checks"]})
    # what the grader left out or refused (the copy's caps, links, forbidden calls): said on the row, not only the page
    findings = dict.fromkeys(m for c in report["checks"] for m in c["messages"] if m.startswith("finding: "))
    out["notes"] = "; ".join([f"{c['name']}: {stable_diagnosis(c)}" for c in report["checks"]
                              if c["verdict"] != "pass"] + list(findings) + ([unpacked] if unpacked else []))
    out["environment"] = "; ".join(report.get("environment", []))
    out["error"] = ""
    return out


FORMULA = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet runs a cell that begins with one of these (OWASP)


def cell(value):
    """A CSV cell a spreadsheet shows as text: one that would run as a formula gets a leading single quote (OWASP's
    CSV injection advice); text of any bytes is written as \\xNN."""
    if not isinstance(value, str):
        return value
    value = shown(value)
    return "'" + value if value.startswith(FORMULA) else value


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    """The batch's CSV, readable by the grader's user only (it holds every student's ids and scores)."""
    with atomic_open(path, newline="", private=True) as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in r.items()} for r in rows)


def load_record(store: Path, key: str) -> dict | None:
    path = store / f"{key}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent, or cut short by a crash before os.replace (never: replace is atomic), or edited
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("report"), dict):
        return None
    return record


def log_line(path: Path, event: str, **fields) -> None:
    """One line of batch.log, appended in one write (O_APPEND: lines from the batch and its workers never mix)."""
    words = " ".join(f"{k}={v}" for k, v in fields.items())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {event} {words}\n".encode("utf-8", "backslashreplace"))
    finally:
        os.close(fd)


def key_entries(entries: list[dict], version: str, rubric: dict, checks, limits) -> dict:
    """folder -> its record key, or for an entry that cannot be keyed, {"error": why} (a row of its own; never an
    abort). The key is made of the folder the worker grades: the layout found in it (an upload zipped in a folder)."""
    from grading.gradescope import find_layout

    keys = {}
    for e in entries:
        if e.get("error"):
            keys[e["folder"]] = {"error": e["error"]}
            continue
        try:
            e["layout"] = str(find_layout(Path(e["folder"])) or e["folder"])
            keys[e["folder"]] = report_key(content_hash(Path(e["layout"]), limits.max_files, limits.max_submission_mb),
                                           version, rubric, checks, limits)
        except Exception as exc:  # noqa: BLE001  (an entry the grader cannot read is its own row)
            keys[e["folder"]] = {"error": f"not graded: its files could not be read ({type(exc).__name__}: "
                                          f"{shown(str(exc))[:300]})"}
    return keys


def grade_batch(entries: list[dict], checks, rubric: dict, limits, shared, jobs: int, store: Path,
                progress: bool = True) -> tuple[list[dict], dict]:
    """Each entry's record (its report, or the error), grading only what store lacks; and counts for the summary."""
    from tqdm import tqdm

    store.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(store, 0o700)  # every student's report: the grader's user only
    def log(event, **fields):
        log_line(store / "batch.log", event, **fields)

    version = grader_version()
    keys = key_entries(entries, version, rubric, checks, limits)
    refused = {f: k["error"] for f, k in keys.items() if isinstance(k, dict)}
    keys = {f: k for f, k in keys.items() if f not in refused}
    records = {k: r for k in set(keys.values()) if (r := load_record(store, k)) is not None}
    todo = {}  # key -> the first entry holding it (identical submissions are graded once)
    for e in entries:
        if e["folder"] in keys and keys[e["folder"]] not in records:
            todo.setdefault(keys[e["folder"]], e)
    reused = len(set(keys.values()) - set(todo))
    log("start", submissions=len(entries), to_grade=len(todo), from_earlier_runs=reused, refused=len(refused),
        grader=version, jobs=jobs, store=store)
    for e in entries:
        if e["folder"] in refused:
            log("refused", submission=e["submission"], error=json.dumps(refused[e["folder"]]))
        elif keys[e["folder"]] in records:
            log("reused", submission=e["submission"], key=keys[e["folder"]])
    graded = died = 0
    pending = list(todo)
    global _LENT
    with tqdm(total=len(todo), desc="grading", unit="submission", disable=not progress) as bar:
        while pending:  # a worker that dies takes its pool down: the rest is resubmitted to a fresh pool
            context, workers = multiprocessing.get_context(), min(jobs, len(pending))
            try:
                lent = sandbox.lend(workers) if context.get_start_method() == "fork" else []
            except RuntimeError:  # no server starts here: each worker tries its own and each row says what failed
                lent = []
            _LENT, clean = (lent, context.Value("i", 0)), False
            try:
                with ProcessPoolExecutor(workers, context, initializer=_init_worker,
                                         initargs=(rubric, limits, shared)) as pool:
                    futures = {}
                    for key in pending:
                        log("queued", submission=todo[key]["submission"], key=key)
                        futures[pool.submit(_grade_one, todo[key]["layout"], checks, str(store), key,
                                            todo[key]["submission"])] = key
                    try:
                        for fut in as_completed(futures):
                            key, record = futures[fut], fut.result()
                            records[key] = record
                            graded += 1
                            if not record["report"]:  # a graded one is logged by its worker
                                log("error", submission=todo[key]["submission"], key=key,
                                    error=json.dumps(record["error"]))
                            bar.update()
                    except BrokenProcessPool:
                        pass
                    else:
                        clean = True
            finally:
                _LENT = None
                sandbox.take_back(lent, keep=clean)  # a broken pool's servers may be mid-request: killed
            lost = [k for k in pending if k not in records]
            if lost and lost == pending:  # nothing finished: mark the first one broken and go on without it
                records[lost[0]] = {"key": lost[0], "report": None, "error": "the grading worker died on this submission"}
                log("error", submission=todo[lost[0]]["submission"], key=lost[0], error="worker died")
                died += 1
                bar.update()
            pending = [k for k in pending if k not in records]
    log("done", graded=graded, from_earlier_runs=reused, worker_deaths=died)
    out = []
    for e in entries:
        record = {"key": "", "report": None, "error": refused[e["folder"]]} if e["folder"] in refused else \
            records[keys[e["folder"]]]
        out.append({"entry": {k: e.get(k, "") for k in ("submission", "sids", "names", "emails", "folder", "layout",
                                                        "unpack")}, **record})
    return out, {"graded": graded, "reused": reused, "identical": len(keys) - len(set(keys.values())),
                 "refused": len(refused), "grader": version}


EXPORT_LOOKALIKE = ("refused: this folder holds {what}, the layout of Gradescope's export, inside a batch of plain "
                    "folders (an export is recognised by the top of the --batch path only); not graded. Grade it on "
                    "its own, or give its path with --batch --export if it is an export")


def batch_entries(path: str, unpack_to: str, export: bool | None = None) -> list[dict]:
    """Submissions to grade: Gradescope's export (ids and names from submission_metadata.yml) or plain folders.

    An export is recognised only by its own top (grading.gradescope.is_export), never by what a student's folder
    holds; export=True takes `path` as one (an error if it is not). In a batch of plain folders, a folder that holds
    an export's metadata is one row saying so, not graded (it once made the whole batch grade a roster its student
    wrote)."""
    from grading.gradescope import export_marks, is_export, read_export

    if export or (export is None and is_export(path)):
        return read_export(path, unpack_to)
    if Path(path).is_file():
        raise ValueError(f"{path} is a file but not Gradescope's export (no submission_metadata.yml in the zip)")
    entries = []
    for p in sorted(Path(path).iterdir()):
        if p.name.startswith(".") or not p.is_dir():
            continue
        e = {"folder": str(p), "submission": shown(p.name), "sids": "", "names": "", "emails": ""}
        try:
            marks = export_marks(p)
        except OSError as exc:
            marks, e["error"] = "", f"not graded: its folder could not be read ({shown(str(exc))[:300]})"
        if marks:
            e["error"] = EXPORT_LOOKALIKE.format(what=marks)
        entries.append(e)
    return entries


def batch(args, rubric, limits) -> int:
    """--batch: grade, write the CSV (and with --report the class report), say what was done."""
    import tempfile

    unpack = tempfile.TemporaryDirectory(prefix=f"grading-batch-{os.getpid()}-")
    try:
        try:
            entries = batch_entries(args.batch, unpack.name, True if args.export else None)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        csv_path = Path(args.csv)
        store = Path(args.reports) if args.reports else csv_path.with_name(csv_path.stem + "-reports")
        start = time.monotonic()
        records, counts = grade_batch(entries, args.checks, rubric, limits, args.shared, args.jobs, store)
        write_csv(csv_path, csv_fields(args.checks), [row(r["entry"], r) for r in records])
        seconds = time.monotonic() - start
        print(f"{len(records)} submissions: {counts['graded']} graded in {seconds:.1f} s (--jobs {args.jobs}), "
              f"{counts['reused']} reports taken from an earlier run of this grader and rubric"
              + (f", {counts['identical']} identical to another" if counts["identical"] else "")
              + (f", {counts['refused']} not graded (their rows say why)" if counts["refused"] else "")
              + f"; wrote {csv_path} (reports and batch.log in {store})")
        if args.report:
            from grading.classreport import write_class_report

            index = write_class_report(Path(args.report), records, args.checks, starter=args.starter,
                                       meta={**counts, "seconds": seconds, "jobs": args.jobs, "csv": str(csv_path)})
            print(f"wrote the class report: {index} (open it in a browser)")
        return 0
    finally:
        unpack.cleanup()
