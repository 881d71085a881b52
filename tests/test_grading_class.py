"""Grading a whole class (issue 39): similarity with the starter as boilerplate, the class report (its pages agree
with the CSV), and a batch that survives kill -9 (a rerun grades only what is missing and writes the same CSV)."""
from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from grading.__main__ import main
from grading.batch import content_hash
from grading.disguise import disguise, disguise_source
from grading.example import BUGS, write_submission
from grading.sandbox import LEFTOVER, sweep_leftovers
from grading.similarity import similar_pairs

ROOT = Path(__file__).resolve().parents[1]


# ---- the disguise keeps behaviour --------------------------------------------------------------------------------

SOURCE = '''import math


def area(radius):
    # the circle's area
    squared = radius * radius  # r^2
    return math.pi * squared


class Shape:
    def __init__(self, size):
        self.size = size

    def grow(self, by=1, *, times=2):
        total = self.size
        for step in range(times):
            total = total + by
        self.size = total
        return [value * 2 for value in (total, by)]

    def describe(self, prefix="shape"):
        def inner(word):
            return f"{prefix}:{word}"
        return inner(str(self.size))
'''


def test_the_disguise_renames_locals_reorders_and_rewrites_comments_but_keeps_behaviour():
    out = disguise_source(SOURCE)
    assert "squared" not in out and "total" not in out and "# the circle's area" not in out
    assert out.index("def describe") < out.index("def grow") < out.index("def __init__")  # methods reversed
    a, b = {}, {}
    exec(compile(SOURCE, "a", "exec"), a)
    exec(compile(out, "b", "exec"), b)
    assert a["area"](3) == b["area"](radius=3)
    sa, sb = a["Shape"](2), b["Shape"](2)
    assert sa.grow(by=3, times=4) == sb.grow(by=3, times=4) and sa.size == sb.size
    assert sa.describe(prefix="x") == sb.describe(prefix="x")


# ---- similarity: a disguised copy is flagged; what the starter gave is no evidence ---------------------------------

def class_folder(tmp_path):
    """A starter (the example submission), two students each adding their own, different code, and a disguised copy
    of the first. Their own code is this project's: real code no one wrote for the test."""
    starter = write_submission(tmp_path / "starter")
    subs = tmp_path / "subs"
    for name, own in (("alice", "optimizer.py"), ("bob", "tasks/char_tokenizer.py")):
        shutil.copytree(starter, subs / name)
        (subs / name / "extra.py").write_text((ROOT / own).read_text())
    disguise(subs / "alice", subs / "carol")
    return starter, subs


def test_a_disguised_copy_is_flagged_and_the_starter_is_no_evidence(tmp_path):
    starter, subs = class_folder(tmp_path)
    folders = {p.name: p for p in subs.iterdir()}
    pairs, own, given = similar_pairs(folders, starter)
    got = {(p.a, p.b): p for p in pairs}
    assert got[("alice", "carol")].flagged and got[("alice", "carol")].share > 0.9
    assert ("alice", "bob") not in got or not got[("alice", "bob")].flagged  # both hold the whole starter
    assert "starter" in given
    assert own["alice"] > 1000 and own["bob"] > 1000
    # the starter alone is never evidence: two students who submitted it untouched share nothing of their own
    shutil.copytree(starter, subs / "dave")
    shutil.copytree(starter, subs / "erin")
    pairs, own, _ = similar_pairs({p.name: p for p in subs.iterdir()}, starter)
    assert own["dave"] == own["erin"] == 0
    assert not any(p.flagged for p in pairs if {p.a, p.b} & {"dave", "erin"})
    # without --starter, code held by more than half the class (4+ submissions) is taken as given
    pairs, _, given = similar_pairs({p.name: p for p in subs.iterdir()})
    flagged = {(p.a, p.b) for p in pairs if p.flagged}
    assert ("alice", "carol") in flagged and ("alice", "bob") not in flagged and "50%" in given


def test_a_copy_in_another_file_layout_is_still_found(tmp_path):
    """The match is against all of the other's files: moving the copied code into another file does not hide it."""
    starter, subs = class_folder(tmp_path)
    moved = subs / "frank"
    shutil.copytree(starter, moved)
    (moved / "models" / "helpers.py").write_text((subs / "carol" / "extra.py").read_text())
    pairs, _, _ = similar_pairs({"alice": subs / "alice", "frank": moved}, starter)
    assert pairs[0].flagged and pairs[0].files[0].file_a == "extra.py" and pairs[0].files[0].file_b == "models/helpers.py"
    assert "<mark>" in pairs[0].files[0].html_a


def test_links_and_huge_files_are_not_read(tmp_path):
    starter, subs = class_folder(tmp_path)
    mallory = subs / "mallory"
    shutil.copytree(starter, mallory)
    (mallory / "stolen.py").symlink_to(subs / "alice" / "extra.py")  # another student's file is not her code
    (mallory / "big.py").write_text("x = 1\n" * 100_000)
    pairs, own, _ = similar_pairs({"alice": subs / "alice", "mallory": mallory}, starter)
    assert own["mallory"] == 0 and not any(p.flagged for p in pairs)


# ---- the class report: pages agree with the CSV --------------------------------------------------------------------

class Cells(HTMLParser):
    """The rows of the table with id=students: the text of each cell and its class."""

    def __init__(self):
        super().__init__()
        self.rows, self.inside, self.cell = [], False, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id") == "students":
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append({})
        elif self.inside and tag == "td":
            self.cell = [attrs.get("class") or "", ""]

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        elif tag == "td" and self.cell is not None:
            self.rows[-1][self.cell[0] or len(self.rows[-1])] = self.cell[1]
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[1] += data


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("class")
    subs = tmp / "subs"
    starter = write_submission(tmp / "starter")
    write_submission(subs / "alice")
    (subs / "alice" / "extra.py").write_text((ROOT / "optimizer.py").read_text())  # code of her own
    write_submission(subs / "bob", **BUGS["no_scale"][1])
    write_submission(subs / "dan", **BUGS["no_positions"][1])
    disguise(subs / "alice", subs / "carol")
    shutil.copytree(subs / "alice", subs / "alice-again")  # identical files: graded once
    out = tmp / "scores.csv"
    code = main(["--batch", str(subs), "--csv", str(out), "--checks", "attention,embed", "--jobs", "2",
                 "--report", str(tmp / "class"), "--starter", str(starter)])
    assert code == 0
    return tmp, out


def test_the_class_report_agrees_with_the_csv(graded_class):
    tmp, out = graded_class
    rows = {r["submission"]: r for r in read_csv(out)}
    parser = Cells()
    parser.feed((tmp / "class" / "index.html").read_text())
    page = {r[0]: r for r in parser.rows if r}
    assert set(page) == set(rows) == {"alice", "alice-again", "bob", "carol", "dan"}
    for name, r in rows.items():
        assert float(page[name]["n score"]) == float(r["score"]), name
        assert float(page[name]["n max"]) == float(r["max_score"]), name
        for check in ("attention", "embed"):
            assert float(page[name][f"n check-{check}"]) == float(r[check]), (name, check)
        assert (tmp / "class" / "students" / f"{name}.html").is_file()
    assert float(rows["bob"]["attention"]) < float(rows["alice"]["attention"])


def test_the_report_ranks_the_named_bugs_and_links_the_students(graded_class):
    tmp, _ = graded_class
    index = (tmp / "class" / "index.html").read_text()
    bugs = index.split("Bugs the grader named")[1].split("<h2>")[0]
    assert "scores not scaled" in bugs and 'href="students/bob.html"' in bugs
    assert "position" in bugs and 'href="students/dan.html"' in bugs
    assert 'href="students/alice.html"' not in bugs
    for png in ("scores.png", "parts.png", "seconds.png"):
        assert (tmp / "class" / png).stat().st_size > 5000
    pairs = index.split('id="pairs"')[1].split("</table>")[0]
    assert "flagged: read both" in pairs and 'href="pairs/1.html"' in pairs
    assert "<mark>" in (tmp / "class" / "pairs" / "1.html").read_text()


def test_identical_submissions_are_graded_once(graded_class):
    tmp, out = graded_class
    log = (tmp / "scores-reports" / "batch.log").read_text()
    assert log.count(" graded ") == 4 and "to_grade=4" in log
    rows = {r["submission"]: r for r in read_csv(out)}
    assert rows["alice-again"]["score"] == rows["alice"]["score"]


# ---- a batch that survives kill -9 ---------------------------------------------------------------------------------

def without_seconds(path):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in read_csv(path)]


def test_a_rerun_after_kill_9_grades_only_what_is_missing_and_writes_the_same_csv(tmp_path):
    subs = tmp_path / "subs"
    for i in range(4):
        (write_submission(subs / f"s{i}") / "notes.txt").write_text(f"student {i}")  # four different submissions
    whole = tmp_path / "whole.csv"
    assert main(["--batch", str(subs), "--csv", str(whole), "--checks", "embed"]) == 0

    cut = tmp_path / "cut.csv"
    store = tmp_path / "cut-reports"
    cmd = [sys.executable, "-m", "grading", "--batch", str(subs), "--csv", str(cut), "--checks", "embed"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(store.glob("*.json"))) < 2:
        time.sleep(0.05)
    killed = group_pids(proc.pid)  # the batch and its workers: the pids their temporary folders are named by
    os.killpg(proc.pid, signal.SIGKILL)  # the batch and its workers, mid-run
    proc.wait()
    gone = time.monotonic() + 30
    while time.monotonic() < gone:  # the workers die too (a rerun minutes later never sees them dying)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    done = len(list(store.glob("*.json")))
    assert 2 <= done < 4 and not cut.exists(), (done, cut.exists())
    assert main(["--batch", str(subs), "--csv", str(cut), "--checks", "embed"]) == 0
    assert without_seconds(cut) == without_seconds(whole)
    log = (store / "batch.log").read_text().splitlines()
    graded = [line.split("submission=")[1].split()[0] for line in log if " graded " in line]
    assert sorted(graded) == ["s0", "s1", "s2", "s3"]  # each finished once, across both runs
    assert sum(" reused " in line for line in log) == done
    # the killed batch's scratch, hub cache and unpacked folders were swept by the rerun's graders (only its own:
    # another test process may have killed a grader of its own a moment ago, whose folders no grader swept yet)
    assert proc.pid in killed, killed
    tmp = Path(tempfile.gettempdir())
    left = [p.name for p in tmp.iterdir() if (m := LEFTOVER.match(p.name)) and int(m[1]) in killed]
    assert left == [], left


def group_pids(pgid: int) -> set[int]:
    """The pids of the processes whose process group is `pgid`."""
    found = set()
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.getpgid(int(name)) == pgid:
                found.add(int(name))
        except ProcessLookupError:  # gone since the listing
            pass
    return found


def test_leftovers_of_a_dead_grader_are_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for name in (f"grading-{dead}-x", f"grading-hub-{dead}-y", f"grading-batch-{dead}-z", f"grading-{os.getpid()}-w",
                 "grading-uids", "grading-test-1", f"other-{dead}-v"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("x")
    removed = sweep_leftovers(str(tmp_path))
    assert sorted(Path(r).name for r in removed) == sorted([f"grading-{dead}-x", f"grading-hub-{dead}-y",
                                                            f"grading-batch-{dead}-z"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"grading-{os.getpid()}-w", "grading-uids",
                                                                 "grading-test-1", f"other-{dead}-v"])


def test_a_changed_submission_or_rubric_is_regraded(tmp_path):
    subs = tmp_path / "subs"
    write_submission(subs / "a")
    write_submission(subs / "b")
    (subs / "b" / "notes.txt").write_text("b")
    out = tmp_path / "s.csv"
    assert main(["--batch", str(subs), "--csv", str(out), "--checks", "embed"]) == 0
    before = content_hash(subs / "a")
    (subs / "a" / "notes.txt").write_text("changed")
    assert content_hash(subs / "a") != before
    assert main(["--batch", str(subs), "--csv", str(out), "--checks", "embed"]) == 0
    log = (tmp_path / "s-reports" / "batch.log").read_text()
    assert log.splitlines()[-1].endswith("graded=1 from_earlier_runs=1 worker_deaths=0")
    rubric = tmp_path / "rubric.json"
    rubric.write_text((ROOT / "grading" / "rubric.json").read_text().replace('"embed": 6', '"embed": 5'))
    assert '"embed": 5' in rubric.read_text()
    assert main(["--batch", str(subs), "--csv", str(out), "--checks", "embed", "--rubric", str(rubric)]) == 0
    assert (tmp_path / "s-reports" / "batch.log").read_text().splitlines()[-1].endswith(
        "graded=2 from_earlier_runs=0 worker_deaths=0")
    assert {r["max_score"] for r in read_csv(out)} == {"7.0"}


def test_report_flags_need_a_batch(tmp_path, capsys):
    write_submission(tmp_path / "a")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "a"), "--report", str(tmp_path / "class")])
    assert "go with --batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--batch", str(tmp_path), "--csv", str(tmp_path / "s.csv"), "--starter", str(tmp_path / "a")])
    assert "give --report" in capsys.readouterr().err
