"""KV-cache blocks: the pool that owns them and the manager that hands them to requests.

A block holds the keys and values of `block_size` consecutive tokens of one sequence in
every layer. Its life cycle:

    free, no hash --allocate--> in use (ref_cnt >= 1) --full & cached--> in use, hashed
        ^                                                                   |
        |   evicted (hash dropped) when reallocated        free (ref 0) <---+
        +----------------------------------------------  hash kept, still findable

A freed block stays in the free queue with its hash, so a later request with the same
prefix can take it back (prefix caching). The free queue is LRU: reallocation takes the
block freed longest ago; blocks with no hash go first.

A full block's hash chains its parent's: hash(parent_hash, token ids). The root of the
chain hashes the request's cache salt, so tenants with different salts share nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ember.engine.request import Request


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block, chained to its parent's (stable across processes)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()[:16]


def root_hash(cache_salt: str | None) -> bytes:
    return hashlib.sha256(b"ember-kv-root:" + (cache_salt or "").encode()).digest()[:16]


class BlockPool:
    """Owns every block; hands out free ones and finds cached ones by hash."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[bytes, KVCacheBlock] = {}
        # called with (hash, block id) just before a cached block is reused for other KV
        self.on_evict: Callable[[bytes, int], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Takes a reference on cached blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= len(self.free_queue), "allocate beyond free blocks"
        out = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_hash, block.block_id)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        # ascending ids: a request's blocks then mostly form runs, which move between
        # workers as single chunks (which blocks are evicted does not change)
        out.sort(key=lambda b: b.block_id)
        return out

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Makes a full block findable by hash (unless another block already is)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drops one reference from each block, in the order given (first is evicted first)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def check_integrity(self) -> bool:
        for block in self.blocks:
            in_queue = block.block_id in self.free_queue
            assert in_queue == (block.ref_cnt == 0), f"block {block.block_id}: queue/ref mismatch"
            assert block.ref_cnt >= 0
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, "hash map out of sync"
        assert all(b.block_hash == h for h, b in self.cached.items())
        return True


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached


class KVCacheManager:
    """Gives each request the blocks its tokens need; the scheduler's one view of the cache.

    Called by the scheduler only: `get_computed_blocks` when admitting a request,
    `allocate_slots` before each step that computes its tokens, `free` when it finishes,
    is aborted or preempted.

    With `num_ranks` > 1 (data-parallel attention) each rank has a pool of `num_blocks`
    of its own, and a request's blocks all come from the pool of the rank that runs it
    (its `rank`, block ids that rank's): chosen when it is admitted, as the rank with the
    longest cached prefix of its prompt, then the most free blocks; kept until it is
    freed (a preempted request may go to another rank when admitted again).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_ranks: int = 1
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(num_blocks) for _ in range(num_ranks)]
        self.req_block_ids: dict[str, list[int]] = {}  # each request's block table
        self.req_rank: dict[str, int] = {}  # the rank whose pool holds a request's blocks
        self._chosen: dict[str, int] = {}  # get_computed_blocks' choice, until allocated
        self.num_hashed_blocks: dict[str, int] = {}
        self.held: dict[str, list[int]] = {}  # finished prefills' blocks kept for a transfer
        self.stats = PrefixCacheStats()

    @property
    def pool(self) -> BlockPool:
        """The pool (of rank 0, the only one without data-parallel attention)."""
        return self.pools[0]

    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free_blocks for pool in self.pools)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: read it, don't change it)."""
        return self.req_block_ids.get(request_id, [])

    def rank(self, request: Request) -> int:
        """The rank whose pool holds (or will hold) the request's blocks."""
        rank = self.req_rank.get(request.request_id)
        if rank is None:
            rank = self._chosen.get(request.request_id)
        if rank is None:
            rank = max(range(len(self.pools)), key=lambda r: self.pools[r].num_free_blocks)
        return rank

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request's tokens, as blocks and a token count
        (over ranks: on the rank chosen for it, see the class).

        At least one token is always left to compute, so the step yields logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self.update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.request_id in self.req_rank or len(self.pools) == 1:
            hits = self._hits(self.pools[self.rank(request)], request, max_blocks)
            return hits, len(hits) * self.block_size
        hits = [self._hits(pool, request, max_blocks) for pool in self.pools]
        rank = max(  # the longest hit, then the most free blocks, then the lowest rank
            range(len(self.pools)), key=lambda r: (len(hits[r]), self.pools[r].num_free_blocks)
        )
        self._chosen[request.request_id] = rank
        return hits[rank], len(hits[rank]) * self.block_size

    def _hits(self, pool: BlockPool, request: Request, max_blocks: int) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Counts a request's prompt in the prefix-cache stats, once, when first admitted."""
        if self.enable_prefix_caching:
            self.stats.queries += request.num_prompt_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] = (),
        cache: bool = True,
        num_lookahead: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens; None when there is not enough.

        `computed_blocks` are prefix-cache hits for a request being admitted; on success
        they join its block table ahead of the new blocks. With `cache=False` the new
        blocks stay unfindable until `cache_blocks` (their KV is still on its way).
        `num_lookahead` more slots are for draft tokens (speculative decoding): their KV
        is written this step but may be rejected, so no block is cached for them.
        """
        ids = self.req_block_ids.get(request.request_id, [])
        rank = self.rank(request)
        pool = self.pools[rank]
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_slots = num_total + num_lookahead
        num_needed = -(-num_slots // self.block_size) - len(ids) - len(computed_blocks)
        num_reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > pool.num_free_blocks - num_reclaimed:
            self._chosen.pop(request.request_id, None)  # chosen again when next admitted
            return None
        pool.touch(computed_blocks)
        new_blocks = pool.allocate(max(num_needed, 0))
        self._chosen.pop(request.request_id, None)
        self.req_rank[request.request_id] = rank
        ids = self.req_block_ids.setdefault(request.request_id, ids)
        ids.extend(b.block_id for b in computed_blocks)
        ids.extend(b.block_id for b in new_blocks)
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(request, ids, num_total)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Makes the full blocks of a request's first `num_tokens` findable (KV now there)."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, self.req_block_ids[request.request_id], num_tokens)

    def hold(self, request: Request, key: str) -> None:
        """Keeps a finished request's blocks under `key` (for a transfer) instead of freeing
        (one rank's pool: KV connectors do not run with data-parallel attention)."""
        self.num_hashed_blocks.pop(request.request_id, None)
        self.req_rank.pop(request.request_id, None)
        self.held[key] = self.req_block_ids.pop(request.request_id, [])

    def release_held(self, key: str) -> None:
        ids = self.held.pop(key, [])
        self.pool.free([self.pool.blocks[i] for i in reversed(ids)])

    def free(self, request: Request) -> None:
        """Returns all of a request's blocks; the last ones are evicted first."""
        ids = self.req_block_ids.pop(request.request_id, [])
        self.num_hashed_blocks.pop(request.request_id, None)
        self._chosen.pop(request.request_id, None)
        pool = self.pools[self.req_rank.pop(request.request_id, 0)]
        pool.free([pool.blocks[i] for i in reversed(ids)])

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only possible while no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for pool in self.pools:
            for block in pool.blocks:
                block.block_hash = None
            pool.cached.clear()
        return True

    def check_integrity(self) -> bool:
        refs = [[0] * pool.num_blocks for pool in self.pools]
        for request_id, ids in self.req_block_ids.items():
            for block_id in ids:
                refs[self.req_rank.get(request_id, 0)][block_id] += 1
        for ids in self.held.values():
            for block_id in ids:
                refs[0][block_id] += 1
        for pool, counts in zip(self.pools, refs, strict=True):
            pool.check_integrity()
            for block in pool.blocks:
                assert counts[block.block_id] == block.ref_cnt, f"block {block.block_id} ref_cnt"
        return True

    def update_hashes(self, request: Request) -> None:
        """Hashes the request's full blocks not hashed yet (chained, salted)."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        for i in range(len(hashes), num_full):
            start = i * self.block_size
            parent = hash_block(parent, request.token_ids[start : start + self.block_size])
            hashes.append(parent)

    def _cache_full_blocks(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        """Registers the blocks that `num_tokens` fill (their KV is computed this step)."""
        start = self.num_hashed_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self.update_hashes(request)
        pool = self.pools[self.req_rank.get(request.request_id, 0)]
        for i in range(start, end):
            pool.cache(pool.blocks[block_ids[i]], request.block_hashes[i])
        self.num_hashed_blocks[request.request_id] = end
