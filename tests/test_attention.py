"""CausalSelfAttention called directly with a KV cache: a prompt fed in chunks (several new tokens after cached
ones, a path GPT2Model's decoding does not take) sees what the whole sequence's forward sees, on every path; the
KVCache's own promises (buffers allocated once and grown by doubling, the dtype and device asked for, reorders that
copy only what they must)."""
import pytest
import torch
from conftest import tiny_config

from modules.attention import CausalSelfAttention, KVCache

PATHS = [dict(attn_implementation="sdpa"), dict(attn_implementation="eager"),
         dict(attn_implementation="eager", backward="manual"), dict(attn_implementation="sdpa", n_kv_head=2),
         dict(attn_implementation="eager", n_kv_head=1)]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(f"{v}" for v in p.values()))
def test_chunked_prefill_after_a_cache_equals_the_full_forward(path):
    """New tokens in a chunk attend to every cached token and causally among themselves: the causal mask is aligned
    to the bottom right of the (new, cached + new) score matrix."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(tiny_config("h4-wide", **path)).eval()
    x = torch.randn(2, 9, layer.all_head_size)
    with torch.no_grad():
        full = layer(x)
        cache = KVCache(1, 2, layer.num_key_value_heads, layer.attention_head_size, capacity=9)
        chunks = []
        for a, b in ((0, 3), (3, 5), (5, 8), (8, 9)):  # 3 tokens, then 2 and 3 after the cache, then one
            chunks.append(layer(x[:, a:b], kv_cache=cache))
            cache.advance(b - a)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_reorder_selects_rows_of_the_filled_positions():
    """KVCache.reorder copies only the filled positions, into a spare buffer pair it swaps in; chained reorders
    must equal index_select of whole buffers, and growing the cache afterwards keeps them."""
    cache = KVCache(n_layer=2, batch_size=2, n_head=3, head_dim=4, capacity=4)
    k, v = torch.randn(2, 2, 3, 5, 4), torch.randn(2, 2, 3, 5, 4)
    for layer in range(2):
        cache.update(layer, k[layer, :, :, :3], v[layer, :, :, :3])
    cache.advance(3)
    cache.reorder(torch.tensor([0, 0, 1, 1]))  # prompt rows -> beams
    k, v = k[:, [0, 0, 1, 1]], v[:, [0, 0, 1, 1]]
    for index in ([1, 0, 3, 3], [0, 1, 2, 3], [2, 2, 0, 1], [3, 1, 0, 0]):
        cache.reorder(torch.tensor(index))
        k, v = k[:, index], v[:, index]
        assert torch.equal(cache.keys[:, :, :, :3], k[:, :, :, :3])
        assert torch.equal(cache.values[:, :, :, :3], v[:, :, :, :3])
    for layer in range(2):
        keys, values = cache.update(layer, k[layer, :, :, 3:], v[layer, :, :, 3:])  # 5 > capacity 4: grows
        assert torch.equal(keys, k[layer]) and torch.equal(values, v[layer])
    cache.advance(2)
    cache.reorder(torch.tensor([3, 2, 1, 0]))  # the spare pair no longer fits the grown buffers: a new one
    assert cache.capacity >= 5 and torch.equal(cache.keys[:, :, :, :5], k[:, [3, 2, 1, 0]])
    assert torch.equal(cache.values[:, :, :, :5], v[:, [3, 2, 1, 0]])


def filled_cache(capacity=4, length=3, batch=2, **kw) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A one-layer cache (3 heads of 4) holding `length` random tokens per row."""
    cache = KVCache(n_layer=1, batch_size=batch, n_head=3, head_dim=4, capacity=capacity, **kw)
    k, v = torch.randn(batch, 3, length, 4), torch.randn(batch, 3, length, 4)
    cache.update(0, k, v)
    cache.advance(length)
    return cache, k, v


def test_the_cache_fills_to_its_capacity_in_place_and_then_grows_by_doubling():
    cache, k, v = filled_cache(capacity=4, length=3)
    keys = cache.keys
    cache.update(0, k[:, :, :1], v[:, :, :1])  # the 4th token: exactly full, still the buffers allocated at first
    cache.advance(1)
    assert cache.capacity == 4 and cache.keys is keys
    got, _ = cache.update(0, k[:, :, :1], v[:, :, :1])  # a 5th: twice the capacity, not just one more
    cache.advance(1)
    assert cache.capacity == 8 and cache.values.shape[3] == 8
    assert torch.equal(got, torch.cat([k, k[:, :, :1], k[:, :, :1]], dim=2))  # the tokens so far, kept across growing
    cache.update(0, torch.randn(2, 3, 12, 4), torch.randn(2, 3, 12, 4))  # 17 > 2 x 8: as much as needed
    assert cache.capacity == 17


def test_the_cache_holds_the_dtype_and_device_it_was_made_for():
    """A bf16 model's cache is bf16 (half the memory); buffers and the explicit path's causal mask are made on the
    device of the tensors they serve (the meta device stands in for an accelerator: mixing it with CPU tensors fails,
    as CUDA's would)."""
    cache = KVCache(2, 1, 2, 4, capacity=5, dtype=torch.bfloat16)
    assert cache.keys.dtype == cache.values.dtype == torch.bfloat16
    meta = KVCache(2, 2, 3, 4, capacity=5, device="meta")
    assert meta.keys.device.type == meta.values.device.type == "meta"
    keys, _ = meta.update(0, torch.empty(2, 3, 2, 4, device="meta"), torch.empty(2, 3, 2, 4, device="meta"))
    assert keys.shape == (2, 3, 2, 4)
    layer = CausalSelfAttention(tiny_config("h4-wide", attn_implementation="eager")).eval()
    q, k = torch.empty(1, 4, 3, 16, device="meta"), torch.empty(1, 4, 3, 16, device="meta")
    assert layer.attention(k, q, torch.empty(1, 4, 3, 16, device="meta"), None).device.type == "meta"


def test_an_identity_reorder_copies_nothing_and_one_beam_per_head_is_not_mistaken_for_one():
    cache, k, v = filled_cache(batch=3)
    keys, values = cache.keys, cache.values
    cache.reorder(torch.arange(3))  # every beam continued its own row
    assert cache.keys is keys and cache.values is values
    cache.reorder(torch.tensor([2, 0, 0]))  # the first real reorder: into a new spare pair, then swapped in
    assert torch.equal(cache.keys[0, :, :, :3], k[[2, 0, 0]]) and torch.equal(cache.values[0, :, :, :3], v[[2, 0, 0]])
    one, k1, _ = filled_cache(batch=1)  # one prompt row -> 3 beams: 3 is also the number of heads
    one.reorder(torch.tensor([0, 0, 0]))
    assert one.keys.shape[1] == 3 and torch.equal(one.keys[0, :, :, :3], k1[[0, 0, 0]])


ALL_PATHS = [dict(attn_implementation="sdpa"), dict(attn_implementation="eager"),
             dict(attn_implementation="eager", backward="manual")]


def causal_mask_with_left_padding(lengths: list[int], T: int) -> torch.Tensor:
    """bool (B, 1, T, T): causal, and no row attends its left padding."""
    real = torch.stack([torch.arange(T) >= T - n for n in lengths])  # (B, T)
    return torch.ones(T, T, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]


@pytest.mark.parametrize("path", ALL_PATHS[:2], ids=lambda p: "-".join(p.values()))  # manual: GPT-2's layers only
def test_rope_gqa_and_qk_norm_attention_equals_transformers_qwen3_attention(path):
    """Rotary positions, grouped-query heads and an RMSNorm of each head's q and k (its eps from the config), as
    Qwen3's attention computes them (weights copied; its output projection set to the identity, which is
    attention_dense's job here), with left padding."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    from modules.positions import RotaryEmbedding

    config = tiny_config("h4-wide", position_embedding="rope", rope_theta=500.0, n_kv_head=2, qk_norm=True,
                         norm="rmsnorm", layer_norm_epsilon=0.1, **path)
    torch.manual_seed(0)
    ours = CausalSelfAttention(config).eval()
    hf_config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            rms_norm_eps=0.1, rope_theta=500.0, attention_bias=True, max_position_embeddings=64,
                            attn_implementation="eager")
    theirs = Qwen3Attention(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for mine, hf in ((ours.query, theirs.q_proj), (ours.key, theirs.k_proj), (ours.value, theirs.v_proj)):
            hf.weight.copy_(mine.weight)
            hf.bias.copy_(torch.randn_like(hf.bias))
            mine.bias.copy_(hf.bias)
        for mine, hf in ((ours.q_norm, theirs.q_norm), (ours.k_norm, theirs.k_norm)):
            hf.weight.copy_(1 + 0.3 * torch.randn_like(hf.weight))
            mine.weight.copy_(hf.weight)
        theirs.o_proj.weight.copy_(torch.eye(64))
        theirs.o_proj.bias.zero_()
    x = torch.randn(2, 7, 64)
    mask = causal_mask_with_left_padding([7, 4], 7)
    positions = (mask[:, 0, -1].long().cumsum(-1) - 1).clamp(min=0)  # each row's real tokens from position 0
    with torch.no_grad():
        got = ours(x, mask, rope=RotaryEmbedding(16, 500.0)(positions))
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        expected, _ = theirs(x, Qwen3RotaryEmbedding(hf_config)(x, positions), additive)
    real = mask[:, 0, -1]  # padding queries attend nothing: their outputs are undefined
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags", [dict(scale_attn_weights=False), dict(scale_attn_by_inverse_layer_idx=True)],
                         ids=["unscaled", "inverse-layer-scaled"])
@pytest.mark.parametrize("path", ALL_PATHS, ids=lambda p: "-".join(p.values()))
def test_gpt2s_attention_scaling_flags_equal_transformers(flags, path):
    """GPT2Config's scale_attn_weights and scale_attn_by_inverse_layer_idx as transformers' GPT-2 applies them (the
    second layer's scores divided by 2), on every attention path, with left padding."""
    from conftest import make_hf_model

    from models.gpt2 import GPT2Model
    from models.loading import hf_to_ours

    config = tiny_config("h4-wide", **flags)
    hf = make_hf_model(config, seed=3)
    with torch.no_grad():  # scores far from zero, so that how they are scaled shows in the outputs
        for block in hf.transformer.h:
            block.attn.c_attn.weight.mul_(6.0)
    ours = GPT2Model(config.replace(**path)).eval()
    ours.load_state_dict(hf_to_ours(hf.state_dict(), config.n_layer))
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # ours counts positions from each row's first real token
        expected = hf.transformer(ids, attention_mask=mask, position_ids=positions).last_hidden_state
        got = ours(ids, mask)["last_hidden_state"]
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)


def autograd_nodes(y: torch.Tensor, depth: int = 4) -> str:
    """The names of the autograd nodes within `depth` steps of y's."""
    names, frontier = [], [y.grad_fn]
    for _ in range(depth):
        frontier = [f for node in frontier if node is not None for f, _ in node.next_functions]
        names += [type(node).__name__ for node in frontier if node is not None]
    return " ".join([type(y.grad_fn).__name__] + names)


def test_attn_implementation_and_backward_choose_the_kernel(monkeypatch):
    """'sdpa' runs torch's fused kernel (also for two tokens, causal), 'eager' the explicit product, and
    backward='manual' the hand-derived attention and projections; all three agree, padded or not."""
    import torch.nn.functional as F

    from modules.manual_backward import ManualLinear

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    x = torch.randn(2, 5, 64, requires_grad=True)
    masks = [None, causal_mask_with_left_padding([5, 3], 5)]
    outputs = {}
    for path in ALL_PATHS:
        torch.manual_seed(0)
        layer = CausalSelfAttention(tiny_config("h4-wide", **path)).train()
        calls.clear()
        out = [layer(x[:, :T], m[..., :T, :T] if m is not None else None) for m in masks for T in (2, 5)]
        outputs["-".join(path.values())] = out
        assert bool(calls) == (path == ALL_PATHS[0]), path
        manual = path.get("backward") == "manual"
        assert all(isinstance(p, ManualLinear) == manual for p in (layer.query, layer.key, layer.value))
        assert ("AttentionFn" in autograd_nodes(out[0])) == manual
    real = [torch.ones(2, T, dtype=torch.bool) if m is None else m[:, 0, -1, :T] for m in masks for T in (2, 5)]
    for name, out in outputs.items():  # padding queries attend nothing: their outputs are undefined
        for got, expected, keep in zip(out, outputs["sdpa"], real):
            torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=1e-5, msg=name)


def test_sdpa_applies_attention_dropout_in_training_only(monkeypatch):
    """Where the one-pass dropout is off (GPT2_FAST_DROPOUT=0), fp32 training keeps SDPA, with attn_pdrop as its
    dropout: training outputs differ from eval's and from each other; eval drops nothing."""
    from modules import dropout

    monkeypatch.setenv(dropout.ENV, "0")
    monkeypatch.setattr(dropout, "_library", None)
    torch.manual_seed(0)
    layer = CausalSelfAttention(tiny_config("h4-wide", attn_pdrop=0.5))
    x = torch.randn(2, 6, 64, requires_grad=True)
    with torch.no_grad():
        plain = layer.eval()(x)
    layer.train()
    first, second = layer(x), layer(x)
    assert not torch.allclose(first, plain, atol=1e-3) and not torch.allclose(first, second, atol=1e-3)


def test_a_caches_buffers_must_have_its_shape_and_its_dtype_each_and_the_error_names_both():
    """KVCache(buffers=...) refuses buffers whose shape alone or dtype alone differs from the cache's, naming the
    shape and dtype it wants and what it got; matching buffers are taken as they are."""
    shape = (2, 1, 3, 8, 4)
    good = (torch.zeros(shape), torch.zeros(shape))
    cache = KVCache(2, 1, 3, 4, 8, buffers=good)
    assert cache.keys is good[0] and cache.values is good[1] and cache.length == 0
    for bad in ((torch.zeros(shape), torch.zeros(2, 1, 3, 9, 4)), (torch.zeros(shape, dtype=torch.bfloat16),
                                                                    torch.zeros(shape))):
        with pytest.raises(ValueError) as err:
            KVCache(2, 1, 3, 4, 8, buffers=bad)
        assert "(2, 1, 3, 8, 4) torch.float32" in str(err.value) and str(tuple(bad[1].shape)) in str(err.value)


def test_reorder_copies_the_filled_positions_and_an_identity_index_copies_nothing():
    """reorder with the batch size unchanged: each row continues the row its index names over the filled positions
    (the cache's length); an identity index leaves the live buffers in place (no copy, no swap)."""
    cache = KVCache(1, 3, 1, 2, 4)
    cache.keys.copy_(torch.arange(24.0).view(1, 3, 1, 4, 2))
    cache.values.copy_(-torch.arange(24.0).view(1, 3, 1, 4, 2))
    cache.length = 3
    keys = cache.keys
    cache.reorder(torch.tensor([0, 1, 2]))
    assert cache.keys is keys and cache._spare is None
    before = keys.clone()
    cache.reorder(torch.tensor([2, 2, 0]))
    assert torch.equal(cache.keys[:, :, :, :3], before[:, [2, 2, 0], :, :3])
    assert torch.equal(cache.values[:, :, :, :3], -before[:, [2, 2, 0], :, :3])


def test_explicit_attention_is_taken_under_bf16_autocast_only():
    """explicit_is_faster under CPU autocast: in bf16 (fp32 queries, no dropout) yes, in float16 no, outside autocast
    no; bf16 queries always (while grads are on)."""
    from modules.attention import explicit_is_faster

    q, off = torch.randn(1, 2, 4, 8), torch.nn.Dropout(0.0)
    assert not explicit_is_faster(q, off)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert explicit_is_faster(q, off)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not explicit_is_faster(q, off)
    assert explicit_is_faster(q.bfloat16(), off)
    with torch.no_grad():
        assert not explicit_is_faster(q.bfloat16(), off)
