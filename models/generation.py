"""Decoding for GPT2LMHeadModel: greedy and sampled, batched prompts with left padding, a preallocated KV cache.

Logit processing follows the usual order: repetition penalty, temperature, top-k, top-p, then argmax or sampling.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from models import decode_threads, fast_step
from models.decode_threads import LONGEST_PERIOD, PROMPT_ENV, PROMPT_MIN_FLOPS, DecodeThreads
from modules import draw
from modules import rows as row_kernel
from modules.attention import KVCache
from modules.linear import (
    blocked_product,
    prepared_rows,
    quantized_weights,
    row_blocks,
    takes_prompt_kernel,
    weight_first,
)
from modules.masks import position_ids_from_mask
from modules.quant import QUANTIZE_MODES, cached_copies, prepared_quantized, quantized_linear


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens already in the sequence (seen: bool (B, V)): positive logits are divided by
    `penalty`, negative ones multiplied, so a seen token always becomes less likely for penalty > 1."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    """Keep the k highest logits per row (and any tied with the k-th); the rest become -inf."""
    if k is None or k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float | None, fast_sort: bool = True) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass reaches p (at least one).
    The mass is that of softmax(logits), summed best first."""
    if p is None or p >= 1.0:
        return logits
    if fast_sort and logits.is_cpu and logits.dtype in (torch.float32, torch.float64):
        return _top_p_from_the_top(logits, p)
    probs = logits.softmax(dim=-1)
    order = torch.sort(logits, dim=-1, descending=True).indices
    remove_sorted = _beyond_nucleus(probs.gather(-1, order), p)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _beyond_nucleus(sorted_probs: torch.Tensor, p: float) -> torch.Tensor:
    """For probabilities sorted best first: True where the mass of the tokens ranked above reaches p (never the
    first)."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False
    return remove_sorted


def sorted_best_first(values: np.ndarray) -> torch.Tensor:
    """1-D values sorted largest first (numpy's SIMD sort of values: gpt2's 50,257 in ~1 ms, torch.sort ~4)."""
    return torch.from_numpy(-np.sort(-values))


MARGIN = 1e-6  # > 3 * 2^-24: how far past p the candidates' mass must be for every later token to be removed for sure
SLACK = 1e-5  # how far past p the binades' mass (summed in another order) is asked to reach


def _nucleus_from_binades(row: np.ndarray, p: float) -> float | None:
    """The smallest kept probability of one row's nucleus (the torch.sort path's cut), or None where that path must
    decide (equal probabilities on both sides of the cut, a cut that is not one run because of rounding, NaN).
    The probabilities are summed per binade (their exponent field), best first, to the first binade where the mass
    passes p; only those candidates are sorted (best first probabilities are the sequence the torch.sort path gathers
    in the logits' order: softmax is monotone). Their cumulative mass, torch's cumsum as that path takes it, must pass
    p by MARGIN, so the mass before any later token, in float32, is >= p: they are removed. Else the whole row is
    sorted."""
    shift, top_exponent = (23, 254) if row.dtype == np.float32 else (52, 2046)
    binade = top_exponent - (row.view(np.int32 if row.dtype == np.float32 else np.int64) >> shift)
    if binade.min() < 0:  # NaN or infinity (softmax of an infinite logit)
        return None
    reach = np.cumsum(np.bincount(binade, weights=row))  # mass of the binades, best first
    last = int(np.searchsorted(reach, p + SLACK))  # the first binade where it passes p
    top = sorted_best_first(row[binade <= last])
    if len(top) < len(row) and not float(top.cumsum(0)[-1]) >= p + MARGIN:
        top = sorted_best_first(row)
    remove_sorted = _beyond_nucleus(top, p)
    n_keep = len(top) - int(remove_sorted.sum())
    if not torch.equal(remove_sorted, torch.arange(len(top)) >= n_keep):
        return None
    if n_keep < len(top) and top[n_keep] == top[n_keep - 1]:  # (all kept: the tokens after them are smaller)
        return None
    return float(top[n_keep - 1])


def _top_p_from_the_top(logits: torch.Tensor, p: float) -> torch.Tensor:
    """top_p_filter on the CPU without sorting every row: each row's cut from its largest probabilities
    (_nucleus_from_binades), the kept tokens those at or above the smallest kept probability; where a row needs
    torch.sort's order, the torch.sort path. gpt2's 50,257 logits on a Zen 4: 0.3-0.6 ms a row for nuclei of 1 to
    5,545 tokens, 1.6 ms for a flat row's 30,680, against ~2 ms sorting the row's values and ~4 ms through
    torch.sort."""
    probs = logits.softmax(dim=-1)
    rows = probs.detach().reshape(-1, logits.shape[-1]).numpy()
    smallest = [_nucleus_from_binades(row, p) for row in rows]
    if None in smallest:
        return top_p_filter(logits, p, fast_sort=False)
    smallest_kept = torch.tensor(smallest, dtype=probs.dtype).view(*probs.shape[:-1], 1)
    return logits.masked_fill(probs < smallest_kept, float("-inf"))


def process_logits(logits: torch.Tensor, seen: torch.Tensor | None = None, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0) -> torch.Tensor:
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, repetition_penalty)
    if temperature != 1.0:
        logits = logits / temperature
    return top_p_filter(top_k_filter(logits, top_k), top_p)


def check_request(model, input_ids, attention_mask, max_new_tokens, repetition_penalty, what="generation") -> None:
    """Checks every decoder (this module's and beam search) makes: prompt shape, sizes, context, left padding."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, prompt_len) with prompt_len >= 1, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    total = input_ids.shape[1] + max_new_tokens
    if total > model.config.n_positions:
        raise ValueError(f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds the "
                         f"context of n_positions={model.config.n_positions}; shorten the prompt or generate fewer tokens")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError(f"prompts must be left-padded for {what} (a row's last token is padding); "
                             "set tokenizer.padding_side = 'left'")


def _check_sampling(temperature, top_k, top_p) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use do_sample=False for greedy decoding), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class Prefill(NamedTuple):
    """Where every decoder (generate, beam search) starts: the prompt run once, and what the steps then need."""
    hidden: torch.Tensor  # (B, C): the last prompt token's final hidden state
    cache: KVCache  # the prompt's keys and values, with room for the new tokens
    positions: torch.Tensor  # (B, T + new): positions of prompt and new tokens (new tokens are always real)
    key_mask: torch.Tensor | None  # (B, 1, 1, T + new): keys a step may attend; None without padding (SDPA skips it)
    seen: torch.Tensor | None  # (B, V) bool: tokens in each prompt, for a repetition penalty (None without one)
    pad: int  # what follows a finished row: pad_token_id, else eos_token_id, else 0
    step: str | None  # why these rows cannot take the C++ decode step (fast_step.why_not; None: they can)


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
            repetition_penalty: float = 1.0, eos_token_id: int | None = None,
            pad_token_id: int | None = None, quantize: str | None = None,
            found: fast_step.Walk | None = None) -> Prefill:
    """Run a checked, left-padded request's prompts through `model` (in eval mode) into a new KV cache, and set up
    the masks, positions and repetition-penalty bookkeeping of the decoding steps. A long prompt's blocks run on the
    thread count that timed fastest (prompt_threads; quantize names the weights' form for its memory). found: the
    caller's fast_step.walk(model) (else one is made here)."""
    with torch.no_grad():  # in the body: mutmut 3 does not mutate decorated functions
        body = model.gpt
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = torch.cat([attention_mask.long(), attention_mask.new_ones(B, max_new_tokens).long()], dim=1)
        positions = position_ids_from_mask(mask)
        key_mask = None if bool(attention_mask.bool().all()) else mask.bool()[:, None, None, :]
        seen = None
        if repetition_penalty != 1.0:
            real = attention_mask.bool()
            # a padding slot names the row's last token (always real), so no slot writes False over a real token
            prompt_tokens = torch.where(real, input_ids, input_ids[:, -1:])
            seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=input_ids.device)
            seen.scatter_(1, prompt_tokens, True)
        cache = body.new_cache(B, T + max_new_tokens, reuse=True)  # the last call's buffers where it had this shape
        found = found if found is not None else fast_step.walk(model)
        # The prompt goes through the checked forward (a short one, of a plain GPT-2 on the CPU: the checks, then
        # one C++ call, models/fast_step.py); each step then takes the lean path (inputs made here).
        step, hidden = fast_step.why_not(model, B, key_mask, cache, found), None
        if fast_step.prompt_why_not(model, input_ids, key_mask, cache, step) is None:
            body._check_inputs(input_ids, None, None)
            with short_prompt_threads(model, B, quantize, found):
                hidden = fast_step.FastPrompt(model, T)(input_ids, cache)  # None: activations int8 cannot take
        if hidden is None:  # a prompt too short to time its blocks takes the decode steps' count while busy
            timed = prompt_is_timed(model, B * T, found)
            with prompt_threads(model, B * T, quantize, found) if timed else \
                    short_prompt_threads(model, B, quantize, found):
                hidden = body(input_ids, mask[:, :T], positions[:, :T], cache,
                              use_cache=True)["last_hidden_state"][:, -1]
        pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
        return Prefill(hidden, cache, positions, key_mask, seen, pad, step)


def mark_seen(seen: torch.Tensor, next_ids: torch.Tensor) -> None:
    """Each row's new token joins the tokens its repetition penalty applies to."""
    seen[torch.arange(len(next_ids), device=next_ids.device), next_ids] = True


# The decode step's LM head reads the whole (V, C) embedding for a few rows: bound by how fast the weights stream,
# so each batch size takes the kernel that streamed fastest on CPUs (docs/performance.md, "Figures behind the code");
# same products, other kernels: the outputs agree to fp32 rounding.


def decode_lm_head(body, batch_size: int, quantize: str | None = None):
    """hidden (B, C) -> logits (B, V) for the decode loop, in the layout that streams the weights fastest
    (quantize="int8" or "int4" at batch 1: from a quantized copy of the head, kept on the body; the embedding lookup
    stays as it is)."""
    weight, softcap = body.lm_head_weight, body.logit_softcap  # softcap: nn.Identity unless the config caps logits
    if quantize is not None and batch_size == 1:
        (head,) = cached_copies([("the LM head", body, weight)], quantize, "_quantized_head")
        call = prepared_quantized(head)
        if call is not None:
            return lambda hidden: softcap(call(hidden) if hidden.dtype == torch.float32 and hidden.is_contiguous()
                                          else quantized_linear(hidden, head))
        return lambda hidden: softcap(quantized_linear(hidden, head))
    if weight.device.type != "cpu":
        return body.hidden_state_to_token
    if row_kernel.pays(weight.dtype, batch_size) and row_kernel.available() and weight.is_contiguous():
        call = row_kernel.prepared(weight.detach(), rows=batch_size)  # once per decode call, like the layers'
        return lambda hidden: softcap(row_kernel.run(call, hidden))
    if batch_size > 1:
        if takes_prompt_kernel(batch_size, weight.dtype, weight):
            return lambda hidden: softcap(row_kernel.chunked_linear(hidden, weight.detach()))  # 9+ rows: its tiles
        return lambda hidden: softcap(weight_first(hidden, weight))  # (V, C) @ (C, B) -> (B, V)
    views = row_blocks(weight.detach(), None, torch.get_num_threads())  # one block of V's rows per thread
    return body.hidden_state_to_token if views is None else lambda hidden: softcap(blocked_product(hidden, views))


def _size(model, found: fast_step.Walk | None) -> int:
    """The model's parameter count (the threads' memory's key): from the caller's walk where it has one."""
    return found.size if found is not None else sum(p.numel() for p in model.parameters())


def _on_cpu(model, found: fast_step.Walk | None) -> bool:
    """Whether the model's (first) parameter is on the CPU, where torch's thread count is the decode's."""
    return found.first_cpu if found is not None else next(model.parameters()).is_cpu


@contextlib.contextmanager
def evaluating(model, found: fast_step.Walk | None = None):
    """model.eval() within the block, model.train(its mode before) after it, as a decode call needs; where no module
    is in training mode, nothing to do (each of the two walks over gpt2's 189 modules took about 1 ms a call).
    found: fast_step.walk(model) from before the block, where the caller has it."""
    training = found.training if found is not None else any(module.training for module in model.modules())
    was_training = model.training
    if training:
        model.eval()
    try:
        yield model
    finally:
        if training:
            model.train(was_training)


@contextlib.contextmanager
def closing_threads(model, rows: int, quantize: str | None = None, found: fast_step.Walk | None = None):
    """A DecodeThreads for one decode loop of `rows` rows, restoring torch's thread count when the loop ends; one that
    changes nothing for a model off the CPU (torch's threads are the CPU's). found: the caller's walk(model)."""
    threads = DecodeThreads((rows, quantize, _size(model, found)), active=_on_cpu(model, found))
    try:
        yield threads
    finally:
        threads.close()


def prompt_is_timed(model, rows: int, found: fast_step.Walk | None = None) -> bool:
    """Whether a prompt of `rows` tokens in all has blocks long enough to time (PROMPT_MIN_FLOPS), on the CPU."""
    width = model.config.n_embd
    return _on_cpu(model, found) and 24 * rows * width * width >= PROMPT_MIN_FLOPS


@contextlib.contextmanager
def short_prompt_threads(model, rows: int, quantize: str | None = None, found: fast_step.Walk | None = None):
    """A short prompt's pass (too short to time: the C++ pass, or the layers' for a bf16 model, w8a8, padding) on the
    count the decode steps of `rows` rows learnt where the machine is still busy (models/decode_threads.py's
    short_prompt_threads); torch's count restored after."""
    n = decode_threads.short_prompt_threads((rows, quantize, _size(model, found))) \
        if decode_threads.remembers_fewer_threads() else None  # (quiet: no key to count)
    original = torch.get_num_threads()
    if n is not None and n != original:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != original:
            torch.set_num_threads(original)


@contextlib.contextmanager
def prompt_threads(model, rows: int, quantize: str | None = None, found: fast_step.Walk | None = None):
    """Each block of a long prompt's pass (`rows` tokens in all) on the thread count that timed fastest so far: a
    DecodeThreads stepped by hooks at each block's start and end (models/decode_threads.py); torch's count restored
    at the end. Prompts whose blocks are too short to time (PROMPT_MIN_FLOPS) and models off the CPU: nothing."""
    active = prompt_is_timed(model, rows, found)
    size = 1 << (rows - 1).bit_length()  # rows rounded up to a power of two: one remembered state per size class
    key = ("prompt", size, quantize, _size(model, found))
    threads = DecodeThreads(key, active=active, env=PROMPT_ENV, work=rows, first_period=LONGEST_PERIOD)
    hooks = []
    try:
        if threads.options:
            for layer in model.gpt.gpt_layers:
                hooks.append(layer.register_forward_pre_hook(lambda *_: threads.step()))
                hooks.append(layer.register_forward_hook(lambda *_: threads.stop()))
        yield threads
    finally:
        for hook in hooks:
            hook.remove()
        threads.close()


def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             repetition_penalty: float = 1.0, eos_token_id: int | None = None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None, quantize: str | None = None) -> torch.Tensor:
    """Continue each prompt by up to max_new_tokens tokens -> (B, prompt_len + new) LongTensor.

    Prompts of different lengths are left-padded (attention_mask 0 on the left). A row that emits eos_token_id
    is finished: later positions hold pad_token_id (default: eos_token_id). Decoding stops early once every row is
    finished. Sampling draws from `generator` when given, so a seeded generator repeats the same text.
    Beam search is models.beam_search.beam_search; GPT2LMHeadModel.generate(num_beams=N) chooses between the two.
    quantize="int8" or "int4": batch-1 decoding steps read weight-only copies of every linear layer and of the LM
    head (modules/quant.py; kept on the model for later calls): "int8" one scale per output row, a quarter of the
    fp32 weights; "int4" one scale per 32 inputs of a row (n_embd and every layer's inputs must be multiples of 32),
    about a sixth, read by modules/rows.cpp on x86 CPUs with AVX2 (elsewhere dequantized at each product, with a
    warning: correct, slow). "w8a8" and "w4a8": the same copies, and each product quantizes its input row to int8
    in blocks of 32 columns and multiplies in integers (faster on AVX2, int4 most; inputs multiples of 32), and
    their prompt (2 tokens or more) multiplies integers too, its activations quantized per tensor (up to 128 tokens
    in the C++ prompt pass's int8 GEMM, longer ones in oneDNN's); int8 / int4's prompt and batches keep the model's
    weights. Outputs are close to the model's own, not identical; int4's further than int8's (the quality of each:
    docs/cpu-decoding.md). The KV cache's buffers are kept on the model for the next call of the same shape
    (GPT2Model.keep_cache).
    """
    with torch.no_grad():  # in the body: mutmut 3 does not mutate decorated functions
        check_request(model, input_ids, attention_mask, max_new_tokens, repetition_penalty)
        if quantize is not None and quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be None or one of {QUANTIZE_MODES}, got {quantize!r}")
        _check_sampling(temperature, top_k, top_p)
        if max_new_tokens == 0:  # nothing to decode: no forward pass for the prompt
            return input_ids.clone()
        body = model.gpt
        B, T = input_ids.shape
        finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        lm_head = decode_lm_head(body, B, quantize)
        quantized = contextlib.ExitStack()  # eval mode, quantized layers, prepared kernel products: this call only
        cache = None
        found = fast_step.walk(model)  # what the checks below read of the model, in one walk
        try:
            quantized.enter_context(evaluating(model, found))
            if quantize is not None:
                quantized.enter_context(quantized_weights(model, quantize, found.linears))
            hidden, cache, positions, key_mask, seen, pad, step_why_not = prefill(
                model, input_ids, attention_mask, max_new_tokens, repetition_penalty, eos_token_id, pad_token_id,
                quantize, found)
            out = torch.full((B, T + max_new_tokens), pad, dtype=torch.long, device=input_ids.device)
            out[:, :T] = input_ids
            fast = None
            if max_new_tokens > 1:  # decode steps follow the first token (a 16-token prompt's call: 2.7 ms of 50 went
                # to making a step it never took). A batch on the CPU (1-8 rows; fp32: more), plain GPT-2: each step
                # in one C++ call (models/fast_step.py); else the steps go through the layers, products prepared once
                if step_why_not is None:
                    fast = fast_step.FastStep(model, cache, key_mask)
                else:
                    quantized.enter_context(prepared_rows(model, B))
            # the steps' thread count, chosen by timing them (models/decode_threads.py)
            threads = quantized.enter_context(closing_threads(model, B, quantize, found))
            for step in range(max_new_tokens):
                threads.step()
                # bf16 models give bf16 logits: filters and sampling work in fp32.
                logits = process_logits(lm_head(hidden).float(), seen, temperature if do_sample else 1.0,
                                        top_k if do_sample else None, top_p if do_sample else None, repetition_penalty)
                if do_sample:
                    # torch.multinomial's token, drawn without its 50,257 logarithms (modules/draw.py)
                    next_ids = draw.multinomial(F.softmax(logits, dim=-1), generator)
                else:
                    next_ids = logits.max(dim=-1).indices  # argmax, first index on ties; 3x faster on a CPU
                if eos_token_id is not None:
                    next_ids = next_ids.masked_fill(finished, pad)
                    finished |= next_ids == eos_token_id
                out[:, T + step] = next_ids
                if seen is not None:
                    mark_seen(seen, next_ids)
                if step == max_new_tokens - 1 or eos_token_id is not None and bool(finished.all()):
                    return out[:, : T + step + 1]
                pos = T + step
                step_mask = key_mask[..., : pos + 1] if key_mask is not None else None
                if fast is not None:
                    hidden = fast(next_ids, positions[:, pos])
                else:
                    hidden = body.decode_step(next_ids[:, None], positions[:, pos: pos + 1], step_mask, cache)
            return out
        finally:
            quantized.close()
            if cache is not None:
                body.keep_cache(cache)  # read by no one now: its buffers serve the next call
