"""Architecture variants (nanochat's GPT): RMSNorm, RoPE, grouped-query attention, q/k norm, ReLU^2, no biases,
untied and soft-capped LM head. Each part against its reference (torch, transformers' Llama), the cache against the
uncached forward, decoding against a no-cache reference, checkpoints round trip, bad configs named."""
import json
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import padded_batch, tiny_config
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from config import VARIANT_FIELDS, GPT2Config, nanochat_preset
from models.gpt2 import GPT2LMHeadModel, GPT2Model
from models.loading import hf_to_ours, ours_to_hf
from modules import rmsnorm
from modules.attention import CausalSelfAttention
from modules.masks import build_attention_mask, position_ids_from_mask
from modules.norms import RMSNorm
from modules.positions import RotaryEmbedding, apply_rotary

ATOL = 1e-5
# "h4-wide" is n_embd 64, 4 heads of 16; every variant alone, then together.
VARIANTS = {
    "rmsnorm": dict(norm="rmsnorm"),
    "rmsnorm-no-scale": dict(norm="rmsnorm", norm_scale=False),
    "layernorm-no-scale": dict(norm_scale=False),
    "relu2": dict(activation_function="relu2"),
    "rope": dict(position_embedding="rope", rope_theta=500.0),
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "qk-norm": dict(qk_norm=True),
    "no-bias": dict(bias=False),
    "untied": dict(tie_word_embeddings=False),
    "softcap": dict(logit_softcap=2.0),
    "nanochat-like": dict(norm="rmsnorm", norm_scale=False, activation_function="relu2", position_embedding="rope",
                          n_kv_head=2, qk_norm=True, bias=False, tie_word_embeddings=False, logit_softcap=15.0),
    "llama-like": dict(norm="rmsnorm", position_embedding="rope", n_kv_head=1, qk_norm=True, bias=False,
                       tie_word_embeddings=False),
}


def variant(name: str, **overrides) -> GPT2Config:
    return tiny_config("h4-wide", **{**VARIANTS[name], **overrides})


def randomised(model, seed=0):
    """Norm scales and biases away from their 1 / 0 init, so that a mis-wired one cannot hide."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def build(config, seed=0):
    torch.manual_seed(seed)
    return randomised(GPT2LMHeadModel(config), seed)


# ---- parts against their references ----------------------------------------------------------------------------

def test_rmsnorm_equals_torch_rms_norm_and_llama_rmsnorm():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 32) * 3 + 1
    ours = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(32) + 0.5)
    llama = LlamaRMSNorm(32, eps=1e-6)
    llama.weight.data.copy_(ours.weight)
    bare = RMSNorm(32, eps=1e-6, scale=False)
    # the one-pass kernel (modules/rmsnorm.py) sums in another order than torch's composite: float32 rounding apart;
    # with it off, torch's own rms_norm, bit for bit
    torch.testing.assert_close(ours(x), F.rms_norm(x, (32,), ours.weight, 1e-6), atol=1e-6, rtol=1e-6)
    saved, rmsnorm._library = rmsnorm._library, False
    try:
        torch.testing.assert_close(ours(x), F.rms_norm(x, (32,), ours.weight, 1e-6), atol=0, rtol=0)
        torch.testing.assert_close(bare(x), F.rms_norm(x, (32,), None, 1e-6), atol=0, rtol=0)
    finally:
        rmsnorm._library = saved
    torch.testing.assert_close(ours(x), llama(x), atol=1e-6, rtol=1e-6)
    by_hand = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * ours.weight
    torch.testing.assert_close(ours(x), by_hand, atol=1e-6, rtol=1e-6)
    assert bare.weight is None and not list(bare.parameters())
    torch.testing.assert_close(bare(x), F.rms_norm(x, (32,), None, 1e-6), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rotary_equals_transformers_llama_rotary_embedding(theta):
    """Same q/k, same positions (left padding: repeated zeros, then counting): LlamaRotaryEmbedding +
    apply_rotary_pos_emb give our values. k has fewer heads (grouped-query attention)."""
    torch.manual_seed(0)
    B, nh, n_kv, T, hs = 2, 4, 2, 9, 16
    llama_config = transformers.LlamaConfig(hidden_size=nh * hs, num_attention_heads=nh, num_key_value_heads=n_kv,
                                            rope_theta=theta, max_position_embeddings=64)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])
    positions = position_ids_from_mask(mask)
    q, k = torch.randn(B, nh, T, hs), torch.randn(B, n_kv, T, hs)
    cos, sin = LlamaRotaryEmbedding(llama_config)(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = apply_rotary(q, k, RotaryEmbedding(hs, theta)(positions))
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    # relative: the score of q at position p and k at position s depends on p - s only
    one_q, one_k = torch.randn(1, 1, 1, hs).expand(1, 1, T, hs), torch.randn(1, 1, 1, hs).expand(1, 1, T, hs)
    rq, rk = apply_rotary(one_q, one_k, RotaryEmbedding(hs, theta)(torch.arange(T)[None]))
    scores = (rq @ rk.transpose(-1, -2))[0, 0]
    torch.testing.assert_close(scores.diagonal(0), scores.diagonal(0)[:1].expand(T), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores.diagonal(-2), scores.diagonal(-2)[:1].expand(T - 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("n_kv_head", [2, 1])
@pytest.mark.parametrize("extras", [{}, dict(position_embedding="rope", qk_norm=True)])
def test_grouped_query_attention_equals_attention_with_repeated_kv_heads(attn, n_kv_head, extras):
    config = tiny_config("h4-wide", attn_implementation=attn, **extras)
    torch.manual_seed(0)
    gqa = randomised(CausalSelfAttention(config.replace(n_kv_head=n_kv_head)))
    mha = CausalSelfAttention(config).eval()
    groups, hs = config.n_head // n_kv_head, config.head_dim
    repeat = lambda t: t.unflatten(0, (n_kv_head, hs)).repeat_interleave(groups, 0).flatten(0, 1)  # noqa: E731
    with torch.no_grad():
        for name, p in mha.named_parameters():
            source = gqa.get_parameter(name)
            p.copy_(repeat(source) if name.startswith(("key.", "value.")) else source)
    assert gqa.key.weight.shape == (n_kv_head * hs, config.n_embd)
    x = torch.randn(3, 8, config.n_embd)
    _, mask = padded_batch([8, 5, 2], 8, 10, ["left", "right", "left"])
    rope = RotaryEmbedding(hs, config.rope_theta)(position_ids_from_mask(mask))
    for m in (build_attention_mask(mask, 8, 0), None):
        torch.testing.assert_close(gqa(x, m, None, rope), mha(x, m, None, rope), atol=ATOL, rtol=0)


def test_relu2_and_softcap_are_what_they_say():
    model = build(variant("softcap", activation_function="relu2"))
    x = torch.randn(50)
    assert torch.equal(model.gpt.gpt_layers[0].interm_af(x), torch.relu(x) ** 2)
    h = torch.randn(2, 3, 64) * 20
    logits = model.gpt.hidden_state_to_token(h)
    torch.testing.assert_close(logits, 2.0 * torch.tanh(h @ model.gpt.word_embedding.weight.t() / 2.0))
    assert logits.abs().max() < 2.0


def test_modules_are_chosen_at_construction():
    gpt2 = GPT2Model(tiny_config("h4-wide"))
    assert isinstance(gpt2.pos_embedding, torch.nn.Embedding) and gpt2.lm_head is None
    assert isinstance(gpt2.final_layer_norm, torch.nn.LayerNorm)
    assert gpt2.lm_head_weight is gpt2.word_embedding.weight
    nano = GPT2Model(variant("nanochat-like"))
    keys = set(nano.state_dict())
    assert "pos_embedding.weight" not in keys and "lm_head.weight" in keys
    assert not any(k.endswith(".bias") or "norm" in k for k in keys), keys  # no biases, parameter-free norms
    assert nano.gpt_layers[0].self_attention.key.out_features == 2 * 16
    assert isinstance(nano.gpt_layers[0].out_layer_norm, RMSNorm)
    llama = GPT2Model(variant("llama-like"))
    assert {"gpt_layers.0.self_attention.q_norm.weight", "final_layer_norm.weight"} <= set(llama.state_dict())
    assert "final_layer_norm.bias" not in llama.state_dict()



@pytest.mark.filterwarnings("error")  # e.g. rms_norm's "Mismatch dtype between input and weight"
def test_bf16_autocast_and_a_bf16_model_run_a_variant_close_to_float32():
    config = variant("llama-like")
    model = build(config)
    ids, mask = padded_batch([8, 5], 8, config.vocab_size, "left")
    real = mask.bool()
    with torch.no_grad():
        want = model(ids, mask)["logits"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(ids, mask)["logits"]
        half = build(config).to(torch.bfloat16)(ids, mask)["logits"]
    for got in (mixed, half):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float()[real], want[real], atol=0.05, rtol=0.05)
    assert model.generate(ids, mask, max_new_tokens=3).shape == (2, 11)

# ---- the KV cache, padding and decoding --------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_decoding_equals_the_uncached_forward_with_left_padding(name, attn):
    config = variant(name, attn_implementation=attn)
    model = build(config)
    ids, mask = padded_batch([9, 4, 6], 9, config.vocab_size, "left", seed=1)
    more = torch.randint(0, config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    full_ids, full_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    with torch.no_grad():
        want = model(full_ids, full_mask)["logits"]
        out = model(ids, mask, use_cache=True)
        cache = out["past_key_values"]
        assert cache.keys.shape[2] == config.kv_heads  # only the key/value heads are cached
        got = [out["logits"]]
        for t in range(3):  # one token at a time
            step = model(more[:, t: t + 1], full_mask[:, : 10 + t], past_key_values=cache, use_cache=True)
            got.append(step["logits"])
        got.append(model(more[:, 3:], full_mask, past_key_values=cache)["logits"])  # then two at once
    got = torch.cat(got, 1)
    real = full_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)
    # left padding changes nothing for the real tokens: each row alone, unpadded
    for i in range(3):
        alone = model(full_ids[i: i + 1, real[i]])["logits"][0]
        torch.testing.assert_close(want[i, real[i]], alone, atol=ATOL, rtol=0)


def test_gradient_checkpointing_gives_the_same_gradients_for_a_rope_model():
    config = variant("nanochat-like")
    a, b = build(config).train(), build(config).train()
    b.gpt.gradient_checkpointing = True
    ids, mask = padded_batch([8, 5], 8, config.vocab_size, "left")
    for m in (a, b):
        m(ids, mask, labels=ids)["loss"].backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=ATOL, rtol=0, msg=name)


def no_cache_greedy(model, ids, mask, n):
    """The reference decode: the whole sequence through forward (no cache) for every new token."""
    for _ in range(n):
        logits = model(ids, mask)["logits"][:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


def no_cache_beam(model, ids, mask, num_beams, n):
    """Reference beam search without EOS (every hypothesis ends at n new tokens, so the search keeps the num_beams
    best sequences by summed log-probability), one prompt at a time, each step recomputed without a cache."""
    best = []
    for row, row_mask in zip(ids, mask):
        beams, scores = row[None], torch.zeros(1)
        for _ in range(n):
            m = row_mask[None].expand(len(beams), -1)
            m = torch.cat([m, torch.ones(len(beams), beams.shape[1] - row.shape[0], dtype=m.dtype)], 1)
            logp = F.log_softmax(model(beams, m)["logits"][:, -1].float(), -1)  # (beams, V)
            top, index = (scores[:, None] + logp).flatten().topk(num_beams)
            beams = torch.cat([beams[index // logp.shape[1]], (index % logp.shape[1])[:, None]], 1)
            scores = top
        best.append(beams[0])
    return torch.stack(best)


@pytest.mark.parametrize("name", ["nanochat-like", "llama-like"])
def test_generate_rope_gqa_variant_equals_a_no_cache_reference(name):
    config = variant(name)
    model = build(config, seed=3)
    ids, mask = padded_batch([7, 3, 1, 5], 7, config.vocab_size, "left", seed=4)
    with torch.no_grad():
        want = no_cache_greedy(model, ids, mask, 12)
    assert torch.equal(model.generate(ids, mask, max_new_tokens=12), want)  # batched, left-padded
    for i in range(4):  # one prompt at a time, unpadded
        alone = ids[i: i + 1, mask[i].bool()]
        assert torch.equal(model.generate(alone, max_new_tokens=12)[0, -12:], want[i, -12:])
    with torch.no_grad():
        want_beam = no_cache_beam(model, ids, mask, 3, 6)
    assert torch.equal(model.generate(ids, mask, max_new_tokens=6, num_beams=3), want_beam)
    # EOS: a row that emits it stops and is padded
    eos = int(want[0, 8])
    got = model.generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got[0, : 9], want[0, : 9]) and (got[0, 9:] == 0).all()


# ---- checkpoints and configs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["nanochat-like", "llama-like", "layernorm-no-scale", "gqa", "untied"])
def test_variant_save_and_load_round_trip(tmp_path, name):
    model = build(variant(name))
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for field in model.config.variant_fields():
        assert written[field] == getattr(model.config, field)
    assert written["model_type"] == ("gpt2" if name == "untied" else "gpt2-variant")  # what transformers can run
    back = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert back.config.to_dict() == model.config.to_dict()
    ids, mask = padded_batch([8, 3], 8, model.config.vocab_size, "left")
    assert torch.equal(back(ids, mask)["logits"], model(ids, mask)["logits"])
    for (key, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), key


def test_conversion_functions_are_inverse_for_variants():
    config = variant("llama-like", bias=True)
    ours = build(config).gpt.state_dict()
    hf = ours_to_hf(ours, config)
    assert hf["h.0.attn.c_attn.weight"].shape == (64, 64 + 2 * 16) and "wpe.weight" not in hf
    assert "lm_head.weight" in hf and "h.1.attn.k_norm.weight" in hf
    back = hf_to_ours(hf, config)
    assert set(back) == set(ours) and all(torch.equal(back[k], ours[k]) for k in ours)
    with pytest.raises(ValueError, match=r"missing keys: lm_head\.weight"):
        hf_to_ours({k: v for k, v in hf.items() if k != "lm_head.weight"}, config)
    with pytest.raises(ValueError, match=r"unexpected keys: wpe\.weight"):
        hf_to_ours({**hf, "wpe.weight": torch.zeros(3, 64)}, config)


def test_a_gpt2_config_json_holds_no_variant_fields(tmp_path):
    GPT2LMHeadModel(tiny_config()).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert not set(VARIANT_FIELDS) & set(written) and written["tie_word_embeddings"] is True


def test_untied_relu2_variant_matches_transformers(tmp_path):
    """The variants transformers' GPT-2 can run export through to_hf, and its model loads our folder."""
    config = variant("untied", activation_function="relu2")
    hf_config = config.to_hf()
    assert hf_config.tie_word_embeddings is False and hf_config.activation_function == "relu2"
    ours = build(config)
    ours.save_pretrained(tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    ids = torch.randint(0, config.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)["logits"], hf(ids).logits, atol=ATOL, rtol=0)
    hf.save_pretrained(tmp_path / "hf")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert not back.config.tie_word_embeddings
    assert torch.equal(back(ids)["logits"], ours(ids)["logits"])


@pytest.mark.parametrize("field, value", [
    ("norm", "rmsnorm"), ("norm_scale", False), ("position_embedding", "rope"), ("n_kv_head", 2),
    ("qk_norm", True), ("bias", False), ("logit_softcap", 30.0),
])
def test_to_hf_refuses_what_transformers_gpt2_cannot_run_naming_the_field(field, value):
    config = tiny_config("h4-wide", **{field: value})
    with pytest.raises(ValueError, match=f"cannot represent.*{field}="):
        config.to_hf()
    tiny_config("h4-wide", n_kv_head=4).to_hf()  # as many kv heads as heads is plain GPT-2
    tiny_config("h4-wide", rope_theta=123.0).to_hf()  # theta without RoPE changes nothing


@pytest.mark.parametrize("kwargs, names", [
    (dict(n_head=4, n_kv_head=3), ["n_head", "n_kv_head"]),
    (dict(n_head=2, n_kv_head=4), ["n_head", "n_kv_head"]),
    (dict(n_kv_head=0), ["n_kv_head"]),
    (dict(n_embd=20, n_head=4, position_embedding="rope"), ["rope", "n_embd", "n_head"]),
    (dict(norm="batchnorm"), ["norm"]),
    (dict(position_embedding="alibi"), ["position_embedding"]),
    (dict(rope_theta=0.0), ["rope_theta"]),
    (dict(logit_softcap=0.0), ["logit_softcap"]),
    (dict(logit_softcap=float("inf")), ["logit_softcap"]),
    (dict(qk_norm="yes"), ["qk_norm"]),
    (dict(bias=1), ["bias"]),
    (dict(backward="manual", norm="rmsnorm", bias=False), ["manual", "norm", "bias"]),
])
def test_invalid_combinations_raise_naming_the_fields(kwargs, names):
    with pytest.raises(ValueError) as info:
        GPT2Config(**{**dict(n_embd=64, n_head=4), **kwargs})
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_every_variant_field_round_trips_through_config_json(tmp_path):
    config = variant("nanochat-like", rope_theta=321.0, layer_norm_epsilon=1e-6)
    config.to_json_file(tmp_path / "config.json")
    assert GPT2Config.from_json_file(tmp_path / "config.json").to_dict() == config.to_dict()
    # marked as a model transformers' GPT-2 cannot run: its Auto classes refuse it rather than build a GPT-2
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2-variant"
    with pytest.raises(ValueError, match="gpt2-variant"):
        transformers.AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("depth, width, heads", [(1, 128, 1), (3, 256, 2), (12, 768, 6), (20, 1280, 10),
                                                 (26, 1664, 13), (32, 2048, 16)])
def test_nanochat_preset_follows_nanochats_sizing_rule(depth, width, heads):
    config = GPT2Config.from_preset(f"nanochat-d{depth}", vocab_size=300)
    assert (config.n_layer, config.n_embd, config.n_head, config.kv_heads, config.head_dim) == (
        depth, width, heads, heads, 128)
    assert (config.norm, config.norm_scale, config.activation_function, config.position_embedding) == (
        "rmsnorm", False, "relu2", "rope")
    assert (config.qk_norm, config.bias, config.tie_word_embeddings, config.logit_softcap, config.rope_theta) == (
        True, False, False, 15.0, 100000.0)
    assert config.vocab_size == 300 and nanochat_preset(depth)["n_positions"] == 2048
    with pytest.raises(ValueError, match="nanochat depth"):
        GPT2Config.from_preset("nanochat-d0")


# ---- run_pretrain.py: the flags reach the model, checkpoints resume, a changed architecture is refused ------------

TEXT = "".join(f"the {w} of {n} said the {v}.\n" for w, v, n in zip(
    ["king", "queen", "fool"] * 30, ["crown", "song", "sword", "word"] * 23, ["york", "rome"] * 45))
TINY = ["--n_layer", "1", "--n_head", "4", "--n_embd", "16", "--block_size", "16", "--batch_size", "4",
        "--eval_iters", "2", "--log_interval", "5", "--num_samples", "0", "--threads", "1", "--warmup_iters", "1",
        "--eval_interval", "3"]
VARIANT_ARGS = ["--norm", "rmsnorm", "--no-norm_scale", "--activation", "relu2", "--position_embedding", "rope",
                "--rope_theta", "1000", "--n_kv_head", "2", "--qk_norm", "--no-bias", "--no-tie_word_embeddings",
                "--logit_softcap", "10"]


def test_pretraining_a_variant_from_the_flags_resumes_and_refuses_another_architecture(tmp_path):
    import run_pretrain

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    common = ["--data", str(corpus), "--out_dir", str(tmp_path / "out"), *TINY]
    first = run_pretrain.main([*common, *VARIANT_ARGS, "--max_iters", "3"])
    config = first["model"].config
    assert (config.norm, config.norm_scale, config.activation_function, config.position_embedding) == (
        "rmsnorm", False, "relu2", "rope")
    assert (config.rope_theta, config.kv_heads, config.qk_norm, config.bias, config.tie_word_embeddings,
            config.logit_softcap) == (1000.0, 2, True, False, False, 10.0)
    resumed = run_pretrain.main([*common, "--max_iters", "6", "--resume"])  # the checkpoint's own architecture
    assert resumed["steps_run"] == 3 and resumed["model"].config.to_dict() == config.to_dict()
    for flags, field in [(["--norm", "layernorm"], "norm"), (["--bias"], "bias"), (["--n_kv_head", "4"], "kv_heads"),
                         (["--activation", "gelu_new"], "activation_function")]:
        with pytest.raises(ValueError, match=f"different architecture.*{field}"):
            run_pretrain.main([*common, *flags, "--max_iters", "9", "--resume"])


def test_depth_flag_builds_nanochats_gpt_and_flags_override_it(capsys):
    import run_pretrain
    from tasks.char_tokenizer import CharTokenizer
    from tasks.pretrain import build_config

    tokenizer = CharTokenizer(list("abc"))
    args = run_pretrain.parse_args(["--data", "x", "--depth", "3"])
    config = build_config(args, tokenizer)
    assert config.to_dict() == GPT2Config.from_preset("nanochat-d3", vocab_size=3, bos_token_id=None,
                                                      eos_token_id=None).to_dict()
    args = run_pretrain.parse_args(["--data", "x", "--depth", "3", "--n_head", "4", "--norm_scale", "--bias",
                                    "--logit_softcap", "30", "--activation", "gelu"])
    config = build_config(args, tokenizer)
    assert (config.n_head, config.kv_heads, config.norm_scale, config.bias, config.logit_softcap) == (4, 4, True,
                                                                                                     True, 30.0)
    assert (config.activation_function, config.norm, config.position_embedding) == ("gelu", "rmsnorm", "rope")
    plain = build_config(run_pretrain.parse_args(["--data", "x"]), tokenizer)
    assert not plain.variant_fields() and plain.activation_function == "gelu_new"
    for argv, message in [(["--preset", "gpt2", "--depth", "2"], "--preset .* and --depth"),
                          (["--arch", "bigram", "--qk_norm"], "--qk_norm"),
                          (["--arch", "bigram", "--depth", "2"], "--depth")]:
        with pytest.raises(SystemExit):
            run_pretrain.parse_args(["--data", "x", *argv])
        assert re.search(message, capsys.readouterr().err)


def test_paraphrase_last_linear_layer_trains_the_untied_head_alone():
    from tasks.paraphrase import ParaphraseGPT

    tied = ParaphraseGPT(GPT2Model(tiny_config("h4-wide")), 1, 2, "last-linear-layer")
    assert [n for n, p in tied.named_parameters() if p.requires_grad] == ["gpt.word_embedding.weight"]
    untied = ParaphraseGPT(GPT2Model(variant("untied")), 1, 2, "last-linear-layer")
    assert [n for n, p in untied.named_parameters() if p.requires_grad] == ["gpt.lm_head.weight"]
