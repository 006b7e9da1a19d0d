"""The CUDA path: the same engine on a GPU (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch
from test_bf16_prefill import GREEDY as GREEDY_16
from test_bf16_prefill import _hf_bf16_greedy as hf_greedy
from test_kv_cache_dtype import rounded_kv_reference
from test_models import GREEDY, PROMPTS, SMALL_KV, hf_reference, token_ids
from test_sampling import make_request

from ember import LLM, SamplingParams
from ember.engine.sampler import apply_penalties
from ember.model_config import MoEConfig
from ember.models import moe
from ember.models.moe import Experts

pytestmark = pytest.mark.gpu

# the KV cache sized from free GPU memory, a small share of it: a tiny model's blocks are
# so small that 90% of an 80 GB card is 18 million of them (20 s to set up)
SMALL_SHARE = dict(kv_cache_memory_fraction=0.02)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_on_cuda_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch)
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=64)
    assert llm.engine.core.runner.device.type == "cuda"
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


def test_bfloat16_default_on_cuda_runs_and_frees_every_block(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), device="cuda", max_model_len=512, **SMALL_SHARE)
    assert llm.engine.core.runner.dtype == torch.bfloat16
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.7, seed=1, max_tokens=16))
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()


def test_a_context_shorter_than_the_step_budget_sizes_its_kv_cache(tiny_checkpoint):
    # the profiling step before the free-memory reading once ran 512 positions through
    # tables of 64: a device-side assert
    llm = LLM(str(tiny_checkpoint("llama")), device="cuda", max_model_len=64, **SMALL_SHARE)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_bf16_kv_cache_on_cuda_matches_transformers_with_keys_and_values_rounded(
    tiny_checkpoint, monkeypatch
):
    """fp32 weights over a bf16 cache on CUDA (torch's SDPA reads it in fp32): greedy
    tokens are transformers' in fp32 with each key (after rotary) and value rounded to
    bf16; every block comes back."""
    path = tiny_checkpoint("llama")
    reference = rounded_kv_reference(path, monkeypatch)
    expected = [hf_greedy(reference, prompt)[0] for prompt in PROMPTS]
    llm = LLM(
        str(path), device="cuda", dtype="float32", kv_cache_dtype="bfloat16",
        max_num_batched_tokens=64, **SMALL_KV,
    )  # fmt: skip
    assert {t.dtype for t in llm.engine.core.runner.kv_caches} == {torch.bfloat16}
    assert token_ids(llm.generate(PROMPTS, GREEDY_16)) == expected
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()


def test_penalties_on_cuda_equal_the_cpu_ones():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    requests = [make_request(params, prompt=[i, 7], output=[i + 1, 9, 9]) for i in range(3)]
    on_cuda = apply_penalties(logits.cuda(), requests)
    torch.testing.assert_close(on_cuda.cpu(), apply_penalties(logits, requests))


def test_every_sampling_option_on_cuda(tiny_checkpoint):
    params = SamplingParams(
        n=3, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=7, max_tokens=24,
        ignore_eos=True, logprobs=3, repetition_penalty=1.2, presence_penalty=0.3,
        frequency_penalty=0.2,
    )  # fmt: skip
    llm = LLM(str(tiny_checkpoint("llama")), device="cuda", dtype="float32", **SMALL_KV)
    outs, again = (llm.generate(PROMPTS[:2], params) for _ in range(2))
    samples = [[c.token_ids for c in o.outputs] for o in outs]
    assert samples == [[c.token_ids for c in o.outputs] for o in again]  # seeded: repeatable
    assert all(len(s) == 3 and len(set(map(tuple, s))) > 1 for s in samples)
    for choice in outs[0].outputs:
        assert len(choice.token_ids) == len(choice.logprobs) == 24
        for token, entry in zip(choice.token_ids, choice.logprobs, strict=True):
            assert next(iter(entry)) == token and len(entry) >= 3
            assert all(value <= 0 for value in entry.values())
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()


MOE = ["deepseek_v3", "deepseek_v3_plain", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("arch", MOE)
def test_moe_models_on_cuda_match_transformers_with_grouped_experts(
    tiny_checkpoint, arch, monkeypatch
):
    """DeepSeek-V3 (MLA), Qwen3-MoE and Mixtral in fp32 on CUDA: transformers' greedy
    tokens with chunked prefill and prefix-cache hits, the experts run as grouped GEMMs
    (torch's grouped_mm; in fp32 torch loops over the groups on the device)."""
    calls, grouped_mm = [], moe.GROUPED_MM

    def counted(*args, **kwargs):
        calls.append(args[0].device.type)
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(moe, "GROUPED_MM", counted)
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch, 12)
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=48, **SMALL_KV)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert token_ids(llm.generate(PROMPTS, params)) == expected
    again = llm.generate(PROMPTS, params)
    assert token_ids(again) == expected and again[0].num_cached_tokens > 0
    assert calls and set(calls) == {"cuda"}
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()


@pytest.mark.parametrize("shape", [(64, 32, 8, 2), (2048, 1408, 64, 6)])
def test_grouped_bf16_experts_on_cuda_equal_the_loop(shape):
    """In bf16 on a Hopper GPU the grouped GEMM is CUTLASS's kernel: its result stays
    within bf16 rounding of one matmul per expert, for 1 to 4,096 tokens."""
    hidden_size, inter, num_experts, top_k = shape
    config = MoEConfig(num_experts, top_k, inter, scoring="softmax", norm_topk_prob=True)
    layer = Experts(hidden_size, config).to("cuda", torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        layer.gate_up_proj.normal_(std=0.05)
        layer.down_proj.normal_(std=0.05)
        for tokens in (1, 7, 300, 4096):
            hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, num_experts, (tokens, top_k), device="cuda")
            weights = torch.rand(tokens, top_k, device="cuda")
            assert layer.grouped(hidden)
            grouped = layer(hidden, weights, ids).float()
            layer.mode = "loop"
            loop = layer(hidden, weights, ids).float()
            layer.mode = "auto"
            assert (grouped - loop).abs().max() <= 0.02 * loop.abs().max()


def test_kv_tiers_on_cuda_serve_an_evicted_session_from_pinned_memory_and_disk(
    tiny_checkpoint, tmp_path
):
    """A session evicted from a tiny GPU pool comes back from pinned host memory, then, in
    a new engine, from disk: the tokens computing it gives, and fewer prompt tokens
    computed."""
    path = str(tiny_checkpoint("llama"))
    pool = dict(device="cuda", dtype="float32", kv_cache_memory=20 * 8192, max_model_len=256)
    prompts = [[(m * i) % 470 + 3 for i in range(200)] for m in (7, 11, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    scratch = LLM(path, enable_prefix_caching=False, **pool)
    first = scratch.generate([prompts[0]], params)[0].outputs[0].token_ids
    turn2 = prompts[0] + first + [5, 6, 7, 8]
    second = scratch.generate([turn2], params)[0].outputs[0].token_ids

    disk = dict(kv_disk_dir=str(tmp_path), kv_disk_size=1 << 24)
    llm = LLM(path, kv_offload_memory=1 << 20, **disk, **pool)
    tiers = llm.engine.core.kv_store
    assert tiers.host.buffer.is_pinned() and tiers.device_blocks is not None
    for prompt in prompts:
        llm.generate([prompt], params)  # the first prompt's blocks leave the GPU pool
    before = llm.engine.core.scheduler.num_prompt_tokens_computed
    out = llm.generate([turn2], params)[0]
    assert out.outputs[0].token_ids == second
    assert tiers.stats.host.hits * 16 == out.num_cached_tokens >= 12 * 16
    computed = llm.engine.core.scheduler.num_prompt_tokens_computed - before
    assert computed == len(turn2) - out.num_cached_tokens
    tiers.flush()

    restarted = LLM(path, **disk, **pool)
    out = restarted.generate([turn2], params)[0]
    assert out.outputs[0].token_ids == second
    assert restarted.engine.core.kv_store.stats.disk.hits * 16 == out.num_cached_tokens > 0
    kv = restarted.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()
