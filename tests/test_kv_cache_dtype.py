"""kv_cache_dtype: a bf16 KV cache holds twice the tokens of a float32 one in the same
memory, and an engine over it computes what transformers computes in float32 with each
key (after rotary) and value rounded to bf16 as it is stored."""

from __future__ import annotations

import pytest
import torch
from test_bf16_prefill import GREEDY, NEW_TOKENS
from test_bf16_prefill import _hf_bf16_greedy as hf_greedy
from test_models import PROMPTS, SMALL_KV, prefill_logits, token_ids
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama

from conftest import simulate_cpu
from ember import LLM
from ember.cli import build_parser
from ember.config import EngineConfig
from ember.engine.kernels import cpu_kernels


def rounded_kv_reference(path, monkeypatch):
    """transformers' float32 model whose keys (after rotary) and values are rounded to
    bf16 before attention reads them, as a bf16 cache keeps them."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rotary = modeling_llama.apply_rotary_pos_emb

    def rounding_rotary(q, k, *args, **kwargs):
        q, k = rotary(q, k, *args, **kwargs)
        return q, k.bfloat16().float()

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rounding_rotary)
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _i, out: out.bfloat16().float())
    return model


@pytest.mark.parametrize("backend", ["cpu-paged", "sdpa"])
def test_a_bf16_cache_computes_what_transformers_does_with_keys_and_values_rounded(
    tiny_checkpoint, monkeypatch, backend
):
    """Exact fp32 matmuls over a bf16 cache: prefill logits next to the rounded-KV
    reference's (and measurably off the unrounded one's: the cache really is bf16),
    and greedy continuations token for token; ember's kernels (decodes on the fused
    layer path, prefill chunks over the blocks) and torch's SDPA alike."""
    if backend == "cpu-paged" and cpu_kernels() is None:
        pytest.skip("ember's CPU kernels could not be built here")
    path = tiny_checkpoint("llama")
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        unrounded = exact(torch.tensor([PROMPTS[0]])).logits[0]
    reference = rounded_kv_reference(path, monkeypatch)
    with torch.inference_mode():
        theirs = reference(torch.tensor([PROMPTS[0]])).logits[0]
    llm = LLM(
        str(path), matmul_precision="ieee", kv_cache_dtype="bfloat16",
        attention_backend=backend, **SMALL_KV,
    )  # fmt: skip
    assert {t.dtype for t in llm.engine.core.runner.kv_caches} == {torch.bfloat16}
    ours = prefill_logits(llm, PROMPTS[0])
    # a key that fp32 rounding puts on the other side of a bf16 step moves a logit by
    # ~1e-4 (measured: 1.5e-4 at worst, 2e-6 on average); not rounding at all moves them
    # by ~1e-2 on average (0.19 at worst)
    error, off = (ours - theirs).abs(), (ours - unrounded).abs()
    assert error.max() < 1e-3 and error.mean() < 2e-5
    assert off.mean() > 1e-3
    expected = [hf_greedy(reference, prompt)[0] for prompt in PROMPTS]  # (tokens, gaps)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


def test_a_bf16_cache_holds_twice_the_blocks_in_the_same_memory(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    full, half = (
        LLM(path, matmul_precision="ieee", kv_cache_dtype=d, **SMALL_KV)
        for d in ("float32", "bfloat16")
    )
    blocks = [llm.engine.core.scheduler.kv_cache.num_blocks for llm in (full, half)]
    assert blocks[1] == 2 * blocks[0] > 0
    assert full.engine.core.runner.kv_caches[0].dtype == torch.float32
    # the KV's identity, which keys stored blocks (ember.kv.tiers), tells them apart
    identities = [llm.engine.core._kv_identity() for llm in (full, half)]
    assert identities[0] != identities[1] and "bfloat16" in identities[1]


@pytest.mark.parametrize("has_bf16", [True, False])
def test_auto_is_bf16_where_prefill_runs_in_bf16(tiny_checkpoint, monkeypatch, has_bf16):
    """auto: bf16 keys and values where prefill runs in bf16 (its attention rounds them to
    bf16 anyway), float32 in exact mode and on CPUs without bf16 units."""
    simulate_cpu(monkeypatch, bf16=has_bf16, amx=has_bf16, bf16_fast=has_bf16)
    path = str(tiny_checkpoint("llama"))
    for precision, expected in [("auto", has_bf16), ("ieee", False)]:
        llm = LLM(path, matmul_precision=precision, **SMALL_KV)
        dtype = llm.engine.core.runner.kv_caches[0].dtype
        assert dtype == (torch.bfloat16 if expected else torch.float32)
        assert len(token_ids(llm.generate(PROMPTS[:1], GREEDY))[0]) == NEW_TOKENS


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert build_parser().parse_args(["serve"]).kv_cache_dtype == "auto"
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert args.kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, bfloat16"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
