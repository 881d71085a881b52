"""modules/head_grad.py: a bf16 CPU training step's LM head weight gradient g^T h in blocks of vocabulary rows,
against autograd's one product and float64.

The blocks split the rows of the output, not the sums: each element is the same sum of N products. On the CPUs
measured the blocks give the one product's bits; the tests allow what a product kernel that blocks its sums by the
output's shape could change (at most 1 element in 1,000 apart, each within one bf16 rounding of float64), far less
than a wrong or missing block would (a whole block of rows). The forward and the hidden states' gradient are
F.linear's: equal to the bit.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import bf16_head_case, loss_and_grads

from modules import head_grad, transposed

case = bf16_head_case


def assert_one_product(dw: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """dw as autograd's g^T h: at most 1 in 1,000 elements apart, all within one bf16 rounding of float64."""
    g, x = grad.reshape(-1, grad.shape[-1]), h.reshape(-1, h.shape[-1])
    assert dw.shape == (g.shape[1], x.shape[1]) and dw.dtype == torch.bfloat16 and dw.is_contiguous()
    assert (dw != g.t() @ x).float().mean() <= 1e-3
    torch.testing.assert_close(dw.double(), g.double().t() @ x.double(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("vocab, block_rows", [(1, 8192), (7, 3), (100, 7), (100, 100), (100, 99), (2053, 512),
                                               (50257, head_grad.BLOCK_ROWS)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.filterwarnings("error")  # torch warns where a product resizes its output: a block that misses its rows
def test_the_blocks_cover_every_row_once_on_ragged_vocabularies(vocab, block_rows, threads):
    h, _, grad = case(37, vocab, 24)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dw = head_grad.weight_gradient(grad, h, block_rows)
    finally:
        torch.set_num_threads(before)
    assert_one_product(dw, grad, h)
    del dw  # its memory is likely the next gradient's: a row left unwritten would keep these values, not negated ones
    assert_one_product(head_grad.weight_gradient(-grad, h, block_rows), -grad, h)


def test_one_product_a_block(monkeypatch):
    h, _, grad = case(9, 100, 8)
    calls = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(1) or mm(*a, **k))
    for block_rows, blocks in ((7, 15), (50, 2), (100, 1), (8192, 1)):
        calls.clear()
        head_grad.weight_gradient(grad, h, block_rows)
        assert len(calls) == blocks


@pytest.mark.parametrize("shape", [(24,), (3, 40), (2, 5, 7)])
def test_the_head_is_f_linears_with_the_weight_gradient_in_blocks(shape, monkeypatch):
    monkeypatch.setattr(head_grad, "BLOCK_ROWS", 512)
    h, w, grad = case(0, 2053, 48, shape=shape)
    leaves = h.clone().requires_grad_(), w.clone().requires_grad_()
    y = head_grad.BlockedGradHead.apply(*leaves)
    y.backward(grad)
    ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_y = F.linear(*ref)
    ref_y.backward(grad)
    assert torch.equal(y, ref_y) and torch.equal(leaves[0].grad, ref[0].grad)
    assert_one_product(leaves[1].grad, grad, h)


def test_the_backward_takes_the_blocked_weight_gradient(monkeypatch):
    """(the blocks give the one product's bits, so only a count tells them from torch's single product)"""
    calls = []
    blocked = head_grad.weight_gradient
    monkeypatch.setattr(head_grad, "weight_gradient", lambda *a: calls.append(1) or blocked(*a))
    h, w, grad = case(0, 300, 16)
    leaves = h.clone().requires_grad_(), w.clone().requires_grad_()
    head_grad.BlockedGradHead.apply(*leaves).backward(grad)
    assert calls == [1]


def test_only_the_gradients_asked_for():
    h, w, grad = case(12, 300, 16)
    w = w.requires_grad_()
    head_grad.BlockedGradHead.apply(h, w).backward(grad)
    assert h.grad is None
    assert_one_product(w.grad, grad, h)
    h = h.requires_grad_()
    head_grad.BlockedGradHead.apply(h, w.detach()).backward(grad)
    assert torch.equal(h.grad, grad @ w.detach())


def test_where_it_applies(monkeypatch):
    monkeypatch.delenv(head_grad.ENV, raising=False)
    monkeypatch.setattr(head_grad, "HEAD_MIN_WEIGHT", 300 * 16)
    h, w, _ = case(4, 300, 16)
    w = w.requires_grad_()
    assert head_grad.applies(h, w) and head_grad.applies(h.view(2, 2, 16), w)
    assert head_grad.applies(h.requires_grad_(), w)
    assert not head_grad.applies(h, w[:-1])  # fewer values than HEAD_MIN_WEIGHT
    assert not head_grad.applies(h.float(), w.float())  # fp32 gains nothing: F.linear's
    assert not head_grad.applies(h, w.float()) and not head_grad.applies(h.float(), w)
    assert not head_grad.applies(h, w.detach())  # no weight gradient to take
    with torch.no_grad():
        assert not head_grad.applies(h, w)
    monkeypatch.setenv(head_grad.ENV, "0")
    assert not head_grad.applies(h, w)
    monkeypatch.setenv(head_grad.ENV, "1")
    assert head_grad.applies(h, w)


@pytest.mark.parametrize("setting", ["default", "off", "transposed"])
def test_the_models_head_takes_it_in_bf16_training_unless_the_transposed_head_does(setting, monkeypatch):
    """A bf16 model with the threshold at 0: the tied head's weight gradient in blocks, loss and every gradient as
    with it off (GPT2_HEAD_GRAD_BLOCKS=0); the transposed head (AMX, or forced) comes first; evaluation and fp32
    training keep F.linear."""
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel
    from modules import rows

    if setting == "transposed" and not rows.available():
        pytest.skip("the rows kernel does not build here")
    monkeypatch.setattr(head_grad, "HEAD_MIN_WEIGHT", 0)
    monkeypatch.setattr(transposed, "HEAD_MIN_WEIGHT", 0)
    monkeypatch.setattr(head_grad, "BLOCK_ROWS", 300)  # the tiny vocabulary in 4 blocks
    monkeypatch.setenv(transposed.ENV, "force" if setting == "transposed" else "0")
    monkeypatch.setenv(head_grad.ENV, "0" if setting == "off" else "1")
    calls = []
    apply = head_grad.BlockedGradHead.apply
    monkeypatch.setattr(head_grad.BlockedGradHead, "apply", lambda *a: calls.append(1) or apply(*a))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide")).to(torch.bfloat16).train()
    assert model.config.vocab_size > 3 * 300
    ids = torch.randint(0, 1000, (2, 12))

    def step():
        return loss_and_grads(model, ids)

    ours = step()
    assert calls == ([1] if setting == "default" else [])
    with torch.no_grad():
        model(ids)
    model.float()
    step()
    assert len(calls) == (1 if setting == "default" else 0)  # evaluation and fp32 training: F.linear
    model.to(torch.bfloat16)
    monkeypatch.setenv(head_grad.ENV, "0")
    monkeypatch.setenv(transposed.ENV, "0")
    reference = step()
    if setting == "transposed":  # the transposed products' own tolerances (tests/test_transposed.py)
        torch.testing.assert_close(ours[0], reference[0], rtol=1e-3, atol=1e-3)
        for name, grad in ours[1].items():
            torch.testing.assert_close(grad.float(), reference[1][name].float(), rtol=2e-2, atol=4e-3)
        return
    assert torch.equal(ours[0], reference[0])  # the forward is F.linear's
    for name, grad in ours[1].items():  # only the head's weight gradient is blocked; the rest follows from it
        assert (grad != reference[1][name]).float().mean() <= 1e-3, name
        torch.testing.assert_close(grad.float(), reference[1][name].float(), rtol=2 ** -7, atol=1e-3)
