"""Output side: incremental detokenization, stop strings and tokens, streaming deltas,
bad input, and n > 1, as a user of `LLM.generate` or of a stream would see them.

Unit tests feed fabricated `EngineCoreOutput`s to the `OutputProcessor`; end-to-end tests
run the tiny random checkpoint of conftest (its byte-level BPE splits rare characters
into several tokens).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ember import LLM, SamplingParams
from ember.engine.core import EngineCoreOutput
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.output_processor import OutputProcessor
from ember.engine.processor import ProcessedPrompt

EOS = 1  # "<|im_end|>" in the tiny tokenizer, and the checkpoint's eos_token_id


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24, max_model_len=128)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def assert_idle(llm: LLM) -> None:
    """Nothing left behind: no request in the engine, every KV block free, cache sound."""
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.output_processor.requests == {}
    kv = engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.check_integrity()


# --- incremental detokenization ----------------------------------------------------------

UNICODE_TEXTS = [
    "Größe 東京 🙂 café",  # whole tokens in the tiny vocabulary (they are in its corpus)
    "Straße 北京 😀 über ñ ∑ 日本語 ok",  # each non-ASCII character spans several tokens
    "x🙃y—z… Größe,北京🙂",
]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
@pytest.mark.parametrize("prompt", ["", "Hello there, 東京"])
def test_incremental_detokenizer_reproduces_full_decode(tokenizer, text, prompt):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), True)
    pieces = [detok.add([t]) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    in_chunks = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), True)
    assert "".join(in_chunks.add(ids[i : i + 3]) for i in range(0, len(ids), 3)) == text


def test_multibyte_characters_really_span_several_tokens(tokenizer):
    """Guards the test above: the second text must exercise partial characters."""
    ids = encode(tokenizer, UNICODE_TEXTS[1])
    assert sum("\ufffd" in tokenizer.decode([t]) for t in ids) >= 10


@pytest.mark.parametrize("prompt_text", ["abc 北京", "hi 😀"])
def test_prompt_ids_ending_mid_character_are_not_echoed_into_the_output(tokenizer, prompt_text):
    ids = encode(tokenizer, prompt_text)
    prompt = next(ids[:n] for n in range(len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    generated = encode(tokenizer, " ok then 東 done")
    detok = IncrementalDetokenizer(tokenizer, prompt, True)
    text = "".join(detok.add([t]) for t in generated)
    expected = tokenizer.decode(generated)
    # at most the broken character of the prompt shows (as U+FFFD), never its text
    assert text.endswith(expected)
    assert set(text[: len(text) - len(expected)]) <= {"\ufffd"}


# --- stop strings, with fabricated core outputs ------------------------------------------


def core_out(ids, finish=None, rid="req", logprobs=None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(ids), logprobs, finish, 0)


def start(tokenizer, params: SamplingParams) -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    prompt = ProcessedPrompt("Hi", encode(tokenizer, "Hi"))
    processor.add_request("req", prompt, params)
    return processor


def stream(processor: OutputProcessor, ids: list[int]):
    """Feeds one token per step; returns (streamed deltas, step of the abort, last output)."""
    deltas, abort_step, last = [], None, None
    for step, token in enumerate(ids):
        outputs, to_abort = processor.process([core_out([token])])
        if abort_step is not None:
            assert (outputs, to_abort) == ([], [])  # tokens after the stop are dropped
            continue
        (last,) = outputs
        deltas.append(last.outputs[0].delta_text)
        assert to_abort in ([], ["req"])
        if to_abort:
            abort_step = step
    return deltas, abort_step, last


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("Once upon a time, STOPWOR alpha beta STOPWORD gamma delta", "STOPWORD"),
        ("Straße 北京 😀 über ñ and more", "京 😀"),
        ("Once upon a time, alpha beta", "e, al"),
    ],
)
def test_stop_string_spanning_tokens_cuts_text_and_aborts(tokenizer, text, stop):
    ids = encode(tokenizer, text)
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # it spans several tokens
    stop_step = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    processor = start(tokenizer, SamplingParams(stop=[stop]))
    deltas, abort_step, last = stream(processor, ids)

    expected = text[: text.index(stop)]
    out = last.outputs[0]
    assert abort_step == stop_step
    assert out.text == expected and stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ids[: stop_step + 1]
    assert last.finished and processor.requests == {}
    # streaming: the deltas add up to the text, and never show text later taken back
    assert "".join(deltas) == expected
    for i in range(len(deltas)):
        assert expected.startswith("".join(deltas[: i + 1]))


def test_earliest_of_several_stop_strings_wins(tokenizer):
    text = "Once upon a time, alpha beta gamma delta"
    ids = encode(tokenizer, text)
    # all tokens in one output: "beta" and "gamma" both present, "beta" comes first
    processor = start(tokenizer, SamplingParams(stop=["gamma", "beta", "zeta"]))
    (output,), to_abort = processor.process([core_out(ids)])
    assert to_abort == ["req"]
    assert output.outputs[0].text == "Once upon a time, alpha "
    assert output.outputs[0].stop_reason == "beta"
    # token by token, "beta" and "a beta" complete on the same token: the earlier one wins
    processor = start(tokenizer, SamplingParams(stop=["beta", "a beta"]))
    _, _, last = stream(processor, ids)
    assert last.outputs[0].text == "Once upon a time, alph"
    assert last.outputs[0].stop_reason == "a beta"


def test_held_back_text_is_flushed_when_the_sequence_ends_otherwise(tokenizer):
    text = "Once upon a time, alpha beta NEVERMA"  # ends in a partial stop string
    ids = encode(tokenizer, text)
    processor = start(tokenizer, SamplingParams(stop=["NEVERMATCH"]))
    deltas = []
    for i, token in enumerate(ids):
        finish = "length" if i == len(ids) - 1 else None
        (output,), to_abort = processor.process([core_out([token], finish)])
        assert to_abort == []
        deltas.append(output.outputs[0].delta_text)
    out = output.outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == text and "".join(deltas) == text
    assert "NEVERMA" not in "".join(deltas[:-1])  # a possible stop string was held back


@pytest.mark.parametrize(
    ("stop_token_ids", "expected_reason"), [([EOS], EOS), ([], None)], ids=["stop-id", "eos"]
)
def test_stop_reason_names_the_stop_token_but_not_eos(tokenizer, stop_token_ids, expected_reason):
    processor = start(tokenizer, SamplingParams(stop_token_ids=stop_token_ids))
    ids = encode(tokenizer, "alpha beta")
    processor.process([core_out(ids)])
    (output,), _ = processor.process([core_out([EOS], "stop")])
    out = output.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == expected_reason
    assert out.token_ids == [*ids, EOS] and out.text == "alpha beta"


def test_stop_string_in_one_of_n_sequences_aborts_only_that_one(tokenizer):
    processor = start(tokenizer, SamplingParams(n=2, stop=["beta"]))
    ids0 = encode(tokenizer, "alpha beta gamma")
    ids1 = encode(tokenizer, "alpha gamma")
    (output,), to_abort = processor.process(
        [core_out(ids0, rid="req#0"), core_out(ids1[:3], rid="req#1")]
    )
    assert to_abort == ["req#0"] and not output.finished
    assert [o.text for o in output.outputs] == ["alpha ", "alp"]
    assert [o.delta_text for o in output.outputs] == ["alpha ", ""]  # "alp" held back
    (output,), to_abort = processor.process([core_out(ids1[3:], "length", rid="req#1")])
    assert to_abort == [] and output.finished
    assert output.outputs[1].text == "alpha gamma" and output.outputs[1].stop_reason is None
    assert output.outputs[1].delta_text == "alpha gamma"
    assert processor.requests == {}


def test_logprobs_and_token_deltas_follow_the_stream(tokenizer):
    processor = start(tokenizer, SamplingParams(logprobs=1))
    steps = [([5, 6], [{5: -0.1}, {6: -0.2}]), ([7], [{7: -0.3, 8: -0.25}])]
    for ids, logprobs in steps:
        (output,), _ = processor.process([core_out(ids, logprobs=logprobs)])
        assert output.outputs[0].delta_token_ids == ids
        assert output.outputs[0].delta_logprobs == logprobs
    assert output.outputs[0].logprobs == steps[0][1] + steps[1][1]


# --- end to end on the tiny checkpoint ---------------------------------------------------

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def greedy(llm):
    """The greedy continuation of PROMPT: what the stop tests cut."""
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]


def test_stop_token_id_ends_output_right_there(llm, greedy):
    ids = greedy.token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and ids[i] != EOS)
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids[k]])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == ids[: k + 1]  # the stop token is kept
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]
    assert greedy.text.startswith(out.text)
    assert_idle(llm)


def test_stop_string_end_to_end(llm, greedy):
    text = greedy.text
    i = next(
        i
        for i in range(3, len(text) - 3)
        if "\ufffd" not in text[i : i + 3] and text.index(text[i : i + 3]) == i
    )
    stop = text[i : i + 3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, stop=stop))
    out = out[0].outputs[0]
    assert out.text == text[:i]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(greedy.token_ids)
    assert greedy.token_ids[: len(out.token_ids)] == out.token_ids
    assert_idle(llm)


def test_streamed_deltas_add_up_to_the_final_text_end_to_end(llm, greedy):
    text = greedy.text
    i = len(text) // 2
    stop = next(text[j : j + 4] for j in range(i, len(text)) if "\ufffd" not in text[j : j + 4])
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop, "\x00never"])
    llm.engine.add_request("stream", PROMPT, params)
    deltas, final = [], None
    while llm.engine.has_unfinished():
        for output in llm.engine.step():
            deltas.append(output.outputs[0].delta_text)
            final = output.outputs[0]
    assert final.finished and final.stop_reason == stop
    assert final.text == text[: text.index(stop)]
    assert "".join(deltas) == final.text
    assert_idle(llm)


def test_eos_ends_output_unless_ignored(llm):
    # a repetition penalty below 1 boosts prompt tokens: a prompt of EOS makes EOS likely
    prompt = [EOS] * 4
    params = SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=0.01)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == [EOS] and out.text == ""  # kept in ids, special: not in text
    assert out.finish_reason == "stop" and out.stop_reason is None
    params.ignore_eos = True
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == [EOS] * 6 and out.finish_reason == "length"
    assert_idle(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), r"prompt must not be empty"),
        ([5] * 130, SamplingParams(), r"prompt has 130 tokens, but max_model_len is 128"),
        ([5] * 128, SamplingParams(), r"prompt has 128 tokens, but max_model_len is 128"),
        (
            [5] * 100,
            SamplingParams(max_tokens=29),
            r"max_tokens=29 plus the prompt's 100 tokens exceeds max_model_len=128",
        ),
        ([5, 512], SamplingParams(), r"prompt token ids must be integers in \[0, 512\)"),
        ([5, -1], SamplingParams(), r"prompt token ids"),
        (["The quick", ""], SamplingParams(), r"prompt must not be empty"),
        (["The quick", "def"], [SamplingParams()], r"sampling_params: got 1 for 2 prompts"),
    ],
)
def test_bad_input_raises_and_leaves_the_engine_serving(llm, greedy, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params)
    assert_idle(llm)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:8] and greedy.text.startswith(out.text)


def test_prompt_and_max_tokens_exactly_filling_max_model_len(llm):
    (out,) = llm.generate([[5] * 100], SamplingParams(temperature=0.0, max_tokens=28))
    assert len(out.outputs[0].token_ids) == 28 and out.outputs[0].finish_reason == "length"
    (out,) = llm.generate([[5] * 120], SamplingParams(temperature=0.0, max_tokens=None))
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_n_siblings_share_prompt_blocks(llm):
    prompt = [3 + (7 * i) % 500 for i in range(50)]  # 3 full blocks of 16 (+2 tokens)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8)
    stats = llm.engine.core.kv_cache.stats
    hits, queries = stats.hits, stats.queries
    (out,) = llm.generate([prompt], params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3  # siblings sample apart
    assert stats.queries - queries == 3 * 50
    assert stats.hits - hits == 2 * 48  # siblings 1 and 2 reuse sibling 0's three blocks
    assert_idle(llm)
    (again,) = llm.generate([prompt], params)  # now all three hit the cache
    assert again.num_cached_tokens == 48
    assert stats.hits - hits == 2 * 48 + 3 * 48
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert_idle(llm)
