"""POST /tokenize and /detokenize (vLLM's shapes) on a real `ember serve` with a tiny
checkpoint: the served tokenizer and chat template (counts equal the prompt tokens that
generation reports), the API key, errors as OpenAI bodies; then through `ember up`'s
router (cluster secret + key) and past a worker that cannot be reached."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from ember import cluster
from ember.bench.startup import free_port
from ember.headers import ROUTER_TOKEN_HEADER
from ember.router.app import build_router_app
from ember.router.policy import Router
from server_utils import EmberServer, Up

KEY = "sesame"
BEARER = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
TEXT = "The quick brown fox jumps over the lazy dog. Größe, 東京 🙂"
MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = EmberServer(
        str(tiny_checkpoint("llama")), "--kv-cache-memory", "16M",
        "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", "--api-key", KEY,
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=BEARER if headers is None else headers,
                      timeout=60)  # fmt: skip


def test_a_prompt_is_tokenized_by_the_served_tokenizer(server, tokenizer):
    answer = post(server.url, "/tokenize", {"model": "tiny", "prompt": TEXT}).json()
    ids = tokenizer.encode(TEXT)
    assert answer == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                      "token_strs": None}  # fmt: skip
    body = {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}
    answer = post(server.url, "/tokenize", body).json()
    assert answer["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert post(server.url, "/detokenize", {"tokens": answer["tokens"]}).json() == {"prompt": TEXT}


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_messages_count_what_a_chat_completion_counts(server, tokenizer, tools):
    body = {"messages": MESSAGES, **({"tools": tools} if tools else {})}
    answer = post(server.url, "/tokenize", body).json()
    chat = post(server.url, "/v1/chat/completions", dict(body, max_tokens=1)).json()
    assert answer["count"] == chat["usage"]["prompt_tokens"] == len(answer["tokens"])
    text = post(server.url, "/detokenize", {"tokens": answer["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nYou are brief.")
    assert text.endswith("<|im_start|>assistant\n")
    assert ("get_weather" in text) is bool(tools)
    shorter = post(server.url, "/tokenize", dict(body, add_generation_prompt=False)).json()
    assert shorter["tokens"] == answer["tokens"][: shorter["count"]] < answer["tokens"]


@pytest.mark.parametrize(
    "path, body, status, param, words",
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt", "either"),
        ("/tokenize", {}, 400, "prompt", "either"),
        ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools", "only with messages"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            400,
            "continue_final_message",
            "add_generation_prompt",
        ),  # fmt: skip
        (
            "/tokenize",
            {"messages": MESSAGES, "chat_template": "x"},
            400,
            "chat_template",
            "not supported",
        ),
        (
            "/tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}},
            400,
            "chat_template_kwargs",
            "not a template variable",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
            "system",
        ),  # fmt: skip
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model", "does not exist"),
        ("/tokenize", {"prompt": "x" * 10_000_000}, 413, None, "larger"),
        ("/detokenize", {"tokens": [1, 512]}, 400, "tokens", "[0, 512)"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens.1", ">= 0"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "list"),
        ("/detokenize", {"prompt": "a"}, 400, "tokens", "required"),
    ],
)
def test_bad_requests_are_openai_errors_naming_the_field(server, path, body, status, param, words):
    response = post(server.url, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_the_api_key_guards_both_like_v1(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        response = post(server.url, path, body, headers={})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        wrong = post(server.url, path, body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert post(server.url, path, body).status_code == 200
    assert httpx.get(f"{server.url}/tokenize", headers=BEARER).status_code == 405


# -- through a router ----------------------------------------------------------------------


def test_the_router_forwards_to_a_worker_and_checks_the_key(tiny_checkpoint, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    secret = "tokenize-test-secret"
    up = Up(str(tiny_checkpoint("llama")), "--mixed", "2", "--api-key-file", str(key_file),
            env={"EMBER_CLUSTER_SECRET": secret}, headers=BEARER)  # fmt: skip
    try:
        answer = post(up.url, "/tokenize", {"messages": MESSAGES, "return_token_strs": True})
        assert answer.status_code == 200 and answer.headers["x-ember-worker"] in up.workers
        tokens = answer.json()["tokens"]
        assert answer.json()["count"] == len(tokens) > 0 and answer.json()["token_strs"]
        text = post(up.url, "/detokenize", {"tokens": tokens}).json()["prompt"]
        assert "What is the weather in Paris?" in text
        assert post(up.url, "/tokenize", {"prompt": "a"}, headers={}).status_code == 401
        router_token = {ROUTER_TOKEN_HEADER: cluster.router_token(secret.encode())}
        for worker in up.urls("mixed"):  # a worker serves its router only, even with the key
            assert post(worker, "/tokenize", {"prompt": "a"}).status_code == 401
            assert post(worker, "/detokenize", {"tokens": [5]}).status_code == 401
            assert post(worker, "/tokenize", {"prompt": "a"}, router_token).status_code == 200
    finally:
        up.stop()


def test_the_router_tries_another_worker_when_one_cannot_be_reached(server):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    app = build_router_app(Router([dead, server.url]))  # no health check has run: both "up"

    async def tokenize() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            try:
                return await client.post("/tokenize", json={"prompt": TEXT}, headers=BEARER)
            finally:
                await app.state.router.client.aclose()

    response = asyncio.run(tokenize())
    assert response.status_code == 200 and response.headers["x-ember-worker"] == server.url
    assert response.json()["count"] > 0
