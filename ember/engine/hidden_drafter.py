"""Drafters that read the target's hidden states: `eagle3` (an EAGLE-3 head, its own
checkpoint) and `mtp` (the model's own multi-token-prediction layer, DeepSeek-V3).

A head at position p reads the token at p + 1 and a state of the target at p, and
predicts the token at p + 2. So each target step hands the proposer its rows of what
the head reads (`ModelRunner.features`: the head's `combine` of the target's hidden
states), and a round of proposals for a request whose tokens are t[0..n-1], of which
the target has computed n - 1, is:
    catch up: one pass over the positions the target computed since the last round (the
      first time, the whole prompt), token t[p + 1] and the target's state at p each;
      its last row (position n - 2) yields the first draft
    -> K - 1 passes of one row each, at n - 1, n, ...: the previous draft and the
      head's own output at the position before, each yielding the next draft.
Rows the target computed for drafts it then rejected are dropped; the head's KV at the
positions it drafted on its own is overwritten by the next round's catch-up. A greedy
request's drafts are the head's argmax; a random request's, the head's draws with the
noise the target's draw at the same position uses (as the draft model's: draft_model).

The head's KV cache is one layer indexed by the target's block table (the same block
ids, in tensors of its own), so it needs no block manager: blocks come and go with the
target's, and a request that finds its prefix in the target's cache finds the head's KV
of it there too. The slots of its own drafting positions are reserved in the target's
block table ahead of the scheduler (they are the slots the drafts' verification uses).
The head's KV of a block is not in the tiers or a PD handover: a block restored from
there, or a prompt prefilled elsewhere, leaves the head's keys and values at those
positions stale, which lowers acceptance, never correctness (the target verifies).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ember.config import EngineConfig
from ember.engine.kv_cache import KVCacheManager
from ember.engine.model_runner import ModelRunner
from ember.engine.request import Request
from ember.engine.sampler import position_noise, random_probs
from ember.engine.speculative import Proposer
from ember.engine.step_inputs import Rows, batch_inputs
from ember.kv import buffers as kv_buffers
from ember.model_config import ModelConfig

logger = logging.getLogger("ember.engine")


class HiddenStateProposer(Proposer):
    """Drafts with `head` (ember.models.eagle3.Eagle3ForCausalLM or
    ember.models.deepseek_v3.MTPDraftHead) over its one-layer KV cache `kv_caches`."""

    def __init__(
        self,
        head: nn.Module,
        kv: KVCacheManager,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        vocab_size: int,
        on_close=None,
    ) -> None:
        self.head, self.kv, self.kv_caches, self.device = head, kv, kv_caches, device
        self.vocab_size = vocab_size  # the target's logits, each draw's noise
        self._on_close = on_close
        # the target's rows not yet read by the head: (first position, rows) in order
        self._pending: weakref.WeakKeyDictionary[Request, list[tuple[int, torch.Tensor]]] = (
            weakref.WeakKeyDictionary()
        )

    def close(self) -> None:
        self.kv_caches = []
        if self._on_close is not None:
            self._on_close()

    def forget(self, request: Request) -> None:
        self._pending.pop(request, None)

    def lag(self, request: Request) -> int:
        _, run = _last_run(self._pending.get(request, []), request.num_computed_tokens)
        return sum(len(rows) for rows in run)

    def take_features(self, request: Request, start: int, rows: torch.Tensor) -> None:
        pending = self._pending.setdefault(request, [])
        # rows from `start` on replace any pending there (computed again: preemption)
        while pending and pending[-1][0] >= start:
            pending.pop()
        if pending:
            first, last = pending[-1]
            pending[-1] = (first, last[: start - first])
        pending.append((start, rows))

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        decodes, prefills = [], []  # the catch-up pass, one-row sequences first
        for request, k in zip(requests, num_tokens, strict=True):
            entry = self._catch_up(request, k) if k > 0 else None
            if entry is not None:
                (decodes if len(entry.rows.tokens) == 1 else prefills).append(entry)
        batch = decodes + prefills
        if not batch:
            return [[] for _ in requests]
        hidden = torch.cat([entry.hidden for entry in batch])
        rows = [entry.rows for entry in batch]
        last = self._run(rows[: len(decodes)], rows[len(decodes) :], hidden)
        step = 1
        while True:
            tokens = self._draw(last, [entry.request for entry in batch], step - 1)
            for entry, token in zip(batch, tokens, strict=True):
                drafts[entry.request.request_id].append(token)
            keep = [i for i, entry in enumerate(batch) if entry.k > step]
            if not keep:
                break
            batch, last = [batch[i] for i in keep], last[keep]
            # the next draft's row: the one just drafted, after the last row
            rows = [
                Rows(
                    [tokens[i]], entry.request.num_computed_tokens - 1 + step, entry.rows.block_ids
                )
                for i, entry in zip(keep, batch, strict=True)
            ]
            last = self._run(rows, [], last)
            step += 1
        return [drafts[r.request_id] for r in requests]

    def _catch_up(self, request: Request, k: int) -> _CatchUp | None:
        """The request's catch-up, or None when the target computed nothing the head
        has not read (no drafts then)."""
        end = request.num_computed_tokens
        start, run = _last_run(self._pending.pop(request, []), end)
        if not run:
            return None
        hidden = torch.cat(run)
        # drafting on past the known tokens takes slots beyond them; with none free,
        # one draft (the catch-up's own row needs none)
        if k > 1 and self.kv.allocate_slots(request, 0, cache=False, num_lookahead=k - 1) is None:
            k = 1
        tokens = request.token_ids[start + 1 : end + 1]
        return _CatchUp(
            request, k, Rows(tokens, start, self.kv.block_ids(request.request_id)), hidden
        )

    def _draw(self, prenorm: torch.Tensor, requests: list[Request], ahead: int) -> list[int]:
        """The draft of each row (a target token id), `ahead` past the requests' known
        tokens: greedy, or a random request's draw with the noise the target's draw at
        that position will use (ember.engine.sampler.position_noise)."""
        logits = self.head.draft_logits(prenorm).float()
        tokens = logits.argmax(dim=-1)  # indices into the head's vocabulary
        drawn = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if drawn:
            ids = self.head.draft_ids  # each logit's target token id (None: the same)
            probs = random_probs(logits[drawn], [requests[i] for i in drawn])
            for row, i in zip(probs, drawn, strict=True):
                request = requests[i]
                position = request.num_tokens + ahead
                noise = position_noise(request.seed, position, self.vocab_size, row.device)
                noise = noise if ids is None else noise[ids]
                tokens[i] = (row / noise).argmax()
        return self.head.target_ids(tokens).tolist()

    def _run(self, decodes: list[Rows], prefills: list[Rows], hidden: torch.Tensor):
        """The head's output (before its norm) at each sequence's last row."""
        ids, positions, meta, sample_idx = batch_inputs(
            decodes, prefills, self.kv.block_size, self.device
        )
        out = self.head(ids, positions, self.kv_caches, meta, hidden)
        self.num_passes += 1
        self.num_rows += len(ids)
        return out[sample_idx]


def _last_run(pending: list[tuple[int, torch.Tensor]], end: int) -> tuple[int, list[torch.Tensor]]:
    """The last contiguous run of the `pending` rows before position `end` (the
    target's states from there on were of drafts), and its first position."""
    run: list[torch.Tensor] = []
    start = after = -1
    for first, rows in pending:
        rows = rows[: max(end - first, 0)]
        if not len(rows):
            continue
        if first != after:
            start, run = first, []  # a gap (states the target never handed over)
        run.append(rows)
        after = first + len(rows)
    return start, run


@dataclass
class _CatchUp:
    """A request's catch-up pass: `k` drafts wanted, the rows (each the token after the
    position) and the target's states at their positions."""

    request: Request
    k: int
    rows: Rows
    hidden: torch.Tensor


def eagle3_proposer(
    config: EngineConfig, target: ModelRunner, kv: KVCacheManager, max_model_len: int
) -> HiddenStateProposer:
    """An EAGLE-3 head from `config.speculative_model` over `target`'s hidden states."""
    from ember.loader.checkpoint import open_checkpoint
    from ember.loader.default_models import resolve_model
    from ember.models.eagle3 import Eagle3ForCausalLM
    from ember.models.llama import LlamaModel

    checkpoint = open_checkpoint(resolve_model(config.speculative_model))
    head_config = ModelConfig.from_hf(checkpoint.hf_config)
    model = target.model_config
    if head_config.eagle is None:
        raise ValueError(
            f"speculative_model {config.speculative_model!r} is not an EAGLE-3 head "
            f"(architectures {head_config.architecture!r})"
        )
    stack = getattr(target.model, "model", None)
    if not isinstance(stack, LlamaModel):
        raise ValueError(f"speculative_method 'eagle3' does not support {model.architecture}")
    layers = head_config.eagle.target_layers(model.num_hidden_layers)
    if head_config.vocab_size != model.vocab_size or head_config.hidden_size != model.hidden_size:
        raise ValueError(
            f"speculative_model: the EAGLE-3 head is for a model with a vocabulary of "
            f"{head_config.vocab_size} and hidden size {head_config.hidden_size}; this one "
            f"has {model.vocab_size} and {model.hidden_size}"
        )
    if head_config.eagle.target_hidden_size != model.hidden_size or not all(
        0 <= i <= model.num_hidden_layers for i in layers
    ):
        raise ValueError(
            f"speculative_model: the EAGLE-3 head reads layers {list(layers)} of hidden size "
            f"{head_config.eagle.target_hidden_size}; the model has {model.num_hidden_layers} "
            f"layers of {model.hidden_size}"
        )
    # drafts need only be likely, not exact: on CPU the head's weights default to bf16
    # (half the bytes each of its passes reads; its lm_head alone is most of them)
    dtype = "bfloat16" if config.dtype == "auto" and target.device.type == "cpu" else config.dtype
    head_engine = dataclasses.replace(
        config, model=config.speculative_model, speculative_method=None,
        speculative_model=None, kv_cache_memory=None, kv_role="mixed", dtype=dtype,
    )  # fmt: skip
    runner = ModelRunner(head_engine, head_config, checkpoint, max_model_len, Eagle3ForCausalLM)
    head = runner.model
    head.share_embedding(stack.embed_tokens.weight)
    runner.allocate_kv_cache(kv.num_blocks)
    stack.capture_layers = frozenset(layers)
    target.features = lambda _: head.combine(torch.cat(stack.captured, dim=-1))
    logger.info("EAGLE-3 head %s over layers %s", config.speculative_model, sorted(layers))
    return HiddenStateProposer(
        head, kv, runner.kv_caches, runner.device, model.vocab_size, runner.free_kv_cache
    )


def mtp_proposer(target: ModelRunner, kv: KVCacheManager) -> HiddenStateProposer:
    """The target's first multi-token-prediction layer as the drafter."""
    from ember.models.deepseek_v3 import MTPDraftHead

    if not getattr(target.model, "mtp", None):
        raise ValueError(
            "speculative_method 'mtp' needs a model with multi-token-prediction layers "
            "(DeepSeek-V3 or Kimi K2 checkpoints with num_nextn_predict_layers); "
            f"{target.config.model} has none"
        )
    head = MTPDraftHead(target.model)
    shape = target.kv_spec.shape(kv.num_blocks, target.block_size)
    kv_caches, _ = kv_buffers.allocate(shape, 1, target.kv_dtype, target.device, shm=False)
    target.features = head.combine
    logger.info("MTP drafter: the model's multi-token-prediction layer")
    return HiddenStateProposer(head, kv, kv_caches, target.device, target.model_config.vocab_size)
