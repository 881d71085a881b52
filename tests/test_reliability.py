"""Nothing lost on faults: kill -9 and --resume, crashes while saving, bad checkpoints, non-finite losses, unsafe
pickles, vocabularies that do not fit, prompts longer than the context."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file
from test_pretrain import TEXT, TINY
from test_task_data import make_tokenizer, write_sentiment

import run_classifier
import run_pretrain
from models.gpt2 import GPT2LMHeadModel, GPT2Model
from tasks import pretrain
from tasks.classifier import GPT2SentimentClassifier
from tasks.classifier import loss_fn as sentiment_loss
from tasks.data import Encoded, collate
from tasks.finetune import train
from training import checkpoint as ck
from training.engine import ArchitectureMismatchError, NonFiniteError, TrainConfig, load_weights

ROOT = Path(__file__).resolve().parents[1]
MODEL = "random:n_layer=2,n_head=2,n_embd=16,n_positions=64,vocab_size=64"


def kill_once_checkpointed(cmd: list[str], checkpoints: list[Path], cwd: Path) -> None:
    """Start `cmd`, wait until one of `checkpoints` is complete, let it run a random moment more, SIGKILL it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not any((c / "manifest.json").is_file() for c in checkpoints):
        assert proc.poll() is None, f"finished before its first checkpoint: {proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(random.Random(time.time_ns()).uniform(0.0, 0.4))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed: make it longer"


# ---- kill -9, then --resume --------------------------------------------------------------------------------------

def test_classifier_killed_at_a_random_moment_resumes_to_the_uninterrupted_weights(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok")
    paths = write_sentiment(tmp_path, "sst", 48)
    common = ["--tokenizer", tok, "--model", MODEL, "--epochs", "3", "--batch_size", "4", "--lr", "1e-3",
              "--fine-tune-mode", "full-model", "--save_every", "1", "--threads", "1",
              "--train", str(paths["train"]), "--dev", str(paths["dev"])]  # dropout 0.3 in the head: RNG restored too
    out = lambda d: ["--output_dir", str(tmp_path / d), "--dev_out", str(tmp_path / d / "dev.csv")]  # noqa: E731
    kill_once_checkpointed([sys.executable, str(ROOT / "run_classifier.py"), *common, *out("killed")],
                           [tmp_path / "killed" / "last"], tmp_path)
    capsys.readouterr()
    assert run_classifier.main(common + out("killed") + ["--resume"]) == 0
    resumed_from = capsys.readouterr().out
    assert run_classifier.main(common + out("full") + ["--save_every", "0"]) == 0  # saving does not change the run

    assert "resuming from" in resumed_from
    for name in ("model.safetensors", "extra.safetensors"):
        a, b = load_file(tmp_path / "full" / "last" / name), load_file(tmp_path / "killed" / "last" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name  # exactly equal, not merely close
    assert (tmp_path / "full" / "dev.csv").read_text() == (tmp_path / "killed" / "dev.csv").read_text()


def test_pretraining_killed_at_a_random_moment_resumes_to_the_uninterrupted_weights(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    common = ["--data", str(corpus), *TINY, "--max_iters", "120", "--eval_interval", "3", "--eval_iters", "1",
              "--dropout", "0.1"]
    killed = tmp_path / "killed"
    # wait for last/, which --resume reads: best/ is written first at an evaluation, and a kill between the two
    # (a busy machine stretches that moment) leaves nothing to resume from
    kill_once_checkpointed([sys.executable, str(ROOT / "run_pretrain.py"), *common, "--out_dir", str(killed)],
                           [killed / "last"], tmp_path)
    capsys.readouterr()
    resumed = run_pretrain.main(common + ["--out_dir", str(killed), "--resume"])
    step = int(capsys.readouterr().out.split("resuming from ")[1].split(" at step ")[1].split()[0])
    full = run_pretrain.main(common + ["--out_dir", str(tmp_path / "full")])

    assert 0 < step < 120 and resumed["steps_run"] == 120 - step
    for (name, a), b in zip(full["model"].state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name


# ---- crashes while saving, and bad checkpoints --------------------------------------------------------------------

SAVER = """
import sys, torch
sys.path.insert(0, {root!r})
from conftest import tiny_config
from models.gpt2 import GPT2LMHeadModel
from training.checkpoint import save_checkpoint
model = GPT2LMHeadModel(tiny_config("h4-wide"))
for step in range(1, 100000):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    save_checkpoint({folder!r}, model, state={{"step": step}})
"""


def test_a_process_killed_while_saving_leaves_a_whole_checkpoint(tmp_path):
    """Kill a process that saves in a loop at random moments: the checkpoint always loads, weights and state agree."""
    folder = tmp_path / "ck" / "last"
    script = SAVER.format(root=str(ROOT / "tests"), folder=str(folder))
    steps = []
    for _ in range(2):
        kill_once_checkpointed([sys.executable, "-c", script], [folder, folder.with_name(".last.old")], tmp_path)
        loaded = ck.load_checkpoint(folder)  # resolves to .last.old if the kill fell between the renames
        weights = load_file(loaded.path / "model.safetensors")
        assert all(bool((w == loaded.state["step"]).all()) for w in weights.values())
        steps.append(loaded.state["step"])
    assert all(s >= 1 for s in steps)
    leftovers = [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name]
    ck.save_checkpoint(folder, GPT2LMHeadModel(tiny_config()), state={"step": 0})  # clears a dead saver's temporary
    assert len(leftovers) <= 2 and not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("fail_in", ["model", "state"])
def test_an_error_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    model = GPT2LMHeadModel(tiny_config())
    ck.save_checkpoint(tmp_path / "last", model, state={"step": 1})

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if fail_in == "model":
        monkeypatch.setattr(model, "save_pretrained", disk_full)
    else:
        monkeypatch.setattr(ck.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        ck.save_checkpoint(tmp_path / "last", model, state={"step": 2})
    monkeypatch.undo()
    assert ck.load_checkpoint(tmp_path / "last").state == {"step": 1}
    ck.save_checkpoint(tmp_path / "last", model, state={"step": 3})
    assert ck.load_checkpoint(tmp_path / "last").state == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def _resave_manifest(folder: Path) -> None:
    """Make a tampered folder's manifest match again (what a buggy or hostile writer would produce)."""
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": ck._sha256(p)}
                for p in sorted(folder.iterdir()) if p.is_file() and p.name != ck.MANIFEST}
    (folder / ck.MANIFEST).write_text(json.dumps(manifest))


def test_corrupt_truncated_wrong_architecture_and_unsafe_checkpoints_each_say_so(tmp_path):
    torch.manual_seed(0)
    model = GPT2SentimentClassifier(GPT2Model(tiny_config()), 3)
    sd = model.state_dict()
    save = lambda name: ck.save_checkpoint(tmp_path / name, model.gpt, state={"step": 1},  # noqa: E731
                                           extra_tensors={k: v for k, v in sd.items() if not k.startswith("gpt.")})
    folder = save("truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ck.CorruptCheckpointError, match="truncated"):
        load_weights(model, folder)

    folder = save("flipped")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    (folder / "model.safetensors").write_bytes(data)
    with pytest.raises(ck.CorruptCheckpointError, match="does not match its checksum"):
        load_weights(model, folder)

    save("good")
    shallower = GPT2SentimentClassifier(GPT2Model(tiny_config(n_layer=2)), 3)
    with pytest.raises(ArchitectureMismatchError, match="n_layer 3 vs 2"):
        load_weights(shallower, tmp_path / "good")

    folder = save("unsafe")
    torch.save({"state": {"step": 1}, "payload": Payload()}, folder / ck.STATE)
    _resave_manifest(folder)
    with pytest.raises(ck.CorruptCheckpointError, match="refusing to load .*Python objects"):
        load_weights(model, folder)


class Payload:
    def __reduce__(self):
        return (os.system, ("echo should never run",))


def test_cli_resume_from_a_truncated_checkpoint_is_a_clear_error(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok")
    paths = write_sentiment(tmp_path, "sst", 16)
    args = ["--tokenizer", tok, "--model", MODEL, "--epochs", "1", "--batch_size", "8", "--threads", "1",
            "--train", str(paths["train"]), "--dev", str(paths["dev"]), "--output_dir", str(tmp_path / "ck"),
            "--dev_out", str(tmp_path / "dev.csv")]
    assert run_classifier.main(args) == 0
    state = tmp_path / "ck" / "last" / ck.STATE
    state.write_bytes(state.read_bytes()[:50])
    assert run_classifier.main(args + ["--resume"]) == 1
    assert "training_state.pt has 50 bytes" in capsys.readouterr().err


def test_pretrain_resume_refuses_other_sizes_and_a_vocabulary_larger_than_the_embedding(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    common = ["--data", str(corpus), *TINY, "--eval_interval", "5"]
    run_pretrain.main(common + ["--out_dir", str(tmp_path / "out"), "--max_iters", "5"])
    with pytest.raises(ArchitectureMismatchError, match="n_embd 16 vs 32"):
        run_pretrain.main(common + ["--out_dir", str(tmp_path / "out"), "--max_iters", "10", "--resume",
                                    "--n_embd", "32"])
    vocab = tmp_path / "out" / "last" / "char_vocab.json"  # --resume continues last/
    chars = json.loads(vocab.read_text())
    chars = chars["chars"] if isinstance(chars, dict) else chars
    extra = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in chars][:5]
    vocab.write_text(vocab.read_text().replace(json.dumps(chars[-1])[1:-1] + '"',
                                               json.dumps(chars[-1])[1:-1] + '", ' + ", ".join(f'"{c}"' for c in extra),
                                               1))
    _resave_manifest(tmp_path / "out" / "last")
    with pytest.raises(ValueError, match="tokenizer has .* tokens but the model's embedding only"):
        run_pretrain.main(common + ["--out_dir", str(tmp_path / "out"), "--max_iters", "10", "--resume"])


def test_pretrain_overwrite_clears_a_broken_checkpoint_without_reading_it(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    common = ["--data", str(corpus), *TINY, "--eval_interval", "5", "--out_dir", str(tmp_path / "out")]
    run_pretrain.main(common + ["--max_iters", "5"])
    (tmp_path / "out" / "last" / ck.STATE).write_bytes(b"garbage")  # the checkpoint --resume reads
    with pytest.raises(ck.CorruptCheckpointError, match="pass --overwrite"):
        run_pretrain.main(common + ["--max_iters", "5", "--resume"])
    capsys.readouterr()
    again = run_pretrain.main(common + ["--max_iters", "5", "--overwrite"])
    assert again["steps_run"] == 5 and "--overwrite: removed the checkpoints" in capsys.readouterr().out
    assert ck.load_checkpoint(tmp_path / "out" / "best").state["step"] == 5  # a whole, verified checkpoint again


def test_pretrain_resume_rule_refuses_changed_settings_allows_more_steps_and_says_when_complete(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    common = ["--data", str(corpus), *TINY, "--eval_interval", "5", "--out_dir", str(tmp_path / "out")]
    run_pretrain.main(common + ["--max_iters", "5"])
    with pytest.raises(ValueError, match=r"batch_size was 4, now 8; lr was 0.001, now 0.002"):
        run_pretrain.main(common + ["--max_iters", "5", "--resume", "--learning_rate", "2e-3", "--batch_size", "8"])
    with pytest.raises(ValueError, match=r"max_iters was 5, now 3 \(it may only grow\)"):
        run_pretrain.main(common + ["--max_iters", "3", "--resume"])
    capsys.readouterr()
    done = run_pretrain.main(common + ["--max_iters", "5", "--resume"])
    out = capsys.readouterr().out
    assert done["complete"] and done["steps_run"] == 0 and done["step"] == 5
    assert "is already complete: step 5 of --max_iters 5" in out and "Raise --max_iters" in out
    assert "done: step 5 | val" in out  # the saved losses are reported, not nothing
    more = run_pretrain.main(common + ["--max_iters", "10", "--resume"])
    assert not more["complete"] and more["steps_run"] == 5 and more["step"] == 10


def test_fine_tuning_resume_adds_epochs_refuses_other_changes_and_says_when_complete(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok")
    paths = write_sentiment(tmp_path, "sst", 16)
    base = ["--tokenizer", tok, "--model", MODEL, "--batch_size", "8", "--threads", "1",
            "--train", str(paths["train"]), "--dev", str(paths["dev"]), "--output_dir", str(tmp_path / "ck"),
            "--dev_out", str(tmp_path / "dev.csv")]
    args = base + ["--lr", "1e-3"]
    assert run_classifier.main(args + ["--epochs", "1"]) == 0
    capsys.readouterr()
    assert run_classifier.main(args + ["--epochs", "1", "--resume"]) == 0
    assert "is already complete: 1 of 1 epochs" in capsys.readouterr().out
    assert run_classifier.main(base + ["--lr", "5e-4", "--epochs", "2", "--resume"]) == 1
    assert "lr was 0.001, now 0.0005" in capsys.readouterr().err
    assert run_classifier.main(args + ["--epochs", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "epoch 2/2 |" in out and "epoch 1/2 |" not in out
    history = ck.load_checkpoint(tmp_path / "ck" / "last").state["history"]
    assert [h["epoch"] for h in history] == [1, 2]


# ---- non-finite losses and gradients -----------------------------------------------------------------------------

def _tiny_task(tmp_path, poison=None, grad_poison_step=None, **cfg):
    """A tiny classifier on random ids; the loss of the batch holding example `poison` is made NaN, or the
    gradient of optimizer step `grad_poison_step` is."""
    torch.manual_seed(0)
    model = GPT2SentimentClassifier(GPT2Model(tiny_config()), 3, 0.0, "full-model")
    g = torch.Generator().manual_seed(1)
    data = [Encoded(str(i), torch.randint(0, 100, (5,), generator=g).tolist(), i % 3) for i in range(24)]
    calls = {"n": 0}

    def loss(m, batch):
        value, stats = sentiment_loss(m, batch)
        return (value * float("nan") if poison in batch["ids"] else value), stats

    if grad_poison_step is not None:
        def hook(grad):
            calls["n"] += 1
            return grad * float("nan") if calls["n"] == grad_poison_step else grad
        model.classifier.weight.register_hook(hook)
    config = TrainConfig(output_dir=str(tmp_path / "out"), epochs=2, batch_size=4, lr=1e-3, save_every=1, **cfg)
    result = train(model, len(data), lambda idx: collate([data[i] for i in idx], 0), loss,
                   lambda m: {"acc": 0.0}, config, {"task": "nan"})
    return model, result


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    order = torch.randperm(24, generator=torch.Generator().manual_seed(11711 * 1000)).tolist()
    poison = str(order[4 * 3])  # in the 4th batch of epoch 1: optimizer step 4
    with pytest.raises(NonFiniteError, match=r"non-finite loss nan at optimizer step 4 \(epoch 1, batch 4 of 6\).*"
                                             r"last good checkpoint .*out/last is kept"):
        _tiny_task(tmp_path, poison=poison)
    kept = ck.load_checkpoint(tmp_path / "out" / "last")
    assert kept.state["step"] == 3
    assert all(torch.isfinite(t).all() for t in load_file(kept.path / "model.safetensors").values())


def test_skip_nonfinite_skips_and_counts_bad_batches(tmp_path, capsys):
    order = torch.randperm(24, generator=torch.Generator().manual_seed(11711 * 1000)).tolist()
    model, result = _tiny_task(tmp_path, poison=str(order[4 * 3]), skip_nonfinite=True)
    assert result["skipped"] == 2  # the poisoned example comes round once per epoch
    assert "warning: skipped optimizer step 4 (epoch 1, batch 4 of 6): non-finite loss nan" in capsys.readouterr().out
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert ck.load_checkpoint(tmp_path / "out" / "last").state["step"] == 12 - 2


def test_non_finite_gradient_with_a_finite_loss_stops_too(tmp_path):
    with pytest.raises(NonFiniteError, match=r"non-finite gradient norm nan at optimizer step 2 "):
        _tiny_task(tmp_path, grad_poison_step=2)


def test_pretraining_stops_on_a_nan_loss_or_skips_it(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    real, calls = pretrain.next_token_loss, {"n": 0}

    def poisoned(model, x, y, reduction="mean"):
        loss = real(model, x, y, reduction)
        if torch.is_grad_enabled():  # training, not evaluation
            calls["n"] += 1
            if calls["n"] == 7:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(pretrain, "next_token_loss", poisoned)
    common = ["--data", str(corpus), *TINY, "--max_iters", "10", "--eval_interval", "5"]
    with pytest.raises(NonFiniteError, match=r"non-finite loss nan at step 7: .*last good checkpoint .*last is kept"):
        run_pretrain.main(common + ["--out_dir", str(tmp_path / "stop")])
    assert ck.load_checkpoint(tmp_path / "stop" / "best").state["step"] == 5
    calls["n"] = 0
    summary = run_pretrain.main(common + ["--out_dir", str(tmp_path / "skip"), "--skip_nonfinite"])
    assert summary["skipped"] == 1 and summary["step"] == 10 and "warning: skipped step 7" in capsys.readouterr().out
    assert all(torch.isfinite(p).all() for p in summary["model"].parameters())


# ---- prompts longer than the context ------------------------------------------------------------------------------

def test_sampling_warns_when_the_prompt_is_cut_to_the_context(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    run_pretrain.main(["--data", str(corpus), "--out_dir", str(tmp_path / "out"), *TINY, "--max_iters", "5",
                       "--eval_interval", "5"])
    model, tokenizer = pretrain.load_for_sampling(tmp_path / "out" / "best")
    with pytest.warns(UserWarning, match="the prompt has 40 tokens, more than the model's context of 16: keeping"):
        text = pretrain.sample_text(model, tokenizer, "the king " * 4 + "the ", 3, generator=torch.Generator())
    assert len(text[0]) == 16 + 3
