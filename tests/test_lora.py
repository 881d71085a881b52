"""LoRA (models/lora.py): PEFT parity both ways, merge / unmerge, merged checkpoints, training and resuming with
adapters, and the bad inputs. PEFT on transformers' GPT-2 is the reference throughout."""
import json

import pytest
import torch
from conftest import make_hf_model, padded_batch, tiny_config

from models.gpt2 import GPT2LMHeadModel
from models.lora import (AdapterError, apply_lora, load_adapter, lora_modules, merge_lora, save_adapter,
                         unmerge_lora)
from models.loading import CheckpointError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def randomize_adapters(model, seed=0):
    """Random A and B (a fresh adapter has B = 0, which would hide any mistake in B or in the scaling)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def hf_logits(model, ids, mask):
    """transformers numbers positions 0..T-1 whatever the padding; give it ours (cumsum - 1) to compare."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def batches(vocab):
    return [padded_batch([7, 4, 9], 9, vocab, side) for side in ("right", "left")]


def assert_same_logits(ours, ref, vocab):
    for ids, mask in batches(vocab):
        a = ours(ids, mask)["logits"]
        b = hf_logits(ref, ids, mask)
        real = mask.bool()
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=0)


@pytest.fixture
def base(hf_folder):
    """(our LM, transformers' LM, folder) on the same random weights."""
    hf, folder = hf_folder(tiny_config("h3-inner"))
    return GPT2LMHeadModel.from_pretrained(folder), hf, folder


def peft_from(folder, adapter):
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    return peft.PeftModel.from_pretrained(hf, adapter).eval()


@pytest.mark.parametrize("rank,targets", [(1, ["c_attn"]), (4, ["attention", "mlp"]),
                                          (3, ["query", "value", "mlp.c_proj"]), (2, "c_fc,c_proj")])
def test_our_adapter_loads_in_peft_with_the_same_logits(base, tmp_path, rank, targets):
    ours, _, folder = base
    apply_lora(ours, rank=rank, alpha=2.5 * rank, targets=targets)
    randomize_adapters(ours)
    save_adapter(ours.eval(), tmp_path / "adapter", base_model=str(folder))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == rank and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) <= {"c_attn", "c_proj", "attn.c_proj", "c_fc", "mlp.c_proj"}
    assert_same_logits(ours, peft_from(folder, tmp_path / "adapter"), ours.config.vocab_size)


PEFT_CONFIGS = [
    dict(r=4, lora_alpha=8, target_modules=["c_attn"]),
    dict(r=2, lora_alpha=5, target_modules=["c_attn", "c_proj", "c_fc"], use_rslora=True),
    dict(r=3, lora_alpha=6, target_modules=["c_attn", "c_fc"], layers_to_transform=[0, 2],
         rank_pattern={"h.2.attn.c_attn": 5}, alpha_pattern={"h.0.mlp.c_fc": 1.5}),
]


@pytest.mark.parametrize("kw", PEFT_CONFIGS, ids=["c_attn", "rslora-all", "patterns-some-layers"])
def test_a_peft_adapter_loads_into_ours_with_the_same_logits_and_saves_back_unchanged(base, tmp_path, kw):
    ours, hf, folder = base
    ref = peft.get_peft_model(hf, peft.LoraConfig(fan_in_fan_out=True, **kw))
    randomize_adapters(ref, seed=1)
    ref.save_pretrained(tmp_path / "peft")
    load_adapter(ours, tmp_path / "peft")
    assert_same_logits(ours, ref.eval(), ours.config.vocab_size)

    save_adapter(ours, tmp_path / "back")  # exact both ways: the same tensors, and PEFT reads the same model
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "peft" / "adapter_model.safetensors"), load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert_same_logits(ours, peft_from(folder, tmp_path / "back"), ours.config.vocab_size)


def test_merge_then_unmerge_restores_the_base_and_a_merged_checkpoint_loads_in_transformers(base, tmp_path):
    ours, _, folder = base
    before = {k: v.clone() for k, v in ours.state_dict().items() if "lora_" not in k}
    apply_lora(ours, rank=4, alpha=8, targets="all")
    randomize_adapters(ours)
    ids, mask = batches(ours.config.vocab_size)[1]
    with torch.no_grad():
        adapted = ours(ids, mask)["logits"]
        merge_lora(ours)
        merged = ours(ids, mask)["logits"]
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)
    ours.save_pretrained(tmp_path / "merged")
    hf_merged = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    real = mask.bool()
    torch.testing.assert_close(hf_logits(hf_merged, ids, mask)[real], adapted[real], atol=1e-5, rtol=0)

    unmerge_lora(ours)
    after = ours.state_dict()
    assert max((after[k] - v).abs().max().item() for k, v in before.items()) <= 1e-6
    with pytest.raises(CheckpointError, match="unmerged LoRA"):
        ours.save_pretrained(tmp_path / "unmerged")  # would silently drop the adapter


def test_bad_hyperparameters_and_targets_are_refused_naming_the_problem(base):
    ours = base[0]
    for kw, msg in [(dict(rank=0), "rank must be a positive integer"), (dict(alpha=0), "alpha must be positive"),
                    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"), (dict(dropout=-0.1), "dropout"),
                    (dict(targets=["c_attn", "lm_head"]), "'lm_head' names no layer; valid targets: c_attn")]:
        with pytest.raises(ValueError, match=msg):
            apply_lora(ours, **kw)
    assert not lora_modules(ours) and all(p.requires_grad for p in ours.parameters())  # nothing half-applied


def test_adapters_for_another_shape_or_with_unsupported_peft_features_are_refused(base, hf_folder, tmp_path):
    ours, _, _ = base
    _, other = hf_folder(tiny_config("h3-inner", n_embd=30, n_inner=40), seed=1)  # wider body, same layer count
    ref = peft.get_peft_model(transformers.GPT2LMHeadModel.from_pretrained(other), peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    ref.save_pretrained(tmp_path / "wide")
    with pytest.raises(AdapterError, match=r"another base shape: h\.0\.attn\.c_attn\.lora_A \(2, 30\)"):
        load_adapter(ours, tmp_path / "wide")
    assert not lora_modules(ours)

    hf = transformers.GPT2LMHeadModel.from_pretrained(base[2])
    for kw, msg in [(dict(use_dora=True), "use_dora"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
                    (dict(bias="lora_only"), "bias='lora_only'")]:
        dora = peft.get_peft_model(transformers.GPT2LMHeadModel.from_pretrained(base[2]), peft.LoraConfig(
            r=2, target_modules=["c_attn"], fan_in_fan_out=True, **kw))
        dora.save_pretrained(tmp_path / msg)
        with pytest.raises(AdapterError, match=f"cannot represent exactly: {msg}"):
            load_adapter(ours, tmp_path / msg)
    emb = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["wte", "c_fc"], fan_in_fan_out=True))
    emb.save_pretrained(tmp_path / "emb")
    with pytest.raises(AdapterError, match=r"not LoRA A/B of GPT-2's .*transformer\.wte\.lora_embedding_A"):
        load_adapter(ours, tmp_path / "emb")
