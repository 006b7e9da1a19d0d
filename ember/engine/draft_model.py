"""The `draft` proposer: a smaller model with the target's tokenizer proposes drafts.

It runs in the engine core beside the target, on a `ModelRunner` of its own with its own
paged KV cache (as many blocks as the target's, so that whatever the target holds fits)
and its own block manager. Each request has a mirror `Request` on the draft's side,
whose tokens are the target's plus the drafts last proposed; the KV it has computed
stays valid up to where those tokens still equal the target's. Only blocks of the
target's own tokens become findable by prefix (a draft's KV is rolled back, and a
findable block must never change under its hash): a new request finds the draft KV of
an earlier one with the same prefix, as the target does.

A round of proposals, for the requests the speculator chose:
    catch up: one step over the target's tokens the draft has not computed (the first
      time the whole prompt, then the accepted drafts and the target's last token),
      which also yields the first draft token (greedy: the draft's argmax)
    -> K - 1 decode steps, each yielding the next draft token
A greedy request's drafts are the draft model's argmax. A random request's are the
draft model's own draws after the request's temperature, top-k, top-p and min-p, with
the noise the target's draw at the same position will use (the mirror has the request's
seed): the target keeps a draft where its own draw gives the same token
(`Sampler.verify`), which the shared noise makes likely wherever the two models'
distributions are near, and the output is the target's own draws whatever the drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from ember.config import EngineConfig
from ember.engine.kv_cache import KVCacheManager
from ember.engine.model_runner import ModelRunner
from ember.engine.request import Request
from ember.engine.scheduler import ScheduledRequest, SchedulerOutput
from ember.engine.speculative import Proposer
from ember.loader.checkpoint import open_checkpoint
from ember.model_config import ModelConfig
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.engine")

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer(Proposer):
    def __init__(
        self, config: EngineConfig, target: ModelConfig, max_model_len: int, num_blocks: int
    ) -> None:
        from ember.loader.default_models import resolve_model

        checkpoint = open_checkpoint(resolve_model(config.speculative_model))
        model_config = ModelConfig.from_hf(checkpoint.hf_config)
        if model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_model: its vocabulary has {model_config.vocab_size} tokens, the "
                f"model's {target.vocab_size}; a draft model must share the tokenizer"
            )
        draft_config = dataclasses.replace(
            config, model=config.speculative_model, speculative_method=None,
            speculative_model=None, kv_cache_memory=None, kv_role="mixed",
        )  # fmt: skip
        self.runner = ModelRunner(draft_config, model_config, checkpoint, max_model_len)
        self.runner.allocate_kv_cache(num_blocks)
        caching = config.enable_prefix_caching
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=caching)
        self._mirrors: dict[str, tuple[Request, Request, int]] = {}  # id -> target, mirror, len
        self._new: set[str] = set()  # mirrors that have not looked up the prefix cache yet
        logger.info("draft model %s: %d KV blocks", config.speculative_model, num_blocks)

    def close(self) -> None:
        self.runner.free_kv_cache()

    def forget(self, request: Request) -> None:
        entry = self._mirrors.get(request.request_id)
        if entry is not None and entry[0] is request:
            self.kv.free(entry[1])
            del self._mirrors[request.request_id]
            self._new.discard(request.request_id)

    def lag(self, request: Request) -> int:
        entry = self._mirrors.get(request.request_id)
        if entry is None or entry[0] is not request:
            return request.num_tokens  # the whole context (less what the prefix cache has)
        return request.num_tokens - self._valid(entry)

    @staticmethod
    def _valid(entry: tuple[Request, Request, int]) -> int:
        """How much of the mirror's KV holds for the target's tokens now."""
        request, mirror, agree = entry  # the target's tokens up to `agree` at the last sync
        target = request.token_ids  # the drafts after them may differ
        while agree < min(len(mirror.token_ids), len(target)) and (
            mirror.token_ids[agree] == target[agree]
        ):
            agree += 1
        # at least the last token is computed again: its logits give the first draft
        return min(mirror.num_computed_tokens, agree, len(target) - 1)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        want = {r.request_id: k for r, k in zip(requests, num_tokens, strict=True) if k > 0}
        mirrors = [self._sync(r) for r in requests if r.request_id in want]
        step = 0
        while mirrors:
            out = SchedulerOutput()
            for mirror in mirrors:
                hits = []  # a new mirror's prefix-cache hits, looked up just before use
                if mirror.request_id in self._new:
                    self._new.discard(mirror.request_id)
                    hits, _ = self.kv.get_computed_blocks(mirror)
                num_hit = len(hits) * self.kv.block_size
                num_new = mirror.num_tokens - mirror.num_computed_tokens - num_hit
                # never cached here: the tokens past the target's are drafts
                if self.kv.allocate_slots(mirror, num_new, hits, cache=False) is not None:
                    mirror.num_computed_tokens += num_hit
                    block_ids = self.kv.block_ids(mirror.request_id)
                    out.scheduled.append(ScheduledRequest(mirror, num_new, block_ids))
                    self.num_rows += num_new
            if not out.scheduled:
                break
            result = self.runner.execute(out)
            self.num_passes += 1
            sampled = dict(zip(result.request_ids, result.token_ids, strict=True))
            for sched in out.scheduled:
                mirror, (token,) = sched.request, sampled[sched.request.request_id]
                mirror.num_computed_tokens += sched.num_new_tokens
                mirror.token_ids.append(token)
                drafts[mirror.request_id].append(token)
            step += 1
            mirrors = [s.request for s in out.scheduled if step < want[s.request.request_id]]
        return [drafts[r.request_id] for r in requests]

    def _sync(self, request: Request) -> Request:
        """The request's mirror, its tokens now the target's and its KV trimmed to where
        they agree."""
        entry = self._mirrors.get(request.request_id)
        if entry is None or entry[0] is not request:
            if entry is not None:
                self.kv.free(entry[1])
            mirror = Request(request.request_id, request.token_ids, _drafting(request), 1 << 30)
            mirror.cache_salt = request.cache_salt
            self._new.add(request.request_id)
            self._mirrors[request.request_id] = (request, mirror, 0)
            entry = self._mirrors[request.request_id]
        mirror, target = entry[1], request.token_ids
        mirror.num_computed_tokens = valid = self._valid(entry)
        # the drafts the target did not take go, and the target's new tokens come (not a
        # whole copy; the tokens up to `valid` agree)
        mirror.token_ids[valid:] = target[valid:]
        # the blocks of the target's tokens (agreed, so never written again) are findable:
        # the next turn of a conversation finds its prompt's draft KV here
        if mirror.num_computed_tokens:
            self.kv.cache_blocks(mirror, mirror.num_computed_tokens)
        self._mirrors[request.request_id] = (request, mirror, len(target))
        return mirror


def _drafting(request: Request) -> SamplingParams:
    """How the draft model draws for `request`: greedy, or as the request samples, with
    its seed (penalties and the rest change the target's distribution only)."""
    p = request.sampling_params
    if p.greedy:
        return GREEDY
    return SamplingParams(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        seed=request.seed, max_tokens=None,
    )  # fmt: skip
