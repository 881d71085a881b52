"""modules/transposed.py: a bf16 CPU training step's LM head computed as (W h^T)^T and large linear layers' weight
gradients as transpose(g) x, through the rows kernel's transpose, against F.linear and float64.

The transpose is exact (a copy): compared for equality, in both builds of the rows kernel, on ragged shapes and any
thread count. The head's product and the weight gradient are the same sums as F.linear's in another order, each
rounded once to bf16: held to one bf16 rounding of float64 (rtol 2^-7, and an atol for values the rounding puts near
0), and to F.linear's own with at most 1 in 1,000 elements apart (measured: 1 in 15,000 on gpt2's head). Everything
else is F.linear's: the same products of the same tensors, so equal to F.linear's to the bit (the bias gradient, a
sum in another order, to a bf16 rounding).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import bf16_head_case

from modules import rows, transposed

case = bf16_head_case


def needs_kernel():
    if not rows.available():
        pytest.skip("the rows kernel does not build here")


@pytest.fixture
def forced(monkeypatch):
    """The transposed path on whatever the CPU (GPT2_TRANSPOSED_PRODUCTS=force)."""
    needs_kernel()
    monkeypatch.setenv(transposed.ENV, "force")


def run(fn, h, w, grad):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(h, w)
    y.backward(grad)
    return y.detach(), h.grad, w.grad


@pytest.mark.parametrize("form", ["native", "avx2"])
@pytest.mark.parametrize("shape", [(1, 1), (16, 16), (15, 17), (33, 47), (300, 37), (37, 300), (512, 16), (17, 2053)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_transpose_is_exact_on_ragged_shapes(form, shape, threads):
    """Blocks of 16 x 16, the ragged columns of each tile and the ragged rows after the tiles: every value moved."""
    needs_kernel()
    lib = rows._load() if form == "native" else rows.library(rows.AVX2)
    x = torch.arange(shape[0] * shape[1], dtype=torch.int32).reshape(shape).to(torch.int16)
    out = torch.full((shape[1], shape[0]), -1, dtype=torch.int16)
    lib.rows_transpose16(x.data_ptr(), shape[0], shape[1], out.data_ptr(), threads)
    assert torch.equal(out, x.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16])
def test_transpose_takes_any_16_bit_tensor_and_a_non_contiguous_one(dtype):
    needs_kernel()
    x = torch.randn(70, 90).to(dtype)
    assert torch.equal(transposed.transpose(x), x.t())
    view = x[::2, 5:80]
    assert torch.equal(transposed.transpose(view), view.t())


@pytest.mark.parametrize("bad", [torch.zeros(4, 4), torch.zeros(8, dtype=torch.bfloat16),
                                 torch.zeros(2, 3, 4, dtype=torch.bfloat16)])
def test_transpose_refuses_what_it_cannot_copy(bad):
    with pytest.raises(ValueError, match="2-D CPU tensor of 16-bit values"):
        transposed.transpose(bad)


@pytest.mark.parametrize("shape", [(24,), (3, 40), (2, 5, 7)])
def test_the_heads_logits_and_weight_gradient_within_one_rounding_and_dh_as_f_linears(forced, shape):
    h, w, grad = case(0, 2053, 48, shape=shape)
    y, dh, dw = run(lambda h, w: transposed.TransposedHead.apply(h, w, None), h, w, grad)
    flat_h, flat_g = h.double().reshape(-1, 48), grad.double().reshape(-1, 2053)
    torch.testing.assert_close(y.double(), h.double() @ w.double().t(), rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(dw.double(), flat_g.t() @ flat_h, rtol=2 ** -7, atol=1e-2)
    ref_y, ref_dh, ref_dw = run(F.linear, h, w, grad)
    assert y.shape == ref_y.shape and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert (y != ref_y).float().mean() <= 1e-3 and (dw != ref_dw).float().mean() <= 1e-3
    assert torch.equal(dh, ref_dh)


def test_where_the_head_takes_it(monkeypatch):
    needs_kernel()
    monkeypatch.setattr(transposed, "HEAD_MIN_WEIGHT", 2053 * 48)
    h, w, _ = case(transposed.HEAD_MIN_ROWS, 2053, 48)
    w = w.requires_grad_()
    monkeypatch.setenv(transposed.ENV, "force")
    monkeypatch.setattr(transposed, "_amx_bf16", lambda: False)  # forced: on any CPU
    assert transposed.head_applies(h, w)
    assert transposed.head_applies(h.view(2, 4, 48), w)
    assert not transposed.head_applies(h[:-1], w)  # fewer rows than MIN_ROWS
    assert not transposed.head_applies(h[:-1].view(1, 7, 48), w)
    assert not transposed.head_applies(h, w[:-1])  # fewer values than MIN_WEIGHT
    assert not transposed.head_applies(h.float(), w.float())
    assert not transposed.head_applies(h, w.detach())  # no gradient to take
    with torch.no_grad():
        assert not transposed.head_applies(h, w)
    monkeypatch.setenv(transposed.ENV, "0")
    assert not transposed.head_applies(h, w)
    monkeypatch.delenv(transposed.ENV)
    for amx in (True, False):  # unset: taken on AMX-BF16 CPUs only
        monkeypatch.setattr(transposed, "_amx_bf16", lambda amx=amx: amx)
        assert transposed.head_applies(h, w) is amx


def test_the_head_falls_back_to_f_linear_where_it_does_not_apply(monkeypatch):
    calls = []
    monkeypatch.setattr(transposed.TransposedHead, "apply", lambda *a: calls.append(a))
    h, w, _ = case(16, 64, 8)
    torch.testing.assert_close(transposed.head(h, w), F.linear(h, w))
    assert calls == []


# ---- the weight gradients of linear layers ----------------------------------------------------------------------

def linear_case(shape, out, n_in, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, n_in, generator=g).to(torch.bfloat16)
    w = (torch.randn(out, n_in, generator=g) * 0.1).to(torch.bfloat16)
    b = (torch.randn(out, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    grad = torch.randn(*shape, out, generator=g).to(torch.bfloat16)
    return x, w, b, grad


def run_linear(fn, x, w, b, grad):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves)
    y.backward(grad)
    return y.detach(), *(t.grad if t is not None else None for t in leaves)


@pytest.mark.parametrize("shape", [(40,), (3, 17), (2, 5, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_linear_layers_weight_gradient_within_one_rounding_and_the_rest_as_f_linears(forced, shape, bias):
    x, w, b, grad = linear_case(shape, 96, 80, bias)
    y, dx, dw, db = run_linear(transposed.TransposedGradLinear.apply, x, w, b, grad)
    ref_y, ref_dx, ref_dw, ref_db = run_linear(F.linear, x, w, b, grad)
    assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx)
    exact = grad.double().reshape(-1, 96).t() @ x.double().reshape(-1, 80)
    torch.testing.assert_close(dw.double(), exact, rtol=2 ** -7, atol=1e-2)
    assert dw.dtype == torch.bfloat16 and dw.is_contiguous() and (dw != ref_dw).float().mean() <= 1e-3
    if bias:
        torch.testing.assert_close(db.double(), grad.double().reshape(-1, 96).sum(0), rtol=2 ** -7, atol=1e-2)
    else:
        assert db is None


@pytest.mark.parametrize("function", ["TransposedHead", "TransposedGradLinear"])
def test_only_the_gradients_asked_for(forced, function):
    """The weight's alone (and no bias gradient for a bias that wants none), then the input's alone."""
    fn = getattr(transposed, function)
    x, w, b, grad = linear_case((12,), 32, 24)
    b = b if fn is transposed.TransposedGradLinear else None
    w = w.requires_grad_()
    fn.apply(x, w, b).backward(grad)
    assert x.grad is None and torch.equal(w.grad, transposed.transpose(grad) @ x)
    assert b is None or b.grad is None
    x = x.requires_grad_()
    fn.apply(x, w.detach(), None).backward(grad)
    assert torch.equal(x.grad, grad @ w.detach())


def test_where_a_linear_layer_takes_it(monkeypatch):
    needs_kernel()
    monkeypatch.setattr(transposed, "LINEAR_MIN_WEIGHT", 32 * 24)
    x, w, _, _ = linear_case((4, 3), 32, 24)
    w = w.requires_grad_()
    monkeypatch.setenv(transposed.ENV, "force")
    monkeypatch.setattr(transposed, "_amx_bf16", lambda: False)  # forced: on any CPU
    assert transposed.linear_applies(x, w) and transposed.linear_applies(x[:1, :1], w)
    assert not transposed.linear_applies(x, w[:-1])  # fewer values than LINEAR_MIN_WEIGHT
    assert not transposed.linear_applies(x.requires_grad_(), w.detach())  # a frozen weight (LoRA's base)
    assert not transposed.linear_applies(x.float(), w.float())
    assert not transposed.linear_applies(x, w.float())
    with torch.no_grad():
        assert not transposed.linear_applies(x, w)
    monkeypatch.setenv(transposed.ENV, "0")
    assert not transposed.linear_applies(x, w)
    monkeypatch.delenv(transposed.ENV)
    for amx in (True, False):
        monkeypatch.setattr(transposed, "_amx_bf16", lambda amx=amx: amx)
        assert transposed.linear_applies(x, w) is amx


def test_linear_falls_back_to_f_linear_where_it_does_not_apply(monkeypatch):
    calls = []
    monkeypatch.setattr(transposed.TransposedGradLinear, "apply", lambda *a: calls.append(a))
    x, w, b, _ = linear_case((6,), 16, 8)
    torch.testing.assert_close(transposed.linear(x, w.requires_grad_(), b), F.linear(x, w, b))
    assert calls == []


@pytest.mark.parametrize("side", ["transposed", "torch"])
def test_a_bf16_training_step_takes_it_in_every_large_linear_layer_and_matches_f_linear(side, monkeypatch):
    """With the thresholds at 0 every linear layer of a bf16 model (six a block) takes the transposed weight gradient
    in training and the tied head its transposed product; loss and every gradient as with F.linear's products
    (GPT2_TRANSPOSED_PRODUCTS=0), within the rounding above grown through the model. A LoRA model's frozen bases do
    not take it."""
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel

    needs_kernel()
    monkeypatch.setattr(transposed, "HEAD_MIN_WEIGHT", 0)
    monkeypatch.setattr(transposed, "LINEAR_MIN_WEIGHT", 0)
    monkeypatch.setenv("GPT2_FUSED_QKV", "0")  # q, k and v as three layers (their one product: tests/test_fused_qkv.py)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide")).to(torch.bfloat16).train()
    ids = torch.randint(0, 1000, (2, 12))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out["loss"].backward()
        return out["logits"].detach(), out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []
    for fn in (transposed.TransposedHead, transposed.TransposedGradLinear):
        monkeypatch.setattr(fn, "apply", lambda *a, apply=fn.apply, name=fn.__name__: calls.append(name) or apply(*a))
    monkeypatch.setenv(transposed.ENV, "force" if side == "transposed" else "0")
    ours = step()
    expected = ["TransposedGradLinear"] * 6 * model.config.n_layer + ["TransposedHead"]
    assert sorted(calls) == (sorted(expected) if side == "transposed" else [])
    with torch.no_grad():
        model(ids)
    assert len(calls) == (len(expected) if side == "transposed" else 0)  # evaluation keeps its own paths
    monkeypatch.setenv(transposed.ENV, "0")
    reference = step()
    assert (ours[0] != reference[0]).float().mean() <= 1e-3
    torch.testing.assert_close(ours[0], reference[0], rtol=2 ** -7, atol=2e-2)
    torch.testing.assert_close(ours[1], reference[1], rtol=1e-3, atol=1e-3)
    for name, grad in ours[2].items():
        torch.testing.assert_close(grad.float(), reference[2][name].float(), rtol=2e-2, atol=4e-3)


def test_lora_bases_and_frozen_layers_keep_f_linear(forced, monkeypatch):
    from conftest import tiny_config

    from models.gpt2 import GPT2LMHeadModel
    from models.lora import apply_lora

    monkeypatch.setattr(transposed, "LINEAR_MIN_WEIGHT", 0)
    calls = []
    apply = transposed.TransposedGradLinear.apply
    monkeypatch.setattr(transposed.TransposedGradLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    model = GPT2LMHeadModel(tiny_config("h4-wide")).to(torch.bfloat16).train()
    apply_lora(model, rank=4)
    ids = torch.randint(0, 1000, (2, 12))
    model(ids, labels=ids)["loss"].backward()
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    assert calls == []  # the frozen weights (the LoRA layers' bases and the rest) have no gradient to take


def test_the_setting_0_turns_it_off_on_an_amx_cpu_and_force_turns_it_on_elsewhere(monkeypatch):
    needs_kernel()
    monkeypatch.setattr(transposed, "_amx_bf16", lambda: True)
    monkeypatch.delenv(transposed.ENV, raising=False)
    assert transposed.available()
    monkeypatch.setenv(transposed.ENV, "0")
    assert not transposed.available()
    monkeypatch.setattr(transposed, "_amx_bf16", lambda: False)
    assert not transposed.available()
    monkeypatch.setenv(transposed.ENV, "force")
    assert transposed.available()


def test_the_linear_backward_takes_the_transposed_gradient(forced, monkeypatch):
    """The weight gradient of TransposedGradLinear goes through transpose(g) (a mutant taking g.t() @ x, within the
    same rounding, survived the value checks)."""
    calls = []
    original = transposed.transpose
    monkeypatch.setattr(transposed, "transpose", lambda t: calls.append(t.shape) or original(t))
    x = torch.randn(40, 24).to(torch.bfloat16).requires_grad_()
    w = torch.randn(16, 24).to(torch.bfloat16).requires_grad_()
    transposed.TransposedGradLinear.apply(x, w, None).sum().backward()
    assert calls == [(40, 16)]
