"""Beam search: the exact best continuation when the beam is wide enough (checked against an exhaustive search),
greedy at width 1, independent of batching, and token for token equal to transformers' beam search."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_model, padded_batch, tiny_config

from models.beam_search import beam_search
from models.generation import generate
from models.gpt2 import GPT2LMHeadModel
from models.loading import hf_to_ours


def load_pair(config, seed=0):
    hf = make_hf_model(config, seed)
    ours = GPT2LMHeadModel(config)
    ours.gpt.load_state_dict(hf_to_ours(hf.state_dict(), config.n_layer))
    return hf, ours.eval()


def sharp_tiny_lm(vocab_size, seed, sharpen=4.0):
    """A tiny model with peakier next-token distributions than random init gives, so scores are far from ties."""
    _, lm = load_pair(tiny_config("h3-inner", vocab_size=vocab_size, bos_token_id=0, eos_token_id=vocab_size - 1), seed)
    with torch.no_grad():
        lm.gpt.word_embedding.weight.mul_(sharpen)
    return lm


def favoured_eos(seed, ahead, token_ids=1000):
    """The h4-wide pair (seed), four left-padded prompts of ids below `token_ids`, and as EOS the token greedy
    decoding emits `ahead` tokens in, so hypotheses end at different steps and the stopping rules matter:
    (hf, ours, ids, mask, eos)."""
    hf, ours = load_pair(tiny_config("h4-wide"), seed=seed)
    ids, mask = padded_batch([6, 3, 5, 6], 6, token_ids, "left", seed=9)
    return hf, ours, ids, mask, int(generate(ours, ids, mask, ahead)[0, -1])

@torch.no_grad()
def exhaustive_best(lm, prompt, num_new, eos, length_penalty):
    """Best continuation over every sequence of num_new tokens, cut after its first EOS, scored like beam search
    (summed log-probabilities / length ** length_penalty); one full forward pass over all sequences, no cache."""
    V, T = lm.config.vocab_size, len(prompt)
    conts = torch.tensor(list(itertools.product(range(V), repeat=num_new)))  # (V ** num_new, num_new)
    seqs = torch.cat([prompt.expand(len(conts), T), conts], dim=1)
    logp = F.log_softmax(lm(seqs)["logits"][:, T - 1: -1].double(), dim=-1).gather(2, conts[..., None])[..., 0]
    best, best_score = None, float("-inf")
    for cont, lp in zip(conts.tolist(), logp.cumsum(1).tolist()):
        n = cont.index(eos) + 1 if eos in cont else num_new
        score = lp[n - 1] / n ** length_penalty
        if score > best_score + 1e-9:  # sequences sharing a prefix up to EOS tie exactly: keep the first
            best, best_score = cont[:n], score
    return best


@pytest.mark.parametrize("early_stopping", [False, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -1.0, 2.0])
def test_wide_beam_finds_the_exhaustive_best(length_penalty, early_stopping):
    lm = sharp_tiny_lm(vocab_size=7, seed=1)
    eos, pad, num_new = 6, 0, 3
    ids, mask = padded_batch([4, 2, 3], 4, 6, "left", seed=2)  # prompts without EOS
    # 7 * 7 = 49 beams hold every two-token prefix, so the third step sees every sequence.
    out = beam_search(lm, ids, mask, num_beams=49, max_new_tokens=num_new, eos_token_id=eos, pad_token_id=pad,
                      length_penalty=length_penalty, early_stopping=early_stopping)
    lengths = []
    for i in range(3):
        best = exhaustive_best(lm, ids[i, mask[i].bool()], num_new, eos, length_penalty)
        lengths.append(len(best))
        assert out[i, 4: 4 + len(best)].tolist() == best
        assert (out[i, 4 + len(best):] == pad).all()
    assert out.shape[1] == 4 + max(lengths)


def test_wide_beam_without_eos_finds_the_most_likely_sequence():
    lm = sharp_tiny_lm(vocab_size=7, seed=3)
    ids = torch.tensor([[1, 5, 2]])
    out = beam_search(lm, ids, num_beams=49, max_new_tokens=3)
    assert out[0, 3:].tolist() == exhaustive_best(lm, ids[0], 3, eos=None, length_penalty=0.0)


def test_outputs_differ_from_greedy_where_greedy_is_not_best():
    """The exhaustive best is not always greedy's choice; beam search must not collapse to greedy."""
    found = False
    for seed in range(6):
        lm = sharp_tiny_lm(vocab_size=7, seed=seed)
        ids = torch.tensor([[1, 2]])
        greedy = generate(lm, ids, max_new_tokens=3)[0, 2:].tolist()
        best = exhaustive_best(lm, ids[0], 3, eos=None, length_penalty=0.0)
        assert beam_search(lm, ids, num_beams=49, max_new_tokens=3)[0, 2:].tolist() == best
        found |= best != greedy
    assert found, "no seed where greedy misses the best sequence: the test lost its power"


def test_one_beam_without_eos_is_greedy():
    _, lm = load_pair(tiny_config("h4-wide"), seed=4)
    ids, mask = padded_batch([5, 2, 4], 5, 1000, "left", seed=5)
    assert torch.equal(beam_search(lm, ids, mask, num_beams=1, max_new_tokens=12), generate(lm, ids, mask, 12))


def test_batched_equals_one_prompt_at_a_time():
    _, lm = load_pair(tiny_config("h3-inner"), seed=6)
    ids, mask = padded_batch([6, 2, 4], 6, 100, "left", seed=7)
    eos = int(generate(lm, ids, mask, 3)[0, -1])  # a token the model does produce, so some beams end
    batched = beam_search(lm, ids, mask, num_beams=3, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    for i in range(3):
        alone = beam_search(lm, ids[i: i + 1, mask[i].bool()], num_beams=3, max_new_tokens=10, eos_token_id=eos,
                            pad_token_id=0)
        n = alone.shape[1] - int(mask[i].sum())
        assert torch.equal(batched[i, 6: 6 + n], alone[0, -n:]) and (batched[i, 6 + n:] == 0).all()


@pytest.mark.parametrize("early_stopping, length_penalty", [(False, 1.0), (True, 1.0), ("never", 1.0),
                                                            (False, 0.0), ("never", 2.0), (False, -1.5)])
def test_equals_transformers_beam_search(early_stopping, length_penalty):
    hf, ours, ids, mask, eos = favoured_eos(seed=8, ahead=2)
    kw = dict(max_new_tokens=12, num_beams=4, eos_token_id=eos, pad_token_id=1, length_penalty=length_penalty,
              early_stopping=early_stopping)
    expected = hf.generate(ids, attention_mask=mask, do_sample=False, **kw)
    got = beam_search(ours, ids, mask, **kw)
    assert (got == eos).any(), "no hypothesis ended with EOS: the test would not exercise finishing"
    assert torch.equal(got, expected)


@pytest.mark.parametrize("seed, length_penalty", [(3, 2.0), (0, 1.0)])
def test_early_stopping_modes_differ_and_each_equals_transformers(seed, length_penalty):
    """With a favoured EOS and a length_penalty > 0, the heuristic (False) stops before a longer, better hypothesis
    appears; "never" keeps searching (its bound uses max_new_tokens for any length_penalty > 0, 1 included). Both
    must still match transformers, whose prompt, once done, stays done."""
    hf, ours, ids, mask, eos = favoured_eos(seed=seed, ahead=1, token_ids=999)
    # pad 1, not 0: transformers fills with EOS when pad_token_id is 0 (it tests `pad_token_id or eos`)
    kw = dict(max_new_tokens=10, num_beams=2, eos_token_id=eos, pad_token_id=1, length_penalty=length_penalty)
    got = {es: beam_search(ours, ids, mask, early_stopping=es, **kw) for es in (False, "never")}
    assert got[False].shape != got["never"].shape or not torch.equal(got[False], got["never"])
    for es, out in got.items():
        assert torch.equal(out, hf.generate(ids, attention_mask=mask, do_sample=False, early_stopping=es, **kw))


def test_the_defaults_are_transformers_beam_defaults():
    """No options but the tokens: 4 beams, 20 new tokens, length_penalty 1, early_stopping False, as transformers'
    generate(num_beams=4) has them; where a favoured EOS ends hypotheses early, another length penalty or stopping
    rule would have chosen other beams, and one token fewer or more another length."""
    hf, ours, ids, mask, eos = favoured_eos(seed=0, ahead=1, token_ids=999)
    got = beam_search(ours, ids, mask, eos_token_id=eos, pad_token_id=1)
    expected = hf.generate(ids, attention_mask=mask, do_sample=False, num_beams=4, max_new_tokens=20,
                           length_penalty=1.0, early_stopping=False, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(got, expected)
    for other in (dict(length_penalty=2.0), dict(early_stopping=True), dict(num_beams=3)):
        assert not torch.equal(got, beam_search(ours, ids, mask, eos_token_id=eos, pad_token_id=1, **other)), other
    no_eos = beam_search(ours, ids, mask, pad_token_id=1)
    assert no_eos.shape == (4, 6 + 20)
    one = beam_search(ours, ids, mask, max_new_tokens=1, pad_token_id=1)  # the first step, not the prompt alone
    assert one.shape == (4, 7) and torch.equal(one, hf.generate(ids, attention_mask=mask, do_sample=False, num_beams=4,
                                                                 max_new_tokens=1, pad_token_id=1, eos_token_id=None))


def test_repetition_penalty_equals_transformers():
    config = tiny_config("h3-inner")
    hf, ours = load_pair(config, seed=10)
    ids = torch.randint(0, 100, (2, 4), generator=torch.Generator().manual_seed(11))  # no padding: HF penalises pads
    kw = dict(max_new_tokens=10, num_beams=3, eos_token_id=None, pad_token_id=0)
    plain = beam_search(ours, ids, **kw)
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, repetition_penalty=1.8, **kw)
    got = beam_search(ours, ids, repetition_penalty=1.8, **kw)
    assert torch.equal(got, expected) and not torch.equal(got, plain)


def test_bad_requests_are_refused():
    _, lm = load_pair(tiny_config("h5"), seed=0)  # n_positions 32
    ids, mask = padded_batch([3, 2], 4, 50, "right", seed=0)
    with pytest.raises(ValueError, match="^prompts must be left-padded for beam search "):
        beam_search(lm, ids, mask, num_beams=2)
    with pytest.raises(ValueError, match="exceeds the context of n_positions=32"):
        beam_search(lm, ids[:, :3], num_beams=2, max_new_tokens=30)
    with pytest.raises(ValueError, match="num_beams must be a positive integer"):
        beam_search(lm, ids, num_beams=0)
    with pytest.raises(ValueError, match="early_stopping must be one of"):
        beam_search(lm, ids, early_stopping="sometimes")
    for penalty in (float("nan"), float("inf")):  # a score divided by length ** nan ranks nothing
        with pytest.raises(ValueError, match=rf"^length_penalty must be a finite number, got {penalty}$"):
            beam_search(lm, ids, num_beams=2, length_penalty=penalty)
    assert torch.equal(beam_search(lm, ids, num_beams=2, max_new_tokens=0), ids)


def test_generate_with_num_beams_runs_beam_search():
    _, lm = load_pair(tiny_config("h3-inner"), seed=8)
    ids, mask = padded_batch([4, 6], 6, 100, "left", seed=9)
    kw = dict(max_new_tokens=8, eos_token_id=7, pad_token_id=0, length_penalty=0.5)
    assert torch.equal(lm.generate(ids, mask, num_beams=3, **kw), beam_search(lm, ids, mask, num_beams=3, **kw))
    with pytest.raises(ValueError, match="do_sample=False"):
        lm.generate(ids, mask, num_beams=3, do_sample=True, **kw)


def test_the_beams_products_are_prepared_once_per_call_for_all_beam_rows(monkeypatch):
    """The decode steps run B*N rows (one per beam): every Linear and the LM head multiply them through a product
    prepared once per call for that row count (modules/linear.prepared_rows, decode_lm_head), not again at each
    step, and the tokens are those of the plain products. Where the C++ step runs the layers (models/fast_step.py),
    only the LM head's product is prepared: the layers' would go unused."""
    from models import fast_step
    from modules import rows as row_kernel
    from modules.linear import Linear

    if not row_kernel.available():
        pytest.skip("the rows kernel cannot be built here (needs an x86 CPU with AVX2 and a C++ compiler)")
    _, lm = load_pair(tiny_config("h3-inner"), seed=3)
    ids, mask = padded_batch([5, 3], 5, 100, "left", seed=4)  # B=2, N=3: 6 rows a step
    kw = dict(num_beams=3, eos_token_id=None, pad_token_id=0)
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)
    plain = {steps: beam_search(lm, ids, mask, max_new_tokens=steps, **kw) for steps in (4, 8)}
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: rows == 6)
    real, made = row_kernel.prepared, []
    monkeypatch.setattr(row_kernel, "prepared", lambda w, *a, **k: made.append(tuple(w.shape)) or real(w, *a, **k))
    head = [tuple(lm.gpt.lm_head_weight.shape)]
    once = sorted([tuple(m.weight.shape) for m in lm.modules() if type(m) is Linear] + head)
    real_step, fast = fast_step.FastStep, []
    monkeypatch.setattr(fast_step, "FastStep", lambda *a, **k: fast.append(a) or real_step(*a, **k))
    stepped = fast_step.why_not(lm, 6, None, lm.gpt.new_cache(6, 13)) is None  # GPT2_DECODE_STEP=0: not
    for steps in (4, 8):
        made.clear()
        assert torch.equal(beam_search(lm, ids, mask, max_new_tokens=steps, **kw), plain[steps])
        if stepped:
            assert made == head and fast, steps  # the C++ step took these beams
        else:
            assert sorted(made) == once and not fast, steps
    monkeypatch.setattr(fast_step, "why_not", lambda *a, **k: "a test: the steps through the layers")
    for steps in (4, 8):
        made.clear()
        assert torch.equal(beam_search(lm, ids, mask, max_new_tokens=steps, **kw), plain[steps])
        assert sorted(made) == once, steps


def test_without_a_pad_id_rows_that_end_early_are_filled_with_eos_as_transformers_does():
    """pad_token_id=None: a row whose best hypothesis ended before the longest one is filled with the EOS id (the
    default the docstring gives; transformers' generate does the same), not with 0."""
    hf, ours, ids, mask, eos = favoured_eos(seed=8, ahead=2)
    assert eos != 0
    kw = dict(max_new_tokens=12, num_beams=4, eos_token_id=eos)
    got = beam_search(ours, ids, mask, **kw)
    new = got[:, ids.shape[1]:]
    is_eos = (new == eos).long()
    after = is_eos.cumsum(1) - is_eos > 0  # the positions after each row's first EOS
    assert after.any(), "no row ended before the longest: the test would not see the filling"
    assert (new[after] == eos).all()
    assert torch.equal(got, hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=eos, **kw))


def test_the_search_stops_once_every_prompt_is_done_and_decodes_its_beam_rows_on_their_thread_plan(monkeypatch):
    """early_stopping=True: once each prompt holds N finished hypotheses no further step is decoded; the decode
    loop's thread plan is keyed by its B*N rows (N = 4 by default, as in transformers)."""
    from models import fast_step, generation

    _, ours, ids, mask, eos = favoured_eos(seed=8, ahead=2)
    kw = dict(max_new_tokens=16, eos_token_id=eos, pad_token_id=1, early_stopping=True)
    steps, keys = [], []
    real_step, real_fast, real_threads = ours.gpt.decode_step, fast_step.FastStep.__call__, generation.DecodeThreads
    # a step is decode_step's or, where the C++ step takes these 16 rows (fp32 with the many-row product), its
    monkeypatch.setattr(ours.gpt, "decode_step", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    monkeypatch.setattr(fast_step.FastStep, "__call__", lambda self, *a: steps.append(1) or real_fast(self, *a))
    monkeypatch.setattr(generation, "DecodeThreads", lambda key, **k: keys.append(key) or real_threads(key, **k))
    beam_search(ours, ids, mask, **kw)
    assert 0 < len(steps) < kw["max_new_tokens"] - 1, len(steps)
    assert [key[0] for key in keys if key[0] != "prompt"] == [4 * 4]
