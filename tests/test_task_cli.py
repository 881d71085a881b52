"""run_classifier.py and run_paraphrase.py end to end on tiny files, a tiny tokenizer and a tiny random model."""
import re

import pytest
from test_task_data import make_tokenizer, write_quora, write_sentiment

import run_classifier
import run_paraphrase
from tasks import evaluate as E


@pytest.fixture
def setup(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    model = "random:n_layer=2,n_head=2,n_embd=16,n_positions=64,vocab_size=64"
    return tmp_path, ["--tokenizer", tok, "--model", model, "--epochs", "1", "--batch_size", "8", "--threads", "1"]


def printed_dev_acc(out: str) -> float:
    return float(re.search(r"best epoch \d+: dev acc ([0-9.]+)", out).group(1))


@pytest.mark.parametrize("mode", ["last-linear-layer", "full-model"])
def test_classifier_one_epoch_writes_gradable_files(setup, capsys, mode):
    tmp, common = setup
    paths = write_sentiment(tmp, "sst", 40)
    dev_out, test_out = tmp / "pred" / f"{mode}-sst-dev-out.csv", tmp / "pred" / f"{mode}-sst-test-out.csv"
    code = run_classifier.main(common + ["--fine-tune-mode", mode, "--train", str(paths["train"]),
                                         "--dev", str(paths["dev"]), "--test", str(paths["test-student"]),
                                         "--dev_out", str(dev_out), "--test_out", str(test_out),
                                         "--output_dir", str(tmp / "ck"), "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "5 classes" in out and re.search(r"epoch 1/1 \| train loss [0-9.]+ acc [0-9.]+ \| dev acc", out)
    graded = E.SCORERS["sst"].score(str(dev_out), str(paths["dev"]))
    assert graded["n"] == 20 and round(graded["accuracy"], 4) == printed_dev_acc(out)
    test_rows = E.read_predictions(test_out, set(range(5)))
    assert list(test_rows) == [f"te{i:05d}abc" for i in range(20)]
    assert dev_out.read_text().startswith("id \t Predicted_Sentiment \n")
    assert (tmp / "ck" / "best" / "model.safetensors").is_file() and (tmp / "ck" / "last" / "extra.safetensors").is_file()


def test_paraphrase_one_epoch_with_split_dev_and_test(setup, capsys):
    tmp, common = setup
    train = write_quora(tmp / "quora.csv", 60)
    test = write_quora(tmp / "quora-test.csv", 10, index_column=False, labels=False, seed=1)
    dev_out, test_out = tmp / "para-dev-output.csv", tmp / "para-test-output.csv"
    code = run_paraphrase.main(common + ["--para_train", str(train), "--split_dev", "40", "--para_test", str(test),
                                         "--para_dev_out", str(dev_out), "--para_test_out", str(test_out),
                                         "--output_dir", str(tmp / "ck"), "--lr", "1e-3", "--grad_accum", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "first 40 examples train, the other 20 dev" in out
    graded = E.SCORERS["para"].score(str(dev_out), str(train), split_dev=40)
    assert graded["n"] == 20 and round(graded["accuracy"], 4) == printed_dev_acc(out)
    assert list(E.read_predictions(test_out, {8505, 3919})) == [f"{i} q{i:04d}" for i in range(10)]
    assert dev_out.read_text().startswith("id \t Predicted_Is_Paraphrase \n")


def test_cli_errors_name_the_problem(setup, capsys):
    tmp, common = setup
    paths = write_sentiment(tmp, "sst", 10)
    bad = tmp / "bad-train.csv"
    bad.write_text(paths["train"].read_text() + "99\tzz\tsome text\t7\n")
    args = common + ["--dev", str(paths["dev"]), "--output_dir", str(tmp / "ck"), "--dev_out", str(tmp / "d.csv")]
    assert run_classifier.main(args + ["--train", str(bad), "--num_labels", "5"]) == 1
    assert "bad-train.csv, line 12: sentiment 7 is out of range for 5 classes" in capsys.readouterr().err
    assert run_classifier.main(args + ["--train", str(tmp / "mine.csv")]) == 1
    assert "pass --num_labels" in capsys.readouterr().err
    assert run_classifier.main(args + ["--train", str(paths["train"]), "--resume"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    assert run_classifier.main(args + ["--train", str(paths["train"])]) == 0
    assert run_classifier.main(args + ["--train", str(paths["train"])]) == 1  # its predictions are there
    assert "d.csv already exists (an earlier run's predictions): pass --overwrite" in capsys.readouterr().err
    assert run_classifier.main(args + ["--train", str(paths["train"]), "--dev_out", str(tmp / "d2.csv")]) == 1
    assert "pass --resume to continue it or --overwrite" in capsys.readouterr().err
    assert run_paraphrase.main(common + ["--train", str(write_quora(tmp / "q.csv", 10))]) == 1
    assert "no dev data" in capsys.readouterr().err


def test_max_steps_reports_throughput_without_files(setup, capsys):
    tmp, common = setup
    paths = write_sentiment(tmp, "cfimdb", 40, num_labels=2)
    code = run_classifier.main(common + ["--train", str(paths["train"]), "--dev", str(paths["dev"]),
                                         "--output_dir", str(tmp / "ck"), "--max_steps", "3", "--bf16",
                                         "--dev_out", str(tmp / "d.csv"), "--fine-tune-mode", "full-model"])
    out = capsys.readouterr().out
    assert code == 0 and "2 classes" in out
    assert re.search(r"benchmark: 3 optimizer steps \(3 batches, \d+ real tokens\) in [0-9.]+ s: \d+ tok/s", out)
    assert not (tmp / "d.csv").exists() and not (tmp / "ck").exists()


def test_gradient_checkpointing_flag_trains_to_the_same_weights(setup, capsys, monkeypatch):
    import torch
    import torch.utils.checkpoint
    from safetensors.torch import load_file

    tmp, common = setup
    paths = write_sentiment(tmp, "sst", 24)
    calls = []
    recompute = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or recompute(*a, **k))
    weights = {}
    for flag in ([], ["--gradient_checkpointing"]):
        calls.clear()
        out_dir = tmp / ("ck" + "".join(flag))
        code = run_classifier.main(common + ["--fine-tune-mode", "full-model", "--train", str(paths["train"]),
                                             "--dev", str(paths["dev"]), "--test", str(paths["test-student"]),
                                             "--output_dir", str(out_dir), "--lr", "1e-3", *flag])
        assert code == 0, capsys.readouterr().out
        weights[bool(flag)] = load_file(out_dir / "last" / "model.safetensors")
        assert bool(calls) == bool(flag)  # the flag reaches the body: its blocks run under checkpoint()
    for name, tensor in weights[False].items():  # recomputation replays dropout's random state: same training
        torch.testing.assert_close(weights[True][name], tensor, atol=1e-6, rtol=0, msg=name)


def test_dropout_flags_mean_one_thing_on_every_cli(setup, capsys):
    """--hidden_dropout_prob is the body's residual + embedding dropout (as GPT2Config's alias) on every CLI;
    the classifier's head has its own --head_dropout."""
    import json

    from training.checkpoint import load_checkpoint

    tmp, common = setup
    paths = write_sentiment(tmp, "sst", 16)
    code = run_classifier.main(common + ["--train", str(paths["train"]), "--dev", str(paths["dev"]),
                                         "--dev_out", str(tmp / "d.csv"), "--output_dir", str(tmp / "cls"),
                                         "--hidden_dropout_prob", "0.25", "--head_dropout", "0.4"])
    assert code == 0, capsys.readouterr().err
    train = write_quora(tmp / "q.csv", 30)
    code = run_paraphrase.main(common + ["--para_train", str(train), "--split_dev", "20", "--output_dir",
                                         str(tmp / "para"), "--para_dev_out", str(tmp / "p.csv"),
                                         "--hidden_dropout_prob", "0.25"])
    assert code == 0, capsys.readouterr().err
    for run in ("cls", "para"):
        saved = json.loads((tmp / run / "last" / "config.json").read_text())
        assert (saved["resid_pdrop"], saved["embd_pdrop"], saved["attn_pdrop"]) == (0.25, 0.25, 0.1), run
    assert load_checkpoint(tmp / "cls" / "last").state["run"]["head_dropout"] == 0.4


# ---- the Python API: one dataclass per CLI, the same fields and defaults as its flags -----------------------------

def _flags(parser) -> dict:
    return {a.dest: a.default for a in parser._actions if a.dest != "help"}


@pytest.mark.parametrize("cli", ["run_classifier", "run_paraphrase", "run_sonnet", "run_pretrain"])
def test_every_cli_flag_is_a_config_field_with_the_same_default(cli):
    import dataclasses
    import importlib

    module = importlib.import_module(cli)
    flags = _flags(module.build_parser())
    if cli == "run_pretrain":
        from tasks.pretrain import PretrainConfig as config
        folded = {"bf16", "fp16", "use_gpu", "dtype"}  # folded into dtype / device before the config is made
    else:
        config = type(module.get_args([]))
        folded = set()
    fields = {f.name: f for f in dataclasses.fields(config)}
    missing = set(flags) - set(fields) - (folded - {"dtype"})
    assert not missing, f"{cli}: flags without a config field: {sorted(missing)}"
    extra = set(fields) - set(flags) - {"expect"}
    assert not extra, f"{cli}: config fields without a flag: {sorted(extra)}"
    instance = config()
    for name, default in flags.items():
        if name not in folded:
            assert getattr(instance, name) == default, f"{cli} --{name}: flag default {default!r}, config " \
                                                       f"default {getattr(instance, name)!r}"


def test_the_classifier_runs_from_python_with_a_config_and_writes_metrics(setup, capsys):
    from tasks.classifier import ClassifierConfig, run
    from training.metrics import read_metrics

    tmp, _ = setup
    paths = write_sentiment(tmp, "sst", 24)
    cfg = ClassifierConfig(tokenizer=str(tmp / "tok"), model="random:n_layer=2,n_head=2,n_embd=16,n_positions=64,"
                           "vocab_size=64", epochs=2, batch_size=8, threads=1, fine_tune_mode="full-model",
                           train=str(paths["train"]), dev=str(paths["dev"]), dev_out=str(tmp / "dev.csv"),
                           output_dir=str(tmp / "ck"), lr=1e-3, log_interval=1)
    (result,) = run(cfg)
    assert result["task"] == "sst" and len(result["history"]) == 2 and (tmp / "dev.csv").is_file()
    records = read_metrics(tmp / "ck")
    evals = [r for r in records if r["kind"] == "eval"]
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in evals] == [3, 6] and [r["epoch"] for r in evals] == [1, 2]  # 24 examples, batch 8
    assert [r["step"] for r in trains] == [1, 2, 3, 4, 5, 6]
    assert all({"train_loss", "lr", "tokens_per_s", "wall_s"} <= set(r) for r in trains)
    assert all("dev_acc" in r and "dev_f1" in r for r in evals)
    assert (tmp / "ck" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
