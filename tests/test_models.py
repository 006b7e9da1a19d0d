"""Greedy output and prefill logits equal Hugging Face transformers' on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ARCHS
from ember import LLM, SamplingParams
from ember.engine.request import Request
from ember.engine.step_cost import StepCoefficients, StepCostModel
from ember.engine.step_inputs import profile_batch

NEW_TOKENS = 32
PROMPTS = [
    [(7 * i) % 500 + 3 for i in range(200)],
    [11, 12, 13, 14, 15],
    [(13 * i) % 480 + 5 for i in range(37)],
    [(3 * i) % 490 + 4 for i in range(121)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SMALL_KV = dict(kv_cache_memory=1 << 24)

_hf_cache: dict[tuple[str, int], tuple] = {}


def hf_reference(path, arch, new_tokens=NEW_TOKENS):
    """transformers' greedy continuations of PROMPTS and its model (cached per arch)."""
    if (arch, new_tokens) not in _hf_cache:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        outs = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            outs.append(gen[0, len(prompt) :].tolist())
        _hf_cache[arch, new_tokens] = (model, outs)
    return _hf_cache[arch, new_tokens]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(tiny_checkpoint, arch, backend):
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch)
    llm = LLM(str(path), attention_backend=backend, **SMALL_KV)
    # decode steps take the fused C++ layer where it applies, the Python layers elsewhere
    fused = llm.engine.core.runner.model.model.fused_decode is not None
    assert fused == (backend == "auto" and arch != "qwen3")
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch)
    llm = LLM(str(path), max_num_batched_tokens=24, **SMALL_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_step_budget_chunks_match_transformers(tiny_checkpoint, arch):
    # prefill tokens made too dear for any chunk: while sequences decode, prefill moves
    # by the floor's 5 tokens
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch)
    options = dict(max_num_batched_tokens=64, max_num_seqs=2, min_prefill_tokens=5)
    llm = LLM(str(path), **options, **SMALL_KV)
    dear = StepCoefficients(base=1.0, per_prefill_token=1e6)
    core = llm.engine.core
    core.step_cost = core.scheduler.cost_model = StepCostModel(dear, prior_weight=1e12)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    stats = llm.engine.core.step_stats
    assert stats.num_capped > 10 and stats.last_prefill_cap == 5


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hit_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch)
    llm = LLM(str(path), **SMALL_KV)
    first = llm.generate(PROMPTS, GREEDY)
    second = llm.generate(PROMPTS, GREEDY)
    assert token_ids(first) == expected and token_ids(second) == expected
    # each prompt's full blocks (but never its last token) come from the cache
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch)
    head_dim = 32 if arch == "qwen3" else 16
    block_bytes = 2 * 2 * 16 * 2 * head_dim * 4  # layers * (k, v) * block * kv heads * dim * fp32
    llm = LLM(
        str(path),
        kv_cache_memory=20 * block_bytes,
        max_model_len=256,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    assert llm.engine.core.kv_cache.num_blocks == 20
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv_cache.num_free_blocks == 20
    assert llm.engine.core.kv_cache.check_integrity()


def test_the_profiling_step_fits_a_short_context(tiny_checkpoint):
    # CUDA sizes its KV cache after running the largest step; with max_model_len below the
    # step's token budget that step is several sequences, each within the position tables
    llm = LLM(str(tiny_checkpoint("llama")), max_model_len=40, **SMALL_KV)
    runner = llm.engine.core.runner
    ids, positions, meta, num_blocks = profile_batch(100, 40, 16, torch.device("cpu"))
    assert [(p.query_start, p.query_len) for p in meta.prefills] == [(0, 40), (40, 40), (80, 20)]
    assert positions.max() == 39 and num_blocks == 3 + 3 + 2
    assert meta.slot_mapping.unique().numel() == 100
    with torch.inference_mode():
        assert runner.model(ids, positions, runner.kv_caches, meta).shape == (100, 64)


def prefill_logits(llm, prompt):
    core = llm.engine.core
    request = Request("logits", prompt, SamplingParams(max_tokens=1), max_tokens=1)
    core.scheduler.add(request)
    scheduled = core.scheduler.schedule().scheduled
    ids, positions, meta, _ = core.runner._prepare(scheduled, 0)
    with torch.inference_mode():
        hidden = core.runner.model(ids, positions, core.runner.kv_caches, meta)
        logits = core.runner.model.compute_logits(hidden)
    core.scheduler.abort("logits")
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    return logits


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model, _ = hf_reference(path, arch)
    llm = LLM(str(path), **SMALL_KV)
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(prefill_logits(llm, PROMPTS[0]), theirs, atol=1e-4, rtol=0)


def test_bf16_weights_on_cpu_keep_fp32_activations(tiny_checkpoint):
    path = tiny_checkpoint("llama")  # tied embeddings: the lm_head shares the bf16 table
    # 10 prompts: decode steps of 9+ rows take the C++ layer's oneDNN bf16 branch, fewer
    # rows its small GEMM
    prompts = PROMPTS + [[(5 * i + k) % 470 + 6 for i in range(9 + 7 * k)] for k in range(6)]
    # the oracle: transformers in fp32 on weights rounded to bf16 (norms stay fp32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.data = module.weight.data.bfloat16().float()
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPTS[0]])).logits[0]
        expected = [
            model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    llm = LLM(str(path), dtype="bfloat16", **SMALL_KV)
    runner = llm.engine.core.runner
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert runner.model.lm_head.weight.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert runner.dtype == torch.float32 and runner.kv_caches[0].dtype == torch.float32
    assert runner.model.model.fused_decode is not None  # decode steps: the C++ layer
    ours = prefill_logits(llm, PROMPTS[0])
    assert ours.dtype == torch.float32
    with torch.inference_mode():  # the same weights run all in bf16, as transformers does
        all_bf16 = model.to(torch.bfloat16)(torch.tensor([PROMPTS[0]])).logits[0].float()
    error = (ours - theirs).abs().max()
    assert 1e-3 < error <= (all_bf16 - theirs).abs().max()  # rounded, less than all-bf16
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    outputs = llm.generate(prompts, GREEDY)
    pairs = zip(token_ids(outputs), expected, strict=True)
    same = sum(a == b for ours_ids, ids in pairs for a, b in zip(ours_ids, ids, strict=True))
    assert same >= 0.5 * NEW_TOKENS * len(prompts)  # random tiny weights: near-ties diverge
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks
