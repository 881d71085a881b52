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
        for a, b in ((0, 3), (3, 7), (7, 8), (8, 9)):  # 3 tokens, then 4 after the cache, then one at a time
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
