"""Data-parallel attention (ember.distributed, `data_parallel_attention`): two ranks of a
mixture-of-experts model, each running attention for its own sequences with the whole
model but the experts, the experts split over both (by expert or within each), tokens
brought to them by all-gather + reduce-scatter or all-to-all: the single process's
greedy tokens and logprobs within 1e-4, with chunked prefill, prefix-cache hits (on the
rank that holds the prefix), preemption and a rank with no sequence in a step; each
rank's KV pool its own; what it does not do yet refused by name."""

from __future__ import annotations

import pytest
from test_tensor_parallel import _assert_same, _run

from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.distributed import shm_comm
from ember.models.moe import Experts

pytestmark = pytest.mark.skipif(not shm_comm.ORDERED_STORES, reason="x86-64 ranks")

DP = dict(tensor_parallel_size=2, data_parallel_attention=True)


@pytest.mark.parametrize(
    "arch, split",
    [
        ("qwen3_moe", dict(expert_parallel=True)),
        ("qwen3_moe", dict(expert_parallel=False)),
        ("qwen3_moe", dict(expert_parallel=True, moe_dispatch="all-to-all")),
        ("deepseek_v3", dict(expert_parallel=True)),
        ("deepseek_v3", dict(expert_parallel=True, moe_dispatch="all-to-all")),
        ("deepseek_v3", dict(expert_parallel=False)),
    ],
)
def test_two_ranks_give_the_single_process_result(tiny_checkpoint, arch: str, split) -> None:
    """Qwen3-MoE (dense layers among the MoE ones) and DeepSeek-V3 (MLA, a shared
    expert, a dense first layer): the three prompts spread over the ranks, the second
    prompt's prefix found again (on its rank: the other one's pool has none of it, and
    that rank runs no sequence in those steps)."""
    path = tiny_checkpoint(arch)
    single, (_, cached) = _run(path, max_num_batched_tokens=16)
    parallel, (_, cached_dp) = _run(path, max_num_batched_tokens=16, **DP, **split)
    _assert_same(single, parallel)
    assert cached == cached_dp == 48  # 3 of the 61-token prompt's blocks


def test_each_rank_runs_its_own_sequences_in_its_own_pool(tiny_checkpoint) -> None:
    """Every rank holds DeepSeek-V3's attention (all heads, the whole latent) and half
    the experts; a rank's pool is as large as one process's (the per-rank budget), so
    the worker holds twice the sequences' KV; the sequences go to both ranks; the
    experts' token counts, each rank counting its own, add up to the single process's."""
    path = str(tiny_checkpoint("deepseek_v3"))
    prompts = [[(7 * i + j) % 500 + 3 for i in range(20 + j)] for j in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0)
    with LLM(path, kv_cache_memory=8 << 20) as llm:
        single = llm.generate(prompts, params)
        blocks = llm.engine.core.kv_cache.num_blocks
        counts = llm.engine.core.runner.expert_tokens()
    with LLM(path, kv_cache_memory=8 << 20, expert_parallel=True, **DP) as llm:
        core = llm.engine.core
        out = llm.generate(prompts, params)
        kv = core.kv_cache
        assert len(kv.pools) == 2 and kv.num_blocks == 2 * blocks
        assert all(pool.cached for pool in kv.pools)  # each rank computed prompts
        assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()
        assert core.runner.expert_tokens() == counts
        attn = core.runner.model.model.layers[0].self_attn
        assert attn.num_heads == 4 and attn.kv_b_proj.weight.shape == (4 * (16 + 12), 16)
        experts = [m for m in core.runner.model.modules() if isinstance(m, Experts)]
        assert experts and all(e.num_local == 4 for e in experts)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in single]


def test_ranks_preempt_in_their_own_pool(tiny_checkpoint) -> None:
    """Pools too small for the sequences on a rank: that rank preempts one of its own
    and recomputes it; the result is one process's."""
    path = tiny_checkpoint("qwen3_moe")
    block_bytes = 4 * 16 * 2 * 2 * 32 * 4  # layers x tokens x (k, v) x KV heads x dim x fp32
    prompts = [[(5 * i + 3 * j) % 500 + 3 for i in range(30)] for j in range(4)]
    options = dict(max_tokens=24, max_model_len=96, max_step_ms=0)
    single, (preempted, _) = _run(path, prompts, kv_cache_memory=8 << 20, **options)
    assert preempted == 0
    # 4 sequences of 4 blocks, 6 blocks a rank: each rank runs out for its second
    parallel, (preempted, _) = _run(
        path, prompts, kv_cache_memory=6 * block_bytes, expert_parallel=True, **DP, **options
    )
    assert preempted > 0
    _assert_same(single, parallel)


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(data_parallel_attention=True), "tensor_parallel_size >= 2"),
        (dict(**DP, moe_dispatch="all-to-all"), "needs expert_parallel"),
        (dict(**DP, pipeline_parallel_size=2), "pipeline_parallel_size=2"),
        (dict(**DP, kv_role="prefill"), "KV connectors"),
        (dict(**DP, kv_offload_memory=1 << 20), "KV connectors"),
        (dict(**DP, speculative_method="ngram"), "speculative_method 'ngram'"),
        (dict(tensor_parallel_size=2, moe_dispatch="all-to-all"), "data_parallel_attention"),
        (dict(**DP, moe_dispatch="broadcast"), "moe_dispatch must be one of"),
    ],
)
def test_what_it_does_not_do_is_refused(options: dict, named: str) -> None:
    with pytest.raises(ValueError, match="moe_dispatch|data_parallel_attention") as error:
        EngineConfig(**options)
    assert named in str(error.value)


def test_a_dense_model_is_refused_before_ranks_start(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        LLM(str(tiny_checkpoint("llama")), kv_cache_memory=8 << 20, **DP)


def test_serve_with_attention_data_parallel(tiny_checkpoint) -> None:
    """`ember serve -tp 2 --data-parallel-attention --expert-parallel`: concurrent
    completions answer as one process does, /load says how the model is split, and
    /metrics counts every token's experts once (each rank its own, summed)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from server_utils import EmberServer, moe_samples

    path = str(tiny_checkpoint("qwen3_moe"))
    prompts = [list(range(10, 40)), list(range(50, 80))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(path, kv_cache_memory=8 << 20) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    flags = ["-tp", "2", "--data-parallel-attention", "--expert-parallel"]
    server = EmberServer(path, *flags, "--kv-cache-memory", "8M")
    try:

        def complete(prompt):
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(complete, prompts))
        load = httpx.get(f"{server.url}/load").json()
        samples = moe_samples(server.url, "ember_moe_expert_tokens")
    finally:
        server.stop()
    assert texts == expected
    assert load["parallel"]["data_parallel_attention"] is True
    experts = [s.value for s in samples if s.name == "ember_moe_expert_tokens"]
    # one MoE layer, 2 experts a token, 35 tokens computed per request (30 + 6 - 1)
    assert sum(experts) == 2 * 35 * 2
