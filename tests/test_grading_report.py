"""Prediction files as leaderboard values, the rubric's validation, and the Gradescope document (no sandbox)."""
from __future__ import annotations

import json

import pytest

from grading.checks import CheckResult, Part
from grading.grader import DEFAULT_RUBRIC, Report, RubricError, load_rubric
from grading.predictions import score_predictions
from grading.report import gradescope, table

GOLD_SST = "\tid\tsentence\tsentiment\n0\taa1\t good .\t4\n1\tbb2\t bad .\t0\n2\tcc3\t meh .\t2\n3\tdd4\t ok .\t3\n"
GOLD_PARA = "id\tsentence1\tsentence2\tis_duplicate\n1 x-1\ta?\tb?\t1.0\n2 y-2\tc?\td?\t0.0\n"


def test_prediction_files_become_leaderboard_values(tmp_path):
    gold, pred = tmp_path / "gold", tmp_path / "pred"
    gold.mkdir(), pred.mkdir()
    (gold / "ids-sst-dev.csv").write_text(GOLD_SST)
    (gold / "quora-dev.csv").write_text(GOLD_PARA)
    (gold / "ids-cfimdb-dev.csv").write_text(GOLD_SST.replace("\t4\n", "\t1\n").replace("\t2\n", "\t0\n")
                                             .replace("\t3\n", "\t1\n"))
    (pred / "full-model-sst-dev-out.csv").write_text("id \t Predicted_Sentiment \naa1, 4 \nbb2, 1 \ncc3, 2 \ndd4, 3 \n")
    (pred / "para-dev-output.csv").write_text("id \t Predicted_Is_Paraphrase \n1 x-1, 8505 \n2 y-2, 8505 \n")
    (pred / "full-model-cfimdb-dev-out.csv").write_text("id \t Predicted_Sentiment \naa1, 7 \n")  # label 7: refused
    board, messages = score_predictions(pred, gold)
    assert board == [{"name": "SST dev accuracy", "value": 0.75}, {"name": "Quora dev accuracy", "value": 0.5}]
    text = " ".join(messages)
    assert "CFIMDB dev accuracy: full-model-cfimdb-dev-out.csv could not be scored: line 2: a label outside the allowed ones" in text
    assert "Sonnet dev chrF: no generated_sonnets_dev.txt or generated_sonnets.txt" in text
    report = Report("s", checks=[CheckResult("embed", [Part("embed", 8.0, 8.0, "pass", 0.0)], verdict="pass")],
                    leaderboard=board, predictions=messages, seconds=1.5)
    doc = gradescope(report)
    assert doc["leaderboard"] == board and doc["score"] == 8.0 and doc["tests"][0]["max_score"] == 8.0
    json.dumps(doc)  # serialisable as is
    assert "embed" in table(report) and "total" in table(report)


@pytest.mark.parametrize("change, words", [
    (lambda r: r["checks"].update(attn={"forward": 1}), "unknown check 'attn'"),
    (lambda r: r["checks"]["embed"].update(embed=-1), "embed.embed points must be a number >= 0"),
    (lambda r: r.update(tolerance={"exact": 1e-2, "close": 1e-5}), "0 < e <= c"),
    (lambda r: r.pop("partial_fraction"), "lacks 'partial_fraction'"),
])
def test_bad_rubric_is_refused_naming_the_problem(tmp_path, change, words):
    rubric = json.loads(DEFAULT_RUBRIC.read_text())
    change(rubric)
    path = tmp_path / "rubric.json"
    path.write_text(json.dumps(rubric))
    with pytest.raises(RubricError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_rubric(path)


def test_default_rubric_totals_100():
    rubric = load_rubric()
    assert sum(sum(parts.values()) for parts in rubric["checks"].values()) == 100


def test_gradescope_shows_each_graded_function_as_its_own_test():
    """A model whose LM head raised: the forward test is 10 / 10 on its own, the head's 0 / 4 with the reason, the
    totals are the report's; the check's diagnosis and findings go with each of its tests, the code's output with
    the first that lost points; a skipped part is a test worth 0."""
    model = CheckResult("model", [Part("forward", 10.0, 10.0, "pass", 0.0),
                                  Part("hidden_state_to_token", 4.0, 0.0, "error", None,
                                       "hidden_state_to_token: error: the submission raised AttributeError")],
                        verdict="partial", messages=["a finding"], output="printed by the student")
    adamw = CheckResult("adamw", [Part("course_test", 15.0, 0.0, "skipped", None, "skipped: no optimizer_test.npy"),
                                  Part("torch_adamw", 15.0, 15.0, "pass", 0.0)], verdict="pass")
    report = Report("s", checks=[model, adamw], seconds=1.0)
    doc = gradescope(report)
    assert [(t["name"], t["score"], t["max_score"]) for t in doc["tests"]] == [
        ("model: GPT2Model.forward", 10.0, 10.0), ("model: GPT2Model.hidden_state_to_token", 0.0, 4.0),
        ("adamw: AdamW: the course's optimizer_test", 0.0, 0.0), ("adamw: AdamW: against torch.optim.AdamW", 15.0, 15.0)]
    assert doc["score"] == sum(t["score"] for t in doc["tests"]) == report.total == 25.0
    assert sum(t["max_score"] for t in doc["tests"]) == report.max_total == 29.0
    forward, head, skipped, torch_adamw = (t["output"] for t in doc["tests"])
    assert forward == "pass: 10 / 10, max error 0\na finding"
    assert head == ("error: 0 / 4 hidden_state_to_token: error: the submission raised AttributeError\na finding\n"
                    "Output of your code (truncated):\nprinted by the student")
    assert skipped == "skipped: 0 / 0 skipped: no optimizer_test.npy"
    assert torch_adamw.startswith("pass: 15 / 15")
