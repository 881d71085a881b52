"""quantize="w8a8" / "w4a8": int8 and int4 weights with the activations quantized to int8 in blocks of 32
(modules/quant.py), and their integer products in modules/rows.cpp (kinds 4 and 5), native and AVX2 builds.

The reference is torch: quant.quantize_activations (the rule) and F.linear of its output by the dequantized weight.
The kernel's quantization must equal the rule bit for bit (the same division, rounding to nearest even); its products
are exact integer sums scaled in fp32, so they agree with the reference to fp32 rounding of sums up to 768 long
(rtol 1e-5, atol 1e-4, as test_rows_kernel.py's)."""
import pytest
import torch
import torch.nn.functional as F

from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from modules import gelu, quant, rows
from modules.linear import Linear, quantized_weights
from modules.quant import quantize, quantize_activations

needs_kernel = pytest.mark.skipif(not rows.available(), reason="the rows kernel cannot be built here (an x86 CPU "
                                  "with AVX2 and FMA on Linux, and a C++ compiler)")


@pytest.fixture(params=["native", "avx2"], scope="module")
def lib(request):
    if not rows.available():
        pytest.skip("the rows kernel cannot be built here")
    return rows._load() if request.param == "native" else rows.library(rows.AVX2)


def test_the_rule_on_hand_made_blocks():
    """Block scale max|x| / 127, round to nearest even, an all-zero block stays zero, blocks are independent."""
    x = torch.zeros(1, 96)
    x[0, :32] = torch.linspace(-1.27, 1.27, 32)  # d = 0.01
    x[0, 5] = 0.025  # 2.5 steps: to 2 (even)
    x[0, 6] = 0.035  # 3.5 steps: to 4 (even)
    x[0, 64:] = 1000.0  # its own scale: exact
    y = quantize_activations(x)
    d = torch.tensor(1.27) / 127
    assert y[0, 5] == 2 * d and y[0, 6] == 4 * d
    assert torch.equal(y[0, 32:64], torch.zeros(32))
    assert torch.equal(y[0, 64:], x[0, 64:])
    assert (y[0, :32] - x[0, :32]).abs().max() <= d / 2 + 1e-7
    with pytest.raises(ValueError, match="blocks of 32 columns, got 48 features"):
        quantize_activations(torch.randn(2, 48))


def test_the_rule_keeps_bf16_inputs_bf16():
    x = torch.randn(3, 64).bfloat16()
    assert quantize_activations(x).dtype == torch.bfloat16


@pytest.mark.parametrize("rows_, in_f", [(1, 64), (3, 768), (8, 3072)])
def test_the_kernel_quantizes_by_the_rule_bit_for_bit(lib, rows_, in_f):
    g = torch.Generator().manual_seed(in_f + rows_)
    x = torch.randn(rows_, in_f, generator=g) * torch.logspace(-3, 3, in_f // 32).repeat_interleave(32)
    x[0, :32] = 0  # an all-zero block
    x[-1, 32:64] = torch.arange(32) * 0.5  # max 15.5: steps of 15.5 / 127, exact ties among them
    q, d = torch.empty(rows_, in_f, dtype=torch.int8), torch.empty(rows_, in_f // 32)
    assert lib.rows_quantize(x.data_ptr(), rows_, in_f, q.data_ptr(), d.data_ptr()) == 0
    assert torch.equal(d, x.view(rows_, -1, 32).abs().amax(-1) / 127)
    assert torch.equal(q.float().view(rows_, -1, 32) * d[..., None], quantize_activations(x).view(rows_, -1, 32))
    assert lib.rows_quantize(x.data_ptr(), rows_, 48, q.data_ptr(), d.data_ptr()) == -2


@pytest.mark.parametrize("mode, shape, batch", [("w8a8", (96, 64), 1), ("w8a8", (130, 768), 3),
                                                ("w8a8", (768, 3072), 8), ("w4a8", (96, 64), 1),
                                                ("w4a8", (130, 768), 5), ("w4a8", (768, 3072), 8)])
def test_the_integer_products_equal_the_quantized_reference(lib, mode, shape, batch):
    g = torch.Generator().manual_seed(shape[0] + batch)
    out_f, in_f = shape
    x, w = torch.randn(batch, in_f, generator=g), torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g)
    weight = quantize(w, mode)
    assert weight.int8_activations
    with torch.no_grad():
        want = F.linear(quantize_activations(x), weight.dequantize(), b)
        torch.testing.assert_close(quant.run_int8_activations(x, weight, b, lib=lib), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(quant.run_int8_activations(x, weight, lib=lib), want - b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode, group, in_f", [("w8a8", None, 32), ("w8a8", None, 96), ("w8a8", None, 160),
                                               ("w4a8", 32, 32), ("w4a8", 32, 96), ("w4a8", 32, 160),
                                               ("w4a8", 96, 96), ("w4a8", 96, 192)])
def test_every_row_count_and_an_odd_number_of_blocks(lib, mode, group, in_f):
    """1 to 8 rows (with VNNI each count is its own unrolled loop), 1, 3 and 5 blocks of 32 columns (the 512-bit
    loop takes blocks in pairs: an odd last block goes through the 256-bit code), int4 groups of one block and of
    three (a pair's two blocks under one scale; at 192 columns the second pair's blocks under two)."""
    g = torch.Generator().manual_seed(in_f)
    w = torch.randn(24, in_f, generator=g)
    weight = quantize(w, mode) if group is None else quant._with_int8_activations(quant.quantize_int4(w, group), mode)
    with torch.no_grad():
        for n in range(1, rows.MAX_ROWS + 1):
            x = torch.randn(n, in_f, generator=g) * 3
            want = F.linear(quantize_activations(x), weight.dequantize())
            torch.testing.assert_close(quant.run_int8_activations(x, weight, lib=lib), want, rtol=1e-5, atol=1e-4)


def test_the_native_build_multiplies_with_vnni_where_the_cpu_has_it(lib):
    """Where the CPU has AVX512-VNNI the native build must take the vpdpbusd code (a macro that stopped matching
    would silently fall back to the slower one); the AVX2 form (GPT2_DECODE_PLAN=avx2) never does, so the
    vpmaddubsw code is tested on such a CPU too."""
    flags = rows.cpu_flags().split()
    want = lib is rows._load() and all(f in flags for f in ("avx512_vnni", "avx512bw", "avx512vl"))
    assert lib.rows_vnni() == want


def test_int4_groups_of_64_extreme_weights_and_bf16_rows(lib):
    """Groups of two blocks; weights at the ends of each range (-8 reads back from a nibble, -128 never written but
    read: vpsignb's |-128| is 128 unsigned); bf16 rows come back bf16."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 128, generator=g)
    x = torch.randn(4, 128, generator=g)
    int4 = quant._with_int8_activations(quant.quantize_int4(w, group=64), "w4a8")
    int4.q[:, :8] = 0x88  # both nibbles -8
    int8 = quant.quantize(w, "w8a8")
    int8.q[:, :5] = -128
    int8.q[:, 5:9] = 127
    with torch.no_grad():
        for weight in (int4, int8):
            want = F.linear(quantize_activations(x), weight.dequantize())
            torch.testing.assert_close(quant.run_int8_activations(x, weight, lib=lib), want, rtol=1e-5, atol=1e-4)
        y = quant.run_int8_activations(x.bfloat16(), int8, lib=lib)
    assert y.dtype == torch.bfloat16


def test_refusals_name_the_problem(lib):
    w = quantize(torch.randn(8, 64), "w8a8")
    with pytest.raises(ValueError, match="int8 activations take int8 or int4 weights, got torch.float32"):
        rows.prepared(torch.randn(8, 64), int8_activations=True, lib=lib)
    with pytest.raises(ValueError, match="blocks of 32 columns: the weight takes 48 inputs"):
        rows.prepared(torch.zeros(8, 48, dtype=torch.int8), scale=torch.ones(8), int8_activations=True, lib=lib)
    with pytest.raises(ValueError, match="1 to 8 rows, got 9"):
        quant.run_int8_activations(torch.randn(9, 64), w, lib=lib)
    out = torch.empty(1, 8)
    assert lib.rows_product(4, 1, torch.randn(64).data_ptr(), 64, w.q.data_ptr(), None, None, out.data_ptr(), 8, 1,
                            0) == -2  # int8 without its scale


def test_modes_refuse_inputs_that_are_not_whole_blocks_and_say_what_to_use():
    with pytest.raises(ValueError, match=r"^w8a8 quantizes activations in blocks of 32 columns: this weight takes 48 "
                                         r"inputs, not a multiple of 32 \(use int8: weight-only\)$"):
        quantize(torch.randn(4, 48), "w8a8")
    with pytest.raises(ValueError, match="int4 quantization needs in_features divisible by the group: 48 features"):
        quantize(torch.randn(4, 48), "w4a8")  # int4's groups refuse it first


@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
def test_without_the_kernel_the_product_is_the_reference_expression(monkeypatch, mode):
    """Where the kernel does not run (pays False: another CPU, GPT2_ROWS_KERNEL=0), the product is
    F.linear(quantize_activations(x), dequantized weight, bias): the mode's numbers on every machine."""
    monkeypatch.setattr(rows, "pays", lambda dtype, rows_: False)
    w, b, x = torch.randn(24, 64), torch.randn(24), torch.randn(2, 1, 64)
    weight = quantize(w, mode)
    with torch.no_grad():
        got = quant.quantized_linear(x, weight, b)
    assert torch.equal(got, F.linear(quantize_activations(x.view(2, 64)), weight.dequantize(), b).view(2, 1, 24))


def tiny_model(seed=0, random_biases=False):
    """random_biases: every Linear's bias drawn from N(0, 1) instead of GPT-2's zeros (a product that dropped its
    bias would pass against zeros)."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=97, n_positions=64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # sharp logits: greedy tokens that vary
        for m in model.modules():
            if random_biases and type(m) is Linear:
                m.bias.normal_()
    return model


@needs_kernel
@torch.no_grad()
@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
@pytest.mark.parametrize("step", ["1", "0"])
def test_generate_with_the_kernel_gives_the_tokens_of_the_reference_expression(monkeypatch, mode, step):
    """The C++ step (GPT2_DECODE_STEP=1) or torch's step with the kernel's products, against torch's step with every
    product the reference expression; and the tokens differ from the weight-only mode's somewhere (the activations
    really are quantized)."""
    monkeypatch.setenv("GPT2_DECODE_STEP", step)
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(3))
    fast = tiny_model().generate(ids, max_new_tokens=16, quantize=mode)
    monkeypatch.setenv("GPT2_DECODE_STEP", "0")
    monkeypatch.setattr(rows, "pays", lambda dtype, rows_: False)
    monkeypatch.setattr(quant, "_warned_int4", True)
    monkeypatch.setattr(quant, "_compiled_gemv", False)
    reference = tiny_model().generate(ids, max_new_tokens=16, quantize=mode)
    assert torch.equal(fast, reference)
    model = tiny_model()
    with quantized_weights(model, mode):
        layers = [m for m in model.modules() if type(m) is Linear]
        assert all(m.quantized.int8_activations for m in layers)



@needs_kernel
@torch.no_grad()
@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
def test_quantized_linear_takes_the_kernel_for_any_leading_shape_and_keeps_bf16_rows_bf16(monkeypatch, mode):
    """quantized_linear (torch's decode step, the head) sends 1 to 8 rows of a w8a8 / w4a8 weight to the kernel's
    integer products, whatever x's leading shape; bf16 rows with an fp32 bias come back bf16; and where the kernel
    does not pay for the rows the expression gives the same values (to float rounding)."""
    g = torch.Generator().manual_seed(9)
    w, b = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    x = torch.randn(2, 3, 64, generator=g)  # 6 rows
    weight = quantize(w, mode)
    ran = []
    real = quant.run_int8_activations
    monkeypatch.setattr(quant, "run_int8_activations", lambda *a, **k: ran.append(a[0].shape) or real(*a, **k))
    want = F.linear(quantize_activations(x), weight.dequantize(), b)
    got = quant.quantized_linear(x, weight, b)
    assert ran == [(2, 3, 64)] and got.shape == (2, 3, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    want_bf16 = F.linear(quantize_activations(x.bfloat16().float()), weight.dequantize(), b)  # the rows it was given
    y = quant.quantized_linear(x.bfloat16(), weight, b)
    assert y.dtype == torch.bfloat16 and len(ran) == 2
    torch.testing.assert_close(y.float(), want_bf16, rtol=8e-3, atol=1e-2)  # the output rounded to bf16 once
    monkeypatch.setattr(rows, "pays", lambda dtype, rows_: False)
    fallback = quant.quantized_linear(x, weight, b)
    assert len(ran) == 2 and fallback.shape == (2, 3, 40)
    torch.testing.assert_close(fallback, got, rtol=1e-5, atol=1e-4)
    y = quant.quantized_linear(x.bfloat16(), weight, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want_bf16, rtol=2e-2, atol=5e-2)  # bf16 activations, weights and product


def test_the_rule_computes_in_fp32_and_names_the_features_of_any_shape():
    x = torch.randn(3, 64, dtype=torch.bfloat16) * 100
    assert torch.equal(quantize_activations(x), quantize_activations(x.float()).bfloat16())
    with pytest.raises(ValueError, match="blocks of 32 columns, got 48 features"):
        quantize_activations(torch.randn(2, 3, 48))


def test_the_integer_product_runs_in_the_kernel_it_is_given():
    """run_int8_activations(lib=...) calls that build's rows_product with kind 4 (int8) or 5 (int4)."""
    from types import SimpleNamespace

    calls = []

    def rows_product(kind, n, *args):
        calls.append((kind, n))
        return 0

    fake = SimpleNamespace(rows_product=rows_product)
    for mode, kind in (("w8a8", 4), ("w4a8", 5)):
        quant.run_int8_activations(torch.randn(2, 64), quantize(torch.randn(8, 64), mode), lib=fake)
        assert calls[-1] == (kind, 2)


# ---- the prompt's int8 GEMM (quant.prompt_product: oneDNN, activations per tensor in 7 bits) ----------------------

_PROMPT_WHY_NOT = quant.prompt_products_why_not()
needs_prompt = pytest.mark.skipif(_PROMPT_WHY_NOT is not None,
                                  reason=f"the prompt's int8 products do not run here: {_PROMPT_WHY_NOT}")


def prompt_reference(x: torch.Tensor) -> torch.Tensor:
    """The rule of quant.quantize_prompt_activations written out in torch, dequantized: (q - zp) * s."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    if lo == hi:
        return torch.zeros_like(x)
    zp = round(127 * -lo / (hi - lo))
    s = max(hi / (127 - zp) if zp < 127 else 0.0, -lo / zp if zp > 0 else 0.0)
    q = torch.clamp(torch.round(x * torch.tensor(1 / s, dtype=torch.float32)) + zp, 0, 127)
    return (q - zp) * s


@pytest.mark.parametrize("case", ["mixed", "positive", "negative", "zeros", "wide", "one-row-of-33"])
@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_the_prompt_quantizer_keeps_the_range_in_7_bits_by_the_rule(case, form):
    """Kernel (modules/rows.cpp) and torch forms: the same bits, values 0..127, each within half a step of x, the
    zero point exact (0 stays 0), and the rule written out (prompt_reference) reproduced."""
    if form == "kernel" and not rows.available():
        pytest.skip("the rows kernel cannot be built here")
    g = torch.Generator().manual_seed(len(case))
    x = {"mixed": torch.randn(64, 96, generator=g) * 3 + 0.5, "positive": torch.rand(20, 64, generator=g) + 0.1,
         "negative": -torch.rand(20, 64, generator=g) - 2, "zeros": torch.zeros(12, 32),
         "wide": torch.randn(16, 3072, generator=g) * torch.logspace(-4, 2, 3072),
         "one-row-of-33": torch.randn(1, 33, generator=g)}[case]
    x[0, 0] = 0.0
    q, s, zp = quant.quantize_prompt_activations(x, lib=None if form == "kernel" else False)
    assert q.dtype == torch.uint8 and q.shape == x.shape and int(q.max()) <= 127 and 0 <= zp <= 127
    deq = (q.float() - zp) * s
    assert float((deq - x).abs().max()) <= s / 2 * (1 + 1e-5) and deq[0, 0] == 0
    assert torch.equal(deq, prompt_reference(x))
    if rows.available():
        other = quant.quantize_prompt_activations(x, lib=False if form == "kernel" else rows._load())
        assert torch.equal(other[0], q) and other[1:] == (s, zp)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_a_non_finite_prompt_activation_is_not_quantized(form, bad):
    if form == "kernel" and not rows.available():
        pytest.skip("the rows kernel cannot be built here")
    x = torch.randn(40, 64)
    x[17, 9] = bad
    assert quant.quantize_prompt_activations(x, lib=None if form == "kernel" else False) is None


@needs_prompt
@torch.no_grad()
@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
@pytest.mark.parametrize("n_rows, in_f, out_f, bias", [(9, 64, 24, True), (130, 768, 96, True), (40, 96, 33, False)])
def test_the_prompt_product_equals_the_dequantized_expression(mode, n_rows, in_f, out_f, bias):
    """oneDNN's int8 GEMM against F.linear((q - zp) * s, the int8 weight dequantized (w4a8: the int4 weight quantized
    again to int8 per row), bias): integer sums are exact, so fp32 rounding only (rtol 1e-5, atol 1e-4)."""
    g = torch.Generator().manual_seed(n_rows)
    w, b = torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g) if bias else None
    x = torch.randn(n_rows, in_f, generator=g) * 2 - 0.3
    weight = quantize(w, mode)
    w8 = weight if mode == "w8a8" else quant.quantize_int8(weight.dequantize())
    got = quant.prompt_linear(x, quant.prompt_weight(weight), b)
    want = F.linear(prompt_reference(x), w8.dequantize(), b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (got - F.linear(x, w, b)).abs().max() > 1e-3  # the activations really are quantized


@needs_prompt
@torch.no_grad()
@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
@pytest.mark.parametrize("tokens", [2, 12])
def test_a_quantized_prompt_takes_the_int8_gemm_and_the_switch_turns_it_off(monkeypatch, mode, tokens):
    """Within quantized_weights(w8a8 / w4a8) a prompt of 2 or 12 tokens: every layer's output is the prompt rule's on
    its own input (F.linear of prompt_reference(input) by the dequantized int8 weight; w4a8: the int4 weight quantized
    again to int8), and the logits move off the float weights'; one row and weight-only modes untouched;
    GPT2_PROMPT_INT8=0: the float weights' output exactly. A NaN in the input reaches the output as fp32's does."""
    model = tiny_model(random_biases=True)
    ids = torch.randint(0, 97, (1, tokens), generator=torch.Generator().manual_seed(5))
    plain = model(ids)["logits"]
    layers = [m for m in model.modules() if type(m) is Linear]
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0], out))) for m in layers]
    with quantized_weights(model, mode):
        got = model(ids)["logits"]
        assert all("_prompt_cache" in m.__dict__ for m in layers)
    for hook in hooks:
        hook.remove()
    assert len(seen) == len(layers)
    for layer, x, y in seen:
        w = quantize(layer.weight, mode)
        w8 = w if mode == "w8a8" else quant.quantize_int8(w.dequantize())
        torch.testing.assert_close(y, F.linear(prompt_reference(x), w8.dequantize(), layer.bias), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, plain, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv(quant.PROMPT_ENV, "0")
    with quantized_weights(model, mode):
        assert torch.equal(model(ids)["logits"], plain)
    monkeypatch.delenv(quant.PROMPT_ENV)
    with quantized_weights(model, mode[:2].replace("w", "int") if mode == "w8a8" else "int4"):
        assert torch.equal(model(ids)["logits"], plain)  # weight-only: the prompt keeps the float weights
    layer = layers[0]
    x = torch.randn(1, 12, layer.in_features)
    x[0, 3, 5] = float("nan")
    with quantized_weights(model, mode):
        y = layer(x)
    assert torch.equal(y.isnan(), torch.nn.functional.linear(x, layer.weight, layer.bias).isnan())


@needs_prompt
@torch.no_grad()
def test_the_prompt_copy_is_made_again_when_the_weights_change_and_cleared_with_the_others():
    """The packed int8 copies follow their layers' quantized copies (a new weight: a new copy; the same: kept; the
    attention's stacked query / key / value copy: made again when only the key changed), and quant.clear drops them
    with the others."""
    model = tiny_model()
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(6))
    with quantized_weights(model, "w8a8"):
        first = model(ids)["logits"]
    attention = model.gpt.gpt_layers[0].self_attention
    layer = model.gpt.gpt_layers[0].attention_dense
    kept, kept_qkv = layer.__dict__["_prompt_cache"], attention.__dict__["_prompt_cache"]
    assert not any("_prompt_cache" in m.__dict__ for m in (attention.query, attention.key, attention.value))
    with quantized_weights(model, "w8a8"):
        assert torch.equal(model(ids)["logits"], first)
    assert layer.__dict__["_prompt_cache"] is kept and attention.__dict__["_prompt_cache"] is kept_qkv
    attention.key.weight.mul_(0.5)
    with quantized_weights(model, "w8a8"):
        second = model(ids)["logits"]
    assert attention.__dict__["_prompt_cache"] is not kept_qkv and layer.__dict__["_prompt_cache"] is kept
    for p in model.parameters():
        p.mul_(0.5)
    with quantized_weights(model, "w8a8"):
        third = model(ids)["logits"]
    assert layer.__dict__["_prompt_cache"] is not kept and len({first.sum(), second.sum(), third.sum()}) == 3
    fresh = tiny_model()
    fresh.load_state_dict(model.state_dict())
    with quantized_weights(fresh, "w8a8"):
        assert torch.equal(fresh(ids)["logits"], third)
    # per block: the 6 layers' int8 copies and 4 of the prompt's (query / key / value stacked, projection, MLP's 2)
    assert quant.clear(model) == model.config.n_layer * (6 + 4)
    assert not any("_prompt_cache" in m.__dict__ for m in model.modules())


@needs_prompt
@torch.no_grad()
@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
@pytest.mark.parametrize("biases", ["all", "none", "some"])
def test_the_stacked_query_key_value_product_is_the_three_products_exactly(mode, biases):
    """One quantization, one GEMM for the three projections: every output the same bits as its own layer's product
    (integer sums, the same scales), whichever biases the layers have; and a whole model's logits the same with the
    stacked product as with the three (forward hooks on the projections keep their own calls)."""
    g = torch.Generator().manual_seed(3)
    layers = [Linear(64, n, bias=biases == "all" or (biases == "some" and n == 32)) for n in (64, 32, 32)]
    for m in layers:
        m.weight.copy_(torch.randn(m.weight.shape, generator=g))
        if m.bias is not None:
            m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    holder = torch.nn.ModuleList(layers)
    x = torch.randn(2, 11, 64, generator=g)
    with quantized_weights(holder, mode):
        stacked = quant.prompt_product(holder, layers, x)
        each = torch.cat([m(x) for m in layers], dim=-1)
    assert stacked.shape == (2, 11, 128) and torch.equal(stacked, each)
    model = tiny_model(random_biases=True)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    with quantized_weights(model, mode):
        fused = model(ids)["logits"]
    assert all("_prompt_cache" in block.self_attention.__dict__ for block in model.gpt.gpt_layers)
    query = model.gpt.gpt_layers[0].self_attention.query
    calls = []
    hook = query.register_forward_hook(lambda *args: calls.append(1))
    with quantized_weights(model, mode):
        assert torch.equal(model(ids)["logits"], fused)
    hook.remove()
    assert calls == [1]


@needs_prompt
@pytest.mark.skipif(not gelu.available(), reason="the GELU kernel is off (GPT2_FAST_GELU=0) or not built")
@torch.no_grad()
def test_the_quantized_prompts_gelu_runs_in_the_kernel(monkeypatch):
    """A w8a8 / w4a8 prompt's GELU is the rows kernel's, as every pass without a gradient is (modules/gelu.py: a new
    tensor, the input untouched, within 2e-7 relative + 5e-8 of the exact tanh GELU), whatever the weights' form;
    with autograd the kernel's Function gives the same values; GPT2_FAST_GELU=0 keeps torch's F.gelu exactly."""
    block = tiny_model().gpt.gpt_layers[0]
    h = torch.randn(1, 12, block.interm_dense.out_features) * 4
    before = h.clone()
    exact = F.gelu(h.double(), approximate="tanh")
    with quantized_weights(block, "w8a8"):
        y = block.interm_af(h)
        assert torch.equal(block.interm_af(h[:, :1]), y[:, :1])
        with torch.enable_grad():
            assert torch.equal(block.interm_af(h.requires_grad_()), y)
    h.requires_grad_(False)
    assert torch.equal(h, before)
    assert ((y.double() - exact).abs() <= 2e-7 * exact.abs() + 5e-8).all()
    assert not torch.equal(y, F.gelu(h, approximate="tanh"))
    with quantized_weights(block, "int8"):
        assert torch.equal(block.interm_af(h), y)
    monkeypatch.setattr(gelu, "_on", False)
    with quantized_weights(block, "w8a8"):
        assert torch.equal(block.interm_af(h), F.gelu(h, approximate="tanh"))


@needs_prompt
@torch.no_grad()
@pytest.mark.parametrize("mode", [None, "w8a8"])
def test_a_prompt_through_lora_layers_keeps_their_own_products(mode):
    """LoRA layers (models/lora.py) have no quantized copy: with adapters on the query and the MLP's output layer, a
    12-token prompt in eval runs them on their float weights (an MLP whose output layer is LoRA's is never taken by
    the int8 GEMM); key and value, without a LoRA query beside them, take the int8 GEMM one by one."""
    from models.lora import apply_lora

    model = tiny_model()
    apply_lora(model, rank=4, targets=("query", "out_dense"))
    model.eval()
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(7))
    plain = model(ids)["logits"]
    block = model.gpt.gpt_layers[0]
    h = torch.randn(1, 12, model.config.n_embd * 4)
    assert not quant.prompt_takes((block.out_dense,), h)
    if mode is None:
        return
    with quantized_weights(model, mode) as layers:
        assert not quant.prompt_takes((block.out_dense,), h)
        got = model(ids)["logits"]
    attention = block.self_attention
    assert len(layers) == 4 * model.config.n_layer and torch.isfinite(got).all() and not torch.equal(got, plain)
    assert "_prompt_cache" in attention.key.__dict__ and "_prompt_cache" not in attention.__dict__


@pytest.mark.parametrize("lo, hi, want", [
    (0.5, 2.0, (2.0 / 127, 0)),  # all positive: the range widened to 0, zero point 0
    (-2.0, -0.5, (2.0 / 127, 127)),  # all negative: zero point 127
    (-1.0, 3.0, (max(3.0 / 95, 1.0 / 32), 32)),  # zp = round(127 / 4) = 32; the scale keeps both ends in range
    (-1.2, 120.0, (1.2, 1)),  # zp = round(1.257) = 1: the negative end sets the scale (120 / 126 would clip it)
    (-120.0, 1.2, (1.2, 126)),  # and the positive end, mirrored
    (0.0, 0.0, (1.0, 0)),  # all zeros
])
def test_the_prompt_scale_widens_to_zero_and_keeps_both_ends_in_7_bits(lo, hi, want):
    scale, zp = quant.prompt_scale(lo, hi)
    assert (scale, zp) == pytest.approx(want) and isinstance(zp, int)
    if hi > lo:
        assert round(min(lo, 0) / scale) + zp >= 0 and round(max(hi, 0) / scale) + zp <= 127


def test_the_prompt_quantizer_takes_the_kernel_it_is_given_and_torch_when_told(monkeypatch):
    """lib=None: this machine's rows kernel (here a stand-in that records its calls); lib=False: torch's ops only."""
    if not rows.available():
        pytest.skip("the rows kernel cannot be built here")
    real, calls = rows._load(), []

    class Recording:
        def rows_minmax(self, *args):
            calls.append("minmax")
            return real.rows_minmax(*args)

        def rows_quantize_u7(self, *args):
            calls.append("quantize")
            real.rows_quantize_u7(*args)

    monkeypatch.setattr(rows, "_load", Recording)
    x = torch.randn(12, 64)
    got = quant.quantize_prompt_activations(x)
    assert calls == ["minmax", "quantize"]
    calls.clear()
    want = quant.quantize_prompt_activations(x, lib=False)
    assert calls == [] and torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_the_prompt_products_say_why_they_do_not_run(monkeypatch):
    monkeypatch.delenv(quant.PROMPT_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert quant.prompt_products_why_not() == ("CPU capability DEFAULT (no SIMD): oneDNN's int8 speed there is not "
                                               "measured")
    monkeypatch.setenv(quant.PROMPT_ENV, "0")
    assert quant.prompt_products_why_not() == "GPT2_PROMPT_INT8=0"


@needs_prompt
@torch.no_grad()
def test_the_prompt_product_is_not_taken_off_the_cpu_or_float32_and_caches_only_its_layers_copies():
    """None for weight-only copies, a layer without a copy, bf16 and non-CPU (meta) inputs, a decode step's 8 rows or
    fewer (one position each), under autograd; a layer whose quantized copy is not the one kept on it (or none is
    kept) gets the product without a cache entry on the owner, so a later call cannot read a stale packed copy."""
    owner = torch.nn.Module()
    layer = Linear(64, 24, bias=False)
    w8 = quantize(layer.weight, "w8a8")
    x = torch.randn(10, 64)
    layer.quantized = quantize(layer.weight, "int8")
    assert quant.prompt_product(owner, (layer,), x) is None
    layer.quantized = None
    assert quant.prompt_product(owner, (layer,), x) is None
    layer.quantized = w8
    assert quant.prompt_product(owner, (layer,), x.bfloat16()) is None
    assert quant.prompt_product(owner, (layer,), x.to("meta")) is None
    assert quant.prompt_product(owner, (layer,), x[:8, None]) is None  # a decode step of 8 rows (B, 1, in)
    assert quant.prompt_product(owner, (layer,), x[None, :2]) is not None  # a prompt of 2 tokens (1, T, in)
    with torch.enable_grad():
        assert quant.prompt_product(owner, (layer,), x) is None
    want = quant.prompt_linear(x, quant.prompt_weight(w8))
    assert torch.equal(quant.prompt_product(owner, (layer,), x), want) and "_prompt_cache" not in owner.__dict__
    layer.__dict__["_quantized_cache"] = (("key",), quantize(torch.randn(24, 64), "w8a8"))  # another weight's copy
    assert torch.equal(quant.prompt_product(owner, (layer,), x), want) and "_prompt_cache" not in owner.__dict__
    layer.__dict__["_quantized_cache"] = (("key",), w8)
    assert torch.equal(quant.prompt_product(owner, (layer,), x), want)
    assert owner.__dict__["_prompt_cache"][0] == (("key",),)


def test_a_range_too_small_for_an_fp32_scale_is_not_quantized_even_with_a_float64_default():
    """1 / scale must be finite in fp32 (what the kernel and torch's form multiply by), whatever torch's default dtype:
    a tensor of denormals gives an fp32 1 / scale of infinity, so it is left to the float weights."""
    x = torch.full((10, 32), 1e-41)
    x[0, 0] = -1e-41
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert quant.quantize_prompt_activations(x, lib=False) is None
        if rows.available():
            assert quant.quantize_prompt_activations(x) is None
    finally:
        torch.set_default_dtype(before)


def test_the_kernels_quantizer_gives_the_same_bits_with_a_float64_default_dtype():
    """The kernel writes the range as two fp32 values into a buffer that must be fp32 whatever torch's default dtype
    (a float64 one would read them back as one wrong number): with float64 the default, the kernel's form still
    equals torch's form bit for bit."""
    if not rows.available():
        pytest.skip("the rows kernel cannot be built here")
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(8)) * 3 + 0.5
    want = quant.quantize_prompt_activations(x, lib=False)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = quant.quantize_prompt_activations(x)
    finally:
        torch.set_default_dtype(before)
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


@needs_prompt
@torch.no_grad()
def test_the_prompt_gemm_takes_a_prompt_of_any_leading_shape_and_no_decode_step():
    """prompt_takes: rows of 2+ positions in the last leading dimension ((T, in), (B, T, in)) or more than MAX_ROWS
    rows in all, in any number of leading dimensions ((3, 3, 1, in): 9 one-position rows); not a decode step of at
    most MAX_ROWS one-position rows, nor one row."""
    layer = Linear(64, 24)
    layer.quantized = quantize(layer.weight, "w8a8")
    leading = {(1,): False, (2,): True, (1, 2): True, (4, 3): True, (1, 1): False, (2, 1): False, (8, 1): False,
               (9, 1): True, (3, 3, 1): True, (2, 2, 2, 1): False}  # x: (*leading, in)
    assert {shape: quant.prompt_takes((layer,), torch.randn(*shape, 64)) for shape in leading} == leading


@needs_kernel
@needs_prompt
def test_the_pass_packs_only_int8_activation_copies_as_int8_bytes():
    """prompt_packed: None for a module without a quantized copy (a LoRA layer, a plain nn.Linear) and for a
    weight-only copy; for a w8a8 copy, int8 bytes of rows_qgemm_bytes' length (made with the prompt's library when
    none is given) and the per-row scales; a copy whose width is not a multiple of 4 is refused by name."""
    assert quant.prompt_packed(torch.nn.Linear(64, 8)) is None
    layer = Linear(64, 24)
    layer.quantized = None
    assert quant.prompt_packed(layer) is None
    layer.quantized = quantize(layer.weight, "int8")
    assert quant.prompt_packed(layer) is None and "_prompt_packed" not in layer.__dict__
    layer.quantized = quantize(layer.weight, "w8a8")
    packed, scale = quant.prompt_packed(layer)  # the prompt's library
    lib = rows.prompt_library()
    assert packed.dtype == torch.int8 and packed.numel() == lib.rows_qgemm_bytes(24, 64)
    assert torch.equal(scale, layer.quantized.scale.float().reshape(-1))
    odd = Linear(30, 4)
    odd.quantized = quant.Int8Weight(torch.ones(4, 30, dtype=torch.int8), torch.ones(4), int8_activations=True)
    with pytest.raises(ValueError, match="the prompt's int8 products take inputs in multiples of 4, this weight has "
                                         "30"):
        quant.prompt_packed(odd)


@needs_kernel
@torch.no_grad()
def test_a_prepared_w8a8_product_quantizes_its_activations():
    """prepared_quantized on a w8a8 copy: the kernel's product with the activations quantized (the rule's output by
    the dequantized weight), not the weight-only product of the same int8 weight."""
    if not rows.pays(torch.int8, 1):
        pytest.skip("the rows kernel does not take int8 here")
    g = torch.Generator().manual_seed(2)
    weight, bias, x = torch.randn(24, 64, generator=g), torch.randn(24, generator=g), torch.randn(1, 64, generator=g)
    w8 = quantize(weight, "w8a8")
    got = quant.prepared_quantized(w8, bias)(x)
    torch.testing.assert_close(got, F.linear(quantize_activations(x), w8.dequantize(), bias), rtol=1e-5, atol=1e-4)
    weight_only = F.linear(x, w8.dequantize(), bias)
    assert (got - weight_only).abs().max() > 1e-3
