"""`ember bench serve` against a real `ember serve` on a tiny checkpoint: the numbers of
requests, tokens, sessions and turns are what was asked, agentic prompts grow and carry
their session header, a trace replay reproduces its shared prefixes, the JSON has every
field, the plot is a PNG; and `ember bench compare` puts runs side by side."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ember.cli import build_parser
from server_utils import EmberServer

TRACE = Path(__file__).parent / "data" / "mooncake-conversation-head.jsonl"
SUMMARY_KEYS = {
    "duration_s", "num_requests", "num_completed", "num_sessions", "num_turns",
    "prompt_tokens", "cached_tokens", "recomputed_prompt_tokens", "output_tokens",
    "request_throughput",
    "output_throughput", "total_token_throughput", "goodput", "slo_ms", "cache_hit_ratio",
    "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "per_turn", "errors", "spec_decode",
}  # fmt: skip
RECORD_KEYS = {
    "session_id", "turn", "start", "ttft", "itl", "e2e", "prompt_tokens", "cached_tokens",
    "output_tokens", "finish_reason", "error", "error_detail", "echoed_session", "worker",
    "hash_ids", "reply_digest",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    srv = EmberServer(str(path), "--kv-cache-memory", "32M", "--max-model-len", "1024")
    yield srv, path
    assert srv.stop() == 0


def bench(tiny, tmp_path: Path, name: str, *args: str) -> dict:
    srv, path = tiny
    out = tmp_path / f"{name}.json"
    argv = ["bench", "serve", "--url", srv.url, "--tokenizer", str(path), "--no-progress",
            "--out", str(out), *args]  # fmt: skip
    parsed = build_parser().parse_args(argv)
    assert parsed.func(parsed) == 0
    return json.loads(out.read_text())


def test_random_workload_counts_and_json(tiny, tmp_path):
    result = bench(
        tiny, tmp_path, "random", "--workload", "random", "--num-requests", "6",
        "--input-len", "20:40", "--output-len", "5", "--max-concurrency", "3",
        "--slo", "ttft=60000,tpot=60000", "--plot", str(tmp_path / "random.png"),
    )  # fmt: skip
    summary, records = result["summary"], result["requests"]
    assert set(summary) == SUMMARY_KEYS and all(set(r) == RECORD_KEYS for r in records)
    assert summary["num_requests"] == summary["num_completed"] == len(records) == 6
    assert summary["spec_decode"] is None  # the server does not speculate
    assert all(len(r["reply_digest"]) == 16 for r in records)
    assert all(r["output_tokens"] == 5 and r["error"] is None for r in records)
    assert summary["output_tokens"] == 30
    # 5 tokens: at most 4 gaps between text chunks (the random model's special tokens and
    # partial characters print nothing)
    assert all(len(r["itl"]) <= 4 for r in records) and any(r["itl"] for r in records)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert all(summary[k]["p99"] >= summary[k]["p50"] > 0 for k in ("ttft_ms", "e2e_ms"))
    assert (tmp_path / "random.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["config"]["workload"] == "random"
    assert all(r["worker"] is None for r in records)  # no router named one
    assert abs(result["config"]["started_at"] - time.time()) < 600  # when it ran


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_agentic_sessions_grow_carry_their_header_and_hit_the_cache(tiny, tmp_path, tool_choice):
    result = bench(
        tiny, tmp_path, f"agentic-{tool_choice}", "--workload", "agentic",
        "--num-sessions", "3", "--num-turns", "3", "--system-tokens", "24",
        "--num-tools", "1", "--tool-tokens", "4", "--turn-tokens", "6", "--output-len", "6",
        "--max-concurrency", "2", "--extra-body", json.dumps({"tool_choice": tool_choice}),
    )  # fmt: skip
    summary, records = result["summary"], result["requests"]
    assert summary["num_sessions"] == 3 and summary["num_turns"] == 3
    assert summary["num_completed"] == len(records) == 9
    for session in {r["session_id"] for r in records}:
        turns = sorted((r for r in records if r["session_id"] == session), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        prompts = [r["prompt_tokens"] for r in turns]
        assert prompts[0] < prompts[1] < prompts[2]  # the whole history is resent
        assert all(r["echoed_session"] == session for r in turns)  # sent, and echoed back
    assert summary["cache_hit_ratio"] > 0
    assert [t["turn"] for t in summary["per_turn"]] == [0, 1, 2]
    for t in summary["per_turn"]:
        turn = [r for r in records if r["turn"] == t["turn"]]
        recomputed = sum(r["prompt_tokens"] - r["cached_tokens"] for r in turn) / len(turn)
        assert t["recomputed_tokens_mean"] == pytest.approx(recomputed)
        if t["ttft_ms_p50"] is not None:  # (forced tool calls stream no content token)
            assert t["ttft_ms_p50"] <= t["ttft_ms_p90"]
    assert summary["recomputed_prompt_tokens"] == sum(
        r["prompt_tokens"] - r["cached_tokens"] for r in records
    )


def test_session_context_opens_each_sessions_first_message_only(tiny_checkpoint):
    from ember.bench.workloads import WordSource, build_workload
    from ember.loader.checkpoint import open_checkpoint

    path = str(tiny_checkpoint("llama"))
    tokenizer = open_checkpoint(path).tokenizer()
    argv = ["bench", "serve", "--url", "http://x", "--workload", "agentic", "--num-sessions", "2", "--num-turns", "2",
            "--tokenizer", path]  # fmt: skip

    def sessions(*extra):
        return build_workload(WordSource(tokenizer, 0), build_parser().parse_args(argv + [*extra]))

    plain, with_context = sessions(), sessions("--session-context-tokens", "40")
    for a, b in zip(plain, with_context, strict=True):
        first, second = (turn.messages[0]["content"] for turn in b.turns)
        assert (
            first.endswith(a.turns[0].messages[0]["content"])
            and second == a.turns[1].messages[0]["content"]
        )
        assert (
            len(tokenizer.encode(first))
            >= len(tokenizer.encode(a.turns[0].messages[0]["content"])) + 30
        )
        assert b.system == a.system  # shared by all sessions, as before
    contexts = {s.turns[0].messages[0]["content"].split("\n\n")[0] for s in with_context}
    assert len(contexts) == 2  # each session's own
    # --quote-tokens: each message asks for a passage of the session's context back
    quoting = sessions("--session-context-tokens", "40", "--quote-tokens", "12")
    for a, b in zip(with_context, quoting, strict=True):
        context = b.turns[0].messages[0]["content"].split("\n\n")[0]
        for asked, turn in zip(a.turns, b.turns, strict=True):
            content = turn.messages[0]["content"]
            head, _, passage = content.partition("\n\nRepeat this text exactly, word for word:\n")
            assert head == asked.messages[0]["content"]
            assert len(passage.split()) == 12 and passage in context


def test_trace_replay_reproduces_shared_prefixes_on_time(tiny, tmp_path):
    result = bench(
        tiny, tmp_path, "trace", "--workload", "trace", "--trace", str(TRACE),
        "--num-requests", "12", "--trace-block-tokens", "32", "--time-scale", "0.05",
        "--max-concurrency", "1",
    )  # fmt: skip
    records = sorted(result["requests"], key=lambda r: r["start"])
    lines = [json.loads(line) for line in TRACE.read_text().splitlines()[:12]]
    assert len(records) == 12
    seen: set[int] = set()
    for record in records:
        line = lines[int(record["session_id"].split("-")[1])]
        assert record["hash_ids"] == line["hash_ids"]
        assert record["start"] >= line["timestamp"] / 1000 * 0.05 - 1e-3  # not before its time
        assert record["output_tokens"] == max(round(line["output_length"] / 16), 1)
        if line["hash_ids"][0] in seen:
            assert record["cached_tokens"] >= 32  # the shared 32-token block (and more)
        else:
            assert record["cached_tokens"] == 0
        seen.update(line["hash_ids"])


def test_compare_puts_runs_side_by_side(tiny, tmp_path, capsys):
    for name in ("a", "b"):
        bench(tiny, tmp_path, name, "--num-requests", "2", "--input-len", "16",
              "--output-len", "3")  # fmt: skip
    capsys.readouterr()
    argv = ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
            "--plot", str(tmp_path / "cdfs.png")]  # fmt: skip
    parsed = build_parser().parse_args(argv)
    assert parsed.func(parsed) == 0
    table = capsys.readouterr().out
    assert "metric | a | b | b / a" in table
    assert "requests completed | 2 | 2 | 1.000x" in table
    assert (tmp_path / "cdfs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_slo_is_a_clear_error(tiny):
    srv, _ = tiny
    parsed = build_parser().parse_args(["bench", "serve", "--url", srv.url, "--slo", "ttft"])
    with pytest.raises(ValueError, match="--slo"):
        parsed.func(parsed)


def test_poisson_arrivals_and_duration_bound_the_run(tiny, tmp_path):
    result = bench(
        tiny, tmp_path, "poisson", "--num-requests", "40", "--input-len", "8",
        "--output-len", "2", "--request-rate", "20", "--duration", "0.5",
    )  # fmt: skip
    starts = sorted(r["start"] for r in result["requests"])
    # 40 arrivals at 20/s span ~2 s; only those in the first 0.5 s are sent
    assert 2 <= len(starts) < 40
    assert starts[-1] <= 0.5 + 0.1
    assert starts[-1] - starts[0] > 0.1  # spread out, not all at once
