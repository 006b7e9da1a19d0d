"""The default model with its real weights: greedy chat output equals transformers' on the
same GGUF file (transformers dequantizes and un-permutes it with its own code); and the
same for it requantized Q4_K_M-style (K-quant blocks decoded in registers)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from kquant import requantize_q4_k_m

from ember import LLM, SamplingParams
from ember.engine.kernels import cpu_kernels, selected_isa, supported_isas
from ember.loader.checkpoint import open_checkpoint
from ember.loader.default_models import resolve_model
from ember.loader.hf_reference import transformers_model
from ember.models.layers import cpu_bf16_outruns_fp32

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


def transformers_greedy(reference, tokenizer, chats) -> list[tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy continuation) of each chat."""
    generations = []
    for chat in chats:
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


@pytest.fixture(scope="module")
def reference_tokens(smollm2):
    llm, reference = smollm2
    return transformers_greedy(reference, llm.get_tokenizer(), CHATS)


def assert_greedy_chats(llm, chats, expected) -> None:
    outputs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    tokenizer = llm.get_tokenizer()
    for (prompt, generated), output in zip(expected, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == generated
        expected_text = tokenizer.decode(generated, skip_special_tokens=True)
        assert output.outputs[0].text == expected_text


def assert_greedy_chats_up_to_near_ties(llm, reference, expected, margin: float) -> None:
    """Each chat alone gives transformers' greedy tokens up to, at most, a position where
    transformers' own top two logits are within `margin`."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for chat, (prompt, tokens) in zip(CHATS, expected, strict=True):
        got = llm.chat([chat], greedy)[0].outputs[0].token_ids
        split = next((i for i, (a, b) in enumerate(zip(tokens, got, strict=False)) if a != b), None)
        if split is None:
            assert got == tokens
            continue
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + tokens[:split]])).logits[0, -1]
        assert logits[tokens[split]] - logits[got[split]] < margin, (chat, split)


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
    assert_greedy_chats(llm, CHATS, reference_tokens)


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
    assert model.lm_head.blocks.shape == (49152, 576 // 32, 34)  # Q8_0


def test_int8_decode_activations_stay_with_transformers_but_at_near_ties(smollm2, reference_tokens):
    """decode_activations int8 (the default outside ieee): batch-1 decode steps round their
    activations to int8 per 32 values. Each chat alone (so every decode step is one row)
    gives transformers' greedy tokens up to, at most, a position where transformers' own
    top two logits are within 0.5; and the logprobs show int8 was used (not bit-equal to
    fp32's) and stays within 0.15 of them."""
    llm, reference = smollm2
    int8 = LLM(str(resolve_model(None)), kv_cache_memory=1 << 27, max_model_len=2048,
               decode_activations="int8")  # fmt: skip
    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    qkv = int8.engine.core.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.int8_max_rows > 0 and qkv.int8_gemm is not None
    assert_greedy_chats_up_to_near_ties(int8, reference, reference_tokens, 0.5)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    fp32_out = llm.chat([CHATS[1]], params)[0].outputs[0]
    int8_out = int8.chat([CHATS[1]], params)[0].outputs[0]
    assert int8_out.token_ids == fp32_out.token_ids
    ours = [next(iter(step.values())) for step in int8_out.logprobs]
    theirs = [next(iter(step.values())) for step in fp32_out.logprobs]
    assert ours != theirs and max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 0.15


@pytest.fixture(scope="module")
def q4_k_m_path(tmp_path_factory):
    """The default model requantized as a Q4_K_M file would be (tests/kquant.py): only
    down_proj (in_features 1536) takes 256-weight K-quants, Q4_K or Q6_K by layer; the
    576-wide matmuls fall back to Q5_0, as llama.cpp's do; the Q8_0 embedding is kept."""
    path = tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    counts = requantize_q4_k_m(str(resolve_model(None)), str(path))
    QT = gguf.GGMLQuantizationType
    assert counts == {QT.Q5_0: 30 * 6, QT.Q4_K: 16, QT.Q6_K: 14}
    return path


def test_k_quant_file_greedy_chat_matches_transformers(q4_k_m_path):
    """Decode reads every matmul's blocks (down_proj's Q4_K / Q6_K super-blocks, Q5_0 and
    the Q8_0 head elsewhere), which decode to exactly the fp32 weights transformers has."""
    from ember.models.layers import Linear

    llm = LLM(str(q4_k_m_path), kv_cache_memory=1 << 27, max_model_len=2048)
    reference = transformers_model(open_checkpoint(q4_k_m_path))
    if cpu_kernels() is not None:
        model = llm.engine.core.runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert len(linears) == 121 and all(m.block_gemm is not None for m in linears)
        block_bytes = [layer.mlp.down_proj.blocks.shape[1:] for layer in model.model.layers]
        assert block_bytes.count((1536 // 256, 144)) == 16  # Q4_K
        assert block_bytes.count((1536 // 256, 210)) == 14  # Q6_K
        assert model.model.layers[0].mlp.gate_up_proj.blocks.shape == (2 * 1536, 576 // 32, 22)
    chats = CHATS[:2]
    assert_greedy_chats(llm, chats, transformers_greedy(reference, llm.get_tokenizer(), chats))


def test_answers_sensibly(smollm2):
    llm, _ = smollm2
    out = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, not the length limit


def test_int8_prefill_stays_near_exact_and_with_transformers_but_at_near_ties(
    smollm2, reference_tokens
):
    """matmul_precision int8 (auto where the tiles run on AVX512-VNNI, but on AMX):
    prompts multiply the file's blocks on int8 activations too, as llama.cpp does, and
    attend in bf16 where bf16 outruns fp32. The 286 positions of a text prompt against
    exact fp32 (measured on an Intel Xeon without AMX, fp32 attention: mean error 0.18 of
    logits up to 39.5, the top-1 token the same at 94.4% of positions, KL 0.005 on
    average; on an AMD EPYC, bf16 attention: 0.17, 91.6%, 0.005) within bounds that
    bf16's error (0.06) would not reach from below; each chat's greedy tokens are
    transformers' up to, at most, a position where transformers' own top two logits are
    within 1.0."""
    from test_models import prefill_logits

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    llm, reference = smollm2
    int8 = LLM(str(resolve_model(None)), kv_cache_memory=1 << 27, max_model_len=2048,
               matmul_precision="int8")  # fmt: skip
    down = int8.engine.core.runner.model.model.layers[0].mlp.down_proj
    assert down.packed is None and down.block_max_rows > 512  # every row on the tiles
    backend = int8.engine.core.runner.model.model.layers[0].self_attn.backend
    assert backend.bf16_chunks == (cpu_bf16_outruns_fp32() and backend.attends_bf16)
    text = open(Path(__file__).resolve().parents[1] / "README.md").read()
    prompt = llm.get_tokenizer()(text)["input_ids"][:286]
    ours, exact = prefill_logits(int8, prompt), prefill_logits(llm, prompt)
    error = (ours - exact).abs().mean()
    assert 0.1 < error < 0.3
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    kl = (exact.softmax(-1) * (exact.log_softmax(-1) - ours.log_softmax(-1))).sum(-1)
    assert kl.mean() < 0.01
    assert_greedy_chats_up_to_near_ties(int8, reference, reference_tokens, 1.0)
