"""fp16 autocast with a gradient scaler, in the fine-tuning loop and in pretraining (runs on CPU too: torch's CPU
autocast and GradScaler support fp16, so the logic is tested here and on GPUs alike)."""
import math

import pytest
import torch
from safetensors.torch import load_file
from test_pretrain import TEXT, TINY
from test_task_data import make_tokenizer, write_sentiment

import run_classifier
import run_pretrain
from training import engine
from training.checkpoint import load_checkpoint


@pytest.fixture
def classifier_args(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    paths = write_sentiment(tmp_path, "sst", 24)
    model = "random:n_layer=2,n_head=2,n_embd=16,n_positions=64,vocab_size=64"
    return lambda out, *extra: ["--tokenizer", tok, "--model", model, "--batch_size", "8", "--threads", "1",
                                "--lr", "1e-3", "--fine-tune-mode", "full-model", "--train", str(paths["train"]),
                                "--dev", str(paths["dev"]), "--output_dir", str(tmp_path / out),
                                "--dev_out", str(tmp_path / out / "dev.csv"), *extra]


def test_fp16_fine_tuning_trains_and_resumes_exactly_with_its_loss_scale(classifier_args, tmp_path):
    assert run_classifier.main(classifier_args("straight", "--fp16", "--epochs", "2")) == 0
    assert run_classifier.main(classifier_args("split", "--fp16", "--epochs", "1")) == 0
    assert run_classifier.main(classifier_args("split", "--fp16", "--epochs", "2", "--resume")) == 0
    a = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    b = load_file(tmp_path / "split" / "last" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the scaler's state is part of the checkpoint
    state = load_checkpoint(tmp_path / "straight" / "last").state
    # 6 optimizer steps: the first few overflow at the default scale 2**16 and are skipped, the rest train
    assert state["step"] >= 1 and state["overflows"] >= 1 and state["step"] + state["overflows"] == 6
    assert state["scaler"]["scale"] < 2.0 ** 16  # the scale the resumed run continued with


def test_fp16_overflows_are_skipped_counted_and_the_scale_recovers(classifier_args, tmp_path, capsys, monkeypatch):
    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda *a, **k: real(*a, **{**k, "init_scale": 2.0 ** 40}))
    assert run_classifier.main(classifier_args("ov", "--fp16", "--epochs", "2")) == 0
    out = capsys.readouterr().out
    skipped = [int(n) for n in __import__("re").findall(r"\| (\d+) fp16 overflow steps skipped", out)]
    assert skipped and skipped[-1] > 0
    weights = load_file(tmp_path / "ov" / "last" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_bf16_and_fp16_together_are_refused(classifier_args, capsys):
    assert run_classifier.main(classifier_args("x", "--fp16", "--bf16")) == 1
    assert "--bf16 and --fp16 exclude each other" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exclude each other"):
        engine.autocast("cpu", True, True)


def test_fp16_pretraining_resumes_exactly(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    common = ["--data", str(corpus), *TINY, "--eval_interval", "4", "--dtype", "float16", "--lr_decay_iters", "8"]
    full = run_pretrain.main(common + ["--out_dir", str(tmp_path / "full"), "--max_iters", "8"])
    run_pretrain.main(common + ["--out_dir", str(tmp_path / "split"), "--max_iters", "4"])
    resumed = run_pretrain.main(common + ["--out_dir", str(tmp_path / "split"), "--max_iters", "8", "--resume"])
    assert resumed["steps_run"] == 4 and math.isfinite(resumed["val_loss"])
    for (name, a), b in zip(full["model"].state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name
