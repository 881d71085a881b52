"""nn.Linear with kernel choices for decoding, where a few single-token rows multiply every weight matrix.

Decoding multiplies a (B, 1, in) input by each weight: a matrix-vector product (B = 1) or a skinny GEMM that reads
the whole weight for a few rows. It is bound by how fast the weights stream, and on CPUs torch's kernels for these
shapes stream slowly (the measurements: docs/performance.md, "Figures behind the code"):
- where `modules.rows.pays` (AVX2 and AVX512 CPUs: fp32 and bf16 with 1 to 8 rows): modules/rows.cpp, which reads
  each weight row once for all rows, with a software prefetch;
- else B = 1: `blocked_linear`: the weight's rows cut into one block per thread and multiplied as one batched
  product, whose blocks torch runs on separate threads (torch's matrix-vector kernel keeps to one core). The rows of
  a row-major weight are views: no copy is made;
- else B > 1: (W @ x^T)^T (`weight_first`): whole decodes (beam search, batch 8) ran faster with it than with the
  row-blocked product, though the products alone did not.
Same values up to float rounding (other summation kernels); training and every other shape take F.linear (a bf16
training step on AMX: with its weight gradient computed from a transposed copy of the output's, modules/transposed.py).
bf16 inputs of 64+ rows without gradients on AMX CPUs take oneDNN-packed copies of the weights (modules/packed.py).
Within `quantized_weights(model, mode)` (a modules.quant.QUANTIZE_MODES name) one-row products (batch-1 decoding)
take int8 or int4 copies of the weights (modules/quant.py); with w8a8 / w4a8 the prompt (2+ tokens, where
the C++ prompt pass does not take it) takes oneDNN's int8 GEMM on those weights with its activations quantized per
tensor (quant.prompt_product); batches of 2-8
rows, and the prompt of the weight-only modes, keep the layer's own weights (dequantizing per call would cost more
than the smaller weights save).
Inputs of 2 to 8 rows in any other shape without gradients (a prompt of 2-8 tokens through the layers: where the C++
prompt pass of models/fast_step.py does not run) take the kernel's few-row product too, fp32 and bf16, outside autocast:
torch's few-row sgemm made gpt2's such prompts 1.9-2.2x slower in fp32, 1.25-1.5x in bf16 (Zen 4, 2026-12-02). fp32
products of 9 to `onednn.kernel_rows()` rows without gradients (a short prompt, in any mode) by weights of at least
`rows.PROMPT_MIN_WEIGHT` values take the rows kernel's product of many rows (rows.many_rows), where the decode plan
timed it faster than F.linear and, where oneDNN is taken, faster than oneDNN (16-32 rows on a Zen 4; none where there is
no plan; a batched decode step's rows, to `rows.prompt_rows()`, keep the kernel: with the C++ step around it, 24 rows
ran 1.47x faster than through oneDNN); GPT2_PROMPT_KERNEL=0 keeps the library's product. Longer fp32 products without
gradients (a prompt past those rows, an evaluation) take oneDNN's inner product where it timed faster than F.linear on
this machine (modules/onednn.py).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from modules import onednn, packed, quant, transforms, transposed
from modules import rows as row_kernel
from modules.quant import Int4Weight, Int8Weight, prepared_quantized, quantized_linear


def weight_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (B, in) computed as (W @ x^T)^T -> a (B, out) transposed view."""
    out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())  # (out, B)
    return out.t()


def takes_prompt_kernel(rows: int, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether `rows` rows of `dtype` times `weight` take the rows kernel's product of many rows (rows.chunked_linear):
    fp32 on the CPU without gradients, a contiguous weight of at least rows.PROMPT_MIN_WEIGHT values, where the kernel
    pays at 8 rows (its passes are its 8-row product) and the rows are within rows.prompt_rows() (a short prompt; a
    decode step of 9+ rows, and its LM head: models/generation.py). A prompt's pass keeps the kernel only within
    onednn.kernel_rows() (Linear.forward)."""
    return (dtype == torch.float32 and weight.dtype == torch.float32 and weight.is_cpu and not torch.is_grad_enabled()
            and weight.is_contiguous() and weight.numel() >= row_kernel.PROMPT_MIN_WEIGHT
            and row_kernel.pays(torch.float32, row_kernel.MAX_ROWS) and row_kernel.takes_chunks(rows))


class Blocks(NamedTuple):
    """A weight's rows cut into equal blocks, as views (no copy): (blocks, in, size) and the bias as (blocks, 1, size);
    `rest` holds the rows left over when the block count does not divide out_features (else None)."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    rest: tuple[torch.Tensor, torch.Tensor | None] | None


def row_blocks(weight: torch.Tensor, bias: torch.Tensor | None, blocks: int) -> Blocks | None:
    """The views blocked_product reads; None where blocking does not apply (one block, or fewer rows than blocks)."""
    out_features, in_features = weight.shape
    size = out_features // blocks
    if blocks <= 1 or size == 0 or not weight.is_contiguous():
        return None
    n = size * blocks
    rest = None if n == out_features else (weight[n:], None if bias is None else bias[n:])
    return Blocks(weight[:n].view(blocks, size, in_features).transpose(1, 2),
                  None if bias is None else bias[:n].view(blocks, 1, size), rest)


def blocked_product(x: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """x (B, in) times the blocked weight (plus bias) -> (B, out), row-major: one batched product, one block per
    thread."""
    w = blocks.weight
    xs = x.expand(w.shape[0], *x.shape)  # (blocks, B, in)
    y = torch.bmm(xs, w) if blocks.bias is None else torch.baddbmm(blocks.bias, xs, w)  # (blocks, B, size)
    y = y.view(1, -1) if x.shape[0] == 1 else y.transpose(0, 1).reshape(x.shape[0], -1)
    return y if blocks.rest is None else torch.cat([y, F.linear(x, *blocks.rest)], dim=1)


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   blocks: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a few rows x (B, in) -> (B, out), row-major, with the weight's rows in
    `blocks` equal blocks (default: torch's thread count) multiplied as one batched product, one block per thread.
    Rows left over when `blocks` does not divide out_features take F.linear."""
    views = row_blocks(weight, bias, blocks or torch.get_num_threads())
    return F.linear(x, weight, bias) if views is None else blocked_product(x, views)


UNPREPARED = object()  # a quantized layer's one-row product not prepared yet (Linear.quantized_call)


class Linear(nn.Linear):
    _blocks: tuple | None = None  # (key, Blocks | None): the decode views, rebuilt when the weights or threads change
    quantized: Int8Weight | Int4Weight | None = None  # set within quantized_weights(): one-row products take it
    # within quantized_weights(), where the rows kernel pays: its product prepared (rows.prepared) at the first one-row
    # product (UNPREPARED until then: a call whose steps all run in C++, or with one new token, never prepares it)
    quantized_call = None
    rows_call = None  # within prepared_rows(): (rows, this weight's product prepared in the rows kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if transforms.torch_func():  # torch.func or dual tensors: torch's products (the kernels below read pointers)
            if self.quantized is not None and not torch.is_grad_enabled():
                return quantized_linear(x, self.quantized, self.bias)
            return F.linear(x, self.weight, self.bias)
        if self.quantized is not None and not torch.is_grad_enabled():
            rows = x.shape[:-1].numel()
            if rows == 1:
                if self.quantized_call is UNPREPARED:
                    self.quantized_call = prepared_quantized(self.quantized, self.bias)
                if self.quantized_call is not None and x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu:
                    return self.quantized_call(x)
                return quantized_linear(x, self.quantized, self.bias)
            if rows > 1:  # the prompt (or 9+ rows): w8a8 / w4a8 in oneDNN's int8 GEMM where it runs
                y = quant.prompt_product(self, (self,), x)
                if y is not None:
                    return y
        if packed.applies(x, self.weight):  # bf16 inference of many rows on an AMX CPU: the weight kept reordered
            return packed.product(self, "_packed", x, (self.weight,), (self.bias,))
        if x.dim() == 3 and x.shape[1] == 1 and x.is_cpu and not torch.is_grad_enabled():
            if self.rows_call is not None and self.rows_call[0] == x.shape[0]:
                return row_kernel.run(self.rows_call[1], x)
            if row_kernel.pays(self.weight.dtype, x.shape[0]) and row_kernel.applies(x, self.weight):
                return row_kernel.rows_linear(x, self.weight, self.bias)
            if x.shape[0] > 1:
                if takes_prompt_kernel(x.shape[0], x.dtype, self.weight):  # 9+ rows (12 sonnets): the kernel
                    return row_kernel.chunked_linear(x, self.weight, self.bias)
                # row-major like F.linear's output: a transposed view sends the next product and SDPA down slow paths
                return weight_first(x[:, 0], self.weight, self.bias).contiguous()[:, None]
            views = self.decode_blocks()
            if views is not None:
                return blocked_product(x[:, 0], views)[:, None]  # (1, 1, out)
        n = x.shape[:-1].numel()
        if 1 < n <= row_kernel.MAX_ROWS and row_kernel.pays(self.weight.dtype, n) and \
                row_kernel.applies(x, self.weight) and not torch.is_autocast_enabled("cpu"):
            return row_kernel.run(row_kernel.prepared(self.weight, self.bias, rows=n), x)  # 2-8 rows: a short prompt
        if x.is_cpu and takes_prompt_kernel(n, x.dtype, self.weight) and n <= onednn.kernel_rows():
            return row_kernel.chunked_linear(x, self.weight, self.bias)  # a short prompt: the kernel
        if onednn.applies(x, self.weight):  # a longer prompt, an evaluation: oneDNN where it timed faster here
            return onednn.linear(x, self.weight, self.bias)
        return transposed.linear(x, self.weight, self.bias)  # F.linear's (bf16 training on AMX: modules/transposed.py)

    def decode_blocks(self) -> Blocks | None:
        """The row-block views of this layer's weight for decoding, built once and reused while the parameters
        keep their storage (views read the current values: training steps and load_state_dict are seen)."""
        key = (self.weight.data_ptr(), self.bias.data_ptr() if self.bias is not None else 0,
               self.weight.shape, torch.get_num_threads())
        if self._blocks is None or self._blocks[0] != key:
            self._blocks = (key, row_blocks(self.weight.detach(), None if self.bias is None else self.bias.detach(),
                                            key[3]))
        return self._blocks[1]


@contextlib.contextmanager
def prepared_rows(model: nn.Module, rows: int):
    """Within the block, every Linear of `model` (LoRA layers excepted) whose weight the rows kernel pays for at
    `rows` rows (rows.pays) multiplies decode steps of that many rows through its product prepared once here,
    instead of checking and preparing at every call (about 8 us a layer, 0.6 ms a gpt2 token). Made for one
    generate call: the weights must not change inside the block. Yields the layers that took one."""
    layers = [m for m in model.modules() if type(m) is Linear and m.weight.is_cpu and m.weight.is_contiguous()
              and row_kernel.pays(m.weight.dtype, rows) and row_kernel.available()]
    for layer in layers:
        bias = None if layer.bias is None else layer.bias.detach()
        layer.rows_call = (rows, row_kernel.prepared(layer.weight.detach(), bias, rows=rows))
    try:
        yield layers
    finally:
        for layer in layers:
            layer.rows_call = None


@contextlib.contextmanager
def quantized_weights(model: nn.Module, mode: str = "int8", layers: list[tuple[str, Linear]] | None = None):
    """Within the block, every Linear of `model` (LoRA layers excepted) computes one-row inputs with a `mode` copy
    of its weight (modules/quant.py: "int8" per-row scales, "int4" groups of 32; "w8a8" / "w4a8" those with the
    inputs quantized to int8 too) whenever no gradient is taken; with w8a8 / w4a8 the prompt (2+ tokens; 9+ rows of
    a batched step) takes oneDNN's int8 GEMM (quant.prompt_product, GPT2_PROMPT_INT8=0: off); other inputs keep the
    layer's own weight. The copies stay on the layers for the next block (int8: a quarter of the fp32 weights'
    memory, int4: about a sixth) and are made again only for weights that changed or another mode.
    A weight the mode cannot take (int4, w8a8, w4a8: in_features not a multiple of 32) raises ValueError naming
    the layer. layers: the model's (name, Linear) pairs where the caller has them (models.fast_step.walk).
    Yields the layers."""
    named = [(name, m) for name, m in model.named_modules() if type(m) is Linear] if layers is None else layers
    # (object.__setattr__: neither attribute is a parameter, buffer or module, and nn.Module's own setattr, which
    # looks in those first, took 0.2 ms of a call for gpt2's 72 layers)
    try:  # the copies placed first (huge pages, where new); each one-row product prepared at its first use
        copies = quant.cached_copies([(f"layer {name}", layer, layer.weight) for name, layer in named], mode)
        for (_, layer), copy in zip(named, copies):
            object.__setattr__(layer, "quantized", copy)
            object.__setattr__(layer, "quantized_call", UNPREPARED)  # prepared at its first one-row product
        yield [layer for _, layer in named]
    finally:
        for _, layer in named:
            object.__setattr__(layer, "quantized", None)
            object.__setattr__(layer, "quantized_call", None)


def clear_derived_weights(model: nn.Module) -> int:
    """Drop every copy derived from `model`'s weights (packed bf16, modules/packed.py; int8/int4, modules/quant.py);
    returns how many there were. The caches follow every write torch counts (in-place ops, optimizer steps, the fused
    AdamW kernel, load_state_dict, LoRA merges); call this after a write through `.data`, which they cannot see."""
    return packed.clear(model) + quant.clear(model)
