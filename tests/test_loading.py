"""The HF <-> ours loader: every source format, both directions, and every failure named."""
import json

import pytest
import torch
import transformers
from conftest import make_hf_model, tiny_config
from safetensors.torch import load_file, save_file

from models import loading
from models.gpt2 import GPT2LMHeadModel, GPT2Model
from models.loading import CheckpointError, hf_to_ours, ours_to_hf

ATOL = 1e-5


def logits_equal(ours, hf, config, atol=ATOL):
    ids = torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)["logits"], hf(ids).logits, atol=atol, rtol=0)


def test_a_quoted_home_path_is_expanded(hf_folder, monkeypatch):
    hf, folder = hf_folder()
    monkeypatch.setenv("HOME", str(folder.parent))
    ours = GPT2LMHeadModel.from_pretrained(f"~/{folder.name}")  # as it arrives from a quoted shell argument
    logits_equal(ours, hf, ours.config)


def test_load_hf_folder_with_safetensors(hf_folder):
    hf, folder = hf_folder()
    ours = GPT2LMHeadModel.from_pretrained(folder)
    assert not ours.training
    logits_equal(ours, hf, ours.config)
    body = GPT2Model.from_pretrained(folder)
    torch.testing.assert_close(body.word_embedding.weight, hf.transformer.wte.weight)


def test_load_sharded_safetensors(hf_folder):
    hf, folder = hf_folder(max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    logits_equal(GPT2LMHeadModel.from_pretrained(folder), hf, tiny_config())


def test_load_pytorch_bin_with_old_buffers_and_without_prefix(tmp_path):
    """Old checkpoints: pytorch_model.bin, no `transformer.` prefix, attn.bias / attn.masked_bias buffers."""
    config = tiny_config()
    hf = make_hf_model(config)
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    for i in range(config.n_layer):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 40, 40, dtype=torch.uint8))
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    config.to_json_file(tmp_path / "config.json")
    logits_equal(GPT2LMHeadModel.from_pretrained(tmp_path), hf, config)


def test_load_single_weights_file_with_config_beside_or_given(tmp_path, hf_folder):
    hf, folder = hf_folder()
    ours = GPT2LMHeadModel.from_pretrained(folder / "model.safetensors")
    logits_equal(ours, hf, ours.config)
    lone = tmp_path / "lone" / "weights.safetensors"
    lone.parent.mkdir()
    lone.write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="cannot infer the number of heads"):
        GPT2LMHeadModel.from_pretrained(lone)
    logits_equal(GPT2LMHeadModel.from_pretrained(lone, config=tiny_config()), hf, ours.config)


def test_round_trip_ours_to_hf_to_ours(tmp_path):
    config = tiny_config("h5")
    torch.manual_seed(0)
    ours = GPT2LMHeadModel(config).eval()
    ours.save_pretrained(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    logits_equal(ours, hf, config)
    hf.save_pretrained(tmp_path / "b")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "b")
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_saved_files_have_hf_key_names_and_no_tied_copy(tmp_path):
    config = tiny_config()
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert "transformer.wte.weight" in keys and "transformer.h.0.attn.c_attn.weight" in keys
    assert "lm_head.weight" not in keys
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"


def test_conversion_functions_are_inverse():
    config = tiny_config("h4-wide")
    hf_sd = {k.removeprefix("transformer."): v for k, v in make_hf_model(config).state_dict().items()
             if k != "lm_head.weight"}
    ours = hf_to_ours(hf_sd, config.n_layer)
    back = ours_to_hf(ours, config.n_layer)
    assert set(back) == set(hf_sd)
    for k in hf_sd:
        assert torch.equal(back[k], hf_sd[k]), k
    # q/k/v split: the first third of c_attn's output columns is the query projection.
    c = config.n_embd
    assert torch.equal(ours["gpt_layers.1.self_attention.query.weight"], hf_sd["h.1.attn.c_attn.weight"][:, :c].t())
    assert torch.equal(ours["gpt_layers.1.self_attention.value.bias"], hf_sd["h.1.attn.c_attn.bias"][2 * c:])


def _rewrite(folder, edit):
    sd = load_file(folder / "model.safetensors")
    edit(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("transformer.h.1.mlp.c_fc.weight"), r"missing keys: h\.1\.mlp\.c_fc\.weight"),
    (lambda sd: sd.__setitem__("transformer.h.0.attn.extra", torch.zeros(2)), r"unexpected keys: h\.0\.attn\.extra"),
    (lambda sd: sd.__setitem__("transformer.h.7.ln_1.weight", torch.zeros(24)), r"unexpected keys: h\.7\.ln_1\.weight"),
    (lambda sd: sd.__setitem__("transformer.wpe.weight", torch.zeros(50, 24)), r"pos_embedding\.weight: checkpoint \(50, 24\)"),
    (lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(101, 24)), "lm_head.weight that differs"),
])
def test_bad_keys_and_shapes_fail_naming_them(hf_folder, edit, message):
    _, folder = hf_folder()
    _rewrite(folder, edit)
    with pytest.raises(CheckpointError, match=message):
        GPT2LMHeadModel.from_pretrained(folder)


def test_unreadable_files_give_clear_errors(tmp_path, hf_folder):
    _, folder = hf_folder()
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        GPT2LMHeadModel.from_pretrained(folder)

    evil = tmp_path / "evil"
    evil.mkdir()
    tiny_config().to_json_file(evil / "config.json")
    torch.save({"weights": torch.zeros(1), "payload": _Arbitrary()}, evil / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="holds Python objects other than tensors"):
        GPT2LMHeadModel.from_pretrained(evil)
    torch.save({"weights": torch.zeros(1), "payload": _RunsCode()}, evil / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="holds Python objects other than tensors"):  # torch: "unsupported GLOBAL"
        GPT2LMHeadModel.from_pretrained(evil)

    (evil / "pytorch_model.bin").write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match="truncated or not a torch checkpoint"):
        GPT2LMHeadModel.from_pretrained(evil)


class _Arbitrary:
    pass


class _RunsCode:
    """Unpickles into a call of os.system (never reached: weights_only refuses it first)."""

    def __reduce__(self):
        import os

        return os.system, ("true",)


def test_missing_paths_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        GPT2LMHeadModel.from_pretrained(tmp_path / "nowhere" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        GPT2LMHeadModel.from_pretrained("./does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no weights in"):
        GPT2LMHeadModel.from_pretrained(tmp_path / "empty")


def test_hub_id_unreachable_names_the_model():
    # HF_HUB_OFFLINE=1 in the tests: the hub path runs, finds nothing cached, and says so.
    with pytest.raises(FileNotFoundError, match="cannot get 'gpt2-medium' from the Hugging Face hub"):
        GPT2LMHeadModel.from_pretrained("gpt2-medium")


def test_hub_id_goes_through_hf_hub_download(monkeypatch, hf_folder):
    """The hub code path end to end, with hf_hub_download served from a local folder (as the cache would)."""
    hf, folder = hf_folder()
    calls = []

    def fake_download(repo_id, filename, local_files_only=False, **kw):
        calls.append((repo_id, filename, local_files_only))
        path = folder / filename
        if not path.exists():
            from huggingface_hub.errors import LocalEntryNotFoundError

            raise LocalEntryNotFoundError(f"{filename} not cached")
        return str(path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    ours = GPT2LMHeadModel.from_pretrained("openai-community/gpt2-tiny")
    logits_equal(ours, hf, ours.config)
    assert calls[0] == ("openai-community/gpt2-tiny", "config.json", True)
    assert ("openai-community/gpt2-tiny", "model.safetensors", True) in calls


def test_course_arguments_and_config_overrides(hf_folder):
    _, folder = hf_folder()
    body = GPT2Model.from_pretrained(folder, d=24, l=3, num_heads=3, hidden_dropout_prob=0.25)
    assert body.config.resid_pdrop == 0.25 and body.gpt_layers[0].out_dropout.p == 0.25
    with pytest.raises(CheckpointError, match="has n_layer=3, but 12 was asked for"):
        GPT2Model.from_pretrained(folder, d=24, l=12)


def test_dtype_option_and_no_random_init_of_loaded_weights(hf_folder):
    hf, folder = hf_folder()
    ours = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert ours.gpt.position_ids.dtype == torch.long and ours.gpt.position_ids.device.type == "cpu"
    want = hf_to_ours(hf.state_dict(), ours.config.n_layer)  # every loaded weight, exactly (no init after loading)
    for name, value in ours.gpt.state_dict().items():
        if name in want:
            assert torch.equal(value, want[name].to(torch.bfloat16)), name
    logits_equal(ours.float(), hf, ours.config, atol=1e-2)  # bf16 rounding of the weights only (measured ~1e-3)


def test_save_is_atomic_when_interrupted(tmp_path, monkeypatch):
    """A crash while writing leaves the previous checkpoint intact and no temporary files."""
    config = tiny_config()
    torch.manual_seed(0)
    first = GPT2LMHeadModel(config)
    first.save_pretrained(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    import safetensors.torch

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        GPT2LMHeadModel(config).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    monkeypatch.undo()
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.gpt.word_embedding.weight, first.gpt.word_embedding.weight)


def test_infer_config_for_a_preset_shaped_file():
    config = loading.infer_config({"wte.weight": torch.empty(50257, 768), "wpe.weight": torch.empty(1024, 768),
                                   **{f"h.{i}.mlp.c_fc.weight": torch.empty(768, 3072) for i in range(12)}})
    assert (config.n_layer, config.n_head, config.n_embd, config.inner_dim) == (12, 12, 768, 3072)


def test_meta_modules_build_shapes_only_and_leave_real_tensors_alone():
    """loading.meta_modules: every parameter and buffer of a model built inside is a meta tensor of the right shape;
    draws and fills of a real tensor inside it still happen; a model built after it is drawn as if it had never been
    entered."""
    config = tiny_config()
    with loading.meta_modules():
        skeleton = GPT2LMHeadModel(config)
        drawn, filled = torch.zeros(3, device="cpu"), torch.zeros(2, device="cpu")
        torch.manual_seed(0)
        torch.nn.init.normal_(drawn)
        filled.fill_(2.0)
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.randn(3)) and torch.equal(filled, torch.full((2,), 2.0))
    torch.manual_seed(1)
    built = GPT2LMHeadModel(config)
    assert {k: v.shape for k, v in built.state_dict().items()} == {k: v.shape for k, v in skeleton.state_dict().items()}
    torch.manual_seed(1)
    again = GPT2LMHeadModel(config).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in built.state_dict().items())


def test_loading_a_checkpoint_in_a_fresh_process_never_imports_the_compiler(hf_folder):
    """from_pretrained (GPT2LMHeadModel and GPT2Model) and a LoRA model's save_base build on the meta device without
    its init draws: torch's normal_ on a meta tensor imports torch._dynamo (1.5 s of every process that loads a
    checkpoint, run_classifier's reload of best/ among them). The loaded weights are the checkpoint's."""
    import subprocess
    import sys
    from pathlib import Path

    hf, folder = hf_folder()
    code = f"""
import sys, torch
from models.gpt2 import GPT2LMHeadModel, GPT2Model
from models.lora import apply_lora, save_base
lm = GPT2LMHeadModel.from_pretrained({str(folder)!r})
body = GPT2Model.from_pretrained({str(folder)!r})
apply_lora(lm, rank=2)
save_base(lm, {str(folder / "base")!r})
print("torch._dynamo" in sys.modules, float(lm.gpt.word_embedding.weight.double().sum()))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, total = done.stdout.split()
    assert loaded == "False"
    assert float(total) == pytest.approx(float(hf.transformer.wte.weight.double().sum()), rel=0, abs=1e-9)
