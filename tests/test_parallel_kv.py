"""KV of a model over ranks (ember.kv.layout): a prefill worker hands a prompt's KV to a
decode worker whose ranks split it the same way (tensor to tensor) or otherwise (one
rank to two, two to one, pipeline stages to tensor-parallel ranks, KV heads shared by
ranks), over TCP and shared memory, and the decode worker's tokens are a mixed worker's;
the KV tiers serve a model over ranks after eviction and a restart; no block is leaked."""

from __future__ import annotations

import time

import pytest
import test_kv_connector
import torch
from test_kv_connector import GREEDY, MAX_TOKENS, PROMPT, decode, make_core, prefill, run, settle
from test_kv_connector import tokens as step_tokens
from test_kv_tiers import BLOCK, PROMPT_A, PROMPT_B, PROMPT_C, computed, reference_turns, tokens
from test_kv_tiers import GREEDY as TURN

from ember import LLM
from ember.config import EngineConfig
from ember.distributed import shm_comm
from ember.engine.core_client import EngineCoreClient
from ember.engine.messages import EngineCoreOutputs, EngineCoreRequest
from ember.kv.layout import Piece, WorkerKV, reshard, reshard_plan, staging
from ember.kv.params import KVTransferParams

pytestmark = pytest.mark.skipif(not shm_comm.ORDERED_STORES, reason="x86-64 ranks")

TP2 = dict(tensor_parallel_size=2)
TP4 = dict(tensor_parallel_size=4)  # the tiny llama's 2 KV heads: each on two ranks
PP2 = dict(pipeline_parallel_size=2)
# fixtures of the one-process hand-off tests: the tiny llama's path, the cluster secret
checkpoint, secret = test_kv_connector.checkpoint, test_kv_connector.secret


@pytest.fixture(scope="module")
def reference(checkpoint):
    core = make_core(checkpoint)
    yield step_tokens(run(core, EngineCoreRequest("ref", PROMPT, GREEDY, MAX_TOKENS, [])))
    core.close()


def _core(checkpoint, request, **options):
    core = make_core(checkpoint, **options)
    request.addfinalizer(core.close)
    return core


class PrefillProcess:
    """A prefill engine core in a process of its own (with its ranks: one process can be
    rank 0 of one model only), driven through its input and output sockets."""

    def __init__(self, checkpoint: str, **options) -> None:
        config = EngineConfig(model=checkpoint, kv_cache_memory=4 << 20, block_size=4,
                              kv_role="prefill", kv_hold_timeout=5.0, **options)  # fmt: skip
        self.client = EngineCoreClient(config)
        self.client.wait_ready()
        self.stats = None

    def run(self, request: EngineCoreRequest) -> list:
        self.client.send(request)
        outputs, deadline = [], time.monotonic() + 60
        while not outputs or outputs[-1].finish_reason is None:
            assert time.monotonic() < deadline, "the prefill worker did not finish"
            message = self.client.recv(100)
            if isinstance(message, EngineCoreOutputs):
                assert not message.errors, message.errors
                outputs += [o for o in message.outputs if o.request_id == request.request_id]
                self.stats = message.stats
        return outputs

    def prefill(self, request_id: str):
        params = KVTransferParams(do_remote_decode=True)
        outputs = self.run(EngineCoreRequest(request_id, PROMPT, GREEDY, 1, [], kv_transfer=params))
        assert outputs[-1].finish_reason == "length"
        return outputs[-1].kv_transfer_params

    def assert_released(self) -> None:
        """Every hold released by its decode worker (none expired, none left)."""
        self.run(EngineCoreRequest("probe", PROMPT[:3], GREEDY, 1, []))
        assert (self.stats.kv_held, self.stats.kv_holds_expired) == (0, 0)


@pytest.fixture(scope="module")
def prefill_workers(tiny_checkpoint):
    """A function (ranks, arch) -> its prefill process (one per model and layout)."""
    started: dict[str, PrefillProcess] = {}

    def get(ranks: dict, arch: str = "llama") -> PrefillProcess:
        key = repr((arch, sorted(ranks.items())))
        if key not in started:
            started[key] = PrefillProcess(str(tiny_checkpoint(arch)), **ranks)
        return started[key]

    yield get
    for worker in started.values():
        worker.client.shutdown()


@pytest.mark.parametrize(
    "prefill_ranks, decode_ranks, transport",
    [
        (TP2, TP2, "tcp"),  # the same split: tensor to tensor
        (TP2, TP2, "shm"),
        ({}, TP2, "tcp"),  # one rank to two: resharded on arrival
        (TP2, {}, "shm"),  # two to one, out of the prefill worker's file
        (PP2, TP2, "tcp"),  # layers split to heads split
        ({}, TP4, "shm"),  # each KV head to two ranks
        (TP4, PP2, "tcp"),  # a shared KV head moves once
    ],
    ids=["tp2-tp2-tcp", "tp2-tp2-shm", "tp1-tp2", "tp2-tp1", "pp2-tp2", "tp1-tp4", "tp4-pp2"],
)
def test_a_handed_over_prompt_decodes_as_one_process_would(
    checkpoint, reference, request, prefill_workers, prefill_ranks, decode_ranks, transport
):
    prefill_worker = prefill_workers(prefill_ranks)
    decode_core = _core(checkpoint, request, kv_role="decode", kv_transport=transport,
                        kv_cache_memory=3 << 20, **decode_ranks)  # fmt: skip
    remote = prefill_worker.prefill(request.node.callspec.id)
    # each KV head of each layer sent once (not again from a rank that shares it)
    sent = sorted((p.layer, h) for p in remote.pieces() for h in range(p.head_start, p.head_stop))
    assert sent == [(layer, head) for layer in range(2) for head in range(2)]
    assert decode(decode_core, "d", remote) == reference
    stats = decode_core.stats()
    assert stats.num_prompt_tokens_computed == 0  # the prompt came from the prefill worker
    assert (stats.kv_loads_ok, stats.kv_loads_failed) == (1, 0)
    assert stats.kv_bytes_received == len(remote.block_ids) * remote.block_bytes
    settle(decode_core)
    prefill_worker.assert_released()


MLA_TP2 = dict(tensor_parallel_size=2, expert_parallel=True)


@pytest.mark.parametrize(
    "prefill_ranks, decode_ranks, transport",
    [(MLA_TP2, {}, "shm"), ({}, MLA_TP2, "tcp"), (MLA_TP2, MLA_TP2, "tcp")],
    ids=["tp2-tp1", "tp1-tp2", "tp2-tp2"],
)
def test_latent_attention_kv_moves_once_whatever_the_ranks(
    tiny_checkpoint, request, prefill_workers, prefill_ranks, decode_ranks, transport
):
    """DeepSeek-V3 keeps the whole latent on every rank: one copy moves, and each decode
    rank gets it."""
    path = str(tiny_checkpoint("deepseek_v3"))
    mixed = _core(path, request)
    want = step_tokens(run(mixed, EngineCoreRequest("ref", PROMPT, GREEDY, MAX_TOKENS, [])))
    prefill_worker = prefill_workers(prefill_ranks, "deepseek_v3")
    decode_core = _core(path, request, kv_role="decode", kv_transport=transport,
                        **decode_ranks)  # fmt: skip
    remote = prefill_worker.prefill(request.node.callspec.id)
    layers = mixed.model_config.num_hidden_layers
    assert remote.pieces() == [Piece(layer, 0, 1) for layer in range(layers)]
    assert decode(decode_core, "d", remote) == want
    assert decode_core.stats().num_prompt_tokens_computed == 0
    settle(decode_core)
    prefill_worker.assert_released()


def test_a_mixed_worker_over_ranks_refuses_handed_over_prompts(checkpoint, request):
    """Its ranks' KV is their own (no shared file): it says so rather than decode a prompt
    whose KV would reach rank 0 only."""
    prefill_core = _core(checkpoint, request, kv_role="prefill")
    remote = prefill(prefill_core, "p")
    mixed = _core(checkpoint, request, **TP2)
    assert mixed.runner.worker_kv is None and mixed.runner.kv_shm_path is None
    params = KVTransferParams(remote_prefill=remote)
    with pytest.raises(ValueError, match="kv_transfer_params: this worker takes no handed"):
        mixed.add_request(EngineCoreRequest("d", PROMPT, GREEDY, MAX_TOKENS, [],
                                            kv_transfer=params))  # fmt: skip
    prefill_core.connector.drop_hold("p")
    settle(prefill_core, mixed)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return reference_turns(checkpoint)


@pytest.mark.parametrize("ranks", [TP4, PP2], ids=["tp4", "pp2"])
def test_tiers_serve_a_model_over_ranks_after_eviction_and_a_restart(
    checkpoint, expected, tmp_path, ranks
):
    """Host memory, then disk after a restart: every rank's blocks (TP=4: each KV head
    stored once, copied to the rank that shares it on load)."""
    first, turn2, second = expected
    # the pool of 20 blocks of test_kv_tiers, per rank: a rank keeps 1/2 of each block
    per_rank = dict(kv_cache_memory=20 * 8192 // 2, max_model_len=256)
    options = dict(kv_offload_memory=1 << 20, kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24,
                   **per_rank, **ranks)  # fmt: skip
    with LLM(checkpoint, **options) as llm:
        assert tokens(llm, PROMPT_A) == first
        tokens(llm, PROMPT_B)  # A's blocks leave the pool (into host memory, then disk)
        tokens(llm, PROMPT_C)
        out = llm.generate([turn2], TURN)[0]
        assert out.outputs[0].token_ids == second
        store = llm.engine.core.kv_store
        assert store.stats.host.hits * BLOCK == out.num_cached_tokens >= 12 * BLOCK
        store.flush()
    with LLM(checkpoint, **options) as restarted:  # an empty pool, a warm disk
        out = restarted.generate([turn2], TURN)[0]
        assert out.outputs[0].token_ids == second
        assert out.num_cached_tokens >= 12 * BLOCK
        assert computed(restarted) == len(turn2) - out.num_cached_tokens
        kv = restarted.engine.core.kv_cache
        assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()


def test_tiers_keep_apart_workers_that_split_the_kv_otherwise(checkpoint, tmp_path):
    """A block stored by one rank is not what two ranks keep: they never share one."""
    options = dict(kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24, kv_cache_memory=20 * 8192,
                   max_model_len=256)  # fmt: skip
    with LLM(checkpoint, **options) as one:
        tokens(one, PROMPT_A)
        one.engine.core.kv_store.flush()
    with LLM(checkpoint, **options, **TP2) as two:
        out = two.generate([PROMPT_A], TURN)[0]
        assert out.num_cached_tokens == 0


# -- the layout, piece by piece ------------------------------------------------------------


def _pieces(layers: int, splits: list[tuple[int, int]]) -> list[Piece]:
    return [Piece(layer, a, b) for layer in range(layers) for a, b in splits]


def test_reshard_plans() -> None:
    one, two = _pieces(2, [(0, 4)]), _pieces(2, [(0, 2), (2, 4)])
    assert reshard_plan(one, two) == [[(0, 0, 0, 2)], [(0, 2, 0, 2)], [(1, 0, 0, 2)],
                                      [(1, 2, 0, 2)]]  # fmt: skip
    assert reshard_plan(two, one) == [[(0, 0, 0, 2), (1, 0, 2, 2)], [(2, 0, 0, 2), (3, 0, 2, 2)]]
    # uneven splits both sides: 3 heads as 2+1 to 1+2
    assert reshard_plan(_pieces(1, [(0, 2), (2, 3)]), _pieces(1, [(0, 1), (1, 3)])) == [
        [(0, 0, 0, 1)], [(0, 1, 0, 1), (1, 0, 1, 1)],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no head 2 of layer 0"):
        reshard_plan(_pieces(2, [(0, 2)]), two)
    with pytest.raises(ValueError, match="of layer 2"):
        reshard_plan(one, _pieces(3, [(0, 4)]))


def test_reshard_moves_each_head_where_it_belongs() -> None:
    """Blocks of a one-rank worker's layer land, head by head, in two ranks' tensors."""
    src = torch.arange(2 * 3 * 4 * 4 * 2, dtype=torch.float32).view(2, 3, 4, 4, 2)
    dst = [torch.zeros(2, 6, 4, 2, 2), torch.zeros(2, 6, 4, 2, 2)]
    plan = reshard_plan([Piece(0, 0, 4)], [Piece(0, 0, 2), Piece(0, 2, 4)])
    reshard([src], plan, dst, [5, 0, 2])
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(dst[rank][:, [5, 0, 2]], src[:, :, :, heads])
        assert not dst[rank][:, [1, 3, 4]].any()
    assert staging([Piece(0, 0, 3)], dst[0], 5)[0].shape == (2, 5, 4, 3, 2)


def test_worker_kv_moves_each_piece_once_and_fills_its_replicas() -> None:
    tensors = [torch.zeros(1, 4, 2, 1, 3) for _ in range(4)]
    # 2 ranks each holding the whole latent of 2 layers (MLA over ranks)
    kv = WorkerKV.of(tensors, _pieces(2, [(0, 1)]) * 2, "/dev/shm/x", [0, 10, 20, 30])
    assert kv.pieces == _pieces(2, [(0, 1)]) and kv.shm_offsets == [0, 10]
    assert [t is tensors[i] for i, t in enumerate(kv.tensors)] == [True, True]
    assert len(kv.every_tensor()) == 4
    kv.tensors[1][:, 2] = 7.0
    kv.fill_replicas([2])
    assert tensors[3][:, 2].eq(7.0).all() and not tensors[3][:, [0, 1, 3]].any()
    assert kv.check_sender(_pieces(2, [(0, 1)]), kv.head_block_bytes * 2) is None
    with pytest.raises(ValueError, match="layout differs"):
        kv.check_sender(_pieces(2, [(0, 1)]), kv.head_block_bytes * 2 + 4)


def test_a_float32_senders_blocks_never_land_in_a_bf16_cache() -> None:
    """kv_cache_dtype: a decode worker's bf16 cache refuses a prefill worker's float32
    blocks (twice the bytes per head), and the other way round."""
    pieces = _pieces(2, [(0, 2)])
    half = WorkerKV.of([torch.zeros(2, 4, 16, 2, 8, dtype=torch.bfloat16)] * 2, pieces)
    full = WorkerKV.of([torch.zeros(2, 4, 16, 2, 8)] * 2, pieces)
    assert full.head_block_bytes == 2 * half.head_block_bytes
    heads = 4  # 2 layers of 2 heads
    for ours, theirs in [(half, full), (full, half)]:
        assert ours.check_sender(pieces, heads * ours.head_block_bytes) is None
        with pytest.raises(ValueError, match="layout differs"):
            ours.check_sender(pieces, heads * theirs.head_block_bytes)
