"""SplitTuner: whether each bf16 matmul runs whole or split by rows, timed on this CPU
while the engine is idle (ember.engine.matmul_split)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_models import SMALL_KV
from torch import nn

from ember import LLM, envs
from ember.engine import calibration
from ember.engine.kernels import cpu_kernels
from ember.engine.matmul_split import MARGIN, SplitTuner
from ember.engine.padded_rows import ROW_QUANTUM
from ember.models.layers import Linear


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def fake_linears(count: int, shape=(96, 64), default=False) -> nn.ModuleList:
    """Linears that look packed for bf16 and splittable; nothing is multiplied."""
    linears = nn.ModuleList(Linear(shape[1], shape[0]) for _ in range(count))
    for linear in linears:
        linear.split_rows = lambda *a: None
        linear.split_default = default
    return linears


def scripted(split_wins, ratio=0.5):
    """A measure where the split takes `ratio` of the whole call's time at the rows
    `split_wins(rows)` says, and 1 / ratio of it elsewhere; records the rows timed."""
    timed = []

    def measure(linears, rows, parts):
        assert parts == 2 and len(linears) >= 1
        timed.append(rows)
        return (1.0, ratio, 1.0) if split_wins(rows) else (1.0, 1 / ratio, 1.0)

    return measure, timed


def drain(tuner: SplitTuner) -> int:
    steps = 0
    while not tuner.done:
        tuner.step()
        steps += 1
    return steps


def test_the_tuner_finds_where_the_winner_changes_to_a_row_quantum(two_threads):
    """Samples every 128 rows, then bisection between two that disagree: the table says
    split exactly where the (scripted) split is faster, to ROW_QUANTUM rows, after far
    fewer timings than row counts; every linear of the shape shares it."""
    model = fake_linears(3)
    measure, timed = scripted(lambda rows: 752 <= rows < 1072)
    tuner = SplitTuner(model, 2048, measure)
    steps = drain(tuner)
    assert steps == len(timed) + 1 < 40  # (the last step only hands the table over)
    assert len(set(timed)) == len(timed)  # no row count timed twice
    table = model[0].split_by_rows
    assert all(linear.split_by_rows is table for linear in model[1:])
    assert tuner.backoff.num_contended == 0
    assert len(table) == 2048 // ROW_QUANTUM + 1
    for index, split in enumerate(table):
        assert split == (752 <= index * ROW_QUANTUM < 1072), index * ROW_QUANTUM


def test_a_choice_moves_from_the_rule_only_for_more_than_the_margin(two_threads):
    """A shape the rule splits stays split where whole is only a little faster (noise),
    and goes whole where it is clearly faster; one the rule keeps whole likewise."""
    near, clear = 1 - MARGIN / 2, 1 - 2 * MARGIN
    for default in (True, False):
        for ratio, moves in ((near, False), (clear, True)):
            model = fake_linears(1, default=default)
            # the other way is faster everywhere by 1 / ratio
            measure, _ = scripted(lambda rows, d=default: not d, ratio=ratio)
            drain(SplitTuner(model, 512, measure))
            table = model[0].split_by_rows
            from_two = table[224 // ROW_QUANTUM :]  # two ranges of 112+ rows
            assert set(from_two) == {default != moves}, (default, ratio)
            assert not any(table[: 224 // ROW_QUANTUM])  # too few rows to split in two


def test_split_parts_follow_the_table_on_two_threads_only(two_threads):
    linear = fake_linears(1)[0]
    assert linear.split_parts(512) == 1  # no table yet: the rule (whole, for this shape)
    linear.split_default = True
    assert [linear.split_parts(r) for r in (208, 224, 512)] == [1, 2, 2]
    table = [False] * (2048 // ROW_QUANTUM + 1)
    table[512 // ROW_QUANTUM] = True
    linear.split_by_rows = tuple(table)
    assert [linear.split_parts(r) for r in (496, 512, 528, 4096)] == [1, 2, 1, 1]
    torch.set_num_threads(1)
    assert linear.split_parts(512) == 1
    measure, timed = scripted(lambda rows: True)
    assert SplitTuner(fake_linears(2), 2048, measure).done and not timed  # nothing to tune


def test_rule_keeps_the_fixed_rule_and_a_bad_value_names_the_variable(two_threads, monkeypatch):
    monkeypatch.setenv("EMBER_MATMUL_SPLIT", "rule")
    measure, timed = scripted(lambda rows: True)
    model = fake_linears(2)
    assert SplitTuner(model, 2048, measure).done and not timed
    assert model[0].split_by_rows is None
    monkeypatch.setenv("EMBER_MATMUL_SPLIT", "fast")
    with pytest.raises(ValueError, match="EMBER_MATMUL_SPLIT"):
        envs.matmul_split()


def test_an_idle_bf16_engine_times_its_matmuls_and_still_computes_them(
    tiny_checkpoint, monkeypatch, two_threads
):
    """A bf16 engine's idle work gives every packed matmul but the head a table from real
    timings, before the step cost calibration; each linear then gives the matmul's
    result, split or whole, at any row count."""
    if cpu_kernels() is None:
        pytest.skip("no ember CPU kernels on this machine")
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = str(tiny_checkpoint("llama"))
    llm = LLM(path, matmul_precision="bf16", max_num_batched_tokens=512,
              max_prefill_step_tokens=768, **SMALL_KV)  # fmt: skip
    core = llm.engine.core  # (steps of up to 768 rows: the longest a step can have)
    while not core.idle.prefaulter.done:
        core.idle_work()
    assert not core.idle.split_tuner.done
    core.idle_work()  # the tuner's first step comes before the calibration's
    assert any(core.idle.split_tuner.timings.values()) and core.idle.calibrator.num_observed == 0
    while core.has_idle_work():
        core.idle_work()
    shapes = core.idle.split_tuner.shapes
    assert len(shapes) >= 4  # qkv, o, gate_up, down
    timed = [m for linears in shapes.values() for m in linears]
    model = core.runner.model
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.split_rows is not None]
    assert set(map(id, packed)) - set(map(id, timed)) <= {id(model.lm_head)}
    for linear in timed:
        assert len(linear.split_by_rows) == 768 // ROW_QUANTUM + 1
        for rows in (240, 512):
            x = torch.randn(rows, linear.weight.shape[1])
            with torch.inference_mode():
                y = linear(x)
            expected = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float())
            torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)


def test_a_timing_taken_while_another_process_had_the_cpu_is_taken_again_later(
    two_threads, monkeypatch
):
    """A timing whose threads had too little of their CPU time is not kept: the tuner is
    not `ready` until the backoff's wait is over, then times the same rows again."""
    monkeypatch.setattr(calibration, "MIN_JUDGED_MS", 10.0)  # as served (conftest: never)
    shares = [0.5, 1.0]  # the first timing shared the CPU

    def measure(linears, rows, parts):
        return 1.0, 0.5, shares.pop(0) if shares else 1.0

    tuner = SplitTuner(fake_linears(1), 512, measure)
    tuner.step()
    assert (
        tuner.backoff.num_contended == 1
        and not tuner.ready
        and not tuner.timings[next(iter(tuner.shapes))]
    )
    tuner.backoff._resume_at = 0.0  # the wait over
    assert tuner.ready
    tuner.step()
    assert [rows for rows, *_ in next(iter(tuner.timings.values()))] == [224]
