"""modules/cross_entropy.py against F.cross_entropy on the upcast logits: loss and gradient.

fp32: atol 1e-6 (the two add in different orders). bf16 / fp16 logits: the loss against F.cross_entropy(logits.float())
at 1e-6 and the gradient, which comes in the logits' dtype, within one rounding of the reference's fp32 gradient.
Blocks of rows are made small (CHUNK_ELEMENTS patched) so that several blocks and a ragged last one are exercised.
"""
import pytest
import torch
import torch.nn.functional as F

from modules import cross_entropy as chunked


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 3 * 37)  # 3 rows a block for V = 37
    monkeypatch.setattr(chunked, "MIN_ELEMENTS", 0)  # blocks for any size of logits


def test_small_logits_go_to_f_cross_entropy(monkeypatch):
    monkeypatch.setattr(chunked, "MIN_ELEMENTS", 10 * 37 + 1)
    logits, targets = case()
    assert not chunked.applies(logits)
    assert chunked.cross_entropy(logits.requires_grad_(), targets).grad_fn.name() != "ChunkedCrossEntropyBackward"
    monkeypatch.setattr(chunked, "MIN_ELEMENTS", 10 * 37)
    assert chunked.cross_entropy(logits, targets).grad_fn.name() == "ChunkedCrossEntropyBackward"


def case(n=10, vocab=37, dtype=torch.float32, ignored=(2, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[list(ignored)] = -100
    return logits, targets


def loss_and_grad(fn, logits, targets, scale=1.0, **kwargs):
    x = logits.clone().requires_grad_()
    loss = fn(x, targets, **kwargs)
    (loss * scale).sum().backward()
    return loss.detach(), x.grad


def reference(logits, targets, **kwargs):
    return F.cross_entropy(logits.float(), targets, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp32_loss_and_gradient_match_f_cross_entropy(reduction):
    logits, targets = case()
    assert chunked.rows_per_chunk(logits.shape[1]) == 3
    ours = loss_and_grad(chunked.cross_entropy, logits, targets, 2.5, reduction=reduction)
    ref = loss_and_grad(reference, logits, targets, 2.5, reduction=reduction)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logits_are_left_as_they_were(dtype):
    """The model returns these logits to the caller: backward must not compute the softmax in their storage."""
    logits, targets = case(dtype=dtype)
    x = logits.clone().requires_grad_()
    chunked.cross_entropy(x, targets).backward()
    assert torch.equal(x.detach(), logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_computed_in_fp32(dtype):
    logits, targets = case(dtype=dtype)
    loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets)
    ref_loss, ref_grad = loss_and_grad(reference, logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)  # the same fp32 gradient, rounded once


def test_float64_is_kept():
    logits, targets = case(dtype=torch.float64)
    loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets)
    ref_loss, ref_grad = loss_and_grad(F.cross_entropy, logits, targets)
    assert loss.dtype == grad.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_nothing_counted_gives_nan_and_a_zero_gradient_like_f_cross_entropy():
    logits, targets = case(ignored=range(10))
    loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets)
    assert torch.isnan(loss)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_under_autocast_and_inference_mode():
    logits, targets = case(dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets)
    torch.testing.assert_close(loss, reference(logits, targets), atol=1e-6, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(chunked.cross_entropy(logits, targets), loss, atol=0, rtol=0)


def test_bad_targets_and_shapes_are_named():
    logits, targets = case()
    targets[4] = 37
    with pytest.raises(ValueError, match=r"class indices in \[0, 37\).*got 37"):
        chunked.cross_entropy(logits, targets)
    targets[4] = -5
    with pytest.raises(ValueError, match="got -5"):
        chunked.cross_entropy(logits, targets)
    with pytest.raises(ValueError, match=r"logits \(N, V\) and targets \(N,\)"):
        chunked.cross_entropy(logits[None], targets)
    with pytest.raises(ValueError, match="reduction"):
        chunked.cross_entropy(logits, targets.clamp(min=0), reduction="max")


def test_the_lm_loss_takes_it_and_still_matches_f_cross_entropy():
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel, lm_loss

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide"))
    assert model.cross_entropy is chunked.cross_entropy
    ids = torch.randint(0, 1000, (2, 9))
    logits = model(ids)["logits"].detach()
    ours = lm_loss(logits, ids, None, 9)
    ref = lm_loss(logits, ids, None, 9, lambda z, y, ignore_index: F.cross_entropy(z, y, ignore_index=ignore_index))
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
