import json

import pytest
import transformers

from config import ALIASES, PRESETS, GPT2Config

COURSE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, intermediate_size=100,
              max_position_embeddings=50, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.05,
              layer_norm_eps=1e-6)
HF = dict(n_embd=64, n_layer=3, n_head=8, n_inner=100, n_positions=50, resid_pdrop=0.2, embd_pdrop=0.2,
          attn_pdrop=0.05, layer_norm_epsilon=1e-6)


def _hf_fields(cfg):
    return {k: getattr(cfg, k) for k in HF}


def test_every_alias_is_in_the_table_and_names_real_fields():
    fields = set(GPT2Config.__dataclass_fields__)
    assert set(COURSE) == set(ALIASES)
    assert all(set(targets) <= fields for targets in ALIASES.values())


def test_construction_with_course_aliases_sets_the_hf_fields():
    cfg = GPT2Config(**COURSE)
    assert _hf_fields(cfg) == HF
    assert cfg == GPT2Config(**HF)  # aliases are not fields of their own: the two configs are equal
    assert {k: getattr(cfg, k) for k in COURSE} == COURSE  # reading an alias reads its field
    assert GPT2Config().intermediate_size == 4 * 768  # n_inner None -> the effective width 4 * n_embd


def test_hidden_dropout_prob_means_residual_and_embedding_dropout_through_every_path(tmp_path):
    base = GPT2Config(resid_pdrop=0.1, embd_pdrop=0.1)
    via_init = GPT2Config(hidden_dropout_prob=0.3)
    via_replace = base.replace(hidden_dropout_prob=0.3)
    via_dict = GPT2Config.from_dict({"hidden_dropout_prob": 0.3})
    via_setattr = GPT2Config()
    via_setattr.hidden_dropout_prob = 0.3
    for cfg in (via_init, via_replace, via_dict, via_setattr):
        assert (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop, cfg.hidden_dropout_prob) == (0.3, 0.3, 0.1, 0.3)


def test_replace_takes_aliases_like_the_constructor():
    cfg = GPT2Config().replace(**COURSE)
    assert _hf_fields(cfg) == HF
    cfg.hidden_size = 32
    assert cfg.n_embd == 32
    with pytest.raises(TypeError, match="both 'hidden_size' and its HF name 'n_embd'"):
        GPT2Config().replace(hidden_size=64, n_embd=64)
    with pytest.raises(TypeError, match="both 'hidden_dropout_prob' and its HF name 'embd_pdrop'"):
        GPT2Config(hidden_dropout_prob=0.2, embd_pdrop=0.0)


def test_a_course_config_json_round_trips_through_our_json_and_transformers(tmp_path):
    (tmp_path / "course.json").write_text(json.dumps({**COURSE, "vocab_size": 300, "model_type": "gpt2"}))
    cfg = GPT2Config.from_json_file(tmp_path / "course.json")
    assert _hf_fields(cfg) == HF and cfg.vocab_size == 300
    assert not set(COURSE) & set(cfg.extra)  # aliases are read, not kept as unknown keys
    cfg.to_json_file(tmp_path / "config.json")
    written = json.loads((tmp_path / "config.json").read_text())
    assert not set(COURSE) & set(written)  # HF names only, once each
    hf = transformers.GPT2Config.from_pretrained(tmp_path)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.max_position_embeddings) == (64, 3, 8, 50)
    assert (hf.n_inner, hf.resid_pdrop, hf.embd_pdrop, hf.attn_pdrop) == (100, 0.2, 0.2, 0.05)
    assert _hf_fields(GPT2Config.from_hf(hf)) == HF
    # a config.json holding both names (HF's own plus a course alias) keeps the HF value
    both = GPT2Config.from_dict({"n_embd": 48, "hidden_size": 64, "n_head": 4})
    assert both.n_embd == 48


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


def test_config_json_carries_n_ctx_for_llama_cpp(tmp_path):
    """The official config.json's n_ctx (the context length), which llama.cpp's convert_hf_to_gguf.py reads:
    written from n_positions, and never a stale value carried over from a loaded file."""
    d = GPT2Config(n_positions=256).to_dict()
    assert d["n_ctx"] == 256
    (tmp_path / "config.json").write_text(json.dumps({**d, "n_ctx": 999}))
    loaded = GPT2Config.from_json_file(tmp_path / "config.json").replace(n_positions=128)
    assert loaded.to_dict()["n_ctx"] == 128
