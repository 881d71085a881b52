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
from modules import onednn, prompt_attention, quant, rows
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
        monkeypatch.setenv(quant.PROMPT_ENV, "0")  # the prompt's int8 products off: the layers' float weights
        assert why(torch.tensor([PROMPT[:8]])) is None  # 2-8 tokens: the pass's fp32 products
        assert why(torch.tensor([PROMPT[:9]])) == "a prompt whose products take the quantized copies"
        monkeypatch.delenv(quant.PROMPT_ENV)
        if quant.prompt_products_why_not() is None:  # on: 2 to INT8_PROMPT_TOKENS tokens, the pass's int8 products
            assert why(torch.tensor([PROMPT[:9]])) is None
            longest = fast_step.INT8_PROMPT_TOKENS
            assert why(torch.tensor([[1] * longest])) is None
            assert why(torch.tensor([[1] * (longest + 1)])) == f"{longest + 1} tokens (past the rows the kernel " \
                                                               "takes for a prompt's products: 16)"
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


# ---- the pass's int8 products (w8a8 / w4a8 prompts of 2+ tokens) ---------------------------------------------------

def int8_reference(x: torch.Tensor, w8: quant.Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The prompt's int8 product in exact integers (float64 for the last line): x quantized per tensor by torch's ops
    (quantize_prompt_activations without the kernel), (q - zp) w^T, times both scales, plus bias."""
    q, scale, zp = quant.quantize_prompt_activations(x, lib=False)
    sums = (q.long() - zp) @ w8.q.long().t()
    y = sums.double() * scale * w8.scale.double().reshape(1, -1)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("form", ["native", "avx2"])
def test_the_int8_prompt_product_is_the_exact_integer_product(form):
    """rows_qgemm against int8_reference for row counts around each form's passes (8 rows VNNI, 4 AVX2, 32 AMX) and
    output counts around the 16-row tiles, with and without a bias, to fp32 rounding of the last line (2e-6 of the
    output's scale); against the layers' path (oneDNN's int8 GEMM) likewise; a NaN or an infinity gives -4, nothing
    written; an input width not a multiple of 4 is refused at packing."""
    lib = avx2_or_skip() if form == "avx2" else rows._load()
    g = torch.Generator().manual_seed(0)
    for out, width in ((40, 64), (16, 96), (7, 32), (33, 128)):
        w8 = quant.quantize(torch.randn(out, width, generator=g), "w8a8")
        packed = torch.empty(lib.rows_qgemm_bytes(out, width), dtype=torch.int8)
        assert lib.rows_qgemm_pack(w8.q.data_ptr(), out, width, packed.data_ptr()) == 0
        scale = w8.scale.float().reshape(-1).contiguous()
        for n in (1, 3, 4, 8, 9, 13, 17, 33):
            x = torch.randn(n, width, generator=g) * 3 + 0.5  # lo < 0 < hi: a zero point inside
            for bias in (None, torch.randn(out, generator=g)):
                y = torch.full((n, out), 7.0)
                assert lib.rows_qgemm(n, x.data_ptr(), width, packed.data_ptr(), scale.data_ptr(),
                                      None if bias is None else bias.data_ptr(), y.data_ptr(), out, 2) == 0
                want = int8_reference(x, w8, bias)
                torch.testing.assert_close(y.double(), want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
                if quant.prompt_products_why_not() is None:
                    layers = quant.prompt_linear(x, quant.prompt_weight(w8), bias)
                    torch.testing.assert_close(y, layers, rtol=2e-6, atol=2e-6 * want.abs().max().item())
        for bad in (float("nan"), float("inf")):
            x = torch.randn(9, width, generator=g)
            x[4, 5] = bad
            y = torch.full((9, out), 7.0)
            assert lib.rows_qgemm(9, x.data_ptr(), width, packed.data_ptr(), scale.data_ptr(), None, y.data_ptr(),
                                  out, 2) == -4
            assert bool((y == 7.0).all())
    odd = torch.zeros(4, 30, dtype=torch.int8)
    assert lib.rows_qgemm_pack(odd.data_ptr(), 4, 30, torch.empty(1000, dtype=torch.int8).data_ptr()) == -2


def test_the_amx_tiles_give_the_vnni_forms_outputs_to_the_bit(monkeypatch):
    """Where the native build has AMX-INT8 (and Linux grants the tiles), rows_qgemm's tile form against the same
    build's VNNI form (GPT2_PROMPT_AMX=0): equal to the bit for row counts around the activation tiles (16 rows) and
    passes (32), output counts around the weight tiles (one, a pair, a pair and a lone tile, partial ones), bias or
    not; inputs not a multiple of 64 (a tile's depth) keep the VNNI form, and GPT2_PROMPT_AMX=0 turns it off."""
    lib = rows._load()
    if not lib.rows_qgemm_amx(64):
        pytest.skip("no AMX-INT8 tiles here (the CPU, the compiler, Linux's grant or GPT2_PROMPT_AMX=0)")
    assert lib.rows_qgemm_amx(128) == 1 and lib.rows_qgemm_amx(96) == 0 and lib.rows_qgemm_amx(32) == 0
    g = torch.Generator().manual_seed(5)
    for out, width in ((16, 64), (32, 128), (48, 64), (7, 192), (50, 768)):
        w = torch.randint(-127, 128, (out, width), dtype=torch.int8, generator=g)
        packed = torch.empty(lib.rows_qgemm_bytes(out, width), dtype=torch.int8)
        assert lib.rows_qgemm_pack(w.data_ptr(), out, width, packed.data_ptr()) == 0
        scale = torch.rand(out, generator=g) + 0.01
        for n in (1, 15, 16, 17, 32, 33, 47, 70):
            x = torch.randn(n, width, generator=g) * 2 - 0.3
            for bias in (None, torch.randn(out, generator=g)):
                ys = []
                for setting in ("1", "0"):
                    monkeypatch.setenv("GPT2_PROMPT_AMX", setting)
                    y = torch.full((n, out), float("nan"))
                    assert lib.rows_qgemm(n, x.data_ptr(), width, packed.data_ptr(), scale.data_ptr(),
                                          None if bias is None else bias.data_ptr(), y.data_ptr(), out, 2) == 0
                    ys.append(y)
                assert torch.equal(ys[0], ys[1]), (out, width, n, bias is None)
    monkeypatch.setenv("GPT2_PROMPT_AMX", "0")
    assert lib.rows_qgemm_amx(64) == 0


def packed_reference(w: torch.Tensor) -> torch.Tensor:
    """rows_qgemm_pack's bytes written out in torch: tiles of 16 output rows (rows past the last zero), 64 bytes per 4
    inputs (output j's 4 weights at 4j), the tiles in pairs interleaved per 4 inputs (the last pair may hold one
    tile), then each row's int32 sum."""
    out, width = w.shape
    tiles = -(-out // 16)
    padded = torch.zeros(tiles * 16, width, dtype=torch.int8)
    padded[:out] = w
    quads = padded.view(tiles, 16, width // 4, 4).permute(0, 2, 1, 3).reshape(tiles, width // 4, 64)  # (tile, k, 64)
    parts = [quads[t:t + 2].transpose(0, 1).reshape(-1) for t in range(0, tiles, 2)]  # a pair: k-major, tiles inside
    sums = w.long().sum(dim=1).int()
    return torch.cat(parts + [sums.view(torch.int8)])


@pytest.mark.parametrize("form", ["native", "avx2"])
def test_every_build_packs_the_int8_weight_alike(form):
    """The packed int8 weight is one layout in every build (a copy made by one build's library is read by another's:
    prompt_packed caches it on the layer): the pairs of interleaved tiles of packed_reference, for output counts of
    one tile, a pair, a pair and a lone tile, and partial tiles."""
    lib = avx2_or_skip() if form == "avx2" else rows._load()
    g = torch.Generator().manual_seed(3)
    for out, width in ((16, 8), (32, 12), (40, 8), (7, 4), (65, 16)):
        w = torch.randint(-127, 128, (out, width), dtype=torch.int8, generator=g)
        packed = torch.full((lib.rows_qgemm_bytes(out, width),), 99, dtype=torch.int8)
        assert lib.rows_qgemm_pack(w.data_ptr(), out, width, packed.data_ptr()) == 0
        assert torch.equal(packed, packed_reference(w)), (out, width)


needs_int8_prompt = pytest.mark.skipif(quant.prompt_products_why_not() is not None,
                                       reason=f"the prompt's int8 products are off: {quant.prompt_products_why_not()}")


@needs_int8_prompt
@pytest.mark.parametrize("mode,T,form", [("w8a8", 2, "native"), ("w8a8", 9, "native"), ("w8a8", 16, "native"),
                                         ("w4a8", 5, "native"), ("w4a8", 12, "native"), ("w8a8", 13, "avx2"),
                                         ("w4a8", 3, "avx2")])
def test_a_w8a8_prompt_of_2_tokens_or_more_takes_the_passs_int8_products(mode, T, form):
    """The pass's int8 products (kind 6) against the layers' pass in the same quantized mode (oneDNN's int8 GEMM,
    the same integers and activation scale): hidden states, keys and values within A8-style room for an activation
    that rounds the other way (LayerNorm in double against torch's), far below fp32 weights' distance; the pass read
    the packed copies (made on the layers, kept for the next call)."""
    model = tiny(n_embd=64)
    ids = torch.tensor([PROMPT[:T]])
    with torch.no_grad(), quantized_weights(model, mode):
        assert fast_step.takes_int8_prompt(model.gpt.gpt_layers[0].self_attention.query.quantized, T)
        cache, ref = model.gpt.new_cache(1, T + 2), model.gpt.new_cache(1, T + 2)
        got = fast_step.FastPrompt(model, T, lib=avx2_or_skip() if form == "avx2" else None)(ids, cache)
        want = model.gpt(ids, past_key_values=ref, use_cache=True)["last_hidden_state"][:, -1]
        layer = model.gpt.gpt_layers[0].interm_dense
        kept = layer.__dict__["_prompt_packed"]
        assert kept[0] == layer.__dict__["_quantized_cache"][0]
        fast_step.FastPrompt(model, T)  # a second pass: the same packed copy
        assert layer.__dict__["_prompt_packed"] is kept
    fp32_ref = model.gpt.new_cache(1, T + 2)
    with torch.no_grad():
        fp32 = model.gpt(ids, past_key_values=fp32_ref, use_cache=True)["last_hidden_state"][:, -1]
    room = dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(got, want, **room)
    torch.testing.assert_close(cache.keys[:, :, :, :T], ref.keys[:, :, :, :T], **room)
    torch.testing.assert_close(cache.values[:, :, :, :T], ref.values[:, :, :, :T], **room)
    assert (got - want).abs().max() < (fp32 - want).abs().max() / 4  # the int8 products, not the float weights
    quant.clear(model)  # the packed copies are dropped with the rest
    assert not any("_prompt_packed" in m.__dict__ for m in model.modules())


def test_with_the_int8_products_off_a_w8a8_prompt_in_the_pass_reads_the_float_weights(monkeypatch):
    """GPT2_PROMPT_INT8=0: a w8a8 / w4a8 prompt of 2-8 tokens still takes the pass, with the layers' float weights
    (as the layers' pass then takes them): the fp32 pass's numbers, no packed copy made."""
    monkeypatch.setenv(quant.PROMPT_ENV, "0")
    model = tiny(n_embd=64)
    ids = torch.tensor([PROMPT[:5]])
    with torch.no_grad():
        plain = fast_step.FastPrompt(model, 5)(ids, model.gpt.new_cache(1, 7))
        for mode in ("w8a8", "w4a8"):
            with quantized_weights(model, mode):
                cache = model.gpt.new_cache(1, 7)
                assert fast_step.prompt_why_not(model, ids, None, cache, None) is None
                prompt = fast_step.FastPrompt(model, 5)
                assert not prompt.int8
                torch.testing.assert_close(prompt(ids, cache), plain, rtol=0, atol=0)
            assert not any("_prompt_packed" in m.__dict__ for m in model.modules())


@needs_int8_prompt
def test_activations_the_int8_products_cannot_quantize_go_through_the_layers(monkeypatch):
    """An infinite embedding makes the first LayerNorm's output NaN: the pass's int8 product returns -4, the pass
    gives None with the cache still empty, and generate's prompt goes through the layers (whose products take the
    float weights for it): the same tokens as with the pass off."""
    model = tiny(n_embd=64)
    with torch.no_grad():
        model.gpt.word_embedding.weight[PROMPT[3]] = float("inf")
    ids = torch.tensor([PROMPT[:12]])
    with torch.no_grad(), quantized_weights(model, "w8a8"):
        cache = model.gpt.new_cache(1, 14)
        assert fast_step.FastPrompt(model, 12)(ids, cache) is None
        assert cache.length == 0
    outs = []
    for setting in ("1", "0"):
        monkeypatch.setenv(fast_step.PROMPT_ENV, setting)
        outs.append(generate(model, ids, max_new_tokens=3, quantize="w8a8"))
    assert torch.equal(outs[0], outs[1])
