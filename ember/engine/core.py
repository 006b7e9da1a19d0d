"""The engine core: scheduler + KV-cache manager + model runner, driven by `step()`.

Knows token ids only (no text, no HTTP). Life cycle: built once (loads the model,
sizes and allocates the KV cache), then `add_request` / `abort_requests` at any time
and `step()` in a loop while `has_unfinished()`; each step returns the new tokens of
every request that got one, and marks those that finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ember.config import EngineConfig, ModelConfig
from ember.engine.kv_cache import KVCacheManager
from ember.engine.model_runner import ModelRunner
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler
from ember.loader.checkpoint import Checkpoint

logger = logging.getLogger("ember.engine")


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_queued_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class EngineCore:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, checkpoint: Checkpoint
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.max_model_len = resolve_max_model_len(config, model_config)
        start = time.perf_counter()
        self.runner = ModelRunner(config, model_config, checkpoint, self.max_model_len)
        num_blocks = self.runner.kv_cache_budget() // self.runner.kv_block_bytes
        min_blocks = -(-self.max_model_len // config.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory fits {num_blocks} blocks of {config.block_size} tokens, "
                f"fewer than one sequence of max_model_len={self.max_model_len} needs "
                f"({min_blocks}); raise kv_cache_memory or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len
        )
        logger.info("engine ready in %.2f s", time.perf_counter() - start)

    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[EngineCoreOutput]:
        sched_out = self.scheduler.schedule()
        if sched_out.empty:
            return []
        step = self.runner.execute(sched_out)
        sampled = dict(zip(step.request_ids, step.sampled.token_ids, strict=True))
        logprobs = dict(zip(step.request_ids, step.sampled.logprobs, strict=True))
        updated, _ = self.scheduler.update(sched_out, sampled)
        outputs = []
        for update in updated:
            request = update.request
            entry = logprobs[request.request_id]
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=update.new_token_ids,
                    new_logprobs=None if entry is None else [entry],
                    finish_reason=request.status.value if request.status.finished else None,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        return outputs

    def stats(self) -> EngineStats:
        sched = self.scheduler
        queued = sum(
            max(r.num_prompt_tokens - r.num_computed_tokens, 0)
            for r in list(sched.waiting) + sched.running
        )
        return EngineStats(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_queued_prefill_tokens=queued,
            kv_blocks_used=self.kv_cache.num_blocks - self.kv_cache.num_free_blocks,
            kv_blocks_total=self.kv_cache.num_blocks,
            prefix_cache_queries=self.kv_cache.stats.queries,
            prefix_cache_hits=self.kv_cache.stats.hits,
        )


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context length served: the model's, capped by the user's and by a sliding window
    (attention over a window is not implemented, so sequences never outgrow it)."""
    limit = model_config.max_position_embeddings
    if model_config.sliding_window is not None:
        limit = min(limit, model_config.sliding_window)
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context of {limit}"
            )
        limit = config.max_model_len
    return limit
