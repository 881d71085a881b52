"""Weight-only int8 and int4, and both with int8 activations (modules/quant.py), and
generate(quantize="int8" | "int4" | "w8a8" | "w4a8")."""
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import need_inductor

import models.generation as generation_module
import modules.linear as linear_module
import modules.quant as quant
from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from modules import rows as row_kernel
from modules.linear import Linear, quantized_weights
from modules.quant import (
    Int4Weight,
    int4_linear,
    int8_linear,
    prepared_quantized,
    quantize,
    quantize_int4,
    quantize_int8,
    quantized_linear,
)

MODES = list(quant.QUANTIZE_MODES)  # int8, int4, w8a8, w4a8
FOUR_BIT = ("int4", "w4a8")


@pytest.fixture
def eager_int8(monkeypatch):
    """The eager products everywhere (int8: dequantized or the eager loop; int4: the dequantized weight, whose
    warning is expected): compiling gpt2's shapes takes minutes under load (one test compiles); the rows kernel is
    left out too (its own tests: test_generate_with_the_rows_kernel_... and test_rows_kernel.py)."""
    monkeypatch.setattr(quant, "_compiled_gemv", False)
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)
    monkeypatch.setattr(quant, "_warned_int4", True)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=64)).eval()


def test_quantize_int8_rounds_each_row_to_half_a_step():
    w = torch.randn(16, 24)
    w[3] = 0.0  # an all-zero row must not divide by zero
    w8 = quantize_int8(w)
    assert w8.q.dtype == torch.int8 and w8.scale.shape == (16,)
    assert int(w8.q.abs().max()) == 127  # each row's largest entry maps to +-127
    err = (w8.dequantize() - w).abs()
    assert bool((err <= w8.scale[:, None] / 2 + 1e-7).all())
    assert torch.equal(w8.dequantize()[3], torch.zeros(24)) and w8.scale[3] == 1.0 and not w8.q[3].any()  # scale 1
    assert w8.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_a_copy_kept_under_the_default_name_is_found_again_and_cleared_with_the_others():
    """cached_quantized without a name keeps its copy where quant.clear looks (CACHE_NAMES): the same copy while the
    weight is unchanged, a new one after an in-place write, none left after clear."""
    owner, w = torch.nn.Module(), torch.randn(8, 32)
    first = quant.cached_quantized(owner, w, "int8")
    assert quant.cached_quantized(owner, w, "int8") is first
    w.mul_(2.0)
    assert quant.cached_quantized(owner, w, "int8") is not first
    assert quant.clear(owner) == 1 and quant.clear(owner) == 0


def test_rows_of_very_different_magnitudes_each_keep_their_own_precision():
    """Per-row scales: a row 1000x smaller than another is quantized as finely as the large one, relative to its
    own size (one scale for the whole tensor would round the small rows to a few levels or to zero)."""
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e3, 1.0, 1e-3, 30.0, 1e-1])
    w = torch.randn(5, 64, generator=g) * magnitudes[:, None]
    w8 = quantize_int8(w)
    assert torch.equal(w8.q.abs().amax(dim=1), torch.full((5,), 127, dtype=torch.int8))  # every row uses the range
    row_err = (w8.dequantize() - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert bool((row_err <= 0.5 / 127 + 1e-6).all()), row_err  # half a step of its own row's range, on every row
    x = torch.randn(1, 64, generator=g)
    y, exact = int8_linear(x, w8, compiled=False), F.linear(x, w)
    bound = x.abs().sum() * w8.scale / 2  # each output: half a step of its own row per product term, at most
    assert bool(((y - exact).abs() <= bound * 1.001 + 1e-6).all()), ((y - exact).abs(), bound)


def test_quantize_int8_rejects_bad_weights():
    with pytest.raises(ValueError, match="2-d"):
        quantize_int8(torch.randn(4))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_int8(torch.ones(4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="features"):
        int8_linear(torch.randn(1, 5), quantize_int8(torch.randn(3, 4)))


def test_quantize_int4_rounds_each_group_to_half_a_step():
    """Groups of 32 along in_features, each with its own scale max|group| / 7: every dequantized weight within half
    a step of its group (scale / 2), values in -7..7 with +-7 reached in every group, an all-zero group exactly zero,
    and groups 1000x apart in magnitude each as fine as their own size allows."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 128, generator=g) * torch.tensor([1e3, 1.0, 1e-3, 30.0])[None, :].repeat_interleave(32, 1)
    w[2, 32:64] = 0.0
    w4 = quantize_int4(w)
    assert w4.q.dtype == torch.uint8 and w4.q.shape == (6, 64) and w4.scale.shape == (6, 4) and w4.group == 32
    assert w4.nbytes == 6 * 64 + 6 * 4 * 4
    v = w4.values()
    assert v.dtype == torch.int8 and int(v.min()) >= -7 and int(v.max()) <= 7
    group_max = v.view(6, 4, 32).abs().amax(-1)
    assert bool((group_max == 7).sum() == 6 * 4 - 1) and int(group_max[2, 1]) == 0  # the zero group: scale 1, q 0
    err = (w4.dequantize() - w).view(6, 4, 32).abs()
    assert bool((err <= w4.scale[:, :, None] / 2 * (1 + 1e-6)).all()), (err.amax(-1), w4.scale / 2)
    assert torch.equal(w4.dequantize()[2, 32:64], torch.zeros(32)) and w4.scale[2, 1] == 1.0
    assert w4.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(quantize_int4(w.double()).q, w4.q)  # any float weight, its scales fp32
    assert quantize_int4(w.bfloat16()).scale.dtype == torch.float32


def test_int4_packing_is_the_documented_layout():
    """Byte k of block j of a row: column 32j + k in the low nibble, column 32j + 16 + k in the high one, 4-bit two's
    complement; -8 (never written by quantize_int4) reads back as -8 * scale."""
    v = torch.tensor([(c * 5) % 15 - 7 for c in range(64)], dtype=torch.float32)[None]  # every value of -7..7
    w4 = quantize_int4(v)
    assert torch.equal(w4.scale, torch.ones(1, 2)) and torch.equal(w4.values(), v.to(torch.int8))
    for j in range(2):
        for k in range(16):
            low, high = int(v[0, 32 * j + k]), int(v[0, 32 * j + 16 + k])
            assert int(w4.q[0, 16 * j + k]) == (low & 0xF) | ((high & 0xF) << 4)
    q = torch.full((1, 16), 0x8F, dtype=torch.uint8)  # low nibble -1, high nibble -8
    deq = Int4Weight(q, torch.tensor([[0.5]]), 32).dequantize()
    assert torch.equal(deq, torch.tensor([[-0.5] * 16 + [-4.0] * 16]))


def test_int4_groups_of_64():
    w = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    w4 = quantize_int4(w, group=64)
    assert w4.scale.shape == (3, 2) and w4.group == 64
    err = (w4.dequantize() - w).view(3, 2, 64).abs()
    assert bool((err <= w4.scale[:, :, None] / 2 * (1 + 1e-6)).all())
    torch.testing.assert_close(w4.scale, w.view(3, 2, 64).abs().amax(-1) / 7)


def test_quantize_int4_rejects_bad_weights():
    with pytest.raises(ValueError, match="2-d"):
        quantize_int4(torch.randn(64))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_int4(torch.ones(4, 64, dtype=torch.long))
    with pytest.raises(ValueError, match="in_features divisible by the group: 48 features, group 32"):
        quantize_int4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="in_features divisible by the group: 96 features, group 64"):
        quantize_int4(torch.randn(4, 96), group=64)
    for group in (16, 0, -32, 48):
        with pytest.raises(ValueError, match=f"positive multiple of 32 columns, got group={group}"):
            quantize_int4(torch.randn(4, 96), group=group)
    with pytest.raises(ValueError, match="input has 5 features, the int4 weight takes 32"):
        int4_linear(torch.randn(1, 5), quantize_int4(torch.randn(3, 32)))
    with pytest.raises(ValueError, match=r"quantize must be one of \('int8', 'int4', 'w8a8', 'w4a8'\), got 'int2'"):
        quantize(torch.randn(3, 32), "int2")


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 3, 9])  # 9: more than the rows kernel takes, the dequantized weight
def test_int4_linear_is_the_dequantized_product(rows):
    """Through the rows kernel where it builds (1 to 8 rows), else the dequantized weight: both against F.linear
    on the dequantized weight (fp32 sums in another order: rtol 1e-5, atol 1e-4); bf16 inputs stay bf16."""
    g = torch.Generator().manual_seed(rows)
    w4, bias = quantize_int4(torch.randn(13, 64, generator=g)), torch.randn(13, generator=g)
    x = torch.randn(rows, 1, 64, generator=g)
    torch.testing.assert_close(int4_linear(x, w4, bias), F.linear(x, w4.dequantize(), bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(int4_linear(x, w4), F.linear(x, w4.dequantize()), rtol=1e-5, atol=1e-4)
    y = int4_linear(x.bfloat16(), w4)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x, w4.dequantize()), atol=0.1, rtol=0.02)


@torch.no_grad()
def test_int4_without_the_kernel_dequantizes_and_warns_once(monkeypatch):
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)  # as where the kernel cannot be built
    monkeypatch.setattr(quant, "_warned_int4", False)
    w4, x = quantize_int4(torch.randn(7, 32)), torch.randn(1, 32)
    with pytest.warns(UserWarning, match="int4 decoding without the int4 kernel"):
        y = int4_linear(x, w4)
    torch.testing.assert_close(y, F.linear(x, w4.dequantize()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        int4_linear(x, w4)
    assert prepared_quantized(w4) is None


def _untied_copy_with_dequantized_weights(model, mode):
    """`model` with every Linear weight replaced by its dequantized copy and the LM head an untied Linear holding
    the dequantized embedding (the embedding lookup keeps the float table): the model generate(quantize=mode)
    multiplies by, at every product, when every product is a one-row one (a one-token prompt at batch 1)."""
    ref = GPT2LMHeadModel(dataclasses.replace(model.config, tie_word_embeddings=False)).eval()
    state = {k: v for k, v in model.state_dict().items()}
    for name, m in model.named_modules():
        if type(m) is Linear:
            state[f"{name}.weight"] = quantize(m.weight, mode).dequantize()
    state["gpt.lm_head.weight"] = quantize(model.gpt.lm_head_weight, mode).dequantize()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and missing == [], (missing, unexpected)
    return ref


@torch.no_grad()
@pytest.mark.parametrize("step", ["1", "0"])
def test_generate_int4_equals_the_model_with_dequantized_int4_weights(monkeypatch, step):
    """A tiny random GPT2LMHeadModel (weights spread so greedy choices are decisive, biases not zero) with a
    one-token prompt at batch 1, so every product is a decoding one: generate(quantize="int4") gives the greedy
    tokens of a copy whose linear weights and LM head are the dequantized int4 values, and its logits agree with
    the copy's full forward pass over the generated text to float rounding (sums of <= 128 products in another
    order: atol 1e-4, rtol 1e-4). The products ran in the rows kernel where it builds: the layers' inside the C++
    step (models/fast_step.py, GPT2_DECODE_STEP=1), or each through its prepared product (GPT2_DECODE_STEP=0)."""
    monkeypatch.setenv("GPT2_DECODE_STEP", step)
    torch.manual_seed(2)  # greedy text that changes token (tied random models tend to repeat one)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=97, n_positions=64)).eval()
    for name, p in model.named_parameters():
        p.copy_(torch.randn(p.shape) * 0.5 if name.endswith("bias") else p * (16.0 if p.dim() == 2 else 1.0))
    ids, n = torch.tensor([[5]]), 24
    logits, kernel_calls = [], []
    real_head, real_prepared = generation_module.decode_lm_head, row_kernel.prepared

    def recording_head(*a, **k):
        head = real_head(*a, **k)
        return lambda hidden: logits.append(head(hidden)) or logits[-1]

    def counted_prepared(*a, **k):
        call = real_prepared(*a, **k)
        return lambda x: kernel_calls.append(a[0].dtype) or call(x)

    monkeypatch.setattr(generation_module, "decode_lm_head", recording_head)
    monkeypatch.setattr(row_kernel, "prepared", counted_prepared)
    out = model.generate(ids, max_new_tokens=n, quantize="int4")
    steps = torch.cat(logits)  # (n, V): the logits each step chose from
    ref = _untied_copy_with_dequantized_weights(model, "int4")
    assert torch.equal(out, ref.generate(ids, max_new_tokens=n))
    torch.testing.assert_close(steps, ref(out[:, :-1])["logits"][0], atol=1e-4, rtol=1e-4)
    assert len(set(out[0].tolist())) > 4 and not torch.equal(out, model.generate(ids, max_new_tokens=n))  # not fp32's
    if row_kernel.available() and row_kernel.pays(torch.uint8, 1):
        layers = 0 if step == "1" else (n - 1) * 2 * 6  # every layer every step, unless in the C++ step
        assert kernel_calls.count(torch.uint8) == n + layers + 2 * 6  # the head, the layers, the fp32 run's prompt


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_is_the_dequantized_product(rows, eager_int8):
    w8, bias = quantize_int8(torch.randn(12, 20)), torch.randn(12)
    x = torch.randn(2, rows, 20)
    torch.testing.assert_close(int8_linear(x, w8, bias), F.linear(x, w8.dequantize(), bias))
    y = int8_linear(x.bfloat16(), w8)  # bf16 activations stay bf16
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x, w8.dequantize()), atol=0.1, rtol=0.02)


@pytest.mark.skipif(not quant.compiled_kernel_available(), reason="no SIMD capability for the compiled kernel")
def test_compiled_one_row_kernel_matches_eager():
    need_inductor()
    w8, x = quantize_int8(torch.randn(40, 32)), torch.randn(1, 32)
    y = int8_linear(x, w8, compiled=True)
    ran = quant._compiled_packed if quant.packed_form_chosen() else quant._compiled_gemv
    assert callable(ran)  # it ran: a failed compile would have set False and computed eagerly
    torch.testing.assert_close(y, int8_linear(x, w8, compiled=False))


@pytest.mark.skipif(not quant.compiled_kernel_available(), reason="no SIMD capability for the compiled kernel")
@pytest.mark.parametrize("in_features", [32, 30])  # 30: not a whole number of 4-byte words, the byte loop instead
def test_word_packed_kernel_matches_the_byte_kernel(in_features):
    """The word-packed loop unpacks byte k of word j as q[:, 4j + k] with its sign: weights at +-127 and small
    negatives catch a wrong byte order or a zero-extension."""
    need_inductor()
    w = torch.randn(40, in_features)
    w[0, :] = torch.linspace(-1, 1, in_features)
    w8, x = quantize_int8(w), torch.randn(1, in_features)
    assert bool((w8.q < 0).any()) and int(w8.q.max()) == 127 and int(w8.q.min()) == -127
    eager = int8_linear(x, w8, compiled=False)
    torch.testing.assert_close(int8_linear(x, w8, compiled=True, packed=True), eager)
    torch.testing.assert_close(int8_linear(x, w8, compiled=True, packed=False), eager)
    if in_features % 4 == 0:
        assert callable(quant._compiled_packed)


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_generate_quantized_decodes_with_quantized_steps_after_a_float_prompt(mode, eager_int8, monkeypatch):
    """Batch 1: the prompt through the float weights, then every step's linear layers and the head from the int8
    or int4 weights (= their dequantized values); the layers are back to their own weights afterwards. The
    products of torch's decode step are hooked here (GPT2_DECODE_STEP=0; the C++ step: tests/test_fast_step.py)."""
    monkeypatch.setenv("GPT2_DECODE_STEP", "0")
    model, n = tiny_model(), 12
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    calls = []  # quantized products, counted: equal tokens alone cannot tell int8 from fp32 on a tiny model
    counted = lambda *a, **k: calls.append(type(a[1])) or quantized_linear(*a, **k)  # noqa: E731
    monkeypatch.setattr(linear_module, "quantized_linear", counted)
    monkeypatch.setattr(generation_module, "quantized_linear", counted)
    out = model.generate(ids, max_new_tokens=n, quantize=mode)
    assert len(calls) == n + (n - 1) * 2 * 6  # the head every step, 6 linears per layer in each step after the first
    assert set(calls) == {Int4Weight if mode in FOUR_BIT else quant.Int8Weight}

    ref = tiny_model()
    acts = quant.quantize_activations if mode.endswith("a8") else (lambda x: x)  # w8a8, w4a8: int8 activations
    for m in ref.modules():
        if type(m) is Linear:
            deq = quantize(m.weight, mode).dequantize()  # one-row inputs (the steps) take it, the prompt does not
            m.register_forward_hook(lambda mod, inp, y, w=deq: F.linear(acts(inp[0]), w, mod.bias)
                                    if inp[0].shape[:-1].numel() == 1 else None)
    head = quantize(ref.gpt.lm_head_weight, mode).dequantize()
    cache = ref.gpt.new_cache(1, 6 + n)
    hidden = ref.gpt(ids, None, None, cache, use_cache=True)["last_hidden_state"][:, -1]
    tokens = [ids]
    for step in range(n):
        tokens.append(F.linear(acts(hidden), head).argmax(-1, keepdim=True))
        hidden = ref.gpt.decode_step(tokens[-1], torch.tensor([[6 + step]]), None, cache)
    assert torch.equal(out, torch.cat(tokens, 1))
    assert all(m.quantized is None for m in model.modules() if type(m) is Linear)
    assert torch.equal(model.generate(ids, max_new_tokens=n), tiny_model().generate(ids, max_new_tokens=n))


@pytest.mark.parametrize("mode", MODES)
def test_quantized_decoding_leaves_batches_and_prompts_to_the_float_weights(mode, eager_int8):
    model = tiny_model()
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model.generate(ids, max_new_tokens=6, quantize=mode), model.generate(ids, max_new_tokens=6))


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_quantized_copies_are_reused_and_remade_when_weights_change(mode, eager_int8):
    """Layers and the LM head: a copy is kept between calls, and made again after an in-place update of the weight
    (an optimizer step) or when the other mode is asked for."""
    model = tiny_model()
    layer = next(m for m in model.modules() if type(m) is Linear)
    ids = torch.zeros(1, 2, dtype=torch.long)
    with quantized_weights(model, mode):
        first = layer.quantized
    model.generate(ids, max_new_tokens=2, quantize=mode)
    head = model.gpt.__dict__["_quantized_head"][1]
    with quantized_weights(model, mode):
        assert layer.quantized is first  # kept between calls
    model.generate(ids, max_new_tokens=2, quantize=mode)
    assert model.gpt.__dict__["_quantized_head"][1] is head
    layer.weight.mul_(2.0)
    model.gpt.word_embedding.weight.mul_(2.0)  # the tied LM head
    with quantized_weights(model, mode):
        assert layer.quantized is not first
        torch.testing.assert_close(layer.quantized.dequantize(), quantize(layer.weight, mode).dequantize())
    assert layer.quantized is None
    model.generate(ids, max_new_tokens=2, quantize=mode)
    torch.testing.assert_close(model.gpt.__dict__["_quantized_head"][1].dequantize(),
                               quantize(model.gpt.word_embedding.weight, mode).dequantize())
    for other in MODES:  # another mode replaces the copy (w8a8 and int8: the same type, another flag)
        if other != mode:
            with quantized_weights(model, other):
                assert type(layer.quantized) is type(quantize(layer.weight, other))
                assert layer.quantized.int8_activations == other.endswith("a8")


def test_quantized_weights_leave_training_alone():
    model = tiny_model()
    layer = next(m for m in model.modules() if type(m) is Linear)
    x = torch.randn(2, 3, layer.in_features)
    with quantized_weights(model):
        y = layer(x[:1, :1])  # one row, but grad enabled: the fp32 weight, so gradients reach it
    assert torch.equal(y, F.linear(x[:1, :1], layer.weight, layer.bias))
    y.sum().backward()
    assert layer.weight.grad is not None


def test_quantize_argument_is_checked():
    model, ids = tiny_model(), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"quantize must be None or one of \('int8', 'int4', 'w8a8', 'w4a8'\), "
                                         r"got 'int3'"):
        model.generate(ids, max_new_tokens=2, quantize="int3")
    for mode in MODES:
        with pytest.raises(ValueError, match="not to beam search"):
            model.generate(ids, max_new_tokens=2, num_beams=2, quantize=mode)


def test_int4_names_the_layer_whose_inputs_do_not_divide_into_groups():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=48, vocab_size=97, n_positions=16)).eval()
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"quantize='int4': the LM head: .*48 features, group 32"):
        model.generate(ids, max_new_tokens=2, quantize="int4")
    with pytest.raises(ValueError, match=r"quantize='int4': layer gpt\.gpt_layers\.0\..*48 features, group 32"):
        with quantized_weights(model, "int4"):
            pass
    assert all(m.quantized is None for m in model.modules() if type(m) is Linear)


@torch.no_grad()
@pytest.mark.skipif(not row_kernel.available(), reason="the rows kernel cannot be built here")
@pytest.mark.parametrize("mode", MODES)
def test_generate_with_the_rows_kernel_equals_the_eager_quantized_decode(mode, monkeypatch):
    """Where the rows kernel takes int8 or int4 decoding (prepared products for every layer and the head), generate
    gives the tokens of the eager path (int4: the dequantized weights), and the prepared products really ran (in
    torch's decode step, GPT2_DECODE_STEP=0: the C++ step's own products are tests/test_fast_step.py's)."""
    monkeypatch.setenv("GPT2_DECODE_STEP", "0")
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))

    def biased_model():  # biases that are not zero, so a product that dropped one would show
        model = tiny_model()
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        return model

    monkeypatch.setattr(quant, "_compiled_gemv", False)
    monkeypatch.setattr(quant, "_warned_int4", True)
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)
    eager = biased_model().generate(ids, max_new_tokens=12, quantize=mode)
    monkeypatch.setattr(row_kernel, "pays",
                        lambda dtype, rows: dtype == (torch.uint8 if mode in FOUR_BIT else torch.int8))
    made, calls = [], []
    real = row_kernel.prepared

    def counted_prepared(*a, **k):
        call = real(*a, **k)
        made.append(a[0].shape)
        return lambda x: calls.append(x.shape) or call(x)

    monkeypatch.setattr(row_kernel, "prepared", counted_prepared)
    model = biased_model()
    assert torch.equal(model.generate(ids, max_new_tokens=12, quantize=mode), eager)
    assert len(made) == 2 * 6 + 1 and len(calls) == 12 + 11 * 2 * 6  # the head every step, the layers after the first
    assert all(m.quantized is None and m.quantized_call is None for m in model.modules() if type(m) is Linear)
    made.clear()
    model.generate(ids, max_new_tokens=1, quantize=mode)  # no decode step: the layers' products are never prepared
    assert len(made) == 1


# ---- the generation CLIs' --quantize ------------------------------------------------------------------------------


def counting_int8(monkeypatch):
    """Records the row count of every int8 product (all must be one row: batch-1 decoding)."""
    rows = []
    counted = lambda *a, **k: rows.append(a[0].shape[:-1].numel()) or quantized_linear(*a, **k)  # noqa: E731
    monkeypatch.setattr(linear_module, "quantized_linear", counted)
    monkeypatch.setattr(generation_module, "quantized_linear", counted)
    return rows


@torch.no_grad()
def test_sample_text_int8_decodes_each_sample_alone(eager_int8, monkeypatch):
    from models.bigram import BigramConfig, BigramLM
    from tasks.char_tokenizer import CharTokenizer
    from tasks.pretrain import sample_text

    tokenizer = CharTokenizer.from_text("abcdefghij klmnop\n")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=len(tokenizer),
                                       n_positions=32)).eval()
    rows = counting_int8(monkeypatch)
    texts = sample_text(model, tokenizer, "ab", 6, num_samples=3, generator=torch.Generator().manual_seed(0),
                        quantize="int8")
    assert len(texts) == 3 and all(t.startswith("ab") and len(t) == 8 for t in texts)
    assert rows and set(rows) == {1}  # batched, the three samples would have read the float weights only
    with pytest.raises(ValueError, match="applies to GPT-2 models"):
        sample_text(BigramLM(BigramConfig(vocab_size=len(tokenizer))), tokenizer, "ab", 3, quantize="int8")


@torch.no_grad()
def test_complete_sonnets_int8_decodes_one_prompt_at_a_time(eager_int8, monkeypatch, tmp_path):
    from test_sonnet import make_bpe_tokenizer

    from tasks.sonnet import Decoding, SonnetGPT, complete_sonnets

    prompts = ["Shall I compare thee", "to a summer's day?\nThou art more", "lovely"]
    tok = make_bpe_tokenizer(tmp_path / "tok", prompts * 3)
    torch.manual_seed(0)
    model = SonnetGPT(GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=len(tok),
                                                 n_positions=64)).eval())
    greedy = Decoding(max_new_tokens=5, do_sample=False, quantize="int8")
    rows = counting_int8(monkeypatch)
    texts = complete_sonnets(model, tok, prompts, greedy, batch_size=16)
    assert rows and set(rows) == {1}
    for prompt, text in zip(prompts, texts):  # each equals that prompt decoded alone with int8 steps
        ids = torch.tensor([tok(prompt)["input_ids"]])
        new = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=tok.eos_token_id,
                             quantize="int8")[0, ids.shape[1]:].tolist()
        new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        assert text == tok.decode(ids[0].tolist() + new)
    with pytest.raises(ValueError, match="not to beam search"):
        complete_sonnets(model, tok, prompts, Decoding(max_new_tokens=5, do_sample=False, num_beams=2,
                                                       quantize="int8"))


@pytest.mark.parametrize("argv, message", [
    (["--data", "x.txt", "--arch", "bigram", "--quantize", "int8"], "--quantize applies to GPT-2 models"),
    (["--sample", "--quantize", "int3"], "invalid choice: 'int3'"),
])
def test_run_pretrain_quantize_flag_is_checked(argv, message, capsys):
    import run_pretrain

    with pytest.raises(SystemExit):
        run_pretrain.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--quantize", "int8"], "--quantize applies to --generate_only"),
    (["--generate_only", "--quantize", "int8", "--num_beams", "2"], "not to beam search"),
])
def test_run_sonnet_quantize_flag_is_checked(argv, message, capsys):
    import run_sonnet

    with pytest.raises(SystemExit):
        run_sonnet.get_args(argv)
    assert message in capsys.readouterr().err


def test_run_sonnet_int8_decoding_has_its_own_folder():
    import run_sonnet
    from tasks.sonnet import default_output_dir

    args = run_sonnet.get_args(["--generate_only", "--greedy", "--quantize", "int8"])
    assert default_output_dir(args) == "checkpoints/sonnet-generate-greedy-int8"
    assert default_output_dir(run_sonnet.get_args(["--generate_only", "--greedy"])) == \
        "checkpoints/sonnet-generate-greedy"


@pytest.mark.parametrize("compiled", [False, True])
def test_int8_linear_keeps_bf16_rows_bf16_with_an_fp32_bias(compiled):
    """bf16 activations with the layer's fp32 bias give bf16 outputs (as the docstring says), on the dequantized
    and on the compiled one-row path, equal to the fp32 product rounded to bf16."""
    w8, bias = quantize_int8(torch.randn(12, 32)), torch.randn(12)
    x = torch.randn(1, 32).bfloat16()
    y = int8_linear(x, w8, bias, compiled=compiled)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w8.dequantize(), bias), atol=0.05, rtol=0.02)


# ---- issue 40: the word-packed loop, the kernel choice, int4's fallback and messages --------------------------------


def sign_spread_int8(out_features=24, in_features=36, seed=11):
    """An int8 weight whose rows reach +-127 and hold small negatives (a wrong byte order or a zero-extension
    shows), and its float original."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    w[0] = torch.linspace(-1, 1, in_features)
    w8 = quantize_int8(w)
    assert bool((w8.q < 0).any()) and int(w8.q.max()) == 127 and int(w8.q.min()) == -127
    return w8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_word_packed_loop_run_eagerly_is_the_dequantized_product_in_fp32(dtype):
    """_gemv_packed (the loop inductor compiles on AVX2 CPUs; AVX512 CPUs never take it) reads the int8 weights four
    to a 32-bit word: one row times them equals F.linear on the dequantized weight, computed in fp32 whatever x's
    dtype (int8_linear casts the result back to it)."""
    w8 = sign_spread_int8()
    x = torch.randn(1, 36, generator=torch.Generator().manual_seed(12)).to(dtype)
    y = quant._gemv_packed(x, w8.q.view(torch.float32), w8.scale)
    assert y.dtype == torch.float32 and y.shape == (1, 24)
    torch.testing.assert_close(y, F.linear(x.float(), w8.dequantize()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_int8_one_row_products_route_to_the_kernel_they_name_without_falling_back(monkeypatch, packed):
    """compiled=True on one row takes the word-packed loop (packed=True, in_features divisible by 4) or the byte loop:
    with torch.compile standing in as the identity (the loops run eagerly, no compile time), each equals the
    dequantized product plus the bias, and no "compiled kernel failed" fallback hides an error."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    monkeypatch.setattr(quant, "_compiled_gemv", None)
    monkeypatch.setattr(quant, "_compiled_packed", None)
    monkeypatch.setattr(quant, "packed_form_chosen", lambda: False)  # no AVX2 warning for the forced packed form
    w8, bias = sign_spread_int8(), torch.randn(24)
    x = torch.randn(1, 36)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = int8_linear(x, w8, bias, compiled=True, packed=packed)
    torch.testing.assert_close(y, F.linear(x, w8.dequantize(), bias), rtol=1e-5, atol=1e-5)
    assert compiled == [{"dynamic": False}]
    assert callable(quant._compiled_packed if packed else quant._compiled_gemv)


@pytest.mark.parametrize("capability, state, expected", [
    ("AVX512", None, True),
    ("AVX2", None, True),
    ("DEFAULT", None, False),  # no SIMD: the kernel would not pay
    ("AVX512", False, False),  # it failed to compile once here: eager from then on
])
def test_one_row_int8_takes_the_compiled_kernel_with_simd_until_it_failed(monkeypatch, capability, state, expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(quant, "_compiled_gemv", state)
    monkeypatch.setattr(quant, "_compiled_packed", None)
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or fn)
    assert quant.compiled_kernel_available() is expected
    w8, x = sign_spread_int8(), torch.randn(1, 36)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = int8_linear(x, w8)
    torch.testing.assert_close(y, F.linear(x, w8.dequantize()), rtol=1e-5, atol=1e-5)
    assert len(compiled) == (1 if expected else 0)
    int8_linear(torch.randn(3, 3, 36), w8)  # several rows: the dequantized weight, never the one-row kernel
    assert len(compiled) == (1 if expected else 0)
    expected_warnings = ["int8 decoding on a CPU without AVX512"] if capability == "AVX2" else []
    assert [str(w.message)[:len("int8 decoding on a CPU without AVX512")] for w in caught] == expected_warnings


def caller_file(fn) -> str:
    """The file a warning aimed at the caller of `fn` names when this file calls it: this file, or the mutation
    tool's trampoline file when `fn` is wrapped in one (bench/mutation.py: frames in between)."""
    return fn.__code__.co_filename if hasattr(fn, "__wrapped__") else __file__


@torch.no_grad()
@pytest.mark.parametrize("rows, warns", [(row_kernel.MAX_ROWS, True), (row_kernel.MAX_ROWS + 1, False)])
def test_int4_without_the_kernel_warns_for_decoding_rows_at_their_caller(monkeypatch, rows, warns):
    """Without the kernel, 1 to MAX_ROWS rows (decoding) warn once, naming the slow path, at int4_linear's caller;
    more rows (a prompt) do not warn: torch's products are the right ones there."""
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)
    monkeypatch.setattr(quant, "_warned_int4", False)
    w4, x = quantize_int4(torch.randn(7, 32)), torch.randn(rows, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = int4_linear(x, w4)
    torch.testing.assert_close(y, F.linear(x, w4.dequantize()))
    assert len(caught) == (1 if warns else 0)
    if warns:
        message = str(caught[0].message)
        assert message.startswith("int4 decoding without the int4 kernel (modules/rows.cpp takes fp32 or bf16 rows")
        assert message.endswith("): each product dequantizes its weight, so the outputs are int4's but slower than "
                                "the float weights"), message
        assert caught[0].filename == caller_file(quant.int4_linear)


@torch.no_grad()
@pytest.mark.skipif(not (row_kernel.available() and row_kernel.pays(torch.uint8, 1)),
                    reason="the rows kernel does not take int4 here")
def test_int4_decoding_rows_take_the_kernel_silently():
    """Where the kernel takes int4, every row count from 1 to MAX_ROWS runs in it (no dequantized copy, so no
    slow-path warning) and equals the dequantized product."""
    g = torch.Generator().manual_seed(13)
    w4, bias = quantize_int4(torch.randn(12, 64, generator=g)), torch.randn(12, generator=g)
    calls, real = [], row_kernel.rows_linear
    for rows in range(1, row_kernel.MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=g)
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
            warnings.simplefilter("error")
            mp.setattr(quant, "_warned_int4", False)
            mp.setattr(row_kernel, "rows_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
            y = int4_linear(x, w4, bias)
        torch.testing.assert_close(y, F.linear(x, w4.dequantize(), bias), rtol=1e-5, atol=1e-4)
    assert calls == [(rows, 64) for rows in range(1, row_kernel.MAX_ROWS + 1)]


@torch.no_grad()
def test_int4_bf16_rows_with_an_fp32_bias_stay_bf16_on_the_dequantized_path():
    g = torch.Generator().manual_seed(14)
    w4, bias = quantize_int4(torch.randn(12, 64, generator=g)), torch.randn(12, generator=g)
    x = torch.randn(2, row_kernel.MAX_ROWS, 64, generator=g)  # 16 rows: more than the kernel takes
    y = int4_linear(x.bfloat16(), w4, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (2, row_kernel.MAX_ROWS, 12)
    torch.testing.assert_close(y.float(), F.linear(x, w4.dequantize(), bias), atol=0.1, rtol=0.02)


def test_int4_dequantizes_in_fp32_whatever_the_scales_dtype():
    """Scales held in bf16 (an Int4Weight whose tensors were cast) still multiply in fp32: values * scale exactly,
    not rounded to bf16 on the way."""
    w4 = quantize_int4(torch.randn(3, 64, generator=torch.Generator().manual_seed(15)))
    half = Int4Weight(w4.q, w4.scale.bfloat16(), w4.group)
    expected = (w4.values().float().view(3, 2, 32) * half.scale.float()[:, :, None]).view(3, 64)
    assert torch.equal(half.dequantize(), expected)


@pytest.mark.parametrize("name, quantizer, product, n_in", [("int8", quantize_int8, int8_linear, 4),
                                                            ("int4", quantize_int4, int4_linear, 32)])
def test_quantization_errors_read_in_full(name, quantizer, product, n_in):
    with pytest.raises(ValueError, match=rf"^{name} quantization takes a 2-d \(out, in\) weight, got shape \(64,\)$"):
        quantizer(torch.randn(64))
    with pytest.raises(ValueError, match=rf"^{name} quantization takes a floating-point weight, got torch\.int64$"):
        quantizer(torch.ones(4, 64, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"^input has 5 features, the {name} weight takes {n_in}$"):
        product(torch.randn(2, 3, 5), quantizer(torch.randn(3, n_in)))


def test_int4_group_errors_read_in_full():
    with pytest.raises(ValueError, match=r"^int4 groups must be a positive multiple of 32 columns, got group=16$"):
        quantize_int4(torch.randn(4, 96), group=16)
    with pytest.raises(ValueError, match=r"^int4 quantization needs in_features divisible by the group: 48 features, "
                                         r"group 32$"):
        quantize_int4(torch.randn(4, 48))
    with pytest.raises(ValueError, match=r"^quantize must be one of \('int8', 'int4', 'w8a8', 'w4a8'\), got 'int2'$"):
        quantize(torch.randn(3, 32), "int2")


def test_int8_weight_size_and_dequantization_in_fp32_whatever_the_scales_dtype():
    w8 = quantize_int8(torch.randn(5, 12, generator=torch.Generator().manual_seed(16)))
    assert w8.nbytes == 5 * 12 + 5 * 4  # a byte a weight, an fp32 scale a row
    half = quant.Int8Weight(w8.q, w8.scale.bfloat16())
    assert torch.equal(half.dequantize(), w8.q.float() * half.scale.float()[:, None])


@pytest.mark.parametrize("capability, byteorder, expected", [
    ("AVX2", "little", True), ("AVX512", "little", False), ("DEFAULT", "little", False), ("AVX2", "big", False)])
def test_the_word_packed_form_is_chosen_on_little_endian_avx2_cpus_only(monkeypatch, capability, byteorder,
                                                                       expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(quant.sys, "byteorder", byteorder)
    assert quant.packed_form_chosen() is expected


@pytest.mark.parametrize("in_features, packed_form", [(36, True), (30, False)])
def test_on_avx2_one_row_int8_takes_the_word_packed_loop_and_warns_once_that_it_saves_memory_not_time(
        monkeypatch, in_features, packed_form):
    """Where packed_form_chosen() (AVX2 CPUs), one row of in_features divisible by 4 takes the word-packed loop,
    warning once at int8_linear's caller that int8 saves memory, not time, there; other widths the byte loop."""
    monkeypatch.setattr(quant, "packed_form_chosen", lambda: True)
    monkeypatch.setattr(quant, "_compiled_gemv", None)
    monkeypatch.setattr(quant, "_compiled_packed", None)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    w8, x = sign_spread_int8(in_features=in_features), torch.randn(1, in_features)
    for call in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = int8_linear(x, w8, compiled=True)
        torch.testing.assert_close(y, F.linear(x, w8.dequantize()), rtol=1e-5, atol=1e-5)
        warned = call == 0 and packed_form
        assert len(caught) == (1 if warned else 0), [str(w.message) for w in caught]
        if warned:
            assert str(caught[0].message) == (
                "int8 decoding on a CPU without AVX512 (torch reports AVX2) through inductor's loop, not the rows "
                "kernel (modules/rows.cpp): it saves memory, not time; its one-row product read 1.7-2.4 GB/s of int8 "
                "weights against the kernel's 10-11 on a 2-core Zen 3 (bench/rows_kernel.py)")
            assert caught[0].filename == caller_file(quant.int8_linear)
    assert callable(quant._compiled_packed) is packed_form and callable(quant._compiled_gemv) is not packed_form


def test_a_compiled_kernel_that_fails_warns_once_and_decodes_with_the_dequantized_weight(monkeypatch):
    """No working compiler: the one-row product falls back to the dequantized weight (with the bias), warns once at
    int8_linear's caller naming the error, and the kernel is not tried again."""
    def broken_compile(fn, **kw):
        def call(*args):
            raise RuntimeError("no C++ compiler")
        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(quant, "_compiled_gemv", None)
    monkeypatch.setattr(quant, "_compiled_packed", None)
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)
    w8, bias, x = sign_spread_int8(), torch.randn(24), torch.randn(1, 1, 36)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = int8_linear(x, w8, bias, compiled=True, packed=False)
    assert [str(w.message) for w in caught] == [
        "int8 decoding: the compiled kernel failed (RuntimeError: no C++ compiler); using dequantized weights "
        "instead (slower)"]
    assert caught[0].filename == caller_file(quant.int8_linear)
    assert y.shape == (1, 1, 24)
    torch.testing.assert_close(y, F.linear(x, w8.dequantize(), bias), rtol=1e-5, atol=1e-5)
    assert quant._compiled_gemv is False and not quant.compiled_kernel_available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(int8_linear(x, w8, bias), y, rtol=1e-5, atol=1e-5)
        # asked for by name afterwards, either loop: eager at once, not a second failure ("'bool' is not callable")
        for packed in (False, True):
            torch.testing.assert_close(int8_linear(x, w8, bias, compiled=True, packed=packed), y, rtol=1e-5,
                                       atol=1e-5)


@torch.no_grad()
@pytest.mark.skipif(not (row_kernel.available() and row_kernel.pays(torch.int8, 1)),
                    reason="the rows kernel does not take int8 here")
def test_int8_rows_take_the_kernel_unless_a_product_is_named():
    """compiled=None: 1 to MAX_ROWS rows run in the rows kernel (equal to the dequantized product with the bias);
    more rows, or compiled=False, the dequantized weight."""
    g = torch.Generator().manual_seed(17)
    w8, bias = sign_spread_int8(12, 64), torch.randn(12, generator=g)
    calls, real = [], row_kernel.rows_linear
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(row_kernel, "rows_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
        for rows in range(1, row_kernel.MAX_ROWS + 2):
            x = torch.randn(rows, 64, generator=g)
            torch.testing.assert_close(int8_linear(x, w8, bias), F.linear(x, w8.dequantize(), bias), rtol=1e-5,
                                       atol=1e-4)
        torch.testing.assert_close(int8_linear(x[:1], w8, bias, compiled=False), F.linear(x[:1], w8.dequantize(), bias))
    assert calls == [(rows, 64) for rows in range(1, row_kernel.MAX_ROWS + 1)]


@torch.no_grad()
def test_clear_drops_every_copy_on_layers_and_head_and_counts_them(eager_int8):
    """quant.clear: the layers' copies and the head's (both CACHE_NAMES) dropped and counted; nothing else touched; a
    second call finds none; the next quantized decode makes them again."""
    model = tiny_model()
    ids = torch.zeros(1, 2, dtype=torch.long)
    model.generate(ids, max_new_tokens=2, quantize="int8")
    layers = [m for m in model.modules() if type(m) is Linear]
    assert all("_quantized_cache" in m.__dict__ for m in layers) and "_quantized_head" in model.gpt.__dict__
    model.gpt.__dict__["unrelated"] = 1
    assert quant.clear(model) == len(layers) + 1
    assert not any(name in m.__dict__ for m in model.modules() for name in quant.CACHE_NAMES)
    assert model.gpt.__dict__["unrelated"] == 1
    assert quant.clear(model) == 0
    model.generate(ids, max_new_tokens=2, quantize="int8")
    assert all("_quantized_cache" in m.__dict__ for m in layers)
