"""Decoding steps of a plain GPT-2 for 1 to 8 rows (fp32: more, as far as the kernel's many-row product pays) in one
C++ call (modules/rows.cpp, `gpt2_step`), instead of the few hundred torch operations of GPT2Model.decode_step.

Each torch operation costs a dispatch of several microseconds; at gpt2 size they added about a third to the time
the weights take to stream, and with int8 or int4 weights, whose products are 4 to 6 times shorter, they were most
of the step (docs/cpu-decoding.md, "Against the CPU engines"); with bf16 weights (half fp32's bytes) they were 40%
of it, and a batch of 8 bf16 rows spent 45% of its step outside the products. The C++ step runs every block
(LayerNorm, q/k/v, the cache write, attention under the padding mask, projections, GELU, residuals) and the final
LayerNorm, for all rows at once, every product in the rows kernel (all rows in one pass over the weight) and in the
layer's own weight kind (fp32, bf16, or, for one row, the int8/int4 copies of quantize=...; 2-8 rows keep the layers'
weights, as decode_step does). A bf16 model's step keeps its activations in fp32 storage rounded to bf16 wherever
decode_step's bf16 operations round them, and its cache in bf16. The embedding lookup, the LM head and the logits
processing stay in Python. The results agree with decode_step to float rounding (other summation orders), like the
kernel's products.

Taken by models.generation.generate and models.beam_search for 1 to 8 rows (left-padded or not) on the CPU in fp32,
or in bf16 (with quantize: one row not), where the kernel builds; fp32 batches of 9 to rows.prompt_rows() rows too
(product_many, as decode_step's chunked_linear; not with int8 activations, whose 9+ rows take oneDNN's int8
GEMM in decode_step; 12 rows sampled: 1.05x decode_step, 2026-11-30, Zen 4); for the GPT-2 architecture (LayerNorm,
learned positions, GELU tanh, full heads; biases, norm scales, an untied head and a logit soft-cap may vary);
anything else keeps decode_step, as do calls under torch.autocast (bf16 products) and models with forward hooks
(the step calls no module). GPT2_DECODE_STEP=0 turns it off.

The prompt's pass before the steps can run in one C++ call too (rows.cpp, `gpt2_prompt_pass`; FastPrompt, taken by
models.generation.prefill): one fp32 sequence without padding into an empty cache, every block as the step runs it for
that many rows (causal attention over the prompt by rows_attend_prompt), the last token's final LayerNorm out. Its
products: 1-8 tokens the kernel's few-row product, 9 to onednn.kernel_rows() its product of many rows (as the layers
take them; a longer prompt goes through the layers, whose products take oneDNN); w8a8 / w4a8 prompts of 2 to
INT8_PROMPT_TOKENS tokens the pass's own int8 GEMM (rows.cpp `rows_qgemm`: the integers and activation scale of
oneDNN's int8 GEMM in the layers, on a packed copy of each layer's int8 weight); not a one-token prompt under quantize
(decode_step's copies). gpt2 on a Zen 4 (2026-12-02, generate with one new token, alternating calls): 2-8 tokens
21-27 ms against 63-72 through the layers (whose few-row products took oneDNN or F.linear), 12-16 tokens 1.15-1.33x;
w8a8, 16 tokens 18 against 24 ms (docs/cpu-decoding.md). GPT2_PROMPT_PASS=0 turns it off.
"""
from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import torch
import torch.nn.modules.module as module_hooks
from torch import nn

from modules import onednn, prompt_attention, quant
from modules import rows as row_kernel
from modules.attention import KVCache
from modules.layer_norm import LayerNorm
from modules.linear import Linear
from modules.quant import Int4Weight, Int8Weight
from modules.rows import pointer

ENV = "GPT2_DECODE_STEP"
PROMPT_ENV = "GPT2_PROMPT_PASS"  # 0: prompts go through the layers (the decode step keeps its own switch)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the models' dtypes the step runs: gpt2_step, _bf16
ALLOWED_VARIANTS = {"bias", "norm_scale", "tie_word_embeddings", "logit_softcap"}  # handled here or by the LM head
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
LAYER_NORMS = (nn.LayerNorm, LayerNorm)  # the norms the step computes as torch's LayerNorm (not the manual one)


class StepLinear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64)]


class StepLayer(ctypes.Structure):
    _fields_ = [("ln1_w", ctypes.c_void_p), ("ln1_b", ctypes.c_void_p), ("q", StepLinear), ("k", StepLinear),
                ("v", StepLinear), ("proj", StepLinear), ("ln2_w", ctypes.c_void_p), ("ln2_b", ctypes.c_void_p),
                ("fc", StepLinear), ("out", StepLinear), ("attn_scale", ctypes.c_float)]


class Walk(NamedTuple):
    """What a decode call's checks read of a model, found in one walk over its modules (each walk over gpt2's 189
    modules or 148 parameters took 0.15-0.35 ms on a Zen 4, and a call made six of them)."""
    training: bool  # a module in training mode
    linears: list[tuple[str, Linear]]  # every plain Linear, named as model.named_modules() names it
    hooked: list[nn.Module]  # the modules with forward hooks or pre-hooks
    dtypes: frozenset[torch.dtype]  # the parameters'
    all_cpu: bool  # every parameter on the CPU
    first_cpu: bool  # the first parameter (model.parameters()'s order) on the CPU, as the threads' choice asks
    size: int  # the parameters' element count, a shared tensor (the tied LM head) once


def walk(model: nn.Module) -> Walk:
    """model.modules() once, with what evaluating, quantized_weights, why_not and the thread choice read."""
    training, linears, hooked, seen, dtypes, all_cpu, first_cpu, size = False, [], [], set(), set(), True, None, 0
    for name, module in model.named_modules():
        training = training or module.training
        if type(module) is Linear:
            linears.append((name, module))
        if module._forward_hooks or module._forward_pre_hooks:
            hooked.append(module)
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:  # model.parameters()'s order, each tensor once
                seen.add(id(p))
                dtypes.add(p.dtype)
                all_cpu = all_cpu and p.is_cpu
                first_cpu = p.is_cpu if first_cpu is None else first_cpu
                size += p.numel()
    return Walk(training, linears, hooked, frozenset(dtypes), all_cpu, bool(first_cpu), size)


def _hooked(body: nn.Module, found: Walk) -> bool:
    """Whether a forward hook or pre-hook would run in decode_step: on any module of the body, or global ones.
    found: a walk of the model holding the body (none of its modules hooked: no walk of the body's)."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return True
    if not found.hooked:
        return False
    return any(m._forward_hooks or m._forward_pre_hooks for m in body.modules())


def why_not(model, batch_size: int, key_mask: torch.Tensor | None, cache: KVCache,
            found: Walk | None = None) -> str | None:
    """Why this decode cannot take the C++ step (None: it can). found: walk(model), where the caller has it."""
    config, body = model.config, model.gpt
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if batch_size < 1:
        return f"{batch_size} rows"
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.dim() != 4 or key_mask.shape[:3] !=
                                 (batch_size, 1, 1) or key_mask.device != cache.keys.device):
        return "a key mask that is not (rows, 1, 1, keys) bool beside the cache"
    if torch.is_autocast_enabled("cpu"):
        return "autocast (its products in another dtype than the weights')"
    found = found if found is not None else walk(model)
    if _hooked(body, found):
        return "forward hooks on the model's modules (the step calls none of them)"
    if config.backward != "autograd" or config.activation_function not in ACTIVATIONS:
        return "not GPT-2's blocks (manual backward or another activation)"
    if set(config.variant_fields()) - ALLOWED_VARIANTS:
        return f"a variant the step does not run: {sorted(set(config.variant_fields()) - ALLOWED_VARIANTS)}"
    dtype = cache.keys.dtype
    if dtype not in DTYPE_NAMES or not cache.keys.is_cpu or not cache.keys.is_contiguous():
        return "the cache is not fp32 or bf16 on the CPU"
    for layer in body.gpt_layers:
        attn = layer.self_attention
        if any(type(m) is not Linear for m in (attn.query, attn.key, attn.value, layer.attention_dense,
                                               layer.interm_dense, layer.out_dense)):
            return "a layer that is not the plain Linear (LoRA)"
        if any(type(n) not in LAYER_NORMS or n.eps != config.layer_norm_epsilon
               for n in (layer.attention_layer_norm, layer.out_layer_norm)):
            return "a norm that is not LayerNorm"
    if found.dtypes - {dtype} or not found.all_cpu:
        return f"parameters not all {DTYPE_NAMES[dtype]} on the CPU, as the cache is"
    if batch_size > row_kernel.MAX_ROWS and (dtype != torch.float32 or not row_kernel.takes_chunks(batch_size)):
        return f"{batch_size} rows (the step runs 1 to {row_kernel.MAX_ROWS}, and fp32 up to the rows the kernel's " \
               f"many-row product pays for: {row_kernel.prompt_rows()})"
    quantized = body.gpt_layers[0].self_attention.query.quantized
    if dtype == torch.bfloat16 and quantized is not None and batch_size == 1:  # more rows read the bf16 weights
        return "bf16 weights with quantized copies (the step's bf16 form reads the bf16 weights)"
    if batch_size > row_kernel.MAX_ROWS and getattr(quantized, "int8_activations", False):
        return "more than 8 rows with int8 activations (decode_step's int8 GEMM)"
    final = body.final_layer_norm
    if type(final) not in LAYER_NORMS or final.eps != config.layer_norm_epsilon:
        return "a final norm that is not LayerNorm"
    if not row_kernel.available():
        return "the rows kernel is not built here"
    return None


class _Stack:
    """The model's blocks as rows.cpp reads them: `layers`, a StepLayer array (each product in the weight kind
    `_linear` picks), `final`, the final norm's pointers, and `keep`, every tensor a pointer points into."""

    quantized = False  # the layers' int8 / int4 copies (one-row steps within quantized_weights) read, not the weights
    bf16 = False  # a bf16 model: its norms and biases as fp32 copies

    def _stack(self, model) -> None:
        body, config = model.gpt, model.config
        self.keep: list[torch.Tensor] = []
        layers = (StepLayer * config.n_layer)()
        for i, layer in enumerate(body.gpt_layers):
            attn = layer.self_attention
            layers[i] = StepLayer(
                *self._norm(layer.attention_layer_norm), self._linear(attn.query), self._linear(attn.key),
                self._linear(attn.value), self._linear(layer.attention_dense), *self._norm(layer.out_layer_norm),
                self._linear(layer.interm_dense), self._linear(layer.out_dense), attn.scale)
        self.layers = layers
        self.final = self._norm(body.final_layer_norm)
        self.eps, self.n_layer, self.n_head, self.width = config.layer_norm_epsilon, config.n_layer, config.n_head, \
            config.n_embd

    def _fp32(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A norm's or a bias's values as the step reads them: fp32 and contiguous (a bf16 model's: an fp32 copy,
        made per generate call, so later changes to the model are seen by the next call), kept alive."""
        if t is None:
            return None
        if t.dtype != torch.float32 or not t.is_contiguous():  # (an fp32 model's own: read in place, 0.4 ms a call)
            t = t.detach().to(torch.float32).contiguous()
        self.keep.append(t)
        return t

    def _norm(self, norm: nn.LayerNorm) -> tuple[int | None, int | None]:
        return pointer(self._fp32(norm.weight)), pointer(self._fp32(norm.bias))

    def _linear(self, layer: Linear) -> StepLinear:
        bias = self._fp32(layer.bias)
        q = layer.quantized if self.quantized else None  # set within quantized_weights (quantize="int8" / ...)
        if isinstance(q, Int8Weight):  # rows_product's kinds: 0 fp32, 1 bf16, 2 int8, 3 int4; 4, 5 int8 activations
            kind, w, scale, group = 2 + 2 * q.int8_activations, q.q, q.scale, 0
        elif isinstance(q, Int4Weight):
            kind, w, scale, group = 3 + 2 * q.int8_activations, q.q, q.scale, q.group
        else:
            kind, w, scale, group = int(self.bf16), layer.weight.detach().contiguous(), None, 0
        self.keep += [t for t in (w, scale) if t is not None]
        return StepLinear(kind, w.data_ptr(), pointer(scale), pointer(bias), group, layer.in_features,
                          layer.out_features)


class FastStep(_Stack):
    """The C++ step for one generate or beam search call: made after the prompt's pass (inside quantized_weights
    where quantize is set, so the layers' int8/int4 copies are in place) and called once per new token."""

    def __init__(self, model, cache: KVCache, key_mask: torch.Tensor | None = None, lib=None):
        """key_mask: generate's (rows, 1, 1, prompt + new tokens) bool, True for the keys a row attends (left
        padding: False on the padding), or None; read at each step up to the new token. lib: a rows.library(...) to
        run instead of this machine's build (tests of the AVX2 form)."""
        body, config = model.gpt, model.config
        rows = self.rows = cache.keys.shape[1]
        first = body.gpt_layers[0].self_attention.query.quantized  # the same kind for every layer
        # quantized copies serve one row, as in decode_step (modules/linear.py); more rows take the layers' weights
        quantized = first if rows == 1 and isinstance(first, (Int8Weight, Int4Weight)) else None
        self.quantized = quantized is not None
        self.bf16 = cache.keys.dtype == torch.bfloat16  # a bf16 model: gpt2_step_bf16 (why_not checked the rest)
        kind = ("bf16" if self.bf16 else "fp32") if quantized is None else \
            row_kernel.plan_kind(quantized.q.dtype, quantized.int8_activations)  # w8a8 / w4a8: planned apart
        self.lib = lib or row_kernel.library_step(kind, rows)  # the kernel's form for it (modules/rows.py)
        self.step = self.lib.gpt2_step_bf16 if self.bf16 else self.lib.gpt2_step
        self.body, self.cache = body, cache
        self._stack(model)
        self.capacity = cache.capacity  # the scratch's size
        self.mask = None if key_mask is None else key_mask.reshape(rows, -1).contiguous()  # bool: one byte a key
        self.x = torch.empty(rows, config.n_embd)
        self.out = torch.empty(rows, config.n_embd)
        self.hidden = torch.empty(rows, config.n_embd, dtype=cache.keys.dtype) if self.bf16 else self.out  # returned
        self.scratch = torch.empty(self.lib.gpt2_step_scratch(config.n_head, config.n_embd, config.inner_dim,
                                                              cache.capacity, rows))

    def __call__(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """token, position: a row's id each ((rows,) or (rows, 1)) -> the final hidden states (rows, C), in the
        model's dtype, after writing the tokens' keys and values into the cache and advancing it."""
        cache, body, mask = self.cache, self.body, self.mask
        if cache.length + 1 > cache.capacity:
            raise RuntimeError(f"the decode cache holds {cache.capacity} tokens and is full")
        if (cache.keys.shape[1], cache.capacity) != (self.rows, self.capacity) or \
                (mask is not None and mask.shape[1] <= cache.length):
            raise RuntimeError(f"the decode step was made for {self.rows} rows, {self.capacity} cached tokens and a "
                               f"key mask of {None if mask is None else mask.shape[1]} keys; the cache has "
                               f"{cache.keys.shape[1]} rows, {cache.capacity} places and {cache.length} keys")
        embedded = body.word_embedding.weight[token.reshape(-1)] + body.pos_embedding.weight[position.reshape(-1)]
        self.x.copy_(embedded)  # summed in the model's dtype (bf16: rounded, as decode_step's embedding is)
        err = self.step(self.layers, self.n_layer, self.n_head, self.width, self.eps, self.rows, self.x.data_ptr(),
                        self.final[0], self.final[1], cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity,
                        cache.length, pointer(mask), 0 if mask is None else mask.shape[1], self.scratch.data_ptr(),
                        self.out.data_ptr(), torch.get_num_threads())
        if err != 0:
            raise RuntimeError(f"the C++ decode step failed (code {err})")
        row_kernel.wrote(cache.keys, cache.values, self.out)  # written in place by the step, as torch would count it
        cache.advance(1)
        if self.bf16:
            self.hidden.copy_(self.out)  # the final norm's output rounded to bf16, as decode_step's is
        return self.hidden


def prompt_why_not(model, input_ids: torch.Tensor, key_mask: torch.Tensor | None, cache: KVCache,
                   step: str | None) -> str | None:
    """Why this prompt cannot take the C++ prompt pass (None: it can). step: why_not's answer for the prompt's rows
    (the caller's, asked once a call). The pass needs what the step needs, and one fp32 sequence without padding
    into an empty cache, of at most as many tokens as a prompt's products take the rows kernel (1-8 rows its
    few-row product, 9 to onednn.kernel_rows() its product of many rows: where Linear.forward takes the kernel too;
    w8a8 / w4a8: 2 to INT8_PROMPT_TOKENS its int8 GEMM), not a one-token prompt with quantized copies (decode_step
    reads those), nor 9+ tokens with int8 activations whose int8 products are off (the layers' float weights)."""
    B, T = input_ids.shape
    if os.environ.get(PROMPT_ENV, "1") == "0":
        return f"{PROMPT_ENV}=0"
    if B != 1 or key_mask is not None:
        return f"{B} rows{' with padding' if key_mask is not None else ''} (the pass runs one sequence)"
    if cache.length != 0 or cache.keys.dtype != torch.float32:
        return "a cache that is not empty or not fp32"
    if step is not None:
        return step
    quantized = model.gpt.gpt_layers[0].self_attention.query.quantized
    int8 = takes_int8_prompt(quantized, T)
    if T > row_kernel.MAX_ROWS and not int8 and not (row_kernel.takes_chunks(T) and T <= onednn.kernel_rows()):
        return f"{T} tokens (past the rows the kernel takes for a prompt's products: {onednn.kernel_rows()})"
    if quantized is not None and (T == 1 or T > row_kernel.MAX_ROWS and quantized.int8_activations and not int8):
        return "a prompt whose products take the quantized copies"
    if not prompt_attention.available():  # GPT2_PROMPT_ATTENTION=0: a prompt's attention is SDPA's, so the layers'
        return f"prompt attention is off ({prompt_attention.ENV}=0)"
    head = model.config.n_embd // model.config.n_head
    if not prompt_attention.takes_head(head):
        return f"a head size of {head} (prompt attention takes multiples of the vector width)"
    return None


# The most tokens a w8a8 / w4a8 prompt runs through the pass's int8 products; longer ones go through the layers
# (oneDNN's int8 GEMM, each block on the thread count prompt_threads times). gpt2, Zen 4, generate with one new token
# (2026-12-02): 16 tokens 18 against 24 ms, 32: 25 / 41, 64: 36 / 38, 128: 62 / 81, 256: 103 / 103, 512: 204 / 201.
INT8_PROMPT_TOKENS = 128


def takes_int8_prompt(quantized, tokens: int) -> bool:
    """Whether a prompt of `tokens` tokens whose layers hold `quantized` copies (the first layer's; None: none) runs
    the pass's int8 products: 2 to INT8_PROMPT_TOKENS tokens of w8a8 / w4a8, where the layers' prompt would take
    int8 products too (quant.prompt_products_why_not: GPT2_PROMPT_INT8=0 keeps both on the float weights)."""
    return (quantized is not None and quantized.int8_activations
            and 1 < tokens <= INT8_PROMPT_TOKENS and quant.prompt_products_why_not() is None)


class FastPrompt(_Stack):
    """The C++ prompt pass (rows.cpp, `gpt2_prompt_pass`): one sequence's blocks in one call, fp32 weights or, for
    2+ tokens of w8a8 / w4a8 (takes_int8_prompt), each layer's int8 weight packed for the prompt's integer products
    (quant.prompt_packed), the activations quantized per tensor as oneDNN's path in the layers quantizes them."""

    def __init__(self, model, tokens: int, lib=None):
        self.lib = lib or row_kernel.library_step("fp32", tokens)  # 2+ rows: the prompt's library
        self.body, self.tokens, self.inner = model.gpt, tokens, model.config.inner_dim
        self.int8 = takes_int8_prompt(model.gpt.gpt_layers[0].self_attention.query.quantized, tokens)
        self._stack(model)

    def _linear(self, layer: Linear) -> StepLinear:
        made = quant.prompt_packed(layer, self.lib) if self.int8 else None
        if made is None:
            return super()._linear(layer)
        bias = self._fp32(layer.bias)
        self.keep += made
        return StepLinear(6, made[0].data_ptr(), made[1].data_ptr(), pointer(bias), 0, layer.in_features,
                          layer.out_features)

    def __call__(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """input_ids (1, T) -> the last token's final hidden state (1, C), after writing the prompt's keys and values
        into the (empty) cache and advancing it; None (the cache left empty) where an int8 product met activations
        it cannot quantize (a NaN or an infinity: the layers' path multiplies those in fp32)."""
        body, T = self.body, self.tokens
        tokens = input_ids[0].long()  # forward's rule: uint8 ids are ids here, not a mask (int8 / int16: no index)
        x = body.word_embedding.weight.index_select(0, tokens) + body.pos_embedding.weight[:T]
        out = torch.empty(1, self.width)
        scratch = torch.empty(self.lib.gpt2_step_scratch(self.n_head, self.width, self.inner, 0, T))  # no scores
        err = self.lib.gpt2_prompt_pass(self.layers, self.n_layer, self.n_head, self.width, self.eps, T, x.data_ptr(),
                                        self.final[0], self.final[1], cache.keys.data_ptr(), cache.values.data_ptr(),
                                        cache.capacity, scratch.data_ptr(), out.data_ptr(), torch.get_num_threads())
        row_kernel.wrote(cache.keys, cache.values)  # (written up to the failing block where it failed)
        if err == -4 and self.int8:
            return None
        if err != 0:
            raise RuntimeError(f"the C++ prompt pass failed (code {err})")
        cache.advance(T)
        return out
