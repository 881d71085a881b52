"""models/fast_step.py's C++ prompt pass (modules/rows.cpp gpt2_prompt_pass) against the layers' own pass (GPT2Model's
forward into a cache), the reference: the last token's final hidden state, every layer's keys and values, the cache's
length; for prompts of 1 to 8 tokens (the kernel's few-row products) and 9 to 16 (its product of many rows), in the
native and the forced AVX2 build; generate and beam search give the same tokens with it as without it
(GPT2_PROMPT_PASS=0), and prompts it does not take keep the layers, each with its reason.

Tolerance: the pass's sums run in other orders than torch's (the kernel's products, LayerNorm in double, exp by a
polynomial): hidden states, keys and values agree to 1e-5 (relative and absolute) on these small models, as the decode
step's do (tests/test_fast_step.py)."""
import os

import pytest
import torch

from models import fast_step
from models.beam_search import beam_search
from models.generation import generate, prefill
from modules import onednn, prompt_attention, rows
from modules.linear import quantized_weights
from tests.test_fast_step import TOL, avx2_or_skip, tiny

pytestmark = [pytest.mark.skipif(not rows.available(), reason="the rows kernel cannot be built here"),
              pytest.mark.skipif(any(os.environ.get(env) == "0" for env in (fast_step.ENV, fast_step.PROMPT_ENV,
                                                                               prompt_attention.ENV)),
                                 reason="the decode step, the prompt pass or prompt attention is switched off (these "
                                        "tests run the pass)")]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]  # 16 tokens of tiny()'s 97


def passes_agree(model, T: int, lib=None) -> None:
    ids = torch.tensor([PROMPT[:T]])
    cache, ref = model.gpt.new_cache(1, T + 3), model.gpt.new_cache(1, T + 3)
    with torch.no_grad():
        assert fast_step.prompt_why_not(model, ids, None, cache, fast_step.why_not(model, 1, None, cache)) is None
        before, before_values = cache.keys._version, cache.values._version
        got = fast_step.FastPrompt(model, T, lib=lib)(ids, cache)
        want = model.gpt(ids, past_key_values=ref, use_cache=True)["last_hidden_state"][:, -1]
    assert got.shape == want.shape == (1, model.config.n_embd)
    torch.testing.assert_close(got, want, **TOL)
    assert cache.length == ref.length == T
    torch.testing.assert_close(cache.keys[:, :, :, :T], ref.keys[:, :, :, :T], **TOL)
    torch.testing.assert_close(cache.values[:, :, :, :T], ref.values[:, :, :, :T], **TOL)
    # written through data_ptr(), counted as torch counts an in-place write
    assert cache.keys._version > before and cache.values._version > before_values


@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("T", [1, 2, 5, 8, 9, 12, 16])
def test_the_pass_is_the_layers_pass(monkeypatch, form, T):
    """1-8 tokens: the kernel's few-row products; 9-16: its product of many rows (the tests run without the plan:
    its row count set here). A key or value written to another place, a causal mask off by one, or the final norm
    of another row moves the results by far more than the tolerance."""
    monkeypatch.setenv(rows.PROMPT_ENV, "16")
    passes_agree(tiny(), T, lib=avx2_or_skip() if form == "avx2" else None)


@pytest.mark.parametrize("overrides", [dict(n_head=2), dict(n_embd=128, n_head=2, n_layer=1), dict(bias=False)])
def test_other_shapes_and_no_biases(monkeypatch, overrides):
    """Head sizes of 32 and 64, one layer, no biases (null pointers the pass must skip)."""
    monkeypatch.setenv(rows.PROMPT_ENV, "16")
    for T in (3, 11):
        passes_agree(tiny(**overrides), T)


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8"])
@pytest.mark.parametrize("sample", [False, True])
def test_generate_gives_the_tokens_of_the_layers_pass(monkeypatch, quantize, sample):
    """Prompts of 1 to 16 tokens, greedy and sampled (a seeded generator): the same tokens with the pass as with
    GPT2_PROMPT_PASS=0, in every quantized mode the pass serves (their prompts' products: the layers' weights)."""
    monkeypatch.setenv(rows.PROMPT_ENV, "16")
    model = tiny()
    for T in (1, 2, 7, 9, 16):
        ids = torch.tensor([PROMPT[:T]])
        outs = []
        for setting in ("1", "0"):
            monkeypatch.setenv(fast_step.PROMPT_ENV, setting)
            outs.append(generate(model, ids, max_new_tokens=6, do_sample=sample, top_k=20,
                                 generator=torch.Generator().manual_seed(T), quantize=quantize))
        assert torch.equal(outs[0], outs[1]), (T, quantize)


def test_beam_search_gives_the_beams_of_the_layers_pass(monkeypatch):
    model, ids = tiny(), torch.tensor([PROMPT[:6]])
    outs = []
    for setting in ("1", "0"):
        monkeypatch.setenv(fast_step.PROMPT_ENV, setting)
        outs.append(beam_search(model, ids, num_beams=3, max_new_tokens=5))
    assert torch.equal(outs[0], outs[1])


def test_prefill_takes_the_pass_where_it_can_and_tells_the_step_why_not(monkeypatch):
    """prefill runs the pass (the layers are not called) and hands on why_not's answer for the decode step."""
    monkeypatch.setenv(rows.PROMPT_ENV, "16")
    model = tiny()
    calls = []
    model.gpt.gpt_layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.tensor([PROMPT[:5]])
    start = prefill(model, ids, None, 2)
    assert calls == [1] and start.step == "forward hooks on the model's modules (the step calls none of them)"
    model = tiny()
    start = prefill(model, ids, None, 2)
    assert start.step is None and start.cache.length == 5
    with torch.no_grad():
        want = model.gpt(ids)["last_hidden_state"][:, -1]
    torch.testing.assert_close(start.hidden, want, **TOL)
    original = model.gpt.forward
    model.gpt.forward = lambda *a, **k: pytest.fail("the layers ran")  # the pass, not the forward
    try:
        prefill(model, ids, None, 2)
    finally:
        model.gpt.forward = original


def test_each_prompt_it_leaves_to_the_layers_is_named(monkeypatch):
    monkeypatch.setenv(rows.PROMPT_ENV, "16")
    model = tiny()
    ids = torch.tensor([PROMPT[:5]])

    def why(ids_=ids, key_mask=None, model_=model, cache=None):
        cache = cache or model_.gpt.new_cache(ids_.shape[0], ids_.shape[1] + 2)
        return fast_step.prompt_why_not(model_, ids_, key_mask, cache, fast_step.why_not(model_, ids_.shape[0],
                                                                                         key_mask, cache))

    assert why() is None
    assert why(ids.repeat(2, 1)) == "2 rows (the pass runs one sequence)"
    mask = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    assert why(key_mask=mask) == "1 rows with padding (the pass runs one sequence)"
    used = model.gpt.new_cache(1, 9)
    used.advance(1)
    assert why(cache=used) == "a cache that is not empty or not fp32"
    bf16 = tiny().to(torch.bfloat16)
    assert why(model_=bf16) == "a cache that is not empty or not fp32"
    assert why(torch.tensor([PROMPT + [1]])) == "17 tokens (past the rows the kernel takes for a prompt's products: 16)"
    monkeypatch.setenv(rows.PROMPT_ENV, "0")
    assert why(torch.tensor([PROMPT[:9]])).startswith("9 tokens (past the rows")
    assert why(torch.tensor([PROMPT[:8]])) is None  # 8 rows: the few-row products, whatever the setting
    monkeypatch.setenv(rows.PROMPT_ENV, "16")
    with quantized_weights(model, "int8"):
        assert why(torch.tensor([PROMPT[:1]])) == "a prompt whose products take the quantized copies"
        assert why(torch.tensor([PROMPT[:9]])) is None  # weight-only: a prompt's products read the layers' weights
    with quantized_weights(model, "w8a8"):
        assert why(torch.tensor([PROMPT[:8]])) is None
        assert why(torch.tensor([PROMPT[:9]])) == "a prompt whose products take the quantized copies"
    width = rows._load().rows_vector_width()
    odd = tiny(n_embd=width * 3, n_head=6)  # head size width / 2
    assert why(model_=odd) == f"a head size of {width // 2} (prompt attention takes multiples of the vector width)"
    monkeypatch.setenv(prompt_attention.ENV, "0")
    assert why() == f"prompt attention is off ({prompt_attention.ENV}=0)"  # its attention is that kernel's
    monkeypatch.delenv(prompt_attention.ENV)
    monkeypatch.setenv(fast_step.ENV, "0")
    assert why() == f"{fast_step.ENV}=0"  # what the step needs, the pass needs
    monkeypatch.delenv(fast_step.ENV)
    monkeypatch.setenv(fast_step.PROMPT_ENV, "0")
    assert why() == f"{fast_step.PROMPT_ENV}=0"


def test_one_token_takes_the_plans_one_row_form_and_more_the_prompts_library(monkeypatch):
    """As a decode step's products: one row the form the decode plan chose for fp32, 2+ rows the prompt's library."""
    asked, real = [], rows.library_step
    monkeypatch.setattr(rows, "library_step", lambda kind, n: asked.append((kind, n)) or real(kind, n))
    model = tiny()
    fast_step.FastPrompt(model, 1)
    fast_step.FastPrompt(model, 5)
    assert asked == [("fp32", 1), ("fp32", 5)]


def test_head_sizes_up_to_prompt_attentions_largest(monkeypatch):
    width = rows._load().rows_vector_width()
    for head, taken in ((prompt_attention.MAX_HEAD, True), (prompt_attention.MAX_HEAD + width, False)):
        model = tiny(n_embd=head, n_head=1, n_layer=1)
        ids = torch.tensor([PROMPT[:3]])
        cache = model.gpt.new_cache(1, 5)
        assert (fast_step.prompt_why_not(model, ids, None, cache, None) is None) is taken, head
    passes_agree(tiny(n_embd=prompt_attention.MAX_HEAD, n_head=1, n_layer=1), 3)


def test_the_pass_keeps_to_the_prompt_kernels_rows(monkeypatch):
    """Past onednn.kernel_rows() a prompt's products take oneDNN in the layers, so the pass leaves it to them."""
    monkeypatch.delenv(rows.PROMPT_ENV, raising=False)
    monkeypatch.setattr(rows, "prompt_rows", lambda: 64)
    monkeypatch.setattr(onednn, "kernel_rows", lambda: 16)
    model = tiny()
    for T, taken in ((16, True), (17, False), (32, False)):
        ids = torch.tensor([(PROMPT * 2 + [1])[:T]])
        cache = model.gpt.new_cache(1, T + 2)
        assert (fast_step.prompt_why_not(model, ids, None, cache, None) is None) is taken, T


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_token_ids_of_every_integer_dtype_forward_takes(dtype):
    """forward takes ids in any integer dtype (models/gpt2.py INTEGER_DTYPES); the pass reads them as ids too (a uint8
    tensor indexing a weight would be a mask)."""
    model, ids = tiny(), torch.tensor([PROMPT[:6]])
    want = generate(model, ids, max_new_tokens=4)[:, 6:]
    assert torch.equal(generate(model, ids.to(dtype), max_new_tokens=4)[:, 6:], want)


def test_bad_token_ids_are_the_forwards_error():
    model = tiny()
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 97\)"):
        generate(model, torch.tensor([[3, 97, 5]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 97\)"):
        generate(model, torch.tensor([[3, -1, 5]]), max_new_tokens=2)


def test_a_failing_pass_names_its_code():
    model = tiny()
    cache = model.gpt.new_cache(1, 6)
    pass_ = fast_step.FastPrompt(model, 4)
    pass_.tokens = 7  # more tokens than the cache holds: rows.cpp refuses (-3), nothing written
    with pytest.raises(RuntimeError, match=r"the C\+\+ prompt pass failed \(code -3\)"):
        pass_(torch.tensor([PROMPT[:7]]), cache)
    assert cache.length == 0
