"""modules/masked_softmax.py: the attention's scale, mask and softmax of a CPU training step, in the rows kernel
(modules/rows.cpp) and in torch's ops, against float64 and against each other.

Every test runs with the kernel (skipped where it does not build) and with torch's ops (GPT2_FAST_SOFTMAX=0).
Tolerances: fp32 probabilities and score gradients atol 2e-7 against float64 (the kernel's exp is a polynomial within
2 ulp, each value rounded a few times: measured 8.6e-8 and 2.5e-8 at worst on these cases, the same as torch's ops);
bf16 within one bf16 rounding of the float64 values (rtol 2^-8, atol 1e-6: the values are rounded once from fp32).
A hidden key given weight, a missing -dot term or a scale left out is off by 1e-2 or more.
"""

import pytest
import torch
from conftest import kernel_or_torch

from modules import masked_softmax as ms
from modules import rows

LOWEST = torch.finfo(torch.float64).min


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, monkeypatch):
    """The softmax's pass: the rows kernel (skipped where it does not build) or torch's ops."""
    return kernel_or_torch(request.param, monkeypatch, ms)


def tolerance(dtype):
    return dict(atol=2e-7, rtol=0) if dtype == torch.float32 else dict(atol=1e-6, rtol=2 ** -8)


def case(B=3, H=2, T=21, K=21, dtype=torch.float32, padded=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(B, H, T, K, generator=g) * 6).to(dtype)
    grad = torch.randn(B, H, T, K, generator=g).to(dtype)
    mask = None
    if padded:  # causal, batch row 0 left-padded by 4: its queries 0-3 see no key
        mask = torch.ones(B, 1, T, K, dtype=torch.bool).tril(K - T)
        mask[0, :, :, :4] = False
    return scores, grad, mask


def run(scores, grad, mask, scale=0.125):
    x = scores.clone().requires_grad_()
    probs = ms.masked_softmax(x, scale, mask)
    probs.backward(grad)
    return probs.detach(), x.grad


def exact(scores, grad, mask, scale=0.125):
    """The course's ops in float64: scale, masked_fill with the lowest value, softmax; masked_fill's backward."""
    x = scores.double().requires_grad_()
    T, K = scores.shape[-2:]
    mask = torch.ones(T, K, dtype=torch.bool).tril(K - T) if mask is None else mask
    probs = torch.softmax((x * scale).masked_fill(~mask, LOWEST), -1)
    probs.backward(grad.double())
    return probs.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2, 21, 21), (2, 3, 1, 1), (1, 2, 16, 16), (2, 1, 5, 37), (1, 1, 129, 129)])
@pytest.mark.parametrize("padded", [False, True])
def test_against_float64(dtype, shape, padded, path):
    """Rows shorter than a vector, one vector, a ragged tail; causal alone (T < K: queries after cached keys) and with
    a padding mask (rows that see no key: 1/K everywhere, a zero gradient)."""
    B, H, T, K = shape
    scores, grad, mask = case(B, H, T, K, dtype, padded and T > 4)
    probs, dscores = run(scores, grad, mask)
    ref_probs, ref_grad = exact(scores, grad, mask)
    assert probs.dtype == dscores.dtype == dtype
    torch.testing.assert_close(probs.double(), ref_probs.to(dtype).double(), **tolerance(dtype))
    if dtype == torch.bfloat16:  # backward reads the bf16 probabilities it saved (torch's ops too): from those
        p, g = probs.double(), grad.double()
        ref_grad = 0.125 * p * (g - (p * g).sum(-1, keepdim=True))
        if mask is not None:
            ref_grad = ref_grad.masked_fill(~mask, 0.0)
    torch.testing.assert_close(dscores.double(), ref_grad.to(dtype).double(), **tolerance(dtype))
    blind = torch.zeros(B, 1, T, dtype=torch.bool) if mask is None else ~mask.any(-1)  # rows that see no key
    assert blind.any() == (padded and T > 4 and T == K)
    assert torch.equal(probs[blind.expand(B, H, T)], torch.full_like(probs[blind.expand(B, H, T)], 1 / K))
    assert torch.equal(dscores[blind.expand(B, H, T)], torch.zeros_like(dscores[blind.expand(B, H, T)]))


def test_the_kernel_takes_what_it_says(path):
    """applies(): training steps' fp32 / bf16 scores with no mask or a (B or 1, 1, T, K) bool mask; not without a
    gradient, not fp16, not other mask shapes, not more queries than keys without a mask."""
    scores, _, mask = case()
    x = scores.clone().requires_grad_()
    assert ms.applies(x, None) == ms.applies(x, mask) == ms.applies(x.bfloat16(), mask[:1]) == (path == "kernel")
    assert not ms.applies(scores, mask)  # no gradient taken
    with torch.no_grad():
        assert not ms.applies(x, mask)
    assert not ms.applies(x.half(), mask)
    assert not ms.applies(x, mask.expand(3, 2, 21, 21))  # a per-head mask
    assert not ms.applies(x, mask.int())
    assert not ms.applies(torch.randn(1, 1, 5, 3, requires_grad=True), None)


def test_the_kernel_repeats_to_the_bit_on_any_thread_count(path):
    scores, grad, mask = case(B=4, H=3, T=40, K=40, dtype=torch.bfloat16)
    torch.set_num_threads(1)  # conftest's restore_threads gives the count back after the test
    one = run(scores, grad, mask)
    torch.set_num_threads(2)
    two = run(scores, grad, mask)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_build_against_float64(form, dtype, path):
    """The native build (16 lanes on an AVX512 CPU) and the AVX2 one (8 lanes), called directly: causal (no mask)
    and a padding mask shared by the batch (batch stride 0)."""
    if path == "torch":
        pytest.skip("the kernel's builds alone")
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    scores, grad, mask = case(B=2, H=2, T=19, K=35, dtype=dtype, padded=False)
    shared = torch.ones(1, 1, 19, 35, dtype=torch.bool).tril(35 - 19)
    shared[..., 30:] = False
    bf16 = int(dtype == torch.bfloat16)
    for m in (None, shared):
        probs, dscores = torch.empty_like(scores), torch.empty_like(scores)
        mask_ptr = None if m is None else m.view(torch.uint8).data_ptr()
        lib.rows_softmax(bf16, scores.data_ptr(), probs.data_ptr(), mask_ptr, 0, 2, 2, 19, 35, 0.3, 2)
        lib.rows_softmax_backward(bf16, probs.data_ptr(), grad.data_ptr(), dscores.data_ptr(), mask_ptr, 0, 2, 2, 19,
                                  35, 0.3, 2)
        ref_probs, _ = exact(scores, grad, m, scale=0.3)
        torch.testing.assert_close(probs.double(), ref_probs.to(dtype).double(), **tolerance(dtype))
        # the backward from the kernel's own probabilities, in float64
        p = probs.double()
        expected = 0.3 * p * (grad.double() - (p * grad.double()).sum(-1, keepdim=True))
        torch.testing.assert_close(dscores.double(), expected.to(dtype).double(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", ["float32", "bf16-weights"])
def test_a_training_step_through_the_model_matches_torchs_ops(dtype, path, monkeypatch):
    """The explicit attention path of a training step (attention dropout on, so fp32 takes it too): loss and every
    gradient as with torch's ops (GPT2_FAST_SOFTMAX=0), within the rounding above grown through the model."""
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1))
    if dtype == "bf16-weights":
        model.to(torch.bfloat16)
    model.train()
    ids = torch.randint(0, 1000, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding

    def step():
        torch.manual_seed(1)  # the same dropout masks both ways
        model.zero_grad(set_to_none=True)
        loss = model(ids, attention_mask=mask, labels=ids)["loss"]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    calls = []
    apply = ms._MaskedSoftmax.apply
    monkeypatch.setattr(ms._MaskedSoftmax, "apply", lambda *a: calls.append(1) or apply(*a))
    ours = step()
    assert len(calls) == (model.config.n_layer if path == "kernel" else 0)  # every layer's softmax took the kernel
    monkeypatch.setenv(ms.ENV, "0")
    torch_ops = step()
    rtol, atol = (1e-5, 1e-6) if dtype == "float32" else (2e-2, 1e-3)
    torch.testing.assert_close(ours[0], torch_ops[0], rtol=rtol, atol=atol)
    for a, b in zip(ours[1], torch_ops[1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)
    if path == "torch":
        assert all(torch.equal(a, b) for a, b in zip(ours[1], torch_ops[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_or_inf_score_makes_its_row_nan_as_torch_does(dtype, path):
    """A diverging step must still end in a non-finite loss: a NaN or +inf score a query sees turns its whole row of
    probabilities NaN, as torch's softmax does, and its gradient at the keys it sees (torch's masked_fill backward
    zeroes the hidden ones; the kernel's are NaN too: either way the step's gradient is non-finite); a NaN in a
    hidden key changes nothing."""
    scores, grad, mask = case(dtype=dtype)
    scores[1, 0, 10, 3] = float("nan")
    scores[2, 1, 12, 5] = float("inf")
    scores[1, 1, 2, 15] = float("nan")  # hidden: key 15 is after query 2
    probs, dscores = run(scores, grad, mask)
    assert probs[1, 0, 10].isnan().all() and dscores[1, 0, 10, :11].isnan().all()
    assert probs[2, 1, 12].isnan().all()
    assert probs[1, 1, 2].isfinite().all() and dscores[1, 1, 2].isfinite().all()
    assert probs.isnan().sum() == 2 * scores.shape[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mask_shared_by_the_batch_and_a_per_head_mask(dtype, path):
    """A (1, 1, T, K) mask serves every batch row (the kernel reads it with a batch stride of 0); a mask of another
    batch size is refused; a per-head (B, nh, T, K) mask, which the kernel does not take, still gives the right
    answer through torch's ops."""
    scores, grad, _ = case(B=3, H=2, T=9, K=13, dtype=dtype, padded=False)
    shared = torch.ones(1, 1, 9, 13, dtype=torch.bool).tril(4)
    shared[..., :3] = False
    per_head = shared.expand(3, 2, 9, 13).clone()
    per_head[1, 1, :, 5] = False
    x = scores.clone().requires_grad_()
    assert ms.applies(x, shared) == (path == "kernel")
    assert not ms.applies(x, shared.expand(2, 1, 9, 13))
    assert not ms.applies(x, per_head)
    for mask in (shared, per_head):
        probs, dscores = run(scores, grad, mask)
        ref_probs, _ = exact(scores, grad, mask)
        torch.testing.assert_close(probs.double(), ref_probs.to(dtype).double(), **tolerance(dtype))
        p, g = probs.double(), grad.double()
        ref_grad = (0.125 * p * (g - (p * g).sum(-1, keepdim=True))).masked_fill(~mask, 0.0)
        torch.testing.assert_close(dscores.double(), ref_grad.to(dtype).double(), **tolerance(dtype))
