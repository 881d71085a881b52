"""--batch on Gradescope's "Export Submissions" (a folder or zip: submission_metadata.yml + one folder per submission):
a CSV keyed by student ids and names with per-check points; a broken or hostile submission is a row, never an abort."""
from __future__ import annotations

import csv
import os
import shutil
import zipfile

import pytest

from grading.__main__ import main
from grading.example import write_submission
from grading.gradescope import is_export, read_export

# the export's metadata as Gradescope writes it: Ruby symbols as keys, a group submission listing each submitter
METADATA = """submission_101:
  :submitters:
  - :name: Ada Lovelace
    :sid: '1001'
    :email: ada@example.edu
  :created_at: 2026-02-23 12:00:00.000000000 -08:00
  :score: 0.0
submission_102:
  :submitters:
  - :name: Alan Turing
    :sid: '1002'
    :email: alan@example.edu
  - :name: Grace Hopper
    :sid: '1003'
    :email: grace@example.edu
  :created_at: 2026-02-23 13:00:00.000000000 -08:00
submission_103:
  :submitters:
  - :name: Mallory
    :sid: '1004'
    :email: mallory@example.edu
"""


def make_export(folder):
    folder.mkdir(parents=True)
    (folder / "submission_metadata.yml").write_text(METADATA)
    write_submission(folder / "submission_101")  # correct
    write_submission(folder / "submission_102" / "cs224n_gpt",  # zipped in a folder; no position embeddings
                     model=[("self.word_embedding(input_ids) + self.pos_embedding(pos_ids)",
                             "self.word_embedding(input_ids)")])
    write_submission(folder / "submission_103",  # hostile: kills its own check process before reporting
                     model=[("    def embed(self, input_ids):\n", "    def embed(self, input_ids):\n        import os\n"
                                                                  "        os._exit(0)\n")])
    return folder


def read_rows(path):
    with open(path, newline="") as f:
        return {r["sids"]: r for r in csv.DictReader(f)}


@pytest.mark.parametrize("as_zip", [False, True])
def test_export_layout_batch_writes_csv_keyed_by_students(tmp_path, as_zip):
    export = make_export(tmp_path / "assignment_42_export")
    if as_zip:  # Gradescope's download: the export folder inside a zip
        shutil.make_archive(str(tmp_path / "export"), "zip", tmp_path, "assignment_42_export")
        shutil.rmtree(export)
        export = tmp_path / "export.zip"
    assert is_export(export)
    out = tmp_path / "scores.csv"
    assert main(["--batch", str(export), "--csv", str(out), "--checks", "embed", "--jobs", "2"]) == 0
    rows = read_rows(out)
    assert list(rows) == ["1001", "1002; 1003", "1004"]
    assert rows["1001"]["names"] == "Ada Lovelace" and rows["1001"]["submission"] == "submission_101"
    assert rows["1001"]["embed"] == rows["1001"]["score"] == rows["1001"]["max_score"] == "8.0"
    assert rows["1002; 1003"]["names"] == "Alan Turing; Grace Hopper"
    assert rows["1002; 1003"]["emails"] == "alan@example.edu; grace@example.edu"
    assert rows["1002; 1003"]["embed"] == "0.0"  # graded: the layout one folder down was found
    assert "position" in rows["1002; 1003"]["notes"]
    assert rows["1004"]["embed"] == "0.0" and "error" in rows["1004"]["notes"]


def test_plain_folders_still_grade(tmp_path):
    write_submission(tmp_path / "class" / "alice")
    out = tmp_path / "scores.csv"
    assert main(["--batch", str(tmp_path / "class"), "--csv", str(out), "--checks", "embed"]) == 0
    row = read_rows(out)[""]
    assert row["submission"] == "alice" and row["embed"] == "8.0"


def test_bad_exports_are_named(tmp_path, capsys):
    (tmp_path / "not_export.zip").write_bytes(b"")
    with zipfile.ZipFile(tmp_path / "not_export.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    assert main(["--batch", str(tmp_path / "not_export.zip"), "--csv", str(tmp_path / "s.csv")]) == 2
    assert "not Gradescope's export" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "submission_metadata.yml").write_text("submission_1: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        read_export(bad)


def test_the_grader_version_covers_the_code_that_runs_in_the_sandbox(tmp_path, monkeypatch):
    """A changed probe (grading/sandboxed/) grades differently: the records of the earlier version are stale."""
    from grading import batch

    copy = tmp_path / "grading"
    shutil.copytree(batch.GRADING, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(batch, "GRADING", copy)
    before = batch.grader_version()
    probes = copy / "sandboxed" / "probes.py"
    probes.write_text(probes.read_text() + "\n# changed\n")
    assert batch.grader_version() != before


def test_the_workers_borrow_the_batchs_fork_servers_and_the_next_batch_starts_none(tmp_path, monkeypatch):
    """--jobs 2: the batch's process takes its idle fork servers or starts them, and its forked workers borrow them;
    they stay warm for the next batch of the process. Every start, in any process, is counted in a file."""
    from grading import sandbox

    starts = tmp_path / "starts"
    spawn = sandbox._spawn_server

    def counted():
        with open(starts, "a") as f:
            f.write(f"{os.getpid()}\n")
        return spawn()
    monkeypatch.setattr(sandbox, "_spawn_server", counted)
    export = make_export(tmp_path / "export")
    for i in range(2):
        out = tmp_path / f"scores{i}.csv"
        assert main(["--batch", str(export), "--csv", str(out), "--checks", "embed", "--jobs", "2",
                     "--reports", str(tmp_path / f"reports{i}")]) == 0
        assert read_rows(out)["1001"]["embed"] == "8.0" and read_rows(out)["1004"]["embed"] == "0.0"
        started = starts.read_text().split() if starts.exists() else []
        assert set(started) <= {str(os.getpid())} and len(started) <= 2  # in this process, none in a worker
        assert [owner for owner, _, _ in sandbox._IDLE] == [os.getpid()] * 2
        if i == 0:
            first = started
    assert started == first  # the second batch started none


def test_a_sandbox_that_cannot_start_is_each_rows_error_not_an_abort(tmp_path, monkeypatch):
    from grading import sandbox

    def broken(proc, home):
        sandbox._kill_server(proc, home)
        raise RuntimeError("the grading sandbox could not start (python grading/sandboxed/zygote.py failed)")
    monkeypatch.setattr(sandbox, "_await_server", broken)
    monkeypatch.setattr(sandbox, "_take_idle", lambda: None)  # no warm server of this process to fall back on
    export = make_export(tmp_path / "export")
    out = tmp_path / "scores.csv"
    main(["--batch", str(export), "--csv", str(out), "--checks", "embed", "--jobs", "2"])
    rows = read_rows(out)
    assert len(rows) == 3 and all("could not start" in r["error"] for r in rows.values()), rows
