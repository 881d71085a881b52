"""The hand-derived backward passes (modules/manual_backward.py): each Function against finite differences
(gradcheck, float64) and its forward against torch's op; the model with backward="manual" against autograd."""
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from torch.autograd import gradcheck

from config import GPT2Config
from models.gpt2 import GPT2LMHeadModel, build_attention_mask
from modules import manual_backward as mb
from optimizer import AdamW

f64 = dict(dtype=torch.float64)


def shapes(seed: int, n: int = 3, high: int = 6):
    """n random (batch, time, width) triples, each in [1, high), small enough for gradcheck."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(int(v) for v in torch.randint(1, high, (3,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    for B, T, C in shapes(0):
        x = torch.randn(B, T, C, **f64, requires_grad=True)
        w = torch.randn(C + 1, C, **f64, requires_grad=True)
        b = torch.randn(C + 1, **f64, requires_grad=True) if bias else None
        torch.testing.assert_close(mb.linear(x, w, b), F.linear(x, w, b))
        assert gradcheck(mb.LinearFn.apply, (x, w, b))


def test_layer_norm():
    for B, T, C in shapes(1):
        C += 1  # a row of one element has no variance to normalise
        x = torch.randn(B, T, C, **f64, requires_grad=True) * 3 + 1
        w = torch.randn(C, **f64, requires_grad=True)
        b = torch.randn(C, **f64, requires_grad=True)
        torch.testing.assert_close(mb.LayerNormFn.apply(x, w, b, 1e-5), F.layer_norm(x, (C,), w, b, 1e-5))
        assert gradcheck(lambda x, w, b: mb.LayerNormFn.apply(x, w, b, 1e-5), (x, w, b))


def test_gelu_tanh():
    x = (torch.randn(4, 9, **f64) * 3).requires_grad_()  # both tails and the bend
    torch.testing.assert_close(mb.gelu_tanh(x), F.gelu(x, approximate="tanh"))
    assert gradcheck(mb.GeluTanhFn.apply, (x,))


def test_softmax():
    for B, T, C in shapes(2):
        x = torch.randn(B, T, C, **f64, requires_grad=True) * 4
        torch.testing.assert_close(mb.softmax(x), torch.softmax(x, -1))
        assert gradcheck(mb.SoftmaxFn.apply, (x,))


def padded_mask(B: int, T: int, cached: int = 0) -> torch.Tensor:
    """The model's own (B, 1, T, cached + T) mask, with row 0 left-padded and row 1 right-padded."""
    real = torch.ones(B, cached + T, dtype=torch.long)
    real[0, : min(2, cached + T - 1)] = 0
    if B > 1:
        real[1, -1] = 0
    return build_attention_mask(real, T, cached)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("cached", [0, 2])
def test_attention_with_padding_and_dropout(p, cached):
    g = torch.Generator().manual_seed(3)
    for B, T, d in shapes(3 + cached, n=2, high=4):  # gradcheck perturbs every element of q, k and v
        B, T, h, S = B + 1, T + 1, 2, T + 1 + cached
        q = torch.randn(B, h, T, d, **f64, generator=g).requires_grad_()
        k, v = (torch.randn(B, h, S, d, **f64, generator=g).requires_grad_() for _ in range(2))
        mask = padded_mask(B, T, cached)
        keep = torch.rand(B, h, T, S, generator=g) >= p if p else None
        scale = d ** -0.5
        # The reference: the course's explicit path, with the same dropout mask.
        ref = torch.softmax((q @ k.transpose(-1, -2) * scale).masked_fill(~mask, torch.finfo(q.dtype).min), -1)
        ref = (ref * keep / (1 - p) if p else ref) @ v
        torch.testing.assert_close(mb.AttentionFn.apply(q, k, v, mask, keep, scale, p), ref)
        assert gradcheck(lambda q, k, v: mb.AttentionFn.apply(q, k, v, mask, keep, scale, p), (q, k, v))


def test_cross_entropy_ignores_targets():
    z = torch.randn(9, 7, **f64, requires_grad=True)
    y = torch.randint(7, (9,))
    y[[1, 4]] = -100
    torch.testing.assert_close(mb.cross_entropy(z, y), F.cross_entropy(z, y, ignore_index=-100))
    assert gradcheck(lambda z: mb.cross_entropy(z, y), (z,))
    with pytest.raises(ValueError, match=r"logits \(N, V\) and targets \(N,\)"):
        mb.cross_entropy(z, y[:3])


def pair(dtype, **overrides):
    """An autograd model and a manual one with the same weights."""
    cfg = tiny_config("h3-inner", **overrides)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg).to(dtype)
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0, so a wrong gain or bias gradient shows
        for name, p in ref.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    manual = GPT2LMHeadModel(cfg.replace(backward="manual")).to(dtype)
    manual.load_state_dict(ref.state_dict())
    return ref, manual


def batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_model_gradients_equal_autograd(dtype, tol):
    ref, manual = pair(dtype)
    ids, mask = batch(ref.config.vocab_size)
    targets = ids.masked_fill(mask == 0, -100).roll(-1, 1)
    losses = []
    for model in (ref, manual):
        if dtype == torch.float32:  # the LM's own loss (lm_loss computes it in fp32)
            loss = model(ids, mask, labels=ids)["loss"]
        else:  # the model's cross-entropy on its float64 logits
            loss = model.cross_entropy(model(ids, mask)["logits"].flatten(0, 1), targets.flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=tol, rtol=0)
    for (name, a), b in zip(ref.named_parameters(), manual.parameters()):
        assert (a.grad - b.grad).abs().max() <= tol, name


def test_twenty_adamw_steps_give_the_same_weights():
    ref, manual = pair(torch.float32)
    ids, mask = batch(ref.config.vocab_size)
    opts = [AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in (ref, manual)]
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        ids = torch.randint(ref.config.vocab_size, ids.shape, generator=g)
        for model, opt in zip((ref, manual), opts):
            opt.zero_grad()
            model(ids, mask, labels=ids)["loss"].backward()
            opt.step()
    for (name, a), b in zip(ref.named_parameters(), manual.parameters()):
        assert (a - b).abs().max() <= 1e-5, name


def test_manual_model_keeps_the_state_dict_and_generates_the_same():
    ref, manual = pair(torch.float32)
    assert list(ref.state_dict()) == list(manual.state_dict())
    assert isinstance(manual.gpt.gpt_layers[0].interm_dense, mb.ManualLinear)
    prompt = torch.randint(ref.config.vocab_size, (2, 5))
    assert torch.equal(ref.generate(prompt, max_new_tokens=6), manual.generate(prompt, max_new_tokens=6))


def test_dropout_in_manual_attention_drops_and_rescales():
    attn = mb.ManualAttention(scale=1.0, dropout=0.5).train()
    v = torch.ones(1, 1, 400, 1)
    out = attn(torch.zeros(1, 1, 400, 1), torch.zeros(1, 1, 400, 1), v, None)  # causal, uniform probabilities
    assert not torch.allclose(out, torch.ones_like(out))  # some probability mass was dropped ...
    assert abs(out[0, 200:].mean().item() - 1.0) < 0.1  # ... and the rest scaled up by 1 / (1 - p)
    out = attn.eval()(torch.zeros(1, 1, 400, 1), torch.zeros(1, 1, 400, 1), v, None)  # eval: nothing dropped
    torch.testing.assert_close(out, torch.ones(1, 400, 1))


def test_config_errors_and_autocast_is_refused():
    with pytest.raises(ValueError, match="backward must be one of"):
        GPT2Config(backward="by hand")
    with pytest.raises(ValueError, match="tanh GELU only"):
        GPT2Config(backward="manual", activation_function="relu")
    assert "backward" not in GPT2Config(backward="manual").to_dict()
    _, manual = pair(torch.float32)
    ids, _ = batch(manual.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="do not support autocast"):
        manual(ids)
