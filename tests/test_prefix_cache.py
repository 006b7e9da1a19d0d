"""Prefix caching through the offline API: exact cached-token counts, same outputs, salts."""

from __future__ import annotations

from ember import LLM, SamplingParams

PREFIX = [(17 * i) % 500 + 3 for i in range(200)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_shared_prefix_reports_its_full_blocks_and_keeps_output(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    first, second = PREFIX + [5, 6, 7], PREFIX + [8, 9]
    uncached = LLM(path, kv_cache_memory=1 << 24, enable_prefix_caching=False)
    expected = uncached.generate([second], GREEDY)[0].outputs[0].token_ids

    llm = LLM(path, kv_cache_memory=1 << 24)
    assert llm.generate([first], GREEDY)[0].num_cached_tokens == 0
    out = llm.generate([second], GREEDY)[0]
    assert out.num_cached_tokens == 192  # 12 full blocks of 16 in the 200-token prefix
    assert out.outputs[0].token_ids == expected
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 192
    assert stats.prefix_cache_queries == len(first) + len(second)


def test_different_cache_salts_share_nothing(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24)
    prompt = PREFIX + [5]
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 192


def test_multi_turn_reuses_the_previous_reply(tiny_checkpoint):
    """An agent's next turn resends prompt + reply: the reply's blocks are cached too."""
    llm = LLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24)
    turn1 = llm.generate([PREFIX], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    history = PREFIX + turn1[0].outputs[0].token_ids  # 240 tokens, all computed but the last
    turn2 = llm.generate([history + [42, 43]], GREEDY)[0]
    assert turn2.num_cached_tokens == (len(history) - 1) // 16 * 16
