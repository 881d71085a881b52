"""models/fast_step.py: the C++ decoding step (modules/rows.cpp gpt2_step) against GPT2Model.decode_step, the
reference, in every weight kind (fp32, int8, int4, and those two with int8 activations; a bf16 model's bf16 weights),
in the native and the forced AVX2 build, for one row and for batches of left-padded rows, for the GPT-2 variants it
takes; generate and beam search give decode_step's tokens with it, and keep decode_step for what it does not take.

Tolerance: the step's sums run in other orders than torch's (the rows kernel's products, a plain softmax, LayerNorm
in double): hidden states agree to 1e-5 (relative and absolute) on these small models. bf16: see its tests."""
import copy
import gc
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from config import GPT2Config
from models import fast_step
from models.generation import prefill
from models.gpt2 import GPT2LMHeadModel
from models.lora import apply_lora
from modules import rows
from modules.linear import Linear, quantized_weights

pytestmark = [pytest.mark.skipif(not rows.available(), reason="the rows kernel cannot be built here"),
              pytest.mark.skipif(os.environ.get(fast_step.ENV) == "0",
                                 reason=f"{fast_step.ENV}=0 turns the decode step off (these tests run it)")]
TOL = dict(rtol=1e-5, atol=1e-5)
# w8a8 / w4a8: the step's LayerNorm and torch's differ by float rounding, and an activation within that distance of a
# half step rounds the other way: one such flip moves an output by its block's step times a weight (about 1e-3 on
# these models). None flipped on the Zen 3 this was written on; the tolerance leaves room for one, far below what a
# wrong scale or block would give.
A8_TOL = dict(rtol=5e-3, atol=5e-3)


def tiny(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    fields = {**dict(n_layer=2, n_head=4, n_embd=64, vocab_size=97, n_positions=64), **overrides}
    model = GPT2LMHeadModel(GPT2Config(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms and biases away from 1 and 0, so each one is exercised
    return model


def prompt_cache(model, ids: torch.Tensor, extra: int = 4):
    cache = model.gpt.new_cache(1, ids.shape[1] + extra)
    with torch.no_grad():
        model.gpt(ids, use_cache=True, past_key_values=cache)
    return cache


def clone(cache):
    other = copy.copy(cache)
    other.keys, other.values = cache.keys.clone(), cache.values.clone()
    return other


def steps_agree(model, quantize: str | None = None, lib=None, n_steps: int = 3) -> None:
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    cache = prompt_cache(model, ids)
    ref = clone(cache)
    tol = A8_TOL if quantize in ("w8a8", "w4a8") else TOL
    with torch.no_grad(), quantized_weights(model, quantize) if quantize else torch.no_grad():
        assert fast_step.why_not(model, 1, None, cache) is None
        fast = fast_step.FastStep(model, cache, lib=lib)
        for i, token in enumerate([7, 41, 2][:n_steps]):
            t, pos = torch.tensor([[token]]), torch.tensor([[5 + i]])
            got = fast(t, pos).clone()
            want = model.gpt.decode_step(t, pos, None, ref)
            torch.testing.assert_close(got, want, **tol)
            assert cache.length == ref.length == 6 + i
            torch.testing.assert_close(cache.keys[:, :, :, : cache.length], ref.keys[:, :, :, : ref.length], **tol)
            torch.testing.assert_close(cache.values[:, :, :, : cache.length], ref.values[:, :, :, : ref.length],
                                       **tol)


def avx2_or_skip():
    """The AVX2 build of the kernel, or a skip where the compiler cannot make it."""
    try:
        return rows.library(rows.AVX2)
    except Exception as err:  # a compiler without x86-64-v3
        pytest.skip(f"the AVX2 build is not available: {err}")


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8", "w4a8"])
def test_the_step_is_decode_step_in_every_weight_kind(quantize):
    steps_agree(tiny(), quantize)


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8", "w4a8"])
def test_the_avx2_build_takes_the_same_steps(quantize):
    steps_agree(tiny(), quantize, lib=avx2_or_skip())


# Left-padded prompts of 2 to 7 tokens (0: padding), as generate gets them; the first rows of each batch size.
PADDED = torch.tensor([[0, 0, 3, 14, 15, 92, 65], [5, 8, 9, 7, 9, 3, 2], [0, 0, 0, 0, 6, 26, 4],
                       [0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 33, 8, 32, 79], [0, 0, 0, 0, 0, 12, 21],
                       [9, 10, 11, 12, 13, 14, 15], [0, 0, 0, 50, 28, 8, 41], [0, 0, 7, 7, 7, 7, 7],
                       [0, 0, 0, 0, 0, 90, 1], [3, 1, 4, 1, 5, 9, 2], [0, 0, 0, 0, 60, 61, 62]])


def batch_steps(model, rows_: int, lib=None, n_steps: int = 4, quantize: str | None = None):
    """The step's and decode_step's (hidden states, keys, values) for `rows_` left-padded rows of PADDED after each
    of n_steps tokens, from the same prefill."""
    ids = PADDED[:rows_]
    start = prefill(model, ids, (ids != 0).long(), n_steps)
    assert start.key_mask is not None or rows_ == 1
    cache, ref = start.cache, clone(start.cache)
    got, want = [], []
    with torch.no_grad():
        assert fast_step.why_not(model, rows_, start.key_mask, cache) is None
        fast = fast_step.FastStep(model, cache, start.key_mask, lib=lib)
        for i in range(n_steps):
            t, pos = (torch.arange(rows_) * 7 + 3 * i + 1) % 97, ids.shape[1] + i
            got.append(fast(t, start.positions[:, pos]).clone())
            mask = None if start.key_mask is None else start.key_mask[..., : pos + 1]
            want.append(model.gpt.decode_step(t[:, None], start.positions[:, pos: pos + 1], mask, ref))
            n = cache.length
            got.append(torch.cat([cache.keys[..., :n, :].flatten(), cache.values[..., :n, :].flatten()]))
            want.append(torch.cat([ref.keys[..., :n, :].flatten(), ref.values[..., :n, :].flatten()]))
    return got, want


@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8", "w4a8"])
@pytest.mark.parametrize("rows_", [1, 3, 8, 12])
def test_batches_of_padded_rows_take_decode_steps_steps(monkeypatch, form, quantize, rows_):
    """Each row attends its own keys only (the padding masked out) and writes its own cache row: a row's mask, keys
    or position read from another row moves its hidden states by far more than the tolerance. 12 rows: fp32
    products of the kernel's many-row form (the layers' own weights under quantize, as for 2-8 rows)."""
    monkeypatch.setenv(rows.PROMPT_ENV, "128")  # the tests run without the plan: its row count set here
    lib = avx2_or_skip() if form == "avx2" else None
    model = tiny()
    tol = A8_TOL if quantize in ("w8a8", "w4a8") else TOL
    if rows_ > rows.MAX_ROWS and quantize in ("w8a8", "w4a8"):  # decode_step's int8 GEMM for 9+ rows: kept
        with quantized_weights(model, quantize):
            start = prefill(model, PADDED[:rows_], (PADDED[:rows_] != 0).long(), 1)
            assert fast_step.why_not(model, rows_, start.key_mask, start.cache) == \
                "more than 8 rows with int8 activations (decode_step's int8 GEMM)"
        return
    with quantized_weights(model, quantize) if quantize else torch.no_grad():
        for got, want in zip(*batch_steps(model, rows_, lib)):
            torch.testing.assert_close(got, want, **tol)


# torch's bf16 kernels of another vector width (ATen's AVX2 build) sum in another order: a value tipped to the next bf16
# number early travels through the layers (under ATEN_CPU_CAPABILITY=avx2, .ci/cpu_classes.py: 55% and 85% of the values
# equal, up to 0.03 apart); there the step is judged by its distance from fp32
# (test_a_bf16_models_step_is_as_close_to_fp32_as_decode_step), as bf16 is a correctness path on AVX2 CPUs anyway
AVX512_ROUNDING = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                     reason="decode_step's bf16 roundings are torch's AVX512 kernels'")


@AVX512_ROUNDING
@pytest.mark.parametrize("form", ["native", "avx2"])
def test_batches_of_a_bf16_model_round_where_decode_step_does(form):
    """As test_a_bf16_models_step_rounds_where_decode_step_does, for 8 left-padded rows (torch's bf16 SDPA under a
    mask: the same structure as without)."""
    lib = avx2_or_skip() if form == "avx2" else None
    for seed in (0, 1):
        for got, want in zip(*batch_steps(tiny(seed).to(torch.bfloat16), 8, lib)):
            assert got.dtype == want.dtype == torch.bfloat16
            assert (got == want).float().mean() >= 0.95, (got.float() - want.float()).abs().max()
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


def bf16_steps(model, lib=None, n_steps: int = 6):
    """(step's, decode_step's) hidden states and caches of a bf16 model after n_steps tokens past a 5-token prompt."""
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    cache = prompt_cache(model, ids, extra=n_steps)
    ref = clone(cache)
    got, want = [], []
    with torch.no_grad():
        assert fast_step.why_not(model, 1, None, cache) is None
        fast = fast_step.FastStep(model, cache, lib=lib)
        for i, token in enumerate([7, 41, 2, 9, 11, 3][:n_steps]):
            t, pos = torch.tensor([[token]]), torch.tensor([[5 + i]])
            got.append(fast(t, pos).clone())
            want.append(model.gpt.decode_step(t, pos, None, ref))
    n = cache.length
    return (torch.cat(got), cache.keys[..., :n, :], cache.values[..., :n, :]), \
        (torch.cat(want), ref.keys[..., :n, :], ref.values[..., :n, :])


@AVX512_ROUNDING
@pytest.mark.parametrize("form", ["native", "avx2"])
def test_a_bf16_models_step_rounds_where_decode_step_does(form):
    """A bf16 model's step (gpt2_step_bf16): bf16 out, a bf16 cache, and every value rounded to bf16 where torch's bf16
    operations round it, attention weighing values by bf16 exps as torch's bf16 SDPA does. On these small models the
    hidden states and the cache come out bit for bit as decode_step's (all of them on the Zen 4 this was written on);
    the test asks 95% of them equal and the rest within two bf16 steps: a rounding point left out or added moved 40-60%
    of them (the attention's exps unrounded: 39 of 64 at the first step)."""
    lib = avx2_or_skip() if form == "avx2" else None
    for seed in (0, 1):
        model = tiny(seed).to(torch.bfloat16)
        for got, want in zip(*bf16_steps(model, lib)):
            assert got.dtype == want.dtype == torch.bfloat16
            assert (got == want).float().mean() >= 0.95, (got - want).abs().max()
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


def test_a_bf16_models_step_is_as_close_to_fp32_as_decode_step():
    """At a wider, deeper model bf16's roundings reorder (other summation orders tip a value to the next bf16 number,
    and the tip travels), so the two bf16 paths part; each is judged by its distance from the same model in fp32 (the
    bf16 weights widened): the step's relative error within 1.2x decode_step's (1.0x +- 0.05 on the Zen 4)."""
    torch.manual_seed(4)
    wide = tiny(4, n_layer=4, n_embd=256, n_head=4, vocab_size=300, n_positions=64).to(torch.bfloat16)
    exact = copy.deepcopy(wide).float()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    cache, cache32 = prompt_cache(wide, ids, extra=12), prompt_cache(exact, ids, extra=12)
    ref = clone(cache)
    errors = {"step": [], "decode_step": []}
    with torch.no_grad():
        fast = fast_step.FastStep(wide, cache)
        for i in range(12):
            t, pos = torch.tensor([[(7 * i + 5) % 300]]), torch.tensor([[8 + i]])
            want32 = exact.gpt.decode_step(t, pos, None, cache32)
            for name, h in (("step", fast(t, pos)), ("decode_step", wide.gpt.decode_step(t, pos, None, ref))):
                errors[name].append(((h.float() - want32).norm() / want32.norm()).item())
    step, plain = (torch.tensor(errors[k]).mean().item() for k in ("step", "decode_step"))
    assert 0 < step <= 1.2 * plain, errors


@pytest.mark.parametrize("variant", [dict(bias=False), dict(norm_scale=False), dict(tie_word_embeddings=False),
                                     dict(logit_softcap=5.0), dict(scale_attn_by_inverse_layer_idx=True),
                                     dict(n_inner=96)])
def test_the_variants_it_takes(variant):
    steps_agree(tiny(**variant))


@pytest.mark.parametrize("variant, reason", [
    (dict(norm="rmsnorm"), "variant"), (dict(position_embedding="rope"), "variant"), (dict(n_kv_head=2), "variant"),
    (dict(qk_norm=True), "variant"), (dict(activation_function="relu"), "activation"),
])
def test_the_variants_it_leaves_to_decode_step(variant, reason):
    model = tiny(**variant)
    assert reason in fast_step.why_not(model, 1, None, prompt_cache(model, torch.tensor([[1, 2]])))


def test_lora_many_rows_and_the_switch_keep_decode_step(monkeypatch):
    model = tiny()
    cache = prompt_cache(model, torch.tensor([[1, 2]]))
    assert "rows" in fast_step.why_not(model, 200, None, cache)  # past the many-row product's timed counts
    monkeypatch.setenv("GPT2_DECODE_STEP", "0")
    assert "GPT2_DECODE_STEP=0" in fast_step.why_not(model, 1, None, cache)
    monkeypatch.delenv("GPT2_DECODE_STEP")
    apply_lora(model, rank=2)
    assert "LoRA" in fast_step.why_not(model, 1, None, cache)


def sharp(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # sharp logits: greedy tokens that vary
    return model


def counted(monkeypatch) -> list:
    """The FastStep calls made from here on."""
    taken, real = [], fast_step.FastStep.__call__
    monkeypatch.setattr(fast_step.FastStep, "__call__", lambda self, *a: taken.append(1) or real(self, *a))
    return taken


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "w8a8", "w4a8", "bf16"])
@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("rows_", [1, 5])
def test_generate_gives_the_tokens_of_decode_step(monkeypatch, quantize, sample, rows_):
    """One prompt, or 5 left-padded ones (with quantize, 2-8 rows keep the layers' own weights in both paths)."""
    model = sharp(tiny(seed=1))
    if quantize == "bf16":  # a bf16 model, its own weights
        model, quantize = model.to(torch.bfloat16), None
    ids = torch.tensor([[5, 6, 7]]) if rows_ == 1 else PADDED[:rows_, 2:]
    kwargs = dict(attention_mask=(ids != 0).long(), max_new_tokens=12, quantize=quantize, do_sample=sample)
    taken = counted(monkeypatch)
    fast = model.generate(ids, generator=torch.Generator().manual_seed(0), **kwargs)
    assert len(taken) == 11  # every step after the prompt's
    monkeypatch.setenv("GPT2_DECODE_STEP", "0")
    plain = model.generate(ids, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(fast, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prompts", [1, 2])
def test_beam_search_gives_the_beams_of_decode_step(monkeypatch, dtype, prompts):
    """4 beams of one prompt, 2 x 4 of two left-padded ones (8 rows): the step follows the cache's reorders (it reads
    the buffers reorder swaps in); 3 prompts' 12 rows take it in fp32 (the many-row products), keep decode_step in
    bf16. bf16 where torch's CPU kernels are not its AVX512 ones (ATEN_CPU_CAPABILITY=avx2: CI's AVX2 class): 3 new
    tokens, since torch's bf16 ops of the layers then round otherwise than the step from the 8th key on (the beams'
    hidden states equal at 3 steps, a quarter of them a bf16 step apart at the 4th, with either prompt attention),
    and near-equal beams may rank otherwise."""
    monkeypatch.setenv(rows.PROMPT_ENV, "128")  # the tests run without the plan: its row count set here
    model = sharp(tiny(seed=2)).to(dtype)
    ids = PADDED[:prompts, 2:] if prompts > 1 else PADDED[:1]
    exact = dtype == torch.float32 or torch.backends.cpu.get_cpu_capability() == "AVX512"
    new_tokens = 10 if exact else 3
    kwargs = dict(attention_mask=(ids != 0).long(), max_new_tokens=new_tokens, num_beams=4)
    taken = counted(monkeypatch)
    fast = model.generate(ids, **kwargs)
    assert len(taken) == new_tokens - 1
    monkeypatch.setenv("GPT2_DECODE_STEP", "0")
    assert torch.equal(fast, model.generate(ids, **kwargs))
    monkeypatch.delenv("GPT2_DECODE_STEP")
    model.generate(PADDED[:3], attention_mask=(PADDED[:3] != 0).long(), max_new_tokens=3, num_beams=4)
    assert len(taken) == new_tokens - 1 + (2 if dtype == torch.float32 else 0)


def test_a_weight_edit_between_calls_is_seen():
    """The step reads the weights through pointers taken at each generate call: an in-place edit between calls
    changes the next call's tokens exactly as it changes decode_step's."""
    model = tiny(seed=2)
    ids = torch.tensor([[1, 2, 3]])
    model.generate(ids, max_new_tokens=4)
    with torch.no_grad():
        model.gpt.gpt_layers[1].interm_dense.weight.mul_(-3)
    steps_agree(model)


@pytest.mark.parametrize("rows_", [1, 12])
def test_generate_under_autocast_keeps_decode_step(monkeypatch, rows_):
    """Under torch.autocast a decode step's products run in bf16 (decode_step), not in the weights' fp32 (the step):
    the step is not taken, at one row or at 12 (the many-row product)."""
    monkeypatch.setenv(rows.PROMPT_ENV, "128")
    model = tiny()
    taken = counted(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.generate(PADDED[:rows_], attention_mask=(PADDED[:rows_] != 0).long(), max_new_tokens=3)
    assert taken == []
    model.generate(PADDED[:rows_], attention_mask=(PADDED[:rows_] != 0).long(), max_new_tokens=3)
    assert len(taken) == 2


def test_a_forward_hook_sees_every_step_of_generate():
    """A hook on a module (here the final norm) is called for the prompt's pass and each decode step, as without the
    step: generate keeps decode_step while one is registered."""
    model = tiny()
    calls = []
    handle = model.gpt.final_layer_norm.register_forward_hook(lambda *a: calls.append(1))
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5)
    handle.remove()
    assert len(calls) == 5  # the prompt, then 4 steps


def test_a_full_cache_is_an_error():
    model = tiny()
    cache = prompt_cache(model, torch.tensor([[1, 2]]), extra=0)
    with torch.no_grad(), pytest.raises(RuntimeError, match="full"):
        fast_step.FastStep(model, cache)(torch.tensor([[3]]), torch.tensor([[2]]))


def test_a_norm_with_another_eps_keeps_decode_step():
    """The C++ step takes one eps for every LayerNorm (the config's): a norm edited to another keeps decode_step."""
    for edit in (lambda m: m.gpt.final_layer_norm, lambda m: m.gpt.gpt_layers[1].out_layer_norm):
        model = tiny()
        edit(model).eps = 1e-3
        assert "norm" in fast_step.why_not(model, 1, None, prompt_cache(model, torch.tensor([[1, 2]])))


def test_each_reason_to_keep_decode_step_is_named_as_it_is(monkeypatch):
    """why_not's reasons word for word, one situation each (generate logs the reason where it keeps decode_step)."""
    model = tiny()
    cache = prompt_cache(model, torch.tensor([[1, 2]]))

    def why(m=model, rows_=1, mask=None, c=cache):
        return fast_step.why_not(m, rows_, mask, c)
    assert why() is None
    assert why(mask=torch.ones(1, 1, 1, 3, dtype=torch.bool)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # decode_step's products in bf16: not the step's
        assert why() == "autocast (its products in another dtype than the weights')"
    for register in (lambda: model.gpt.gpt_layers[1].interm_dense.register_forward_hook(lambda *a: None),
                     lambda: model.gpt.final_layer_norm.register_forward_pre_hook(lambda *a: None),
                     lambda: torch.nn.modules.module.register_module_forward_hook(lambda *a: None),
                     lambda: torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)):
        handle = register()  # a hook decode_step would call: an interpretability probe, a global logger
        assert why() == "forward hooks on the model's modules (the step calls none of them)"
        handle.remove()
        assert why() is None
    assert why(rows_=0) == "0 rows"
    monkeypatch.setenv(rows.PROMPT_ENV, "128")  # the kernel's many-row product up to 128 rows (else the plan's)
    assert why(rows_=12) is None  # fp32
    half = tiny().to(torch.bfloat16)
    assert why(m=half, rows_=9, c=prompt_cache(half, torch.tensor([[1, 2]]))) == \
        "9 rows (the step runs 1 to 8, and fp32 up to the rows the kernel's many-row product pays for: 128)"
    assert why(rows_=129) == "129 rows (the step runs 1 to 8, and fp32 up to the rows the kernel's many-row " \
                             "product pays for: 128)"
    monkeypatch.setenv(rows.PROMPT_ENV, "0")  # torch's product beyond 8 rows: the step stops there too
    assert why(rows_=12) == "12 rows (the step runs 1 to 8, and fp32 up to the rows the kernel's many-row product " \
                            "pays for: 8)"
    monkeypatch.delenv(rows.PROMPT_ENV)
    for mask in (torch.ones(1, 1, 1, 3), torch.ones(1, 3, dtype=torch.bool), torch.ones(2, 1, 1, 3, dtype=torch.bool),
                 torch.ones(1, 2, 1, 3, dtype=torch.bool), torch.ones(1, 1, 1, 3, dtype=torch.bool, device="meta")):
        assert why(mask=mask) == "a key mask that is not (rows, 1, 1, keys) bool beside the cache", mask.shape
    assert why(m=tiny(activation_function="relu")) == "not GPT-2's blocks (manual backward or another activation)"
    keys = cache.keys
    for other in (keys.double(), keys.transpose(-1, -2), keys.to("meta")):  # another dtype, strides or device alone
        assert why(c=SimpleNamespace(keys=other)) == "the cache is not fp32 or bf16 on the CPU", (other.dtype,
                                                                                                 other.device)
    for edit, reason in ((lambda m: m.gpt.gpt_layers[1].out_layer_norm, "a norm that is not LayerNorm"),
                         (lambda m: m.gpt.final_layer_norm, "a final norm that is not LayerNorm")):
        other = tiny()
        edit(other).eps = 1e-3
        assert why(m=other) == reason
    wide = tiny()
    wide.double()  # its cache (made before) still fp32: the parameters' dtype is what is refused
    assert why(m=wide) == "parameters not all fp32 on the CPU, as the cache is"
    half = tiny().to(torch.bfloat16)  # a bf16 model with the fp32 cache: refused the same way
    assert why(m=half) == "parameters not all fp32 on the CPU, as the cache is"
    half_cache = prompt_cache(half, torch.tensor([[1, 2]]))
    assert why(m=half, c=half_cache) is None
    assert why(m=model, c=half_cache) == "parameters not all bf16 on the CPU, as the cache is"
    with quantized_weights(half, "int8"):
        assert why(m=half, c=half_cache) == "bf16 weights with quantized copies (the step's bf16 form reads the bf16 " \
                                            "weights)"
    with_lora = tiny()
    apply_lora(with_lora, rank=2)
    assert why(m=with_lora) == "a layer that is not the plain Linear (LoRA)"
    monkeypatch.setattr(rows, "available", lambda: False)
    assert why() == "the rows kernel is not built here"


def test_one_walk_finds_what_torchs_walks_find():
    """walk(model): each fact as torch's own walks give it, on models that differ in each: a module training, LoRA's
    layers (not the plain Linear), a hook, a second path to one module, a tensor shared (the tied head) and one
    registered twice, a module off the CPU (first or not), another dtype, a parameter slot holding None."""
    models = [tiny(), tiny(tie_word_embeddings=False)]
    training = tiny()
    training.gpt.gpt_layers[1].train()
    lora = tiny()
    apply_lora(lora, rank=2)
    hooked = tiny()
    hooked.gpt.final_layer_norm.register_forward_pre_hook(lambda *a: None)
    hooked.register_forward_hook(lambda *a: None)
    twice = tiny()
    twice.again = twice.gpt.gpt_layers[0].interm_dense  # one module, two names: walked once, under its first
    twice.shared = nn.Parameter(torch.zeros(3))
    twice.gpt.gpt_layers[1].shared = twice.shared  # one parameter on two modules: counted once
    twice.gpt.final_layer_norm.register_parameter("spare", None)
    meta_last, meta_first = tiny(), tiny()
    meta_last.gpt.final_layer_norm.to("meta")
    meta_first.gpt.word_embedding.to("meta")
    mixed = tiny()
    mixed.gpt.gpt_layers[0].to(torch.bfloat16)
    models += [training, lora, hooked, twice, meta_last, meta_first, mixed, tiny().double()]
    for model in models:
        found = fast_step.walk(model)
        parameters = list(model.parameters())
        assert found.training == any(m.training for m in model.modules())
        assert found.linears == [(name, m) for name, m in model.named_modules() if type(m) is Linear]
        assert found.hooked == [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
        assert found.dtypes == {p.dtype for p in parameters}
        assert found.all_cpu == all(p.is_cpu for p in parameters)
        assert found.first_cpu == parameters[0].is_cpu
        assert found.size == sum(p.numel() for p in parameters)
    assert [fast_step.walk(m).training for m in models[:3]] == [False, False, True]
    assert len(fast_step.walk(lora).linears) < len(fast_step.walk(models[0]).linears)
    assert len(fast_step.walk(hooked).hooked) == 2 and fast_step.walk(models[0]).hooked == []
    assert (fast_step.walk(meta_last).all_cpu, fast_step.walk(meta_last).first_cpu) == (False, True)
    assert (fast_step.walk(meta_first).all_cpu, fast_step.walk(meta_first).first_cpu) == (False, False)
    assert fast_step.walk(mixed).dtypes == {torch.float32, torch.bfloat16}
    assert fast_step.walk(twice).size == fast_step.walk(models[0]).size + 3
    assert fast_step.walk(models[1]).size - fast_step.walk(models[0]).size == 97 * 64  # the untied head's


def counted_walks(monkeypatch, model) -> list[bool]:
    """A list that gets True for each walk over `model`'s modules or its body's (why_not's hooks, unless told), False
    for any other named_modules call (torch's recursion passes a memo; other modules): modules() and parameters()
    walk through named_modules too."""
    walks, named_modules = [], nn.Module.named_modules

    def counted(self, *args, **kwargs):
        walks.append((self is model or self is model.gpt) and not args)
        return named_modules(self, *args, **kwargs)
    monkeypatch.setattr(nn.Module, "named_modules", counted)
    return walks


def test_a_hook_outside_the_body_keeps_the_step_and_each_call_walks_the_model_once(monkeypatch):
    """A hook on the LM-head model itself is never called by a decode step (generate calls no module's forward
    there): the step stays. A generate or beam search call walks the model's modules once (fast_step.walk), not
    once per check: each walk over gpt2's modules took 0.15-0.35 ms."""
    model = tiny()
    model.register_forward_hook(lambda *a: None)
    cache = prompt_cache(model, torch.tensor([[1, 2]]))
    assert fast_step.why_not(model, 1, None, cache) is None
    assert fast_step.why_not(model, 1, None, cache, fast_step.walk(model)) is None
    model.gpt.gpt_layers[0].register_forward_hook(lambda *a: None)
    assert fast_step.why_not(model, 1, None, cache, fast_step.walk(model)) == \
        "forward hooks on the model's modules (the step calls none of them)"
    model = tiny()
    walks = counted_walks(monkeypatch, model)
    for quantize in (None, "int8", "w8a8"):
        walks.clear()
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, quantize=quantize)
        assert walks.count(True) == 1, quantize
    walks.clear()
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, num_beams=2)
    assert walks.count(True) == 1


def test_the_last_place_in_the_cache_is_used_and_the_next_step_is_an_error():
    model = tiny()
    cache = prompt_cache(model, torch.tensor([[1, 2]]), extra=1)
    with torch.no_grad():
        step = fast_step.FastStep(model, cache)
        step(torch.tensor([[3]]), torch.tensor([[2]]))
        assert cache.length == cache.capacity == 3
        with pytest.raises(RuntimeError, match=r"^the decode cache holds 3 tokens and is full$"):
            step(torch.tensor([[4]]), torch.tensor([[3]]))


def test_a_step_made_for_other_rows_or_a_short_mask_is_an_error():
    """The scratch and the mask are sized for the cache the step was made for: another row count, capacity, or a mask
    without the new token's key is an error before anything is written."""
    model = tiny()
    ids = PADDED[:2]
    start = prefill(model, ids, (ids != 0).long(), 2)
    token, pos = torch.tensor([3, 4]), start.positions[:, ids.shape[1]]
    with torch.no_grad():
        short = fast_step.FastStep(model, start.cache, start.key_mask[..., : ids.shape[1]])
        with pytest.raises(RuntimeError, match=r"^the decode step was made for 2 rows, 9 cached tokens and a key mask "
                                               r"of 7 keys; the cache has 2 rows, 9 places and 7 keys$"):
            short(token, pos)
        step = fast_step.FastStep(model, start.cache, start.key_mask)
        unmasked = fast_step.FastStep(model, start.cache)
        start.cache.reorder(torch.tensor([0, 1, 1]))  # three rows now
        with pytest.raises(RuntimeError, match="made for 2 rows.*the cache has 3 rows"):
            step(torch.tensor([3, 4, 5]), pos)
        with pytest.raises(RuntimeError, match=r"^the decode step was made for 2 rows, 9 cached tokens and a key mask "
                                               r"of None keys; the cache has 3 rows, 9 places and 7 keys$"):
            unmasked(torch.tensor([3, 4, 5]), pos)


def test_a_failing_step_names_its_code_and_a_step_bumps_what_it_wrote():
    """The cache's keys and values and the step's output are written through pointers: their versions go up as after
    an in-place torch op (issue 52). A non-zero return of the C++ step is an error naming the code."""
    model = tiny()
    cache = prompt_cache(model, torch.tensor([[1, 2]]))
    with torch.no_grad():
        step = fast_step.FastStep(model, cache)
        written = (cache.keys, cache.values, step.out)
        before = [t._version for t in written]
        step(torch.tensor([[3]]), torch.tensor([[2]]))
        assert [t._version - b for t, b in zip(written, before)] == [1, 1, 1]

    class Failing:  # the kernel's library, but its step reports code 3
        def __init__(self, lib):
            self.lib = lib

        def __getattr__(self, name):
            return getattr(self.lib, name)

        def gpt2_step(self, *args):
            return 3
    with torch.no_grad():
        step = fast_step.FastStep(model, cache, lib=Failing(rows.library_step("fp32")))
        with pytest.raises(RuntimeError, match=r"^the C\+\+ decode step failed \(code 3\)$"):
            step(torch.tensor([[4]]), torch.tensor([[3]]))


@pytest.mark.parametrize("quantize, kind", [(None, "fp32"), ("int8", "int8"), ("int4", "int4"), ("w8a8", "w8a8"),
                                            ("w4a8", "w4a8"), ("bf16", "bf16")])
def test_the_step_runs_the_kernel_form_the_plan_chose_for_its_weight_kind(monkeypatch, quantize, kind):
    asked, real = [], rows.library_step
    monkeypatch.setattr(rows, "library_step", lambda k="fp32", n=1: asked.append((k, n)) or real(k, n))
    if quantize == "bf16":
        bf16_steps(tiny(n_layer=1).to(torch.bfloat16), n_steps=1)
    else:
        steps_agree(tiny(n_layer=1), quantize, n_steps=1)
    assert asked == [(kind, 1)]
    asked.clear()
    model = tiny(n_layer=1).to(torch.bfloat16) if quantize == "bf16" else tiny(n_layer=1)
    with quantized_weights(model, quantize) if quantize and quantize != "bf16" else torch.no_grad():
        batch_steps(model, 3, n_steps=1)
    assert asked == [("bf16" if quantize == "bf16" else "fp32", 3)]  # 2-8 rows: the layers' own weights


def test_weights_it_copies_to_make_contiguous_live_as_long_as_the_step():
    """A layer whose weight or bias is not contiguous is read from a contiguous copy: the copies are kept (freed, their
    memory would be handed to the next allocations of their size, filled here with NaN)."""
    model = tiny(seed=3)
    linears = [m for layer in model.gpt.gpt_layers for m in layer.modules() if type(m) is Linear]
    with torch.no_grad():
        for m in linears:
            m.weight = nn.Parameter(m.weight.detach().t().contiguous().t())  # the same values, transposed strides
            m.bias = nn.Parameter(torch.stack([m.bias.detach(), m.bias.detach()], 1)[:, 0])
    assert not any(m.weight.is_contiguous() or m.bias.is_contiguous() for m in linears)
    ids = torch.tensor([[3, 14, 15]])
    cache = prompt_cache(model, ids)
    ref = clone(cache)
    with torch.no_grad():
        step = fast_step.FastStep(model, cache)
        gc.collect()
        litter = [torch.full(t.shape, float("nan")) for m in linears for t in (m.weight, m.bias)]
        t, pos = torch.tensor([[7]]), torch.tensor([[3]])
        torch.testing.assert_close(step(t, pos), model.gpt.decode_step(t, pos, None, ref), **TOL)
    assert len(litter) == 2 * len(linears)


def test_a_bf16_models_fp32_norms_and_biases_live_as_long_as_the_step():
    """The step reads a bf16 model's norms and biases from fp32 copies made when it is built: they are kept (freed,
    their memory would go to the next allocations of their size, filled here with NaN), and the step's output is
    decode_step's after the litter as before it."""
    model = tiny(seed=5).to(torch.bfloat16)
    ids = torch.tensor([[3, 14, 15]])
    cache = prompt_cache(model, ids)
    ref = clone(cache)
    small = [t for t in model.parameters() if t.dim() == 1]  # every norm's scale and shift, every bias
    with torch.no_grad():
        step = fast_step.FastStep(model, cache)
        gc.collect()
        litter = [torch.full(t.shape, float("nan")) for t in small for _ in range(2)]
        t, pos = torch.tensor([[7]]), torch.tensor([[3]])
        got, want = step(t, pos), model.gpt.decode_step(t, pos, None, ref)
    assert not got.isnan().any() and (got == want).float().mean() >= 0.95
    assert len(litter) == 2 * len(small)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form", ["native", "avx2"])
def test_the_steps_gelu_is_the_tanh_gelu_to_float_rounding(form, threads):
    """Vectorized as v / (1 + exp(-2u)) with a polynomial exp: within 2e-7 relative plus 5e-8 absolute of the exact
    gelu(approximate="tanh") (float64) from -30 to 30, at 0, at huge inputs and on a tail shorter than a vector
    (torch's own fp32 gelu: 1.2e-5 relative, 1.5e-7 absolute on the same points, on the Zen 3 this was written on)."""
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    x = torch.cat([torch.linspace(-30, 30, 60001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4, 88.0])])
    y = torch.empty_like(x)
    lib.rows_gelu_tanh(x.data_ptr(), y.data_ptr(), y.numel(), threads)  # 60008: the last 0 is no whole vector
    want = torch.nn.functional.gelu(x.double(), approximate="tanh")
    err = (y.double() - want).abs()
    assert (err <= 2e-7 * want.abs() + 5e-8).all(), (x[err.argmax()], err.max())
    assert torch.equal(y[-7:-2], torch.tensor([0.0, 0.0, 5e-31, -5e-31, 1e4])) and abs(y[-2]) < 1e-30 and y[-1] == 88.0


@pytest.mark.parametrize("case", ["pass", "layers", "timed layers"])
def test_prefill_alone_walks_once_and_keys_the_threads_on_the_request(monkeypatch, case):
    """prefill without the caller's walk makes one (fast_step.walk) and hands it to every check: the thread choices
    for the prompt (the C++ pass's short-prompt count; the layers' path, padded: the short-prompt count or, blocks long
    enough to time, prompt_threads) get the rows, the quantize mode and the walk; nothing walks the model again."""
    from models import generation

    monkeypatch.setattr(generation.decode_threads, "remembers_fewer_threads", lambda: True)  # the busy branch too
    keys = []
    real_short = generation.decode_threads.short_prompt_threads
    monkeypatch.setattr(generation.decode_threads, "short_prompt_threads",
                        lambda key: keys.append(key) or real_short(key))
    used = []
    for name in ("short_prompt_threads", "prompt_threads"):
        real = getattr(generation, name)
        monkeypatch.setattr(generation, name, lambda m, rows, q=None, f=None, _r=real, _n=name:
                            used.append((_n, rows, q, f)) or _r(m, rows, q, f))
    model = tiny(n_embd=512, n_head=8, n_layer=1) if case == "timed layers" else tiny()
    walks = counted_walks(monkeypatch, model)
    made = []
    real_walk = fast_step.walk
    monkeypatch.setattr(fast_step, "walk", lambda m: made.append(real_walk(m)) or made[-1])
    ids = torch.tensor([[1, 2, 3, 4, 5]]) if case == "pass" else \
        torch.randint(1, 97, (2, 5 if case == "layers" else 48))
    mask = None if case == "pass" else torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)
    with torch.no_grad():
        prefill(model, ids, mask, 2, quantize="int8")  # (the mode only names the threads' memory here)
    assert walks.count(True) == 1 and len(made) == 1
    if case == "timed layers":
        assert used == [("prompt_threads", ids.numel(), "int8", made[0])]
    else:
        assert used == [("short_prompt_threads", ids.shape[0], "int8", made[0])]
        assert keys == [(ids.shape[0], "int8", made[0].size)]
