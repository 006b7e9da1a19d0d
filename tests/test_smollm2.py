"""The default model with its real weights: greedy chat output equals transformers' on the
same GGUF file (transformers dequantizes and un-permutes it with its own code)."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.kernels import cpu_kernels, selected_isa, supported_isas
from ember.loader.checkpoint import open_checkpoint
from ember.loader.default_models import resolve_model
from ember.loader.hf_reference import transformers_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Übersetze: Guten Morgen, wie geht's? 🙂"}],
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model(None)  # fetched by `make test` beforehand (ember download)
    return LLM(str(path), kv_cache_memory=1 << 28, max_model_len=2048), transformers_model(
        open_checkpoint(path)
    )


@pytest.fixture(scope="module")
def reference_tokens(smollm2):
    """transformers' greedy continuation of each chat."""
    llm, reference = smollm2
    tokenizer = llm.get_tokenizer()
    generations = []
    for chat in CHATS:
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
        prompt = list(prompt["input_ids"])
        with torch.inference_mode():
            generated = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )[0, len(prompt) :].tolist()
        generations.append((prompt, generated))
    return generations


# every CPU kernel build this machine runs (an AVX-512 machine runs all three)
@pytest.mark.parametrize("isa", supported_isas())
def test_greedy_chat_matches_transformers(smollm2, reference_tokens, isa, cpu_isa):
    llm, _ = smollm2
    if isa != selected_isa():
        cpu_isa(isa)
        llm = LLM(str(resolve_model(None)), kv_cache_memory=1 << 27, max_model_len=2048)
        if cpu_kernels() is not None:
            qkv = llm.engine.core.runner.model.model.layers[0].self_attn.qkv_proj
            assert qkv.block_gemm.__module__ == f"ember_cpu_kernels_{isa}"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    outputs = llm.chat(CHATS, params)
    tokenizer = llm.get_tokenizer()
    for (prompt, generated), output in zip(reference_tokens, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == generated
        expected_text = tokenizer.decode(generated, skip_special_tokens=True)
        assert output.outputs[0].text == expected_text


def test_decode_steps_read_the_files_blocks(smollm2):
    """The output above came from the file's Q4_1 / Q8_0 blocks: every matmul of SmolLM2
    (30 layers x qkv, o, gate_up, down, and the head tied to the Q8_0 embedding) has them."""
    from ember.models.layers import Linear

    llm, _ = smollm2
    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    model = llm.engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 121 and all(m.block_gemm is not None for m in linears)
    assert model.lm_head.blocks.shape == (49152, 576 // 32 * 34)  # Q8_0


def test_answers_sensibly(smollm2):
    llm, _ = smollm2
    out = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, not the length limit
