"""GGUF files of the MoE and MLA architectures: deepseek2 (DeepSeek-V3/R1, Kimi K2),
qwen3moe, and llama with experts (Mixtral), written in the test from tiny transformers
checkpoints the way llama.cpp's converter writes them (gguf_convert.py), then run
against transformers on the checkpoint they came from."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_convert import QT, write_gguf
from test_models import PROMPTS, SMALL_KV, hf_reference, token_ids
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config

from conftest import DEEPSEEK, build_tokenizer
from ember import LLM, SamplingParams
from ember.loader.gguf_loader import gguf_to_hf_config, iter_gguf_weights, read_gguf
from ember.models.moe import Experts, SparseMoE

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

# DeepSeek-V3's and Kimi K2's YaRN has mscale == mscale_all_dim (1.0), which is all a
# deepseek2 file can say (llama.cpp keeps 0.1 x mscale_all_dim); the conftest checkpoint
# differs there on purpose, so these are built here
_YARN = dict(DEEPSEEK["rope_parameters"], mscale=1.0, mscale_all_dim=1.0)
DEEPSEEK_CONFIGS = {
    "deepseek_v3": DeepseekV3Config(**dict(DEEPSEEK, rope_parameters=_YARN)),
    # q in one projection (q_lora_rank None), 4 groups of which 2, no weight normalization
    "deepseek_v3_q": DeepseekV3Config(
        **dict(
            DEEPSEEK,
            rope_parameters=_YARN,
            q_lora_rank=None,
            n_group=4,
            topk_group=2,
            norm_topk_prob=False,
        )
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """name -> (path of a tiny transformers checkpoint, transformers' model_type)."""
    built: dict[str, Path] = {}

    def get(name: str) -> tuple[Path, str]:
        if name not in DEEPSEEK_CONFIGS:
            return tiny_checkpoint(name), name
        if name not in built:
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(DEEPSEEK_CONFIGS[name], dtype=torch.float32)
            built[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(built[name])
            build_tokenizer(built[name])
        return built[name], "deepseek_v3"

    return get


# ---------------------------------------------------------------- against transformers

CASES = {
    # DeepSeek-V3: q through a LoRA, YaRN, 2 groups of which 1, a shared expert, a dense
    # first layer, the split attn_k_b / attn_v_b of today's files
    "deepseek_v3": dict(name="deepseek_v3"),
    "deepseek_v3-kv_b": dict(name="deepseek_v3", split_kv_b=False),  # files before that
    "deepseek_v3-q": dict(name="deepseek_v3_q"),
    # Qwen3-MoE with dense layers between (their router is absent from the file)
    "qwen3_moe": dict(name="qwen3_moe"),
    "mixtral": dict(name="mixtral"),  # llama with experts: q/k rows permuted
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_match_transformers(checkpoint, tmp_path, case):
    args = dict(CASES[case])
    path, model_type = checkpoint(args.pop("name"))
    model, expected = hf_reference(path, str(path), NEW_TOKENS)
    gguf_path = write_gguf(model, model_type, tmp_path / "m.gguf", **args)
    llm = LLM(str(gguf_path), max_num_batched_tokens=48, **SMALL_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    config = llm.engine.core.runner.model_config
    assert config.architecture == model.config.architectures[0]
    moe_layers = [
        i for i, layer in enumerate(llm.engine.core.runner.model.model.layers)
        if isinstance(layer.mlp, SparseMoE)
    ]  # fmt: skip
    expected_moe = {"qwen3_moe": [1], "mixtral": [0, 1]}.get(model_type, [1, 2])
    assert moe_layers == expected_moe


def test_deepseek_config_equals_the_checkpoints(checkpoint, tmp_path):
    path, _ = checkpoint("deepseek_v3")
    model, _ = hf_reference(path, str(path), NEW_TOKENS)
    config = gguf_to_hf_config(read_gguf(write_gguf(model, "deepseek_v3", tmp_path / "d.gguf")))
    theirs = model.config
    for key in (
        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
        "first_k_dense_replace", "moe_intermediate_size", "norm_topk_prob", "vocab_size",
        "routed_scaling_factor", "num_attention_heads", "num_key_value_heads",
    ):  # fmt: skip
        assert config[key] == getattr(theirs, key), key
    assert config["rope_interleave"] is True
    assert config["rope_scaling"] == {
        key: _YARN[key]
        for key in ("rope_type", "factor", "original_max_position_embeddings", "beta_fast",
                    "beta_slow", "mscale", "mscale_all_dim")
    }  # fmt: skip


def test_quantized_experts_match_transformers_on_the_same_weights(checkpoint, tmp_path):
    """Q8_0 matrices, the stacked experts and attn_k_b / attn_v_b among them (those whose
    rows split into 32-weight blocks): ember's tokens equal transformers' run on the
    dequantized weights, and each expert's weights are gguf's dequantization of its rows."""
    path, _ = checkpoint("deepseek_v3")
    model, _ = hf_reference(path, str(path), NEW_TOKENS)
    gguf_path = write_gguf(model, "deepseek_v3", tmp_path / "q8.gguf", qtype=QT.Q8_0)
    reader = read_gguf(gguf_path)
    stacked = {t.name: t for t in reader.tensors}["blk.1.ffn_down_exps.weight"]
    assert stacked.tensor_type == QT.Q8_0
    weights = dict(iter_gguf_weights(reader, gguf_to_hf_config(reader)))
    for expert in range(8):
        expected = gguf.quants.dequantize(stacked.data[expert], QT.Q8_0)
        got = weights[f"model.layers.1.mlp.experts.{expert}.down_proj.weight"].numpy()
        np.testing.assert_array_equal(got, expected)
    # transformers on what the file holds (each matrix through Q8_0 and back)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for _, tensor in rounded.named_parameters():
            if tensor.ndim >= 2 and tensor.shape[-1] % 32 == 0:
                data = tensor.numpy()
                tensor.copy_(torch.from_numpy(
                    gguf.quants.dequantize(gguf.quants.quantize(data, QT.Q8_0), QT.Q8_0)
                ))  # fmt: skip
        expected = [
            rounded.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(p):].tolist()
            for p in PROMPTS
        ]  # fmt: skip
    llm = LLM(str(gguf_path), **SMALL_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    # decode steps read the experts' Q8_0 blocks (ember's block GEMM), prefill the floats
    experts = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(e.block_gemm is not None for e in experts)
    assert experts[0].blocks["down_proj"].shape == (8, 64, 1, 34)  # 32 weights in 34 bytes
    unblocked = LLM(str(gguf_path), gguf_blocks=False, **SMALL_KV)
    assert not any(e.block_gemm for e in unblocked.engine.core.runner.model.modules()
                   if isinstance(e, Experts))  # fmt: skip


def test_experts_keep_blocks_only_in_one_format():
    """gate and up in two formats: their fused matmul multiplies the floats; down's blocks
    are still read."""
    from ember.engine.kernels import cpu_kernels
    from ember.model_config import MoEConfig

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    moe = MoEConfig(num_experts=2, top_k=1, intermediate_size=32, scoring="softmax",
                    norm_topk_prob=True)  # fmt: skip
    experts = Experts(64, moe)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    for e in range(2):
        for part, qtype in (("gate_proj", QT.Q8_0), ("up_proj", QT.Q4_0), ("down_proj", QT.Q8_0)):
            weight = experts._expert_part(experts.gate_up_proj, experts.down_proj, e, part)
            blocks = gguf.quants.quantize(weight.detach().numpy(), qtype)
            weight.data.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
            size = gguf.GGML_QUANT_SIZES[qtype][1]
            experts.load_blocks(e, part, torch.from_numpy(blocks.reshape(len(blocks), -1, size)))
    experts.pack_for_cpu()
    assert experts.blocks["gate_up_proj"] is None and experts.blocks["down_proj"] is not None
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        got = experts(x, torch.ones(3, 1), torch.tensor([[0], [1], [1]]))
    experts.blocks["down_proj"] = None  # the floats only
    with torch.inference_mode():
        floats = experts(x, torch.ones(3, 1), torch.tensor([[0], [1], [1]]))
    assert torch.equal(got, floats)  # the blocks decode to exactly the floats


def test_one_tensor_per_expert_files_load(checkpoint, tmp_path):
    """Files converted before llama.cpp stacked the experts name each one
    `blk.N.ffn_gate.E.weight`: Mixtral's early GGUF files."""
    path, _ = checkpoint("mixtral")
    model, expected = hf_reference(path, str(path), NEW_TOKENS)
    old = write_gguf(model, "mixtral", tmp_path / "old.gguf", qtype=QT.Q8_0, per_expert=True)
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in read_gguf(old).tensors}
    stacked = write_gguf(model, "mixtral", tmp_path / "stacked.gguf", qtype=QT.Q8_0)
    llm = LLM(str(old), **SMALL_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == token_ids(
        LLM(str(stacked), **SMALL_KV).generate(PROMPTS, GREEDY)
    )


def test_deepseek2_tokenizer_and_chat_template_come_from_the_file(checkpoint, tmp_path):
    """transformers cannot read a deepseek2 file's config, so its GGUF tokenizer path does
    not open these files; ember builds the tokenizer from the file's vocabulary itself."""
    path, _ = checkpoint("deepseek_v3")
    model, _ = hf_reference(path, str(path), NEW_TOKENS)
    gguf_path = write_gguf(model, "deepseek_v3", tmp_path / "t.gguf", tokenizer_dir=path)
    llm = LLM(str(gguf_path), **SMALL_KV)
    ours, theirs = llm.get_tokenizer(), AutoTokenizer.from_pretrained(path)
    text = "The quick brown fox, naïve café 🙂 def main():"
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False
    )
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False
    )
    assert len(ours) == len(theirs)
    # DeepSeek-V3's files ask for a BOS token in front of every prompt
    assert ours.encode("hi")[0] == ours.bos_token_id == 2


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("gating", [gguf.ExpertGatingFuncType.SOFTMAX, None])
def test_deepseek_v2_softmax_gating_is_refused(checkpoint, tmp_path, gating):
    """DeepSeek-V2 files (softmax gating, said or, as llama.cpp reads them, unsaid)."""
    path, _ = checkpoint("deepseek_v3")
    model, _ = hf_reference(path, str(path), NEW_TOKENS)
    v2 = write_gguf(model, "deepseek_v3", tmp_path / "v2.gguf", gating=gating)
    with pytest.raises(ValueError, match="softmax expert gating"):
        LLM(str(v2), **SMALL_KV)


def test_attn_k_b_without_attn_v_b_is_refused(checkpoint, tmp_path):
    path, _ = checkpoint("deepseek_v3")
    model, _ = hf_reference(path, str(path), NEW_TOKENS)
    reader = read_gguf(write_gguf(model, "deepseek_v3", tmp_path / "g.gguf"))
    config = gguf_to_hf_config(reader)
    tensors = [t for t in reader.tensors if t.name != "blk.2.attn_v_b.weight"]
    from ember.loader.gguf_loader import _iter_weights

    with pytest.raises(ValueError, match=r"blk\.2\.attn_k_b but not its pair"):
        list(_iter_weights(tensors, "deepseek2", config))
