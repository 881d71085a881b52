"""Decoding: token-for-token equal to transformers' generate under greedy search; cache, EOS, filters, sampling."""
import pytest
import torch
from conftest import make_hf_model, padded_batch, tiny_config
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from models import fast_step, generation, paths
from models.generation import apply_repetition_penalty, generate, prefill, top_k_filter, top_p_filter
from models.gpt2 import GPT2LMHeadModel
from models.loading import hf_to_ours


def load_pair(config, seed=0, attn="sdpa"):
    hf = make_hf_model(config, seed)
    ours = GPT2LMHeadModel(config.replace(attn_implementation=attn))
    ours.gpt.load_state_dict(hf_to_ours(hf.state_dict(), config.n_layer))
    return hf, ours.eval()


@torch.no_grad()
def tie_every_logit(hf, ours):
    """The same row for every token in both tied embeddings: every logit ties, at every step."""
    for emb in (hf.get_input_embeddings().weight, ours.gpt.word_embedding.weight):
        emb.copy_(emb[:1].expand_as(emb).clone())


def hf_greedy(hf, ids, mask, n, eos=None, pad=0):
    return hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=eos,
                       pad_token_id=pad, min_new_tokens=0 if eos is not None else n)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["h3-inner", "h4-wide"])
def test_greedy_single_prompt_equals_transformers(name, attn):
    config = tiny_config(name)
    hf, ours = load_pair(config, attn=attn)
    ids = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    expected = hf_greedy(hf, ids, torch.ones_like(ids), 25)
    assert torch.equal(ours.generate(ids, max_new_tokens=25), expected)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_batched_left_padded_equals_transformers(attn):
    config = tiny_config("h4-wide")
    hf, ours = load_pair(config, seed=2, attn=attn)
    ids, mask = padded_batch([7, 3, 1, 5], 7, config.vocab_size, "left", seed=4)
    expected = hf_greedy(hf, ids, mask, 20)
    got = ours.generate(ids, mask, max_new_tokens=20)
    assert got.shape == (4, 27)
    assert torch.equal(got, expected)


def test_greedy_takes_the_first_of_tied_logits_like_transformers():
    """Every logit tied (the tied embedding holds the same row for every token): greedy picks token 0 at every
    step, as argmax and transformers do."""
    config = tiny_config("h4-wide")
    hf, ours = load_pair(config, seed=3)
    tie_every_logit(hf, ours)
    ids, mask = padded_batch([4, 2], 4, config.vocab_size, "left", seed=5)
    got = ours.generate(ids, mask, max_new_tokens=6)
    assert torch.equal(got, hf_greedy(hf, ids, mask, 6)) and (got[:, 4:] == 0).all()


def test_greedy_search_ignores_the_sampling_settings_as_transformers_does():
    """Without do_sample, temperature, top_k and top_p change nothing (transformers applies them only when sampling):
    not even a temperature so small that dividing by it would overflow the logits to ties, nor a nucleus that keeps
    one of several tied logits."""
    config = tiny_config("h4-wide")
    hf, ours = load_pair(config, seed=3)
    ids, mask = padded_batch([4, 2], 4, config.vocab_size, "left", seed=5)
    settings = dict(temperature=1e-44, top_k=3, top_p=0.01)
    assert torch.equal(ours.generate(ids, mask, max_new_tokens=6, **settings), hf_greedy(hf, ids, mask, 6))
    tie_every_logit(hf, ours)
    assert torch.equal(ours.generate(ids, mask, max_new_tokens=6, **settings), hf_greedy(hf, ids, mask, 6))


def test_batched_greedy_equals_one_prompt_at_a_time():
    config = tiny_config("h3-inner")
    _, ours = load_pair(config, seed=3)
    ids, mask = padded_batch([6, 2, 4], 6, config.vocab_size, "left", seed=5)
    batched = ours.generate(ids, mask, max_new_tokens=12)
    for i in range(3):
        alone = ids[i: i + 1, mask[i].bool()]
        assert torch.equal(ours.generate(alone, max_new_tokens=12)[0, -12:], batched[i, -12:])


def test_cached_decoding_equals_recomputing_the_whole_sequence():
    config = tiny_config("h5")
    _, ours = load_pair(config, seed=6)
    ids, mask = padded_batch([5, 3], 5, config.vocab_size, "left", seed=7)
    cached = ours.generate(ids, mask, max_new_tokens=15)
    seq, m = ids, mask
    with torch.no_grad():
        for _ in range(15):
            nxt = ours(seq, m)["logits"][:, -1].argmax(-1, keepdim=True)
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    assert torch.equal(cached, seq)


def test_eos_stops_each_row_and_pads_after_it():
    config = tiny_config("h4-wide")
    hf, ours = load_pair(config, seed=1)
    ids, mask = padded_batch([7, 3, 5], 7, config.vocab_size, "left", seed=9)
    free = ours.generate(ids, mask, max_new_tokens=12)
    eos = int(free[0, 7 + 3])  # the token row 0 emits at step 3 becomes "end of sequence"
    assert not (free[1:, 7:] == eos).any()  # the other rows never emit it: they decode on after row 0 has ended
    pad = config.vocab_size - 2
    got = ours.generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    assert torch.equal(got, hf_greedy(hf, ids, mask, 12, eos=eos, pad=pad))
    row = got[0, 7:]
    stop = (row == eos).nonzero()[0].item()
    assert stop <= 3 and torch.all(row[stop + 1:] == pad)
    # decoding ends once every row has finished
    all_stop = ours.generate(ids[:1], mask[:1], max_new_tokens=12, eos_token_id=eos)
    assert all_stop.shape[1] == 7 + stop + 1


def test_twenty_new_tokens_by_default_and_prefills_own_defaults():
    """generate's default is 20 new tokens. prefill (generate and beam search pass it every argument; a caller of
    its own may not) keeps no repetition-penalty bookkeeping by default, gives no key mask to prompts without
    padding and the whole request's mask to padded ones, and follows a finished row with the pad id, else the EOS
    id, else 0."""
    config = tiny_config("h4-wide")
    _, ours = load_pair(config)
    ids, mask = padded_batch([4, 2], 4, config.vocab_size, "left", seed=1)
    assert generate(ours, ids[:1]).shape == (1, 4 + 20)
    plain = prefill(ours, ids[:1], None, 3)
    assert plain.seen is None and plain.key_mask is None and plain.pad == 0
    assert plain.cache.length == 4 and plain.cache.capacity == 4 + 3
    padded = prefill(ours, ids, mask, 3, eos_token_id=5)
    assert torch.equal(padded.key_mask[:, 0, 0], torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1).bool())
    assert padded.pad == 5 and prefill(ours, ids, mask, 3, eos_token_id=5, pad_token_id=7).pad == 7


def test_one_left_padded_prompt_equals_transformers_and_the_prompt_without_its_padding():
    """Batch 1 with padding: the steps must mask the padding keys (the C++ step, which does not, is not taken)."""
    config = tiny_config("h4-wide")
    hf, ours = load_pair(config, seed=2)
    with torch.no_grad():
        for model in (hf, ours):
            for p in model.parameters():
                p.mul_(3)  # sharper logits: greedy tokens that vary, so attending the padding would show
    ids, mask = padded_batch([8, 1], 8, config.vocab_size, "left", seed=4)
    row, row_mask = ids[1:], mask[1:]  # one real token after seven pads
    got = ours.generate(row, row_mask, max_new_tokens=10)
    assert torch.equal(got, hf_greedy(hf, row, row_mask, 10))
    assert torch.equal(got[:, 7:], ours.generate(row[:, 7:], max_new_tokens=10))


def test_the_thread_plans_are_keyed_by_rows_the_weights_form_and_the_models_size(monkeypatch):
    """Each prompt pass and each decode loop keeps the thread count it timed under its own key (models/
    decode_threads.py): the prompt's rows rounded up to a power of two, or the loop's rows; the weights' form
    (quantize, whose copies stream at other speeds); the model's size. A prompt too short to time asks the decode
    steps' key instead (short_prompt_threads)."""
    from models import decode_threads

    keys, short = [], []
    real = generation.DecodeThreads
    monkeypatch.setattr(generation, "DecodeThreads", lambda key, **kw: keys.append(key) or real(key, **kw))
    monkeypatch.setattr(decode_threads, "remembers_fewer_threads", lambda: True)  # (the key is asked only then)
    monkeypatch.setattr(decode_threads, "short_prompt_threads", lambda key: short.append(key) or None)
    _, ours = load_pair(tiny_config("h4-wide"))
    size = ours.num_parameters()
    ids = torch.randint(0, 100, (3, 5), generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv(fast_step.PROMPT_ENV, "0")  # a one-row prompt through the layers, as a longer one goes
    monkeypatch.setattr(generation, "PROMPT_MIN_FLOPS", 0)  # these prompts timed, as long ones are
    ours.generate(ids[:1], max_new_tokens=3, quantize="int8")
    ours.generate(ids, max_new_tokens=3)
    assert keys == [("prompt", 8, "int8", size), (1, "int8", size), ("prompt", 16, None, size), (3, None, size)]
    assert short == []
    monkeypatch.undo()
    monkeypatch.setattr(generation, "DecodeThreads", lambda key, **kw: keys.append(key) or real(key, **kw))
    monkeypatch.setattr(decode_threads, "remembers_fewer_threads", lambda: True)  # (the key is asked only then)
    monkeypatch.setattr(decode_threads, "short_prompt_threads", lambda key: short.append(key) or None)
    monkeypatch.setenv(fast_step.PROMPT_ENV, "0")
    keys.clear()
    ours.generate(ids[:1], max_new_tokens=3, quantize="int8")  # too short to time: the steps' key is asked
    ours.generate(ids, max_new_tokens=3)
    assert keys == [(1, "int8", size), (3, None, size)] and short == [(1, "int8", size), (3, None, size)]
    if paths.BY_NAME["prompt-pass"].runs_here() is None:  # the C++ prompt pass: one call, no thread count to time
        monkeypatch.delenv(fast_step.PROMPT_ENV)
        keys.clear()
        short.clear()
        ours.generate(ids[:1], max_new_tokens=3, quantize="int8")
        assert keys == [(1, "int8", size)] and short == [(1, "int8", size)]


@pytest.mark.parametrize("where", ["layers", "c++ pass"])
def test_an_error_in_the_prompts_pass_reaches_the_caller_and_leaves_the_model_as_it_was(monkeypatch, where):
    """A prompt pass that fails (Ctrl-C in a long prompt, out of memory) raises its own error, not one of the
    clean-up's, and the model is back in training mode: through the layers, or in the C++ prompt pass."""
    _, ours = load_pair(tiny_config("h4-wide"))
    ours.train()

    def broken(*args, **kwargs):
        raise KeyboardInterrupt("the prompt's pass stopped")

    if where == "layers":
        monkeypatch.setenv(fast_step.PROMPT_ENV, "0")
        monkeypatch.setattr(ours.gpt, "forward", broken)
    elif paths.BY_NAME["prompt-pass"].runs_here() is None:
        monkeypatch.setattr(fast_step.FastPrompt, "__call__", broken)
    else:
        pytest.skip("the C++ prompt pass does not run here")
    with pytest.raises(KeyboardInterrupt, match="the prompt's pass stopped"):
        ours.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    assert ours.training


def test_generation_refuses_right_padding_and_overlong_requests():
    config = tiny_config("h5")  # n_positions 32
    _, ours = load_pair(config)
    ids, mask = padded_batch([4, 2], 4, config.vocab_size, "right")
    with pytest.raises(ValueError, match="left-padded"):
        ours.generate(ids, mask, max_new_tokens=3)
    with pytest.raises(ValueError, match="exceeds the context of n_positions=32"):
        ours.generate(ids[:, :4], max_new_tokens=29)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        ours.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        ours.generate(ids, do_sample=True, top_p=1.5)


def test_every_refused_request_names_its_problem_and_the_limits_themselves_are_accepted():
    """Each check's message, whole (a user reads it), and each limit's boundary value accepted."""
    import re

    config = tiny_config("h5")  # n_positions 32
    _, ours = load_pair(config)
    ids, mask = padded_batch([4, 4], 4, config.vocab_size, "left")
    refused = [
        (dict(input_ids=ids[0]), "input_ids must be (batch, prompt_len) with prompt_len >= 1, got shape (4,)"),
        (dict(input_ids=ids[:, :0]), "input_ids must be (batch, prompt_len) with prompt_len >= 1, got shape (2, 0)"),
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
        (dict(max_new_tokens=29), "prompt length 4 + max_new_tokens 29 = 33 exceeds the context of n_positions=32; "
                                  "shorten the prompt or generate fewer tokens"),
        (dict(attention_mask=mask[:, :3]), "attention_mask shape (2, 3) != input_ids shape (2, 4)"),
        (dict(attention_mask=padded_batch([4, 2], 4, 10, "right")[1]),
         "prompts must be left-padded for generation (a row's last token is padding); "
         "set tokenizer.padding_side = 'left'"),
        (dict(do_sample=True, temperature=0.0),
         "temperature must be > 0 (use do_sample=False for greedy decoding), got 0.0"),
        (dict(do_sample=True, top_k=-1), "top_k must be >= 0, got -1"),
        (dict(do_sample=True, top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(do_sample=True, top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(quantize="int3"), "quantize must be None or one of ('int8', 'int4', 'w8a8', 'w4a8'), got 'int3'"),
    ]
    for kw, message in refused:
        request = dict(input_ids=ids, attention_mask=mask, max_new_tokens=2) | kw
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            ours.generate(**request)
    for kw in (dict(max_new_tokens=28), dict(repetition_penalty=1e-3), dict(do_sample=True, top_k=0, top_p=1.0),
               dict(do_sample=True, temperature=1e-3, top_p=1e-3)):
        out = ours.generate(ids, mask, **dict(max_new_tokens=2) | kw)
        assert out.shape == (2, 4 + kw.get("max_new_tokens", 2))


def test_zero_new_tokens_returns_the_prompt_without_running_the_model(monkeypatch):
    _, ours = load_pair(tiny_config("h5"))
    ids, mask = padded_batch([4, 2], 4, 100, "left")
    monkeypatch.setattr(ours.gpt, "forward", lambda *a, **k: pytest.fail("ran the prompt for no new token"))
    for kw in ({}, {"do_sample": True, "top_p": 0.9}, {"num_beams": 2}):
        out = ours.generate(ids, mask, max_new_tokens=0, **kw)
        assert torch.equal(out, ids) and out is not ids
    with pytest.raises(ValueError, match="left-padded"):  # still checked
        ours.generate(*padded_batch([4, 2], 4, 100, "right"), max_new_tokens=0)


def test_generate_keeps_the_training_mode(monkeypatch):
    """A model in training mode decodes in eval mode and comes back in training mode, every module, also where the
    quantized copies could not be made; a model in eval mode is not walked over twice (eval(), train())."""
    import models.generation as generation

    _, ours = load_pair(tiny_config("h5"))
    ours.train()
    seen = []
    real_forward = ours.gpt.forward
    monkeypatch.setattr(ours.gpt, "forward", lambda *a, **k: seen.append(ours.training) or real_forward(*a, **k))
    ours.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2)
    assert seen == [False] and all(m.training for m in ours.modules())

    def refused(model, mode, layers):
        raise ValueError("no copies")

    monkeypatch.setattr(generation, "quantized_weights", refused)
    with pytest.raises(ValueError, match="no copies"):
        ours.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, quantize="int8")
    assert all(m.training for m in ours.modules())
    monkeypatch.undo()
    ours.eval()
    monkeypatch.setattr(type(ours), "train", lambda *a, **k: pytest.fail("train() called on a model in eval mode"))
    ours.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2)
    assert not any(m.training for m in ours.modules())


# ---- logit filters against hand-made distributions and transformers' warpers ----------------------------------------

def test_top_k_keeps_the_k_best_and_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    assert torch.equal(top_k_filter(logits, 1).isfinite(), torch.tensor([[False, True, False, True, False]]))
    assert torch.equal(top_k_filter(logits, 3).isfinite(), torch.tensor([[False, True, True, True, False]]))
    assert torch.equal(top_k_filter(logits, 0), logits) and torch.equal(top_k_filter(logits, None), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    kept = lambda p: top_p_filter(logits, p).isfinite()[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False, False]
    assert kept(0.6) == [True, True, False, False, False]
    assert kept(0.86) == [True, True, True, True, False]
    assert kept(1.0) == [True] * 5
    assert kept(1e-9) == [True, False, False, False, False]  # at least one token survives
    shuffled = logits[:, [3, 0, 4, 1, 2]]
    assert top_p_filter(shuffled, 0.6).isfinite()[0].tolist() == [False, True, False, True, False]


@pytest.mark.parametrize("k", [1, 5, 40])
@pytest.mark.parametrize("p", [0.3, 0.9, 0.999])
def test_filters_match_transformers_warpers(k, p):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(k))
    torch.testing.assert_close(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits.clone()))
    torch.testing.assert_close(top_p_filter(logits, p), TopPLogitsWarper(p)(None, logits.clone()))


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_top_p_with_the_fast_sort_removes_what_torch_sort_removes_even_among_ties(scale):
    """The CPU path sorts with numpy, which orders equal logits differently; rounded logits (many ties, so cuts
    inside runs of equal values) and -inf from top-k must still remove exactly the tokens torch.sort's order does."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(3, 1000, generator=g) * scale
        if trial % 2:
            logits = (logits * 4).round() / 4
        if trial % 3 == 0:
            logits = top_k_filter(logits, 50)
        for p in (0.05, 0.5, 0.9, 0.999):
            assert torch.equal(top_p_filter(logits, p), top_p_filter(logits, p, fast_sort=False)), (trial, p)


def test_filters_work_on_every_row_of_logits_with_more_dimensions_and_on_bf16():
    """(B, T, V) logits are filtered per row exactly as the same rows flattened to (B * T, V) by transformers'
    warpers; bf16 logits (a bf16 model's) are filtered too."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 50, generator=g)
    rows = logits.reshape(6, 50)
    for k in (1, 7, 49, 50):
        torch.testing.assert_close(top_k_filter(logits, k), TopKLogitsWarper(k)(None, rows.clone()).view(2, 3, 50))
    for p in (0.2, 0.9):
        torch.testing.assert_close(top_p_filter(logits, p), TopPLogitsWarper(p)(None, rows.clone()).view(2, 3, 50))
        half = logits.bfloat16()  # numpy has no bf16: the torch.sort path, row by row as well
        assert torch.equal(top_p_filter(half, p), top_p_filter(half.reshape(6, 50), p).view(2, 3, 50))


def test_top_p_1_and_top_k_of_the_vocabulary_keep_every_token_even_where_the_mass_rounds_to_1():
    """One logit far above the rest: the mass of the tokens ranked above the second reaches 1.0 in float32, yet
    top_p=1.0 keeps them all (it is no filter), as does top_k equal to the vocabulary size."""
    logits = torch.cat([torch.tensor([[40.0]]), torch.randn(1, 99, generator=torch.Generator().manual_seed(2))], 1)
    assert float(logits.softmax(-1)[0, 0]) == 1.0
    for fast in (True, False):
        assert torch.equal(top_p_filter(logits, 1.0, fast_sort=fast), logits)
    assert torch.equal(top_k_filter(logits, 100), logits)
    flat = torch.zeros(2, 100)  # every token equally likely: a nucleus of 0.999 keeps all 100 (no cut to look at)
    assert torch.equal(top_p_filter(flat, 0.999), flat)


def test_top_p_answers_without_torch_sort_unless_ties_straddle_the_cut(monkeypatch):
    """The CPU path's point is to skip torch.sort: for logits without ties at the cut it answers from numpy's sorted
    values alone; equal logits on both sides of the cut send it to torch.sort, whose order decides."""
    sorts = []
    real = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real(*a, **k))
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))
    for p in (0.1, 0.5, 0.9):
        assert torch.equal(top_p_filter(logits.view(2, 2, 1000), p), top_p_filter(logits, p).view(2, 2, 1000))
        got = top_p_filter(logits, p)
        assert not sorts, p
        assert torch.equal(got, top_p_filter(logits, p, fast_sort=False)) and sorts
        sorts.clear()
    tied = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])  # the nucleus of 0.5 ends inside the run of 2.0s
    assert torch.equal(top_p_filter(tied, 0.5), top_p_filter(tied, 0.5, fast_sort=False)) and sorts


def _top_p_sorts(monkeypatch) -> list:
    """What each CPU top-p call sorted: a row's candidates (their count), "row" for a whole row, "torch.sort"."""
    sorts = []
    real_sort, real_values = torch.sort, generation.sorted_best_first

    def values(x):
        sorts.append("row" if len(x) == V else len(x))
        return real_values(x)

    V = None
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append("torch.sort") or real_sort(*a, **k))
    monkeypatch.setattr(generation, "sorted_best_first", values)

    def set_vocab(n):
        nonlocal V
        V = n
    return sorts, set_vocab


def _binade_candidates(row: torch.Tensor, p: float) -> int:
    """How many probabilities of `row` lie in the binades (powers of two, largest first) up to the first whose
    summed mass reaches p + generation.SLACK: the candidates the CPU top-p path sorts."""
    exponent = torch.frexp(row).exponent.long()
    below_top = exponent.max() - exponent  # 0: the largest binade
    mass = torch.bincount(below_top, weights=row.double()).cumsum(0)
    last = int(torch.searchsorted(mass, torch.tensor([p + generation.SLACK], dtype=mass.dtype)))
    return int((below_top <= last).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spread", [1.0, 3.0, 8.0])
def test_top_p_sorts_only_the_binades_that_reach_p(monkeypatch, spread, dtype):
    """gpt2's vocabulary, fp32 or fp64 logits: from a nucleus of a few tokens to thousands, each row sorts exactly the
    probabilities of the binades up to the first whose mass passes p, never the whole row nor through torch.sort,
    and removes what the torch.sort path removes."""
    sorts, set_vocab = _top_p_sorts(monkeypatch)
    set_vocab(50257)
    logits = (torch.randn(3, 50257, generator=torch.Generator().manual_seed(int(spread))) * spread).to(dtype)
    probs = logits.softmax(-1)
    for p in (0.05, 0.5, 0.9, 0.99):
        got = top_p_filter(logits, p)
        assert sorts == [_binade_candidates(row, p) for row in probs], (p, sorts)
        assert all(n < 50257 for n in sorts)
        kept = got.isfinite().sum(-1)
        assert all(n >= k for n, k in zip(sorts, kept.tolist()))  # the nucleus is among the candidates sorted
        sorts.clear()
        assert torch.equal(got, top_p_filter(logits, p, fast_sort=False))
        sorts.clear()


@pytest.mark.parametrize("slack", [True, False])
@pytest.mark.parametrize("past", [2e-5, 5e-6, 2e-6, 0.5e-6])
def test_top_p_takes_the_candidates_only_where_their_mass_passes_p_by_the_margin(monkeypatch, past, slack):
    """Probabilities in three binades: 0.8 over 40 tokens in [2^-6, 2^-5), 0.1 over 8 in [2^-7, 2^-6), the rest far
    below; a nucleus of the first 48 whose mass passes p by `past`. The binades are taken up to the one whose mass
    passes p by SLACK (1e-5): 2e-5 past p takes two (48 candidates), 5e-6 all three (the whole row). The candidates'
    own cumulative mass must pass p by MARGIN (1e-6) for the later tokens to be removed for sure: with SLACK 0, 2e-6
    answers from the 48, 0.5e-6 sorts the whole row too."""
    if not slack:
        monkeypatch.setattr(generation, "SLACK", 0.0)
    probs = torch.cat([torch.full((40,), 0.8 / 40), torch.full((8,), 0.1 / 8), torch.full((952,), 0.1 / 952)])
    logits = probs.log()[None] + torch.linspace(0, 1e-4, 1000)[None].flip(-1)  # no ties, the same order
    mass = logits.softmax(-1)[0].sort(descending=True).values.cumsum(0)
    p = float(mass[47]) - past
    sorts, set_vocab = _top_p_sorts(monkeypatch)
    set_vocab(1000)
    got = top_p_filter(logits, p)
    if slack:
        assert sorts == ([48] if past > generation.SLACK else ["row"]), sorts
    else:
        assert sorts == ([48] if past > generation.MARGIN else [48, "row"]), sorts
    sorts.clear()
    assert torch.equal(got, top_p_filter(logits, p, fast_sort=False))
    assert int(got.isfinite().sum()) == 48


def test_processing_defaults_change_nothing_and_a_penalty_of_2_applies():
    from models.generation import mark_seen, process_logits

    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    history = torch.tensor([[1, 5, 5, 7], [0, 2, 29, 3]])
    seen = torch.zeros(2, 30, dtype=torch.bool).scatter(1, history, True)
    assert torch.equal(process_logits(logits), logits) and torch.equal(process_logits(logits, seen), logits)
    expected = RepetitionPenaltyLogitsProcessor(2.0)(history, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 2.0), expected)
    meta = torch.zeros(2, 30, dtype=torch.bool, device="meta")  # the row index is made on the tokens' device
    mark_seen(meta, torch.tensor([3, 4], device="meta"))


def test_repetition_penalty_matches_transformers_and_temperature_scales():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    history = torch.tensor([[1, 5, 5, 7], [0, 2, 29, 3]])
    seen = torch.zeros(2, 30, dtype=torch.bool).scatter(1, history, True)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.3), expected)
    _, ours = load_pair(tiny_config("h5"))
    ids = torch.tensor([[3, 4]])
    # penalising every token seen makes greedy decoding avoid repeating itself where it otherwise would
    plain = ours.generate(ids, max_new_tokens=20)[0, 2:]
    penalised = ours.generate(ids, max_new_tokens=20, repetition_penalty=1e4)[0]
    assert len(set(penalised.tolist())) == 22 and len(set(plain.tolist())) < 20


@pytest.mark.parametrize("penalty", [1.3, 2.0])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_with_repetition_penalty_equals_transformers(attn, penalty):
    """The penalty covers the prompt's tokens as well as the new ones: the prompts are the model's own greedy
    continuations, which it would otherwise repeat."""
    config = tiny_config("h3-inner")
    hf, ours = load_pair(config, seed=12, attn=attn)
    start = torch.randint(0, 100, (2, 3), generator=torch.Generator().manual_seed(13))
    ids = ours.generate(start, max_new_tokens=9)  # no padding: HF penalises pads
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                           do_sample=False, repetition_penalty=penalty, pad_token_id=0)
    got = ours.generate(ids, max_new_tokens=20, repetition_penalty=penalty)
    assert torch.equal(got, expected)
    assert not torch.equal(got, ours.generate(ids, max_new_tokens=20))


def test_sampling_is_reproducible_with_a_seeded_generator_and_top_k_1_is_greedy():
    config = tiny_config("h4-wide")
    _, ours = load_pair(config)
    ids, mask = padded_batch([5, 2], 5, config.vocab_size, "left")
    a = ours.generate(ids, mask, max_new_tokens=15, do_sample=True, temperature=1.5,
                      generator=torch.Generator().manual_seed(7))
    b = ours.generate(ids, mask, max_new_tokens=15, do_sample=True, temperature=1.5,
                      generator=torch.Generator().manual_seed(7))
    c = ours.generate(ids, mask, max_new_tokens=15, do_sample=True, temperature=1.5,
                      generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = ours.generate(ids, mask, max_new_tokens=15)
    assert torch.equal(ours.generate(ids, mask, max_new_tokens=15, do_sample=True, top_k=1), greedy)


def test_sampling_follows_temperature():
    """With a model that always predicts the same distribution, sample frequencies follow softmax(logits / T)."""
    config = tiny_config("h5", n_layer=1)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.gpt.final_layer_norm.bias.copy_(torch.linspace(-1, 1, config.n_embd))
        model.gpt.word_embedding.weight[:3] = torch.randn(3, config.n_embd, generator=torch.Generator().manual_seed(0))
    logits = model(torch.zeros(1, 1, dtype=torch.long))["logits"][0, -1].detach()
    ids = torch.zeros(4000, 1, dtype=torch.long)
    for temperature in (0.7, 2.0):
        out = model.generate(ids, max_new_tokens=1, do_sample=True, temperature=temperature,
                             generator=torch.Generator().manual_seed(1))[:, -1]
        freq = torch.bincount(out, minlength=config.vocab_size).float() / len(out)
        p = (logits / temperature).softmax(-1)
        # within 4 binomial standard deviations per token: tight enough to tell T from T**2 or sqrt(T)
        bound = 4 * (p * (1 - p) / len(out)).sqrt() + 1e-3
        assert ((freq - p).abs() <= bound).all(), (temperature, freq[:3], p[:3])


@torch.no_grad()
def reference_sampling(lm, ids, mask, n, generator, temperature=1.0, top_k=None, top_p=None):
    """Sampling spelled out: each step runs the whole sequence again (no cache), filters the last position's
    logits token by token in float64 (top-k, then top-p: the most likely tokens, in order, until the mass before
    a token reaches p), and draws the batch's next tokens with one torch.multinomial call on the generator."""
    seq, m = ids, mask
    for _ in range(n):
        logits = lm(seq, m)["logits"][:, -1].float()
        if temperature != 1.0:
            logits = logits / temperature
        keep = torch.ones_like(logits, dtype=torch.bool)
        for row in range(len(logits)):
            order = logits[row].double().argsort(descending=True).tolist()
            if top_k:
                kth = logits[row, order[top_k - 1]]
                keep[row] &= logits[row] >= kth
            probs = logits[row].masked_fill(~keep[row], float("-inf")).double().softmax(-1).tolist()
            if top_p is not None and top_p < 1.0:
                mass, allowed = 0.0, torch.zeros_like(keep[row])
                for token in order:
                    if mass >= top_p:  # p > 0: the most likely token always stays
                        break
                    allowed[token] = True
                    mass += probs[token]
                keep[row] &= allowed
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        next_ids = torch.multinomial(probs, 1, generator=generator)
        seq, m = torch.cat([seq, next_ids], 1), torch.cat([m, torch.ones_like(next_ids)], 1)
    return seq


@pytest.mark.parametrize("settings", [dict(temperature=1.2, top_p=0.9), dict(top_k=20, top_p=0.7),
                                      dict(temperature=0.7), dict(temperature=1.5, top_k=5)])
@pytest.mark.parametrize("lengths", [[5], [6, 3, 5]])
def test_sampling_draws_transformers_tokens_from_the_same_seed(settings, lengths):
    """The sonnet pattern: generate(do_sample=True) after torch.manual_seed(s), no generator (torch's default one),
    against transformers' generate after the same seed: the same tokens, one prompt and a left-padded batch (on
    gpt2 random weights and the course's sonnet lines, 40 of 40 lines and 40 of 40 batch rows agreed, flat and
    sharp distributions alike). Sharpened so that top-p cuts inside the vocabulary."""
    config = tiny_config("h4-wide")
    hf, ours = load_pair(config, seed=6)
    with torch.no_grad():
        for model_norm in (hf.transformer.ln_f, ours.gpt.final_layer_norm):
            model_norm.weight.mul_(6.0)
            model_norm.bias.mul_(6.0)
    ids, mask = padded_batch(lengths, max(lengths), config.vocab_size, "left", seed=2)
    torch.manual_seed(11)
    got = ours.generate(ids, mask, max_new_tokens=15, do_sample=True, **settings)
    torch.manual_seed(11)
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=15, min_new_tokens=15, do_sample=True,
                           pad_token_id=0, **{"top_k": 0, **settings})
    assert torch.equal(got, expected)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("settings", [dict(temperature=0.8, top_p=0.9), dict(top_k=20, top_p=0.7),
                                      dict(temperature=1.3), dict(temperature=0.6, top_k=7)])
def test_sampling_draws_the_same_tokens_as_a_spelled_out_reference(settings, batch):
    """Pins the sampled tokens for a seed: the decoder's fast paths (KV cache, decode-time LM head layouts, the
    way top-p finds its cut) must draw exactly what the plain computation draws from the same generator."""
    config = tiny_config("h4-wide")
    _, ours = load_pair(config, seed=4)
    with torch.no_grad():  # sharper distributions: top-p 0.9 keeps about 100-240 of the 1000 tokens, 0.7 4-75
        ours.gpt.final_layer_norm.weight.mul_(10.0)
        ours.gpt.final_layer_norm.bias.mul_(10.0)
    ids, mask = padded_batch([6, 3, 5][:batch], 6, config.vocab_size, "left", seed=9)
    got = ours.generate(ids, mask, max_new_tokens=12, do_sample=True, generator=torch.Generator().manual_seed(3),
                        **settings)
    expected = reference_sampling(ours, ids, mask, 12, torch.Generator().manual_seed(3), **settings)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "soft-capped"])
def test_the_decode_head_takes_each_batch_sizes_kernel_and_equals_the_models_head(monkeypatch, softcap):
    """decode_lm_head: the rows kernel where it pays (fp32, 1 to 8 rows), else (V, C) @ (C, B) for several rows and
    the row-blocked product for one (threads > 1); every form soft-caps like the model's own head and equals it to
    fp32 rounding. Off the CPU it is the model's head itself."""
    import models.generation as generation
    from modules import rows as row_kernel

    torch.set_num_threads(2)  # restored by conftest's restore_threads
    torch.manual_seed(0)
    body = GPT2LMHeadModel(tiny_config("h5", logit_softcap=softcap)).eval().gpt
    used = []
    for name in ("weight_first", "blocked_product"):
        real = getattr(generation, name)
        monkeypatch.setattr(generation, name, lambda *a, _real=real, _name=name: used.append(_name) or _real(*a))
    run, prepared = row_kernel.run, row_kernel.prepared
    monkeypatch.setattr(row_kernel, "run", lambda *a: used.append("rows") or run(*a))
    rows_prepared = []  # the head's product is prepared for the batch's row count (the library that count takes)
    monkeypatch.setattr(row_kernel, "prepared",
                        lambda *a, **k: rows_prepared.append(k.get("rows")) or prepared(*a, **k))
    cases = [(1, True, "rows"), (3, True, "rows"), (1, False, "blocked_product"), (2, False, "weight_first"),
             (3, False, "weight_first")]
    for batch, kernel, expected in cases:
        monkeypatch.setattr(row_kernel, "available", lambda kernel=kernel, real=row_kernel.available: kernel and real())
        if expected == "rows" and not (row_kernel.available() and row_kernel.pays(torch.float32, batch)):
            continue  # no compiler here (the kernel's own tests skip too), or a CPU where it does not pay (AVX2)
        hidden = torch.randn(batch, body.config.n_embd, generator=torch.Generator().manual_seed(batch))
        used.clear()
        got = generation.decode_lm_head(body, batch)(hidden)
        assert used == [expected], (batch, kernel, used)
        assert rows_prepared == ([batch] if expected == "rows" else []), rows_prepared
        rows_prepared.clear()
        torch.testing.assert_close(got, body.hidden_state_to_token(hidden), atol=2e-5, rtol=2e-5)
        if softcap:
            assert got.abs().max() <= softcap
    meta = GPT2LMHeadModel(tiny_config("h5")).to("meta").gpt
    assert generation.decode_lm_head(meta, 1) == meta.hidden_state_to_token


@pytest.mark.parametrize("kernel", [True, False], ids=["prepared", "no-kernel"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_decode_head_reads_its_copy_at_batch_1_only(monkeypatch, mode, kernel):
    """quantize= at batch 1: the head's logits are the quantized copy's (kept on the model, made again after the
    weights change) for fp32, bf16 or strided rows alike, soft-capped; other batch sizes keep the model's head; a
    head the format cannot take is refused naming the LM head."""
    import re

    import models.generation as generation
    import modules.quant as quant_module
    from models.generation import decode_lm_head
    from modules.quant import quantize, quantized_linear

    prepared_calls = []  # fp32 contiguous rows take the prepared kernel product where there is one
    real = generation.prepared_quantized

    def prepared(head):
        call = real(head) if kernel else None
        return None if call is None else lambda hidden: prepared_calls.append(1) or call(hidden)

    monkeypatch.setattr(generation, "prepared_quantized", prepared)
    # strided and bf16 rows take quantized_linear eagerly here: inductor's one-row loop (compiled in 8-10 s at its
    # first use) has its own tests in tests/test_quant.py
    monkeypatch.setattr(quant_module, "_compiled_gemv", False)
    torch.manual_seed(0)
    body = GPT2LMHeadModel(tiny_config("h4-wide", logit_softcap=4.0)).eval().gpt  # n_embd 64: int4's groups fit
    head = decode_lm_head(body, 1, mode)
    copy = quantize(body.lm_head_weight.detach(), mode)
    wide = torch.randn(1, 128, generator=torch.Generator().manual_seed(0))
    for hidden in (wide[:, :64], wide[:, ::2], wide[:, :64].bfloat16()):  # contiguous fp32, strided, bf16
        expected = body.logit_softcap(quantized_linear(hidden, copy))  # a bf16 row gives bf16 logits
        prepared_calls.clear()
        torch.testing.assert_close(head(hidden), expected, atol=1e-4, rtol=1e-3)
        fp32_rows = hidden.dtype == torch.float32 and hidden.is_contiguous()
        assert len(prepared_calls) == (1 if kernel and fp32_rows and real(copy) is not None else 0)
        assert not torch.allclose(expected.float(), body.hidden_state_to_token(hidden.float()), atol=1e-3)
    with torch.no_grad():
        body.word_embedding.weight.mul_(-1.0)  # an edit in place: the next decode quantizes again
    flipped = body.logit_softcap(quantized_linear(wide[:, :64], copy))
    torch.testing.assert_close(decode_lm_head(body, 1, mode)(wide[:, :64]), -flipped, atol=1e-4, rtol=1e-3)
    three = torch.randn(3, 64)
    torch.testing.assert_close(decode_lm_head(body, 3, mode)(three), body.hidden_state_to_token(three),
                               atol=2e-5, rtol=2e-5)
    if mode == "int4":
        odd = GPT2LMHeadModel(tiny_config("h5")).gpt  # n_embd 48: not a multiple of int4's 32
        with pytest.raises(ValueError, match=re.escape("quantize='int4': the LM head: ")):
            decode_lm_head(odd, 1, mode)


@pytest.mark.parametrize("lengths", [[7], [6, 2, 4]])
def test_a_call_reusing_the_last_calls_cache_buffers_poisoned_equals_a_fresh_models(lengths):
    """generate keeps its KV cache's buffers for the next call of the same shape (GPT2Model.keep_cache): the second
    call writes every position it reads, so buffers filled with NaN in between change nothing (one prompt: the C++
    step; a left-padded batch: torch's steps), against a fresh copy of the model, which has no kept buffers. Another
    shape, an inference-mode call and a cache above KEPT_CACHE_BYTES get new buffers."""
    from models import gpt2

    config = tiny_config("h3-inner")
    _, ours = load_pair(config, seed=3)
    first, mask = padded_batch(lengths, max(lengths), config.vocab_size, "left", seed=5)
    second, _ = padded_batch(lengths, max(lengths), config.vocab_size, "left", seed=6)
    ours.generate(first, mask, max_new_tokens=9)
    keys, values = gpt2._KEPT_CACHES[ours.gpt]
    keys.fill_(float("nan"))
    values.fill_(float("nan"))
    fresh = GPT2LMHeadModel(config).eval()
    fresh.load_state_dict(ours.state_dict())
    assert ours.gpt not in gpt2._KEPT_CACHES or gpt2._KEPT_CACHES[ours.gpt][0] is keys
    made = []
    new_cache = ours.gpt.new_cache
    ours.gpt.new_cache = lambda *a, **k: made.append(new_cache(*a, **k)) or made[-1]
    assert torch.equal(ours.generate(second, mask, max_new_tokens=9), fresh.generate(second, mask, max_new_tokens=9))
    assert made[-1].keys is keys and made[-1].values is values
    ours.generate(second, mask, max_new_tokens=5)  # another capacity: new buffers, kept in their place
    assert made[-1].keys is not keys and gpt2._KEPT_CACHES[ours.gpt][0] is made[-1].keys
    with torch.inference_mode():  # new buffers (another capacity) made in inference mode: not kept
        ours.generate(second, mask, max_new_tokens=4)
    assert made[-1].keys.is_inference() and ours.gpt not in gpt2._KEPT_CACHES
    assert torch.equal(ours.generate(second, mask, max_new_tokens=5), fresh.generate(second, mask, max_new_tokens=5))
    gpt2_bytes = gpt2.KEPT_CACHE_BYTES
    try:
        gpt2.KEPT_CACHE_BYTES = made[-1].keys.nbytes  # keys and values together are above it
        gpt2._KEPT_CACHES.clear()
        ours.generate(second, mask, max_new_tokens=5)
        assert ours.gpt not in gpt2._KEPT_CACHES
    finally:
        gpt2.KEPT_CACHE_BYTES = gpt2_bytes


def test_the_c_step_and_the_layers_prepared_products_are_made_only_where_steps_use_them(monkeypatch):
    """A call with one new token makes neither the C++ step nor the layers' prepared row products; a longer one makes
    the step where it runs (and no prepared products: the step runs the layers), else the products, once."""
    import models.generation as generation
    from models import fast_step

    _, ours = load_pair(tiny_config("h5"))
    ours.eval()
    steps, prepared = [], []
    real_step, real_prepared = fast_step.FastStep, generation.prepared_rows
    monkeypatch.setattr(fast_step, "FastStep", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    monkeypatch.setattr(generation, "prepared_rows", lambda *a, **k: prepared.append(1) or real_prepared(*a, **k))
    ids = torch.zeros(1, 3, dtype=torch.long)
    runs = fast_step.why_not(ours, 1, None, ours.gpt.new_cache(1, 8)) is None
    for new, made in ((1, ([], [])), (2, ([1], []) if runs else ([], [1]))):
        steps.clear()
        prepared.clear()
        ours.generate(ids, max_new_tokens=new)
        assert (steps, prepared) == made, new
    monkeypatch.setattr(fast_step, "why_not", lambda *a, **k: "a test: the steps through the layers")
    prepared.clear()
    ours.generate(ids, max_new_tokens=2)
    assert prepared == [1]


def test_the_threads_helpers_read_the_model_alone_as_from_its_walk():
    """The size and device the thread choice keys on: the same from a caller's walk and from the model alone (a
    helper called by itself walks its parameters)."""
    m = GPT2LMHeadModel(tiny_config("h5")).eval()
    walked = fast_step.walk(m)
    assert generation._size(m, None) == generation._size(m, walked) == m.num_parameters()
    assert generation._on_cpu(m, None) is generation._on_cpu(m, walked) is True


def test_a_prompt_is_timed_from_the_flops_of_its_blocks():
    """prompt_is_timed: a prompt's blocks are timed from 24 x rows x n_embd^2 flops at PROMPT_MIN_FLOPS (5e8) on: 5087
    rows of a 64-wide model (5.0002e8) and not 5086 (4.9992e8), with or without the caller's walk."""
    from models.decode_threads import PROMPT_MIN_FLOPS

    m = GPT2LMHeadModel(tiny_config("h4-wide")).eval()
    assert 24 * 5086 * 64 * 64 < PROMPT_MIN_FLOPS <= 24 * 5087 * 64 * 64
    for found in (None, fast_step.walk(m)):
        assert generation.prompt_is_timed(m, 5087, found) and not generation.prompt_is_timed(m, 5086, found)
        assert not generation.prompt_is_timed(m.to("meta"), 10 ** 9, None if found is None else found._replace(
            first_cpu=False))
