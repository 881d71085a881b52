"""python -m grading --example DIR [--bug NAME]: the sample submission a newcomer grades first. The correct one gets
full marks from the real grader, each bug loses its own check's points with the bug named, a non-empty DIR is refused
without --overwrite. Only the checks each case needs are graded (one warm Grader for the module)."""
from __future__ import annotations

import pytest

from grading.__main__ import main
from grading.example import BUGS, FILES, write_example
from grading.grader import Grader
from grading.reference import BUGS as DIAGNOSES

FAST = ("attention", "layer")  # the correct example: two checks suffice here; test_grading.py grades it on all six


@pytest.fixture(scope="module")
def grader():
    with Grader() as g:
        yield g


def test_example_is_written_and_grades_full_marks(grader, tmp_path, capsys):
    folder = tmp_path / "example"
    assert main(["--example", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"next: python -m grading {folder}" in out
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*.py")) == sorted(rel for rel, _ in FILES.values())
    report = grader.grade(folder, FAST)
    assert [(c.name, c.verdict) for c in report.checks] == [(name, "pass") for name in FAST]
    assert report.total == report.max_total > 0


def test_buggy_example_loses_the_attention_points_and_names_the_bug(grader, tmp_path, capsys):
    folder = tmp_path / "buggy"
    assert main(["--example", str(folder), "--bug"]) == 0  # --bug alone: no_scale
    out = capsys.readouterr().out
    assert "no_scale" in out and "modules/attention.py" in out and f"next: python -m grading {folder}" in out
    attention, layer = grader.grade(folder, FAST).checks
    assert attention.score < attention.max_score and attention.diagnosis_key == "no_scale"
    assert DIAGNOSES["no_scale"] in attention.diagnosis  # "scores not scaled by 1/sqrt(head_dim)"
    assert layer.score == layer.max_score  # graded with the reference attention: the bug costs its own check only


# The slowest checks (a hub checkpoint; 1000 AdamW steps): test_grading.py grades these very substitutions.
GRADED_IN_TEST_GRADING = {"qkv_swapped", "no_bias_correction"}


@pytest.mark.parametrize("bug", sorted(set(BUGS) - {"no_scale"} - GRADED_IN_TEST_GRADING))
def test_each_offered_bug_is_diagnosed_in_its_check(grader, tmp_path, bug):
    check, _ = BUGS[bug]
    (result,) = grader.grade(write_example(tmp_path / bug, bug), (check,)).checks
    assert result.score < result.max_score and result.diagnosis_key == bug, (result.diagnosis, result.messages)


def test_the_slow_bugs_are_the_mutations_test_grading_grades():
    from test_grading import ADAMW_MUTATIONS, MUTATIONS

    assert BUGS["qkv_swapped"] == ("from_pretrained", MUTATIONS["qkv_swapped"][0])
    assert BUGS["no_bias_correction"] == ("adamw", {"optimizer": ADAMW_MUTATIONS["no_bias_correction"]})


def test_non_empty_folder_is_refused_without_overwrite(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    assert main(["--example", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "notes.txt" in err and "--overwrite" in err
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]  # nothing written
    assert main(["--example", str(folder), "--overwrite"]) == 0
    assert (folder / "notes.txt").read_text() == "keep me" and (folder / "models" / "gpt2.py").is_file()


def test_example_flags_are_checked(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["--example", str(tmp_path / "f")]) == 2  # a file, not a folder
    assert "not a folder" in capsys.readouterr().err
    for argv in (["--bug", "no_scale", str(tmp_path)], ["--example", str(tmp_path / "x"), "--bug", "typo"],
                 ["--example", str(tmp_path / "x"), str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
    assert not (tmp_path / "x").exists()
