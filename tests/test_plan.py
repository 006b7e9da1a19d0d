"""`ember plan`: the trace as a demand, the profile's fit, the queueing arithmetic on a
fixed profile (worked by hand below), the search, and the commands end to end against a
tiny worker."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from ember.cli import main
from ember.plan.command import engine_flags
from ember.plan.demand import Demand, Request, from_bench, from_mooncake, load_trace
from ember.plan.model import (
    parse_slo,
    plan,
    predict_disaggregated,
    predict_mixed,
    replay_queue,
)
from ember.plan.profile import WorkerProfile, measure, nonneg_lstsq
from server_utils import EmberServer

# a worker whose costs are exactly (ms):
#   prefill(n, c) = 20 + 1.0 n + 0.01 n (c + n / 2) / 1000 ... x 1000 pairs
#   decode(B, c)  = 30 + 2 B + 0.5 B c / 1000
PREFILL = (20.0, 1.0, 0.01)
DECODE = (30.0, 2.0, 0.5)


def exact_profile(**overrides) -> WorkerProfile:
    def prefill(n, c):
        return PREFILL[0] + PREFILL[1] * n + PREFILL[2] * n * (c + n / 2) / 1000

    def decode(b, c):
        return DECODE[0] + DECODE[1] * b + DECODE[2] * b * c / 1000

    options = dict(
        model="m", machine="box",
        prefill=[[n, 0, prefill(n, 0)] for n in (16, 64, 256, 1024, 2048)],
        decode=[[b, c, decode(b, c)] for b in (1, 4, 16) for c in (100, 1000)],
        kv_bytes_per_token=0, max_num_batched_tokens=512, max_step_ms=0.0,
    )  # fmt: skip
    return WorkerProfile(**{**options, **overrides})


def steady(count=61, gap=1.0, prompt=200, new=200, output=50) -> Demand:
    return Demand(tuple(Request(i * gap, prompt, new, output) for i in range(count)))


def test_the_fit_recovers_the_costs_and_never_goes_negative():
    profile = exact_profile()
    assert profile.coefficients["prefill"] == pytest.approx(PREFILL, abs=1e-5)
    assert profile.coefficients["decode"] == pytest.approx(DECODE, abs=1e-5)
    import numpy as np

    # y = 5 - x: the slope would be negative, so it is held at 0 and the mean is fitted
    coef = nonneg_lstsq(np.array([[1.0, 0], [1, 1], [1, 2]]), np.array([5.0, 4, 3]))
    assert coef.tolist() == pytest.approx([4.0, 0.0])


def test_the_replayed_queue_serves_first_come_first_and_on_the_server_free_first():
    assert replay_queue([0, 0, 0], [100, 100, 100], 1) == [0, 100, 200]
    assert replay_queue([0, 0, 0], [100, 100, 100], 2) == [0, 0, 100]
    # out of order in the list: waits come back in the list's order
    assert replay_queue([50, 0, 120], [100, 100, 10], 1) == [50, 0, 80]
    assert replay_queue([0, 10, 20], [30, 5, 5], 2) == [0, 0, 0]


def test_disaggregated_arithmetic_worked_by_hand():
    """A burst of two prompts, then one every 10 s: 200 new tokens, 50 out each, on 1
    prefill + 1 decode worker."""
    demand = Demand(tuple(Request(t, 200, 200, 50) for t in (0, 0, 10, 20)))
    p = predict_disaggregated(exact_profile(), demand, prefill=1, decode=1)
    service = 20 + 200 + 0.01 * 200 * 100 / 1000  # 220.2 ms, the same for every prompt
    waits = [0, service, 0, 0]  # the second of the burst waits for the first
    per_seq = 2 + 0.5 * (200 + 25) / 1000  # per_row + per_krow x mean context while decoding
    tokens_per_ms = 3 / 20 / 1000 * 50  # 3 gaps in 20 s, 50 tokens each
    running = tokens_per_ms * 30 / (1 - tokens_per_ms * per_seq)  # Little: N = r d(N)
    itl = 30 + per_seq * running
    assert p.running_per_worker == pytest.approx(running)
    assert p.itl_ms == pytest.approx(itl)
    assert p.itl_p90_ms == pytest.approx(30 + per_seq * (running + 1.2816 * math.sqrt(running)))
    assert p.ttft_ms == pytest.approx(sum(waits) / 4 + service + itl)
    assert p.ttft_p90_ms == pytest.approx(service + service + itl)  # the burst's second
    assert p.utilization["prefill"] == pytest.approx(3 / 20 / 1000 * service)
    assert p.utilization["decode"] == pytest.approx(tokens_per_ms * per_seq)
    # two prefill workers take the burst at once
    two = predict_disaggregated(exact_profile(), demand, prefill=2, decode=1)
    assert two.ttft_p90_ms == pytest.approx(service + itl)
    # the hand-off: 1 MB a token at 2 GB/s is 0.5 ms a token, 100 ms for 200 tokens
    with_kv = predict_disaggregated(exact_profile(kv_bytes_per_token=1_000_000), demand, 1, 1)
    assert with_kv.ttft_ms - p.ttft_ms == pytest.approx(100.0)


def test_mixed_arithmetic_worked_by_hand():
    """One prompt every 0.4 s on one mixed worker: prompts stretch its decode steps."""
    demand = steady(gap=0.4)
    p = predict_mixed(exact_profile(), demand, 1)
    rate = 1 / 400  # a ms
    share = rate * (200 + 0.01 * 200 * 100 / 1000)  # 200.2 ms a prompt past the fixed cost
    per_seq = 2 + 0.5 * 225 / 1000
    tokens = rate * 50
    running = tokens * 30 / ((1 - share) - tokens * per_seq)
    step = 30 + per_seq * running  # a decode step
    assert p.running_per_worker == pytest.approx(running)
    assert p.itl_ms == pytest.approx(step / (1 - share))
    # chunks of 512 (no step budget): a prompt is one step, which also carries the decodes
    service = 20 + 200 + 0.2 + step
    assert service < 400  # each prompt done before the next: no wait
    assert p.ttft_ms == pytest.approx(service + p.itl_ms)
    # steps with a chunk: 1 in 400 ms, the rest of the time decode-only steps
    chunk_step = step + 200
    with_chunk = rate / (rate + (1 - rate * chunk_step) / step)
    assert with_chunk > 0.1  # so the p90 gap is a step with a chunk
    assert p.itl_p90_ms == pytest.approx(chunk_step)
    sparse = predict_mixed(exact_profile(), steady(gap=3.0), 1)  # 1 step in ~90 has one
    assert sparse.itl_p90_ms < 40
    assert p.itl_p90_ms > predict_disaggregated(exact_profile(), demand, 1, 1).itl_p90_ms


def test_a_step_budget_shrinks_the_mixed_workers_gaps():
    budget = predict_mixed(exact_profile(max_step_ms=100.0), steady(), 1)
    none = predict_mixed(exact_profile(), steady(), 1)
    assert budget.itl_p90_ms == pytest.approx(100.0, rel=1e-6)  # a chunk fills the budget
    assert budget.ttft_ms > none.ttft_ms  # in more, smaller chunks


def test_an_itl_target_holds_the_mixed_workers_gaps_for_longer_prompts():
    """A 120 ms target under the ~246 ms steps that carry a 200-token chunk beside ~8
    decodes: those steps run in slices with decode steps between, so the p90 gap is the
    target, and each prompt also carries the decode steps between its slices (one per
    120 ms less a decode step)."""
    demand = steady(gap=0.5)  # a chunk step is the p90 gap (1 step in 10 or more)
    none = predict_mixed(exact_profile(), demand, 1)
    target = predict_mixed(exact_profile(target_itl_ms=120.0), demand, 1)
    assert none.itl_p90_ms > 200 and target.itl_p90_ms == pytest.approx(120.0)
    step = none.itl_p90_ms - 200  # the decode step the prompt's one step carried
    slices = math.ceil(220.2 / (120.0 - step))  # decode steps among the slices, in all
    assert target.running_per_worker >= 1  # (decodes run beside every prompt)
    service = 220.2 + slices * step
    assert target.ttft_ms == pytest.approx(service + target.itl_ms)
    assert target.ttft_ms > none.ttft_ms
    above = predict_mixed(exact_profile(target_itl_ms=1000.0), demand, 1)  # never reached
    assert (above.itl_p90_ms, above.ttft_ms) == (none.itl_p90_ms, none.ttft_ms)


def test_the_recommended_flags_keep_the_profiled_workers_limits():
    # a profile from before the ITL target went on by default: the worker had none
    assert engine_flags(exact_profile()) == [
        "--max-num-batched-tokens", "512", "--max-step-ms", "0", "--target-itl-ms", "0",
    ]  # fmt: skip
    auto = exact_profile(max_num_batched_tokens=1024, max_step_ms=250.0, target_itl_ms=95.0,
                         target_itl_auto=True)  # fmt: skip
    assert engine_flags(auto) == []
    assert engine_flags(exact_profile(max_step_ms=250.0, target_itl_ms=80.0))[-2:] == [
        "--target-itl-ms", "80",
    ]  # fmt: skip


def test_overload_is_unstable_and_more_workers_fix_it():
    heavy = steady(count=201, gap=0.1)  # 10 prompts a second of 220 ms each
    assert not predict_disaggregated(exact_profile(), heavy, 1, 1).stable
    assert not predict_mixed(exact_profile(), heavy, 1).stable
    # 0.5 tokens a ms at 2.1 ms a sequence-step: more than one decode worker can step
    assert not predict_disaggregated(exact_profile(), heavy, 4, 1).stable
    assert predict_disaggregated(exact_profile(), heavy, 4, 2).stable
    assert predict_disaggregated(exact_profile(), heavy, 4, 2).as_dict()["ttft_ms"] is not None
    assert predict_mixed(exact_profile(), heavy, 1).as_dict()["ttft_p90_ms"] is None


def test_the_plan_is_the_smallest_cluster_meeting_the_slo():
    demand = steady(gap=0.4)
    slo = {"ttft": 400, "itl": 60}
    result = plan(exact_profile(), demand, slo, max_workers=4)
    best = result.disaggregated
    assert (best.prefill, best.decode) == (1, 1) and best.meets(slo)
    # a mixed worker's p90 gap is a step with a 200-token chunk until prompts are rare
    # enough on each: 2 workers (a prompt every 0.8 s each, 1 step in ~13 with one)
    assert predict_mixed(exact_profile(), demand, 1).itl_p90_ms > 200
    assert result.mixed.workers == 2 and result.mixed.itl_p90_ms < 60
    assert result.best is best  # 2 workers either way: the lower p90s
    assert best.ttft_p90_ms + best.itl_p90_ms < result.mixed.ttft_p90_ms + result.mixed.itl_p90_ms
    assert best.command() == "ember up --prefill 1 --decode 1"
    loose = plan(exact_profile(), demand, {"ttft": 2000, "itl": 600}, max_workers=4)
    assert loose.best.mode == "mixed" and loose.best.workers == 1  # fewer workers win
    assert plan(exact_profile(), demand, {"ttft": 10}, max_workers=3).best is None
    assert len(result.considered) == 4 + 6  # 1-4 mixed, and every P + D <= 4


def test_a_profile_whose_idle_decode_step_costs_nothing_still_plans():
    """A fit may put a decode step's fixed cost at 0 (a tiny model, noisy gaps): at no
    load a step then costs nothing, and the plan must still come out finite."""
    free = exact_profile(decode=[[b, c, 2.0 * b] for b in (1, 4, 16) for c in (100, 1000)])
    assert free.coefficients["decode"][0] == pytest.approx(0, abs=1e-9)
    for prediction in plan(free, steady(gap=1.0), {"ttft": 1e6}, max_workers=2).considered:
        assert prediction.stable and prediction.itl_p90_ms >= 0


def test_slo_parsing():
    assert parse_slo("ttft=500, itl=50") == {"ttft": 500.0, "itl": 50.0}
    for bad in ("tpot=5", "ttft", "ttft=x", "ttft=0", ""):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_a_mooncake_trace_is_shaped_as_ember_bench_replays_it(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 1536, "output_length": 512, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 1400, "output_length": 100, "hash_ids": [0, 1, 3]},
        {"timestamp": 4000, "input_length": 100, "output_length": 10, "hash_ids": [0]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    demand = load_trace(path, block_tokens=16, output_scale=0.5, time_scale=2.0)
    # 16 tokens a 512-token block: 48, 44 and 3 tokens; blocks [0, 1] seen before: 32
    # cached; block [0] alone: all but the last token
    assert demand.requests == (
        Request(0.0, 48, 48, 256), Request(4.0, 44, 12, 50), Request(6.0, 3, 1, 5),
    )  # fmt: skip
    assert demand.rate == pytest.approx(2 / 6)
    assert load_trace(path, start=1, count=1 + 1).requests[0].arrival == 0.0
    assert from_mooncake(rows, 16, None, 1.0).requests[0].output_tokens == 16  # 512 x 16/512
    with pytest.raises(ValueError, match="time_scale"):
        load_trace(path, time_scale=0)
    with pytest.raises(ValueError, match="at once"):
        from_mooncake([dict(rows[0], timestamp=0)] * 2, 16, None, 1.0)


def test_an_ember_bench_result_is_a_demand(tmp_path):
    result = {"config": {}, "summary": {}, "requests": [
        {"start": 5.0, "prompt_tokens": 100, "cached_tokens": 64, "output_tokens": 20,
         "error": None},
        {"start": 7.5, "prompt_tokens": 50, "cached_tokens": 0, "output_tokens": 0,
         "error": None},
        {"start": 6.0, "prompt_tokens": 9, "cached_tokens": 0, "output_tokens": 0,
         "error": "HTTP 429"},
    ]}  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    assert load_trace(path).requests == (Request(0.0, 100, 36, 20), Request(2.5, 50, 50, 1))
    with pytest.raises(ValueError, match="no completed"):
        from_bench({"requests": []})


@pytest.fixture(scope="module")
def tiny_worker(tiny_checkpoint):
    server = EmberServer(str(tiny_checkpoint("llama")), "--max-step-ms", "0")
    yield server
    server.stop()


PROBES = ["--lengths", "16", "48", "96", "--batches", "1", "2", "4", "--contexts", "32",
          "--decode-tokens", "32", "--repeats", "1", "--no-progress"]  # fmt: skip


def test_profile_a_running_worker_and_plan_from_it(tiny_worker, tmp_path, capsys):
    out = tmp_path / "profile.json"
    args = ["plan", "profile", "--url", tiny_worker.url, "--out", str(out), *PROBES]
    assert main([*args, "--machine", "a test box"]) == 0
    profile = WorkerProfile.load(out)
    assert profile.machine == "a test box" and profile.source == tiny_worker.url
    assert [row[0] for row in profile.prefill] == [16, 48, 96]
    assert [row[:2] for row in profile.decode] == [[1, 48], [2, 48], [4, 48]]
    assert all(row[-1] > 0 for row in profile.prefill + profile.decode)
    assert all(c >= 0 for part in profile.coefficients.values() for c in part)
    # the tiny llama: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes
    assert profile.kv_bytes_per_token == 512
    # the worker's own limits: the default chunk, the step budget its fixture turned off,
    # the ITL target auto (what it came to on the worker's own steps)
    assert (profile.max_num_batched_tokens, profile.max_step_ms) == (1024, 0.0)
    assert profile.target_itl_auto and profile.target_itl_ms > 0

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 2000 * i, "input_length": 2048, "output_length": 256,
                    "hash_ids": [0, 1, 100 + i, 200 + i]}) + "\n" for i in range(20)
    ))  # fmt: skip
    plan_json = tmp_path / "plan.json"
    args = ["plan", "--trace", str(trace), "--trace-block-tokens", "16", "--profile", str(out),
            "--slo", "ttft=60000,itl=60000", "--max-workers", "3", "--json", str(plan_json)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    # the worker ran with --max-step-ms 0: so must the recommended ones
    assert "recommended: ember up --mixed 1 --max-step-ms 0" in printed
    saved = json.loads(plan_json.read_text())
    assert saved["recommended"]["command"] == "ember up --mixed 1"
    assert saved["engine_flags"] == ["--max-step-ms", "0"]
    assert saved["demand"]["mean_prompt_tokens"] == 64 and saved["demand"]["requests"] == 20
    assert len(saved["considered"]) == 3 + 3
    assert main([*args[:-6], "--slo", "ttft=0.001", "--max-workers", "2"]) == 1
    assert "no configuration meets the SLO" in capsys.readouterr().out


def test_profile_errors_are_clear(tiny_worker, tmp_path):
    with pytest.raises(ValueError, match="is not an ember plan profile"):
        (tmp_path / "p.json").write_text('{"model": "m"}')
        WorkerProfile.load(tmp_path / "p.json")
    with pytest.raises(ValueError, match="3 or more"):
        WorkerProfile("m", "box", [[1, 0, 1]], [[1, 0, 1]])
    assert main(["plan", "--slo", "ttft=5"]) == 2  # no trace: refused, exit 2
    assert main(["plan", "profile", "--url", tiny_worker.url, "--cores", "1"]) == 2
    with pytest.raises(ValueError, match="raise --decode-tokens"):
        asyncio.run(measure(tiny_worker.url, lengths=(16, 32, 48), batches=(1,),
                            contexts=(16,), decode_tokens=1, repeats=1, progress=False))  # fmt: skip


def test_plan_without_a_profile_profiles_the_model_here_first(tiny_checkpoint, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 1000 * i, "input_length": 512, "output_length": 512,
                    "hash_ids": [i]}) + "\n" for i in range(5)
    ))  # fmt: skip
    saved = tmp_path / "here.json"
    args = ["plan", "--trace", str(trace), "--slo", "ttft=60000", "--model",
            str(tiny_checkpoint("llama")), "--cores", "1", "--save-profile", str(saved),
            "--serve-args", "--kv-cache-memory 64M", *PROBES]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "profiling the model on this machine first" in out and "recommended:" in out
    profile = WorkerProfile.load(saved)
    assert profile.machine.endswith("1 cores") and profile.source.startswith("http://127.0.0.1")
