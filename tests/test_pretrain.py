"""Training a GPT from scratch on a text file (run_pretrain.py, tasks/pretrain.py; the character tokenizer on its own:
test_char_tokenizer.py)."""
import contextlib
import math

import numpy as np
import pytest
import torch
from conftest import tokenizer_path

import run_pretrain
from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from tasks import pretrain
from training.checkpoint import STATE

TEXT = "".join(f"{w} the {v} of {n}, said the {w}.\n" for w, v, n in zip(
    ["king", "queen", "fool", "knight"] * 40, ["crown", "song", "sword", "word", "heart"] * 32,
    ["york", "rome", "kent"] * 54))

TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--block_size", "16", "--batch_size", "4",
        "--eval_iters", "2", "--log_interval", "5", "--num_samples", "0", "--threads", "1",
        "--warmup_iters", "2"]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def run(data, out_dir, *extra):
    return run_pretrain.main(["--data", str(data), "--out_dir", str(out_dir), *TINY, *extra])


def test_corpus_is_encoded_once_split_90_10_and_batches_are_shifted_windows(corpus_file, tmp_path, monkeypatch):
    corpus = pretrain.prepare_corpus(corpus_file, "char", tmp_path / "cache")
    n = len(TEXT)
    assert corpus.meta["num_tokens"] == n and isinstance(corpus.tokens, np.memmap)
    assert (len(corpus.train), len(corpus.val)) == (int(n * 0.9), n - int(n * 0.9))
    assert corpus.tokenizer.decode(corpus.tokens.tolist()) == TEXT
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    monkeypatch.setattr(pretrain, "_encode_to_file", lambda *a, **k: pytest.fail("re-encoded a cached corpus"))
    again = pretrain.prepare_corpus(corpus_file, "char", tmp_path / "cache", val_fraction=0.25)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == files  # reused, not re-encoded
    assert len(again.val) == n - int(n * 0.75)
    x, y = pretrain.get_batch(corpus.val, 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    val_text = corpus.tokenizer.decode(corpus.val.tolist())
    assert all(corpus.tokenizer.decode(row.tolist()) in val_text for row in x)


def test_bpe_encoding_in_chunks_equals_encoding_the_whole_text(tmp_path):
    tok = pretrain.tokenizer_for(tokenizer_path())
    text = "".join(f"line {i}:  spaced   words{' ' * (i % 3)}\n{chr(10) * (i % 4)}\r\n  indent {i}\n"
                   for i in range(200))
    path = tmp_path / "bpe.txt"
    path.write_bytes(text.encode())
    corpus = pretrain.prepare_corpus(path, tok, tmp_path / "cache", chunk_bytes=64)
    assert corpus.tokens.tolist() == tok(text, add_special_tokens=False)["input_ids"]


def test_loss_falls_well_below_uniform_guess(corpus_file, tmp_path):
    summary = run(corpus_file, tmp_path / "out", "--max_iters", "80", "--eval_interval", "40", "--n_embd", "32",
                  "--learning_rate", "1e-2", "--warmup_iters", "5")
    uniform = math.log(len(summary["tokenizer"]))  # 3.18 nats for 24 characters
    assert summary["val_loss"] < 0.5 * uniform and summary["train_loss"] < 0.5 * uniform
    assert (tmp_path / "out" / "best" / "char_vocab.json").is_file()


@pytest.mark.parametrize("threads", [
    ["--dropout", "0.1"],  # one thread; dropout draws from the restored global generator
    ["--threads", "2"],  # each batch split across two threads
])
def test_resume_equals_an_uninterrupted_run(corpus_file, tmp_path, threads):
    common = ["--eval_interval", "5", "--lr_decay_iters", "20", "--warmup_iters", "3", *threads]
    full = run(corpus_file, tmp_path / "full", "--max_iters", "20", *common)
    run(corpus_file, tmp_path / "split", "--max_iters", "10", *common)
    resumed = run(corpus_file, tmp_path / "split", "--max_iters", "20", "--resume", *common)
    assert resumed["steps_run"] == 10 and resumed["val_loss"] == full["val_loss"]
    for (name, a), b in zip(full["model"].state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(FileExistsError, match="--resume"):
        run(corpus_file, tmp_path / "split", "--max_iters", "20", *common)
    again = run(corpus_file, tmp_path / "split", "--max_iters", "20", "--overwrite", *common)  # from scratch
    assert again["steps_run"] == 20 and again["val_loss"] == full["val_loss"]


def test_gradient_checkpointing_trains_the_same_model(corpus_file, tmp_path, monkeypatch):
    import torch.utils.checkpoint

    calls = []
    recompute = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or recompute(*a, **k))
    plain = run(corpus_file, tmp_path / "plain", "--max_iters", "6", "--eval_interval", "3", "--dropout", "0.1")
    assert calls == []
    recomputed = run(corpus_file, tmp_path / "ckpt", "--max_iters", "6", "--eval_interval", "3", "--dropout", "0.1",
                     "--gradient_checkpointing")
    assert recomputed["model"].gpt.gradient_checkpointing and not plain["model"].gpt.gradient_checkpointing
    assert len(calls) >= 6  # the flag reached the blocks: they ran under checkpoint() in training
    for (name, a), b in zip(plain["model"].state_dict().items(), recomputed["model"].state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)


def test_batch_split_across_threads_gives_the_gradient_of_the_whole_batch(corpus_file, tmp_path):
    """The engine's split_batch: slices of a micro-batch on separate threads add up to the whole batch's gradient."""
    from training.backward import Backward, LossOf
    from training.batches import MicroBatch

    corpus = pretrain.prepare_corpus(corpus_file, "char", tmp_path / "cache")
    x, y = pretrain.get_batch(corpus.train, 5, 16, torch.Generator().manual_seed(0))
    results = []
    for workers in (1, 3):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(corpus.tokenizer), n_positions=16, n_embd=16, n_layer=2,
                                           n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        params = list(model.parameters())
        backward = Backward(LossOf(model, pretrain.window_loss), params, workers, contextlib.nullcontext)
        loss, _ = backward(MicroBatch({"input_ids": x, "labels": y}, 0.5, x.numel()), lambda t: t)
        backward.close()
        results.append((loss, torch.cat([p.grad.flatten() for p in params])))
    (loss1, grad1), (loss3, grad3) = results
    expected = torch.nn.functional.cross_entropy(model(x)["logits"].flatten(0, 1), y.flatten()).detach()
    torch.testing.assert_close(loss1, 0.5 * expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss3, loss1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad3, grad1, rtol=1e-5, atol=1e-7)
    assert grad1.abs().sum() > 0


def test_sampling_from_a_checkpoint_beyond_the_context(corpus_file, tmp_path, capsys):
    run(corpus_file, tmp_path / "out", "--max_iters", "10", "--eval_interval", "5")
    argv = ["--sample", "--model", str(tmp_path / "out" / "best"), "--prompt", "the king", "--max_new_tokens", "40",
            "--num_samples", "2", "--top_p", "0.9"]
    first = run_pretrain.main(argv)["samples"]
    assert len(first) == 2 and all(s.startswith("the king") and len(s) == len("the king") + 40 for s in first)
    assert run_pretrain.main(argv)["samples"] == first  # seeded
    with pytest.raises(ValueError, match="not in the .*vocabulary.*'Z'"):
        run_pretrain.main(argv[:4] + ["Zebra"])


def test_bpe_checkpoint_loads_in_transformers(corpus_file, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer_dir = tokenizer_path()
    summary = run(corpus_file, tmp_path / "out", "--tokenizer", str(tokenizer_dir), "--max_iters", "4",
                  "--eval_interval", "2")
    folder = tmp_path / "out" / "best"
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok.encode(" the queen of rome")])
    ours = GPT2LMHeadModel.from_pretrained(folder).eval()
    torch.testing.assert_close(hf(ids).logits, ours(ids)["logits"], atol=1e-5, rtol=1e-5)
    assert hf.config.vocab_size == len(summary["tokenizer"]) == 50257
    samples = run_pretrain.main(["--sample", "--model", str(folder), "--max_new_tokens", "5"])["samples"]
    assert samples[0].startswith("<|endoftext|>") and len(samples[0]) > len("<|endoftext|>")


@pytest.mark.parametrize("content, error, match", [
    (b"", ValueError, "is empty"),
    (b"good line\nbad \xff byte\n", ValueError, r"not UTF-8 text at line 2 \(byte 14\)"),
    (None, FileNotFoundError, "not found"),
    ("dir", ValueError, "not a file"),
])
def test_errors_for_empty_or_unreadable_corpus(tmp_path, content, error, match):
    path = tmp_path / "corpus.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=match):
        run(path, tmp_path / "out", "--max_iters", "2")


def test_errors_for_block_size_above_context_and_a_corpus_too_short(corpus_file, tmp_path):
    with pytest.raises(ValueError, match="block_size 32 exceeds .*n_positions=16"):
        run(corpus_file, tmp_path / "out", "--max_iters", "2", "--block_size", "32", "--n_positions", "16")
    short = tmp_path / "short.txt"
    short.write_text("just a few characters here\n" * 3)
    with pytest.raises(ValueError, match="the val split has 9 tokens"):
        run(short, tmp_path / "out2", "--max_iters", "2")


def test_bf16_weights_trains_in_bf16_with_fp32_masters_and_resumes_exactly(corpus_file, tmp_path, monkeypatch):
    """--dtype bf16-weights: the model's weights are bf16 (no autocast), AdamW keeps their fp32 masters and moments,
    the loss falls as in fp32, and a resumed run (the masters come back from the optimizer state) equals an
    uninterrupted one."""
    from training import engine

    monkeypatch.setattr(engine, "bf16_matmul_is_fast", lambda device: True)  # no warning on AVX2-only CPUs
    common = ["--dtype", "bf16-weights", "--eval_interval", "10", "--lr_decay_iters", "40", "--n_embd", "32",
              "--learning_rate", "1e-2", "--warmup_iters", "5", "--dropout", "0.1"]
    full = run(corpus_file, tmp_path / "full", "--max_iters", "40", *common)
    model = full["model"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    fp32 = run(corpus_file, tmp_path / "fp32", "--max_iters", "40", *common[2:])
    assert abs(full["val_loss"] - fp32["val_loss"]) < 0.1 * fp32["val_loss"]
    assert full["val_loss"] < 0.6 * math.log(len(full["tokenizer"]))
    state = torch.load(tmp_path / "full" / "last" / STATE, weights_only=False)  # OUT/last's optimizer state
    masters = [s["master"] for s in state["optimizer"]["state"].values() if "master" in s]
    assert len(masters) == len(list(model.parameters())) and all(m.dtype == torch.float32 for m in masters)
    run(corpus_file, tmp_path / "split", "--max_iters", "20", *common)
    resumed = run(corpus_file, tmp_path / "split", "--max_iters", "40", "--resume", *common)
    assert resumed["steps_run"] == 20 and resumed["val_loss"] == full["val_loss"]
    for (name, a), b in zip(model.state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b), name


def test_bf16_weights_with_muon_is_refused_by_name(corpus_file, tmp_path):
    with pytest.raises(ValueError, match="bf16-weights .* --optimizer adamw"):
        run(corpus_file, tmp_path / "out", "--max_iters", "2", "--dtype", "bf16-weights", "--optimizer", "muon")
