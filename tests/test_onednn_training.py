"""modules/onednn.py's training products: TrainingLinear's forward and gradients against F.linear's autograd (fp32,
within 1e-4 of values of about 30: oneDNN blocks the sums differently from MKL), where Linear layers, the LM head and
the fused q/k/v product take it and where not, a whole model's gradients with it against without, and its choice
(GPT2_ONEDNN_TRAINING; timed twice, cached, not timed on a busy machine)."""
from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel
from modules import fused_qkv, onednn, rows, transposed
from modules.linear import Linear
from tests.conftest import loss_and_grads

needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available()
                                       and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
                                  reason="torch has no oneDNN inner product here")
TOL = dict(atol=1e-4, rtol=1e-5)


def reference(x, w, b, grad):
    """F.linear's output and autograd's gradients of x, w and b (those that require one) for the output's grad."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in (x, w, b)]
    out = F.linear(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad if t is not None else None for t in leaves]


def taken(x, w, b, grad):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in (x, w, b)]
    out = onednn.TrainingLinear.apply(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad if t is not None else None for t in leaves]


@needs_onednn
@pytest.mark.parametrize("shape", [(300,), (3, 100), (2, 7, 9)])
@pytest.mark.parametrize("bias", [True, False])
def test_its_output_and_gradients_are_f_linears_to_float_rounding(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 256, generator=g).requires_grad_()
    w = torch.randn(513, 256, generator=g).requires_grad_()  # odd out_features
    b = torch.randn(513, generator=g).requires_grad_() if bias else None
    grad = torch.randn(*shape, 513, generator=g)
    (out, grads), (want, want_grads) = taken(x, w, b, grad), reference(x, w, b, grad)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, **TOL)
    for got, expected in zip(grads, want_grads):
        if expected is None:
            assert got is None
        else:
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, **TOL)


@needs_onednn
def test_strided_inputs_and_an_expanded_gradient_give_f_linears_values():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 40, generator=g).t().requires_grad_()  # (40, 256), column-major
    w = torch.randn(256, 300, generator=g).t().requires_grad_()  # (300, 256), a transposed weight
    grad = torch.randn(1, 300, generator=g).expand(40, 300)  # stride 0: oneDNN's op takes any strides
    (out, grads), (want, want_grads) = taken(x, w, None, grad), reference(x, w, None, grad)
    torch.testing.assert_close(out, want, **TOL)
    for got, expected in zip(grads[:2], want_grads[:2]):
        torch.testing.assert_close(got, expected, **TOL)


@needs_onednn
def test_only_the_gradients_asked_for_are_computed(monkeypatch):
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda x, w, b=None: calls.append(tuple(w.shape)) or real(x, w, b))
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(20, 64, generator=g), torch.randn(96, 64, generator=g).requires_grad_()
    onednn.TrainingLinear.apply(x, w, None).sum().backward()  # a frozen input: no g W
    assert calls == [(96, 64), (64, 20)] and x.grad is None
    calls.clear()
    x.requires_grad_()
    w.grad = None
    w.requires_grad_(False)
    onednn.TrainingLinear.apply(x, w, None).sum().backward()  # a frozen weight: no g^T x
    assert calls == [(96, 64), (64, 96)] and w.grad is None


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(onednn.TRAINING_ENV, "1")
    monkeypatch.setattr(onednn, "has_inner_product", lambda: True)


def test_it_applies_to_fp32_cpu_training_products_of_9_rows_and_2_18_values_only(monkeypatch, forced):
    w = torch.zeros(512, 512, requires_grad=True)  # 2^18 values: the smallest weight it takes
    x = torch.zeros(9, 512)
    assert onednn.training_applies(x, w)
    assert onednn.training_applies(torch.zeros(3, 3, 512), w)
    assert not onednn.training_applies(torch.zeros(8, 512), w)  # decode's few rows
    assert not onednn.training_applies(x, torch.zeros(511, 512, requires_grad=True))  # a smaller weight
    assert not onednn.training_applies(x.bfloat16(), w.detach().bfloat16().requires_grad_())
    assert not onednn.training_applies(torch.zeros(512), w)  # one vector
    assert not onednn.training_applies(x, w.detach())  # nothing requires a gradient
    assert onednn.training_applies(x.requires_grad_(), w.detach())  # the input's gradient alone
    with torch.no_grad():
        assert not onednn.training_applies(x, w)  # inference: onednn.applies decides
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not onednn.training_applies(x, w)  # autocast's casts stay F.linear's
    monkeypatch.setenv(onednn.TRAINING_ENV, "0")
    assert not onednn.training_applies(x, w)
    monkeypatch.setenv(onednn.ENV, "0")  # the inference products' switch leaves training's alone
    monkeypatch.setenv(onednn.TRAINING_ENV, "1")
    assert onednn.training_applies(x, w)


@needs_onednn
def test_a_linear_and_the_head_take_it_in_training_and_not_without_gradients(monkeypatch, forced):
    calls = []
    real = onednn.TrainingLinear.apply
    monkeypatch.setattr(onednn.TrainingLinear, "apply", lambda *a: calls.append(tuple(a[1].shape)) or real(*a))
    monkeypatch.setenv(onednn.ENV, "0")  # inference's own oneDNN products out of the way
    torch.manual_seed(0)
    layer = Linear(512, 1024)
    x = torch.randn(2, 20, 512, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), **TOL)
    y.sum().backward()
    with torch.no_grad():
        layer(x)
    transposed.head(torch.randn(30, 512, requires_grad=True), torch.randn(1024, 512))
    monkeypatch.setenv(onednn.TRAINING_ENV, "0")
    layer(x).sum().backward()
    assert calls == [(1024, 512), (1024, 512)]


@needs_onednn
def test_the_fused_qkv_product_with_it_gives_the_plain_ones_values(monkeypatch, forced):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, 512, generator=g, requires_grad=True)
    ws = [torch.randn(512, 512, generator=g, requires_grad=True) for _ in range(3)]
    bs = [torch.randn(512, generator=g, requires_grad=True) for _ in range(3)]
    grad = torch.randn(2, 12, 1536, generator=g)
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda a, w, b=None: calls.append(tuple(w.shape)) or real(a, w, b))
    assert onednn.training_applies(x, ws[0][:100], values=3 * ws[0].numel())  # the three weights' values count
    assert not onednn.training_applies(x, ws[0], values=3 * 170 * 512)  # 261120 values: under 2^18
    out = fused_qkv.QKVLinear.apply(x, *ws, *bs, True)
    out.backward(grad)
    got = [out.detach()] + [t.grad.clone() for t in (x, *ws, *bs)]
    assert calls == [(1536, 512), (512, 1536), (512, 24)]  # forward, g W, g^T x
    for t in (x, *ws, *bs):
        t.grad = None
    want = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)
    want.backward(grad)
    for a, b in zip(got, [want.detach()] + [t.grad for t in (x, *ws, *bs)]):
        torch.testing.assert_close(a, b, **TOL)


@needs_onednn
def test_a_models_training_gradients_with_it_are_the_plain_ones(monkeypatch):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=1024, n_positions=64))
    model.eval()  # no dropout; grad mode still on
    ids = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(1))
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda a, w, b=None: calls.append(1) or real(a, w, b))
    monkeypatch.setenv(onednn.TRAINING_ENV, "1")
    loss, grads = loss_and_grads(model, ids)
    assert calls  # the MLP's 1024 x 256 weights (2^18 values) and the tied head took it
    monkeypatch.setenv(onednn.TRAINING_ENV, "0")
    plain_loss, plain = loss_and_grads(model, ids)
    torch.testing.assert_close(loss, plain_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == plain.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture
def fresh(onednn_fresh):
    return onednn_fresh  # conftest's: no setting, an empty kernel cache, no choice made yet


def test_the_choice_is_timed_twice_cached_and_read_by_later_processes(monkeypatch, fresh):
    timings = iter([{"onednn": 400.0, "torch": 200.0}, {"onednn": 390.0, "torch": 210.0}])
    monkeypatch.setattr(onednn, "time_training", lambda: next(timings))
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    chosen = onednn.training_choice()
    assert chosen["takes"] and chosen["source"].startswith("timed, cached in ") and len(chosen["speeds"]) == 2
    (cached,) = fresh.glob("onednn-training-*.json")
    assert json.loads(cached.read_text()) == chosen
    monkeypatch.setattr(onednn, "_choices", {})  # a later process: reads the file, times nothing
    monkeypatch.setattr(onednn, "time_training", lambda: pytest.fail("timed again"))
    assert onednn.training_choice() == chosen
    assert onednn.training_choice() is onednn._choices[onednn.TRAINING_ENV]  # then kept in the process


def test_it_takes_oneDNN_only_where_both_timings_read_it_margin_faster(monkeypatch, fresh):
    timings = iter([{"onednn": 400.0, "torch": 200.0}, {"onednn": 204.0, "torch": 200.0}])
    monkeypatch.setattr(onednn, "time_training", lambda: next(timings))
    monkeypatch.setattr(rows, "machine_busy", lambda: None)
    assert onednn.training_choice()["takes"] is False


def test_a_busy_machine_is_not_timed_for_training_either(monkeypatch, fresh):
    monkeypatch.setattr(rows, "machine_busy", lambda: "load average 3.0 on 2 cores")
    monkeypatch.setattr(onednn, "time_training", lambda: pytest.fail("timed on a busy machine"))
    chosen = onednn.training_choice()
    assert not chosen["takes"] and chosen["source"] == "not timed: the machine is busy (load average 3.0 on 2 cores)"
    assert list(fresh.iterdir()) == []


def test_the_training_setting_forces_either_side_and_anything_else_is_an_error(monkeypatch, fresh):
    monkeypatch.setattr(onednn, "time_training", lambda: pytest.fail("timed with a setting"))
    monkeypatch.setenv(onednn.TRAINING_ENV, "1")
    assert onednn.training_choice() == {"takes": True, "source": f"{onednn.TRAINING_ENV}=1"}
    monkeypatch.setenv(onednn.TRAINING_ENV, "0")
    assert onednn.training_choice() == {"takes": False, "source": f"{onednn.TRAINING_ENV}=0"}
    monkeypatch.setenv(onednn.TRAINING_ENV, "on")
    with pytest.raises(ValueError, match=f"^{onednn.TRAINING_ENV} must be 0 \\(F.linear\\), 1 \\(oneDNN\\) or unset"):
        onednn.training_choice()
    monkeypatch.setenv(onednn.TRAINING_ENV, "1")
    monkeypatch.setattr(onednn, "has_inner_product", lambda: False)  # no oneDNN: not even forced
    assert onednn.training_choice() == {"takes": False, "source": "torch has no oneDNN inner product here"}


@needs_onednn
def test_the_timing_reads_both_libraries_rates_of_the_three_products():
    speeds = onednn.time_training(rounds=1, n=16)
    assert speeds.keys() == {"onednn", "torch"} and all(v > 0 for v in speeds.values())


@needs_onednn
def test_a_lora_layers_frozen_base_takes_it_for_the_inputs_gradient(monkeypatch, forced):
    from modules.lora import LoRALinear

    calls = []
    real = onednn.TrainingLinear.apply
    monkeypatch.setattr(onednn.TrainingLinear, "apply", lambda *a: calls.append(tuple(a[1].shape)) or real(*a))
    torch.manual_seed(0)
    base = Linear(512, 512)
    plain = base.weight.detach().clone(), base.bias.detach().clone()
    layer = LoRALinear(base, rank=4, alpha=8)
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 10, 512, requires_grad=True)
    layer(x).sum().backward()
    assert calls == [(512, 512)] and layer.weight.grad is None and layer.lora_B.grad is not None
    got = x.grad
    x.grad = None
    h = F.linear(x, layer.lora_A)
    (F.linear(x, *plain) + layer.scaling * F.linear(h, layer.lora_B)).sum().backward()
    torch.testing.assert_close(got, x.grad, **TOL)
    with torch.no_grad():
        layer(x)  # evaluation: F.linear's (or onednn.linear's) product, not training's
    assert calls == [(512, 512)]


@needs_onednn
def test_gradient_checkpointing_recomputes_through_it_to_the_plain_gradients(monkeypatch):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=1024, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).train()
    model.gpt.gradient_checkpointing = True
    ids = torch.randint(0, 1024, (2, 30), generator=torch.Generator().manual_seed(1))
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda a, w, b=None: calls.append(1) or real(a, w, b))
    monkeypatch.setenv(onednn.TRAINING_ENV, "1")
    loss, grads = loss_and_grads(model, ids)
    taken = len(calls)
    monkeypatch.setenv(onednn.TRAINING_ENV, "0")
    model.gpt.gradient_checkpointing = False
    plain_loss, plain = loss_and_grads(model, ids)
    # per layer the MLP's two weights: forward, recomputed forward, two gradients; the head: forward, two gradients
    assert taken == 2 * 2 * 4 + 3 and len(calls) == taken
    torch.testing.assert_close(loss, plain_loss, atol=1e-5, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], plain[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_training_timings_cache_is_keyed_by_the_cpus_flags_torch_and_the_rows_timed(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    path = onednn._training_path()
    assert path.parent == tmp_path and re.fullmatch(r"onednn-training-[0-9a-f]{16}\.json", path.name)
    assert path != onednn._path()  # not the inference choice's file
    monkeypatch.setattr(onednn, "TRAINING_ROWS", 512)
    assert onednn._training_path() != path
    monkeypatch.undo()
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(rows.CPU_FLAGS_ENV, "fpu avx2 fma")
    assert onednn._training_path() != path
    monkeypatch.delenv(rows.CPU_FLAGS_ENV)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert onednn._training_path() != path


def test_the_timing_reads_the_three_products_of_each_library_as_gflops(monkeypatch):
    calls = []
    monkeypatch.setattr(onednn, "linear", lambda x, w, b=None: calls.append(("onednn", x.shape, w.shape, b is not None)))
    monkeypatch.setattr(onednn.F, "linear", lambda x, w, b=None: calls.append(("torch", x.shape, w.shape, b is not None)))

    def interleaved(contenders, rounds):
        assert rounds == 3
        for run in contenders.values():
            run()
        return {"onednn": [1.0, 9.0, 1.0], "torch": [2.0, 2.0, 0.1]}

    monkeypatch.setattr(rows, "interleaved", interleaved)
    speeds = onednn.time_training(rounds=3, n=16)
    flop = 3 * 2 * 16 * 2 * 3072 * 768
    assert speeds == {"onednn": pytest.approx(flop / 1e9), "torch": pytest.approx(flop / 2 / 1e9)}
    onednn_calls = [c[1:] for c in calls if c[0] == "onednn"]
    # each weight: warm-up, then the timed round: forward with the bias, g W, g^T x
    per_round = [((16, 768), (3072, 768), True), ((16, 3072), (768, 3072), False), ((3072, 16), (768, 16), False),
                 ((16, 3072), (768, 3072), True), ((16, 768), (3072, 768), False), ((768, 16), (3072, 16), False)]
    assert onednn_calls == per_round * 2
    assert [c[1:] for c in calls if c[0] == "torch"] == [((16, 768), (3072, 768), True),
                                                         ((16, 3072), (768, 3072), True)] * 2


def test_there_is_no_inner_product_without_oneDNN(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not onednn.has_inner_product() and not onednn.available()
    monkeypatch.setenv(onednn.TRAINING_ENV, "1")
    assert onednn.training_choice() == {"takes": False, "source": "torch has no oneDNN inner product here"}


@needs_onednn
def test_the_inference_products_start_past_8_rows(monkeypatch):
    monkeypatch.setenv(onednn.ENV, "1")
    w = torch.zeros(512, 512)
    with torch.no_grad():
        assert onednn.applies(torch.zeros(9, 512), w) and not onednn.applies(torch.zeros(8, 512), w)


def test_the_inference_timings_race_gpt2_shaped_weights_at_their_documented_budget(monkeypatch):
    seen = {}
    monkeypatch.setattr(rows, "time_products", lambda products, counts, megabytes, rounds: seen.update(
        products=products, counts=counts, megabytes=megabytes, rounds=rounds) or {str(counts[0]): {"onednn": 1.0}})
    assert onednn.time_products() == {"onednn": 1.0}
    assert seen == {"products": {"onednn": onednn.linear, "torch": F.linear}, "counts": [onednn.PROMPT_ROWS],
                    "megabytes": 16, "rounds": 5}
    monkeypatch.setattr(rows, "prompt_library", lambda: "the plan's library")
    monkeypatch.setattr(rows, "time_prompt_rows", lambda *a, **k: seen.update(args=a, kwargs=k) or "timed")
    assert onednn.time_kernel_rows([16, 32]) == "timed"
    assert seen["args"] == ("the plan's library", [16, 32], 64, 5)
    assert seen["kwargs"] == {"against": ("onednn", onednn.linear)}


@needs_onednn
def test_the_fused_qkv_product_takes_it_by_the_three_weights_values_and_not_by_default(monkeypatch, forced):
    calls, real = [], onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda a, w, b=None: calls.append(tuple(w.shape)) or real(a, w, b))
    torch.manual_seed(0)
    qkv = [Linear(300, 300) for _ in range(3)]  # 90000 values each: 270000 together, past 2^18
    x = torch.randn(2, 12, 300, requires_grad=True)
    fused_qkv.project(x, qkv).sum().backward()
    assert calls == [(900, 300), (300, 900), (300, 24)]
    calls.clear()
    fused_qkv.QKVLinear.apply(x, *(m.weight for m in qkv), *(m.bias for m in qkv)).sum().backward()
    assert calls == []  # QKVLinear alone keeps F.linear's products
