"""Beam search for GPT2LMHeadModel: batched prompts with left padding, one KV-cache row per beam, reordered each step.

    ids = beam_search(lm, prompt_ids, prompt_mask, num_beams=4, max_new_tokens=40, eos_token_id=50256)

The semantics are those of transformers' `generate(num_beams=N, do_sample=False)`, so the two agree token for token
(tests/test_beam_search.py checks it):
- Each step scores every continuation of every live beam by its summed log-probability and keeps the 2N best
  candidates of each prompt. The N best that do not end become the next live beams (at most one candidate per beam
  is EOS, so N always remain).
- A candidate ends by emitting `eos_token_id` or by reaching `max_new_tokens`. If it ranks among the step's N best
  candidates it joins the prompt's N finished hypotheses, scored sum_logprobs / new_len ** length_penalty, where
  new_len counts the new tokens (EOS included). length_penalty > 0 favours longer outputs, < 0 shorter ones.
- `early_stopping`: True: a prompt is done once it holds N finished hypotheses. False (HF's default): also once the
  best live beam, scored at the current length, does not beat the worst finished one (a heuristic: with
  length_penalty > 0 a longer continuation could still win). "never": the bound uses max_new_tokens when
  length_penalty > 0, so no better hypothesis is missed for lack of steps (the search is still limited by its width).
- `repetition_penalty` acts on the log-probabilities, as HF's logits processors do inside beam search.

The result is each prompt's best finished hypothesis: (B, prompt_len + L) where L is the longest of them; positions
after a row's EOS hold `pad_token_id` (default: the EOS id). With num_beams=1 and no EOS this is greedy decoding.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from models import fast_step
from models.generation import (
    apply_repetition_penalty,
    check_request,
    closing_threads,
    decode_lm_head,
    evaluating,
    mark_seen,
    prefill,
)
from modules.linear import prepared_rows

EARLY_STOPPING = (False, True, "never")


def _check_beam_args(num_beams, length_penalty, early_stopping) -> None:
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive integer, got {num_beams!r}")
    if not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}")


def beam_search(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, num_beams: int = 4,
                max_new_tokens: int = 20, eos_token_id: int | None = None, pad_token_id: int | None = None,
                length_penalty: float = 1.0, early_stopping: bool | str = False,
                repetition_penalty: float = 1.0) -> torch.Tensor:
    """Best beam-search continuation of each (left-padded) prompt -> (B, prompt_len + L) LongTensor; see the module
    docstring for the scoring and stopping rules."""
    with torch.no_grad():  # in the body: mutmut 3 does not mutate decorated functions
        check_request(model, input_ids, attention_mask, max_new_tokens, repetition_penalty, what="beam search")
        _check_beam_args(num_beams, length_penalty, early_stopping)
        if max_new_tokens == 0:
            return input_ids.clone()
        body, N, V = model.gpt, num_beams, model.config.vocab_size
        device = input_ids.device
        B, T = input_ids.shape
        K = min(2 * N, N * V)  # candidates kept per prompt and step
        top_n = torch.arange(K, device=device) < N  # only the step's N best candidates may finish
        prompt = torch.arange(B, device=device)[:, None]  # (B, 1) for indexing (B, K) tables
        rows = torch.arange(B, device=device).repeat_interleave(N)  # beam row -> its prompt

        prepared = contextlib.ExitStack()  # eval mode; the decode steps' kernel products, prepared once for this call
        found = fast_step.walk(model)  # what the checks below read of the model, in one walk
        try:
            prepared.enter_context(evaluating(model, found))
            # The prompt runs once per prompt; its cache rows, positions, masks and seen tokens are then copied per beam.
            hidden, cache, positions, key_mask, seen, pad, _ = prefill(model, input_ids, attention_mask, max_new_tokens,
                                                                       repetition_penalty, eos_token_id, pad_token_id,
                                                                       found=found)
            cache.reorder(rows)
            hidden, beam_positions = hidden[rows], positions[rows]  # (B*N, C), (B*N, T + new)
            key_mask = key_mask[rows] if key_mask is not None else None  # (B*N, 1, 1, T + new)
            seen = seen[rows] if seen is not None else None
            lm_head = decode_lm_head(body, hidden.shape[0])
            # the beam rows on the CPU (1-8; fp32: more), plain GPT-2: each step in one C++ call (models/fast_step.py)
            fast = None
            if fast_step.why_not(model, B * N, key_mask, cache, found) is None:
                fast = fast_step.FastStep(model, cache, key_mask)
            else:  # the steps go through the layers
                prepared.enter_context(prepared_rows(model, B * N))

            seqs = torch.full((B, N, T + max_new_tokens), pad, dtype=torch.long, device=device)
            seqs[:, :, :T] = input_ids[:, None]
            scores = torch.zeros(B, N, device=device)
            scores[:, 1:] = float("-inf")  # all beams start as the same prompt: only the first is live, or beams would repeat
            fin_seqs, fin_scores = seqs.clone(), torch.full((B, N), float("-inf"), device=device)  # sorted, best first
            fin_len = torch.zeros(B, N, dtype=torch.long, device=device)
            done = torch.zeros(B, dtype=torch.bool, device=device)
            threads = prepared.enter_context(closing_threads(model, hidden.shape[0], found=found))
            for step in range(max_new_tokens):
                threads.step()
                new_len, last = step + 1, step == max_new_tokens - 1
                logp = F.log_softmax(lm_head(hidden).float(), dim=-1)  # (B*N, V)
                if seen is not None:
                    logp = apply_repetition_penalty(logp, seen, repetition_penalty)
                top, index = (scores.view(-1, 1) + logp).view(B, N * V).topk(K, dim=1)  # (B, K), best first
                beam, token = index // V, index % V
                cand = seqs[prompt, beam]  # (B, K, T + new)
                cand[:, :, T + step] = token
                ends = torch.full_like(token, last, dtype=torch.bool)
                if eos_token_id is not None:
                    ends |= token == eos_token_id

                # Finished hypotheses: merge this step's ending candidates into the N best so far.
                finishing = ends & top_n & ~done[:, None] & torch.isfinite(top)
                merged = torch.cat([fin_scores, torch.where(finishing, top / new_len ** length_penalty, float("-inf"))], 1)
                fin_scores, keep = merged.topk(N, dim=1)
                fin_seqs = torch.cat([fin_seqs, cand], dim=1)[prompt, keep]
                fin_len = torch.cat([fin_len, torch.full_like(token, new_len)], dim=1).gather(1, keep)
                if last:
                    break

                # Live beams: the N best candidates that do not end.
                scores, pick = top.masked_fill(ends, float("-inf")).topk(N, dim=1)
                seqs = cand[prompt, pick]
                source = (prompt * N + beam.gather(1, pick)).view(-1)  # the beam row each new beam continues
                next_ids = token.gather(1, pick).view(-1)

                full = torch.isfinite(fin_scores).all(dim=1)
                if early_stopping is True:
                    done |= full
                else:
                    bound_len = max_new_tokens if early_stopping == "never" and length_penalty > 0 else new_len
                    done |= full & (scores[:, 0] / bound_len ** length_penalty <= fin_scores[:, -1])
                if bool(done.all()):
                    break

                cache.reorder(source)
                if seen is not None:
                    seen = seen[source]
                    mark_seen(seen, next_ids)
                pos = T + step
                step_mask = key_mask[..., : pos + 1] if key_mask is not None else None
                if fast is not None:  # reads the cache's buffers as reorder left them
                    hidden = fast(next_ids, beam_positions[:, pos])
                else:
                    hidden = body.decode_step(next_ids[:, None], beam_positions[:, pos: pos + 1], step_mask, cache)
            return fin_seqs[:, 0, : T + int(fin_len[:, 0].max())]
        finally:
            prepared.close()
