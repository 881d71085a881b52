"""Parity of GPT2Model / GPT2LMHeadModel with transformers.GPT2LMHeadModel (eager), fp32, atol 1e-5."""
import pytest
import torch
import torch.utils.checkpoint
import transformers
from conftest import TINY_CONFIGS, checkpointed_twin, make_hf_model, padded_batch, tiny_config

from config import PRESETS, GPT2Config
from models.gpt2 import GPT2LMHeadModel, GPT2Model, position_ids_from_mask
from models.loading import hf_to_ours

ATOL = 1e-5


def load_pair(config: GPT2Config, seed: int = 0, attn: str = "sdpa"):
    hf = make_hf_model(config, seed)
    ours = GPT2LMHeadModel(config.replace(attn_implementation=attn))
    ours.gpt.load_state_dict(hf_to_ours(hf.state_dict(), config.n_layer))
    return hf, ours.eval()


def hidden_states(model, layers, *args, **kwargs):
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for layer in layers]
    try:
        result = model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return result, outs


BATCHES = {
    "no padding": ([9, 9, 9], "right"),
    "right": ([9, 4, 1], "right"),
    "left": ([9, 4, 1], "left"),
    "mixed sides": ([3, 9, 6, 5], ["left", "right", "left", "right"]),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("padding", list(BATCHES))
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_logits_and_every_hidden_state_match_transformers(name, padding, attn):
    config = tiny_config(name)
    hf, ours = load_pair(config, attn=attn)
    lengths, side = BATCHES[padding]
    ids, mask = padded_batch(lengths, 9, config.vocab_size, side)
    with torch.no_grad():
        ours_out, ours_h = hidden_states(ours, ours.gpt.gpt_layers, ids, mask)
        hf_out, hf_h = hidden_states(hf, hf.transformer.h, ids, attention_mask=mask,
                                     position_ids=position_ids_from_mask(mask), output_hidden_states=True)
    real = mask.bool()
    assert len(ours_h) == len(hf_h) == config.n_layer
    for a, b in zip(ours_h, hf_h):
        torch.testing.assert_close(a[real], b[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.gpt(ids, mask)["last_hidden_state"][real], hf_out.hidden_states[-1][real],
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_out["logits"][real], hf_out.logits[real], atol=ATOL, rtol=0)
    assert torch.isfinite(ours_out["logits"]).all()  # padding positions too: no NaN anywhere


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gradients_of_every_parameter_match_transformers(attn):
    config = tiny_config("h3-inner")
    hf, ours = load_pair(config, seed=1, attn=attn)
    hf.train(), ours.train()  # dropout is 0: train mode must still be deterministic and equal
    ids, mask = padded_batch([9, 5, 7], 9, config.vocab_size, ["left", "right", "left"], seed=3)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)  # ours also skips targets predicted from padding
    hf_loss = hf(ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), labels=labels).loss
    ours_loss = ours(ids, mask, labels=ids)["loss"]
    torch.testing.assert_close(ours_loss, hf_loss, atol=ATOL, rtol=0)
    hf_loss.backward()
    ours_loss.backward()
    hf_grads = hf_to_ours({n: p.grad for n, p in hf.named_parameters()}, config.n_layer)
    ours_grads = {n: p.grad for n, p in ours.gpt.named_parameters()}
    assert set(hf_grads) == set(ours_grads)
    for name, g in ours_grads.items():
        torch.testing.assert_close(g, hf_grads[name], atol=ATOL, rtol=0, msg=name)


def test_sdpa_and_explicit_attention_paths_agree_in_outputs_and_gradients():
    config = tiny_config("h4-wide")
    torch.manual_seed(0)
    a = GPT2LMHeadModel(config.replace(attn_implementation="sdpa"))
    b = GPT2LMHeadModel(config.replace(attn_implementation="eager"))
    b.load_state_dict(a.state_dict())
    ids, mask = padded_batch([12, 7, 3], 12, config.vocab_size, ["left", "right", "left"])
    la, lb = a(ids, mask, labels=ids), b(ids, mask, labels=ids)
    real = mask.bool()
    torch.testing.assert_close(la["logits"][real], lb["logits"][real], atol=ATOL, rtol=0)
    la["loss"].backward()
    lb["loss"].backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=ATOL, rtol=0, msg=name)


def test_left_padding_gives_the_unpadded_outputs_and_last_token_is_last_real_token():
    config = tiny_config("h5")
    torch.manual_seed(0)
    model = GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 6))
    with torch.no_grad():
        alone = model(ids, torch.ones_like(ids))
        for side in ("left", "right"):
            pad = torch.randint(0, config.vocab_size, (1, 4))
            padded = torch.cat([pad, ids], 1) if side == "left" else torch.cat([ids, pad], 1)
            mask = torch.tensor([[0] * 4 + [1] * 6]) if side == "left" else torch.tensor([[1] * 6 + [0] * 4])
            out = model(padded, mask)
            real = out["last_hidden_state"][mask.bool()]
            torch.testing.assert_close(real, alone["last_hidden_state"][0], atol=ATOL, rtol=0)
            torch.testing.assert_close(out["last_token"], alone["last_token"], atol=ATOL, rtol=0)
            torch.testing.assert_close(alone["last_token"][0], alone["last_hidden_state"][0, -1])


def test_two_argument_course_call_and_module_names():
    config = tiny_config("h3-inner")
    model = GPT2Model(config)
    layer = model.gpt_layers[0]
    for name in ("word_embedding", "pos_embedding", "embed_dropout", "gpt_layers", "final_layer_norm"):
        assert hasattr(model, name)
    assert model.position_ids.shape == (1, config.n_positions)
    for name in ("self_attention", "attention_dense", "attention_layer_norm", "attention_dropout", "interm_dense",
                 "out_dense", "out_layer_norm", "out_dropout"):
        assert hasattr(layer, name)
    for name in ("query", "key", "value"):
        assert isinstance(getattr(layer.self_attention, name), torch.nn.Linear)
    ids = torch.randint(0, config.vocab_size, (2, 5))
    out = model(ids, torch.ones_like(ids))
    assert out["last_hidden_state"].shape == (2, 5, config.n_embd) and out["last_token"].shape == (2, config.n_embd)
    assert model.hidden_state_to_token(out["last_hidden_state"]).shape == (2, 5, config.vocab_size)
    h = model.encode(model.embed(ids), torch.ones_like(ids))
    torch.testing.assert_close(model.final_layer_norm(h), out["last_hidden_state"])


def test_lm_head_is_tied_to_the_token_embedding():
    model = GPT2LMHeadModel(tiny_config("h5"))
    with torch.no_grad():
        model.gpt.word_embedding.weight[3].fill_(0.5)
    h = torch.randn(1, 1, model.config.n_embd)
    assert model.gpt.hidden_state_to_token(h)[0, 0, 3].item() == pytest.approx(0.5 * h.sum().item(), rel=1e-5)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in model.gpt.parameters())


def test_dropout_is_active_only_in_train_mode():
    config = tiny_config("h4-wide", resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)
    hf, ours = load_pair(config)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    ours.train()
    a, b = ours(ids)["logits"], ours(ids)["logits"]
    assert not torch.allclose(a, b)
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)["logits"], ours(ids)["logits"], atol=0, rtol=0)
        torch.testing.assert_close(ours(ids)["logits"], hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameter_counts_of_official_presets_equal_transformers(preset):
    config = GPT2Config.from_preset(preset)
    with torch.device("meta"):
        ours = GPT2LMHeadModel(config)
        hf = transformers.GPT2LMHeadModel(config.to_hf())
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(ours) == count(hf)
    expected_m = {"gpt2": 124, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558}[preset]
    assert round(count(ours) / 1e6) == expected_m
    ours_shapes = {k: tuple(v.shape) for k, v in ours.gpt.state_dict().items()}
    hf_shapes = {k: tuple(v.shape) for k, v in hf_to_ours(hf.state_dict(), config.n_layer).items()}
    assert ours_shapes == hf_shapes


def test_init_follows_gpt2_scheme():
    config = GPT2Config(vocab_size=500, n_embd=256, n_layer=8, n_head=4)
    torch.manual_seed(0)
    model = GPT2Model(config)
    layer = model.gpt_layers[3]
    assert layer.interm_dense.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.out_dense.weight.std().item() == pytest.approx(0.02 / (2 * 8) ** 0.5, rel=0.05)
    assert layer.attention_dense.weight.std().item() == pytest.approx(0.02 / (2 * 8) ** 0.5, rel=0.05)
    assert model.word_embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(layer.interm_dense.bias == 0) and torch.all(layer.out_layer_norm.weight == 1)


def test_loss_ignores_padding_and_minus_100():
    config = tiny_config("h5")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 6))
    padded = torch.cat([ids, torch.randint(0, config.vocab_size, (1, 3))], 1)
    mask = torch.tensor([[1] * 6 + [0] * 3])
    with torch.no_grad():
        torch.testing.assert_close(model(padded, mask, labels=padded)["loss"], model(ids, labels=ids)["loss"])
        labels = padded.clone()
        labels[:, 6:] = -100
        torch.testing.assert_close(model(padded, labels=labels)["loss"], model(ids, labels=ids)["loss"])


def test_gradient_checkpointing_gives_the_same_gradients(monkeypatch):
    config = tiny_config("h4-wide")
    calls = []
    recompute = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or recompute(*a, **k))
    a, b = checkpointed_twin(config)
    ids = torch.randint(0, config.vocab_size, (2, 10))
    a(ids, labels=ids)["loss"].backward()
    assert calls == []
    b(ids, labels=ids)["loss"].backward()
    assert len(calls) == config.n_layer  # every block of b ran under checkpoint()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=0)


def test_bad_inputs_raise_clear_errors():
    config = tiny_config("h5")
    model = GPT2Model(config)
    with pytest.raises(ValueError, match="exceeds the model's context of n_positions=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 257\)"):
        model(torch.tensor([[1, 257]]))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(ValueError, match="no real token"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="seq_len >= 1"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_every_integer_dtype_of_input_ids_gives_the_int64_outputs(dtype):
    model = GPT2Model(tiny_config("h5")).eval()
    ids = torch.randint(0, 120, (2, 6))  # fits every dtype listed
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    want = model(ids, mask)
    got = model(ids.to(dtype), mask)
    assert torch.equal(got["last_hidden_state"], want["last_hidden_state"])
    assert torch.equal(got["last_token"], want["last_token"])
