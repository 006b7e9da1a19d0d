"""The KV connector's two halves, as an engine core uses them.

Scheduler half (`KVConnectorScheduler`, called by the scheduler only, on the engine
thread): how many of a request's tokens come from outside (`external_tokens`), starting
and finishing loads, and holding a finished prefill's blocks for a decode worker
(`hold`) until the transfer is released or times out (`collect`). It decides; it never
touches KV memory.

Worker half (`KVConnectorWorker`): moves bytes. On a prefill worker it runs the KV
endpoint (`server.KVTransferServer`) over the engine's KV tensors; on any worker it runs
loads in background threads through a transport and reports which finished, so the
engine keeps decoding other requests while a prompt's blocks arrive.

With tiers below the pool (`store`, ember.kv.tiers), the same path loads a prompt's
blocks past its local prefix-cache hit from host memory, disk or the cluster store, and
every request's computed full blocks are saved into the tiers when it finishes or is
preempted (`save`). Whether the cluster store holds a prompt's blocks is asked when the
request arrives (`request_added`), off the engine thread; the request waits in the queue
for the answer (`external_tokens` returns None) at most LOOKUP_WAIT seconds.

A decode request's life: admitted with its local prefix-cache hit -> blocks allocated for
the rest of the prompt (not yet findable by hash) -> WAITING_FOR_KV while a thread fetches
only those blocks -> on success its prompt counts as computed and its blocks become
findable; on failure (refused, timed out, corrupt) its blocks are freed and it waits
again to recompute the prompt like any request. An abort during a load frees the blocks
once the load thread is done with them.
"""

from __future__ import annotations

import logging
import secrets
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ember.kv.buffers import block_bytes, chunks, node_id
from ember.kv.params import RemotePrefill
from ember.kv.server import HeldTransfers, KVTransferServer
from ember.kv.tiers import TieredStore, TierLoad
from ember.kv.transport import KVTransferError, ShmTransport, Transport, make_transport

logger = logging.getLogger("ember.kv")

LOOKUP_WAIT = 1.0  # seconds a request waits for the cluster store's answer, then computes


@dataclass
class KVStats:
    """Counters since start, for /load and /metrics."""

    loads_ok: int = 0
    loads_failed: int = 0
    bytes_received: int = 0
    load_seconds: list[float] = field(default_factory=list)  # recent ones, for percentiles
    load_seconds_total: float = 0.0
    holds_expired: int = 0


@dataclass
class _Load:
    request: object  # the engine's Request
    future: Future
    started: float
    tier_load: TierLoad | None = None  # a load from the tiers (given up after the timeout)


@dataclass
class _Lookup:
    future: Future  # list[bool]: which of the prompt's blocks the cluster store holds
    started: float


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class KVConnectorWorker:
    """Moves blocks: serves held ones (prefill) and fetches remote ones (any role)."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        *,
        role: str,
        transport: str,
        secret: bytes | None,
        host: str,
        port: int,
        timeout: float,
        checksum: bool,
        fake_fault: str | None = None,
        shm_path: str | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.block_bytes = block_bytes(kv_caches)
        self.num_blocks = kv_caches[0].shape[1] if kv_caches else 0
        self.transport_name = transport
        self.checksum = checksum
        self.shm_path = shm_path
        self.holds = HeldTransfers()
        self.server: KVTransferServer | None = None
        self._transports: dict[str, Transport] = {}
        self._secret = secret or b""
        self._timeout = timeout
        self._host = host
        self._fake_fault = fake_fault
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ember-kv-load")
        if role == "prefill":
            if not secret:
                raise ValueError(
                    "a prefill worker needs the cluster's secret: set EMBER_CLUSTER_SECRET "
                    "(ember up sets it for its workers)"
                )
            self.server = KVTransferServer(kv_caches, self.holds, secret, host, port)
        self.mooncake = None  # a prefill worker's Mooncake endpoint, when that is the transport
        if role == "prefill" and transport == "mooncake":
            from ember.kv.mooncake import MooncakeEndpoint

            self.mooncake = MooncakeEndpoint(kv_caches, host)
        self.node = node_id()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for transport in self._transports.values():
            transport.close()
        if self.mooncake is not None:
            self.mooncake.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def transport_for(self, remote: RemotePrefill) -> Transport:
        name = self.transport_name
        if name == "auto":
            name = "shm" if ShmTransport.usable(remote) else "tcp"
        transport = self._transports.get(name)
        if transport is None:
            transport = make_transport(
                name, self._secret, self._timeout, self._fake_fault, self._host
            )
            self._transports[name] = transport
        return transport

    def start_load(self, remote: RemotePrefill, src_ids: list[int], dst_ids: list[int]) -> Future:
        return self._pool.submit(self._load, remote, src_ids, dst_ids)

    def release_remote(self, remote: RemotePrefill) -> None:
        """Gives a remote transfer back without reading it (best effort, in the background)."""
        self._pool.submit(self._release, remote)

    def _load(self, remote: RemotePrefill, src_ids: list[int], dst_ids: list[int]) -> int:
        if not src_ids:
            self._release(remote)
            return 0
        transport = self.transport_for(remote)
        try:
            num_bytes, crc = transport.fetch(
                remote, src_ids, self.kv_caches, dst_ids, self.checksum
            )
        except BaseException:
            self._release(remote)  # best effort: the prefill worker need not wait it out
            raise
        if crc is not None:
            local = 0
            for view in chunks(self.kv_caches, dst_ids):
                local = zlib.crc32(view, local)
            if local != crc:
                raise KVTransferError("the received blocks do not match the sender's checksum")
        return num_bytes

    def _release(self, remote: RemotePrefill) -> None:
        try:
            self.transport_for(remote).release(remote)
        except (OSError, KVTransferError) as exc:
            logger.info("could not release transfer %s (%s); it expires", remote.transfer_id, exc)


class KVConnectorScheduler:
    """Decides what comes from outside and what is held for others (engine thread only)."""

    def __init__(
        self,
        worker: KVConnectorWorker,
        block_size: int,
        hold_timeout: float,
        store: TieredStore | None = None,
        load_timeout: float = 10.0,
    ) -> None:
        self.worker = worker
        self.block_size = block_size
        self.hold_timeout = hold_timeout
        self.load_timeout = load_timeout
        self.store = store
        self.stats = KVStats()
        self._loads: dict[str, _Load] = {}
        self._lookups: dict[str, _Lookup] = {}  # cluster-store lookups, by request
        self._store_failed: set[str] = set()  # requests that recompute after a failed load
        self._held_by_request: dict[str, str] = {}  # request id -> transfer id
        self._held: dict[str, str] = {}  # transfer id -> request id

    # -- decode side --------------------------------------------------------------------

    @staticmethod
    def remote(request) -> RemotePrefill | None:
        params = request.kv_transfer
        return None if params is None else params.remote_prefill

    def _storable(self, request) -> bool:
        return (
            self.store is not None
            and self.remote(request) is None
            and request.request_id not in self._store_failed
            and not request.needs_prompt_logprobs  # the logits of every prompt token
        )

    def request_added(self, request) -> None:
        """Asks the cluster store, in the background, which of the prompt's blocks it has."""
        if self._storable(request) and self.store.cluster is not None:
            last = (request.num_tokens - 1) // self.block_size
            future = self.store.lookup(request.block_hashes[:last])
            self._lookups[request.request_id] = _Lookup(future, time.monotonic())

    def external_tokens(self, request, num_local_hit: int) -> int | None:
        """Prompt tokens that will be loaded (from the prefill worker, or from the tiers)
        rather than computed; None while the cluster store's answer is awaited."""
        remote = self.remote(request)
        if remote is not None:
            return max(remote.num_tokens - num_local_hit, 0)
        if not self._storable(request):
            return 0
        in_cluster = self._cluster_blocks(request)
        if in_cluster is None:
            return None
        # the stored blocks that continue the local hit, leaving a token to compute
        first = num_local_hit // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        found = 0
        for i in range(first, last):
            if not (
                self.store.has(request.block_hashes[i]) or i < len(in_cluster) and in_cluster[i]
            ):
                break
            found += 1
        return found * self.block_size

    def _cluster_blocks(self, request) -> list[bool] | None:
        """Which blocks the cluster store has (as asked on arrival); None: not known yet."""
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            return []
        if not lookup.future.done():
            if time.monotonic() - lookup.started < LOOKUP_WAIT:
                return None
            lookup.future.cancel()
            self.store.stats.lookups_failed += 1
            self._lookups[request.request_id] = _Lookup(_done([]), lookup.started)
            return []
        try:
            return lookup.future.result()
        except Exception as exc:  # noqa: BLE001 - a store that fails: compute
            logger.warning("KV store lookup for %s failed (%s)", request.request_id, exc)
            self.store.stats.lookups_failed += 1
            self._lookups[request.request_id] = _Lookup(_done([]), lookup.started)
            return []

    @property
    def num_looking_up(self) -> int:
        """Requests waiting for the cluster store's answer."""
        return sum(not lookup.future.done() for lookup in self._lookups.values())

    def start_load(self, request, block_ids: list[int], num_local_hit: int) -> None:
        """Fetches the prompt's blocks from `num_local_hit` on into this request's blocks."""
        remote = self.remote(request)
        first = num_local_hit // self.block_size
        self._lookups.pop(request.request_id, None)
        if remote is None:  # from the tiers, up to request.num_loaded_end
            end = request.num_loaded_end // self.block_size
            pairs = zip(request.block_hashes[first:end], block_ids[first:end], strict=True)
            tier_load = self.store.load(list(pairs))
            self._loads[request.request_id] = _Load(
                request, tier_load.future, time.monotonic(), tier_load
            )
            return
        num_blocks = -(-remote.num_tokens // self.block_size)
        src, dst = remote.block_ids[first:num_blocks], block_ids[first:num_blocks]
        future = self.worker.start_load(remote, src, dst)
        self._loads[request.request_id] = _Load(request, future, time.monotonic())

    def release_unused(self, request) -> None:
        """The prompt's KV was all here already: give the remote transfer back."""
        self._store_failed.discard(request.request_id)
        self._lookups.pop(request.request_id, None)
        remote = self.remote(request)
        if remote is not None:
            self.worker.release_remote(remote)
            request.kv_transfer = None

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def finished_loads(self) -> list[tuple[object, bool]]:
        """Loads that ended since the last call: (request, succeeded)."""
        done = []
        now = time.monotonic()
        for request_id, load in list(self._loads.items()):
            late = load.tier_load is not None and now - load.started > self.load_timeout
            if not load.future.done() and not (late and load.tier_load.cancel()):
                continue
            del self._loads[request_id]
            seconds = now - load.started
            try:
                if not load.future.done():
                    raise TimeoutError(f"no answer from the tiers in {self.load_timeout} s")
                num_bytes = load.future.result()
            except Exception as exc:  # noqa: BLE001 - any failure means: recompute
                logger.warning("KV load for %s failed (%s); recomputing", request_id, exc)
                self.stats.loads_failed += 1
                if self.remote(load.request) is None:  # the tiers': not tried again
                    self._store_failed.add(request_id)
                    load.request.num_cached_tokens = load.request.num_computed_tokens
                done.append((load.request, False))
                continue
            self.stats.loads_ok += 1
            self.stats.bytes_received += num_bytes
            self.stats.load_seconds = (self.stats.load_seconds + [seconds])[-1000:]
            self.stats.load_seconds_total += seconds
            done.append((load.request, True))
        return done

    # -- prefill side -------------------------------------------------------------------

    def cached_tokens(self, request, num_local_hit: int) -> int:
        """The prefix-cache hit to report: the prefill worker's, for a handed-over prompt;
        the local hit and what the tiers hold, for one loading from them."""
        remote = self.remote(request)
        if remote is not None:
            return remote.num_cached_tokens
        return max(num_local_hit, request.num_loaded_end)

    def request_finished(
        self, request, block_ids: list[int], at_length: bool
    ) -> RemotePrefill | None:
        """A request ended (at its token limit: `at_length`): its blocks are held for a
        decode worker (the params for it are returned) or saved into the tiers before they
        are freed (None)."""
        self._lookups.pop(request.request_id, None)
        handed_over = None
        if at_length:
            handed_over = self.hold(request, block_ids)
        if handed_over is None:
            self.save(request, block_ids)
        return handed_over

    def save(self, request, block_ids: list[int]) -> None:
        """A request's computed full blocks into the tiers (before they are freed)."""
        self._store_failed.discard(request.request_id)
        if self.store is None:
            return
        num_blocks = min(
            len(request.block_hashes),
            len(block_ids),
            request.num_computed_tokens // self.block_size,
        )
        hashes = request.block_hashes[:num_blocks]
        self.store.save(zip(hashes, block_ids[:num_blocks], strict=True), request.retain_kv)

    def hold(self, request, block_ids: list[int]) -> RemotePrefill | None:
        """Holds a finished prefill's blocks for a decode worker, if it asked for that and
        stopped only at its one-token limit; the params for the decode worker, or None."""
        params = request.kv_transfer
        server = self.worker.server
        if params is None or not params.do_remote_decode or server is None:
            return None
        num_tokens = request.num_prompt_tokens
        num_blocks = -(-num_tokens // self.block_size)
        mooncake = self.worker.mooncake
        transfer_id = f"{request.request_id}:{secrets.token_hex(6)}"
        held = list(block_ids[:num_blocks])
        self.worker.holds.add(transfer_id, held, self.hold_timeout)
        self._held_by_request[request.request_id] = transfer_id
        self._held[transfer_id] = request.request_id
        return RemotePrefill(
            host=server.host,
            port=server.port,
            transfer_id=transfer_id,
            block_ids=held,
            num_tokens=num_tokens,
            block_size=self.block_size,
            block_bytes=self.worker.block_bytes,
            num_blocks=self.worker.num_blocks,
            first_token_ids=request.output_token_ids,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            node=self.worker.node,
            shm_path=self.worker.shm_path,
            mooncake_session=mooncake.session if mooncake else None,
            kv_addrs=mooncake.kv_addrs if mooncake else None,
        )

    def drop_hold(self, request_id: str) -> None:
        """The frontend will not hand this prefill over (e.g. a stop string ended it)."""
        transfer_id = self._held_by_request.get(request_id)
        if transfer_id is not None:
            self.worker.holds.release(transfer_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def collect(self) -> list[str]:
        """Transfer ids whose held blocks may be freed now."""
        freed = self.worker.holds.collect()
        for transfer_id in freed:
            request_id = self._held.pop(transfer_id)
            if self._held_by_request.get(request_id) == transfer_id:
                del self._held_by_request[request_id]
        self.stats.holds_expired = self.worker.holds.num_expired
        return freed
