"""The `tiers` KV connector: a request's prompt blocks from the tiers below the pool
(host memory, disk, the cluster store: ember.kv.tiers), and its computed blocks into them.

Scheduler half (`TierConnector`): claims the stored blocks that continue a request's
local prefix-cache hit (the longest unbroken run, leaving a token to compute; not for a
prompt whose logprobs are wanted, nor one a prefill worker sends); loads them into its
new blocks through the store's loader thread (given up after `kv_load_timeout`, its late
bytes never written); saves every request's computed full blocks into them (`kv_save`,
SAVE_POLICIES: when they are computed, when the request finishes, or when the pool
evicts them). Whether the cluster store holds a prompt's blocks is asked when the
request arrives (`request_added`), off the engine thread; the request waits in the queue
for the answer (`external_tokens` is None) at most LOOKUP_WAIT seconds, then computes. A
request whose load failed is not claimed again: it recomputes.

Worker half: `tiers.TieredStore`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from ember import envs
from ember.kv.connector import ConnectorContext, KVConnector
from ember.kv.tiers import TieredStore

logger = logging.getLogger("ember.kv")

LOOKUP_WAIT = 1.0  # seconds a request waits for the cluster store's answer, then computes
# when a request's computed full blocks are copied into the tiers:
# computed  after the step that filled them (write-through: other workers see them at once)
# finished  when the request finishes or is preempted, before its blocks are freed
# evicted   when the pool reuses a cached block for other KV (write-back: only what leaves)
SAVE_POLICIES = ("computed", "finished", "evicted")
MAX_RETAINED = 1 << 16  # evicted: the sessions' block hashes remembered until evicted


@dataclass
class _Lookup:
    future: Future  # list[bool]: which of the prompt's blocks the cluster store holds
    started: float


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class TierConnector(KVConnector):
    name = "tiers"

    def __init__(
        self,
        store: TieredStore,
        block_size: int,
        load_timeout: float,
        stats=None,
        save: str = "computed",
    ):
        super().__init__(stats, load_timeout)
        if save not in SAVE_POLICIES:
            raise ValueError(f"kv_save must be one of {', '.join(SAVE_POLICIES)}; got {save!r}")
        self.store = store
        self.block_size = block_size
        self.save_policy = save
        self._retained: OrderedDict[bytes, None] = OrderedDict()  # evicted: sessions' blocks
        self._lookups: dict[str, _Lookup] = {}  # cluster-store lookups, by request
        self._failed: set[str] = set()  # requests that recompute after a failed load

    def close(self) -> None:
        self.store.close()

    def _claimable(self, request) -> bool:
        params = request.kv_transfer
        return (
            (params is None or params.remote_prefill is None)  # a prefill worker sends it
            and request.request_id not in self._failed
            and not request.needs_prompt_logprobs  # the logits of every prompt token
        )

    def request_added(self, request, num_local_hit: int) -> None:
        """Asks the cluster store, in the background, which of the prompt's blocks it has;
        then (or at once, without a store) reads the stored blocks past the pool's hit
        into host memory while the request is queued."""
        if not self._claimable(request):
            return
        first = num_local_hit // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[first:last]
        retain = request.retain_kv
        if self.store.cluster is None:
            self.store.prefetch(hashes, retain=retain)
            return
        future = self.store.lookup(request.block_hashes[:last])
        future.add_done_callback(
            lambda done: (
                done.cancelled()
                or done.exception() is not None
                or self.store.prefetch(hashes, done.result()[first:], retain)
            )
        )
        self._lookups[request.request_id] = _Lookup(future, time.monotonic())

    def external_tokens(self, request, num_local_hit: int) -> int | None:
        if not self._claimable(request):
            return 0
        in_cluster = self._cluster_blocks(request)
        if in_cluster is None:
            return None
        first = num_local_hit // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        found = 0
        for i in range(first, last):
            here = self.store.has(request.block_hashes[i])
            if not (here or i < len(in_cluster) and in_cluster[i]):
                break
            found += 1
        return found * self.block_size

    def _cluster_blocks(self, request) -> list[bool] | None:
        """Which blocks the cluster store has (as asked on arrival); None: not known yet."""
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            return []
        if lookup.future.done():
            try:
                return lookup.future.result()
            except Exception as exc:  # noqa: BLE001 - a store that fails: compute
                logger.warning("KV store lookup for %s failed (%s)", request.request_id, exc)
        elif time.monotonic() - lookup.started < LOOKUP_WAIT:
            return None
        else:
            lookup.future.cancel()
        self.store.stats.lookups_failed += 1
        self._lookups[request.request_id] = _Lookup(_done([]), lookup.started)
        return []

    @property
    def num_looking_up(self) -> int:
        return sum(not lookup.future.done() for lookup in self._lookups.values())

    def start_load(self, request, block_ids: list[int], num_local_hit: int) -> None:
        """Copies the stored blocks from `num_local_hit` up to `request.num_loaded_end`."""
        self._lookups.pop(request.request_id, None)
        first = num_local_hit // self.block_size
        end = request.num_loaded_end // self.block_size
        pairs = zip(request.block_hashes[first:end], block_ids[first:end], strict=True)
        load = self.store.load(list(pairs), request.retain_kv)
        self._track(request, load.future, load.cancel)

    def _load_failed(self, request) -> None:
        self._failed.add(request.request_id)  # not tried again: it recomputes
        request.num_cached_tokens = request.num_computed_tokens

    def release_unused(self, request) -> None:
        self._failed.discard(request.request_id)
        self._lookups.pop(request.request_id, None)

    def request_finished(self, request, block_ids: list[int], at_length: bool) -> None:
        self._lookups.pop(request.request_id, None)
        self.save(request, block_ids)

    def save(self, request, block_ids: list[int]) -> None:
        """A finished or preempted request's blocks, before they are freed: saved now
        ("finished"; "computed" saved them already, and now only marks a session's), or
        remembered as a session's until the pool evicts them ("evicted")."""
        self._failed.discard(request.request_id)
        num_blocks = min(
            len(request.block_hashes),
            len(block_ids),
            request.num_computed_tokens // self.block_size,
        )
        hashes = request.block_hashes[:num_blocks]
        if self.save_policy == "evicted":
            if request.retain_kv:
                for block_hash in hashes:
                    self._retained[block_hash] = None
                    self._retained.move_to_end(block_hash)
                while len(self._retained) > MAX_RETAINED:
                    self._retained.popitem(last=False)
        elif self.save_policy == "finished" or request.retain_kv:
            self.store.save(zip(hashes, block_ids[:num_blocks], strict=True), request.retain_kv)

    def blocks_computed(self, request, block_ids: list[int], start: int, end: int) -> None:
        if self.save_policy == "computed":
            end = min(end, len(request.block_hashes), len(block_ids))
            pairs = zip(request.block_hashes[start:end], block_ids[start:end], strict=True)
            self.store.save(pairs, request.retain_kv)

    def block_evicted(self, block_hash: bytes, block_id: int) -> None:
        if self.save_policy == "evicted":
            retain = block_hash in self._retained
            self._retained.pop(block_hash, None)
            self.store.save([(block_hash, block_id)], retain)


def make_tiers(context: ConnectorContext) -> TierConnector | None:
    """The tiers the config asks for, or None when it asks for none."""
    config = context.config
    if not (config.kv_offload_memory or config.kv_disk_dir or config.kv_store):
        return None
    cluster = None
    if config.kv_store:
        from ember.kv import mooncake

        cluster = mooncake.MooncakeStoreTier(
            config.kv_store, envs.cluster_secret(), config.kv_store_memory, config.kv_host
        )
    store = TieredStore(
        context.kv_caches,
        context.kv_identity,
        config.kv_offload_memory,
        config.kv_disk_dir,
        config.kv_disk_size,
        cluster,
        config.session_ttl,
        context.kv.fill_replicas,
    )
    return TierConnector(
        store, config.block_size, config.kv_load_timeout, context.stats, config.kv_save
    )
