"""The KV connector in one process: a prefill engine core hands a prompt's KV to a decode
engine core over each transport, and every way a transfer can go wrong ends with the
request recomputed and no block left allocated on either side."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.engine.speculative import Proposer
from ember.kv import wire
from ember.kv.buffers import SHM_DIR, remove_stale_shm
from ember.kv.params import KVTransferParams
from ember.sampling_params import SamplingParams

PROMPT = list(range(5, 40))  # 35 tokens: 8 full blocks of 4 and a partial one
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(autouse=True)
def secret(monkeypatch):
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", "test-secret")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def make_core(checkpoint, kv_cache_memory=4 << 20, **options) -> EngineCore:
    config = EngineConfig(
        model=checkpoint, kv_cache_memory=kv_cache_memory, block_size=4, **options
    )
    return EngineCore.from_config(config)


def run(core: EngineCore, request: EngineCoreRequest, timeout: float = 30.0):
    core.add_request(request)
    outputs, deadline = [], time.monotonic() + timeout
    while core.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish"
        outputs += core.step()
        time.sleep(0.001)
    return outputs


def tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def prefill(core: EngineCore, request_id: str, prompt=PROMPT, sampling=GREEDY):
    params = KVTransferParams(do_remote_decode=True)
    request = EngineCoreRequest(request_id, prompt, sampling, 1, [], kv_transfer=params)
    outputs = run(core, request)
    assert outputs[-1].finish_reason == "length"
    remote = outputs[-1].kv_transfer_params
    assert remote is not None and remote.num_tokens == len(prompt)
    return remote


def decode(core: EngineCore, request_id: str, remote, prompt=PROMPT, sampling=GREEDY):
    params = KVTransferParams(remote_prefill=remote)
    request = EngineCoreRequest(request_id, prompt, sampling, MAX_TOKENS, [], kv_transfer=params)
    return remote.first_token_ids + tokens(run(core, request))


def settle(*cores: EngineCore, timeout: float = 10.0) -> None:
    """Steps the cores until no block is in use (held transfers released or expired)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for core in cores:
            core.step()
        if all(c.kv_cache.num_free_blocks == c.kv_cache.num_blocks for c in cores):
            break
        time.sleep(0.02)
    for core in cores:
        assert core.kv_cache.check_integrity()
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks, "blocks leaked"


@pytest.fixture(scope="module")
def reference(checkpoint):
    core = make_core(checkpoint)
    yield tokens(run(core, EngineCoreRequest("ref", PROMPT, GREEDY, MAX_TOKENS, [])))
    core.close()


@pytest.fixture
def prefill_core(checkpoint):
    core = make_core(checkpoint, kv_role="prefill", kv_hold_timeout=1.0)
    yield core
    core.close()


def _decode_core(checkpoint, request, **options):
    core = make_core(checkpoint, kv_role="decode", **options)
    request.addfinalizer(core.close)
    return core


@pytest.mark.parametrize("transport", ["tcp", "shm", "auto"])
def test_handed_over_decode_matches_a_mixed_worker(
    transport, checkpoint, prefill_core, reference, request
):
    # a cache of another size than the prefill worker's: block ids and layouts differ
    decode_core = _decode_core(checkpoint, request, kv_transport=transport, kv_cache_memory=3 << 20)
    remote = prefill(prefill_core, "p")
    assert prefill_core.connector.num_held == 1
    assert decode(decode_core, "d", remote) == reference
    stats = decode_core.stats()
    assert stats.num_prompt_tokens_computed == 0  # the prompt came from the prefill worker
    assert (stats.kv_loads_ok, stats.kv_loads_failed) == (1, 0)
    assert stats.kv_bytes_received == len(remote.block_ids) * remote.block_bytes
    if transport == "tcp":
        assert prefill_core.stats().kv_bytes_sent == stats.kv_bytes_received
    settle(prefill_core, decode_core)
    assert prefill_core.stats().kv_holds_expired == 0  # released by the decode worker


def test_a_seeded_random_request_draws_the_same_tokens_when_handed_over(
    checkpoint, prefill_core, request
):
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS)
    mixed = make_core(checkpoint)
    request.addfinalizer(mixed.close)
    want = tokens(run(mixed, EngineCoreRequest("ref", PROMPT, seeded, MAX_TOKENS, [])))
    decode_core = _decode_core(checkpoint, request)
    remote = prefill(prefill_core, "p", sampling=seeded)
    assert decode(decode_core, "d", remote, sampling=seeded) == want
    other = SamplingParams(temperature=1.0, seed=6, max_tokens=MAX_TOKENS)
    assert tokens(run(mixed, EngineCoreRequest("other", PROMPT, other, MAX_TOKENS, []))) != want
    settle(prefill_core, decode_core)


def test_only_blocks_the_decode_worker_lacks_are_sent(checkpoint, prefill_core, reference, request):
    decode_core = _decode_core(checkpoint, request, kv_transport="tcp")
    # the decode worker already computed the first 20 tokens (5 full blocks) itself
    run(decode_core, EngineCoreRequest("warm", PROMPT[:21], GREEDY, 1, []))
    remote = prefill(prefill_core, "p")
    assert decode(decode_core, "d", remote) == reference
    received = decode_core.stats().kv_bytes_received
    assert received == (len(remote.block_ids) - 5) * remote.block_bytes
    assert prefill_core.stats().kv_bytes_sent == received
    settle(prefill_core, decode_core)


def test_a_speculating_decode_worker_matches_a_mixed_worker(
    checkpoint, prefill_core, reference, request
):
    decode_core = _decode_core(
        checkpoint, request, speculative_method="ngram", speculative_adaptive=False
    )

    class Reference(Proposer):  # drafts the reference's tokens, every third one wrong
        def propose(self, requests, num_tokens):
            out = []
            for r, k in zip(requests, num_tokens, strict=True):
                n = r.num_output_tokens
                out.append([t + (i % 3 == 2) for i, t in enumerate(reference[n : n + k], n)])
            return out

    decode_core.speculator.proposer = Reference()
    remote = prefill(prefill_core, "p")
    assert decode(decode_core, "d", remote) == reference
    spec = decode_core.stats().spec_decode
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    settle(prefill_core, decode_core)


def test_an_eagle3_decode_worker_drafts_after_a_handover(
    checkpoint, prefill_core, reference, request, tmp_path
):
    """The head never saw the prompt (prefilled elsewhere): it drafts from the decode
    worker's own steps on, and the output is the mixed worker's."""
    from test_hidden_drafters import write_eagle3

    head = write_eagle3(tmp_path / "eagle3", layers=[0, 1, 2])  # the tiny model's 2 layers
    decode_core = _decode_core(
        checkpoint, request, speculative_method="eagle3", speculative_model=str(head),
        speculative_adaptive=False,
    )  # fmt: skip
    remote = prefill(prefill_core, "p")
    assert decode(decode_core, "d", remote) == reference
    assert decode_core.stats().spec_decode["num_drafts"] >= 2
    proposer = decode_core.speculator.proposer
    assert not proposer._pending and proposer.head.lm_head.weight.dtype == torch.bfloat16
    settle(prefill_core, decode_core)


@pytest.mark.parametrize("fault", ["fail", "drop", "corrupt"])
def test_a_failed_transfer_is_recomputed_and_frees_every_block(
    fault, checkpoint, prefill_core, reference, request
):
    decode_core = _decode_core(
        checkpoint, request, kv_transport="fake", kv_fake_fault=fault,
        kv_load_timeout=0.5, kv_checksum=True,
    )  # fmt: skip
    remote = prefill(prefill_core, "p")
    assert decode(decode_core, "d", remote) == reference  # recomputed, same tokens
    stats = decode_core.stats()
    assert (stats.kv_loads_ok, stats.kv_loads_failed) == (0, 1)
    assert stats.num_prompt_tokens_computed == len(PROMPT)
    settle(prefill_core, decode_core)


def test_a_peer_without_the_secret_is_refused(
    checkpoint, prefill_core, reference, request, monkeypatch
):
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", "wrong")
    decode_core = _decode_core(checkpoint, request, kv_transport="tcp", kv_load_timeout=1.0)
    remote = prefill(prefill_core, "p")
    assert decode(decode_core, "d", remote) == reference
    assert decode_core.stats().kv_loads_failed == 1
    assert prefill_core.stats().kv_bytes_sent == 0
    # the refused peer could not release the blocks either: they expire
    settle(prefill_core, decode_core)
    assert prefill_core.stats().kv_holds_expired == 1


def test_the_endpoint_serves_only_held_blocks(prefill_core):
    remote = prefill(prefill_core, "p")
    server = prefill_core.connector.get("disagg").worker.server
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        wire.prepare(sock, 5.0)
        wire.authenticate_server(sock, b"test-secret")
        unheld = max(remote.block_ids) + 1
        wire.send_frame(sock, wire.Fetch(remote.transfer_id, [unheld]))
        reply = wire.recv_reply(sock)
        assert not reply.ok and "does not hold" in reply.error
        wire.send_frame(sock, wire.Fetch("no-such-transfer", remote.block_ids[:1]))
        assert not wire.recv_reply(sock).ok
        wire.send_frame(sock, wire.Release(remote.transfer_id))
        assert wire.recv_reply(sock).ok
    settle(prefill_core)


def test_an_unclaimed_prefill_frees_its_blocks_after_the_hold_timeout(prefill_core):
    prefill(prefill_core, "p")
    assert prefill_core.kv_cache.num_free_blocks < prefill_core.kv_cache.num_blocks
    settle(prefill_core)  # kv_hold_timeout is 1 s
    assert prefill_core.stats().kv_holds_expired == 1


def test_aborting_a_request_while_its_kv_arrives_frees_its_blocks_after(
    checkpoint, prefill_core, request
):
    decode_core = _decode_core(checkpoint, request, kv_transport="fake", kv_fake_fault="delay:0.5")
    remote = prefill(prefill_core, "p")
    params = KVTransferParams(remote_prefill=remote)
    decode_core.add_request(
        EngineCoreRequest("d", PROMPT, GREEDY, MAX_TOKENS, [], kv_transfer=params)
    )
    decode_core.step()
    assert decode_core.stats().num_waiting_for_kv == 1
    decode_core.abort_requests(["d"])
    assert "d" not in decode_core.scheduler.requests
    assert decode_core.kv_cache.num_free_blocks < decode_core.kv_cache.num_blocks  # still busy
    settle(prefill_core, decode_core)


def test_bad_kv_transfer_params_are_refused(checkpoint, prefill_core, request):
    decode_core = _decode_core(checkpoint, request)
    remote = prefill(prefill_core, "p")
    with pytest.raises(ValueError, match="prompt"):
        decode(decode_core, "d", remote, prompt=PROMPT[:-1])
    two = SamplingParams(temperature=0.0, max_tokens=4, n=2)
    params = KVTransferParams(remote_prefill=remote)
    with pytest.raises(ValueError, match="n = 1"):
        decode_core.add_request(EngineCoreRequest("x", PROMPT, two, 4, [], kv_transfer=params))
    assert not decode_core.has_unfinished()
    prefill_core.abort_requests(["p"])  # the frontend gives the held prefill up
    settle(prefill_core, decode_core)
    assert prefill_core.stats().kv_holds_expired == 0


def test_a_decode_worker_trusts_no_endpoint_without_the_secret():
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def impostor():  # accepts any proof and answers garbage
        conn, _ = server.accept()
        conn.sendall(b"n" * wire.NONCE_BYTES)
        wire.recv_exact(conn, 32 + wire.NONCE_BYTES)
        conn.sendall(b"x" * 32)
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    with socket.create_connection(server.getsockname(), timeout=5) as sock:
        with pytest.raises(ConnectionError, match="secret"):
            wire.authenticate_server(sock, b"test-secret")
    server.close()


def test_a_prefill_worker_needs_the_secret(checkpoint, monkeypatch):
    monkeypatch.delenv("EMBER_CLUSTER_SECRET")
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(ValueError, match="EMBER_CLUSTER_SECRET"):
        make_core(checkpoint, kv_role="prefill")
    assert set(os.listdir(SHM_DIR)) <= before  # its shared-memory KV file is gone too


def test_a_killed_engines_shared_memory_file_is_removed_by_the_next(prefill_core):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    stale = os.path.join(SHM_DIR, f"ember-kv-{dead}-00000000")
    open(stale, "wb").close()
    own = prefill_core.runner.kv_shm_path
    remove_stale_shm()
    assert not os.path.exists(stale) and os.path.exists(own)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_disaggregated_worker_on_cuda_is_refused_up_front(role):
    # KV transfers read and write the KV tensors as host memory
    with pytest.raises(ValueError, match="device cpu"):
        EngineConfig(kv_role=role, device="cuda")
