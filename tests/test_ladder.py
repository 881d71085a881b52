"""The learning path: the bigram baseline (models/bigram.py, run_pretrain.py --arch bigram) and the ladder of
"Let's build GPT" (models/ladder.py, python -m tasks.ladder)."""
import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_same_update

import run_pretrain
from models.bigram import BigramConfig, BigramLM, load_lm
from models.ladder import RUNGS, LadderLM, Residual, build_rung
from optimizer import AdamW
from tasks import ladder

ENGLISH = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 30
KOREAN = "옛날 옛적에 호랑이가 살았습니다.\n호랑이는 떡을 좋아했습니다.\n어머니는 떡을 팔러 갔습니다.\n" * 30
FAST = ["--max_iters", "6", "--eval_interval", "3", "--eval_iters", "1", "--warmup_iters", "1", "--batch_size", "4",
        "--block_size", "16", "--n_layer", "2", "--n_head", "2", "--n_embd", "16", "--threads", "1"]


def count_entropy(ids: np.ndarray, vocab: int) -> tuple[float, torch.Tensor]:
    """Cross-entropy of the count-based bigram estimate on the pairs it was counted from, and its log table."""
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (ids[:-1], ids[1:]), 1)
    probs = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    ce = -np.mean(np.log(probs[ids[:-1], ids[1:]]))
    with np.errstate(divide="ignore"):  # pairs never seen get probability 0, logit -inf
        return float(ce), torch.from_numpy(np.log(probs))


def test_bigram_loss_reaches_the_cross_entropy_of_the_counts():
    rng = np.random.default_rng(0)
    vocab = 7
    # A skewed Markov chain, so the floor is well below uniform (ln 7 = 1.95).
    transition = rng.dirichlet(np.full(vocab, 0.3), size=vocab)
    ids = [0]
    for u in rng.random(1500):
        ids.append(min(int(np.searchsorted(transition[ids[-1]].cumsum(), u)), vocab - 1))
    ids = np.array(ids)
    floor, log_table = count_entropy(ids, vocab)
    x, y = torch.from_numpy(ids[:-1])[None], torch.from_numpy(ids[1:])[None]
    model = BigramLM(BigramConfig(vocab_size=vocab)).double()
    with torch.no_grad():  # the count estimate itself, as the model's table: its loss is the floor exactly
        model.token_embedding_table.weight.copy_(log_table)
    assert model(x, y)["loss"].item() == pytest.approx(floor, abs=1e-12)
    # Trained by gradient descent from random init, the loss approaches that floor and cannot go below it.
    model = BigramLM(BigramConfig(vocab_size=vocab)).double()
    opt = AdamW(model.parameters(), lr=0.2)
    for _ in range(150):
        opt.zero_grad()
        loss = model(x, y)["loss"]
        loss.backward()
        opt.step()
    assert floor - 1e-9 <= model(x, y)["loss"].item() <= floor + 0.005
    assert floor < math.log(vocab) - 0.3


def test_bigram_logits_depend_on_the_current_token_only_and_bad_ids_are_refused():
    model = BigramLM(BigramConfig(vocab_size=5))
    ids = torch.tensor([[1, 2, 3, 4]])
    logits = model(ids)["logits"]
    assert torch.equal(logits[0, 2], model.token_embedding_table.weight[3])
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 5\)"):
        model(torch.tensor([[1, 5]]))
    with pytest.raises(ValueError, match="a bigram model has no"):
        model.config.replace(n_layer=2)


def run_bigram(data, out_dir, *extra):
    return run_pretrain.main(["--arch", "bigram", "--data", str(data), "--out_dir", str(out_dir),
                              "--block_size", "16", "--batch_size", "8", "--max_iters", "40", "--eval_interval", "20",
                              "--eval_iters", "2", "--warmup_iters", "2", "--learning_rate", "5e-2", "--min_lr", "1e-3",
                              "--num_samples", "1", "--max_new_tokens", "30", "--threads", "1", *extra])


def test_run_pretrain_arch_bigram_trains_checkpoints_samples_and_resumes(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(ENGLISH, encoding="utf-8")
    summary = run_bigram(data, tmp_path / "out")
    vocab = len(set(ENGLISH))
    assert summary["val_loss"] < math.log(vocab) - 0.5  # well below the uniform guess
    assert isinstance(load_lm(tmp_path / "out" / "best"), BigramLM)
    assert len(summary["samples"][0]) == 1 + 30  # the default prompt (newline) and 30 characters
    sampled = run_pretrain.main(["--sample", "--model", str(tmp_path / "out" / "best"), "--prompt", "Speak",
                                 "--max_new_tokens", "20"])
    assert sampled["samples"][0].startswith("Speak") and len(sampled["samples"][0]) == 25
    resumed = run_bigram(data, tmp_path / "out", "--resume", "--max_iters", "60")
    assert resumed["step"] == 60
    with pytest.raises(ValueError, match="holds a BigramLM, not --arch gpt2"):
        run_pretrain.main(["--data", str(data), "--out_dir", str(tmp_path / "out"), "--resume", "--block_size", "16"])
    with pytest.raises(SystemExit):
        run_pretrain.parse_args(["--arch", "bigram", "--data", str(data), "--n_layer", "2"])
    assert "--n_layer do(es) not apply" in capsys.readouterr().err


@pytest.mark.parametrize("style", ["gpt2", "lecture"])
def test_each_rung_is_causal_and_built_from_its_parts(style):
    torch.manual_seed(0)
    ids = torch.randint(11, (2, 8))
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] + 1) % 11
    for rung in RUNGS:
        model = build_rung(rung, 11, 8, n_layer=2, n_head=2, n_embd=8, dropout=0.2, style=style).eval()
        with torch.no_grad():  # weights large enough that every token visibly moves the logits it may reach
            for p in model.parameters():
                p.normal_(std=0.5)
            a, b = model(ids)["logits"], model(later)["logits"]
        torch.testing.assert_close(a[:, :5], b[:, :5], msg=f"{rung}: a later token changed an earlier prediction")
        assert (a[:, 5:] - b[:, 5:]).abs().amax() > 1e-3, rung
        if rung == "bigram":
            continue
        kinds = {type(m) for m in model.modules()}
        assert (Residual in kinds) == (RUNGS.index(rung) >= RUNGS.index("residual")), rung
        assert (torch.nn.LayerNorm in kinds) == (RUNGS.index(rung) >= RUNGS.index("layernorm")), rung
        assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) == (rung == "dropout")
        assert len(model.blocks) == (2 if RUNGS.index(rung) >= RUNGS.index("blocks") else 1)
        heads = model.blocks[0][0].branch[1] if Residual in kinds else model.blocks[0][0]
        assert heads.num_attention_heads == (1 if rung == "one_head" else 2)
        activation = torch.nn.ReLU if style == "lecture" else torch.nn.GELU
        assert (activation in kinds) == (RUNGS.index(rung) >= RUNGS.index("feed_forward")), rung
        assert (heads.query.bias is None) == (style == "lecture")
    with pytest.raises(ValueError, match="unknown rung"):
        LadderLM("bigram", build_rung("one_head", 11, 8).config)


@pytest.mark.parametrize("text", [ENGLISH, KOREAN], ids=["english", "korean"])
def test_ladder_runs_end_to_end(tmp_path, text, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(text, encoding="utf-8")
    results = ladder.main(["--data", str(data), "--out_dir", str(tmp_path / "ladder"), *FAST])
    assert list(results["rungs"]) == list(RUNGS)
    assert results["corpus"]["vocab"] == len(set(text))
    saved = json.loads((tmp_path / "ladder" / "ladder.json").read_text())
    for rung, r in saved["rungs"].items():
        assert math.isfinite(r["val_full"]) and [s for s, _, _ in r["curve"]] == [0, 3, 6], rung
        assert r["val_full"] < r["curve"][0][2] + 0.05, rung  # 6 steps do not make it worse than the start
    assert (tmp_path / "ladder" / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| residual | + residual connections (2 blocks, projections) | " in out


def test_ladder_runs_a_subset_in_ladder_order_and_refuses_bad_input(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(ENGLISH, encoding="utf-8")
    results = ladder.main(["--data", str(data), "--out_dir", str(tmp_path / "l"), "--no_plot",
                           "--rungs", "layernorm", "bigram", *FAST])
    assert list(results["rungs"]) == ["bigram", "layernorm"]
    assert not (tmp_path / "l" / "ladder.png").exists()
    with pytest.raises(SystemExit):
        ladder.parse_args(["--data", str(data), "--n_embd", "10", "--n_head", "4"])
    assert "--n_embd 10 must be divisible by --n_head 4" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        ladder.main(["--data", str(tmp_path / "missing.txt"), "--out_dir", str(tmp_path / "l"), *FAST])
    short = tmp_path / "short.txt"
    short.write_text("abc", encoding="utf-8")
    with pytest.raises(ValueError, match="too few for one window"):
        ladder.main(["--data", str(short), "--out_dir", str(tmp_path / "l"), *FAST])


def test_bigram_floor_of_the_ladder_matches_a_direct_count(tmp_path):
    """The ladder's whole-split val loss of a well-trained bigram is the val cross-entropy of the train counts:
    F.cross_entropy over the same windows, computed from the counts instead of a trained table."""
    data = tmp_path / "corpus.txt"
    data.write_text(ENGLISH, encoding="utf-8")
    results = ladder.main(["--data", str(data), "--out_dir", str(tmp_path / "b"), "--no_plot", "--rungs", "bigram",
                           "--max_iters", "300", "--bigram_lr", "0.1", "--eval_interval", "300", "--eval_iters", "1",
                           "--block_size", "16", "--batch_size", "32", "--threads", "1"])
    from tasks.pretrain import prepare_corpus

    corpus = prepare_corpus(data, "char", tmp_path / "b" / "data")
    train, val = np.asarray(corpus.train).astype(np.int64), np.asarray(corpus.val).astype(np.int64)
    V = len(corpus.tokenizer)
    counts = np.full((V, V), 1e-3)  # pairs unseen in train get a tiny mass (the text repeats, so none occur in val)
    np.add.at(counts, (train[:-1], train[1:]), 1)
    n = (len(val) - 1) // 16 * 16
    logits = torch.from_numpy(np.log(counts / counts.sum(1, keepdims=True)))[val[:n]]
    floor = F.cross_entropy(logits, torch.from_numpy(val[1: n + 1])).item()
    assert results["rungs"]["bigram"]["val_full"] == pytest.approx(floor, abs=0.05)
    assert floor < math.log(V) - 1  # far from what an untrained table scores


def test_lecture_style_is_the_lectures_model():
    """The lecture's gpt.py at n_embd 32, 4 heads, 3 blocks, block 8, vocab 65: 42,369 parameters, counted by hand;
    its Head scales scores by C**-0.5 with C = n_embd; PyTorch's default init (embeddings N(0, 1))."""
    C, V, T, L = 32, 65, 8, 3
    block = 3 * C * C + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C) + 2 * 2 * C  # q/k/v, proj, MLP, two LNs
    torch.manual_seed(0)
    model = build_rung("layernorm", V, T, n_layer=L, n_head=4, n_embd=C, style="lecture")
    assert model.num_parameters() == V * C + T * C + L * block + 2 * C + (C * V + V) == 42_369
    assert 0.9 < model.token_embedding.weight.std().item() < 1.1  # nn.Embedding's N(0, 1), not GPT-2's 0.02
    assert build_rung("bigram", V, T, style="lecture").token_embedding_table.weight.std().item() > 0.9
    attention = model.blocks[0][0].branch[1]
    x = torch.randn(2, T, C)
    q, k, v = (layer(x).view(2, T, 4, 8).transpose(1, 2) for layer in (attention.query, attention.key, attention.value))
    scores = (q @ k.transpose(-1, -2) * C ** -0.5).masked_fill(torch.ones(T, T).tril() == 0, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, T, C)  # the lecture's heads, concatenated
    torch.testing.assert_close(attention(x), expected)
    # one override against the style: GPT-2's init and GELU, everything else the lecture's
    mixed = build_rung("feed_forward", V, T, n_embd=C, style={"base": "lecture", "init": "gpt2"})
    assert mixed.token_embedding.weight.std().item() < 0.03 and mixed.blocks[0][0].query.bias is None
    with pytest.raises(ValueError, match="unknown style"):
        build_rung("one_head", V, T, style="nanogpt")
    with pytest.raises(ValueError, match="style init='xavier'"):
        build_rung("one_head", V, T, style={"base": "lecture", "init": "xavier"})


def test_lecture_preset_sets_the_lectures_settings_and_flags_override_it(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(ENGLISH, encoding="utf-8")
    args = ladder.parse_args(["--preset", "lecture", "--data", str(data)])
    assert (args.n_embd, args.block_size, args.batch_size, args.max_iters, args.lr, args.min_lr) == \
        (32, 8, 32, 5000, 1e-3, 1e-3)
    assert (args.weight_decay, args.decay, args.beta2, args.max_grad_norm, args.eval_iters, args.style) == \
        (0.01, "all", 0.999, 0.0, 200, "lecture")
    assert args.rungs == ["bigram", "one_head", "multi_head", "feed_forward", "blocks", "residual", "layernorm"]
    bigram = ladder.rung_settings(args, "bigram")
    assert (bigram.max_iters, bigram.lr, bigram.min_lr) == (3000, 1e-2, 1e-2)  # bigram.py: constant lr 1e-2
    scaled = ladder.rung_settings(args, "scaled")
    assert (scaled.batch_size, scaled.block_size, scaled.n_embd, scaled.n_head, scaled.n_layer, scaled.lr) == \
        (64, 256, 384, 6, 6, 3e-4)
    scaled = ladder.rung_settings(ladder.parse_args(["--preset", "lecture", "--data", str(data), "--rungs", "scaled",
                                                     "--max_iters", "10", "--lr", "1e-4"]), "scaled")
    assert (scaled.max_iters, scaled.lr, scaled.n_embd) == (10, 1e-4, 384)  # flags win
    assert scaled.min_lr == pytest.approx(1e-4)  # still a constant learning rate
    model = ladder.build("scaled", 65, scaled)
    assert model.rung == "dropout" and model.num_parameters() == 10_788_929  # gpt.py: "10.788929 M parameters"
    args = ladder.parse_args(["--preset", "lecture", "--data", str(data), "--init", "gpt2", "--lr", "2e-3",
                              "--rungs", "multi_head"])
    assert (args.init, args.lr, args.rungs, args.n_embd) == ("gpt2", 2e-3, ["multi_head"], 32)
    assert args.min_lr == pytest.approx(2e-3)
    assert ladder.parse_args(["--data", str(data)]).style == "gpt2"  # no preset: the same-budget ladder
    with pytest.raises(SystemExit):
        ladder.parse_args(["--data", str(data), "--rungs", "scaled"])
    assert "--rungs scaled is the lecture's scaled-up model" in capsys.readouterr().err


def test_the_lecture_preset_steps_like_the_lectures_adamw_and_its_scaled_model_drops_out_0_2(tmp_path):
    """gpt.py's optimizer is torch.optim.AdamW(model.parameters(), lr=learning_rate) with its defaults (betas
    (0.9, 0.999), eps 1e-8, weight decay 0.01 on every parameter) at a constant rate: the preset's steps equal its
    steps, with gradients small enough that eps shapes them. gpt.py's scaled model: dropout = 0.2 on the attention
    probabilities and each residual branch."""
    data = tmp_path / "corpus.txt"
    data.write_text(ENGLISH, encoding="utf-8")
    args = ladder.parse_args(["--preset", "lecture", "--data", str(data)])
    s = ladder.rung_settings(args, "layernorm")
    torch.manual_seed(0)
    model = ladder.build("layernorm", 65, s)
    reference = copy.deepcopy(model)
    ours, schedule = ladder.optimizer_for(model, s)
    lecture = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(model.parameters(), reference.parameters()):
            p.grad = torch.randn(p.shape, generator=g) * 1e-7  # |g| ~ 1e-7: eps 1e-8 and 1e-6 step very apart
            q.grad = p.grad.clone()
        ours.step()
        schedule.step()
        lecture.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_same_update(p, q, msg=lambda m: f"{name}: {m}")

    scaled = ladder.build("scaled", 65, ladder.rung_settings(args, "scaled"))
    rates = [m.p for m in scaled.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(rates) == 6 * 3 and set(rates) == {0.2}  # per block: attention probabilities, two residual branches


def test_lecture_preset_runs_end_to_end_with_the_lectures_column(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(ENGLISH, encoding="utf-8")
    results = ladder.main(["--preset", "lecture", "--data", str(data), "--out_dir", str(tmp_path / "l"),
                           "--rungs", "bigram", "multi_head", "blocks", "--max_iters", "6", "--bigram_iters", "4",
                           "--eval_interval", "3", "--eval_iters", "2", "--threads", "1"])
    assert [s for s, _, _ in results["rungs"]["bigram"]["curve"]] == [0, 3, 4]
    assert results["rungs"]["multi_head"]["settings"]["batch_size"] == 32
    out = capsys.readouterr().out
    assert re.search(r"\| multi_head \| 4 heads of size 8 \| [\d,]+ \| 6 x 32 x 8 \|", out)
    assert "| 2.28 | " in out and "| blocks | 3 blocks |" in out and "| - | - |" in out  # no lecture number
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in lines}) == 1  # header, separator and rows: one column count
    assert (tmp_path / "l" / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ladder_trains_on_cuda(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(ENGLISH, encoding="utf-8")
    results = ladder.main(["--data", str(data), "--out_dir", str(tmp_path / "c"), "--no_plot", "--device", "cuda",
                           "--rungs", "bigram", "layernorm", *FAST])
    assert all(math.isfinite(r["val_full"]) for r in results["rungs"].values())


def test_the_ladder_plot_draws_dots_not_bars_on_a_zoomed_axis(tmp_path, monkeypatch):
    """Issue 37: ladder.png drew bars from 1.8, so a bar's length overstated the gaps between rungs. Bars must start
    at zero; dots (where only the position carries the value) may use a zoomed axis."""
    import matplotlib.pyplot as plt

    results = json.loads((Path(ladder.__file__).parents[1] / "docs" / "ladder_lecture.json").read_text())
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    ladder.plot(results, tmp_path / "ladder.png")
    left = figures[0].axes[0]
    assert not left.patches or left.get_ylim()[0] == 0  # no bars on an axis that starts above zero
    drawn = sorted(round(y, 4) for line in left.get_lines() for y in line.get_ydata())
    est = [r["curve"][-1][2] for r in results["rungs"].values()]
    full = [r["val_full"] for r in results["rungs"].values()]
    lecture = [ladder.LECTURE_LOSS[r] for r in results["rungs"] if r in ladder.LECTURE_LOSS]
    assert drawn == sorted(round(y, 4) for y in est + full + lecture)
    monkeypatch.undo()
    plt.close(figures[0])


def test_the_lecture_docs_say_what_reproduces_across_cpus():
    """Issue 37: learning-path.md promised `--preset lecture` "the same losses to the last digit"; an AVX2-only CPU
    gives other losses from the feed-forward rung on (its matmul kernels round differently)."""
    text = (Path(ladder.__file__).parents[1] / "docs" / "learning-path.md").read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if "last digit" in p]
    assert paragraphs and all("same CPU class" in p and "AVX2" in p for p in paragraphs)
