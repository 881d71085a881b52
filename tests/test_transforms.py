"""The model under torch.func (functional_call with grad, vmap, jvp): per-sample gradients and functional training.
Under a transform the fused kernels and our autograd Functions step aside for torch's ops (modules/transforms.py);
the gradients must equal the ones plain autograd gives with every fused path taken."""
from __future__ import annotations

import pytest
import torch
from conftest import graph_names, padded_batch, tiny_config
from torch.func import functional_call, grad, jvp, vmap

from models.gpt2 import GPT2LMHeadModel, GPT2Model
from modules import transforms

pytestmark = pytest.mark.usefixtures("fused_paths_on")  # the fused paths these tests step around

# fp32 gradients of the same loss by two routes (our kernels and Functions vs torch's ops): sums in other orders
ATOL, RTOL = 2e-6, 1e-4


def lm(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_config("h4-wide", **overrides)).train()


def lm_loss(model, params, ids, mask):
    return functional_call(model, params, (ids,), dict(attention_mask=mask, labels=ids))["loss"]


def autograd_grads(model, ids, mask) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(ids, attention_mask=mask, labels=ids)["loss"].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_active_inside_each_transform_only():
    seen = {}

    def probe(name):
        def f(x):
            seen[name] = transforms.active()
            return x.sin().sum()
        return f

    x = torch.randn(3)
    grad(probe("grad"))(x)
    vmap(probe("vmap"))(x[:, None])
    jvp(probe("jvp"), (x,), (torch.ones(3),))
    probe("plain")(x)
    with torch.no_grad():
        probe("no_grad")(x)
    assert seen == dict(grad=True, vmap=True, jvp=True, plain=False, no_grad=False)


def test_unwrapped_reads_every_example():
    found = []

    def f(row):
        found.append(transforms.unwrapped(row).clone())
        return row

    x = torch.arange(6.0).reshape(2, 3)
    vmap(f)(x)
    vmap(vmap(f))(x)
    assert torch.equal(found[0], x) and torch.equal(found[1], x)
    assert transforms.unwrapped(x) is x


@pytest.fixture
def every_loss_kernel(monkeypatch):
    """The loss's kernel for tiny vocabularies too (it takes 2^21 logits and more)."""
    from modules import cross_entropy

    monkeypatch.setattr(cross_entropy, "MIN_ELEMENTS", 0)


def test_the_fused_paths_run_outside_a_transform(every_loss_kernel):
    """The reference below is worth something only if plain autograd takes our Functions on this model."""
    model = lm()
    ids, mask = padded_batch([12, 7], 12, 1000, "left")
    names = graph_names(model(ids, attention_mask=mask, labels=ids)["loss"])
    ours = {"_GELUBackward", "ChunkedCrossEntropyBackward", "QKVLinearBackward", "_TiedTableBackward"}
    assert ours <= names, ours - names


def test_grad_equals_autograd_with_the_fused_paths(every_loss_kernel):
    model = lm()
    ids, mask = padded_batch([12, 7, 10], 12, 1000, "left")
    params = {n: p.detach() for n, p in model.named_parameters()}
    functional = grad(lm_loss, argnums=1)(model, params, ids, mask)
    expected = autograd_grads(model, ids, mask)
    assert functional.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(functional[name], g, atol=ATOL, rtol=RTOL, msg=name)


def test_per_sample_gradients_equal_one_example_at_a_time(every_loss_kernel):
    model = lm()
    ids, mask = padded_batch([12, 5, 9], 12, 1000, ["left", "right", "left"])
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(params, row_ids, row_mask):
        return lm_loss(model, params, row_ids[None], row_mask[None])

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, ids, mask)
    for i in range(len(ids)):
        expected = autograd_grads(model, ids[i:i + 1], mask[i:i + 1])
        for name, g in expected.items():
            torch.testing.assert_close(per_sample[name][i], g, atol=ATOL, rtol=RTOL, msg=f"row {i}: {name}")


def test_bf16_weights_and_dropout_under_grad():
    """bf16 weights (the fused LayerNorm, the head's bf16 products) and dropout in training: grad runs, every
    parameter gets a finite gradient of the loss autograd gives, to bf16's precision."""
    model = lm(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1).to(torch.bfloat16)
    ids, mask = padded_batch([12, 9], 12, 1000, "left")
    params = {n: p.detach() for n, p in model.named_parameters()}
    functional = grad(lm_loss, argnums=1)(model, params, ids, mask)
    assert "_LayerNormBackward" in graph_names(model(ids, attention_mask=mask, labels=ids)["loss"])
    assert all(torch.isfinite(g).all() for g in functional.values())
    model.eval()  # no dropout: the same loss both ways
    functional = grad(lm_loss, argnums=1)(model, params, ids, mask)
    expected = autograd_grads(model, ids, mask)
    for name, g in expected.items():
        # the keys' bias moves every score of a query by the same amount, which softmax ignores: its gradient is
        # zero but for rounding, and is measured against the queries' bias's
        scale = expected[name.replace("key.bias", "query.bias")].float().norm()
        error = (functional[name].float() - g.float()).norm() / scale
        assert error < 2e-2, (name, error.item())


def test_without_the_check_torch_func_refuses_our_functions(monkeypatch):
    model = lm()
    ids, mask = padded_batch([12, 7], 12, 1000, "left")
    params = {n: p.detach() for n, p in model.named_parameters()}
    monkeypatch.setattr(transforms, "active", lambda: False)
    with pytest.raises(RuntimeError, match="setup_context"):
        grad(lm_loss, argnums=1)(model, params, ids, mask)


def test_jvp_of_the_hidden_states():
    """Forward-mode: the directional derivative of the hidden states along a direction in parameter space, against
    a central difference in float64."""
    torch.manual_seed(0)
    model = GPT2Model(tiny_config("h4-wide")).double().eval()
    ids, mask = padded_batch([12, 7], 12, 1000, "left")
    params = {n: p.detach() for n, p in model.named_parameters()}
    tangent = {n: torch.randn_like(p) for n, p in params.items()}

    def hidden(params):
        return functional_call(model, params, (ids, mask))["last_hidden_state"]

    _, derivative = jvp(hidden, (params,), (tangent,))
    h = 1e-6
    ahead = hidden({n: p + h * tangent[n] for n, p in params.items()})
    behind = hidden({n: p - h * tangent[n] for n, p in params.items()})
    torch.testing.assert_close(derivative, (ahead - behind) / (2 * h), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["id-too-large", "negative-id", "empty-mask-row"])
def test_vmap_still_checks_each_examples_values(case):
    model = GPT2Model(tiny_config("h4-wide")).eval()
    ids, mask = padded_batch([12, 7, 10], 12, 1000, "left")
    if case == "id-too-large":
        ids[1, 5] = 1000
    elif case == "negative-id":
        ids[2, 0] = -1
    else:
        mask[2] = 0
    params = {n: p.detach() for n, p in model.named_parameters()}

    def hidden(params, row_ids, row_mask):
        return functional_call(model, params, (row_ids[None], row_mask[None]))["last_hidden_state"].sum()

    match = "no real token" if case == "empty-mask-row" else r"input_ids must be in \[0, 1000\)"
    with pytest.raises(ValueError, match=match):
        vmap(grad(hidden), in_dims=(None, 0, 0))(params, ids, mask)


def test_manual_backward_says_it_runs_under_autograd_only():
    model = lm(backward="manual")
    ids, mask = padded_batch([12, 7], 12, 1000, "left")
    params = {n: p.detach() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"backward='manual'.*backward='autograd'"):
        grad(lm_loss, argnums=1)(model, params, ids, mask)
    model(ids, attention_mask=mask, labels=ids)["loss"].backward()  # outside a transform: its own backward passes
    assert all(p.grad is not None for p in model.parameters())


def test_forward_mode_dual_tensors_through_the_fused_paths(every_loss_kernel):
    """torch.autograd.forward_ad (dual tensors, no torch.func): the loss's tangent along a direction in one weight's
    space equals the reverse-mode gradient (every fused path taken) dotted with that direction."""
    import torch.autograd.forward_ad as fwAD

    model = lm()
    ids, mask = padded_batch([12, 7, 10], 12, 1000, "left")
    name = "gpt.gpt_layers.0.interm_dense.weight"
    direction = torch.randn_like(dict(model.named_parameters())[name])
    gradient = autograd_grads(model, ids, mask)[name]
    with fwAD.dual_level():
        assert transforms.active() and transforms.torch_func()
        dual = fwAD.make_dual(dict(model.named_parameters())[name].detach(), direction)
        loss = functional_call(model, {name: dual}, (ids,), dict(attention_mask=mask, labels=ids), strict=False)["loss"]
        tangent = fwAD.unpack_dual(loss).tangent
    assert not transforms.active()
    torch.testing.assert_close(tangent, (gradient * direction).sum(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 4])
def test_vmap_over_evaluation_rows(tokens):
    """An evaluation under vmap (no gradients): each example's 1-8 rows are what the decoding kernels take outside a
    transform; under it torch's products, the same logits."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide", n_embd=256)).eval()
    ids = torch.randint(0, 1000, (3, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch.cat([model(ids[i:i + 1])["logits"] for i in range(len(ids))])
        found = vmap(lambda row: model(row[None])["logits"][0])(ids)
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-4)
