"""Scoring a prompt over /v1/completions, as evaluation harnesses do: `echo` with `logprobs`
(OpenAI's legacy shape, what lm-eval's local-completions sends) and vLLM's
`prompt_logprobs`, against transformers' log_softmax on the same prompt, with prefill
split into small chunks."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember.engine.processor import InputProcessor, ProcessedPrompt
from ember.kv.params import KVTransferParams
from ember.sampling_params import SamplingParams
from server_utils import tiny_server

KV = ["--kv-cache-memory", "16M", "--max-model-len", "512", "--max-num-batched-tokens", "24"]
PROMPTS = [[(13 * i) % 480 + 5 for i in range(70)], [(7 * i) % 500 + 3 for i in range(9)]]
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    yield from tiny_server(tiny_checkpoint, *KV)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """transformers' log_softmax at every position of a prompt."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)

    return logprobs


def complete(server, **fields) -> dict:
    body = {"model": "tiny", "temperature": 0, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_puts_the_prompt_first(server, tokenizer):
    plain = complete(server, prompt=TEXT, max_tokens=5)["choices"][0]["text"]
    echoed = complete(server, prompt=TEXT, max_tokens=5, echo=True)["choices"][0]["text"]
    assert echoed == TEXT + plain
    ids = complete(server, prompt=PROMPTS[1], max_tokens=5, echo=True)["choices"][0]["text"]
    assert ids.startswith(tokenizer.decode(PROMPTS[1]))


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(server, reference):
    # lm-eval's local-completions loglikelihood request
    body = dict(prompt=PROMPTS, max_tokens=1, logprobs=1, echo=True, seed=1234)
    response = complete(server, **body)
    assert response["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    for choice, prompt in zip(response["choices"], PROMPTS, strict=True):
        logprobs, expected = choice["logprobs"], reference(prompt)
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        scored = logprobs["token_logprobs"][1 : len(prompt)]
        truth = [float(expected[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert scored == pytest.approx(truth, abs=1e-4)
        for i, top in enumerate(logprobs["top_logprobs"][1 : len(prompt)], 1):
            assert max(top.values()) == pytest.approx(float(expected[i - 1].max()), abs=1e-4)
            greedy = int(expected[i - 1].argmax()) == prompt[i]
            assert (logprobs["token_logprobs"][i] == max(top.values())) == greedy
        last = logprobs["token_logprobs"][-1]  # the generated token: greedy, so the best
        assert last == pytest.approx(float(expected[-1].max()), abs=1e-4)
        assert choice["text"].startswith(logprobs["tokens"][0])


def test_return_tokens_as_token_ids_names_each_token_by_its_id(server, reference, tokenizer):
    """vLLM's return_tokens_as_token_ids: every token of the logprobs as "token_id:N",
    so that tokens that print alike (byte tokens as "\ufffd") stay apart."""
    prompt = PROMPTS[0]
    body = dict(prompt=prompt, max_tokens=6, echo=True, logprobs=3, ignore_eos=True,
                return_tokens_as_token_ids=True)  # fmt: skip
    choice = complete(server, **body)["choices"][0]
    tokens, tops = choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert [f"token_id:{t}" for t in ids] == tokens and ids[: len(prompt)] == prompt
    assert choice["text"] == tokenizer.decode(prompt) + tokenizer.decode(ids[len(prompt) :])
    expected = reference(ids)
    for i, top in enumerate(tops[1:], 1):
        row = expected[i - 1]
        assert list(top) == [f"token_id:{t}" for t in row.topk(3).indices.tolist()]  # no merge
        assert list(top.values()) == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    plain = complete(server, **dict(body, return_tokens_as_token_ids=False))["choices"][0]
    assert plain["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    events = httpx.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={"model": "tiny", "temperature": 0, "stream": True, **body},
    ).text
    chunks = [json.loads(x[6:])["choices"][0] for x in events.splitlines() if x[6:7] == "{"]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == tokens  # fmt: skip
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 5,
        "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "return_tokens_as_token_ids": True}).json()["choices"][0]  # fmt: skip
    content = chat["logprobs"]["content"]
    assert chat["message"]["content"] == tokenizer.decode(
        [int(e["token"].removeprefix("token_id:")) for e in content]
    )
    for entry in content:
        for item in [entry, *entry["top_logprobs"]]:
            assert item["token"].startswith("token_id:")
            assert item["bytes"] == list(item["token"].encode())


def test_prompt_logprobs_in_vllm_shape(server, reference, tokenizer):
    response = complete(server, prompt=PROMPTS[0], max_tokens=2, prompt_logprobs=3, n=2)
    prompt, expected = PROMPTS[0], reference(PROMPTS[0])
    for choice in response["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for i in range(1, len(prompt)):
            row, entry = expected[i - 1], entries[i]
            top = row.topk(3).indices.tolist()
            assert set(entry) == {str(t) for t in [prompt[i], *top]}
            for token, item in entry.items():
                assert item["logprob"] == pytest.approx(float(row[int(token)]), abs=1e-4)
                assert item["decoded_token"] == tokenizer.decode([int(token)])
            assert sorted(entry[str(t)]["rank"] for t in top) == [1, 2, 3]
            assert next(iter(entry)) == str(prompt[i])  # the prompt's token first
    plain = complete(server, prompt=PROMPTS[0], max_tokens=2)["choices"][0]
    assert "prompt_logprobs" not in plain


def test_streamed_echo_and_prompt_logprobs_come_in_the_first_chunk(server):
    body = dict(prompt=TEXT, max_tokens=6, echo=True, logprobs=3, prompt_logprobs=1)
    whole = complete(server, **body)["choices"][0]
    events = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "temperature": 0, "stream": True, **body},
        timeout=60,
    ).text
    chunks = [json.loads(x[6:])["choices"][0] for x in events.splitlines() if x[6:7] == "{"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert chunks[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    # the engine computed 3 alternatives per prompt token; prompt_logprobs shows 1
    assert all(len(entry) <= 2 for entry in whole["prompt_logprobs"][1:])
    assert max(len(top) for top in whole["logprobs"]["top_logprobs"][1:]) == 3


def test_chat_refuses_prompt_logprobs(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"


def test_a_disaggregated_request_for_prompt_logprobs_runs_whole_on_the_prefill_worker():
    processor = InputProcessor(None, 512, 512, frozenset({1}))
    prompt = ProcessedPrompt(None, PROMPTS[1])
    handover = KVTransferParams(do_remote_decode=True)
    plain = processor.process("a", prompt, SamplingParams(max_tokens=8), kv_transfer=handover)
    assert plain.kv_transfer is not None and plain.max_tokens == 1
    scored = SamplingParams(max_tokens=8, prompt_logprobs=0)
    whole = processor.process("b", prompt, scored, kv_transfer=handover)
    assert whole.kv_transfer is None and whole.max_tokens == 8
