import json

import pytest
import transformers

from config import ALIASES, PRESETS, GPT2Config


def test_course_aliases_read_and_write_the_hf_fields():
    cfg = GPT2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, intermediate_size=100,
                     max_position_embeddings=50, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.05,
                     layer_norm_eps=1e-6)
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_inner, cfg.n_positions) == (64, 3, 8, 100, 50)
    assert (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop, cfg.layer_norm_epsilon) == (0.2, 0.2, 0.05, 1e-6)
    cfg.hidden_size = 32
    assert cfg.n_embd == 32
    for alias, name in ALIASES.items():
        if alias not in ("intermediate_size",):
            assert getattr(cfg, alias) == getattr(cfg, name)
    assert GPT2Config().intermediate_size == 4 * 768  # n_inner None -> 4 * n_embd


def test_presets_match_official_architectures():
    sizes = {name: (c["n_layer"], c["n_head"], c["n_embd"]) for name, c in PRESETS.items()}
    assert sizes == {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
                     "gpt2-xl": (48, 25, 1600)}
    assert GPT2Config.from_preset("openai-community/gpt2-xl").n_head == 25
    with pytest.raises(ValueError, match="unknown GPT-2 preset"):
        GPT2Config.from_preset("gpt3")


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_embd=10, n_head=3), "divisible by n_head"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(vocab_size=-5), "vocab_size must be a positive integer"),
    (dict(n_positions=2.5), "n_positions must be a positive integer"),
    (dict(n_inner=0), "n_inner"),
    (dict(resid_pdrop=1.0), "resid_pdrop"),
    (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
    (dict(activation_function="swish"), "activation_function"),
    (dict(attn_implementation="flash"), "attn_implementation"),
])
def test_invalid_values_raise_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPT2Config(**kwargs)


def test_unknown_and_duplicate_fields_raise():
    with pytest.raises(TypeError, match="unknown field"):
        GPT2Config(n_embed=10)
    with pytest.raises(TypeError, match="both 'hidden_size' and its HF name 'n_embd'"):
        GPT2Config(hidden_size=64, n_embd=64)


def test_round_trip_through_transformers_config():
    cfg = GPT2Config(vocab_size=321, n_positions=77, n_embd=48, n_layer=5, n_head=6, n_inner=100, resid_pdrop=0.0,
                     scale_attn_by_inverse_layer_idx=True, pad_token_id=7)
    hf = cfg.to_hf()
    assert isinstance(hf, transformers.GPT2Config)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.n_inner) == (48, 5, 6, 100)
    back = GPT2Config.from_hf(hf)
    for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "resid_pdrop",
                 "scale_attn_by_inverse_layer_idx", "pad_token_id", "layer_norm_epsilon"):
        assert getattr(back, name) == getattr(cfg, name), name


def test_config_json_is_read_by_transformers_and_back(tmp_path):
    cfg = GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4)
    cfg.to_json_file(tmp_path / "config.json")
    hf = transformers.GPT2Config.from_pretrained(tmp_path)
    assert (hf.vocab_size, hf.n_embd, hf.n_layer, hf.n_head, hf.model_type) == (300, 32, 2, 4, "gpt2")
    hf.save_pretrained(tmp_path / "hf")
    back = GPT2Config.from_json_file(tmp_path / "hf" / "config.json")
    assert (back.vocab_size, back.n_embd, back.n_layer, back.n_head) == (300, 32, 2, 4)


@pytest.mark.parametrize("field, value, message", [
    ("add_cross_attention", True, "cross_attention"),
    ("tie_word_embeddings", False, "tie_word_embeddings"),
    ("model_type", "llama", "not a GPT-2 config"),
])
def test_unsupported_hf_configs_are_refused(tmp_path, field, value, message):
    d = GPT2Config().to_dict()
    d[field] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message):
        GPT2Config.from_json_file(tmp_path / "config.json")


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        GPT2Config.from_json_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        GPT2Config.from_json_file(tmp_path / "bad.json")
