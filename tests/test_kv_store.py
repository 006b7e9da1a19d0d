"""The cluster tier (`kv_store`, Mooncake Store): a prompt computed by one worker is
continued by another with its prefix loaded from the store; a forged value, a store that
is down, slow or failing each fall back to recomputing, with the right tokens and no
leaked block.

The Mooncake test runs a real mooncake_master (and a process holding the pool's memory)
inside a loopback-only network namespace, as tests/test_kv_mooncake.py does; the others
put a fake store with the same three calls in its place.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from ember import LLM
from tests.test_kv_mooncake import run_in_namespace
from tests.test_kv_tiers import (
    BLOCK,
    GREEDY,
    POOL,
    PROMPT_A,
    assert_clean,
    computed,
    reference_turns,
    tokens,
)

URL = "mooncake://127.0.0.1:1"  # the fake store's (never dialled)


class FakeStore:
    """A Mooncake Store stand-in: a dict, with a delay or a failure where a test wants."""

    def __init__(self, *args) -> None:
        self.values: dict[bytes, bytes] = {}
        self.exists_delay = self.get_delay = 0.0
        self.fail = False

    def close(self) -> None:
        pass

    def exists(self, keys):
        time.sleep(self.exists_delay)
        if self.fail:
            raise RuntimeError("the store is down")
        return [k in self.values for k in keys]

    def put(self, key, data, pin_seconds=0.0):
        self.values[key] = data
        return True

    def get(self, key, length):
        time.sleep(self.get_delay)
        return self.values.get(key)


@pytest.fixture
def fake_store(monkeypatch):
    import ember.kv.mooncake

    shared = FakeStore()
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", "store-test")
    monkeypatch.setattr(ember.kv.mooncake, "MooncakeStoreTier", lambda *args: shared)
    return shared


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    return reference_turns(tiny_checkpoint("llama"))


def _store(llm: LLM):
    return llm.engine.core.kv_store


def test_another_worker_loads_the_prefix_from_the_store(tiny_checkpoint, expected, fake_store):
    first, turn2, second = expected
    a = LLM(str(tiny_checkpoint("llama")), kv_store=URL, **POOL)
    assert tokens(a, PROMPT_A) == first
    _store(a).flush()
    assert len(fake_store.values) == len(PROMPT_A) // BLOCK + 0  # its full prompt blocks
    b = LLM(str(tiny_checkpoint("llama")), kv_store=URL, **POOL)
    out = b.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert out.num_cached_tokens >= 12 * BLOCK
    assert computed(b) == len(turn2) - out.num_cached_tokens
    assert _store(b).stats.cluster.hits * BLOCK == out.num_cached_tokens
    assert_clean(b)


def test_a_slow_lookup_computes_instead(tiny_checkpoint, expected, fake_store, monkeypatch):
    import ember.kv.store_connector

    first, turn2, second = expected
    monkeypatch.setattr(ember.kv.store_connector, "LOOKUP_WAIT", 0.2)
    a = LLM(str(tiny_checkpoint("llama")), kv_store=URL, **POOL)
    tokens(a, PROMPT_A)
    _store(a).flush()
    fake_store.exists_delay = 1.0
    b = LLM(str(tiny_checkpoint("llama")), kv_store=URL, **POOL)
    out = b.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert out.num_cached_tokens == 0 and computed(b) == len(turn2)
    assert _store(b).stats.lookups_failed == 1
    assert_clean(b)


def test_a_failing_store_computes_instead(tiny_checkpoint, expected, fake_store):
    first, turn2, second = expected
    a = LLM(str(tiny_checkpoint("llama")), kv_store=URL, **POOL)
    tokens(a, PROMPT_A)
    _store(a).flush()
    fake_store.fail = True
    out = a.generate([turn2], GREEDY)[0]  # its own pool still holds A's prompt
    assert out.outputs[0].token_ids == second
    assert _store(a).stats.lookups_failed == 1
    assert_clean(a)


def test_a_load_that_times_out_writes_nothing_after(tiny_checkpoint, expected, fake_store):
    """A store that answers a read after the load was given up: the request recomputed,
    its blocks went to others, and the late bytes must not land in them."""
    first, turn2, second = expected
    a = LLM(str(tiny_checkpoint("llama")), kv_store=URL, **POOL)
    tokens(a, PROMPT_A)
    _store(a).flush()
    fake_store.get_delay = 1.5
    b = LLM(str(tiny_checkpoint("llama")), kv_store=URL, kv_load_timeout=0.3, **POOL)
    out = b.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert computed(b) == len(turn2)
    assert b.engine.core.connector.stats.loads_failed == 1
    fake_store.get_delay = 0.0
    time.sleep(2.0)  # the late read has come back by now, and was dropped
    # the blocks it would have written now hold turn2's KV: the next turn reads them
    turn3 = turn2 + second + [9, 10]
    want = tokens(LLM(str(tiny_checkpoint("llama")), enable_prefix_caching=False, **POOL), turn3)
    assert tokens(b, turn3) == want
    assert_clean(b)


def test_kv_store_urls_are_checked():
    from ember.config import EngineConfig

    for url in ("mooncake://", "redis://h:1", "mooncake://h", "mooncake://h:1/x", "h:1"):
        with pytest.raises(ValueError, match="kv_store"):
            EngineConfig(kv_store=url)


def test_kv_store_needs_the_cluster_secret(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("EMBER_CLUSTER_SECRET", raising=False)
    with pytest.raises(ValueError, match="EMBER_CLUSTER_SECRET"):
        LLM(str(tiny_checkpoint("llama")), kv_store="mooncake://127.0.0.1:9", **POOL)


# -- a real Mooncake Store, in a network namespace ------------------------------------------


def test_two_workers_share_a_mooncake_store_in_a_network_namespace(tiny_checkpoint):
    run_in_namespace(__file__, "engines", str(tiny_checkpoint("llama")), done="STORE OK")


def test_ember_up_with_a_mooncake_store_moves_sessions_without_recompute(tiny_checkpoint):
    run_in_namespace(__file__, "up", str(tiny_checkpoint("llama")), done="STORE OK")


def _check_up(checkpoint: str) -> None:
    """`ember up --kv-store mooncake`, 2 workers: the same prompt in sessions that the
    router homes on different workers is computed once; the other worker loads it."""
    import httpx

    from tests.server_utils import Up

    cluster = Up(checkpoint, "--mixed", "2", "--kv-store", "mooncake",
                 "--kv-store-memory", "64M", "--max-num-batched-tokens", "64")  # fmt: skip
    try:
        body = {"prompt": list(range(3, 203)), "max_tokens": 4, "temperature": 0}

        def queries() -> dict[str, int]:
            return {u: cluster.worker_load(u)["prefix_cache_queries"] for u in cluster.workers}

        homes, answers, usage = [], [], []  # the worker each session went to
        for i in range(16):
            before = queries()
            headers = {"x-session-affinity": f"session-{i}"}
            url = f"{cluster.url}/v1/completions"
            reply = httpx.post(url, json=body, headers=headers, timeout=60)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["text"])
            usage.append(reply.json()["usage"])
            homes += [u for u, n in queries().items() if n != before[u]]
            if len(set(homes)) == 2:
                break
            if i == 0:  # its 25 full blocks in the store before another worker looks
                _wait_store_writes(cluster, homes[0], 200 // 8)
        assert len(set(homes)) == 2, "the router sent every session to one worker"
        assert len(set(answers)) == 1
        # the first worker computed the prompt (then 8 tokens for each repeat); the second
        # loaded the 24 full blocks from the store and computed only the last 8
        first, second = cluster.worker_load(homes[0]), cluster.worker_load(homes[-1])
        assert first["num_prompt_tokens_computed"] == 200 + 8 * (len(homes) - 2)
        assert second["num_prompt_tokens_computed"] == 8
        assert second["kv_tiers"]["cluster"]["hits"] == 192 // 8
        metrics = httpx.get(f"{homes[-1]}/metrics", timeout=5).text
        hits = re.search(r'ember_kv_tier_blocks\{event="hit",.*tier="cluster"\} (\S+)', metrics)
        assert hits and float(hits.group(1)) == 24, metrics
        assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == 192
        cluster.wait_no_blocks()
    finally:
        cluster.stop()
    print("STORE OK")


def _wait_store_writes(cluster, url: str, num_blocks: int, timeout: float = 60.0) -> None:
    """Until worker `url` has written `num_blocks` blocks to the cluster store (its writes
    go on after the request; under load they may lag the next request)."""
    deadline = time.monotonic() + timeout
    while True:
        tiers = cluster.worker_load(url)["kv_tiers"]
        if tiers["cluster"]["writes"] >= num_blocks or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert tiers["cluster"]["writes"] >= num_blocks, tiers


def _check(checkpoint: str) -> None:
    from ember.kv.mooncake import MAC_BYTES, store_commands, wait_listening

    master, holder, address = store_commands(64 << 20)
    processes = [subprocess.Popen(master, stdout=subprocess.DEVNULL)]
    try:
        wait_listening(int(address.rsplit(":", 1)[1]), 30)
        processes.append(subprocess.Popen(holder, stdout=subprocess.DEVNULL))
        wait_listening(int(next(a for a in holder if a.startswith("--port=")).split("=")[1]), 30)
        url = f"mooncake://{address}"

        reference = LLM(checkpoint, enable_prefix_caching=False, **POOL)
        first = tokens(reference, PROMPT_A)
        turn2 = PROMPT_A + first + [5, 6, 7, 8]
        second = tokens(reference, turn2)

        a = LLM(checkpoint, kv_store=url, **POOL)  # worker A computes the first turn
        assert tokens(a, PROMPT_A) == first
        _store(a).flush()
        assert _store(a).stats.cluster.writes == len(PROMPT_A) // BLOCK

        b = LLM(checkpoint, kv_store=url, **POOL)  # worker B continues the session
        out = b.generate([turn2], GREEDY)[0]
        assert out.outputs[0].token_ids == second
        assert out.num_cached_tokens == len(PROMPT_A) // BLOCK * BLOCK
        assert computed(b) == len(turn2) - out.num_cached_tokens
        assert _store(b).stats.cluster.hits == len(PROMPT_A) // BLOCK
        assert_clean(b)

        # a value forged by someone without the secret (in the last block B stored, which
        # no one has read, so the store lets it be replaced): refused, recomputed
        from ember.engine.kv_cache import hash_block, root_hash

        tier, block_hash = _store(b).cluster, root_hash(None)
        for i in range(len(turn2) // BLOCK):
            block_hash = hash_block(block_hash, turn2[i * BLOCK : (i + 1) * BLOCK])
        name = tier.name(_store(b).key(block_hash))
        _store(b).flush()
        assert tier._store.remove(name) == 0
        assert tier._store.put(name, bytes(MAC_BYTES + _store(b).block_bytes)) == 0
        c = LLM(checkpoint, kv_store=url, **POOL)
        out = c.generate([turn2], GREEDY)[0]
        assert out.outputs[0].token_ids == second
        assert computed(c) == len(turn2)
        assert _store(c).stats.cluster.corrupt == 1
        assert c.engine.core.connector.stats.loads_failed == 1
        assert_clean(c)

        # the store goes down: worker B still answers, computing
        for process in processes:
            process.kill()
            process.wait()
        turn3 = turn2 + second + [9]
        start = time.monotonic()
        out = b.generate([turn3], GREEDY)[0]
        assert time.monotonic() - start < 60
        assert out.outputs[0].token_ids == tokens(reference, turn3)
        assert _store(b).stats.lookups_failed == 1
        _store(b).flush()
        assert _store(b).stats.cluster.writes_dropped >= 1
        assert_clean(b)
    finally:
        for process in processes:
            process.kill()
    print("STORE OK")


if __name__ == "__main__":
    {"engines": _check, "up": _check_up}[sys.argv[1]](sys.argv[2])
