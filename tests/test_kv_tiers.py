"""KV tiers below the engine's pool (ember.kv.tiers): a prompt whose blocks were evicted
from a tiny pool is served from host memory, then from disk, then by a restarted engine,
with the same tokens as computing it from scratch and fewer prompt tokens computed; a
damaged or missing block file falls back to recomputing; KV of another model or tenant
never matches."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.kv import tiers
from ember.kv.buffers import DeviceBlocks, block_bytes, chunks

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
# the tiny llama: 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes a token,
# 8 KiB a block; the pool holds 20 blocks, one 200-token prompt takes 13
POOL = dict(kv_cache_memory=20 * 8192, max_model_len=256)
PROMPT_A = [(7 * i) % 500 + 3 for i in range(200)]
# B and C after A evict all of A's blocks from the pool
PROMPT_B = [(11 * i) % 480 + 7 for i in range(200)]
PROMPT_C = [(13 * i) % 470 + 9 for i in range(200)]


def tokens(llm: LLM, prompt: list[int], kv_retention: str | None = None, **kw) -> list[int]:
    params = SamplingParams(**{**GREEDY.__dict__, **kw})
    return llm.generate([prompt], params, kv_retention=kv_retention)[0].outputs[0].token_ids


def computed(llm: LLM) -> int:
    return llm.engine.core.scheduler.num_prompt_tokens_computed


def store(llm: LLM):
    return llm.engine.core.kv_store


def assert_clean(llm: LLM) -> None:
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()


def reference_turns(checkpoint) -> tuple[list[int], list[int], list[int]]:
    """Greedy tokens of A, A's next turn (A + its answer + more), and that turn's greedy
    tokens, computed from scratch."""
    llm = LLM(str(checkpoint), enable_prefix_caching=False, **POOL)
    first = tokens(llm, PROMPT_A)
    turn2 = PROMPT_A + first + [5, 6, 7, 8]
    return first, turn2, tokens(llm, turn2)


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    return reference_turns(tiny_checkpoint("llama"))


def test_an_evicted_session_comes_back_from_host_memory(tiny_checkpoint, expected):
    first, turn2, second = expected
    llm = LLM(str(tiny_checkpoint("llama")), kv_offload_memory=1 << 20, **POOL)
    assert tokens(llm, PROMPT_A) == first
    tokens(llm, PROMPT_B)  # A's blocks leave the pool (into host memory when freed)
    tokens(llm, PROMPT_C)
    before = computed(llm)
    out = llm.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    # A's 12 full computed blocks (and its answer's) come back: only the rest is computed
    loaded = out.num_cached_tokens
    assert loaded >= 12 * BLOCK
    assert computed(llm) - before == len(turn2) - loaded
    assert store(llm).stats.host.hits * BLOCK == loaded
    assert_clean(llm)


def test_then_from_disk_and_after_a_restart(tiny_checkpoint, expected, tmp_path):
    first, turn2, second = expected
    options = dict(kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24, **POOL)
    llm = LLM(str(tiny_checkpoint("llama")), **options)  # no host tier: straight to disk
    assert tokens(llm, PROMPT_A) == first
    tokens(llm, PROMPT_B)
    tokens(llm, PROMPT_C)
    store(llm).flush()
    out = llm.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert store(llm).stats.disk.hits * BLOCK == out.num_cached_tokens >= 12 * BLOCK
    store(llm).flush()
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files and not list(tmp_path.rglob("*.tmp"))

    restarted = LLM(str(tiny_checkpoint("llama")), **options)  # an empty pool, warm disk
    out = restarted.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert out.num_cached_tokens >= 12 * BLOCK
    assert computed(restarted) == len(turn2) - out.num_cached_tokens
    assert_clean(restarted)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_block_file_falls_back_to_recompute(tiny_checkpoint, expected, tmp_path, damage):
    first, turn2, second = expected
    options = dict(kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24, **POOL)
    llm = LLM(str(tiny_checkpoint("llama")), **options)
    assert tokens(llm, PROMPT_A) == first
    store(llm).flush()
    restarted = LLM(str(tiny_checkpoint("llama")), **options)
    victim = restarted.engine.core.kv_store
    key = victim.key(_first_block_hash(restarted, PROMPT_A))
    path = victim.disk.path(key)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.unlink()
    out = restarted.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert computed(restarted) == len(turn2)  # the first block is gone: nothing after counts
    assert restarted.engine.core.connector.stats.loads_failed == 1
    assert victim.stats.disk.corrupt == (0 if damage == "delete" else 1)
    assert_clean(restarted)
    victim.flush()  # the recomputed block was saved again, whole
    assert victim.disk.read(key, victim.block_bytes) is not None


def _first_block_hash(llm: LLM, prompt: list[int]) -> bytes:
    from ember.engine.kv_cache import hash_block, root_hash

    return hash_block(root_hash(None), prompt[:BLOCK])


def test_another_model_or_tenant_never_hits(tiny_checkpoint, tmp_path):
    options = dict(kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24, **POOL)
    llm = LLM(str(tiny_checkpoint("llama")), **options)
    tokens(llm, PROMPT_A)
    store(llm).flush()
    other_tenant = LLM(str(tiny_checkpoint("llama")), **options)
    out = other_tenant.generate([PROMPT_A], GREEDY, cache_salt="tenant-2")[0]
    assert out.num_cached_tokens == 0 and store(other_tenant).stats.disk.hits == 0
    # the same architecture and shapes, other weights: another namespace on disk
    other_model = LLM(str(tiny_checkpoint("mistral")), **options)
    out = other_model.generate([PROMPT_A], GREEDY)[0]
    assert out.num_cached_tokens == 0 and store(other_model).stats.disk.hits == 0
    store(other_model).flush()
    assert len({p.parent for p in Path(tmp_path).rglob("*.kvb")}) == 2


def as_rows(llm: LLM) -> LLM:
    """The engine's tiers move blocks as a KV cache on CUDA has them moved: gathered into
    rows of bytes, each row to or from its tier, the rows scattered into the blocks
    (DeviceBlocks, here over the CPU tensors)."""
    below = store(llm)
    below.device_blocks = DeviceBlocks(below.kv_caches)
    return llm


def test_blocks_moved_as_rows_come_back_from_memory_disk_and_a_restart(
    tiny_checkpoint, expected, tmp_path, monkeypatch
):
    first, turn2, second = expected
    gathered, scattered = [], []
    monkeypatch.setattr(DeviceBlocks, "gather", spy(DeviceBlocks.gather, gathered))
    monkeypatch.setattr(DeviceBlocks, "scatter", spy(DeviceBlocks.scatter, scattered))
    monkeypatch.setattr(tiers, "MAX_ROW_BYTES", 3 * 8192)  # rows of 3 blocks at most
    options = dict(kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24, **POOL)
    llm = as_rows(LLM(str(tiny_checkpoint("llama")), kv_offload_memory=1 << 20, **options))
    assert tokens(llm, PROMPT_A) == first
    tokens(llm, PROMPT_B)
    tokens(llm, PROMPT_C)
    out = llm.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert store(llm).stats.host.hits * BLOCK == out.num_cached_tokens >= 12 * BLOCK
    assert max(gathered) == max(scattered) == 3 and sum(scattered) >= 12  # in groups
    store(llm).flush()
    restarted = as_rows(LLM(str(tiny_checkpoint("llama")), **options))
    out = restarted.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert store(restarted).stats.disk.hits * BLOCK == out.num_cached_tokens >= 12 * BLOCK
    assert_clean(restarted)


def spy(method, calls: list):
    def called(self, *args):
        calls.append(len(args[0]))
        return method(self, *args)

    return called


def test_rows_are_the_bytes_of_each_block():
    """A block's row is its bytes in the order a CPU cache's `chunks` gives them (so the
    disk and the store mean the same by them), and scattering rows writes just their
    blocks."""
    torch.manual_seed(0)
    kv = [torch.randn(2, 6, 4, 2, 3), torch.randn(1, 6, 4, 1, 5)]  # K+V, and a latent
    rows = DeviceBlocks(kv).gather([4, 1])
    assert rows.shape == (2, block_bytes(kv))
    assert bytes(rows[0].numpy()) == b"".join(chunks(kv, [4]))
    assert bytes(rows[1].numpy()) == b"".join(chunks(kv, [1]))
    before = [t.clone() for t in kv]
    DeviceBlocks(kv).scatter([0, 5], rows)
    for now, was in zip(kv, before, strict=True):
        assert torch.equal(now[:, 0], was[:, 4]) and torch.equal(now[:, 5], was[:, 1])
        assert torch.equal(now[:, 1:5], was[:, 1:5])


def test_tiers_need_prefix_caching(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(str(tiny_checkpoint("llama")), kv_offload_memory=1 << 20,
            enable_prefix_caching=False, **POOL)  # fmt: skip


def test_smollm2_from_the_disk_tier_equals_computing_it(tmp_path):
    """The real default model: a 600-token prompt's next turn, computed from scratch and
    served by a restarted engine from the disk tier, gives the same tokens."""
    from ember.loader.default_models import resolve_model

    path = str(resolve_model(None))  # fetched by `make test` beforehand (ember download)
    prompt = [(37 * i) % 40000 + 100 for i in range(600)]
    options = dict(kv_cache_memory=1 << 26, max_model_len=1024, kv_disk_dir=str(tmp_path))
    first = LLM(path, **options)
    answer = tokens(first, prompt)
    store(first).flush()
    turn2 = prompt + answer + [100, 200, 300]
    fresh = tokens(LLM(path, kv_cache_memory=1 << 26, max_model_len=1024), turn2)
    restarted = LLM(path, **options)
    out = restarted.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == fresh
    assert out.num_cached_tokens == 607 // BLOCK * BLOCK  # every full block computed before
    assert computed(restarted) == len(turn2) - out.num_cached_tokens


# -- agent sessions: x-session-affinity / kv_retention "session" ------------------------------

SLOTS = 14  # host memory for 14 blocks: A's 12 and two more


@pytest.mark.parametrize("retain", [True, False])
def test_a_sessions_blocks_are_evicted_last_from_host_memory(tiny_checkpoint, expected, retain):
    first, turn2, second = expected
    llm = LLM(str(tiny_checkpoint("llama")), kv_offload_memory=SLOTS * 8192, **POOL)
    retention = "session" if retain else None
    assert tokens(llm, PROMPT_A, kv_retention=retention) == first
    tokens(llm, PROMPT_B)  # their blocks pass through host memory after A's
    tokens(llm, PROMPT_C)
    out = llm.generate([turn2], GREEDY, kv_retention=retention)[0]
    assert out.outputs[0].token_ids == second
    hits = store(llm).stats.host.hits
    # a session's blocks outlast the others'; without retention B and C pushed A's out
    assert hits == (len(PROMPT_A) // BLOCK if retain else 0)
    assert_clean(llm)


def test_a_sessions_blocks_stay_on_disk_for_the_ttl(tiny_checkpoint, expected, tmp_path):
    first, turn2, second = expected
    # room on disk for 13 blocks' files (a 36-byte header each): A's 12 and one more
    options = dict(kv_disk_dir=str(tmp_path), kv_disk_size=13 * (8192 + 36), **POOL)
    llm = LLM(str(tiny_checkpoint("llama")), **options)
    assert tokens(llm, PROMPT_A, kv_retention="session") == first
    store(llm).flush()
    tokens(llm, PROMPT_B)
    tokens(llm, PROMPT_C)
    store(llm).flush()
    assert len(list(tmp_path.rglob("*.kvs"))) == len(PROMPT_A) // BLOCK  # A's, kept
    assert len(list(tmp_path.rglob("*.kvb"))) == 1  # room left for one other block

    restarted = LLM(str(tiny_checkpoint("llama")), **options)  # the promise survives
    out = restarted.generate([turn2], GREEDY, kv_retention="session")[0]
    assert out.outputs[0].token_ids == second
    assert out.num_cached_tokens == len(PROMPT_A) // BLOCK * BLOCK
    assert_clean(restarted)

    # past the TTL a session's blocks are the first to go
    expiring = LLM(str(tiny_checkpoint("llama")), session_ttl=0.2, **options)
    time.sleep(0.5)
    tokens(expiring, PROMPT_B)
    store(expiring).flush()
    assert len(list(tmp_path.rglob("*.kvs"))) < len(PROMPT_A) // BLOCK


def test_kv_retention_is_checked(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), **POOL)
    with pytest.raises(ValueError, match="kv_retention"):
        llm.generate([PROMPT_A], GREEDY, kv_retention="forever")


def test_the_session_header_marks_a_session(tiny_checkpoint):
    from ember.engine.messages import EngineCoreRequest

    core = LLM(str(tiny_checkpoint("llama")), **POOL).engine.core

    def retained(**fields) -> bool:
        request = EngineCoreRequest("r", PROMPT_A, GREEDY, 8, [], **fields)
        return core.intake.make_sequences(request)[0].retain_kv

    assert retained(session_id="agent-7") and retained(kv_retention="session")
    assert not retained()


# -- when blocks are saved: kv_save ----------------------------------------------------------


@pytest.mark.parametrize("policy", ["computed", "finished", "evicted"])
def test_each_save_policy_serves_an_evicted_session(tiny_checkpoint, expected, policy):
    """Write-through, at finish, write-back: the same tokens and hits; they differ in when
    the copies happen (after the step, at the end, when the pool needs the block)."""
    from ember.engine.messages import EngineCoreRequest

    first, turn2, second = expected
    llm = LLM(str(tiny_checkpoint("llama")), kv_offload_memory=1 << 20, kv_save=policy, **POOL)
    core = llm.engine.core
    core.add_request(EngineCoreRequest("a", PROMPT_A, GREEDY, 8, []))
    core.step()  # the whole prompt in one step: 12 full blocks, then decoding
    assert store(llm).stats.host.writes == (12 if policy == "computed" else 0)
    while core.has_unfinished():
        core.step()
    assert store(llm).stats.host.writes == (0 if policy == "evicted" else 12)
    tokens(llm, PROMPT_B)  # B's blocks push A's out of the pool: written back now
    tokens(llm, PROMPT_C)
    assert store(llm).stats.host.writes >= 12
    out = llm.generate([turn2], GREEDY)[0]
    assert out.outputs[0].token_ids == second
    assert out.num_cached_tokens == 12 * BLOCK
    assert store(llm).stats.host.hits == 12
    assert_clean(llm)


def test_an_unknown_save_policy_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="kv_save"):
        LLM(str(tiny_checkpoint("llama")), kv_offload_memory=1 << 20, kv_save="later", **POOL)


def disk_options(tmp_path, host_bytes: int = 1 << 20) -> dict:
    return dict(kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24,
                kv_offload_memory=host_bytes, **POOL)  # fmt: skip


def save_a_to_disk(checkpoint, options: dict, kv_retention: str | None = None) -> None:
    llm = LLM(str(checkpoint), **options)
    tokens(llm, PROMPT_A, kv_retention=kv_retention)
    store(llm).flush()


def step_all(core) -> list[int]:
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    return [t for o in outputs for t in o.new_token_ids]


def test_a_queued_requests_blocks_are_read_into_memory_ahead(tiny_checkpoint, expected, tmp_path):
    """While a request waits, its blocks on disk are read into host memory, so that its
    load when admitted is a memcpy."""
    from ember.engine.messages import EngineCoreRequest

    first, turn2, second = expected
    options = disk_options(tmp_path)
    save_a_to_disk(tiny_checkpoint("llama"), options)
    restarted = LLM(str(tiny_checkpoint("llama")), **options)  # warm disk, empty memory
    core = restarted.engine.core
    core.add_request(EngineCoreRequest("t2", turn2, GREEDY, 8, []))
    store(restarted).flush()  # the prefetch, done before the first step
    assert store(restarted).stats.prefetched == 12
    assert step_all(core) == second
    assert store(restarted).stats.host.hits == 12 and store(restarted).stats.disk.hits == 0
    assert_clean(restarted)


def test_a_load_waits_for_the_prefetch_already_reading_its_blocks(
    tiny_checkpoint, expected, tmp_path, monkeypatch
):
    """A request admitted while its prefetch is still reading from disk takes each block
    from host memory once the prefetch has it: every block is read from disk once."""
    from ember.engine.messages import EngineCoreRequest
    from ember.kv.disk_tier import DiskTier

    first, turn2, second = expected
    options = disk_options(tmp_path)
    save_a_to_disk(tiny_checkpoint("llama"), options)
    reads = []
    read = DiskTier.read

    def slow_read(self, key, length):
        reads.append(key)
        time.sleep(0.05)
        return read(self, key, length)

    monkeypatch.setattr(DiskTier, "read", slow_read)
    restarted = LLM(str(tiny_checkpoint("llama")), **options)
    core = restarted.engine.core
    core.add_request(EngineCoreRequest("t2", turn2, GREEDY, 8, []))
    deadline = time.monotonic() + 5
    while not store(restarted)._fetching and time.monotonic() < deadline:
        time.sleep(0.001)  # the prefetch has claimed the blocks it is about to read
    assert step_all(core) == second
    assert len(reads) == len(set(reads)) == 12
    assert store(restarted).stats.host.hits == 12 and store(restarted).stats.disk.hits == 0
    assert_clean(restarted)


def test_a_sessions_prefetched_blocks_outlast_older_blocks_in_host_memory(
    tiny_checkpoint, expected, tmp_path
):
    """A queued session's blocks read ahead into a full host memory are as recent as any:
    other sessions' blocks saved before its load evict older blocks, not them."""
    from ember.engine.messages import EngineCoreRequest

    first, turn2, second = expected
    options = disk_options(tmp_path, host_bytes=16 * 8192)  # 16 blocks
    save_a_to_disk(tiny_checkpoint("llama"), options, kv_retention="session")
    restarted = LLM(str(tiny_checkpoint("llama")), **options)
    tiers = store(restarted)
    others = [bytes([i]) * 16 for i in range(8)]  # other sessions' blocks, by hash
    tiers.save([(h, 0) for h in others[:4]], retain=True)  # older than the session's
    core = restarted.engine.core
    core.add_request(EngineCoreRequest("t2", turn2, GREEDY, 8, [], kv_retention="session"))
    tiers.flush()
    assert tiers.stats.prefetched == 12  # host memory is full now
    tiers.save([(h, 0) for h in others[4:]], retain=True)  # saved while it waits
    in_memory = [tiers.key(h) in tiers.host for h in others]
    assert in_memory == [False] * 4 + [True] * 4  # the older ones made room
    assert step_all(core) == second
    assert tiers.stats.host.hits == 12 and tiers.stats.disk.hits == 0
    assert_clean(restarted)


def test_ember_up_restarts_a_killed_worker_and_it_serves_warm_from_disk(tiny_checkpoint, tmp_path):
    """`ember up --kv-disk-dir`: each worker its own directory; a session's worker killed
    with SIGKILL is started again by `ember up`, rejoins the router, and the session's next
    turn goes home and loads the prompt from disk instead of computing it."""
    import os
    import signal

    import httpx

    from tests.server_utils import Up, child_pids

    cluster = Up(str(tiny_checkpoint("llama")), "--mixed", "2", "--kv-disk-dir", str(tmp_path),
                 "--worker-restarts", "1")  # fmt: skip
    try:
        headers = {"x-session-affinity": "agent-1"}
        body = {"prompt": PROMPT_A, "max_tokens": 4, "temperature": 0}

        def send() -> dict:
            reply = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers,
                               timeout=60)  # fmt: skip
            assert reply.status_code == 200, reply.text
            return reply.json()

        before = {u: cluster.worker_load(u)["num_prompt_tokens_computed"] for u in cluster.workers}
        answer = send()
        (home,) = [u for u in cluster.workers if cluster.worker_load(u)["num_prompt_tokens_computed"]
                   != before[u]]  # fmt: skip
        ports = {u: int(u.rsplit(":", 1)[1]) for u in cluster.workers}
        index = ports[home] - min(ports.values())  # worker i listens on --worker-port + i
        files = list((tmp_path / f"worker-{index}").glob("*/*.kvs"))  # a session's blocks
        deadline = time.monotonic() + 20
        while len(files) < len(PROMPT_A) // 8 and time.monotonic() < deadline:
            time.sleep(0.1)  # written in the background
            files = list((tmp_path / f"worker-{index}").glob("*/*.kvs"))
        assert len(files) == len(PROMPT_A) // 8  # --block-size 8
        assert not list((tmp_path / f"worker-{1 - index}").glob("*/*.kv*"))

        flag = b"--port\0%d\0" % ports[home]
        (pid,) = [p for p in child_pids(cluster.process.pid)
                  if flag in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # down, then started again and healthy
            time.sleep(0.3)
            try:
                healthy = {w["url"]: w["healthy"] for w in cluster.load()["workers"]}
                if healthy[home] and cluster.worker_load(home)["num_prompt_tokens_computed"] == 0:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                continue
        else:
            raise AssertionError("the killed worker did not come back")
        assert pid not in child_pids(cluster.process.pid)

        again = send()  # the same prompt, home again: 25 blocks on disk, the last recomputed
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT_A) - 8
        restarted = cluster.worker_load(home)
        assert restarted["num_prompt_tokens_computed"] == 8
        assert restarted["kv_tiers"]["disk"]["hits"] == len(PROMPT_A) // 8 - 1
        cluster.wait_no_blocks()
    finally:
        cluster.stop()


class _SmallDisk:
    """A file system with room for `room` bytes of block files under one directory, in
    place of DiskTier._write_file: ENOSPC past that, like a disk that fills up."""

    def __init__(self, directory: Path, room: int) -> None:
        self.directory, self.room = directory, room

    def __call__(self, path: Path, header: bytes, data: bytes) -> None:
        import errno

        used = sum(p.stat().st_size for p in self.directory.rglob("*.kv?"))
        if used + len(header) + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        path.write_bytes(header + data)


def _disk_tier(tmp_path: Path, monkeypatch, room: int):
    from ember.kv.disk_tier import DiskTier
    from ember.kv.tiers import TierCounters

    monkeypatch.setattr(DiskTier, "_write_file", staticmethod(_SmallDisk(tmp_path, room)))
    return DiskTier(tmp_path, 1 << 30, b"\x01" * 16, TierCounters())


def test_a_full_disk_keeps_the_newest_blocks_that_fit(tmp_path, monkeypatch):
    """A file system that fills up long before --kv-disk-size: the tier keeps the newest
    blocks that fit (older ones make room), counts no error and takes more once there is
    room again."""
    size = 8192 + 36  # a block's file
    tier = _disk_tier(tmp_path, monkeypatch, room=5 * size)
    blocks = {bytes([i]) * 16: bytes([i]) * 8192 for i in range(12)}
    for key, data in blocks.items():
        tier.write(key, data)
    kept = [key for key in blocks if tier.read(key, 8192) == blocks[key]]
    assert kept == list(blocks)[-len(kept) :] and 4 <= len(kept) <= 5  # the newest
    assert tier._stats.writes == 12 and tier._stats.write_errors == 0
    assert tier.num_bytes <= 5 * size and tier.capacity < tier.given
    tier._write_file.room = 9 * size  # room again: the tier grows back into it
    for i in range(12, 24):
        tier.write(bytes([i]) * 16, bytes([i]) * 8192)
    assert tier.num_bytes > 5 * size and tier._stats.write_errors == 0


def test_a_disk_that_fails_loses_blocks_not_requests(tmp_path, monkeypatch, caplog):
    """Writes that fail (no room at all, or an I/O error) are counted and logged at most
    once a minute; the tier holds nothing it did not write."""
    tier = _disk_tier(tmp_path, monkeypatch, room=0)
    with caplog.at_level("WARNING", logger="ember.kv"):
        for i in range(10):
            tier.write(bytes([i]) * 16, bytes([i]) * 8192)
    assert tier._stats.write_errors == 10 and tier._stats.writes == 0
    assert tier.num_bytes == 0 and tier.read(b"\x00" * 16, 8192) is None
    assert sum("not written" in r.message for r in caplog.records) == 1
