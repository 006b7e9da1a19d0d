"""A step's model inputs from its scheduled rows: input ids, positions, the attention
metadata (slots, decode block tables and masks, prefill sequences) and the rows to sample;
also the largest step, for profiling memory. Built per sequence (slices and aranges),
never with a Python loop over a prefill's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.engine.attention import AttentionMetadata, PrefillSeq


@dataclass
class Rows:
    """One sequence's tokens in a step: `tokens` at positions `start`, `start + 1`, ...,
    with the KV blocks `block_ids`; `samples`: logits wanted (every row of a decode's,
    the last of a prefill's)."""

    tokens: list[int]
    start: int
    block_ids: list[int]
    samples: bool = True


def batch_inputs(decodes: list[Rows], prefills: list[Rows], block_size: int, device):
    """Input ids, positions, attention metadata and the rows to sample of a step.
    A decode's rows (its known token and its drafts) each attend to the context up to
    themselves; a prefill's are one sequence of the paged prefill."""
    bs = block_size
    input_ids, positions, slots, sample_idx, rows = [], [], [], [], []
    for seq in decodes:
        span = range(seq.start, seq.start + len(seq.tokens))
        if seq.samples:
            sample_idx += range(len(input_ids), len(input_ids) + len(seq.tokens))
        input_ids += seq.tokens
        positions += span
        slots += [seq.block_ids[p // bs] * bs + p % bs for p in span]
        rows += [(seq.block_ids, p + 1) for p in span]
    prefill_pos, prefill_slots, prefill_seqs = [], [], []
    for seq in prefills:
        start, num = seq.start, len(seq.tokens)
        input_ids += seq.tokens
        pos = torch.arange(start, start + num)
        table = torch.tensor(seq.block_ids)
        prefill_pos.append(pos)
        prefill_slots.append(table[pos // bs] * bs + pos % bs)
        prefill_seqs.append(PrefillSeq(len(input_ids) - num, num, start + num, table.to(device)))
        if seq.samples:
            sample_idx.append(len(input_ids) - 1)
    table, mask, lens = _decode_tables(rows, block_size, device)
    meta = AttentionMetadata(
        slot_mapping=torch.cat([torch.tensor(slots, dtype=torch.long), *prefill_slots]).to(device),
        num_decodes=len(rows),
        num_decode_seqs=len(decodes),
        decode_block_table=table,
        decode_mask=mask,
        decode_context_lens=lens,
        prefills=prefill_seqs,
    )
    positions_t = torch.cat([torch.tensor(positions, dtype=torch.long), *prefill_pos])
    ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    return (
        ids,
        positions_t.to(device),
        meta,
        torch.tensor(sample_idx, dtype=torch.long, device=device),
    )


def _decode_tables(rows: list[tuple[list[int], int]], block_size: int, device):
    """Block table, mask and context length of each decode row (block ids, context)."""
    if not rows:
        return None, None, None
    width = max(len(ids) for ids, _ in rows)
    table = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
    context = torch.tensor([n for _, n in rows])
    mask = decode_mask(context, width, block_size)
    return table.to(device), mask.to(device), context.to(device)


def decode_mask(context: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """[rows, 1, 1, width * block_size]: which slots of its blocks each decode row reads."""
    mask = torch.arange(width * block_size, device=context.device).unsqueeze(0)
    return (mask < context.unsqueeze(1))[:, None, None, :]


def profile_batch(num_tokens: int, max_model_len: int, block_size: int, device: torch.device):
    """The largest step: `num_tokens` of prompt as sequences of at most `max_model_len`
    (positions never pass the model's tables), each in blocks of its own.
    Returns (input_ids, positions, metadata, number of KV blocks it writes)."""
    prefills, positions, slots = [], [], []
    first_token = first_block = 0
    while first_token < num_tokens:
        n = min(max_model_len, num_tokens - first_token)
        num_blocks = -(-n // block_size)
        table = torch.arange(first_block, first_block + num_blocks, device=device)
        prefills.append(PrefillSeq(first_token, n, n, table))
        positions.append(torch.arange(n))
        slots.append(first_block * block_size + torch.arange(n))
        first_token += n
        first_block += num_blocks
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        num_decodes=0,
        decode_block_table=None,
        decode_mask=None,
        decode_context_lens=None,
        prefills=prefills,
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return ids, torch.cat(positions).to(device), meta, first_block
