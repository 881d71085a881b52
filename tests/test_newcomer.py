"""What a newcomer trips on (issue 30): output folders that do not exist yet, the confusion matrix in the table,
the unreachable hub (one probe, then offline), offline errors that say what to do, LoRA on a random base, and
prediction files that one run must not silently take from another."""
import json
import re

from test_evaluate import GOLD_PARA, GOLD_SST, files

from tasks import evaluate as E


def test_evaluate_json_creates_its_folder_and_prints_the_confusion_matrix(tmp_path, monkeypatch, capsys):
    pred, gold = files(tmp_path, GOLD_SST, ["aa1, 4", "bb2, 1", "cc3, 2", "dd4, 3"])
    monkeypatch.chdir(tmp_path)
    assert E.main(["--task", "sst", "--pred", pred, "--gold", gold, "--json", "runs/deeper/eval.json"]) == 0
    assert json.loads((tmp_path / "runs" / "deeper" / "eval.json").read_text())[0]["accuracy"] == 0.75
    out = capsys.readouterr().out
    table = out[out.index("sst confusion matrix"):].splitlines()
    assert table[1].split() == ["gold", "\\", "pred", "0", "1", "2", "3", "4"]
    assert table[2].split() == ["0", "0", "1", "0", "0", "0"]  # gold 0 predicted as 1
    assert [row.split()[0] for row in table[2:7]] == ["0", "1", "2", "3", "4"]


def test_evaluate_names_the_paraphrase_answers_in_the_confusion_matrix(tmp_path, capsys):
    pred, gold = files(tmp_path, GOLD_PARA, ["1 x-1, 8505", "2 y-2, 8505", "3 z-3, 3919"],
                       header="id \t Predicted_Is_Paraphrase ")
    assert E.main(["--task", "para", "--pred", pred, "--gold", gold]) == 0
    out = capsys.readouterr().out
    assert re.search(r"no 3919 +1 +1\n +yes 8505 +0 +1", out), out
