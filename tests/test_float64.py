"""A float64 model computes in float64 end to end: the upcasts that exist for half precision (the LM loss, the
pretraining loss, RMSNorm) must not round float64 down to float32. Checked where it shows: finite differences of the
LM's own loss against autograd and the hand-derived backward, and the two backward paths against each other."""
import pytest
import torch
from conftest import tiny_config

from models.gpt2 import GPT2LMHeadModel, GPT2Model
from modules.norms import RMSNorm
from tasks import classifier, paraphrase
from tasks.pretrain import next_token_loss


def pair():
    """An autograd and a manual-backward float64 model with the same weights: matrices at std 0.2, so that attention
    is far from uniform and every parameter moves the loss; biases and gains away from 0 and 1."""
    cfg = tiny_config("h3-inner")
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg).double()
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(std=0.2)
    manual = GPT2LMHeadModel(cfg.replace(backward="manual")).double()
    manual.load_state_dict(ref.state_dict())
    return ref, manual


def padded_batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, -3:] = 0  # right padding
    return ids, mask


def test_float64_model_loss_is_float64():
    ref, manual = pair()
    ids, mask = padded_batch(ref.config.vocab_size)
    for model in (ref, manual):
        assert model(ids, mask, labels=ids)["loss"].dtype == torch.float64
    assert next_token_loss(ref, ids[:, :-1], ids[:, 1:]).dtype == torch.float64
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    assert RMSNorm(8).double()(x).dtype == torch.float64
    torch.testing.assert_close(RMSNorm(8).double()(x), x * x.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt(),
                               atol=1e-15, rtol=0)  # not a float32 result cast back


def test_task_losses_of_a_float64_model_are_float64():
    ids, mask = padded_batch(tiny_config().vocab_size)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1])}
    model = classifier.GPT2SentimentClassifier(GPT2Model(tiny_config()), 3, 0.0).double()
    assert classifier.loss_fn(model, batch)[0].dtype == torch.float64
    model = paraphrase.ParaphraseGPT(GPT2Model(tiny_config()), yes_id=5, no_id=7).double()
    assert paraphrase.loss_fn(model, batch)[0].dtype == torch.float64


def test_backward_paths_agree_to_1e_12_on_a_padded_float64_model():
    ref, manual = pair()
    ids, mask = padded_batch(ref.config.vocab_size)
    losses = []
    for model in (ref, manual):
        loss = model(ids, mask, labels=ids)["loss"]  # the LM's own loss, shifted and masked
        loss.backward()
        losses.append(loss.detach())
    assert abs(losses[0] - losses[1]) <= 1e-12
    for (name, a), b in zip(ref.named_parameters(), manual.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-12, name


@pytest.mark.parametrize("name", ["gpt.word_embedding.weight", "gpt.gpt_layers.0.self_attention.query.weight",
                                  "gpt.gpt_layers.0.attention_layer_norm.bias", "gpt.gpt_layers.1.interm_dense.bias",
                                  "gpt.final_layer_norm.weight"])
def test_central_differences_agree_with_both_backward_paths(name):
    ref, manual = pair()
    ids, mask = padded_batch(ref.config.vocab_size)
    for model in (ref, manual):
        model(ids, mask, labels=ids)["loss"].backward()
    full = dict(ref.named_parameters())[name].grad
    index = tuple(int(i) for i in torch.unravel_index(full.abs().argmax(), full.shape))  # its largest entry
    grads = [dict(model.named_parameters())[name].grad[index].item() for model in (ref, manual)]
    p, h = dict(ref.named_parameters())[name], 1e-5
    with torch.no_grad():
        p[index] += h
        up = ref(ids, mask, labels=ids)["loss"].item()
        p[index] -= 2 * h
        down = ref(ids, mask, labels=ids)["loss"].item()
        p[index] += h
    numeric = (up - down) / (2 * h)  # error O(h^2) + O(eps |loss| / h): about 1e-10 in float64
    assert abs(numeric) > 1e-3, "the parameter must move the loss for the check to mean anything"
    for grad in grads:
        assert abs(grad - numeric) <= 1e-7 * abs(numeric), (grad, numeric)
