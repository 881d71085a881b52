"""Causal multi-head self-attention with a padding mask and a preallocated key/value cache.

Variants, chosen when the layer is built: grouped-query attention (fewer key/value heads than query heads, each
shared by a group of query heads; the cache holds the key/value heads only), an RMSNorm of every head's q and k, and
rotary positions (modules/positions.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modules import dropout as hashed
from modules import fused_qkv, packed, prompt_attention, quant, transforms
from modules.linear import Linear as DecodeLinear
from modules.manual_backward import ManualAttention, ManualLinear
from modules.masked_softmax import masked_softmax
from modules.norms import RMSNorm
from modules.positions import Rope, apply_rotary, no_rotary


class KVCache:
    """Keys and values of every layer for the tokens seen so far, in buffers allocated once.

    Decoding writes each new step into place instead of concatenating, so a step costs no reallocation.
    Layer i calls `update(i, k, v)` during a forward pass; the model calls `advance(T)` once all layers are done.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 buffers: tuple[torch.Tensor, torch.Tensor] | None = None):
        """n_head: the key/value heads (fewer than the query heads under grouped-query attention). buffers: keys and
        values of that shape to use instead of new ones (a finished cache's, GPT2Model.keep_cache)."""
        shape = (n_layer, batch_size, n_head, capacity, head_dim)
        if buffers is not None:
            if any(b.shape != shape or b.dtype != dtype for b in buffers):
                raise ValueError(f"KVCache buffers must be {shape} {dtype}, got "
                                 f"{[(tuple(b.shape), b.dtype) for b in buffers]}")
            self.keys, self.values = buffers
        else:
            self.keys = torch.empty(shape, dtype=dtype, device=device)
            self.values = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0  # tokens already stored (same for every layer between forward passes)
        self._spare: tuple[torch.Tensor, torch.Tensor] | None = None  # reorder's target, swapped with the live pair

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, n_kv, T, hs) after the cached tokens; return all keys and values so far (B, n_kv, L+T, hs)."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            self._grow(end)
        # written in the cache's dtype (the assignment converts): e.g. autocast's bf16 projections into an fp32 cache
        self.keys[layer_idx, :, :, self.length:end] = k
        self.values[layer_idx, :, :, self.length:end] = v
        return self.keys[layer_idx, :, :, :end], self.values[layer_idx, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows: row i continues row index[i] (beam search keeps the cache of the surviving beams).

        With the batch size unchanged, only the filled positions are copied, into a spare pair of buffers that then
        becomes the live one (gpt2, 4 beams: about half the time of copying whole buffers); an identity index
        (every beam continued its own row) copies nothing.
        """
        if index.shape[0] != self.keys.shape[1]:  # e.g. prompt rows -> beam rows
            self.keys, self.values = self.keys.index_select(1, index), self.values.index_select(1, index)
            self._spare = None
            return
        if bool((index == torch.arange(len(index), device=index.device)).all()):
            return
        if self._spare is None or self._spare[0].shape != self.keys.shape:
            self._spare = (torch.empty_like(self.keys), torch.empty_like(self.values))
        n = self.length
        for live, spare in zip((self.keys, self.values), self._spare):
            torch.index_select(live[:, :, :, :n], 1, index, out=spare[:, :, :, :n])
        self._spare, (self.keys, self.values) = (self.keys, self.values), self._spare

    def _grow(self, needed: int) -> None:
        new_capacity = max(needed, 2 * self.capacity)
        pad = new_capacity - self.capacity
        self.keys = F.pad(self.keys, (0, 0, 0, pad))
        self.values = F.pad(self.values, (0, 0, 0, pad))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, n_kv, S, hs) -> (B, n_kv * groups, S, hs): each key/value head once per query head of its group."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def explicit_is_faster(query: torch.Tensor, dropout: nn.Dropout) -> bool:
    """CPU training where the explicit path is the faster one:
    - bf16 (autocast, or bf16 weights): torch's SDPA backward is slower there than the explicit path's products
      (gpt2 training step on a 2-core Xeon with AMX, autocast: 1.36x at 4 x 128, 1.12x at 2 x 512, 1.6x at 1 x 1024;
      bf16 weights on a Zen 4: 1.08x at 4 x 128; docs/performance.md), which hold the (B, nh, T, S) scores for
      backward instead (more memory);
    - attention dropout in training mode: torch's CPU SDPA then runs its math fallback, the same products as the
      explicit path, with torch's dropout mask instead of the one-pass one (modules/dropout.py).
    fp32 without dropout keeps SDPA."""
    if not (query.is_cpu and torch.is_grad_enabled()):
        return False
    if query.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu")
                                         and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        return True
    return dropout.training and 0.0 < dropout.p < 1.0 and isinstance(dropout, hashed.Dropout) and hashed.applies(query)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.num_attention_heads = config.n_head
        self.num_key_value_heads = config.kv_heads  # n_head for GPT-2; fewer for grouped-query attention
        self.kv_groups = self.num_attention_heads // self.num_key_value_heads  # query heads per key/value head
        self.attention_head_size = config.n_embd // config.n_head
        self.all_head_size = config.n_embd
        kv_size = self.num_key_value_heads * self.attention_head_size
        self.layer_idx = layer_idx
        Linear = ManualLinear if config.backward == "manual" else DecodeLinear
        self.query = Linear(config.n_embd, self.all_head_size, bias=config.bias)
        self.key = Linear(config.n_embd, kv_size, bias=config.bias)
        self.value = Linear(config.n_embd, kv_size, bias=config.bias)
        # q/k norm (nanochat, OLMo, Qwen3): every head's q and k scaled to unit RMS before the positions rotate them
        hs, eps = self.attention_head_size, config.layer_norm_epsilon
        self.q_norm = RMSNorm(hs, eps, config.norm_scale) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hs, eps, config.norm_scale) if config.qk_norm else nn.Identity()
        self.rotate = apply_rotary if config.position_embedding == "rope" else no_rotary
        self.dropout = hashed.Dropout(config.attn_pdrop)
        self.scale = 1.0 / math.sqrt(self.attention_head_size) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        self.use_sdpa = config.attn_implementation == "sdpa" and config.backward == "autograd"
        # backward="manual": the core of the explicit path as one Function with a hand-derived backward
        self.manual = ManualAttention(self.scale, config.attn_pdrop) if config.backward == "manual" else None

    def split_heads(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, heads * hs) -> (B, heads, T, hs)."""
        return y.unflatten(-1, (-1, self.attention_head_size)).transpose(1, 2)

    def transform(self, x: torch.Tensor, linear_layer: nn.Linear) -> torch.Tensor:
        """Project (B, T, C) and split heads -> (B, nh, T, hs) (n_kv heads for the key and value projections)."""
        return self.split_heads(linear_layer(x))

    def fused_qkv_applies(self, x: torch.Tensor) -> bool:
        """bf16 inference of many rows on an AMX CPU (modules/packed.py) with plain Linear projections (not LoRA's)."""
        return (packed.applies(x, self.query.weight) and type(self.query) is type(self.key) is type(self.value)
                is DecodeLinear and self.key.weight.dtype == self.value.weight.dtype == torch.bfloat16)

    def fused_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three projections as one product with a packed (C + 2 kv, C) weight -> q, k, v split in heads."""
        y = packed.product(self, "_packed_qkv", x, (self.query.weight, self.key.weight, self.value.weight),
                           (self.query.bias, self.key.bias, self.value.bias))
        return self.split_qkv(y)

    def split_qkv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three projections' outputs side by side (B, T, C + 2 kv) -> q, k, v split in heads."""
        kv_size = self.num_key_value_heads * self.attention_head_size
        return tuple(self.split_heads(p) for p in y.split([self.all_head_size, kv_size, kv_size], dim=-1))

    def prompt_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The prompt of a w8a8 / w4a8 generate: the three projections as one int8 GEMM (quant.prompt_product; one
        quantization of x, one product 3x as wide: 8% faster than three on gpt2's 512-token prompt on a Zen 3, the
        same numbers) -> q, k, v split in heads, or None where it is not taken. Projections with forward hooks keep
        their own calls, so the hooks run."""
        layers = (self.query, self.key, self.value)
        if not all(type(m) is DecodeLinear and not (m._forward_hooks or m._forward_pre_hooks) for m in layers):
            return None
        y = quant.prompt_product(self, layers, x)
        return None if y is None else self.split_qkv(y)

    def training_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A training step's three projections as one product (modules/fused_qkv.py) -> q, k, v split in heads, or
        None where it is not taken (LoRA's or manual layers, hooks, autocast, eval: see fused_qkv.applies)."""
        layers = (self.query, self.key, self.value)
        if not (all(type(m) is DecodeLinear for m in layers) and fused_qkv.applies(x, layers)):
            return None
        return self.split_qkv(fused_qkv.project(x, layers))

    def attention(self, key: torch.Tensor, query: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The explicit path, as the course teaches: scores, mask, softmax, dropout, weighted sum -> (B, T, C)."""
        key, value = repeat_kv(key, self.kv_groups), repeat_kv(value, self.kv_groups)  # (B, nh, S, hs)
        scores = torch.matmul(query, key.transpose(-1, -2))  # (B, nh, T, S)
        # scale, mask (None: plain causal), softmax: one pass each way in a CPU training step (modules/masked_softmax)
        probs = self.dropout(masked_softmax(scores, self.scale, attention_mask).to(value.dtype))
        out = torch.matmul(probs, value)  # (B, nh, T, hs)
        return out.transpose(1, 2).flatten(2)  # (B, T, nh, hs) -> (B, T, C)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, rope: Rope | None = None) -> torch.Tensor:
        """hidden_states (B, T, C) -> (B, T, C).

        attention_mask: bool (B, 1, T, S), True where a query may attend a key, causality included
        (S = cached + new tokens); None means causal attention without padding and without cached tokens
        (or a single new token, which may see everything cached).
        rope: the new tokens' (cos, sin) from the model's RotaryEmbedding (RoPE models), None for learned positions.
        """
        if self.fused_qkv_applies(hidden_states):
            qkv = self.fused_qkv(hidden_states)
        else:
            qkv = self.training_qkv(hidden_states) or self.prompt_qkv(hidden_states)
        if qkv is not None:
            query, key, value = qkv
            query, key = self.q_norm(query), self.k_norm(key)
        else:
            query = self.q_norm(self.transform(hidden_states, self.query))  # (B, nh, T, hs)
            key = self.k_norm(self.transform(hidden_states, self.key))  # (B, n_kv, T, hs)
            value = self.transform(hidden_states, self.value)
        query, key = self.rotate(query, key, rope)
        if kv_cache is not None:
            key, value = kv_cache.update(self.layer_idx, key, value)  # (B, n_kv, S, hs)
            query = query.to(key.dtype)
        T, S = query.shape[2], key.shape[2]
        if attention_mask is None and 1 < T < S:  # several new tokens after cached ones: causal is bottom-right
            attention_mask = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)
        if self.manual is not None:
            return self.manual(key, query, value, attention_mask)
        if not self.use_sdpa or transforms.torch_func() or explicit_is_faster(query, self.dropout):
            return self.attention(key, query, value, attention_mask)
        is_causal = attention_mask is None and T > 1
        # a prompt's pass on the CPU (no cached tokens: is_causal; full heads: the shapes match) in the rows kernel
        if is_causal and not (self.training and self.dropout.p > 0) and prompt_attention.applies(query, key, value):
            return prompt_attention.attend(query, key, value, self.scale)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, is_causal=is_causal,
            dropout_p=self.dropout.p if self.training else 0.0, scale=self.scale, enable_gqa=self.kv_groups > 1,
        )  # (B, nh, T, hs)
        return out.transpose(1, 2).flatten(2)  # (B, T, nh, hs) -> (B, T, C)
