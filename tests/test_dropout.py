"""modules/dropout.py: the one-pass hashed dropout our models use in CPU training, against torch's nn.Dropout's
contract (rate, scale, backward, eval identity, seeding) and its own (counter-based masks, the AVX2 build equal to
the native one, checkpointing recomputes the same masks)."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import check_kernel_loader, checkpointed_twin, tiny_config
from torch import nn

from modules import dropout as hashed
from modules import rows

pytestmark = pytest.mark.skipif(not hashed.available(), reason="the dropout kernel cannot be built on this machine")

Z = 5.0  # binomial bounds: mean +- Z standard deviations (a false failure about once in 3.5 million)


def within_binomial(kept: int, n: int, q: float) -> bool:
    return abs(kept - n * q) <= Z * math.sqrt(n * q * (1 - q))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_at_rate_one_minus_p_and_scales_kept_entries_by_one_over_one_minus_p(p, dtype):
    torch.manual_seed(0)
    x = (torch.rand(1 << 20) + 0.5).to(dtype)  # no zeros: an output 0 means dropped
    y = hashed.Dropout(p).train()(x)
    kept = y != 0
    assert within_binomial(int(kept.sum()), x.numel(), 1 - p)
    expected = (x.float() * (1.0 / (1.0 - p))).to(dtype)  # one rounding, as torch's x * mask * scale
    assert torch.equal(y[kept], expected[kept])


def test_masks_have_no_correlation_between_neighbours_or_calls():
    n, p = 1 << 20, 0.5
    a, b = hashed.keep_mask(n, p, seed=1234), hashed.keep_mask(n, p, seed=1235)
    for first, second in ((a[:-1], a[1:]), (a[:-16], a[16:]), (a, b)):  # neighbours, one vector apart, two seeds
        both = int((first & second).sum())
        assert within_binomial(both, first.numel(), (1 - p) ** 2)
    # the index's high part is mixed in per block of 2^14: blocks do not repeat each other
    block = 1 << 14
    assert within_binomial(int((a[:block] & a[block:2 * block]).sum()), block, (1 - p) ** 2)


def test_the_mask_is_a_function_of_seed_and_index_alone():
    p, seed = 0.3, 99
    long, short = hashed.keep_mask(100_000, p, seed), hashed.keep_mask(1000, p, seed)
    assert torch.equal(long[:1000], short)
    x = torch.ones(100_000)
    torch.set_num_threads(2)
    y = hashed.apply_mask(x, p, seed)  # the threaded kernel draws the same mask as the one-thread function
    assert torch.equal(y != 0, long)


def test_backward_applies_the_forward_mask_to_the_gradient():
    torch.manual_seed(3)
    p = 0.25
    x = (torch.rand(4, 12, 33, 33) + 0.5).requires_grad_()
    y = hashed.Dropout(p).train()(x)
    upstream = torch.randn_like(y)
    y.backward(upstream)
    assert torch.equal(x.grad, upstream * (y != 0) * (1.0 / (1.0 - p)))


def test_a_second_derivative_is_refused_rather_than_silently_zero():
    x = torch.rand(64, requires_grad=True)
    y = hashed.Dropout(0.5).train()(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_torch_manual_seed_repeats_the_masks_and_a_new_seed_changes_them():
    m, x = hashed.Dropout(0.5).train(), torch.rand(10_000) + 0.5
    torch.manual_seed(7)
    first, second = m(x), m(x)
    torch.manual_seed(7)
    assert torch.equal(m(x), first)
    assert not torch.equal(first, second)


def test_is_an_nn_dropout_and_is_the_identity_in_eval_and_at_p_zero():
    m = hashed.Dropout(0.1)
    assert isinstance(m, nn.Dropout) and repr(m) == repr(nn.Dropout(0.1))
    x = torch.rand(1000)
    assert m.eval()(x) is x or torch.equal(m.eval()(x), x)
    assert torch.equal(hashed.Dropout(0.0).train()(x), x)
    assert torch.equal(hashed.Dropout(1.0).train()(x), torch.zeros_like(x))  # torch's dropout at p = 1


def test_other_dtypes_inplace_and_switched_off_run_torchs_dropout(monkeypatch):
    calls = []
    monkeypatch.setattr(hashed._HashedDropout, "apply", lambda *a: calls.append(a) or a[0])
    x64 = torch.rand(1000, dtype=torch.float64)
    y = hashed.Dropout(0.5).train()(x64)
    assert y.dtype == torch.float64 and calls == [] and 300 < int((y == 0).sum()) < 700
    hashed.Dropout(0.5, inplace=True).train()(torch.rand(1000))
    assert calls == []
    hashed.Dropout(0.5).train()(torch.rand(1000))
    assert len(calls) == 1
    monkeypatch.setattr(hashed, "_library", False)  # GPT2_FAST_DROPOUT=0 or no compiler
    hashed.Dropout(0.5).train()(torch.rand(1000))
    assert len(calls) == 1


def test_a_dropped_nan_or_infinity_gives_nan_as_torchs_does():
    x = torch.full((4096,), float("nan"))
    x[::2] = float("inf")
    y = hashed.Dropout(0.5).train()(x)
    assert torch.isnan(y[1::2]).all()
    assert (torch.isinf(y[::2]) | torch.isnan(y[::2])).all() and torch.isnan(y[::2]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_draws_and_scales_exactly_as_the_native_one(dtype):
    if "avx2" not in rows.cpu_flags().split():
        pytest.skip("no AVX2 on this CPU")
    native, avx2 = hashed.library(rows.NATIVE), hashed.library(rows.AVX2)
    x = torch.randn(100_003).to(dtype)
    for p, seed in ((0.1, 5), (0.5, 2**62 + 11)):
        assert torch.equal(hashed.apply_mask(x, p, seed, native), hashed.apply_mask(x, p, seed, avx2))


def test_the_model_uses_it_in_cpu_training_and_checkpointing_recomputes_the_same_masks(monkeypatch):
    config = tiny_config("h4-wide", resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    a, b = checkpointed_twin(config)
    ids = torch.randint(0, config.vocab_size, (2, 10))
    calls = []
    apply = hashed._HashedDropout.apply
    monkeypatch.setattr(hashed._HashedDropout, "apply", lambda *args: calls.append(1) or apply(*args))
    losses = []
    for model in (a, b):
        torch.manual_seed(1)
        loss = model(ids, labels=ids)["loss"]
        loss.backward()
        losses.append(loss.detach())
    assert len(calls) >= 2 * (1 + 3 * config.n_layer)  # embedding, attention probabilities, two residuals per layer
    assert torch.equal(losses[0], losses[1])
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=0, msg=name)
    with torch.no_grad():  # eval: no dropout at all, so the two models agree with dropout p
        assert torch.equal(a.eval()(ids)["logits"], b.eval()(ids)["logits"])


def test_a_kernel_that_cannot_be_built_or_is_switched_off_loads_as_false_with_a_warning_naming_it(monkeypatch):
    built = []
    monkeypatch.setenv("GPT2_SOME_KERNEL", "0")
    assert rows.load_kernel("GPT2_SOME_KERNEL", lambda: built.append(1), "k", "fallback") is False and not built

    def failing_build():
        raise RuntimeError("g++: not found")
    monkeypatch.setenv("GPT2_SOME_KERNEL", "1")
    with pytest.warns(UserWarning, match=r"the kernel x\.cpp could not be built \(RuntimeError: g\+\+: not found\); "
                                         r"torch's runs"):
        assert rows.load_kernel("GPT2_SOME_KERNEL", failing_build, "the kernel x.cpp", "torch's runs") is False


def test_the_dropout_kernel_loads_once_under_its_switch_and_a_failed_build_names_itself(monkeypatch):
    """modules/dropout.py's own loader (conftest.check_kernel_loader); a fresh build is the library the module uses."""
    assert check_kernel_loader(monkeypatch, hashed, hashed.ENV, r"^the dropout kernel modules/dropout\.cpp could not "
                                                                r"be built \(OSError: no compiler here\); dropout runs torch's")
    fresh = hashed.library()  # its argument types hold a 64-bit seed (ctypes' default int would refuse or cut it)
    seed = 2**62 + 12345
    assert torch.equal(hashed.keep_mask(4096, 0.5, seed, lib=fresh), hashed.keep_mask(4096, 0.5, seed))
    assert not torch.equal(hashed.keep_mask(4096, 0.5, seed), hashed.keep_mask(4096, 0.5, seed + 2**40))


def test_the_threshold_stays_a_32_bit_value_and_a_rate_next_to_one_drops_everything():
    assert hashed.threshold(0.5) == 2**31 and hashed.threshold(0.0) == 0
    p = 1 - 1e-12  # rounds to 2**32, one past what 32 bits hold
    assert hashed.threshold(p) == 2**32 - 1
    assert int(hashed.keep_mask(1 << 16, p, 7).sum()) == 0


def test_seeds_span_63_bits_and_p_zero_draws_none():
    torch.manual_seed(0)
    seeds = [hashed.draw_seed() for _ in range(20)]
    assert max(seeds) > 2**40 and len(set(seeds)) == 20  # an int64 draw, not a float's 24 bits
    torch.manual_seed(0)
    state = torch.get_rng_state()
    x = torch.rand(1000)
    torch.set_rng_state(state)
    hashed.Dropout(0.0).train()(x)  # the identity, as torch's: no seed drawn from the generator
    assert torch.equal(torch.get_rng_state(), state)
