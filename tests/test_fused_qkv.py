"""modules/fused_qkv.py: a training step's query, key and value projections as one product, against three F.linear
calls (the plain path): the same sums, so float32 agrees to float rounding (rtol 1e-5 on values of order 1) and bf16
to one bf16 rounding; where it is taken and where not; and what backward keeps.

Also models/gpt2.py's forward without a mask (positions counted on, no mask built, the last position as each row's
last token): the same outputs as with a mask of ones, and nothing read back from the tensors but the inputs' one
check (a GPU step waits for each read-back)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import loss_and_grads, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from models.gpt2 import GPT2LMHeadModel
from modules import fused_qkv
from modules.linear import Linear

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2e-2)}


def layers(n_in=24, sizes=(24, 8, 8), bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return [Linear(n_in, n, bias=bias).to(dtype) for n in sizes]


def separate(x, qkv):
    return torch.cat([F.linear(x, m.weight, m.bias) for m in qkv], dim=-1)


def grads(fn, x, qkv, grad):
    x = x.clone().requires_grad_()
    for m in qkv:
        for p in m.parameters():
            p.grad = None
    y = fn(x, qkv)
    y.backward(grad)
    return y.detach(), x.grad, [p.grad.clone() for m in qkv for p in m.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape, sizes", [((2, 5), (24, 24, 24)), ((7,), (24, 8, 8)), ((3, 4, 2), (16, 24, 4))])
def test_one_product_gives_the_three_products_and_their_gradients(dtype, bias, shape, sizes):
    qkv = layers(sizes=sizes, bias=bias, dtype=dtype)
    x = torch.randn(*shape, 24).to(dtype)
    grad = torch.randn(*shape, sum(sizes)).to(dtype)
    ours = grads(fused_qkv.project, x, qkv, grad)
    plain = grads(separate, x, qkv, grad)
    torch.testing.assert_close(ours[0], plain[0], **TOL[dtype])
    torch.testing.assert_close(ours[1], plain[1], **TOL[dtype])
    assert len(ours[2]) == len(plain[2]) == 3 * (2 if bias else 1)
    for a, b in zip(ours[2], plain[2]):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_only_the_gradients_asked_for():
    qkv = layers()
    qkv[1].weight.requires_grad_(False)
    qkv[2].bias.requires_grad_(False)
    x = torch.randn(6, 24)
    grad = torch.randn(6, 40)
    fused_qkv.project(x, qkv).backward(grad)
    assert qkv[1].weight.grad is None and qkv[2].bias.grad is None
    torch.testing.assert_close(qkv[0].weight.grad, grad[:, :24].t() @ x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[2].weight.grad, grad[:, 32:].t() @ x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[1].bias.grad, grad[:, 24:32].sum(0), rtol=1e-5, atol=1e-5)
    x = x.requires_grad_()
    for m in qkv:
        m.requires_grad_(False)
    fused_qkv.QKVLinear.apply(x, *(m.weight for m in qkv), *(m.bias for m in qkv)).backward(grad)
    torch.testing.assert_close(x.grad, grad @ torch.cat([m.weight for m in qkv]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["transposed", "torch"])
def test_on_amx_the_weights_gradient_is_taken_from_a_transposed_copy(side, monkeypatch):
    """Where modules/transposed.py takes large layers' weight gradients (AMX, or forced), the fused weight's too."""
    from modules import rows, transposed

    if not rows.available():
        pytest.skip("the rows kernel does not build here")
    monkeypatch.setenv(transposed.ENV, "force" if side == "transposed" else "0")
    monkeypatch.setattr(transposed, "LINEAR_MIN_WEIGHT", 40 * 24)
    copies = []
    transpose = transposed.transpose
    monkeypatch.setattr(transposed, "transpose", lambda g: copies.append(g.shape) or transpose(g))
    qkv = layers(dtype=torch.bfloat16)
    x = torch.randn(2, 6, 24).to(torch.bfloat16)
    grad = torch.randn(2, 6, 40).to(torch.bfloat16)
    ours = grads(fused_qkv.project, x, qkv, grad)
    assert copies == ([(12, 40)] if side == "transposed" else [])
    plain = grads(separate, x, qkv, grad)
    for a, b in zip(ours[2], plain[2]):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
    monkeypatch.setattr(transposed, "LINEAR_MIN_WEIGHT", 40 * 24 + 1)  # a smaller weight: autograd's form
    copies.clear()
    grads(fused_qkv.project, x, qkv, grad)
    assert copies == []


def test_backward_keeps_the_input_and_the_weights_themselves_not_their_concatenation():
    qkv = layers()
    x = torch.randn(4, 24)
    y = fused_qkv.project(x, qkv)
    kept = y.grad_fn.saved_tensors
    assert len(kept) == 4 and kept[0].data_ptr() == x.data_ptr()
    assert [t.data_ptr() for t in kept[1:]] == [m.weight.data_ptr() for m in qkv]


def test_where_it_applies(monkeypatch):
    monkeypatch.delenv(fused_qkv.ENV, raising=False)
    qkv = layers()
    x = torch.randn(3, 24)
    assert fused_qkv.applies(x, qkv)
    with torch.no_grad():
        assert not fused_qkv.applies(x, qkv)  # evaluation and generation keep their paths
    for m in qkv:
        m.requires_grad_(False)
    assert not fused_qkv.applies(x, qkv)  # nothing to train in them
    qkv[2].weight.requires_grad_(True)
    assert fused_qkv.applies(x, qkv)
    assert not fused_qkv.applies(x.double(), qkv)  # the input in another dtype
    assert not fused_qkv.applies(x.double(), layers(bias=False))
    assert not fused_qkv.applies(x, [m.to("meta") for m in layers(bias=False)])  # weights on another device
    mixed = layers()
    mixed[1].bias = None
    assert not fused_qkv.applies(x, mixed)  # biases on some and not others
    assert fused_qkv.applies(x, layers(bias=False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_qkv.applies(x, qkv)  # autocast's casts: F.linear's form
    handle = qkv[1].register_forward_hook(lambda *a: None)
    assert not fused_qkv.applies(x, qkv)  # a hook must see its own call
    handle.remove()
    pre = qkv[0].register_forward_pre_hook(lambda *a: None)
    assert not fused_qkv.applies(x, qkv)
    pre.remove()
    assert fused_qkv.applies(x, qkv)
    monkeypatch.setenv(fused_qkv.ENV, "0")
    assert not fused_qkv.applies(x, qkv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_step_takes_it_in_every_block_and_matches_the_three_products(dtype, monkeypatch):
    calls = []
    apply = fused_qkv.QKVLinear.apply
    monkeypatch.setattr(fused_qkv.QKVLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide")).to(dtype).train()
    ids = torch.randint(0, 1000, (2, 12))

    def step():
        return loss_and_grads(model, ids)

    monkeypatch.delenv(fused_qkv.ENV, raising=False)
    ours = step()
    assert len(calls) == model.config.n_layer
    with torch.no_grad():
        model(ids)
    assert len(calls) == model.config.n_layer  # evaluation: the layers' own paths
    monkeypatch.setenv(fused_qkv.ENV, "0")
    plain = step()
    assert len(calls) == model.config.n_layer
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-3)
    torch.testing.assert_close(ours[0], plain[0], **tol)
    for name, grad in ours[1].items():
        torch.testing.assert_close(grad.float(), plain[1][name].float(), **tol, msg=name)


def test_lora_layers_and_hooked_projections_keep_their_own_calls(monkeypatch):
    from models.lora import apply_lora

    monkeypatch.delenv(fused_qkv.ENV, raising=False)
    calls = []
    apply = fused_qkv.QKVLinear.apply
    monkeypatch.setattr(fused_qkv.QKVLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    ids = torch.randint(0, 1000, (2, 8))
    model = GPT2LMHeadModel(tiny_config("h4-wide")).train()
    seen = []
    model.gpt.gpt_layers[0].self_attention.key.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model(ids, labels=ids)["loss"].backward()
    assert seen == [(2, 8, 64)] and len(calls) == model.config.n_layer - 1  # the hooked block: three calls
    lora = GPT2LMHeadModel(tiny_config("h4-wide")).train()
    apply_lora(lora, rank=4)
    calls.clear()
    lora(ids, labels=ids)["loss"].backward()
    assert calls == []


class ReadBacks(TorchDispatchMode):
    """Counts the operations that read a tensor's value back to Python (.item(), bool(), int())."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_forward_without_a_mask_reads_nothing_back_and_matches_a_mask_of_ones():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide")).eval()
    ids = torch.randint(0, 1000, (3, 10))
    with torch.no_grad(), ReadBacks() as reads:
        out = model.gpt(ids)
    assert reads.count == 0
    with torch.no_grad():
        ones = model.gpt(ids, torch.ones_like(ids))
    torch.testing.assert_close(out["last_hidden_state"], ones["last_hidden_state"], rtol=0, atol=0)
    torch.testing.assert_close(out["last_token"], ones["last_token"], rtol=0, atol=0)
    assert torch.equal(out["last_token"], out["last_hidden_state"][:, -1])


@pytest.mark.parametrize("variant", ["gpt2", "rope"])
def test_continuing_from_a_cache_without_a_mask_counts_positions_on(variant):
    overrides = dict(position_embedding="rope") if variant == "rope" else {}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide", **overrides)).eval()
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        whole = model(ids)["logits"]
        first = model(ids[:, :5], use_cache=True)
        rest = model(ids[:, 5:], past_key_values=first["past_key_values"], use_cache=True)["logits"]
        masked = model(ids[:, :5], torch.ones(2, 5, dtype=torch.long), use_cache=True)
        rest_masked = model(ids[:, 5:], torch.ones(2, 9, dtype=torch.long),
                            past_key_values=masked["past_key_values"])["logits"]
    torch.testing.assert_close(rest, whole[:, 5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, rest_masked, rtol=1e-6, atol=1e-6)


def test_the_inputs_checks_still_name_bad_ids_and_empty_mask_rows():
    model = GPT2LMHeadModel(tiny_config("h4-wide")).eval()
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 1000\); got values from -1 to 999"):
        model(torch.tensor([[5, -1, 999]]))
    with pytest.raises(ValueError, match="got values from 0 to 1000"):
        model(torch.tensor([[0, 1000]], dtype=torch.int32))
    with pytest.raises(ValueError, match="a row with no real token"):
        model(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 1], [0, 0]]))
    assert model(torch.zeros(0, 3, dtype=torch.long))["logits"].shape == (0, 3, 1000)
