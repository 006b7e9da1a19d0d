"""Mixture-of-experts and multi-head latent attention: DeepSeek-V3 (and the Kimi K2.5
wrapper of it), Qwen3-MoE and Mixtral against transformers on tiny random checkpoints,
the latent cache, the routers, and the latent layout handed from a prefill worker to a
decode worker."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_kv_connector import decode, make_core, prefill, run, settle, tokens
from test_models import PROMPTS, SMALL_KV, hf_reference, prefill_logits, token_ids
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from ember import LLM, SamplingParams
from ember.engine.messages import EngineCoreRequest
from ember.engine.mla import MLABackend, MLAWeights
from ember.model_config import ModelConfig, MoEConfig
from ember.models import moe
from ember.models.moe import Experts, SparseMoE, TopKRouter
from server_utils import WORKER_ARGS, EmberServer, Up, moe_samples

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
DEEPSEEK = ["deepseek_v3", "deepseek_v3_plain"]
MOE = [*DEEPSEEK, "qwen3_moe", "mixtral"]


def reference(path, arch):
    """transformers' model and greedy continuations of PROMPTS (cached per arch)."""
    return hf_reference(path, arch, NEW_TOKENS)


def assert_no_blocks_used(llm):
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()


@pytest.mark.parametrize("arch", MOE)
def test_greedy_and_prefill_logits_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model, expected = reference(path, arch)
    # 48-token steps: the 200- and 121-token prompts prefill in chunks, decodes alongside
    llm = LLM(str(path), max_num_batched_tokens=48, **SMALL_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    # the same prompts again: every full block of each prompt is a prefix-cache hit
    again = llm.generate(PROMPTS, GREEDY)
    assert token_ids(again) == expected
    assert again[0].num_cached_tokens == (len(PROMPTS[0]) // 16) * 16
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPTS[3]])).logits[0]
    # the prompt's first 112 tokens are cached: the rest attends to their latents
    cached = len(PROMPTS[3]) // 16 * 16
    torch.testing.assert_close(prefill_logits(llm, PROMPTS[3]), theirs[cached:], atol=1e-4, rtol=0)
    assert_no_blocks_used(llm)
    fresh = LLM(str(path), **SMALL_KV)
    torch.testing.assert_close(prefill_logits(fresh, PROMPTS[3]), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", MOE)
def test_grouped_gemm_experts_give_transformers_tokens(tiny_checkpoint, arch, monkeypatch):
    """The path CUDA takes (two grouped GEMMs a layer, torch's `grouped_mm`), forced on
    CPU, where torch runs the same operator as a loop over the groups: greedy tokens and
    prefill logits as transformers', and the grouped GEMM is what ran."""
    calls, grouped_mm = [], moe.GROUPED_MM

    def counted(*args, **kwargs):
        calls.append(kwargs["offs"].shape[0])
        return grouped_mm(*args, **kwargs)

    path = tiny_checkpoint(arch)
    model, expected = reference(path, arch)
    llm = LLM(str(path), max_num_batched_tokens=48, **SMALL_KV)
    experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Experts)]
    assert not experts[0].grouped(torch.zeros(1, 64))  # auto: a loop on CPU
    for layer in experts:
        layer.mode = "grouped"
    monkeypatch.setattr(moe, "GROUPED_MM", counted)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert calls and set(calls) == {experts[0].num_experts}
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPTS[3]])).logits[0]
    fresh = LLM(str(path), **SMALL_KV)
    for layer in fresh.engine.core.runner.model.modules():
        if isinstance(layer, Experts):
            layer.mode = "grouped"
    torch.testing.assert_close(prefill_logits(fresh, PROMPTS[3]), theirs, atol=1e-4, rtol=0)


def test_grouped_experts_equal_the_loop_with_idle_experts():
    """Experts no token chose (empty groups), one token, and no token at all."""
    config = MoEConfig(8, 2, intermediate_size=32, scoring="softmax", norm_topk_prob=True)
    layer = Experts(64, config)
    torch.manual_seed(0)
    with torch.no_grad():
        layer.gate_up_proj.normal_(std=0.1)
        layer.down_proj.normal_(std=0.1)
    for count in (0, 1, 5, 40):
        hidden = torch.randn(count, 64)
        ids = torch.randint(0, 3, (count, 2))  # experts 3-7 idle
        weights = torch.rand(count, 2)
        layer.mode = "loop"
        expected = layer(hidden, weights, ids)
        layer.mode = "grouped"
        torch.testing.assert_close(layer(hidden, weights, ids), expected, atol=1e-6, rtol=0)
    layer.mode = "fast"
    with pytest.raises(ValueError, match="Experts.mode"):
        layer(hidden, weights, ids)


def test_experts_sit_where_the_config_puts_them(tiny_checkpoint):
    """Qwen3-MoE: every decoder_sparse_step-th layer not in mlp_only_layers; DeepSeek:
    from first_k_dense_replace on; and ember counts the tokens routed to each expert."""
    for arch, moe_layers in (("qwen3_moe", [1]), ("deepseek_v3", [1, 2]), ("mixtral", [0, 1])):
        llm = LLM(str(tiny_checkpoint(arch)), **SMALL_KV)
        layers = llm.engine.core.runner.model.model.layers
        assert [
            i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)
        ] == moe_layers
        llm.generate([PROMPTS[2]], GREEDY)
        counts = layers[moe_layers[0]].mlp.experts.tokens_per_expert
        top_k = llm.engine.core.runner.model_config.moe.top_k
        assert int(counts.sum()) == (len(PROMPTS[2]) + NEW_TOKENS - 1) * top_k


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_bf16_weights_keep_the_experts_in_bf16_and_stay_near_fp32(tiny_checkpoint, arch):
    """`dtype="bfloat16"` on CPU stores every matmul weight in bf16, the experts' too (half
    the bytes a step reads), with fp32 activations: the logits stay closer to the fp32
    model's, on average, than transformers' own bf16 run (routing near a tie can flip an
    expert in either, so the worst row says little)."""
    path = tiny_checkpoint(arch)
    model, _ = reference(path, arch)
    low = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        exact = model(torch.tensor([PROMPTS[3]])).logits[0]
        theirs = low(torch.tensor([PROMPTS[3]])).logits[0].float()
    llm = LLM(str(path), dtype="bfloat16", matmul_precision="ieee", **SMALL_KV)
    experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(e.gate_up_proj.dtype == torch.bfloat16 for e in experts)
    ours = prefill_logits(llm, PROMPTS[3])
    assert (ours - exact).abs().mean() < (theirs - exact).abs().mean()
    assert token_ids(llm.generate(PROMPTS[1:2], GREEDY))[0]  # decodes (small GEMM on bf16 W)


def test_forced_preemption_keeps_the_greedy_tokens(tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v3")
    _, expected = reference(path, "deepseek_v3")
    # 20 blocks of 16 tokens (the latent layout: 3 layers x 24 values x 4 bytes a token),
    # prompts admitted in chunks of 64 (none past them): they outgrow the cache while decoding
    llm = LLM(
        str(path), kv_cache_memory=20 * 16 * 3 * 24 * 4, max_model_len=256,
        max_num_batched_tokens=64, max_prefill_step_tokens=64, enable_prefix_caching=False,
    )  # fmt: skip
    assert llm.engine.core.kv_cache.num_blocks == 20
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_blocks_used(llm)


def test_the_cache_keeps_one_latent_per_token(tiny_checkpoint):
    """kv_lora_rank + qk_rope_head_dim values a token and layer (16 + 8 here), where a
    cache of keys and values would keep 2 x heads x (192-wide keys, 128-wide values)."""
    llm = LLM(str(tiny_checkpoint("deepseek_v3")), **SMALL_KV)
    runner = llm.engine.core.runner
    num_blocks = llm.engine.core.kv_cache.num_blocks
    # one part (no separate keys and values), blocks of 16 tokens, one "head" of 24
    assert runner.kv_caches[0].shape == (1, num_blocks, 16, 1, 24)
    assert runner.kv_block_bytes == 3 * 16 * 24 * 4


def test_latent_decode_equals_expanded_attention():
    torch.manual_seed(0)
    heads, nope, rope, v, lora, block = 4, 16, 8, 12, 16, 4
    context = 23
    weights = MLAWeights(torch.randn(heads * (nope + v), lora), heads, nope, v, lora, 0.3)
    cache = torch.randn(1, 8, block, 1, lora + rope)
    table = torch.tensor([[5, 2, 7, 0, 3, 6]])  # 6 blocks: 24 slots, 23 used
    q_nope, q_rope = torch.randn(1, heads, nope), torch.randn(1, heads, rope)
    mask = (torch.arange(6 * block) < context)[None, None, None, :]
    meta = type("Meta", (), {"decode_block_table": table, "decode_mask": mask})
    latent_space = MLABackend.decode(q_nope, q_rope, cache[0], meta, weights)
    # expanded: every head's keys and values from the latents, plain softmax attention
    entries = cache[0].index_select(0, table[0]).view(-1, lora + rope)[:context]
    kv = (entries[:, :lora] @ weights.kv_b.T).view(context, heads, nope + v)
    keys = torch.cat([kv[..., :nope], entries[:, None, lora:].expand(-1, heads, -1)], -1)
    query = torch.cat([q_nope, q_rope], -1)[0]
    probs = torch.softmax(torch.einsum("hd,chd->hc", query, keys) * 0.3, -1)
    expanded = torch.einsum("hc,chv->hv", probs, kv[..., nope:])
    torch.testing.assert_close(latent_space[0], expanded, atol=1e-5, rtol=1e-5)


ROUTERS = {
    "deepseek_v3": DeepseekV3TopkRouter,
    "deepseek_v3_plain": DeepseekV3TopkRouter,
    "qwen3_moe": Qwen3MoeTopKRouter,
    "mixtral": MixtralTopKRouter,
}


@pytest.mark.parametrize("arch", MOE)
def test_router_picks_transformers_experts(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    hf_config = AutoConfig.from_pretrained(path)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    theirs = ROUTERS[arch](hf_config)
    ours = TopKRouter(config.hidden_size, config.moe)
    torch.manual_seed(3)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
        if ours.e_score_correction_bias is not None:
            theirs.e_score_correction_bias.normal_(std=0.1)
            ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    hidden = torch.randn(64, config.hidden_size)
    hidden[:8] = 0  # every score 0.5: ties, broken as torch.topk breaks them
    with torch.no_grad():
        for trial in range(2):
            if trial and ours.e_score_correction_bias is not None:  # ties in the choice too
                theirs.e_score_correction_bias.zero_()
                ours.e_score_correction_bias.zero_()
            _, their_weights, their_ids = theirs(hidden)
            our_weights, our_ids = ours(hidden)
            assert torch.equal(our_ids, their_ids)
            torch.testing.assert_close(our_weights, their_weights, atol=0, rtol=0)


def rewrite_checkpoint(src, dst, rename, config_edit=lambda config: config):
    """A copy of checkpoint `src` at `dst`, its tensors `rename`d, its config edited."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_edit(config)))
    tensors = load_file(dst / "model.safetensors")
    save_file(rename(tensors), dst / "model.safetensors")
    return dst


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny DeepSeek-V3's per-expert tensors in transformers' in-memory layout (each
    layer's experts stacked: gate_up_proj, down_proj)."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        e = range(8)
        gate_up = [torch.cat([tensors[f"{prefix}.{i}.{p}_proj.weight"] for p in ("gate", "up")]) for i in e]  # fmt: skip
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{i}.down_proj.weight"] for i in e])  # fmt: skip
    return out


def test_stacked_expert_tensors_load_like_per_expert_ones(tiny_checkpoint, tmp_path):
    """transformers' in-memory layout (experts stacked: gate_up_proj, down_proj)."""
    path = tiny_checkpoint("deepseek_v3")
    _, expected = reference(path, "deepseek_v3")
    stacked = rewrite_checkpoint(path, tmp_path / "stacked", stack_experts)
    llm = LLM(str(stacked), **SMALL_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


def test_kimi_k25_config_wraps_a_deepseek_v3_text_model(tiny_checkpoint, tmp_path):
    """Kimi K2.5: the language model is a `text_config` of type deepseek_v3 inside a
    multimodal config, its tensors under `language_model.`; vision tensors are not used."""
    path = tiny_checkpoint("deepseek_v3")
    _, expected = reference(path, "deepseek_v3")

    def wrap(config):
        text = dict(config, model_type="deepseek_v3")
        return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": text, "vision_config": {"hidden_size": 8}}  # fmt: skip

    def rename(tensors):
        out = {f"language_model.{k}": v for k, v in tensors.items()}
        out["vision_tower.patch_embed.weight"] = torch.zeros(8, 8)
        return out

    kimi = rewrite_checkpoint(path, tmp_path / "kimi", rename, wrap)
    config = ModelConfig.from_hf(json.loads((kimi / "config.json").read_text()))
    assert config.architecture == "DeepseekV3ForCausalLM" and config.mla.kv_lora_rank == 16
    llm = LLM(str(kimi), **SMALL_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected


def test_multi_token_prediction_layers_are_loaded_and_kept(tiny_checkpoint, tmp_path):
    """A checkpoint with an MTP layer (`model.layers.3.*` after 3 decoder layers, as
    DeepSeek publishes them): its tensors land in `model.mtp[0]`, its copies of the
    embedding and head are not loaded, and plain decoding does not change."""
    path = tiny_checkpoint("deepseek_v3")
    _, expected = reference(path, "deepseek_v3")
    torch.manual_seed(5)

    def add_mtp(tensors):
        out = dict(tensors)
        for name, tensor in tensors.items():
            if name.startswith("model.layers.2."):  # a MoE layer's shapes
                out[name.replace("layers.2.", "layers.3.")] = torch.randn_like(tensor)
        extra = {"enorm.weight": (64,), "hnorm.weight": (64,), "eh_proj.weight": (64, 128),
                 "shared_head.norm.weight": (64,), "shared_head.head.weight": (512, 64),
                 "embed_tokens.weight": (512, 64)}  # fmt: skip
        out.update({f"model.layers.3.{k}": torch.randn(shape) for k, shape in extra.items()})
        return out

    mtp = rewrite_checkpoint(
        path, tmp_path / "mtp", add_mtp, lambda c: dict(c, num_nextn_predict_layers=1)
    )
    llm = LLM(str(mtp), **SMALL_KV)
    model = llm.engine.core.runner.model
    written = load_file(mtp / "model.safetensors")
    assert len(model.mtp) == 1
    mtp_layer = model.mtp[0]
    assert torch.equal(mtp_layer.eh_proj.weight, written["model.layers.3.eh_proj.weight"])
    assert torch.equal(mtp_layer.shared_head_norm.weight, written["model.layers.3.shared_head.norm.weight"])  # fmt: skip
    experts = mtp_layer.layer.mlp.experts
    assert torch.equal(experts.down_proj[5], written["model.layers.3.mlp.experts.5.down_proj.weight"])  # fmt: skip
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    # transformers' save_pretrained writes no MTP layer though its config names one
    plain = LLM(str(path), **SMALL_KV).engine.core.runner
    assert plain.model_config.num_mtp_layers == 1 and len(plain.model.mtp) == 0


def test_kimi_k2_config_loads():
    """Kimi K2's published config.json (its shapes; DeepseekV3ForCausalLM, yarn, one
    group, 384 experts): every field ember reads."""
    k2 = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
        "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0, "eos_token_id": 163586, "bos_token_id": 163584,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    }  # fmt: skip
    config = ModelConfig.from_hf(k2)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.num_groups) == (384, 8, 1)
    assert config.moe.dense_layers == frozenset({0})
    assert config.rope.rope_type == "yarn" and config.rope.magnitude == 1.0
    assert config.mla.kv_lora_rank + config.mla.qk_rope_head_dim == 576
    from ember.models.deepseek_v3 import DeepseekV3ForCausalLM

    spec = DeepseekV3ForCausalLM.kv_cache_spec(config)
    # bf16: 1152 bytes a token and layer, against 64 heads x (192 + 128) x 2 = 40960
    assert spec.token_bytes(torch.bfloat16) == 1152


def test_metrics_count_the_tokens_each_expert_took(tiny_checkpoint):
    server = EmberServer(str(tiny_checkpoint("qwen3_moe")), *WORKER_ARGS)
    try:
        prompt = list(range(10, 40))
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        samples = moe_samples(server.url, "ember_moe_expert_tokens")
    finally:
        server.stop()
    tokens = {s.labels["expert"]: s.value for s in samples if s.name == "ember_moe_expert_tokens"}
    # layer 1 is the one MoE layer: 8 experts, 2 a token, every token computed once
    assert {s.labels["layer"] for s in samples} == {"1"} and len(tokens) == 8
    assert sum(tokens.values()) == (len(prompt) + 6 - 1) * 2
    imbalance = [s.value for s in samples if s.name == "ember_moe_expert_imbalance"]
    assert imbalance == [max(tokens.values()) / (sum(tokens.values()) / 8)]


# -- the latent layout handed over between workers --------------------------------------


@pytest.fixture(scope="module")
def deepseek(tiny_checkpoint):
    return str(tiny_checkpoint("deepseek_v3"))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_prefill_worker_hands_the_latent_cache_to_a_decode_worker(deepseek, transport, monkeypatch):
    monkeypatch.setenv("EMBER_CLUSTER_SECRET", "test-secret")
    prompt = list(range(5, 40))
    mixed = make_core(deepseek)
    cores = [make_core(deepseek, kv_role="prefill", kv_hold_timeout=5.0)]
    cores.append(make_core(deepseek, kv_role="decode", kv_transport=transport, kv_cache_memory=3 << 20))  # fmt: skip
    try:
        want = tokens(run(mixed, EngineCoreRequest("ref", prompt, GREEDY_10, 10, [])))
        remote = prefill(cores[0], "p", prompt)
        assert remote.block_bytes == 3 * 4 * 24 * 4  # blocks of 4 tokens, the latent layout
        assert decode(cores[1], "d", remote, prompt) == want
        assert cores[1].stats().num_prompt_tokens_computed == 0
        settle(*cores)
    finally:
        for core in (mixed, *cores):
            core.close()


GREEDY_10 = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_ember_up_on_deepseek_v3_matches_one_mixed_worker(deepseek, transport):
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 12,
            "temperature": 0, "logprobs": 2}  # fmt: skip
    # twice: the second time a prefix-cache hit (on the prefill worker in the cluster)
    reference_server = EmberServer(deepseek, *WORKER_ARGS)
    try:
        url = f"{reference_server.url}/v1/completions"
        wants = [httpx.post(url, json=body, timeout=60).json() for _ in range(2)]
    finally:
        reference_server.stop()
    cluster = Up(deepseek, "--prefill", "1", "--decode", "1", "--kv-transport", transport)
    try:
        for want in wants:
            got = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60).json()
            assert got["choices"] == want["choices"]
            assert got["usage"] == want["usage"]
        decode_load = cluster.worker_load(cluster.urls("decode")[0])
        assert decode_load["num_prompt_tokens_computed"] == 0
        assert decode_load["kv_transfer"]["loads_ok"] >= 1
        cluster.wait_no_blocks()
    finally:
        cluster.stop()
