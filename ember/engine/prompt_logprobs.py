"""Log-probabilities of prompt tokens: vLLM's `prompt_logprobs`, and what `echo` with
`logprobs` on /v1/completions returns (evaluation harnesses score text this way).

A request that asks for them computes every prompt token: the scheduler gives it no
prefix-cache hit until they are all collected. Each step that computes a chunk of its
prompt reads the logits at the chunk's positions:

    prompt tokens:   t0     t1     t2    ...   t[P-2]    t[P-1]
    logits at:       0      1      2     ...   P-2       P-1
                     '->t1  '->t2  '->t3       '->t[P-1] '-> the first output token

so position q gives the logprob of token q + 1, and token 0 has none. The entries
collect on the request across chunks (a preempted request recomputing its prompt adds
only the positions it lacks) and go out with its first output token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember.engine.messages import PromptLogprobs

if TYPE_CHECKING:
    from ember.engine.scheduler import ScheduledRequest

MAX_ROWS = 256  # logits rows computed at once: a [256, vocab] fp32 block


def compute_prompt_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, batch: list[ScheduledRequest]
) -> dict[str, PromptLogprobs]:
    """The new prompt logprobs of each request in `batch` (laid out in `hidden` one after
    another, `num_new_tokens` rows each and a row per draft) that still lacks some."""
    out: dict[str, PromptLogprobs] = {}
    offset = 0
    for sched in batch:
        request, start = sched.request, sched.start
        if request.needs_prompt_logprobs:
            done = len(request.prompt_logprobs.entries)
            first, end = (
                max(start, done),
                min(start + sched.num_new_tokens, request.num_prompt_tokens - 1),
            )
            if first < end:
                rows = hidden[offset + first - start : offset + end - start]
                targets = request.prompt_token_ids[first + 1 : end + 1]
                num_top = request.sampling_params.prompt_logprobs
                out[request.request_id] = _logprobs(model, rows, targets, num_top)
        offset += sched.num_new_tokens + len(sched.spec_token_ids)
    return out


def _logprobs(
    model: torch.nn.Module, rows: torch.Tensor, targets: list[int], num_top: int
) -> PromptLogprobs:
    result = PromptLogprobs()
    for i in range(0, len(targets), MAX_ROWS):
        tokens = targets[i : i + MAX_ROWS]
        logprobs = torch.log_softmax(model.compute_logits(rows[i : i + MAX_ROWS]).float(), -1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
        result.ranks.extend(((logprobs > chosen).sum(-1) + 1).tolist())
        top_values, top_ids = logprobs.topk(num_top)  # num_top 0: empty rows
        for token, value, ids, values in zip(
            tokens, chosen.squeeze(1).tolist(), top_ids.tolist(), top_values.tolist(), strict=True
        ):
            entry = {token: value}
            for t, v in zip(ids, values, strict=True):
                entry.setdefault(t, v)
            result.entries.append(entry)
    return result
