"""CausalSelfAttention called directly with a KV cache: a prompt fed in chunks (several new tokens after cached
ones, a path GPT2Model's decoding does not take) sees what the whole sequence's forward sees, on every path."""
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
