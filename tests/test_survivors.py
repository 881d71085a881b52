"""Behaviour that mutation testing found unpinned (issue 40): each test checks a reference, a round trip or an
invariant that a plausible slip in the code would break."""
import pytest
import torch
import torch.nn.functional as F
from conftest import padded_batch, tiny_config

from models.generation import decode_lm_head
from models.gpt2 import GPT2LMHeadModel, GPT2Model, lm_loss
from models.lora import apply_lora, merge_lora, unmerge_lora
from modules import rows as row_kernel
from modules.norms import make_norm
from tasks.char_tokenizer import CharTokenizer

# ---- LoRA: merge and unmerge are idempotent ----------------------------------------------------------------------

def test_merging_an_already_merged_adapter_changes_nothing_and_unmerging_twice_restores_the_base():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h3-inner")).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, rank=3, alpha=6, targets="all")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a fresh adapter has B = 0: a doubled delta would still be zero
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ids, mask = padded_batch([7, 4], 8, model.config.vocab_size, "left")
    with torch.no_grad():
        adapted = model(ids, mask)["logits"]  # the adapters applied in the forward pass: the reference
        merge_lora(model)
        once = {k: v.clone() for k, v in model.state_dict().items()}
        merge_lora(model)
        twice = model(ids, mask)["logits"]
    for k, v in once.items():
        assert torch.equal(model.state_dict()[k], v), k
    torch.testing.assert_close(twice, adapted, atol=1e-5, rtol=0)
    unmerge_lora(model)
    unmerge_lora(model)
    after = model.state_dict()
    for k, v in base.items():
        torch.testing.assert_close(after[k], v, atol=1e-6, rtol=0, msg=k)


# ---- character tokenizer: ids are the vocabulary's, whatever its order --------------------------------------------

def test_an_unsorted_saved_vocabulary_encodes_to_its_own_ids_and_round_trips(tmp_path):
    chars = ["z", "\n", "a", " ", "Q", "é", "m", "!"]  # deliberately not in code-point order
    CharTokenizer(chars).save_pretrained(tmp_path)
    tok = CharTokenizer.from_pretrained(tmp_path)
    assert tok.chars == chars
    text = "mazé! Q\nz a"
    ids = tok.encode(text)
    assert ids == [chars.index(c) for c in text]
    assert tok.decode(ids) == text
    assert tok.encode("".join(chars)) == list(range(len(chars)))


# ---- RMSNorm eps from the config, block norms and q/k norms --------------------------------------------------------

def llama_rmsnorm(dim, eps, weight):
    LlamaRMSNorm = pytest.importorskip("transformers.models.llama.modeling_llama").LlamaRMSNorm
    ref = LlamaRMSNorm(dim, eps=eps)
    with torch.no_grad():
        ref.weight.copy_(weight)
    return ref


@pytest.mark.parametrize("eps", [1e-2, 0.5])
def test_rmsnorm_eps_from_the_config_matches_llama_rmsnorm_in_block_and_qk_norms(eps):
    config = tiny_config("h4-wide", norm="rmsnorm", qk_norm=True, layer_norm_epsilon=eps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, config.n_embd, generator=g) * 0.05  # mean(x^2) ~ eps: eps changes the output a lot

    norm = make_norm(config)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(config.n_embd, generator=g) + 0.5)
    ref = llama_rmsnorm(config.n_embd, eps, norm.weight)
    torch.testing.assert_close(norm(x), ref(x), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(ref(x), llama_rmsnorm(config.n_embd, 1e-6, norm.weight)(x), atol=1e-3)  # eps matters

    model = GPT2Model(config)
    for layer in model.gpt_layers:
        for block_norm in (layer.attention_layer_norm, layer.out_layer_norm):
            torch.testing.assert_close(block_norm(x), llama_rmsnorm(config.n_embd, eps, block_norm.weight)(x),
                                       atol=1e-6, rtol=1e-5)
        attn = layer.self_attention
        hs = attn.attention_head_size
        heads = torch.randn(2, config.n_head, 5, hs, generator=g) * 0.05  # (B, nh, T, hs)
        for qk in (attn.q_norm, attn.k_norm):
            with torch.no_grad():
                qk.weight.copy_(torch.rand(hs, generator=g) + 0.5)
            torch.testing.assert_close(qk(heads), llama_rmsnorm(hs, eps, qk.weight)(heads), atol=1e-6, rtol=1e-5)
    final = model.final_layer_norm
    torch.testing.assert_close(final(x), llama_rmsnorm(config.n_embd, eps, final.weight)(x), atol=1e-6, rtol=1e-5)


# ---- generation: a finished row is padded with eos by default -----------------------------------------------------

def test_a_row_that_finishes_early_is_padded_with_eos_like_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = tiny_config("h4-wide")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config.to_hf(attn_implementation="eager")).eval()
    with torch.no_grad():  # larger token embeddings: each prompt then continues with a token of its own
        hf.transformer.wte.weight.mul_(20)
    hf.generation_config.pad_token_id = None  # transformers then pads with eos, as ours should
    hf.save_pretrained(tmp_path / "hf")
    ours = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert ours.config.pad_token_id is None
    ids, mask = padded_batch([7, 3, 5], 7, config.vocab_size, "left", seed=4)
    free = ours.generate(ids, mask, max_new_tokens=12)
    eos = int(free[0, 7])  # row 0's first new token becomes "end of sequence"
    assert eos != 0 and not (free[1:, 7:] == eos).any()  # the other rows never emit it
    got = ours.generate(ids, mask, max_new_tokens=12, eos_token_id=eos)
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    assert torch.equal(got, expected)
    assert got.shape == (3, 19) and torch.all(got[0, 7:] == eos)  # row 0: eos, then eos as padding
    assert torch.equal(got[1:], free[1:])


# ---- sparse token gradient: an embedding with a padding_idx stays on the dense path -------------------------------

def test_the_padding_row_gets_no_lookup_gradient_with_a_padding_idx():
    """A tied embedding with a padding_idx (as a course model may build it): the lookup of the padding token adds
    nothing to its row, so the training forward's gradient equals the body and head called apart, and the padding
    row's gradient is the LM head's alone."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_config("h4-wide")).train()
    ids = torch.randint(0, 1000, (3, 12), generator=torch.Generator().manual_seed(1))
    pad = int(ids[0, 0])
    ids[:, -3:] = pad  # the padding token appears in every row
    model.gpt.word_embedding.padding_idx = pad

    model(ids, labels=ids)["loss"].backward()
    fused = model.gpt.word_embedding.weight.grad.clone()
    assert fused.layout == torch.strided

    model.zero_grad(set_to_none=True)
    hidden = model.gpt(ids)["last_hidden_state"]  # body and head apart: the dense nn.Embedding path
    lm_loss(model.gpt.hidden_state_to_token(hidden), ids, None, ids.shape[1], F.cross_entropy).backward()
    dense = model.gpt.word_embedding.weight.grad.clone()
    torch.testing.assert_close(fused, dense, atol=1e-6, rtol=0)

    model.zero_grad(set_to_none=True)  # the head's gradient alone: embeddings looked up from a detached copy
    body = model.gpt
    emb = F.embedding(ids, body.word_embedding.weight.detach()) + body.pos_embedding(body.position_ids[:, :12])
    hidden = body.final_layer_norm(body.encode(body.embed_dropout(emb)))
    lm_loss(model.gpt.hidden_state_to_token(hidden), ids, None, ids.shape[1], F.cross_entropy).backward()
    head_only = model.gpt.word_embedding.weight.grad
    torch.testing.assert_close(fused[pad], head_only[pad], atol=1e-6, rtol=0)


# ---- decoding's LM head: every product it takes gives the model's own (soft-capped) logits -------------------------

def spread_model(seed=0, **variant):
    """A tiny model whose biases are not zero and whose raw logits are large (a soft cap then changes them a lot)."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(tiny_config("h4-wide", **variant)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
        model.gpt.lm_head_weight.mul_(100)
    return model


def force_rows_kernel(monkeypatch, on: bool):
    """The rows kernel on every product of 1 to 8 rows (on), or on none, whatever rows.pays measured for this CPU."""
    if on and not row_kernel.available():
        pytest.skip("the rows kernel cannot be built here (needs an x86 CPU with AVX2 and FMA on Linux, and g++)")
    monkeypatch.setattr(row_kernel, "pays", lambda dtype, n: on and 1 <= n <= row_kernel.MAX_ROWS)


SOFTCAP_VARIANTS = {"softcap": dict(logit_softcap=3.0), "plain": {},
                    "softcap-untied": dict(logit_softcap=3.0, tie_word_embeddings=False)}


@pytest.mark.parametrize("variant", sorted(SOFTCAP_VARIANTS))
@pytest.mark.parametrize("kernel", [True, False], ids=["rows-kernel", "torch"])
def test_the_decode_lm_head_gives_the_models_own_logits(monkeypatch, variant, kernel):
    force_rows_kernel(monkeypatch, kernel)
    model = spread_model(**SOFTCAP_VARIANTS[variant])
    g = torch.Generator().manual_seed(2)
    for batch in (1, 3):
        hidden = torch.randn(batch, model.config.n_embd, generator=g)
        with torch.no_grad():
            expected = model.gpt.hidden_state_to_token(hidden)
            got = decode_lm_head(model.gpt, batch)(hidden)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
        if model.config.logit_softcap:  # the cap binds: raw logits reach well past it
            raw = F.linear(hidden, model.gpt.lm_head_weight)
            assert raw.abs().max() > 10 and got.abs().max() <= 3.0


@pytest.mark.parametrize("kernel", [True, False], ids=["rows-kernel", "torch"])
def test_sampling_a_soft_capped_model_draws_what_full_forwards_draw(monkeypatch, kernel):
    """Greedy tokens cannot show a dropped cap (tanh keeps the order); sampled ones can: generate with a seeded
    generator against full forwards of the whole sequence (no cache, no decode kernels) drawing from the same one."""
    force_rows_kernel(monkeypatch, kernel)
    model = spread_model(seed=1, logit_softcap=3.0)
    ids, mask = padded_batch([6, 4, 5], 6, model.config.vocab_size, "left", seed=3)
    got = model.generate(ids, mask, max_new_tokens=6, do_sample=True, generator=torch.Generator().manual_seed(4))

    g = torch.Generator().manual_seed(4)
    seq, seq_mask = ids, mask
    with torch.no_grad():
        for _ in range(6):
            logits = model(seq, seq_mask)["logits"][:, -1]
            next_ids = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)
            seq, seq_mask = torch.cat([seq, next_ids], 1), torch.cat([seq_mask, torch.ones_like(next_ids)], 1)
    assert torch.equal(got, seq)


# ---- decode products prepared for one generate call: none outlives it ---------------------------------------------

def same_weights(model):
    """A fresh model holding a copy of `model`'s weights: the reference for what `model` must compute now."""
    fresh = GPT2LMHeadModel(model.config).eval()
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    return fresh


@pytest.mark.parametrize("kernel", [True, False], ids=["rows-kernel", "torch"])
def test_after_generate_the_model_computes_with_its_weights_replaced_or_edited_in_place(monkeypatch, kernel):
    force_rows_kernel(monkeypatch, kernel)
    model = spread_model(seed=2)
    ids, mask = padded_batch([6, 4, 5], 6, model.config.vocab_size, "left", seed=5)
    step = ids[:, -1:]  # one token per row: the shape of a decode step's products
    model.generate(ids, mask, max_new_tokens=3)
    # replaced: new tensors, as a checkpoint loaded with assign=True (or onto a meta model) gives
    model.load_state_dict({k: v.clone() for k, v in spread_model(seed=3).state_dict().items()}, assign=True)
    with torch.no_grad():
        torch.testing.assert_close(model(step)["logits"], same_weights(model)(step)["logits"], atol=1e-4, rtol=1e-5)
    model.generate(ids, mask, max_new_tokens=3)
    with torch.no_grad():  # edited in place, as an optimizer step does
        for p in model.parameters():
            p.mul_(1.0 + 0.5 * torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        fresh = same_weights(model)
        torch.testing.assert_close(model(step)["logits"], fresh(step)["logits"], atol=1e-4, rtol=1e-5)
    assert torch.equal(model.generate(ids, mask, max_new_tokens=4), fresh.generate(ids, mask, max_new_tokens=4))


# ---- the rows kernel's build cache: a build is reused only for the same source, flags and compiler ----------------

FAKE_CXX = """#!/bin/sh
# A stand-in C++ compiler: the "library" it builds is a copy of the source it was given; it logs each build.
if [ "$1" = "--version" ]; then echo "fake-c++ ${FAKE_CXX_VERSION:-1.0}"; exit 0; fi
out=""; src=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift 2;;
    *.cpp) src="$1"; shift;;
    *) shift;;
  esac
done
echo "$src" >> "$(dirname "$0")/builds.log"
cp "$src" "$out"
"""


def test_the_kernel_cache_builds_an_edited_source_and_reuses_a_build_only_for_the_same_inputs(tmp_path, monkeypatch):
    cxx = tmp_path / "fake-c++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    source = tmp_path / "rows.cpp"
    source.write_text(row_kernel.SOURCE.read_text())
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("GPT2_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(row_kernel.CPU_FLAGS_ENV, raising=False)  # -march=native, not a stood-in class's flags
    monkeypatch.setattr(row_kernel, "SOURCE", source)

    def builds():
        log = tmp_path / "builds.log"
        return len(log.read_text().splitlines()) if log.exists() else 0

    first = row_kernel._build()
    assert first.read_text() == source.read_text() and builds() == 1
    assert row_kernel._build() == first and builds() == 1  # the same inputs: the cached build
    source.write_text(source.read_text().replace("int rows_vector_width", "int /* edited */ rows_vector_width"))
    edited = row_kernel._build()
    assert edited.read_text() == source.read_text() and builds() == 2  # what runs is what the source now says
    assert row_kernel._build(row_kernel.AVX2).read_text() == source.read_text() and builds() == 3  # other flags
    monkeypatch.setenv("FAKE_CXX_VERSION", "2.0")
    assert row_kernel._build() not in (first, edited) and builds() == 4  # another compiler


# ---- LayerNorm: eps from the config on both backward paths, and no shift with bias=False ---------------------------

def autograd_nodes(tensor: torch.Tensor) -> set[str]:
    """The class names of every node in `tensor`'s autograd graph."""
    seen, names, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("backward", ["autograd", "manual"])
def test_layernorm_eps_from_the_config_matches_transformers_gpt2_on_both_backward_paths(hf_folder, backward):
    """HF's GPT-2 takes layer_norm_epsilon from its config; at 0.5 (hidden states of variance ~1e-3 at GPT-2's
    init) eps decides the outputs, so a norm built with nn.LayerNorm's default 1e-5 would not match. The manual
    backward's model computes the same logits and gradients as autograd's, and its LayerNorms' backward is the
    hand-derived one (no torch LayerNorm node in its graph)."""
    hf, folder = hf_folder(tiny_config("h3-inner", layer_norm_epsilon=0.5))
    ids, mask = padded_batch([9, 6], 9, hf.config.vocab_size, "right")
    model = GPT2LMHeadModel.from_pretrained(folder, backward=backward)
    ref = GPT2LMHeadModel.from_pretrained(folder)
    assert model.config.layer_norm_epsilon == 0.5
    logits = model(ids, mask)["logits"]
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits * mask[..., None], expected * mask[..., None], atol=1e-5, rtol=1e-4)
    nodes = autograd_nodes(logits)
    assert ("NativeLayerNormBackward0" in nodes) == (backward == "autograd"), nodes
    model(ids, mask, labels=ids)["loss"].backward()
    ref(ids, mask, labels=ids)["loss"].backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_bias_false_leaves_the_layernorms_without_a_shift_too():
    """bias=False (nanoGPT's meaning): no bias in the Linear layers and none in the LayerNorms, so the state dict
    holds no bias and a block's LayerNorm output has zero mean per position whatever the training did to it."""
    config = tiny_config("h3-inner", bias=False)
    model = GPT2Model(config)
    assert [name for name, _ in model.named_parameters() if name.endswith("bias")] == []
    biased = GPT2Model(tiny_config("h3-inner"))
    n_norms = 2 * config.n_layer + 1
    n_linear_biases = sum(m.bias.numel() for m in biased.modules() if isinstance(m, torch.nn.Linear))
    assert sum(p.numel() for p in biased.parameters()) - sum(p.numel() for p in model.parameters()) == \
        n_linear_biases + n_norms * config.n_embd
    norm = make_norm(config)
    x = torch.randn(3, config.n_embd)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (config.n_embd,), eps=config.layer_norm_epsilon))
