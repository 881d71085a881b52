"""modules/packed.py: bf16 inference of many rows with the weights kept in oneDNN's blocked layout (and q/k/v as one
packed product). The path is taken on AMX CPUs only; here it is switched on (GPT2_PACKED_BF16=force) wherever oneDNN
has bf16 kernels, so its correctness is tested on AVX512-BF16 CPUs too. Against the same model with the path off: a
layer equals F.linear to bf16 rounding (rtol 1.6e-2), a whole model's logits to a few bf16 steps of the logits'
scale, greedy tokens equal."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import packed_switch, tiny_config

from models.gpt2 import GPT2LMHeadModel
from modules import packed
from modules.linear import Linear
from optimizer import AdamW

pytestmark = pytest.mark.skipif(not packed._bf16_kernels(),
                                reason="oneDNN has no bf16 kernels on this CPU (needs AVX512-BF16 or AMX)")


@pytest.fixture
def packing(monkeypatch):
    """The packed path on, whatever the CPU's AMX flag says (GPT2_PACKED_BF16=force); `off()` turns it off for a
    reference run."""
    return packed_switch(monkeypatch)


kept = packed.kept


def bf16_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(tiny_config("h4-wide", **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)  # GPT-2's init zeroes biases; a dropped one would hide
            if name.endswith(("query.weight", "key.weight")):
                p.mul_(10)  # peaked attention: queries and keys mixed up would show
    return model.to(torch.bfloat16)


def test_a_layer_of_many_rows_equals_f_linear_and_few_rows_or_gradients_keep_f_linear(packing):
    layer = Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(2, 40, 64).bfloat16()
    with torch.no_grad():
        y = layer(x)
        assert kept(layer) == ["_packed"]
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1.6e-2, atol=1e-2)
        layer.weight.mul_(-1)  # an in-place update: the packed copy is made again
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1.6e-2, atol=1e-2)
        few = Linear(64, 48).to(torch.bfloat16)
        few(x[:, :31])  # 62 rows: under MIN_ROWS
    assert kept(few) == []
    fresh = Linear(64, 48).to(torch.bfloat16)
    fresh(x).sum().backward()  # gradients: training keeps F.linear
    assert kept(fresh) == [] and fresh.weight.grad is not None


@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 2}, {"bias": False}], ids=["gpt2", "gqa", "no-bias"])
def test_a_bf16_forward_with_packed_weights_equals_the_forward_without(packing, overrides):
    model = bf16_model(**overrides)
    ids = torch.randint(0, 1000, (4, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)["logits"]
        assert kept(model) == sorted(["_packed_head"] + ["_packed_qkv", "_packed", "_packed", "_packed"] * 2)
        packing.off()
        expected = model(ids)["logits"]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=scale / 32)  # a few bf16 steps
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


def test_greedy_generation_of_a_long_prompt_is_the_same_with_packed_weights(packing):
    model = bf16_model(seed=3)
    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    with_packed = model.generate(torch.cat([ids, ids]), torch.cat([mask, mask]), max_new_tokens=8)  # 96-row prefill
    assert "_packed_qkv" in kept(model)
    packing.off()
    assert torch.equal(with_packed, model.generate(torch.cat([ids, ids]), torch.cat([mask, mask]), max_new_tokens=8))


def test_clear_drops_the_copies_and_the_switch_turns_the_path_off(packing):
    model = bf16_model()
    ids = torch.randint(0, 1000, (2, 40))
    with torch.no_grad():
        model(ids)
        assert packed.clear(model) == 9 and kept(model) == []  # per layer q/k/v, out, fc, proj; the head
        packing.off()
        model(ids)
    assert kept(model) == []
    with torch.no_grad():
        packing.on()
        model(ids)
    assert kept(model) != [] and kept(copy.deepcopy(model)) == []  # opaque oneDNN tensors stay out of copies
    with pytest.raises(ValueError, match="a bias or none"):
        packed.weights(torch.nn.Module(), (torch.ones(2, 2).bfloat16(),) * 2, (torch.ones(2).bfloat16(), None), "_p", 64)


@pytest.mark.parametrize("overrides", [{}, {"n_kv_head": 2}], ids=["gpt2", "gqa"])
def test_the_fused_qkv_product_gives_each_projection_its_own_weight_and_bias(packing, overrides):
    model = bf16_model(**overrides)
    attention = model.gpt.gpt_layers[0].self_attention
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 40, 64, generator=g).bfloat16()
    with torch.no_grad():
        for layer in (attention.query, attention.key, attention.value):
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 2)  # large and distinct per projection
        assert attention.fused_qkv_applies(x)
        fused = attention.fused_qkv(x)
        packing.off()
        for got, layer in zip(fused, (attention.query, attention.key, attention.value)):
            expected = attention.split_heads(F.linear(x, layer.weight, layer.bias))
            torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=2e-2)


MODEL_VARIANTS = {"gpt2": {}, "gqa": {"n_kv_head": 2}, "no-bias": {"bias": False},
                  "untied-softcap": {"tie_word_embeddings": False, "logit_softcap": 5.0},
                  "rmsnorm-rope-qk-norm": {"norm": "rmsnorm", "position_embedding": "rope", "qk_norm": True}}


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_packed_forwards_equal_the_plain_path_before_and_after_a_training_step(packing, variant):
    """An AdamW step changes every weight in place (same storage, a new version): the packed copies follow."""
    model = bf16_model(seed=5, **MODEL_VARIANTS[variant])
    ids = torch.randint(0, 1000, (4, 20), generator=torch.Generator().manual_seed(6))

    def packed_and_plain():
        with torch.no_grad():
            packing.on()
            got = model(ids)["logits"].float()
            assert "_packed_qkv" in kept(model)
            packing.off()
            expected = model(ids)["logits"].float()
        torch.testing.assert_close(got, expected, rtol=0, atol=expected.abs().max().item() / 32)  # a few bf16 steps
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
        return got

    before = packed_and_plain()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    model(ids, labels=ids)["loss"].backward()
    optimizer.step()
    after = packed_and_plain()
    assert not torch.allclose(before, after, atol=0.1)  # the step changed the outputs, and the packed path saw it
