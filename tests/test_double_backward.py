"""Second derivatives through our kernels' autograd Functions: `torch.autograd.grad(..., create_graph=True)` and a
backward of what it returns (gradient penalties, Hessian-vector products, MAML). Each Function's backward runs torch's
ops in that case (modules/transforms.torch_backward, or the rule in torch's ops), so the second derivatives must
equal the ones of torch's own op; the whole model's equal transformers'."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import graph_names, tiny_config

from models.gpt2 import GPT2LMHeadModel
from models.loading import hf_to_ours
from modules import (
    cross_entropy,
    dropout,
    fused_qkv,
    gelu,
    head_grad,
    layer_norm,
    masked_softmax,
    onednn,
    rmsnorm,
    rows,
    transposed,
)

pytestmark = pytest.mark.usefixtures("fused_paths_on")  # the kernels these tests differentiate twice


def hvp(fn, inputs: list[torch.Tensor], seed: int = 1, varied: list[int] | None = None) -> list[torch.Tensor]:
    """d/d inputs of <d fn(inputs)/d inputs . v, u>: a Hessian-vector product of the scalar <fn(inputs), w>, with
    random w, u (the first gradient taken with create_graph=True, then differentiated). varied: the inputs that ask
    for gradients (all by default); the others are constants, and their entries zeros."""
    g = torch.Generator().manual_seed(seed)
    varied = list(range(len(inputs))) if varied is None else varied
    inputs = [x.detach().clone().requires_grad_(i in varied) for i, x in enumerate(inputs)]
    leaves = [inputs[i] for i in varied]
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=g).to(out.dtype)
    first = torch.autograd.grad((out.float() * w.float()).sum(), leaves, create_graph=True)
    u = [torch.randn(x.shape, generator=g).to(x.dtype) for x in leaves]
    second = torch.autograd.grad(sum((d.float() * v.float()).sum() for d, v in zip(first, u)), leaves,
                                 allow_unused=True)
    found = {i: torch.zeros_like(x) if s is None else s for i, s, x in zip(varied, second, leaves)}
    return [found.get(i, torch.zeros_like(x)) for i, x in enumerate(inputs)]


def assert_same(ours: list[torch.Tensor], reference: list[torch.Tensor], bf16: bool) -> None:
    for i, (a, b) in enumerate(zip(ours, reference)):
        if bf16:  # two routes to bf16 values: their rounding differs
            error = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)
            assert error < 3e-2, (i, error.item())
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"input {i}")


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def test_gelu():
    x = randn(4, 300)
    assert gelu.applies(x.requires_grad_())
    assert_same(hvp(gelu.gelu_new, [x]), hvp(lambda x: F.gelu(x, approximate="tanh"), [x]), bf16=False)


def test_layer_norm_bf16():
    """(batch, time, width) as in the model, and an eps of the values' scale: it shapes the derivatives"""
    x = randn(2, 3, 64, dtype=torch.bfloat16, scale=0.3)
    w, b = randn(64, dtype=torch.bfloat16, seed=1), randn(64, dtype=torch.bfloat16, seed=2)
    assert layer_norm.applies(x.requires_grad_(), (64,), w, b)
    assert_same(hvp(lambda x, w, b: layer_norm.layer_norm(x, (64,), w, b, eps=0.05), [x, w, b]),
                hvp(lambda x, w, b: F.layer_norm(x, (64,), w, b, eps=0.05), [x, w, b]), bf16=True)


def test_layer_norm_bf16_frozen_weights():
    """Only the input asks for a gradient (a frozen norm): the others are not differentiated."""
    x, w, b = randn(6, 64, dtype=torch.bfloat16), randn(64, dtype=torch.bfloat16, seed=1), randn(64, seed=2)
    b = b.to(torch.bfloat16)
    assert_same(hvp(lambda x: layer_norm.layer_norm(x, (64,), w, b), [x]),
                hvp(lambda x: F.layer_norm(x, (64,), w, b), [x]), bf16=True)


@pytest.mark.parametrize("masked", [False, True])
def test_masked_softmax(masked):
    scores = randn(2, 3, 8, 8)
    mask = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8).clone() if masked else None
    if masked:
        mask[1, :, :, 0] = False  # padding: the first key of the second row
    assert masked_softmax.applies(scores.requires_grad_(), mask)

    def reference(s):  # no mask: causal (as the explicit attention passes it)
        allowed = torch.ones(8, 8, dtype=torch.bool).tril() if mask is None else mask
        return torch.softmax((s * 0.3).masked_fill(~allowed, float("-inf")), -1)

    assert_same(hvp(lambda s: masked_softmax.masked_softmax(s, 0.3, mask), [scores]), hvp(reference, [scores]),
                bf16=False)


def test_dropout():
    x = randn(5, 40)
    seed, p = 1234, 0.3
    keep = dropout.keep_mask(x.numel(), p, seed).view(x.shape)
    ours = hvp(lambda x: dropout._HashedDropout.apply(x, p, seed) ** 2, [x])  # a square: a second derivative to take
    assert_same(ours, hvp(lambda x: (x * keep / (1 - p)) ** 2, [x]), bf16=False)


def test_cross_entropy(monkeypatch):
    monkeypatch.setattr(cross_entropy, "MIN_ELEMENTS", 0)
    logits, targets = randn(12, 50), torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(3))
    targets[4] = -100
    assert cross_entropy.applies(logits)
    for reduction in ("mean", "sum"):
        assert_same(hvp(lambda z: cross_entropy.cross_entropy(z, targets, reduction=reduction), [logits]),
                    hvp(lambda z: F.cross_entropy(z, targets, reduction=reduction), [logits]), bf16=False)


def test_rmsnorm():
    x, w = randn(2, 3, 64, scale=0.3), randn(64, seed=1)  # an eps of the values' scale: it shapes the derivatives
    assert rmsnorm.applies(x, w)
    assert_same(hvp(lambda x, w: rmsnorm.rms_norm(x, w, 0.05), [x, w]),
                hvp(lambda x, w: F.rms_norm(x, (64,), w, 0.05), [x, w]), bf16=False)
    assert not torch.allclose(hvp(lambda x, w: F.rms_norm(x, (64,), w, 0.05), [x, w])[0],
                              hvp(lambda x, w: F.rms_norm(x, (64,), w), [x, w])[0], rtol=1e-3)


def linear_square(fn):
    """fn's output squared: a linear map alone has no second derivative in its inputs but the cross terms."""
    return lambda *args: fn(*args) ** 2


def test_onednn_training_linear():
    x, w, b = randn(12, 32), randn(24, 32, seed=1, scale=0.2), randn(24, seed=2)
    assert_same(hvp(linear_square(onednn.TrainingLinear.apply), [x, w, b]), hvp(linear_square(F.linear), [x, w, b]),
                bf16=False)


def test_blocked_head_bf16():
    h, w = randn(10, 32, dtype=torch.bfloat16), randn(300, 32, dtype=torch.bfloat16, seed=1, scale=0.2)
    assert_same(hvp(linear_square(head_grad.BlockedGradHead.apply), [h, w]), hvp(linear_square(F.linear), [h, w]),
                bf16=True)


@pytest.mark.skipif(not rows.available(), reason="needs the rows kernel (a C++ compiler)")
def test_transposed_bf16():
    x, w, b = (randn(16, 32, dtype=torch.bfloat16), randn(48, 32, dtype=torch.bfloat16, seed=1, scale=0.2),
               randn(48, dtype=torch.bfloat16, seed=2))
    assert_same(hvp(linear_square(transposed.TransposedGradLinear.apply), [x, w, b]),
                hvp(linear_square(F.linear), [x, w, b]), bf16=True)
    assert_same(hvp(linear_square(lambda h, w: transposed.TransposedHead.apply(h, w, None)), [x, w]),
                hvp(linear_square(F.linear), [x, w]), bf16=True)


@pytest.mark.parametrize("varied", [None, [0], [1], [3, 6], [4], [5, 6], [0, 2]])
@pytest.mark.parametrize("use_onednn", [False, True])
def test_fused_qkv(use_onednn, varied):
    """All seven inputs asking for gradients, or some (a frozen input, frozen weights with trained biases)."""
    x = randn(2, 6, 32)
    ws = [randn(32, 32, seed=s, scale=0.2) for s in (1, 2, 3)]
    bs = [randn(32, seed=s) for s in (4, 5, 6)]
    assert_same(hvp(linear_square(lambda *a: fused_qkv.QKVLinear.apply(*a, use_onednn)), [x, *ws, *bs], varied=varied),
                hvp(linear_square(lambda x, wq, wk, wv, bq, bk, bv: F.linear(x, torch.cat((wq, wk, wv)),
                                                                             torch.cat((bq, bk, bv)))),
                    [x, *ws, *bs], varied=varied), bf16=False)


def penalty_grads(named_params, loss) -> dict[str, torch.Tensor]:
    """The gradient of |d loss / d parameters|^2 with respect to the parameters (a gradient penalty's), by name."""
    names, params = zip(*named_params)
    first = torch.autograd.grad(loss, params, create_graph=True)
    return dict(zip(names, torch.autograd.grad(sum(g.pow(2).sum() for g in first), params)))


def test_model_gradient_penalty_equals_transformers(hf_folder, monkeypatch):
    """A gradient penalty through the whole model in training mode, with the fused paths taken (the loss's kernel, the
    fused GELU, softmax and q/k/v product, the tied table), against transformers' eager model (no dropout; SDPA's
    CPU kernel has no second derivative, in transformers as here)."""
    monkeypatch.setattr(cross_entropy, "MIN_ELEMENTS", 0)
    config = tiny_config("h4-wide", attn_implementation="eager")
    hf, folder = hf_folder(config, seed=1)
    ours = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager")
    hf.train(), ours.train()
    ids = torch.randint(0, config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    our_loss = ours(ids, labels=ids)["loss"]
    taken = graph_names(our_loss)
    assert {"_GELUBackward", "_MaskedSoftmaxBackward", "ChunkedCrossEntropyBackward", "QKVLinearBackward",
            "_TiedTableBackward"} <= taken, taken
    ours_grads = penalty_grads(ours.gpt.named_parameters(), our_loss)
    hf_grads = hf_to_ours(penalty_grads(hf.named_parameters(), hf(input_ids=ids, labels=ids).loss), config.n_layer)
    assert set(hf_grads) == set(ours_grads)
    for name, g in ours_grads.items():
        torch.testing.assert_close(g, hf_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_default_attention_has_no_second_derivative_as_in_transformers():
    """SDPA's CPU kernel (the default attention without dropout) has no second derivative in torch: the error is
    torch's and names it; the explicit attention (attn_implementation='eager') has one."""
    model = GPT2LMHeadModel(tiny_config("h4-wide")).train()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="scaled_dot_product"):
        penalty_grads(model.named_parameters(), model(ids, labels=ids)["loss"])


def test_manual_backward_refuses_second_derivatives():
    """backward='manual' saves what its forwards compute (a LayerNorm's mean and 1/std, log-sum-exps): those would be
    constants in a second derivative, so create_graph=True through it stops with an error, not a wrong answer."""
    model = GPT2LMHeadModel(tiny_config("h4-wide", backward="manual", attn_implementation="eager")).double().train()
    ids = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match=r"backward='manual'\) gives first derivatives only"):
        penalty_grads(model.named_parameters(), model(ids, labels=ids)["loss"])
