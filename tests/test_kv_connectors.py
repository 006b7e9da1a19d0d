"""The KV connector interface (ember.kv.connector): a connector of one's own, named by
`module:factory`, serves an evicted prompt through the same hooks the built-in ones use;
connectors compose in order (the first to claim a prompt loads it); unknown names are
refused with the known ones."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from test_kv_tiers import (
    BLOCK,
    GREEDY,
    POOL,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    computed,
    reference_turns,
    tokens,
)

from ember import LLM
from ember.kv.buffers import chunks
from ember.kv.connector import KVConnector


class Copier(KVConnector):
    """Keeps a copy of every finished request's full blocks in a dict, and loads them back."""

    name = "copier"

    def __init__(self, context) -> None:
        super().__init__(context.stats)
        self.kv_caches = context.kv_caches
        self.block_size = context.config.block_size
        self.saved: dict[bytes, bytes] = {}
        self.num_loads = 0

    def external_tokens(self, request, num_local_hit: int) -> int:
        first = num_local_hit // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        found = 0
        for block_hash in request.block_hashes[first:last]:
            if block_hash not in self.saved:
                break
            found += 1
        return found * self.block_size

    def start_load(self, request, block_ids: list[int], num_local_hit: int) -> None:
        first = num_local_hit // self.block_size
        end = request.num_loaded_end // self.block_size
        for block_hash, block_id in zip(
            request.block_hashes[first:end], block_ids[first:end], strict=True
        ):
            data, offset = self.saved[block_hash], 0
            for view in chunks(self.kv_caches, [block_id]):
                view[:] = data[offset : offset + len(view)]
                offset += len(view)
        self.num_loads += 1
        done: Future = Future()
        done.set_result((end - first) * len(data))
        self._track(request, done)

    def request_finished(self, request, block_ids: list[int], at_length: bool) -> None:
        num_blocks = min(len(request.block_hashes), request.num_computed_tokens // BLOCK)
        for block_hash, block_id in zip(
            request.block_hashes[:num_blocks], block_ids[:num_blocks], strict=True
        ):
            self.saved[block_hash] = b"".join(chunks(self.kv_caches, [block_id]))


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    return reference_turns(tiny_checkpoint("llama"))


def _evict_then_continue(llm: LLM, expected) -> int:
    first, turn2, second = expected
    assert tokens(llm, PROMPT_A) == first
    tokens(llm, PROMPT_B)  # A's blocks leave the pool
    tokens(llm, PROMPT_C)
    before = computed(llm)
    out = llm.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert computed(llm) - before == len(turn2) - out.num_cached_tokens
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()
    return out.num_cached_tokens


def test_a_connector_of_ones_own_serves_an_evicted_prompt(tiny_checkpoint, expected):
    llm = LLM(str(tiny_checkpoint("llama")),
              kv_connectors=("disagg", "test_kv_connectors:Copier"), **POOL)  # fmt: skip
    assert _evict_then_continue(llm, expected) == len(PROMPT_A) // BLOCK * BLOCK
    copier = llm.engine.core.connector.get("copier")
    assert copier.num_loads == 1 and llm.engine.core.connector.stats.loads_ok == 1


@pytest.mark.parametrize("order", [("copier", "tiers"), ("tiers", "copier")])
def test_the_first_connector_to_claim_a_prompt_loads_it(tiny_checkpoint, expected, order):
    names = tuple("test_kv_connectors:Copier" if n == "copier" else n for n in order)
    llm = LLM(str(tiny_checkpoint("llama")), kv_connectors=names,
              kv_offload_memory=1 << 20, **POOL)  # fmt: skip
    assert _evict_then_continue(llm, expected) == len(PROMPT_A) // BLOCK * BLOCK
    copier = llm.engine.core.connector.get("copier")
    host_hits = llm.engine.core.kv_store.stats.host.hits
    if order[0] == "copier":
        assert copier.num_loads == 1 and host_hits == 0
    else:
        assert copier.num_loads == 0 and host_hits == len(PROMPT_A) // BLOCK


@pytest.mark.parametrize("name", ["nope", "no_such_module:x", "test_kv_connectors:Nope"])
def test_an_unknown_connector_is_refused(tiny_checkpoint, name):
    with pytest.raises(ValueError, match="kv_connectors.*(disagg|cannot load)"):
        LLM(str(tiny_checkpoint("llama")), kv_connectors=("disagg", name), **POOL)
