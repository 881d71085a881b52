"""modules/prompt_attention.py: a prompt's causal attention in one rows-kernel call, against torch's SDPA and float64,
in both builds of the kernel, fp32 and bf16; where CausalSelfAttention takes it (a prompt's pass in fp32 or bf16
without gradients) and where it keeps SDPA; and a model's prompt, logits and greedy tokens with it and without it."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from modules import prompt_attention, rows

pytestmark = pytest.mark.skipif(not prompt_attention.available(), reason=f"{prompt_attention.ENV}=0 turns it off"
                                if os.environ.get(prompt_attention.ENV) == "0" else "the rows kernel does not build "
                                "here (it needs AVX2 or AVX512 on x86-64 Linux and a C++ compiler)")


def qkv_views(B: int, H: int, T: int, hs: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """query, key and value (B, H, T, hs) as the model makes them: strided views of one fused (B, T, 3, H, hs)."""
    torch.manual_seed(seed)
    fused = torch.randn(B, T, 3, H, hs)
    return tuple(t.transpose(1, 2) for t in fused.unbind(2))


def reference(q, k, v, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                          scale=scale).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form", ["native", "avx2"])
def test_the_kernel_is_causal_softmax_attention_to_float_rounding(form, threads):
    """Within 2e-5 of float64 and of SDPA's float32 for blocks of queries whole and part (T around the vector
    width of either build: 16 and 8), one to three sequences, head sizes from one vector to 256 (every multiple of
    the build's width is taken), strided views and contiguous tensors; the largest error seen on the Zen 4 it was
    written on was 7.6e-6 (hs 256, 100 tokens)."""
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    width, before = lib.rows_vector_width(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for B, H, T in [(1, 2, 2), (2, 3, 7), (1, 2, 8), (3, 1, 9), (1, 4, 16), (2, 2, 17), (1, 3, 33), (1, 2, 100)]:
            for hs in sorted({width, 2 * width, 64, 256}):
                q, k, v = qkv_views(B, H, T, hs, seed=T + hs)
                out = prompt_attention.attend(q, k, v, 0.3, lib)
                assert out.shape == (B, T, H * hs)
                torch.testing.assert_close(out.double(), reference(q, k, v, 0.3), atol=2e-5, rtol=1e-5)
                sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).transpose(1, 2).flatten(2)
                torch.testing.assert_close(out, sdpa, atol=2e-5, rtol=1e-5)
                contiguous = prompt_attention.attend(q.contiguous(), k.contiguous(), v.contiguous(), 0.3, lib)
                torch.testing.assert_close(contiguous, out, atol=0, rtol=0)  # the same sums, whatever the strides
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("form", ["native", "avx2"])
def test_bf16_is_computed_in_fp32_and_rounded_once(form):
    """bf16 query, key and value: the output is the float64 attention of the same bf16 numbers rounded to bf16 in all
    but a few values (sums in fp32: on the Zen 5 it was written on, 0-0.04% of values one bf16 step away, where the
    exact value lies near a rounding boundary or sums cancel to near 0) and never further than a step or the fp32
    sums' rounding (1e-6 of values about 1); torch's bf16 SDPA
    is one step away in about a third of them (its weights rounded to bf16 before the values' sum). Strided views
    and contiguous tensors give the same bits."""
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    for B, H, T, hs in [(2, 3, 37, 64), (1, 2, 130, 128), (1, 1, 5, lib.rows_vector_width())]:
        q, k, v = (t.bfloat16() for t in qkv_views(B, H, T, hs, seed=T))
        out = prompt_attention.attend(q, k, v, 0.125, lib)
        assert out.dtype == torch.bfloat16 and out.shape == (B, T, H * hs)
        exact = reference(q, k, v, 0.125)
        rounded = exact.bfloat16()
        assert (out != rounded).double().mean() < 0.002, (out != rounded).double().mean()
        assert ((out.double() - exact).abs() <= 2 ** -6 * exact.abs() + 1e-6).all()  # a step, or fp32 sums' rounding
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125).transpose(1, 2).flatten(2)
        assert (sdpa != rounded).double().mean() > 0.1  # what the kernel improves on (if torch's changes, so may this)
        contiguous = prompt_attention.attend(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, lib)
        assert torch.equal(contiguous, out)


def test_bf16_is_left_to_sdpa_on_amx(monkeypatch):
    """On a CPU with AMX-BF16 torch's bf16 SDPA keeps a bf16 prompt (its products can take AMX's tiles; the kernel was
    not timed against it there) unless GPT2_PROMPT_ATTENTION=force; fp32 is taken as anywhere."""
    monkeypatch.delenv(prompt_attention.ENV, raising=False)
    q, k, v = qkv_views(1, 2, 5, 64)
    assert prompt_attention.applies(q, k, v) and prompt_attention.applies(q.bfloat16(), k.bfloat16(), v.bfloat16())
    monkeypatch.setattr(rows, "has_cpu_flag", lambda *names: "amx_bf16" in names)
    assert prompt_attention.applies(q, k, v) and not prompt_attention.applies(q.bfloat16(), k.bfloat16(), v.bfloat16())
    monkeypatch.setenv(prompt_attention.ENV, "force")  # an AMX machine's timing of it
    assert prompt_attention.applies(q.bfloat16(), k.bfloat16(), v.bfloat16())


def test_mixed_dtypes_are_an_error_naming_them():
    q, k, v = qkv_views(1, 2, 5, 64)
    assert not prompt_attention.applies(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="all float32 or all bfloat16, got torch.float32, torch.bfloat16, "
                                         "torch.float32$"):
        prompt_attention.attend(q, k.bfloat16(), v, 0.5)
    with pytest.raises(ValueError, match="got torch.float64, torch.float64, torch.float64$"):
        prompt_attention.attend(q.double(), k.double(), v.double(), 0.5)
    assert not prompt_attention.applies(q.double(), k.double(), v.double())


def test_large_scores_stay_finite_and_the_first_query_sees_only_itself():
    """Scores in the hundreds (e^100 overflows float32 unless the softmax's max is taken off before exp), within
    1e-4 of float64 (the scores' own float32 rounding, about 1e-5 of a hundred, moves the weights); the first query's
    output is its own value row, whatever the later keys hold."""
    q, k, v = qkv_views(1, 2, 40, 64, seed=3)
    out = prompt_attention.attend(q * 10, k * 10, v, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q * 10, k * 10, v, 0.125), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0, 0].view(2, 64), v[0, :, 0], atol=0, rtol=0)


def test_a_head_size_the_kernel_does_not_take_is_an_error_naming_it():
    width = rows._load().rows_vector_width()
    q, k, v = qkv_views(1, 2, 5, width + 4)
    with pytest.raises(ValueError, match=f"head sizes that are multiples of {width} up to 256, got {width + 4}$"):
        prompt_attention.attend(q, k, v, 0.5)
    assert not prompt_attention.applies(q, k, v)


def tiny(**overrides) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    fields = {**dict(n_layer=2, n_head=4, n_embd=64, vocab_size=97, n_positions=64), **overrides}
    return GPT2LMHeadModel(GPT2Config(**fields)).eval()


@pytest.fixture
def spy(monkeypatch):
    """The (B, H, T, hs) shapes attend() was called with."""
    calls, real = [], prompt_attention.attend
    monkeypatch.setattr(prompt_attention, "attend",
                        lambda q, k, v, scale, lib=None: calls.append(tuple(q.shape)) or real(q, k, v, scale, lib))
    return calls


def test_a_models_prompt_takes_it_with_sdpas_logits_and_greedy_tokens(monkeypatch, spy):
    """A forward without gradients and generate's prompt (into the KV cache) take the kernel, a layer each; the
    logits match SDPA's (GPT2_PROMPT_ATTENTION=0) to float rounding and greedy decoding gives the same tokens. The
    decode steps (one new token over cached ones) never take it."""
    model = tiny(n_head=4, n_embd=64)  # head size 16: the native build's width on AVX512, two vectors on AVX2
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
        out = model.generate(ids[:1], max_new_tokens=6)
    assert spy == [(2, 4, 21, 16)] * 2 + [(1, 4, 21, 16)] * 2
    monkeypatch.setenv(prompt_attention.ENV, "0")
    with torch.no_grad():
        plain = model(ids)
        plain_out = model.generate(ids[:1], max_new_tokens=6)
    assert len(spy) == 4
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    assert torch.equal(out, plain_out)


def test_gradients_grouped_keys_cached_tokens_dropout_and_odd_heads_keep_sdpa(spy):
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    model = tiny()
    model(ids)["logits"].sum().backward()  # a training forward: gradients to take
    with torch.no_grad():
        tiny(n_kv_head=2)(ids)  # grouped key/value heads
        tiny(n_head=2, n_embd=40)(ids)  # head size 20: no multiple of either build's width
        training = tiny(attn_pdrop=0.1).train()
        training(ids)  # dropout on the attention weights, in training mode
        assert spy == []
        training.eval()(ids)  # the same model in evaluation: taken
        assert spy == [(1, 4, 12, 16)] * 2
        tiny(attn_pdrop=0.0).train()(ids)  # training mode without attention dropout and without gradients: taken
        assert spy == [(1, 4, 12, 16)] * 4
        bf16 = tiny().to(torch.bfloat16)
        logits = bf16(ids)["logits"]  # a bf16 model's evaluation: taken, but on AMX (torch's SDPA there)
        taken = 4 if rows.has_cpu_flag("amx_bf16") and os.environ.get(prompt_attention.ENV) != "force" else 6
        assert spy == [(1, 4, 12, 16)] * taken
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setenv(prompt_attention.ENV, "0")
        try:
            plain = bf16(ids)["logits"]  # SDPA's bf16
        finally:
            monkeypatch.undo()
    assert len(spy) == taken and logits.dtype == plain.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), plain.float(), atol=0.05, rtol=0.02)


def test_the_rule_at_its_edges():
    """Two tokens or more (one new token is a decode step's), head sizes up to MAX_HEAD, and grad mode on where
    nothing requires a gradient."""
    width = rows._load().rows_vector_width()
    assert prompt_attention.applies(*qkv_views(1, 2, 2, width))
    assert not prompt_attention.applies(*qkv_views(1, 2, 1, 64))
    assert prompt_attention.applies(*qkv_views(1, 1, 3, prompt_attention.MAX_HEAD))
    assert not prompt_attention.applies(*qkv_views(1, 1, 3, prompt_attention.MAX_HEAD + width))
    with torch.enable_grad():
        q, k, v = qkv_views(1, 2, 4, 64)
        assert prompt_attention.applies(q, k, v)
        assert not prompt_attention.applies(q.requires_grad_(), k, v)
