"""GPT-2: token + position embeddings, a stack of pre-LN blocks, a final LayerNorm, and an LM head tied to the
token embedding. Reads top to bottom; weight conversion lives in models/loading.py, decoding in models/generation.py.

The variants of GPT2Config (nanochat's GPT: RMSNorm, RoPE, grouped-query attention, q/k norm, ReLU^2, no biases, an
untied and soft-capped LM head) are chosen when the modules are built; the forward pass is the same for all of them.
"""
from __future__ import annotations

import math
import os
import weakref

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from config import GPT2Config
from models.beam_search import beam_search
from models.generation import generate
from modules import cross_entropy as chunked
from modules import manual_backward, onednn, packed, transforms, transposed
from modules.attention import KVCache
from modules.dropout import Dropout
from modules.gpt2_layer import GPT2Layer
from modules.masks import build_attention_mask, position_ids_from_mask  # noqa: F401 (re-exported)
from modules.norms import RMSNorm, make_norm
from modules.positions import NoPositionEmbedding, NoRotary, RotaryEmbedding

# Token ids may come in any of these (e.g. uint8 from a small vocabulary); the embedding reads them as int64.
INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class LogitSoftCap(nn.Module):
    """logits -> cap * tanh(logits / cap): smooth, bounded to (-cap, cap), near the identity for small logits."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return self.cap * torch.tanh(logits / self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap}"


class _TiedTable(torch.autograd.Function):
    """The tied (V, C) table's two uses in a training forward as one node: the token rows looked up, and the table
    again as the LM head's weight (an alias the head multiplies by). Autograd runs this backward only once both
    gradients are in (the head's, dense, and the rows'), so the rows are added into the head's gradient in place:
    torch's own accumulation of the two adds a sparse gradient into a dense one out of place, a copy of the whole
    (V, C) gradient a step. Without the head's gradient (a loss that does not go through it) the rows come as a sparse
    tensor, which the weight's hook makes dense."""

    @staticmethod
    def forward(ctx, input_ids: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(input_ids)
        ctx.shape = weight.shape
        return F.embedding(input_ids, weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx, d_rows: torch.Tensor | None, d_head: torch.Tensor | None):
        (input_ids,) = ctx.saved_tensors
        if d_rows is None:
            return None, d_head
        rows = d_rows.reshape(-1, ctx.shape[1])
        if torch.is_grad_enabled():  # create_graph=True: the sum out of place, so that it can itself be differentiated
            dense = d_rows.new_zeros(ctx.shape) if d_head is None else d_head
            return None, dense.index_add(0, input_ids.reshape(-1), rows.to(dense.dtype))
        if d_head is None:
            return None, torch.sparse_coo_tensor(input_ids.reshape(1, -1), rows, ctx.shape, check_invariants=False)
        if not d_head.is_contiguous():
            d_head = d_head.contiguous()
        return None, d_head.index_add_(0, input_ids.reshape(-1), rows.to(d_head.dtype))


def _dense_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: a gradient that arrived as rows alone (sparse) becomes a dense one."""
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.to_dense()


# generate's KV cache buffers kept for its next call (GPT2Model.keep_cache), per model body: outside the module, so
# that torch.save(model) and deepcopy do not carry them; dropped with the model.
_KEPT_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
KEPT_CACHE_BYTES = 128 << 20  # gpt2 batch 1 up to its 1,024 positions (75 MB); larger caches are not kept


class GPT2Model(nn.Module):
    """The GPT-2 body. forward(input_ids, attention_mask) -> {'last_hidden_state': (B, T, C), 'last_token': (B, C)}."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.word_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        # Positions: GPT-2 adds a learned table to the token embeddings; RoPE models have none and rotate q and k in
        # every attention layer by angles `rotary` computes once per forward.
        rope = config.position_embedding == "rope"
        self.pos_embedding = NoPositionEmbedding() if rope else nn.Embedding(config.n_positions, config.n_embd)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta) if rope else NoRotary()
        self.embed_dropout = Dropout(config.embd_pdrop)
        self.register_buffer("position_ids", torch.arange(config.n_positions).unsqueeze(0), persistent=False)
        self.gpt_layers = nn.ModuleList([GPT2Layer(config, i) for i in range(config.n_layer)])
        self.final_layer_norm = make_norm(config)
        # LM head: the token embedding (tied, GPT-2) or a matrix of its own; logits soft-capped where asked (nanochat)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.logit_softcap = LogitSoftCap(config.logit_softcap) if config.logit_softcap else nn.Identity()
        manual = config.backward == "manual"  # hand-derived backward passes (modules/manual_backward.py)
        # the head's product: bf16 training on AMX computes it transposed (modules/transposed.py), elsewhere its weight
        # gradient in blocks of vocabulary rows (modules/head_grad.py); else F.linear
        self.lm_linear = manual_backward.linear if manual else transposed.head
        self.gradient_checkpointing = False  # recompute each block in backward to save activation memory
        self.apply(self._init_weights)
        # GPT-2 paper: scale the init of projections that write into the residual stream by 1/sqrt(#residual layers).
        for layer in self.gpt_layers:
            for proj in (layer.attention_dense, layer.out_dense):
                nn.init.normal_(proj.weight, std=config.initializer_range / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, RMSNorm)) and module.weight is not None:
            nn.init.ones_(module.weight)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token + position embeddings (RoPE models: token embeddings alone), then dropout: (B, T) -> (B, T, C)."""
        if position_ids is None:
            position_ids = self.position_ids[:, : input_ids.shape[1]]
        return self.embed_dropout(self.word_embedding(input_ids) + self.pos_embedding(position_ids))

    def embed_with_head(self, input_ids: torch.Tensor,
                        position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """embed() for a forward whose output the tied LM head follows -> (embeddings, the head's weight to use, or
        None for the table itself). Where sparse_token_grad() holds, the lookup and the head's weight are one node
        (_TiedTable), whose backward adds the looked-up rows into the head's gradient in place."""
        if not self.sparse_token_grad():
            return self.embed(input_ids, position_ids), None
        tokens, head_weight = _TiedTable.apply(input_ids, self.word_embedding.weight)
        return self.embed_dropout(tokens + self.pos_embedding(position_ids)), head_weight

    def sparse_token_grad(self) -> bool:
        """Whether the token embedding's gradient may come as rows instead of a dense matrix (embed_with_head).

        With the LM head tied, the (V, C) weight gets two gradients a step: the head's, dense, and the embedding's,
        which touches only the B*T rows looked up. Dense, the second is a zero-filled (V, C) matrix (154 MB for gpt2)
        then added to the first: 0.7-4.8% of a gpt2 4 x 128 step on a 2-core Xeon (docs/performance.md). As sparse
        rows (sparse=True) autograd still adds them to the head's gradient out of place, a copy of the (V, C) gradient
        (6 ms of a bf16 gpt2 step on an AMX Xeon, profiled 2026-12-03); so the lookup and the head's weight are one
        node (_TiedTable) whose backward adds the rows into the head's gradient in place. Taken when training a plain
        tied nn.Embedding with autograd on the CPU, outside torch.compile and torch.func (the README's char model, a 65
        x 128 table, is no slower with it); a hook on the weight turns a gradient that arrives as rows alone (a loss
        that does not go through the head) back into a dense one, so `.grad` is always dense."""
        embedding = self.word_embedding
        if not (type(embedding) is nn.Embedding and self.lm_head is None and self.config.backward == "autograd"
                and torch.is_grad_enabled() and embedding.weight.requires_grad and embedding.weight.is_cpu
                and embedding.padding_idx is None and embedding.max_norm is None
                and not embedding.scale_grad_by_freq and not transforms.active()):
            return False
        weight = embedding.weight
        if not hasattr(weight, "_post_accumulate_grad_hooks"):  # a torch that keeps hooks elsewhere: stay dense
            return False
        if _dense_grad not in (weight._post_accumulate_grad_hooks or {}).values():  # None until a hook is added
            weight.register_post_accumulate_grad_hook(_dense_grad)
        return True

    def encode(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
               kv_cache: KVCache | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the blocks (no final LayerNorm). attention_mask: (B, cached + T) with 1 for real tokens.
        position_ids (B, T) place the tokens for RoPE (default: counted from the mask, as forward does)."""
        B, T = hidden_states.shape[:2]
        num_cached = kv_cache.length if kv_cache is not None else 0
        if position_ids is None:
            full = attention_mask if attention_mask is not None else torch.ones(B, num_cached + T, dtype=torch.long,
                                                                                 device=hidden_states.device)
            position_ids = position_ids_from_mask(full)[:, -T:]
        mask = build_attention_mask(attention_mask, T, num_cached)
        rope = self.rotary(position_ids)  # (cos, sin) of every token's angles for RoPE; None for learned positions
        for layer in self.gpt_layers:
            if self.gradient_checkpointing and self.training and kv_cache is None:
                hidden_states = torch.utils.checkpoint.checkpoint(layer, hidden_states, mask, None, rope,
                                                                  use_reentrant=False)
            else:
                hidden_states = layer(hidden_states, mask, kv_cache, rope)
        if kv_cache is not None:
            kv_cache.advance(hidden_states.shape[1])
        return hidden_states

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool = False, head_follows: bool = False) -> dict[str, torch.Tensor]:
        """input_ids (B, T); attention_mask (B, T), or (B, cached + T) when continuing from past_key_values.
        head_follows: the caller applies the tied LM head to the output (GPT2LMHeadModel does; see sparse_token_grad).

        Positions come from the attention mask, so padding on either side leaves real tokens' outputs unchanged.
        'last_token' is the final hidden state of each row's last real token. With use_cache=True the result also
        holds 'past_key_values' (a KVCache) to pass back in with the next tokens.
        """
        self._check_inputs(input_ids, attention_mask, past_key_values)
        if input_ids.dtype not in (torch.long, torch.int):  # nn.Embedding indexes with int32 or int64 only
            input_ids = input_ids.long()
        B, T = input_ids.shape
        num_cached = past_key_values.length if past_key_values is not None else 0
        if position_ids is None:  # no mask: every token real, positions counted on from the cached ones
            position_ids = (position_ids_from_mask(attention_mask)[:, -T:] if attention_mask is not None else
                            torch.arange(num_cached, num_cached + T, device=input_ids.device).expand(B, T))
        if use_cache and past_key_values is None:
            past_key_values = self.new_cache(B, T)

        head_weight = None  # the tied head's weight as part of the lookup's node (embed_with_head)
        if head_follows:
            hidden_states, head_weight = self.embed_with_head(input_ids, position_ids)  # (B, T, C)
        else:
            hidden_states = self.embed(input_ids, position_ids)
        hidden_states = self.encode(hidden_states, attention_mask, past_key_values, position_ids)
        hidden_states = self.final_layer_norm(hidden_states)

        if attention_mask is None:  # every token real: the last position
            last_token = hidden_states[:, -1]
        else:  # the last real token: the first index where the running count of real tokens reaches its total
            last_idx = attention_mask[:, -T:].long().cumsum(-1).argmax(-1)  # (B,)
            last_token = hidden_states[torch.arange(B, device=hidden_states.device), last_idx]  # (B, C)
        out = {"last_hidden_state": hidden_states, "last_token": last_token}
        if head_weight is not None:  # for the caller's head (GPT2LMHeadModel); only with head_follows
            out["head_weight"] = head_weight
        if use_cache:
            out["past_key_values"] = past_key_values
        return out

    def decode_step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, key_mask: torch.Tensor | None,
                    kv_cache: KVCache) -> torch.Tensor:
        """One token per row after the cached ones, without forward's checks (the caller validated the whole
        request once): input_ids, position_ids (B, 1); key_mask bool (B, 1, 1, cached + 1), True for real tokens,
        or None without padding. Returns the final hidden states (B, C)."""
        hidden_states = self.embed(input_ids, position_ids)  # (B, 1, C)
        rope = self.rotary(position_ids)
        for layer in self.gpt_layers:
            hidden_states = layer(hidden_states, key_mask, kv_cache, rope)
        kv_cache.advance(1)
        return self.final_layer_norm(hidden_states[:, -1])

    def hidden_state_to_token(self, hidden_state: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """(..., C) -> (..., vocab) logits with the weights tied to the token embedding (or the untied lm_head),
        soft-capped when config.logit_softcap is set. weight: forward's out["head_weight"] where it gave one (the
        same values, tied into the lookup's gradient node); None: lm_head_weight."""
        weight = self.lm_head_weight if weight is None else weight
        if packed.applies(hidden_state, weight):  # bf16 inference of many rows on an AMX CPU (modules/packed.py)
            return self.logit_softcap(packed.product(self, "_packed_head", hidden_state, (weight,), (None,)))
        if onednn.applies(hidden_state, weight):  # fp32 inference of many rows, where oneDNN timed faster here
            return self.logit_softcap(onednn.linear(hidden_state, weight))
        return self.logit_softcap(self.lm_linear(hidden_state, weight))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's (V, C) matrix: the token embedding itself (tied, GPT-2) or lm_head's."""
        return self.word_embedding.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, batch_size: int, capacity: int, dtype: torch.dtype | None = None,
                  reuse: bool = False) -> KVCache:
        """A cache of the key/value heads (config.kv_heads: fewer than n_head under grouped-query attention).
        reuse: take the buffers of the cache last given to keep_cache where they have this shape, dtype and device
        (its old values stay in them: a cache reads only what was written since, up to its length)."""
        c = self.config
        dtype = dtype or self.word_embedding.weight.dtype
        device = self.word_embedding.weight.device
        kept = _KEPT_CACHES.pop(self, None) if reuse else None
        if kept is not None and kept[0].shape == (c.n_layer, batch_size, c.kv_heads, capacity, c.head_dim) \
                and kept[0].dtype == dtype and kept[0].device == device:
            return KVCache(c.n_layer, batch_size, c.kv_heads, c.head_dim, capacity, dtype, device, buffers=kept)
        return KVCache(c.n_layer, batch_size, c.kv_heads, c.head_dim, capacity, dtype, device)

    def keep_cache(self, cache: KVCache) -> None:
        """Keep the buffers of `cache`, which no one reads again (generate's own, at its end), for the next
        new_cache(reuse=True) of the same shape: a new cache's pages are faulted in at their first write (gpt2, a
        512-token prompt: 38 MB, about 9,000 page faults, 15-18 ms on a Zen 3, 3% of the prompt's pass). One cache
        a model, of at most KEPT_CACHE_BYTES; not one made under torch.inference_mode."""
        keys, values = cache.keys, cache.values
        if keys.is_contiguous() and values.is_contiguous() and not keys.is_inference() \
                and keys.nbytes + values.nbytes <= KEPT_CACHE_BYTES:  # inference tensors: not writable outside it
            _KEPT_CACHES[self] = (keys, values)

    def _check_inputs(self, input_ids, attention_mask, past_key_values) -> None:
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be (batch, seq_len) with seq_len >= 1, got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in INTEGER_DTYPES:
            raise TypeError(f"input_ids must be token ids in an integer tensor ({', '.join(map(str, INTEGER_DTYPES))}), "
                            f"got {input_ids.dtype}")
        num_cached = past_key_values.length if past_key_values is not None else 0
        total = num_cached + input_ids.shape[1]
        if total > self.config.n_positions:
            raise ValueError(
                f"sequence length {total} exceeds the model's context of n_positions={self.config.n_positions}; "
                f"truncate the input"
            )
        if attention_mask is not None and attention_mask.shape != (input_ids.shape[0], total):
            raise ValueError(
                f"attention_mask must have shape {(input_ids.shape[0], total)} (batch, cached + new tokens), "
                f"got {tuple(attention_mask.shape)}"
            )
        if not input_ids.numel():  # no rows: no values to check
            return
        # the values' checks read the tensors' contents: one transfer from a GPU for all of them, not one each
        # (under torch.func's vmap the checks read every example's values at once: transforms.unwrapped)
        found = [*torch.aminmax(transforms.unwrapped(input_ids).reshape(-1))]
        if attention_mask is not None:
            found.append(transforms.unwrapped(attention_mask.bool().any(-1)).all())
        lowest, highest, *rows_real = torch.stack([x.long() for x in found]).tolist()
        if lowest < 0 or highest >= self.config.vocab_size:
            raise ValueError(
                f"input_ids must be in [0, {self.config.vocab_size}); got values from {lowest} "
                f"to {highest} (does the tokenizer match the model's vocabulary?)"
            )
        if rows_real and not rows_real[0]:
            raise ValueError("attention_mask has a row with no real token (all zeros)")

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "gpt2", d: int | None = None, l: int | None = None,
                        num_heads: int | None = None, config: GPT2Config | None = None,
                        dtype: torch.dtype | None = None, **config_overrides) -> "GPT2Model":
        """Load official or saved GPT-2 weights: a hub id ('gpt2', 'gpt2-medium', ...), a local HF folder, or a
        weights file. `d`, `l`, `num_heads` (the course's arguments) are checked against the checkpoint;
        config_overrides change non-architecture fields such as dropout (e.g. hidden_dropout_prob=0.3)."""
        from models.loading import load_pretrained

        return load_pretrained(cls, model, config=config, dtype=dtype, expect=dict(n_embd=d, n_layer=l, n_head=num_heads),
                               **config_overrides)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write HF format (config.json + model.safetensors) that transformers.GPT2LMHeadModel loads."""
        from models.loading import save_pretrained

        save_pretrained(self, save_directory)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with the tied language-model head: forward -> {'logits': (B, T, V), 'loss': scalar or None}."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.gpt = GPT2Model(config)
        # the loss: hand-derived backward, or by blocks of rows on the CPU (modules/cross_entropy.py)
        self.cross_entropy = manual_backward.cross_entropy if config.backward == "manual" else chunked.cross_entropy

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                past_key_values: KVCache | None = None, use_cache: bool = False) -> dict[str, torch.Tensor | None]:
        """labels (B, T): usually input_ids. Position t predicts labels[t + 1]; labels of -100 are ignored, and so
        is any target that is padding or is predicted from padding (the first token after left padding). The loss is the mean cross-entropy over the remaining targets."""
        out = self.gpt(input_ids, attention_mask, position_ids, past_key_values, use_cache, head_follows=True)
        logits = self.gpt.hidden_state_to_token(out["last_hidden_state"], out.get("head_weight"))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = lm_loss(logits, labels, attention_mask, input_ids.shape[1], self.cross_entropy)
        result = {"logits": logits, "loss": loss}
        if use_cache:
            result["past_key_values"] = out["past_key_values"]
        return result

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
                 **kwargs) -> torch.Tensor:
        """Decode with a KV cache -> (B, prompt + new). num_beams > 1 (with do_sample=False) runs beam search
        (models.beam_search, transformers' length_penalty and early_stopping rules); otherwise greedy or sampled
        decoding (models.generation.generate, which lists the options)."""
        num_beams = kwargs.pop("num_beams", 1)
        if num_beams == 1:
            for ignored in ("length_penalty", "early_stopping"):  # beam options mean nothing to one sequence
                kwargs.pop(ignored, None)
            return generate(self, input_ids, attention_mask, max_new_tokens=max_new_tokens, **kwargs)
        if kwargs.pop("quantize", None) is not None:
            raise ValueError("quantize applies to greedy and sampled decoding, not to beam search (num_beams > 1)")
        if kwargs.pop("do_sample", False):
            raise ValueError("beam search is deterministic here: pass do_sample=False with num_beams > 1")
        for ignored in ("temperature", "top_k", "top_p", "generator"):  # sampling options mean nothing to beams
            kwargs.pop(ignored, None)
        return beam_search(self, input_ids, attention_mask, num_beams, max_new_tokens, **kwargs)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "gpt2", config: GPT2Config | None = None,
                        dtype: torch.dtype | None = None, **config_overrides) -> "GPT2LMHeadModel":
        from models.loading import load_pretrained

        return load_pretrained(cls, model, config=config, dtype=dtype, **config_overrides)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        from models.loading import save_pretrained

        save_pretrained(self.gpt, save_directory)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None, num_new: int,
            cross_entropy=chunked.cross_entropy) -> torch.Tensor:
    """Shifted next-token cross-entropy (at least fp32: half precision upcast, float64 kept), ignoring -100 labels and
    pairs that touch padding. cross_entropy takes the logits in their own dtype and computes at least in fp32."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    # Shift the labels, not the logits: slicing (B, T, V) logits would copy them; the last position predicts nothing.
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # (B, T)
    if attention_mask is not None:  # a target counts only if it and the position predicting it are real tokens
        real = attention_mask[:, -num_new:].bool()
        targets = targets.masked_fill(~(F.pad(real[:, 1:], (0, 1)) & real), -100)
    return cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
