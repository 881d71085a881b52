"""The grading command (python -m tasks.evaluate) on hand-made prediction files."""
import json

import pytest

from tasks import evaluate as E

GOLD_SST = "\tid\tsentence\tsentiment\n0\taa1\t good .\t4\n1\tbb2\t bad .\t0\n2\tcc3\t meh .\t2\n3\tdd4\t ok .\t3\n"
GOLD_PARA = ("id\tsentence1\tsentence2\tis_duplicate\n1 x-1\ta?\tb?\t1.0\n2 y-2\tc?\td?\t0.0\n3 z-3\te?\tf?\t0.0\n")


def files(tmp_path, gold, pred_rows, header="id \t Predicted_Sentiment "):
    (tmp_path / "gold.csv").write_text(gold)
    (tmp_path / "pred.csv").write_text(header + "\n" + "".join(f"{r} \n" for r in pred_rows))
    return str(tmp_path / "pred.csv"), str(tmp_path / "gold.csv")


def test_scores_a_course_format_file_and_writes_json(tmp_path, capsys):
    pred, gold = files(tmp_path, GOLD_SST, ["AA1, 4", "bb2, 1", "cc3, 2", "dd4, 3"])
    out = tmp_path / "r.json"
    assert E.main(["--task", "sst", "--pred", pred, "--gold", gold, "--json", str(out)]) == 0
    result = json.loads(out.read_text())[0]
    assert result["accuracy"] == 0.75 and result["n"] == 4
    from sklearn.metrics import f1_score  # here, not at collection: sklearn's import is 4.5 s

    expected_f1 = f1_score([4, 0, 2, 3], [4, 1, 2, 3], labels=range(5), average="macro", zero_division=0)
    assert result["macro_f1"] == pytest.approx(expected_f1)
    assert result["confusion_matrix"][0] == [0, 1, 0, 0, 0]
    assert "accuracy 0.7500" in capsys.readouterr().out


def test_paraphrase_uses_the_yes_no_token_ids(tmp_path):
    pred, gold = files(tmp_path, GOLD_PARA, ["1 x-1, 8505", "2 y-2, 8505", "3 z-3, 3919"],
                       header="id \t Predicted_Is_Paraphrase ")
    metrics = E.SCORERS["para"].score(pred, gold)
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["labels"] == [3919, 8505]


@pytest.mark.parametrize("rows, pattern", [
    (["aa1, 4", "bb2, 0", "cc3, 2"], r"1 gold id\(s\) have no prediction \(e\.g\. \['dd4'\]\)"),
    (["aa1, 4", "bb2, 0", "cc3, 2", "dd4, 3", "ee5, 1"], r"1 predicted id\(s\) are not in"),
    (["aa1, 4", "bb2, 0", "aa1, 2", "dd4, 3"], r"pred\.csv, line 4: duplicate id 'aa1' \(first on line 2\)"),
    (["aa1, 4", "bb2, 5", "cc3, 2", "dd4, 3"], r"pred\.csv, line 3: unknown label 5"),
    (["aa1, 4", "bb2, four", "cc3, 2", "dd4, 3"], r"line 3: label 'four' is not an integer"),
    (["aa1 4"], r"line 2: expected `<id>, <label>`"),
])
def test_bad_prediction_files_are_refused(tmp_path, rows, pattern):
    pred, gold = files(tmp_path, GOLD_SST, rows)
    with pytest.raises(E.PredictionError, match=pattern):
        E.SCORERS["sst"].score(pred, gold)


def test_paraphrase_labels_must_be_token_ids(tmp_path, capsys):
    pred, gold = files(tmp_path, GOLD_PARA, ["1 x-1, 1", "2 y-2, 0", "3 z-3, 0"])
    assert E.main(["--task", "para", "--pred", pred, "--gold", gold]) == 1
    assert "unknown label 1 (allowed: [3919, 8505])" in capsys.readouterr().err


def test_header_is_required_and_files_must_exist(tmp_path):
    pred, gold = files(tmp_path, GOLD_SST, ["aa1, 4"], header="aa0, 1")
    with pytest.raises(E.PredictionError, match="line 1: expected a header"):
        E.read_predictions(pred)
    with pytest.raises(FileNotFoundError, match="prediction file not found"):
        E.read_predictions(tmp_path / "missing.csv")


def test_written_files_are_byte_for_byte_the_course_format_and_read_back(tmp_path):
    path = tmp_path / "p" / "out.csv"
    E.write_predictions(path, ["aa1", "2 y-2"], [3, 8505], "paraphrase")
    assert path.read_text() == "id \t Predicted_Is_Paraphrase \naa1, 3 \n2 y-2, 8505 \n"
    assert E.read_predictions(path) == {"aa1": 3, "2 y-2": 8505}


def test_split_dev_grades_the_tail_of_one_file(tmp_path):
    pred, gold = files(tmp_path, GOLD_PARA, ["2 y-2, 3919", "3 z-3, 8505"], header="id \t Predicted_Is_Paraphrase ")
    assert E.SCORERS["para"].score(pred, gold, split_dev=1)["accuracy"] == 0.5


def test_mismatched_flag_counts_are_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        E.main(["--task", "sst", "--task", "para", "--pred", "a", "--gold", "b"])
