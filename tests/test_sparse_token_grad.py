"""The tied token embedding's gradient as rows (models/gpt2.py: GPT2Model.sparse_token_grad).

GPT2LMHeadModel's training forward looks tokens up and takes the LM head's weight in one node (models/gpt2.py:
_TiedTable), whose backward adds the looked-up rows into the head's dense gradient in place instead of building and
adding a second (V, C) matrix (or, as autograd would add sparse rows, copying the head's). Every test compares with the dense path
(the body and the head called apart, as a classifier or a user would) at atol 1e-6 in fp32: the two differ only in
the order of additions. `.grad` must stay dense whatever the loss goes through.
"""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from models.gpt2 import GPT2LMHeadModel, lm_loss

ATOL = 1e-6


def make_model(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_config("h4-wide", **overrides)).train()


def batch(seed: int = 1, shape=(3, 12)) -> torch.Tensor:
    # a repeated token, so that rows of the embedding's gradient add up
    ids = torch.randint(0, 1000, shape, generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = ids[0, 1]
    return ids


def dense_loss(model: GPT2LMHeadModel, ids: torch.Tensor) -> torch.Tensor:
    """The same loss without head_follows: the body and the head called apart, so the embedding stays dense."""
    hidden = model.gpt(ids)["last_hidden_state"]
    return lm_loss(model.gpt.hidden_state_to_token(hidden), ids, None, ids.shape[1], F.cross_entropy)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].layout == torch.strided, name
        torch.testing.assert_close(a[name], b[name], atol=ATOL, rtol=0, msg=name)


@pytest.fixture
def sparse_lookups(monkeypatch):
    """Records True for every lookup through the tied node (_TiedTable), False for every other F.embedding call."""
    from models import gpt2

    seen = []
    original, tied = F.embedding, gpt2._TiedTable.apply

    def spy(*args, **kwargs):
        seen.append(False)
        return original(*args, **kwargs)

    def spy_tied(*args):
        seen.append(True)
        return tied(*args)

    monkeypatch.setattr(F, "embedding", spy)
    monkeypatch.setattr(gpt2._TiedTable, "apply", spy_tied)
    return seen


def test_training_forward_takes_rows_and_gives_the_dense_path_s_gradients(sparse_lookups):
    ours, ref = make_model(), make_model()
    ids = batch()
    ours(ids, labels=ids)["loss"].backward()
    assert True in sparse_lookups  # the token lookup went the sparse way
    sparse_lookups.clear()
    dense_loss(ref, ids).backward()
    assert True not in sparse_lookups
    assert_same_grads(grads(ours), grads(ref))


def test_no_rows_without_gradients_frozen_embeddings_or_an_untied_head(sparse_lookups):
    ids = batch()
    model = make_model()
    with torch.no_grad():
        model(ids, labels=ids)
    model.gpt.word_embedding.weight.requires_grad_(False)  # frozen (LoRA and the like)
    model(ids, labels=ids)["loss"].backward()
    assert model.gpt.word_embedding.weight.grad is None
    untied = make_model(tie_word_embeddings=False)
    untied(ids, labels=ids)["loss"].backward()  # the embedding alone: rows would be its whole gradient
    assert untied.gpt.word_embedding.weight.grad.layout == torch.strided
    assert True not in sparse_lookups


def test_accumulating_micro_batches_matches_the_dense_path():
    ours, ref = make_model(), make_model()
    for seed in (1, 2, 3):
        ids = batch(seed)
        ours(ids, labels=ids)["loss"].backward()
        dense_loss(ref, ids).backward()
    assert_same_grads(grads(ours), grads(ref))


def test_a_loss_that_skips_the_head_still_leaves_a_dense_gradient():
    """Rows alone reach the weight when the loss comes from hidden states (a hook on a layer): the hook on the
    weight makes them dense, and they equal the dense path's gradient."""
    ours, ref = make_model(), make_model()
    ids = batch()
    captured = []
    ours.gpt.gpt_layers[0].register_forward_hook(lambda m, i, o: captured.append(o))
    ours(ids)
    captured[0].square().mean().backward()
    grad = ours.gpt.word_embedding.weight.grad
    assert grad.layout == torch.strided
    ref.gpt.gpt_layers[0](ref.gpt.embed(ids)).square().mean().backward()
    torch.testing.assert_close(grad, ref.gpt.word_embedding.weight.grad, atol=ATOL, rtol=0)


def test_autograd_grad_returns_a_dense_gradient():
    model = make_model()
    ids = batch()
    (grad,) = torch.autograd.grad(model(ids, labels=ids)["loss"], [model.gpt.word_embedding.weight])
    assert grad.layout == torch.strided


def test_bf16_autocast_matches_the_dense_path():
    ours, ref = make_model(), make_model()
    ids = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours_loss = ours(ids, labels=ids)["loss"]
        ref_loss = dense_loss(ref, ids)
    ours_loss.backward()
    ref_loss.backward()
    a, b = grads(ours), grads(ref)
    for name in a:
        assert a[name].layout == torch.strided, name
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-3, msg=name)


def test_a_trained_model_deep_copies_saves_and_keeps_training():
    model = make_model()
    ids = batch()
    model(ids, labels=ids)["loss"].backward()
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the hook on the weight is a module-level function: pickles
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for m in (clone, loaded):
        m.zero_grad(set_to_none=True)
        m(ids, labels=ids)["loss"].backward()
        assert m.gpt.word_embedding.weight.grad.layout == torch.strided
    torch.testing.assert_close(clone.gpt.word_embedding.weight.grad, loaded.gpt.word_embedding.weight.grad,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rows_go_into_the_heads_gradient_in_place(dtype):
    """The weight's .grad is the head's own gradient tensor with the rows added (no (V, C) copy: the point of the
    tied node), and equals the dense path's; in bf16 (bf16-weights) too."""
    ours, ref = make_model().to(dtype), make_model().to(dtype)
    ids = batch()
    out = ours.gpt(ids, head_follows=True)
    seen = []
    out["head_weight"].register_hook(lambda g: seen.append(g.data_ptr()))
    logits = ours.gpt.hidden_state_to_token(out["last_hidden_state"], out["head_weight"])
    lm_loss(logits, ids, None, ids.shape[1], F.cross_entropy).backward()
    grad = ours.gpt.word_embedding.weight.grad
    assert seen == [grad.data_ptr()] and grad.layout == torch.strided
    dense_loss(ref, ids).backward()
    tol = dict(atol=ATOL, rtol=0) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(grad.float(), ref.gpt.word_embedding.weight.grad.float(), **tol)


def test_a_body_forward_without_the_head_gives_no_head_weight():
    model = make_model()
    ids = batch()
    assert "head_weight" not in model.gpt(ids)
    with torch.no_grad():
        assert "head_weight" not in model.gpt(ids, head_follows=True)
