"""Issue 55: a class batch that one hostile student cannot hijack, stop, freeload on or hide from. Each attack is built
from copies of `python -m grading --example` (grading.example.write_submission) and graded as a batch: the batch
finishes, every honest student's row equals the one a batch without the attackers gives, and each attacker's row
says what was refused. bench/grading_batch_attacks.py runs the same attacks one by one on any checkout."""
from __future__ import annotations

import csv
import os
import shutil
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from bench.grading_batch_attacks import PAD, deep, pad
from grading.__main__ import main
from grading.batch import content_hash
from grading.example import BUGS, write_submission
from grading.gradescope import is_export

NO_POSITIONS = BUGS["no_positions"][1]
FORMULA = "=1+2"


def read(path) -> dict:
    with open(path, newline="", encoding="utf-8") as f:
        return {r["submission"]: r for r in csv.DictReader(f)}


def without_seconds(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "seconds"}


def honest_class(subs: Path) -> None:
    write_submission(subs / "alice")
    write_submission(subs / "bob", **NO_POSITIONS)
    write_submission(subs / "carol")
    pad(subs / "carol")  # 20,000 files beside her code


def batch(folder, out: Path, *extra) -> int:
    return main(["--batch", str(folder), "--csv", str(out), "--checks", "embed", "--jobs", "1", *extra])


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One batch of the honest class, and one of the same class with every plain-folder attacker beside it."""
    tmp = tmp_path_factory.mktemp("attacks")
    clean, subs = tmp / "clean", tmp / "subs"
    honest_class(clean)
    honest_class(subs)  # the same class again (a copy of 20,000 files takes seconds)
    hijack = subs / "mallory-hijack"  # an export's layout inside a student's folder, with a roster she wrote
    write_submission(hijack / "submission_1")
    write_submission(hijack / "submission_2", **NO_POSITIONS)
    (hijack / "submission_metadata.yml").write_text(
        "submission_1:\n  :submitters:\n  - :name: Mallory\n    :sid: '666'\n"
        "submission_2:\n  :submitters:\n  - :name: Alice\n    :sid: '1001'\n")
    write_submission(subs / "mallory-bytes")  # a file name that is not UTF-8
    with open(os.path.join(os.fsencode(subs / "mallory-bytes"), b"notes-\xff.txt"), "wb") as f:
        f.write(b"x")
    write_submission(Path(os.fsdecode(os.fsencode(subs) + b"/mallory-folder-\xff")))  # the folder's own name
    write_submission(subs / "mallory-deep")
    deep(subs / "mallory-deep")
    pad(subs / "mallory-pad", PAD + 1)  # carol's padding (one more file), none of her code: once keyed like hers
    write_submission(subs / FORMULA)
    assert batch(clean, tmp / "clean.csv") == 0
    assert batch(subs, tmp / "subs.csv") == 0
    yield tmp, read(tmp / "clean.csv"), read(tmp / "subs.csv")
    subprocess.run(["rm", "-rf", str(subs / "mallory-deep")], check=False)  # shutil.rmtree recurses


def test_honest_rows_equal_a_batch_without_the_attackers(graded):
    _, clean, attacked = graded
    assert set(clean) == {"alice", "bob", "carol"}
    for name in clean:
        assert without_seconds(attacked[name]) == without_seconds(clean[name]), name
    assert [clean[n]["embed"] for n in ("alice", "bob", "carol")] == ["8.0", "0.0", "8.0"]


def test_a_students_export_layout_does_not_hijack_the_batch(graded):
    tmp, _, attacked = graded
    row = attacked["mallory-hijack"]
    assert row["score"] == "" and "refused" in row["error"] and "submission_metadata.yml" in row["error"]
    assert not {"submission_1", "submission_2"} & set(attacked)  # her roster is never graded
    assert "666" not in (tmp / "subs.csv").read_text()
    assert not is_export(tmp / "subs")


def test_names_of_any_bytes_and_deep_folders_are_rows_not_aborts(graded):
    _, _, attacked = graded
    assert attacked["mallory-bytes"]["embed"] == "8.0"
    assert attacked["mallory-folder-\\xff"]["embed"] == "8.0"  # its name as text any spreadsheet reads
    row = attacked["mallory-deep"]
    assert row["embed"] == "8.0" and "folders deeper than 32 levels not looked at" in row["notes"], row


def test_padding_shared_with_a_classmate_does_not_share_her_record(graded):
    tmp, _, attacked = graded
    assert attacked["carol"]["embed"] == "8.0"
    row = attacked["mallory-pad"]
    assert row["embed"] == "0.0" and "files and folders of the submission were not looked at" in row["notes"], row
    log = (tmp / "subs-reports" / "batch.log").read_text()
    assert " graded submission=mallory-pad " in log


def test_csv_cells_are_no_formulas_and_the_records_are_private(graded):
    tmp, _, attacked = graded
    assert "'" + FORMULA in attacked and FORMULA not in attacked
    assert attacked["'" + FORMULA]["embed"] == "8.0"
    assert stat.S_IMODE((tmp / "subs.csv").stat().st_mode) == 0o600
    store = tmp / "subs-reports"
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in store.iterdir()} == {0o600}


# ---- exports -------------------------------------------------------------------------------------------------------

def export(folder: Path, students: dict) -> Path:
    meta = []
    for i, (name, (sid, email, build)) in enumerate(students.items()):
        build(folder / f"submission_{i + 1}")
        meta.append(f"submission_{i + 1}:\n  :submitters:\n  - :name: '{name}'\n    :sid: '{sid}'\n"
                    f"    :email: '{email}'\n")
    (folder / "submission_metadata.yml").write_text("".join(meta))
    return folder


def zipped(folder: Path, out: Path) -> Path:
    return Path(shutil.make_archive(str(out), "zip", folder.parent, folder.name))


def test_an_export_zip_with_a_deep_member_and_formula_names(tmp_path):
    honest = {"Ada": ("1001", "ada@example.edu", write_submission),
              "Alan": ("1002", "alan@example.edu", lambda f: write_submission(f, **NO_POSITIONS))}
    clean = zipped(export(tmp_path / "a" / "export", honest), tmp_path / "clean")
    evil = zipped(export(tmp_path / "b" / "export", {**honest, "=HYPERLINK(\"http://x/\"&A1)": (
        "+1004", "@SUM(1)", write_submission)}), tmp_path / "evil")
    with zipfile.ZipFile(evil, "a") as z:
        z.writestr("export/submission_3/" + "d/" * 1100 + "deep.txt", "x")
    assert batch(clean, tmp_path / "clean.csv") == 0
    assert batch(evil, tmp_path / "evil.csv") == 0
    before, after = read(tmp_path / "clean.csv"), read(tmp_path / "evil.csv")
    for name in ("submission_1", "submission_2"):
        assert without_seconds(after[name]) == without_seconds(before[name]), name
    row = after["submission_3"]
    assert row["embed"] == "8.0" and "1 entries of this submission left out" in row["notes"], row
    assert row["names"] == "'=HYPERLINK(\"http://x/\"&A1)" and row["sids"] == "'+1004" and row["emails"] == "'@SUM(1)"


def test_an_export_is_recognised_by_its_top_only_or_by_export(tmp_path, capsys):
    subs = tmp_path / "subs"
    write_submission(subs / "alice")
    export(subs / "mallory", {"Mallory": ("666", "m@x", write_submission)})
    assert not is_export(subs)  # a student's folder among others
    assert is_export(subs / "mallory")  # the export itself
    wrapped = tmp_path / "download"
    shutil.copytree(subs / "mallory", wrapped / "assignment_export")
    assert is_export(wrapped)  # the one folder a download holds
    assert batch(subs, tmp_path / "plain.csv") == 0
    assert set(read(tmp_path / "plain.csv")) == {"alice", "mallory"}
    assert batch(subs, tmp_path / "export.csv", "--export") == 0  # the staff say it is one: its one export
    rows = read(tmp_path / "export.csv")
    assert set(rows) == {"submission_1"} and rows["submission_1"]["sids"] == "666"


def test_an_export_past_the_unpack_caps_is_refused_with_a_clear_error(tmp_path, monkeypatch, capsys):
    import grading.gradescope

    evil = zipped(export(tmp_path / "e" / "export", {"Ada": ("1", "a@x", write_submission)}), tmp_path / "evil")
    monkeypatch.setattr(grading.gradescope, "UNPACK_MAX_ENTRIES", 5)
    assert batch(evil, tmp_path / "s.csv") == 2
    err = capsys.readouterr().err
    assert "more than an export may hold" in err and "UNPACK_MAX_ENTRIES" in err


# ---- the record key: what the sandbox copies -----------------------------------------------------------------------

def test_the_key_covers_code_behind_padding_links_and_any_bytes(tmp_path):
    a = write_submission(tmp_path / "a")
    pad(a)
    first = content_hash(a)
    write_submission(a, **NO_POSITIONS)  # the code changed, behind 20,000 files
    assert content_hash(a) != first
    shutil.move(a / "models", a / "v1")
    shutil.copytree(a / "v1", a / "v2")
    (a / "v2" / "gpt2.py").write_text((a / "v2" / "gpt2.py").read_text() + "\n# v2\n")
    (a / "models").symlink_to("v1")
    linked = content_hash(a)
    (a / "models").unlink()
    (a / "models").symlink_to(str((a / "v2").resolve()))  # re-pointed (as an absolute link)
    assert content_hash(a) != linked
    b = write_submission(tmp_path / "b")
    plain = content_hash(b)
    with open(os.path.join(os.fsencode(b), b"x\xff.py"), "wb") as f:
        f.write(b"pass\n")
    assert content_hash(b) != plain


def test_a_changed_submission_behind_padding_is_regraded(tmp_path):
    subs = tmp_path / "subs"
    write_submission(subs / "carol")
    pad(subs / "carol")
    out = tmp_path / "s.csv"
    assert batch(subs, out) == 0 and read(out)["carol"]["embed"] == "8.0"
    write_submission(subs / "carol", **NO_POSITIONS)
    assert batch(subs, out) == 0
    assert read(out)["carol"]["embed"] == "0.0"
    assert (tmp_path / "s-reports" / "batch.log").read_text().splitlines()[-1].endswith(
        "graded=1 from_earlier_runs=0 worker_deaths=0")


# ---- similarity: what it reads, what it costs, what it cannot see --------------------------------------------------

def filler(seed: int, size: int) -> str:
    """Python code of about `size` bytes, different for each seed (no two lines alike)."""
    lines, n, i = [], 0, 0
    while n < size:
        line = f"def f{seed}_{i}(x):\n    return min(x, {seed * 7919 + i}) + max(x, {i * 104729 % 99991})\n\n"
        lines.append(line)
        n, i = n + len(line), i + 1
    return "".join(lines)


def test_similarity_reads_a_budget_per_submission_and_names_the_rest(tmp_path):
    from grading.similarity import BUDGET, LAYOUT, python_files, similar_pairs

    subs = tmp_path / "subs"
    alice = write_submission(subs / "alice")
    (alice / "extra.py").write_text((Path(__file__).resolve().parents[1] / "optimizer.py").read_text())
    for i in range(12):  # a dozen 255 KiB files: once 51.5 s and 1.65 GiB for two such students
        (alice / f"big{i:02d}.py").write_text(filler(i, 255 * 1024))
    shutil.copytree(alice, subs / "alice-copy")
    write_submission(subs / "bob", **NO_POSITIONS)
    read, skipped = python_files(alice)
    assert [str(p.relative_to(alice)) for p in read][:len(LAYOUT)] == list(LAYOUT)  # the graded files first
    assert "extra.py" in {p.name for p in read} and len(skipped) == 12
    assert sum(p.stat().st_size for p in read) <= BUDGET
    pairs, own, _ = similar_pairs({p.name: p for p in subs.iterdir()}, write_submission(tmp_path / "starter"))
    (pair,) = [p for p in pairs if p.flagged]
    assert {pair.a, pair.b} == {"alice", "alice-copy"} and pair.skipped_a == pair.skipped_b == 12
    assert len(pair.files) <= 8


def test_code_run_from_strings_is_a_finding_on_the_students_page(tmp_path):
    from grading.classreport import student_page
    from grading.similarity import dynamic_code

    sub = write_submission(tmp_path / "sub", attention=[("import math\n", "import math\nexec(open('a.txt').read())\n")])
    (sub / "helper.py").write_text("import re\nPAT = re.compile('x')\ncode = compile('1 + 1', 'f', 'eval')\n"
                                   "model_eval = None\n")
    found = dynamic_code(sub)
    assert found == ["exec() at modules/attention.py:2", "compile() at helper.py:3"], found
    page = student_page({"entry": {"submission": "sub", "folder": str(sub)}, "report": None, "error": "x",
                         "dynamic": found})
    assert "finding: exec() at modules/attention.py:2" in page


def test_copies_with_mechanical_edits_are_still_flagged(tmp_path):
    """Issue 55's evasions, each on a copy of alice (whose own code, extra.py, her attention module imports): another
    source encoding, a long comment past the size cap, the code moved into a folder the detector skipped (and
    imported from there), 400 dummy files beside it. Before, none was flagged (shares 25-62%, or under 1000 chars)."""
    from grading.similarity import similar_pairs

    starter = write_submission(tmp_path / "starter")
    subs = tmp_path / "subs"
    own = (Path(__file__).resolve().parents[1] / "optimizer.py").read_text()
    imports = [("import math\n", "import math\nimport extra  # noqa\n")]
    alice = write_submission(subs / "alice", attention=imports)
    (alice / "extra.py").write_text(own)
    carol = write_submission(subs / "carol", attention=imports)
    (carol / "extra.py").write_bytes(("# -*- coding: latin-1 -*-\n# caf\u00e9\n" + own).encode("latin-1", "replace"))
    dave = write_submission(subs / "dave", attention=imports)
    (dave / "extra.py").write_text("".join(f"# {i:06d} {'x' * 70}\n" for i in range(4000)) + own)
    erin = write_submission(subs / "erin", attention=[("import math\n", "import math\nfrom env import extra  # noqa\n")])
    (erin / "env").mkdir()
    (erin / "env" / "extra.py").write_text(own)
    frank = write_submission(subs / "frank", attention=imports)
    (frank / "extra.py").write_text(own)
    for i in range(400):
        (frank / f"dummy{i:03d}.py").write_text(f"X{i} = {i}\n")
    pairs, _, _ = similar_pairs({p.name: p for p in subs.iterdir()}, starter)
    flagged = {frozenset((p.a, p.b)) for p in pairs if p.flagged}
    for name in ("carol", "dave", "erin", "frank"):
        assert frozenset(("alice", name)) in flagged, (name, [(p.a, p.b, p.share, p.chars) for p in pairs])
