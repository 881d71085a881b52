"""modules/cross_entropy.py against F.cross_entropy on the upcast logits: loss and gradient.

Every test runs twice: with the rows kernel's row loops (GPT2_FAST_LOSS on, where the kernel builds) and with
torch's ops by blocks (GPT2_FAST_LOSS=0). fp32, torch's ops: atol 1e-6 (the two add in different orders); the kernel:
atol 1e-6 plus rtol 2e-6, since its exp is a polynomial within 2 ulp of the true value and the log-sum-exp and the
gradient each take one (measured: 5.7e-7 relative at worst on these cases, a gradient of 2.5 off by 1.4e-6; a
wrong term of the gradient, such as a target's -1 left out or a row's weight applied twice, is off by 1e-2 or more).
bf16 / fp16 logits: the loss against F.cross_entropy(logits.float()) at the same tolerance and the gradient, which
comes in the logits' dtype, within one rounding of the reference's fp32 gradient (the kernel's fp32 value may sit on
the other side of a rounding boundary: one bf16 step, rtol 2^-8). Blocks of rows are made small (CHUNK_ELEMENTS
patched) so that several blocks and a ragged last one are exercised.
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import kernel_or_torch

from modules import cross_entropy as chunked


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, monkeypatch):
    """The loss's row loops: the rows kernel (skipped where it does not build) or torch's ops by blocks."""
    return kernel_or_torch(request.param, monkeypatch, chunked)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 3 * 37)  # 3 rows a block for V = 37
    monkeypatch.setattr(chunked, "MIN_ELEMENTS", 0)  # blocks for any size of logits


def tolerance(path: str, dtype: torch.dtype = torch.float32) -> dict:
    """The module docstring's tolerances: fp32 values, or a gradient in `dtype`."""
    if dtype in (torch.bfloat16, torch.float16) and path == "kernel":
        return dict(atol=1e-6, rtol=2 ** -8)
    return dict(atol=1e-6, rtol=2e-6 if path == "kernel" else 0)


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
def test_fp32_loss_and_gradient_match_f_cross_entropy(reduction, path):
    logits, targets = case()
    assert chunked.rows_per_chunk(logits.shape[1]) == 3
    ours = loss_and_grad(chunked.cross_entropy, logits, targets, 2.5, reduction=reduction)
    ref = loss_and_grad(reference, logits, targets, 2.5, reduction=reduction)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, **tolerance(path if reduction != "none" else "torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logits_are_left_as_they_were(dtype):
    """The model returns these logits to the caller: backward must not compute the softmax in their storage."""
    logits, targets = case(dtype=dtype)
    x = logits.clone().requires_grad_()
    chunked.cross_entropy(x, targets).backward()
    assert torch.equal(x.detach(), logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_computed_in_fp32(dtype, path):
    logits, targets = case(dtype=dtype)
    loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets)
    ref_loss, ref_grad = loss_and_grad(reference, logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    path = path if dtype == torch.bfloat16 else "torch"  # fp16 logits keep torch's ops
    torch.testing.assert_close(loss, ref_loss, **tolerance(path))
    torch.testing.assert_close(grad, ref_grad, **tolerance(path, dtype))  # the same fp32 gradient, rounded once


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


def test_under_autocast_and_inference_mode(path):
    logits, targets = case(dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets)
    torch.testing.assert_close(loss, reference(logits, targets), **tolerance(path))
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
    with pytest.raises(ValueError, match=r"logits \(N, V\) and targets \(N,\)"):
        chunked.cross_entropy(logits[None], targets[:1])  # 3-D logits whose first dimension matches
    with pytest.raises(ValueError, match="reduction"):
        chunked.cross_entropy(logits, targets.clamp(min=0), reduction="max")


def test_the_lm_loss_takes_it_and_still_matches_f_cross_entropy(path):
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel, lm_loss

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide"))
    assert model.cross_entropy is chunked.cross_entropy
    ids = torch.randint(0, 1000, (2, 9))
    logits = model(ids)["logits"].detach()
    ours = lm_loss(logits, ids, None, 9)
    ref = lm_loss(logits, ids, None, 9, lambda z, y, ignore_index: F.cross_entropy(z, y, ignore_index=ignore_index))
    torch.testing.assert_close(ours, ref, **tolerance(path))


def test_the_kernel_is_what_the_kernel_runs_take(path):
    """kernel_takes: contiguous fp32 and bf16 logits where the kernel is on; fp16, strided logits and
    GPT2_FAST_LOSS=0 keep torch's ops (so each parametrised run above is the path it names)."""
    logits = torch.randn(4, 37)
    assert chunked.kernel_takes(logits) == (path == "kernel")
    assert chunked.kernel_takes(logits.bfloat16()) == (path == "kernel")
    assert not chunked.kernel_takes(logits.half())
    assert not chunked.kernel_takes(torch.randn(37, 4).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 53, 1031])
def test_rows_of_any_length_against_float64(dtype, vocab, path):
    """Rows shorter than a vector, and whole vectors with a ragged tail (AVX512: 16 lanes, AVX2: 8); one row's
    target at the last column, one ignored."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 5).to(dtype)
    targets = torch.randint(0, vocab, (6,), generator=g)
    targets[0], targets[4] = vocab - 1, -100
    loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets, 3.0)
    exact_loss, exact_grad = loss_and_grad(F.cross_entropy, logits.double(), targets, 3.0)
    torch.testing.assert_close(loss.double(), exact_loss, **tolerance(path))
    torch.testing.assert_close(grad.double(), exact_grad.to(dtype).double(), **tolerance(path, dtype))
    assert torch.equal(grad[4], torch.zeros_like(grad[4]))  # the ignored row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_logits(dtype, path, monkeypatch):
    """A NaN in a row: its loss and whole gradient NaN. -inf entries (a masked vocabulary): a finite loss, a zero
    gradient there, the rest as F.cross_entropy's. +inf: a NaN loss, and the gradient NaN at that entry, 0 elsewhere
    (F.cross_entropy's log-softmax backward makes the whole row NaN; the loss is NaN either way, which stops a run).
    The kernel gives what torch's ops by blocks give, NaN for NaN."""
    logits, targets = case(n=5, vocab=53, dtype=dtype, ignored=())
    logits[0, 7] = float("nan")
    logits[1, targets[1]] = float("inf")
    logits[2, :20] = float("-inf")
    targets[2] = 30
    logits[3, 40] = float("inf")
    loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets, reduction="sum")
    assert torch.isnan(loss)
    assert grad[0].isnan().all() and grad[1].isnan().sum() == 1 and grad[3].isnan().sum() == 1
    assert torch.equal(grad[2, :20], torch.zeros(20, dtype=dtype))
    rows = [2, 4]  # the finite rows against F.cross_entropy
    ref_loss, ref_grad = loss_and_grad(reference, logits[rows], targets[rows], reduction="sum")
    torch.testing.assert_close(grad[rows].float(), ref_grad.to(dtype).float(), **tolerance(path, dtype))
    monkeypatch.setenv(chunked.ENV, "0")
    _, torch_grad = loss_and_grad(chunked.cross_entropy, logits, targets, reduction="sum")
    torch.testing.assert_close(grad, torch_grad, equal_nan=True, **tolerance(path, dtype))


def test_the_kernel_gives_the_same_bits_on_any_thread_count(path):
    """Each row's sums go in one order whatever the threads: a run repeats to the bit on 1 or 2 threads."""
    logits, targets = case(n=64, vocab=211, dtype=torch.bfloat16, ignored=(5,))
    torch.set_num_threads(1)  # conftest's restore_threads gives the count back after the test
    one = loss_and_grad(chunked.cross_entropy, logits, targets)
    torch.set_num_threads(2)
    two = loss_and_grad(chunked.cross_entropy, logits, targets)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_build_of_the_kernel_against_float64(form, dtype, path):
    """The native build (16 lanes on an AVX512 CPU) and the AVX2 one (8 lanes, its own compare-and-mask for the
    zero terms): each row's log-sum-exp and gradient against float64 at the kernel's tolerance, a -inf entry's
    gradient 0 in both."""
    if path == "torch":
        pytest.skip("the kernel's builds alone")
    from modules import rows

    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(9, 1031, generator=g) * 4).to(dtype)
    logits[3, 100:140] = float("-inf")
    targets = torch.randint(0, 1031, (9,), generator=g)
    weight = torch.rand(9, generator=g)
    lse, grad = torch.empty(9), torch.empty_like(logits)
    bf16 = int(dtype == torch.bfloat16)
    lib.rows_ce_lse(bf16, logits.data_ptr(), 9, 1031, lse.data_ptr(), 2)
    lib.rows_ce_grad(bf16, logits.data_ptr(), lse.data_ptr(), targets.data_ptr(), weight.data_ptr(), grad.data_ptr(),
                     9, 1031, 2)
    exact = torch.logsumexp(logits.double(), -1)
    torch.testing.assert_close(lse.double(), exact, **tolerance(path))
    softmax = torch.softmax(logits.double(), -1)
    softmax[torch.arange(9), targets] -= 1
    expected = (softmax * weight.double()[:, None]).to(dtype)
    torch.testing.assert_close(grad.double(), expected.double(), **tolerance(path, dtype))
    assert torch.equal(grad[3, 100:140], torch.zeros(40, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_rows_than_classes(dtype, path):
    """N > V (a small vocabulary, many tokens): every row's log-sum-exp computed, by blocks or by the kernel."""
    logits, targets = case(n=50, vocab=7, dtype=dtype, ignored=(3,))
    loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets, 2.0)
    ref_loss, ref_grad = loss_and_grad(reference, logits, targets, 2.0)
    torch.testing.assert_close(loss, ref_loss, **tolerance(path))
    torch.testing.assert_close(grad, ref_grad.to(dtype), **tolerance(path, dtype))


def test_a_class_index_as_ignore_index_in_every_reduction(path):
    """ignore_index need not be -100: a class index is ignored as such in "mean", "sum" and "none"."""
    logits, targets = case()
    targets = targets.clamp(min=0)
    targets[[1, 4]] = 5
    for reduction in ("mean", "sum", "none"):
        ours = chunked.cross_entropy(logits, targets, ignore_index=5, reduction=reduction)
        ref = F.cross_entropy(logits, targets, ignore_index=5, reduction=reduction)
        # a summed loss (about 94 here) is one fp32 rounding of it away: relative, as the kernel's tolerance
        torch.testing.assert_close(ours, ref, **tolerance("kernel" if reduction == "sum" else path))


def test_float64_as_torchs_default_dtype(path):
    """fp32 logits with torch's default dtype set to float64 (tests/test_float64.py's setting): the row sums stay
    fp32 buffers (the kernel writes fp32), and the loss is F.cross_entropy's."""
    logits, targets = case()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        loss, grad = loss_and_grad(chunked.cross_entropy, logits, targets)
    finally:
        torch.set_default_dtype(before)
    ref_loss, ref_grad = loss_and_grad(reference, logits, targets)
    torch.testing.assert_close(loss, ref_loss, **tolerance(path))
    torch.testing.assert_close(grad, ref_grad, **tolerance(path))


def test_the_blocked_backward_computes_each_row_once(monkeypatch):
    """Without the kernel the backward takes the rows in blocks of rows_per_chunk: one softmax (one exp) per block,
    not one per row (a loop stepping by one row rewrote the same values N times over)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 64 * 8)  # blocks of 8 rows of 64
    monkeypatch.setattr(chunked, "kernel_takes", lambda logits: False)
    logits = torch.randn(21, 64, requires_grad=True)
    targets = torch.randint(0, 64, (21,), generator=torch.Generator().manual_seed(0))
    loss = chunked.ChunkedCrossEntropy.apply(logits, targets, -100, True)
    exps = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.exp_, torch.ops.aten.exp):
                exps.append(args[0].shape)
            return func(*args, **(kwargs or {}))

    with Count():
        loss.backward()
    assert [shape[0] for shape in exps] == [8, 8, 5]
    torch.testing.assert_close(logits.grad, torch.func.grad(lambda z: F.cross_entropy(z, targets))(logits.detach()))


def test_int32_targets_give_the_int64_ones_gradient(monkeypatch):
    """Targets in int32 (a tokenizer's or a dataset's dtype): the kernel reads them as int64 after a cast."""
    monkeypatch.setattr(chunked, "MIN_ELEMENTS", 0)
    logits = torch.randn(10, 300)
    targets = torch.randint(0, 300, (10,), generator=torch.Generator().manual_seed(0))
    grads = []
    for t in (targets, targets.int()):
        z = logits.clone().requires_grad_()
        chunked.cross_entropy(z, t).backward()
        grads.append(z.grad)
    assert torch.equal(grads[0], grads[1])
