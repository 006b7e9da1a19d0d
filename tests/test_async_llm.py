"""The async interface streams per step, matches the offline API, and frees on cancel."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from ember import LLM, SamplingParams, envs
from ember.engine.async_llm import AsyncLLM, EngineDeadError

PROMPT = [(5 * i) % 400 + 7 for i in range(50)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def async_llm(tiny_checkpoint):
    engine = AsyncLLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24)
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, **kw):
    return [out async for out in engine.generate(prompt, params, **kw)]


def test_streams_one_token_per_step_and_matches_offline(tiny_checkpoint, async_llm):
    expected = LLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24).generate(
        [PROMPT], GREEDY
    )[0]

    async def main():
        return await asyncio.gather(*(collect(async_llm, PROMPT, GREEDY) for _ in range(3)))

    for stream in asyncio.run(main()):
        assert len(stream) == 12 and stream[-1].finished and not stream[0].finished
        deltas = [t for out in stream for t in out.outputs[0].delta_token_ids]
        assert deltas == expected.outputs[0].token_ids
        assert "".join(o.outputs[0].delta_text for o in stream) == expected.outputs[0].text


def test_leaving_the_stream_aborts_and_frees_blocks(async_llm):
    async def main():
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        async for _ in async_llm.generate(PROMPT, long):
            break  # client went away after the first token
        for _ in range(100):
            await asyncio.sleep(0.02)
            stats = async_llm.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
        return stats

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_bad_input_raises_and_engine_keeps_serving(async_llm):
    async def main():
        with pytest.raises(ValueError, match="max_tokens"):
            await collect(async_llm, PROMPT, SamplingParams(max_tokens=10**6))
        with pytest.raises(ValueError, match="empty"):
            await collect(async_llm, [], GREEDY)
        return await collect(async_llm, PROMPT, GREEDY)

    assert asyncio.run(main())[-1].finished


def test_shutdown_fails_live_requests_instead_of_hanging(async_llm):
    async def main():
        stream = async_llm.generate(PROMPT, SamplingParams(max_tokens=900, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, async_llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert async_llm.dead
    assert async_llm.client.process.returncode == 0  # the core aborted its work and exited


def test_a_killed_engine_core_fails_live_and_new_requests(async_llm):
    """Each failure says whether the core had taken the request (a router may run one it
    never took elsewhere, but not one that may have killed the core)."""

    async def main():
        stream = async_llm.generate(PROMPT, SamplingParams(max_tokens=900, ignore_eos=True))
        await stream.__anext__()
        async_llm.client.process.kill()
        # sent before the death is noticed, into a core that is gone: never taken
        with pytest.raises(EngineDeadError) as unseen:
            await collect(async_llm, PROMPT, GREEDY)
        with pytest.raises(EngineDeadError, match="exited") as live:
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError) as later:
            await collect(async_llm, PROMPT, GREEDY)
        return unseen.value.started, live.value.started, later.value.started

    assert asyncio.run(main()) == (False, True, False)
    assert async_llm.dead


@pytest.mark.parametrize("stop_at", ["backoff", "loading", "restarted"])
def test_a_restarted_core_serves_and_a_shutdown_at_any_moment_leaves_nothing(
    tiny_checkpoint, stop_at
):
    from server_utils import child_pids

    engine = AsyncLLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24, restarts=2)
    try:
        expected = asyncio.run(collect(engine, PROMPT, GREEDY))[-1].outputs[0].token_ids
        first = engine.client
        first.process.kill()
        deadline = time.monotonic() + 60
        while not engine.dead:  # noticed within the reader's poll
            time.sleep(0.01)
        while stop_at != "backoff" and engine.client is first and not child_pids(os.getpid()):
            time.sleep(0.01)  # loading: the new core's process is up, not yet ready
        while stop_at == "restarted" and engine.dead:
            assert time.monotonic() < deadline, "the core did not restart"
            time.sleep(0.05)
        if stop_at == "restarted":
            again = asyncio.run(collect(engine, PROMPT, GREEDY))[-1].outputs[0].token_ids
            assert again == expected and engine.num_restarts == 1
        else:
            assert engine.dead and engine.restarting
    finally:
        engine.shutdown()
    assert not child_pids(os.getpid())  # the core, old or new, is gone


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_engine_core_spins_longer_unless_told_otherwise(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    engine = AsyncLLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24)
    try:
        spin = _environ(engine.client.process.pid).get("GOMP_SPINCOUNT")
        assert spin == envs.ENGINE_GOMP_SPINCOUNT
    finally:
        engine.shutdown()
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")  # a user's own setting wins
    assert envs.engine_core_env()["GOMP_SPINCOUNT"] == "1000"


def test_a_request_the_core_cannot_take_is_refused_and_the_core_goes_on():
    """Whatever `add_request` raises, the engine-core loop answers with a RequestError and
    keeps serving the other requests in the same batch of messages."""
    import msgspec
    import zmq

    from ember.engine.core_proc import EngineCoreProc
    from ember.engine.messages import EngineCoreRequest

    class Core:
        added: list[str] = []

        def add_request(self, request):
            if request.request_id == "bad":
                raise RuntimeError("boom")
            self.added.append(request.request_id)

    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.bind("inproc://core-input")
    push.connect("inproc://core-input")
    encode = msgspec.msgpack.Encoder().encode
    for request_id in ("bad", "good"):
        push.send(encode(EngineCoreRequest(request_id, [1, 2], SamplingParams(), 4, [0])))
    proc = EngineCoreProc(Core(), pull, None)
    errors = []
    while len(errors) + len(Core.added) < 2:
        errors += proc._drain_inputs()
    assert [(e.request_id, e.message) for e in errors] == [("bad", "RuntimeError: boom")]
    assert Core.added == ["good"]
    push.close(0)
    pull.close(0)
    context.term()
