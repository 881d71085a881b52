"""Sonnets: the course's file format, chrF as the course computes it, SonnetGPT's loss and decoding controls on text
prompts, and run_sonnet.py end to end on tiny synthetic sonnets with a tiny byte-level BPE and a tiny model."""
import random
import re

import pytest
import sacrebleu
import torch
from conftest import data_path, tiny_config

import run_sonnet
from models.beam_search import beam_search
from models.gpt2 import GPT2LMHeadModel
from tasks import evaluate as E
from tasks import sonnet as S

WORDS = "love time eyes heart fair beauty thee thou doth art sweet death night day truth rose".split()
HEADER = "Sonnets\nby Somebody\n  with Someone Else\n\n\n\n"


def make_sonnet(rng, n_lines=6):
    lines = [" ".join(rng.choice(WORDS) for _ in range(4)).capitalize() + "," for _ in range(n_lines)]
    return "\n".join(lines[:-2] + ["  " + lines[-2], "  " + lines[-1]])  # an indented couplet, as in the files


def course_file(sonnets, first=1, header=HEADER, newline="\n"):
    text = header + "".join(f"\n\n{first + i}\n\n{s}\n" for i, s in enumerate(sonnets))
    return text.replace("\n", newline)


def make_bpe_tokenizer(folder, texts):
    """A byte-level BPE (GPT-2's scheme, a few hundred tokens) trained on the texts, EOS = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# Files


def test_crlf_and_lf_files_read_the_same_and_drop_the_header(tmp_path):
    sonnets = [make_sonnet(random.Random(i)) for i in range(3)]
    (tmp_path / "lf.txt").write_bytes(course_file(sonnets).encode())
    (tmp_path / "crlf.txt").write_bytes(course_file(sonnets, newline="\r\n").encode())
    assert b"\r\n" in (tmp_path / "crlf.txt").read_bytes()
    lf, crlf = S.read_sonnets(tmp_path / "lf.txt"), S.read_sonnets(tmp_path / "crlf.txt")
    assert lf == crlf == sonnets
    assert "\n  " in lf[0] and not any("\r" in s for s in crlf)  # the couplet's indentation stays; no CR left


def test_a_file_without_header_keeps_its_first_sonnet():
    assert S.parse_sonnets("1\nFirst line,\nsecond.\n\n2\nThird line.\n") == ["First line,\nsecond.", "Third line."]


@pytest.mark.parametrize("text, pattern", [
    ("just a header\nand text\n", r"x\.txt: no numbered sonnets"),
    ("header\n\n1\n\nSome line,\n\n2\n", r"x\.txt, line 7: sonnet 2 is empty"),
])
def test_bad_files_are_refused_naming_the_line(text, pattern):
    with pytest.raises(S.SonnetFileError, match=pattern):
        S.parse_sonnets(text, "x.txt")


def test_writer_is_the_course_format_and_reads_back(tmp_path, capsys):
    path = tmp_path / "out" / "generated_sonnets.txt"
    sonnets = ["Shall I compare thee,\nto a summer's day?", "  Indented couplet line,\nand another."]
    S.write_sonnets(path, sonnets)
    assert path.read_bytes() == (b"--Generated Sonnets-- \n\n\n0\nShall I compare thee,\nto a summer's day?\n\n"
                                 b"\n1\n  Indented couplet line,\nand another.\n\n")
    assert S.read_sonnets(path) == [s.strip() for s in sonnets]
    S.write_sonnets(path, ["A line\n14\nafter a number line", "B"])
    assert "sonnet 0 holds the number-only line '14'" in capsys.readouterr().out
    gold = tmp_path / "gold.txt"
    gold.write_text(course_file(["A", "B"]))
    with pytest.raises(S.SonnetFileError, match="holds 3 sonnets but .* holds 2"):
        S.score_file(path, gold)


def test_the_course_files():
    folder = data_path("cs224n")
    train = S.read_sonnets(folder / "sonnets.txt")  # CRLF
    prompts = S.read_sonnets(folder / "sonnets_held_out_dev.txt")
    gold = S.read_sonnets(folder / "TRUE_sonnets_held_out_dev.txt")
    assert len(train) == 131 and train[0].startswith("From fairest creatures we desire increase,")
    assert len(prompts) == len(gold) == 12 and all(len(p.splitlines()) == 3 for p in prompts)
    S.check_pairs(prompts, gold, "prompts", "gold")
    assert len(S.read_sonnets(folder / "sonnets_held_out.txt")) == 12
    with pytest.raises(S.SonnetFileError, match="prompt 0 of prompts is not the start of sonnet 0 of gold"):
        S.check_pairs(prompts[1:] + prompts[:1], gold, "prompts", "gold")


# ---------------------------------------------------------------------------------------------------------------
# chrF


@pytest.mark.parametrize("hyps, refs, expected", [
    (["a b c"], ["abc"], 100.0),  # whitespace is ignored; orders 4-6 have no n-grams and drop out
    (["aa"], ["ab"], 25.0),  # unigram P = R = 1/2, bigram 0: averaged over the two orders present
    (["a", "b"], ["a", "c"], 50.0),  # corpus statistics are summed over sonnets before the score
    (["ab"], ["abcd"], 100 * 25 / 53),  # P = 1, R = (1/2 + 1/3) / 2 = 5/12; F2 = 5 P R / (4 P + R) = 25/53
])
def test_chrf_known_values_equal_sacrebleu(hyps, refs, expected):
    assert S.chrf(hyps, refs) == pytest.approx(expected, abs=1e-9)
    assert S.chrf(hyps, refs) == sacrebleu.corpus_chrf(hyps, [refs]).score


def test_file_score_equals_sacrebleu_on_the_texts(tmp_path, capsys):
    rng = random.Random(0)
    gold, generated = [make_sonnet(rng, 14) for _ in range(4)], [make_sonnet(rng, 12) for _ in range(4)]
    (tmp_path / "gold.txt").write_text(course_file(gold, first=132))
    S.write_sonnets(tmp_path / "gen.txt", generated)
    expected = sacrebleu.metrics.CHRF().corpus_score(generated, [gold]).score
    assert E.SCORERS["sonnet"].score(str(tmp_path / "gen.txt"), str(tmp_path / "gold.txt")) == {"chrf": expected, "n": 4}
    assert E.main(["--task", "sonnet", "--pred", str(tmp_path / "gen.txt"), "--gold", str(tmp_path / "gold.txt")]) == 0
    assert f"chrf {expected:.4f}" in capsys.readouterr().out
    S.write_sonnets(tmp_path / "short.txt", generated[:3])
    assert E.main(["--task", "sonnet", "--pred", str(tmp_path / "short.txt"), "--gold", str(tmp_path / "gold.txt")]) == 1
    assert "short.txt holds 3 sonnets but" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# SonnetGPT


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    rng = random.Random(1)
    return make_bpe_tokenizer(tmp_path_factory.mktemp("tok"), [make_sonnet(rng, 14) for _ in range(40)])


def tiny_sonnet_gpt(vocab_size, seed=0, n_positions=96):
    torch.manual_seed(seed)
    return S.SonnetGPT(GPT2LMHeadModel(tiny_config("h3-inner", vocab_size=vocab_size, n_positions=n_positions,
                                                   bos_token_id=0, eos_token_id=vocab_size - 1))).eval()


@torch.no_grad()
def test_loss_counts_real_tokens_only():
    model = tiny_sonnet_gpt(100)
    a, b = torch.randint(0, 99, (7,)), torch.randint(0, 99, (4,))
    ids = torch.stack([a, torch.cat([b, torch.tensor([5, 6, 7])])])
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    alone = [float(model.loss(x[None], torch.ones(1, len(x), dtype=torch.long))) for x in (a, b)]
    expected = (alone[0] * 6 + alone[1] * 3) / 9  # 6 and 3 predicted tokens
    assert float(model.loss(ids, mask)) == pytest.approx(expected, rel=1e-5)
    ids[1, 4:] = 42  # what the padding holds does not matter
    assert float(model.loss(ids, mask)) == pytest.approx(expected, rel=1e-5)
    assert model(ids, mask).shape == (2, 7, 100)


def prompts_for(n, seed=2):
    rng = random.Random(seed)
    return ["\n".join(make_sonnet(rng, 14).splitlines()[: rng.randint(1, 3)]) for _ in range(n)]


def test_batched_greedy_equals_one_at_a_time_and_stops_at_eos(tokenizer):
    model = tiny_sonnet_gpt(len(tokenizer), seed=3)
    prompts = prompts_for(5)
    # A repetition penalty keeps the tiny random model from repeating one token (and must ignore the padding).
    greedy = S.Decoding(max_new_tokens=12, do_sample=False, repetition_penalty=2.0)
    first = tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    new = model.generate(torch.tensor([first]), do_sample=False, max_new_tokens=12, repetition_penalty=2.0)
    new = new[0, len(first):].tolist()
    # Make a token that greedy decoding first emits k > 0 tokens into prompt 0's continuation the EOS: that
    # prompt must stop there, the others go on.
    k = next(i for i in range(1, 12) if new[i] not in new[:i])
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path, eos_token=tokenizer.convert_ids_to_tokens(new[k]))
    batched = S.complete_sonnets(model, tok, prompts, greedy, batch_size=5)
    assert batched == [S.complete_sonnets(model, tok, [p], greedy, batch_size=1)[0] for p in prompts]
    assert batched[0] == tokenizer.decode(first + new[:k])
    assert all(t.startswith(p) and len(t) > len(p) for t, p in zip(batched, prompts))


def test_prompt_length_errors_give_a_real_range(tokenizer):
    model = tiny_sonnet_gpt(len(tokenizer), n_positions=32)
    with pytest.raises(ValueError, match="prompt 0 has .* tokens; .* allows 1 to 2$"):
        S.complete_sonnets(model, tokenizer, ["a much longer prompt than two tokens"], S.Decoding(max_new_tokens=30))
    with pytest.raises(ValueError, match="max_new_tokens 32 leaves no room for a prompt .* use at most 31"):
        S.complete_sonnets(model, tokenizer, ["a"], S.Decoding(max_new_tokens=32))


def test_seeded_sampling_repeats(tokenizer):
    model = tiny_sonnet_gpt(len(tokenizer), seed=4)
    prompts = prompts_for(4)
    run = lambda seed: S.complete_sonnets(model, tokenizer, prompts, S.Decoding(max_new_tokens=16, seed=seed), 2)
    assert run(7) == run(7) and run(7) != run(8)


def test_decoding_controls_reach_the_decoders():
    model = tiny_sonnet_gpt(100, seed=5)
    ids = torch.randint(0, 99, (3, 5), generator=torch.Generator().manual_seed(0))
    greedy = model.generate(ids, do_sample=False, max_new_tokens=10)
    g = lambda **kw: model.generate(ids, max_new_tokens=10, generator=torch.Generator().manual_seed(0), **kw)
    # Each filter, pushed to its limit, leaves one token: sampling becomes greedy decoding.
    assert torch.equal(g(top_k=1, top_p=None, temperature=1.2), greedy)
    assert torch.equal(g(top_p=1e-9, temperature=1.2), greedy)
    assert torch.equal(g(top_p=None, temperature=1e-4), greedy)
    assert not torch.equal(g(top_p=None, temperature=5.0), greedy)
    penalised = model.generate(ids, do_sample=False, max_new_tokens=10, repetition_penalty=3.0)
    assert torch.equal(penalised, model.lm.generate(ids, max_new_tokens=10, repetition_penalty=3.0))
    assert not torch.equal(penalised, greedy)
    eos = int(greedy[0, 7])  # a token the model emits, so hypotheses end at different lengths
    beam = lambda lp: model.generate(ids, do_sample=False, max_new_tokens=10, num_beams=3, length_penalty=lp,  # noqa: E731
                                     eos_token_id=eos)
    assert torch.equal(beam(0.5), beam_search(model.lm, ids, num_beams=3, max_new_tokens=10, length_penalty=0.5,
                                              eos_token_id=eos))
    assert not torch.equal(beam(-3.0), beam(3.0))  # length_penalty reaches the beam search
    with pytest.raises(ValueError, match="pass do_sample=False with num_beams > 1"):
        model.generate(ids, num_beams=3)


def test_baselines():
    train = ["l1\nl2\nl3\nl4\nl5", "m1\nm2\nm3\nm4"]
    assert S.baseline_sonnets(["p1\np2\np3"], "prompts", train, 0) == ["p1\np2\np3"]
    out = S.baseline_sonnets(["p1\np2\np3"] * 6, "random_sonnet", train, 0)
    assert set(out) == {"p1\np2\np3\nl4\nl5", "p1\np2\np3\nm4"}


# ---------------------------------------------------------------------------------------------------------------
# run_sonnet.py end to end


def test_run_sonnet_end_to_end(tmp_path, tokenizer, capsys):
    rng = random.Random(5)
    train, dev, test = ([make_sonnet(rng, 14) for _ in range(n)] for n in (10, 3, 2))
    files = {"train": course_file(train, newline="\r\n"), "gold": course_file(dev, first=11),
             "dev": course_file(["\n".join(s.splitlines()[:3]) for s in dev], first=11),
             "test": course_file(["\n".join(s.splitlines()[:3]) for s in test], first=14)}
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_bytes(text.encode())
    tokenizer.save_pretrained(tmp_path / "tok")
    model = f"random:n_layer=2,n_head=2,n_embd=32,n_positions=160,vocab_size={len(tokenizer)}"
    common = ["--tokenizer", str(tmp_path / "tok"), "--sonnet_path", str(tmp_path / "train.txt"),
              "--dev_sonnet_path", str(tmp_path / "dev.txt"), "--dev_gold_path", str(tmp_path / "gold.txt"),
              "--held_out_sonnet_path", str(tmp_path / "test.txt"), "--dev_out", str(tmp_path / "dev_out.txt"),
              "--sonnet_out", str(tmp_path / "out.txt"), "--max_new_tokens", "40", "--threads", "1"]
    assert run_sonnet.main(common + ["--model", model, "--epochs", "2", "--batch_size", "4", "--lr", "3e-3",
                                     "--output_dir", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"epoch 2/2 \| train loss [0-9.]+ \| dev chrf [0-9.]+ loss [0-9.]+", out), out
    best = float(re.search(r"best epoch \d: dev chrF ([0-9.]+)", out).group(1))
    graded = S.score_file(tmp_path / "dev_out.txt", tmp_path / "gold.txt")
    assert graded["n"] == 3 and round(graded["chrf"], 2) == best  # same weights, same seed: the same sonnets
    assert (tmp_path / "out.txt").read_text().startswith("--Generated Sonnets-- \n\n\n0\n")
    assert len(S.read_sonnets(tmp_path / "out.txt")) == 2

    ck = str(tmp_path / "ck" / "best")
    assert run_sonnet.main(common + ["--generate_only", "--model", ck, "--num_beams", "2", "--overwrite"]) == 0
    assert "beam search, 2 beams" in capsys.readouterr().out
    assert run_sonnet.main(common + ["--baseline", "prompts", "--overwrite"]) == 0
    prompts_only = S.chrf(S.read_sonnets(tmp_path / "dev.txt"), dev)
    assert f"dev chrF {prompts_only:.2f} over 3 sonnets (baseline prompts)" in capsys.readouterr().out
    assert run_sonnet.main(common + ["--baseline", "prompts", "--dev_gold_path", str(tmp_path / "test.txt"),
                                     "--overwrite"]) == 1
    assert "dev.txt holds 3 prompts but" in capsys.readouterr().err


def test_a_rerun_baseline_is_told_to_overwrite_not_to_resume(tmp_path, monkeypatch, capsys):
    """Issue 37: `run_sonnet.py --baseline prompts` run twice was told "--resume to continue the run that wrote
    them", but a baseline (or a decoding) trains nothing: only --overwrite replaces its files."""
    rng = random.Random(3)
    dev = [make_sonnet(rng, 14) for _ in range(2)]
    for name, text in (("train", course_file([make_sonnet(rng, 14) for _ in range(3)])), ("gold", course_file(dev)),
                       ("dev", course_file(["\n".join(s.splitlines()[:3]) for s in dev]))):
        (tmp_path / f"{name}.txt").write_text(text)
    monkeypatch.chdir(tmp_path)
    common = ["--baseline", "prompts", "--sonnet_path", "train.txt", "--dev_sonnet_path", "dev.txt",
              "--dev_gold_path", "gold.txt", "--held_out_sonnet_path", "dev.txt"]
    assert run_sonnet.main(common) == 0
    for again in ([], ["--resume"]):
        assert run_sonnet.main(common + again) == 1
        err = capsys.readouterr().err
        assert "pass --overwrite to replace them (this run trains nothing, so there is no run to --resume)" in err
        assert "continue the run" not in err
    assert run_sonnet.main(common + ["--overwrite"]) == 0
