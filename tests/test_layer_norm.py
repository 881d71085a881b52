"""modules/layer_norm.py: GPT-2's LayerNorm in a bf16 CPU training step, in the rows kernel (modules/rows.cpp) and in
torch's F.layer_norm, against float64 and against each other.

Every test runs with the kernel (skipped where it does not build) and with torch's (GPT2_FAST_LAYERNORM=0). The module
takes the kernel for bf16 only; the kernel's fp32 form (which holds its arithmetic to fp32 precision) is called
directly on the kernel's side of the fp32 cases.
Tolerances: fp32 values and gradients atol 2e-5 rtol 1e-5 against float64 LayerNorm of the same inputs (a row's sums
in fp32 over up to 768 values; the kernel measured 8.6e-6 at worst up to 512 x 768, torch's own 1.5e-5 on these
cases); bf16 within one bf16 rounding of float64 from the same bf16 inputs (rtol 2^-7, atol 2e-3 for the values the
rounding puts near 0: each result is rounded once from fp32). torch's own bf16 backward is less exact: its weight's
and bias's gradients off by up to 0.2 on these cases (1.6 and 2.7 at 512 x 768, against the kernel's 1.2e-4 and 0),
its dx by up to 5.4e-3 (rows of 3) and 1.6e-2 (512 x 768; the kernel 2e-3), and its sums change with the thread
count (0.77 off on 198 rows with one thread): on its side dx is held to atol 2e-2 rtol 2^-5 here, and its bf16 weight
and bias gradients only to their shape and dtype. A missing mean(g) or mean(g xh) term, or rstd left out, is
off by 1e-1 or more.
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import kernel_or_torch

from modules import layer_norm as ln
from modules import rows


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, monkeypatch):
    """The norm's pass: the rows kernel (skipped where it does not build) or torch's F.layer_norm."""
    return kernel_or_torch(request.param, monkeypatch, ln)


def tolerance(dtype):
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2 ** -7)


TORCH_BF16_DX = dict(atol=2e-2, rtol=2 ** -5)  # torch's bf16 dx (the module's docstring)


def case(shape, dtype=torch.float32, affine="both", seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = (torch.randn(*shape, generator=g) * 3 + 1.5).to(dtype)
    grad = torch.randn(*shape, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(C, generator=g)).to(dtype) if affine in ("both", "weight") else None
    b = (0.3 * torch.randn(C, generator=g)).to(dtype) if affine == "both" else None
    return x, grad, w, b


def run(x, grad, w, b, eps=1e-5):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = ln.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2], eps)
    y.backward(grad)
    return y.detach(), *(t.grad if t is not None else None for t in leaves)


def direct(x, grad, w, b, lib=None, eps=1e-5):
    """The kernel called as the module calls it (fwd, then bwd), in any of its dtypes."""
    lib = lib or rows._load()
    R, C = x.numel() // x.shape[-1], x.shape[-1]
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw, db = (None if t is None else torch.empty_like(t) for t in (w, b))
    mean, rstd = torch.empty(R), torch.empty(R)
    bf16 = int(x.dtype == torch.bfloat16)

    def ptr(t):
        return None if t is None else t.data_ptr()

    lib.rows_layernorm(bf16, x.data_ptr(), ptr(w), ptr(b), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), R, C, eps, 2)
    lib.rows_layernorm_backward(bf16, grad.data_ptr(), x.data_ptr(), ptr(w), mean.data_ptr(), rstd.data_ptr(),
                                dx.data_ptr(), ptr(dw), ptr(db), R, C, 2)
    return y, dx, dw, db


def ours(x, grad, w, b, path):
    """The module's results; on the kernel's side of an fp32 case (the module runs torch's there) the kernel's fp32
    form called directly."""
    return direct(x, grad, w, b) if path == "kernel" and x.dtype == torch.float32 else run(x, grad, w, b)


def exact(x, grad, w, b, eps=1e-5):
    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = F.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2], eps)
    y.backward(grad.double())
    return y.detach(), *(t.grad if t is not None else None for t in leaves)


def assert_near(ours, ref, dtype, path="kernel"):
    """y, dx, dw, db against float64's (None where there is none)."""
    for i, (a, e) in enumerate(zip(ours, ref)):
        assert (a is None) == (e is None)
        if a is not None:
            assert a.dtype == dtype
            assert a.shape == e.shape
            if path == "torch" and dtype == torch.bfloat16 and i >= 2:
                continue  # torch's bf16 weight and bias sums: no bound (the docstring)
            tol = TORCH_BF16_DX if path == "torch" and dtype == torch.bfloat16 and i == 1 else tolerance(dtype)
            torch.testing.assert_close(a.double(), e.to(dtype).double(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 768), (3, 35), (4, 3), (70, 16), (1, 7, 100)])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_against_float64(dtype, shape, affine, path):
    """Rows of whole vectors, a ragged tail, shorter than a vector; more rows than a chunk of the weight's
    gradient sums (32); with weight and bias, weight only (bias=False), neither (norm_scale=False)."""
    x, grad, w, b = case(shape, dtype, affine)
    assert_near(ours(x, grad, w, b, path), exact(x, grad, w, b), dtype, path)


def test_the_bf16_weight_and_bias_gradients_of_gpt2s_rows_to_one_rounding(path):
    """512 rows of 768 (gpt2 at 4 x 128), 16 chunks of the sums: the kernel's bf16 dw and db within one bf16 rounding
    of float64's (torch's bf16 op: off by 1.6 and 2.7, the module's docstring)."""
    if path == "torch":
        pytest.skip("the kernel's precision")
    x, grad, w, b = case((4, 128, 768), torch.bfloat16)
    assert_near(run(x, grad, w, b), exact(x, grad, w, b), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_torchs_layer_norm(dtype, path):
    """The kernel's values and gradients next to F.layer_norm's in the same dtype: fp32 to its rounding, bf16 within
    a bf16 step (each rounds the same fp32 values once, computed in another order; torch's less exact bf16 dx at
    TORCH_BF16_DX, its bf16 weight and bias sums left out: the float64 tests hold the kernel's)."""
    x, grad, w, b = case((6, 33, 96), dtype)
    mine = ours(x, grad, w, b, path)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(leaves[0], (96,), leaves[1], leaves[2], 1e-5)
    y.backward(grad)
    theirs = (y.detach(), *(t.grad for t in leaves))
    for i, (a, t) in enumerate(zip(mine, theirs)):
        if dtype == torch.bfloat16 and i >= 2:
            continue
        tol = TORCH_BF16_DX if dtype == torch.bfloat16 and i == 1 else tolerance(dtype)
        torch.testing.assert_close(a.float(), t.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eps_where_the_variance_is_small_and_a_constant_row(dtype, path):
    """Rows of spread 1e-3 (variance 1e-6, against eps 1e-5: eps inside the square root decides) and a constant row
    (variance 0: the output is the bias, rstd 1/sqrt(eps))."""
    x, grad, w, b = case((5, 40), dtype)
    x = (x.double() * 1e-3).to(dtype)
    x[3] = 0.75
    assert_near(ours(x, grad, w, b, path), exact(x, grad, w, b), dtype, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_modules_own_eps(dtype, path):
    """LayerNorm(eps=1e-2) on rows of variance 1e-4: the module's eps reaches the kernel and torch's alike."""
    norm = ln.LayerNorm(40, eps=1e-2).to(dtype)
    x, grad, _, _ = case((5, 40), dtype)
    x = (x.double() * 1e-2).to(dtype).requires_grad_()
    norm(x).backward(grad)
    y = norm(x.detach())
    ref = exact(x.detach(), grad, norm.weight.detach(), norm.bias.detach(), eps=1e-2)
    torch.testing.assert_close(y.detach().double(), ref[0].to(dtype).double(), **tolerance(dtype))
    tol = TORCH_BF16_DX if path == "torch" and dtype == torch.bfloat16 else tolerance(dtype)
    torch.testing.assert_close(x.grad.double(), ref[1].to(dtype).double(), **tol)


def test_a_float64_default_dtype_does_not_reach_the_kernels_statistics(path):
    """A bf16 step under torch.set_default_dtype(torch.float64) (the statistics the kernel writes are float32 whatever
    the default) gives the same results."""
    x, grad, w, b = case((6, 24), torch.bfloat16)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        mine = run(x, grad, w, b)
    finally:
        torch.set_default_dtype(before)
    assert_near(mine, exact(x, grad, w, b), torch.bfloat16, path)


def test_no_rows_gives_zero_gradients_for_the_weight_and_bias(path):
    x, grad, w, b = case((0, 8), torch.bfloat16)
    y, dx, dw, db = run(x, grad, w, b)
    assert y.shape == dx.shape == (0, 8)
    assert torch.equal(dw, torch.zeros(8, dtype=torch.bfloat16)) and torch.equal(db, torch.zeros_like(db))


def test_the_kernel_takes_what_it_says(path):
    """applies(): training steps' bf16 rows with the weight and bias in bf16; not fp32 (torch's is as fast there),
    not without a gradient, not fp16 or float64, not an fp32 weight for bf16 rows (autocast's norms), not a
    multi-dimensional shape."""
    x, _, w, b = case((4, 8), torch.bfloat16)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    on = path == "kernel"
    assert ln.applies(xg, (8,), w, b) == ln.applies(x, (8,), wg, None) == ln.applies(xg, (8,), None, None) == on
    assert not ln.applies(x, (8,), w, b)  # no gradient taken
    with torch.no_grad():
        assert not ln.applies(xg, (8,), wg, b)
    assert not ln.applies(xg.float(), (8,), w.float(), b.float())
    assert not ln.applies(xg.half(), (8,), None, None)
    assert not ln.applies(xg.double(), (8,), None, None)
    assert not ln.applies(xg, (8,), w.float(), b.float())  # fp32 weight, bf16 rows
    assert not ln.applies(xg, (4, 8), None, None)
    assert not ln.applies(xg, (8,), w[:4], None)
    assert not ln.applies(xg, (8,), w, b.float())  # a bias in another dtype

    def rows_of(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16, requires_grad=True)

    # one row (1-D), rows of one value, no rows at all: the kernel's; rows of no values: torch's
    assert ln.applies(rows_of(8), (8,), None, None) == ln.applies(rows_of(3, 1), (1,), None, None) == on
    assert ln.applies(rows_of(2, 0, 8), (8,), None, None) == on
    assert not ln.applies(rows_of(3, 0), (0,), None, None)
    assert ln._threads(ln.SMALL - 1) == 1 and ln._threads(ln.SMALL) == torch.get_num_threads()


def test_the_module_is_nn_layer_norm_with_its_state_and_takes_the_kernel_in_training(path, monkeypatch):
    from torch import nn

    from modules.norms import make_norm

    class Cfg:
        n_embd, layer_norm_epsilon, norm, norm_scale, bias, backward = 16, 1e-5, "layernorm", True, True, "autograd"

    norm = make_norm(Cfg())
    assert isinstance(norm, nn.LayerNorm) and type(norm) is ln.LayerNorm
    assert list(norm.state_dict()) == ["weight", "bias"] and norm.eps == 1e-5
    calls = []
    apply = ln._LayerNorm.apply
    monkeypatch.setattr(ln._LayerNorm, "apply", lambda *a: calls.append(1) or apply(*a))
    x = torch.randn(3, 16)
    norm(x)  # fp32: torch's
    norm.to(torch.bfloat16)
    x = x.bfloat16()
    with torch.no_grad():
        y_eval = norm(x)
    y = norm(x)
    assert len(calls) == (1 if path == "kernel" else 0)
    torch.testing.assert_close(y.detach(), y_eval, **tolerance(torch.bfloat16))
    assert torch.equal(y_eval, F.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5))


@pytest.mark.parametrize("wants", ["x", "weight", "bias"])
def test_only_the_gradients_asked_for(wants, path):
    x, grad, w, b = case((5, 24), torch.bfloat16)
    leaves = {"x": x.clone(), "weight": w.clone(), "bias": b.clone()}
    leaves[wants].requires_grad_()
    ln.layer_norm(leaves["x"], (24,), leaves["weight"], leaves["bias"]).backward(grad)
    ref = dict(zip(("x", "weight", "bias"), exact(x, grad, w, b)[1:]))
    for name, t in leaves.items():
        assert (t.grad is not None) == (name == wants)
    if path == "kernel" or wants == "x":
        tol = tolerance(torch.bfloat16) if path == "kernel" else TORCH_BF16_DX
        torch.testing.assert_close(leaves[wants].grad.double(), ref[wants].bfloat16().double(), **tol)


def test_the_kernel_repeats_to_the_bit_on_any_thread_count(path):
    if path == "torch":
        pytest.skip("the kernel's promise (torch's bf16 op sums in another order on another thread count)")
    x, grad, w, b = case((300, 64), torch.bfloat16)  # 10 chunks of the weight's gradient sums
    torch.set_num_threads(1)  # conftest's restore_threads gives the count back after the test
    one = run(x, grad, w, b)
    torch.set_num_threads(2)
    two = run(x, grad, w, b)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_makes_its_row_nan_as_torch_does(dtype, path):
    """A NaN in a row's input (a diverging step) makes that row's output and input gradient NaN, and the weight's
    and bias's gradients NaN; the other rows stay finite."""
    x, grad, w, b = case((4, 40), dtype)
    x[2, 7] = float("nan")
    y, dx, dw, db = ours(x, grad, w, b, path)
    assert y[2].isnan().all() and dx[2].isnan().all()
    assert y[[0, 1, 3]].isfinite().all() and dx[[0, 1, 3]].isfinite().all()
    assert dw.isnan().all() and db.isfinite().all()


@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_build_against_float64(form, dtype, path):
    """The native build (16 lanes on an AVX512 CPU) and the AVX2 one (8 lanes), called directly."""
    if path == "torch":
        pytest.skip("the kernel's builds alone")
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    x, grad, w, b = case((37, 45), dtype)
    assert_near(direct(x, grad, w, b, lib), exact(x, grad, w, b), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bf16-weights"])
def test_a_training_step_through_the_model_matches_torchs(dtype, path, monkeypatch):
    """Every block's two norms and the final one take the kernel in a bf16 training step (none in fp32); loss and
    every gradient as with torch's (GPT2_FAST_LAYERNORM=0), within the rounding above grown through the model."""
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide"))
    if dtype == "bf16-weights":
        model.to(torch.bfloat16)
    model.train()
    ids = torch.randint(0, 1000, (2, 12))

    def step():
        torch.manual_seed(1)  # the same dropout masks both ways
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids)["loss"]
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []
    apply = ln._LayerNorm.apply
    monkeypatch.setattr(ln._LayerNorm, "apply", lambda *a: calls.append(1) or apply(*a))
    ours = step()
    assert len(calls) == (2 * model.config.n_layer + 1 if path == "kernel" and dtype == "bf16-weights" else 0)
    monkeypatch.setenv(ln.ENV, "0")
    torch_ops = step()
    rtol, atol = (1e-5, 1e-6) if dtype == "float32" else (2e-2, 4e-3)  # bf16: dx's roundings through bf16 sums
    torch.testing.assert_close(ours[0], torch_ops[0], rtol=rtol, atol=atol)
    for name, a in ours[1].items():
        if dtype == "bf16-weights" and "layer_norm" in name:
            continue  # torch's bf16 sums of the norms' gradients are the less exact (the module's docstring)
        torch.testing.assert_close(a.float(), torch_ops[1][name].float(), rtol=rtol, atol=atol)
    if path == "torch" or dtype == "float32":
        assert all(torch.equal(a, torch_ops[1][n]) for n, a in ours[1].items())
