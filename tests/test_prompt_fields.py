"""vLLM's fields that shape a prompt: `chat_template_kwargs` (the template's own variables),
`continue_final_message` (the last message goes on), `add_special_tokens` (the tokenizer's
BOS before the prompt) and `truncate_prompt_tokens` / `truncation_side`, each against
transformers' tokens for the same request, on a tiny checkpoint whose tokenizer writes a
BOS and whose template reads a variable."""

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


@pytest.mark.parametrize("side", ["left", "right", None])
def test_truncate_prompt_tokens_keeps_that_many_from_the_side_asked(server, tokenizer, side):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)  # the BOS first
    kept = ids[-5:] if side == "left" else ids[:5]  # None: the tokenizer's side, "right"
    body = {"prompt": text, "truncate_prompt_tokens": 5, **GREEDY}
    if side is not None:
        body["truncation_side"] = side
    answer = post(server, "/v1/completions", body).json()
    assert answer["usage"]["prompt_tokens"] == 5
    assert answer["choices"][0]["text"] == completion_of(server, kept)
    echoed = post(server, "/v1/completions", dict(body, echo=True, max_tokens=1)).json()
    assert echoed["choices"][0]["text"].startswith(tokenizer.decode(kept))  # its text is cut too
    whole = post(server, "/v1/completions", dict(body, truncate_prompt_tokens=len(ids))).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)
    chat = rendered(tokenizer, MESSAGES, add_generation_prompt=True)
    body = {"messages": MESSAGES, "truncate_prompt_tokens": 6, "truncation_side": side or "right"}
    cut = chat[-6:] if side == "left" else chat[:6]
    answer = post(server, "/v1/chat/completions", {**body, **GREEDY}).json()
    assert answer["usage"]["prompt_tokens"] == 6
    assert answer["choices"][0]["message"]["content"] == completion_of(server, cut)


def test_truncate_prompt_tokens_minus_one_leaves_room_for_max_tokens(server, tokenizer):
    long = [(7 * i) % 500 + 3 for i in range(600)]  # more than max_model_len (512)
    body = {"prompt": long, **GREEDY}
    assert post(server, "/v1/completions", body).status_code == 400  # as before, uncut
    answer = post(server, "/v1/completions", dict(body, truncate_prompt_tokens=-1)).json()
    assert answer["usage"]["prompt_tokens"] == 512 - GREEDY["max_tokens"]
    assert answer["choices"][0]["text"] == completion_of(server, long[: 512 - 8])
    left = dict(body, truncate_prompt_tokens=-1, truncation_side="left")
    assert post(server, "/v1/completions", left).json()["choices"][0]["text"] == completion_of(
        server, long[-(512 - 8) :]
    )
    # a text longer than the context could hold is cut on its side before tokenizing
    text = "The quick brown fox jumps over the lazy dog. " * 20_000
    refused = post(server, "/v1/completions", {"prompt": text, **GREEDY})
    assert refused.status_code == 400 and "characters" in refused.json()["error"]["message"]
    cut = {"prompt": text, "truncate_prompt_tokens": 40, "truncation_side": "left", **GREEDY}
    tail = tokenizer.encode(text[-4000:], add_special_tokens=False)[-40:]
    answer = post(server, "/v1/completions", cut).json()
    assert answer["usage"]["prompt_tokens"] == 40
    assert answer["choices"][0]["text"] == completion_of(server, tail)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"truncate_prompt_tokens": 513}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 5, "truncation_side": "middle"}, "truncation_side"),
        ({"truncate_prompt_tokens": 0}, "prompt"),  # nothing left
    ],
)
def test_bad_truncations_are_a_400_naming_the_field(server, fields, param):
    response = post(server, "/v1/completions", {"prompt": "The quick brown fox", **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
