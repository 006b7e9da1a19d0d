"""vLLM's fields that shape a prompt: `chat_template_kwargs` (the template's own variables),
`continue_final_message` (the last message goes on) and `add_special_tokens` (the
tokenizer's BOS before the prompt), each against transformers' rendering of the same
request, on a tiny checkpoint whose tokenizer writes a BOS and whose template reads a
variable."""

from __future__ import annotations

import shutil

import httpx
import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from conftest import CHAT_TEMPLATE
from server_utils import EmberServer

TEMPLATE = "{% if note %}<|im_start|>system\n{{ note }}<|im_end|>\n{% endif %}" + CHAT_TEMPLATE
BOS = "<|endoftext|>"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
GO_ON = [*MESSAGES, {"role": "assistant", "content": "jumps over"}]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("bos") / "llama"
    shutil.copytree(tiny_checkpoint("llama"), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    bos = tokenizer.convert_tokens_to_ids(BOS)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos)]
    )
    tokenizer.bos_token = BOS
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.encode("hi")[0] == tokenizer.convert_tokens_to_ids(BOS)  # the premise
    return tokenizer


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = EmberServer(
        str(checkpoint), "--kv-cache-memory", "16M", "--max-model-len", "512",
        "--served-model-name", "tiny",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)


def rendered(tokenizer, messages, **kwargs) -> list[int]:
    """transformers' ids of the chat: its template, no special tokens added."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def completion_of(server, ids: list[int]) -> str:
    response = post(server, "/v1/completions", {"prompt": ids, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_chat_reads(server, body: dict, ids: list[int]) -> None:
    """The chat request's prompt is `ids` (/tokenize, usage) and its answer that of a
    completion of `ids`."""
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert tokens == ids
    chat = post(server, "/v1/chat/completions", {**body, **GREEDY})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    assert chat.json()["choices"][0]["message"]["content"] == completion_of(server, ids)


def test_chat_template_kwargs_are_the_templates_variables(server, tokenizer):
    note = {"note": "Be brief."}
    with_note = rendered(tokenizer, MESSAGES, add_generation_prompt=True, **note)
    without = rendered(tokenizer, MESSAGES, add_generation_prompt=True)
    assert len(with_note) > len(without)
    assert_chat_reads(server, {"messages": MESSAGES, "chat_template_kwargs": note}, with_note)
    assert_chat_reads(server, {"messages": MESSAGES}, without)
    for name in ("tools", "tokenize", "messages", "continue_final_message", "documents"):
        body = {"messages": MESSAGES, "chat_template_kwargs": {name: []}}
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 400, name
        assert response.json()["error"]["param"] == "chat_template_kwargs"
        assert repr(name) in response.json()["error"]["message"]


def test_continue_final_message_goes_on_from_the_assistants_words(server, tokenizer):
    ids = rendered(tokenizer, GO_ON, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\njumps over")
    body = {"messages": GO_ON, "continue_final_message": True, "add_generation_prompt": False}
    assert_chat_reads(server, body, ids)
    both = post(server, "/v1/chat/completions", {"messages": GO_ON, "continue_final_message": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


def test_add_special_tokens_puts_the_tokenizers_bos_first(server, tokenizer):
    bos = tokenizer.convert_tokens_to_ids(BOS)
    plain = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    for special, ids in ((None, [bos, *plain]), (True, [bos, *plain]), (False, plain)):
        body = {"prompt": "The quick brown fox", **GREEDY}
        if special is not None:
            body["add_special_tokens"] = special
        response = post(server, "/v1/completions", body).json()
        assert response["usage"]["prompt_tokens"] == len(ids), special
        assert response["choices"][0]["text"] == completion_of(server, ids)
    chat = rendered(tokenizer, MESSAGES, add_generation_prompt=True)
    assert_chat_reads(server, {"messages": MESSAGES}, chat)  # the template's ids alone
    body = {"messages": MESSAGES, "add_special_tokens": True}
    assert_chat_reads(server, body, [bos, *chat])
