"""matmul_precision "bf16": prefill on a bf16 copy of the weights packed once, with bf16
activations and attention, against transformers run in bf16 on tiny random models."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_models import PROMPTS, SMALL_KV, hf_reference, prefill_logits, token_ids
from transformers import AutoModelForCausalLM

from conftest import simulate_cpu
from ember import LLM, SamplingParams
from ember.cli import build_parser
from ember.config import EngineConfig
from ember.engine.kernels import cpu_kernels
from ember.engine.padded_rows import padded_rows
from ember.models.layers import BF16_MIN_ROWS, DECODE_BLOCK_MAX_ROWS, Linear, cpu_has_bf16

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Bounds on the rows of logits of four prompts of 121-400 tokens, taken together. These
# random models' logits reach ~9-10 in absolute value. Measured on an AMX Xeon, off the
# fp32 logits, transformers in bf16 / ember's bf16 prefill:
# - 99.9th percentile 0.13-0.35 / 0.11-0.28;
# - mean 0.025-0.047 / 0.020-0.038;
# - the single worst 0.24-0.79 / 0.32-0.64. One prompt's worst logit is too noisy to bound
#   tightly: ember's was 0.4-1.35x transformers' prompt by prompt.
# The checks:
# - against transformers in bf16: at most MAX_ERROR of the largest logit at worst,
#   MAX_MEAN_ERROR of it on average, and the same top-1 token in at least
#   MIN_ARGMAX_AGREEMENT of rows;
# - against fp32: no further off than transformers' own bf16 run, times FP32_SLACK, on
#   average and at the 99.9th percentile (norms, rotary, softmax and the residual stream
#   stay fp32 in ember), times WORST_SLACK at worst, yet more than BF16_MIN_ERROR off (the
#   bf16 path really ran).
MAX_ERROR = 0.15
MAX_MEAN_ERROR = 0.01
MIN_ARGMAX_AGREEMENT = 0.9
FP32_SLACK = 1.25
WORST_SLACK = 2.0
BF16_MIN_ERROR = 1e-3
# Greedy steps must agree where transformers' own bf16 top-2 logit gap is at least MARGIN
# (above the worst difference measured between the two bf16 runs' logits over the four
# prompts, 0.95, so that a rounding does not swap them)
MARGIN = 1.5

needs_bf16 = pytest.mark.skipif(not cpu_has_bf16(), reason="needs AMX or AVX-512 BF16")


def _hf_bf16(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefill_logits_near_transformers_bf16(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    fp32_model, _ = hf_reference(path, arch)
    hf_bf16 = _hf_bf16(path)
    llm = LLM(str(path), matmul_precision="bf16", **SMALL_KV)
    seeded = torch.Generator().manual_seed(1)
    prompts = [PROMPTS[0], PROMPTS[3]]
    prompts += [torch.randint(3, 480, (n,), generator=seeded).tolist() for n in (250, 400)]
    rows = []  # (exact, theirs, ours) per prompt
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            exact, theirs = (m(ids).logits[0].float() for m in (fp32_model, hf_bf16))
        rows.append((exact, theirs, prefill_logits(llm, prompt)))
    exact, theirs, ours = (torch.cat(column) for column in zip(*rows, strict=True))
    assert ours.dtype == torch.float32
    scale = exact.abs().max()
    error = (ours - theirs).abs()
    assert error.max() < MAX_ERROR * scale and error.mean() < MAX_MEAN_ERROR * scale
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= MIN_ARGMAX_AGREEMENT
    ours_off, theirs_off = ((x - exact).abs().flatten() for x in (ours, theirs))
    assert BF16_MIN_ERROR < ours_off.max() <= WORST_SLACK * theirs_off.max()
    assert ours_off.quantile(0.999) <= FP32_SLACK * theirs_off.quantile(0.999)
    assert ours_off.mean() <= FP32_SLACK * theirs_off.mean()


def _compare_greedy(ours: list[int], theirs: list[int], gaps: list[float]) -> int:
    """Steps that agree up to the first divergence, which must come where transformers'
    own top-2 gap is under MARGIN (after it the contexts differ, so comparing stops)."""
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            assert gaps[step] < MARGIN, f"step {step}: {a} != {b} with a gap of {gaps[step]}"
            return step
    return len(ours)


def _hf_bf16_greedy(model, prompt):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = [step[0].float().topk(2).values for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), [float(t[0] - t[1]) for t in top2]


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # the fused C++ decode, the Python one
def test_greedy_matches_transformers_bf16_where_it_is_decided(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model = _hf_bf16(path)
    llm = LLM(str(path), matmul_precision="bf16", **SMALL_KV)
    # 18 prompts: decodes share steps with prefill chunks, then decode-only steps of 18
    # rows (bf16, through the Python layers) and of fewer (exact fp32); then the first
    # four again: prefix hits, whose chunks attend to bf16 copies of the fp32 cache
    prompts = PROMPTS + [[(5 * i + k) % 470 + 6 for i in range(9 + 7 * k)] for k in range(14)]
    compared = 0
    for batch in (prompts, PROMPTS):
        for prompt, ours in zip(batch, token_ids(llm.generate(batch, GREEDY)), strict=True):
            theirs, gaps = _hf_bf16_greedy(model, prompt)
            compared += _compare_greedy(ours, theirs, gaps)
    # near-ties come early on these random models (measured: 60 of 128 steps agree before
    # the first on PROMPTS twice); a quarter at least keeps "diverged at once" from passing
    assert compared >= NEW_TOKENS * (len(prompts) + len(PROMPTS)) // 4
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks


def _linears(llm):
    return [m for m in llm.engine.core.runner.model.modules() if isinstance(m, Linear)]


def _packed_copies(linear: Linear) -> list[torch.Tensor]:
    return [t for t in vars(linear).values() if isinstance(t, torch.Tensor) and t.is_mkldnn]


def test_weights_are_packed_once_in_bf16(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = tiny_checkpoint("llama")
    setting = torch.backends.mkldnn.matmul.fp32_precision
    exact, fast = (LLM(str(path), matmul_precision=p, **SMALL_KV) for p in ("ieee", "bf16"))
    for ours, theirs in zip(_linears(fast), _linears(exact), strict=True):
        assert [t.dtype for t in _packed_copies(ours)] == [torch.bfloat16]  # no fp32 copy
        assert [t.dtype for t in _packed_copies(theirs)] == [torch.float32]
        # decode keeps the fp32 weights (small GEMM), and no per-call rounding is set
        assert ours.weight.dtype == torch.float32 and ours.bf16_prefill
        torch.testing.assert_close(ours.packed.to_dense().float(), ours.weight.bfloat16().float())
    model = fast.engine.core.runner.model.model
    layers = model.fused_decode.layers
    assert all(p is None for layer in layers for p in layer.packed)
    # no fp32 packed copy to fall back on: GGUF blocks take any rows (drafts' verification)
    assert all(layer.block_max_rows > DECODE_BLOCK_MAX_ROWS for layer in layers)
    exact_layers = exact.engine.core.runner.model.model.fused_decode.layers
    assert all(layer.block_max_rows == DECODE_BLOCK_MAX_ROWS for layer in exact_layers)
    assert model.fused_decode_max_rows == BF16_MIN_ROWS - 1  # larger batches: bf16
    fast.generate(PROMPTS, GREEDY)
    assert torch.backends.mkldnn.matmul.fp32_precision == setting


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_bf16_steps_fused_conversions_change_no_bit(tiny_checkpoint, arch, monkeypatch):
    """In a bf16 step each decoder layer's norms give the matmul after them bf16 (the fused
    kernel rounds the float32 norm once) rather than float32 that the matmul rounds, and
    the bf16 qkv is split and rotated by one kernel (q rounded back to bf16) rather than
    widened whole (not under Qwen3's q/k norm): the same bits either way, so the prefill's
    logits are identical with and without them."""
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = tiny_checkpoint(arch)  # every row computed both times: no prefix cache
    llm = LLM(str(path), matmul_precision="bf16", enable_prefix_caching=False, **SMALL_KV)
    layers = llm.engine.core.runner.model.model.local_layers
    assert all(layer.bf16_into_attention and layer.bf16_into_mlp for layer in layers)
    assert all(layer.self_attn.fused_split == (arch != "qwen3") for layer in layers)
    handed, splits = [], []  # the dtype of each matmul's input; the fused splits
    forward = Linear.forward
    monkeypatch.setattr(
        Linear, "forward", lambda self, x: forward(self, handed.append(x.dtype) or x)
    )
    kernels = cpu_kernels()
    split = kernels.rotary_split_bf16

    class Counted:
        def __getattr__(self, name):
            return (
                (lambda *a: splits.append(1) or split(*a))
                if name == "rotary_split_bf16"
                else getattr(kernels, name)
            )

    monkeypatch.setattr("ember.models.llama.cpu_kernels_for", lambda x: Counted())
    fused = prefill_logits(llm, PROMPTS[3])
    assert len(PROMPTS[3]) >= BF16_MIN_ROWS
    # float32 in: the first layer's (its input norm adds no bf16 delta) and the head's
    assert handed.count(torch.float32) == 2 and len(handed) == 4 * len(layers) + 1
    assert len(splits) == (len(layers) if arch != "qwen3" else 0)
    for layer in layers:
        layer.bf16_into_attention = layer.bf16_into_mlp = layer.self_attn.fused_split = False
    handed.clear()
    assert torch.equal(prefill_logits(llm, PROMPTS[3]), fused)
    assert handed.count(torch.float32) == 2 * len(layers) + 1


def test_bf16_matmul_inputs_come_over_rows_rounded_to_16(monkeypatch):
    """oneDNN makes a primitive for each row count a matmul sees (7-12 ms a new count, and
    its cache grows toward a gigabyte: docs/benchmarks.md). The kernels that make a bf16
    step's matmul inputs allocate rows rounded up to ROW_QUANTUM, the spare rows zero;
    Linear multiplies over them and keeps its rows: the same bits as over the exact rows.
    float32 outputs keep their exact rows."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no ember CPU kernels on this machine")
    rows, dim = 37, 64
    norm = kernels.add_rms_norm(torch.randn(rows, dim), None, torch.rand(dim), 1e-6, True)
    silu = kernels.silu_and_mul(torch.randn(rows, 2 * dim).bfloat16())
    for made in (norm, silu):
        assert made.shape == (rows, dim) and made.dtype == torch.bfloat16
        seen = padded_rows(made)
        assert seen.shape == (48, dim) and torch.equal(seen[:rows], made)
        assert not seen[rows:].any()  # zeros, never stale values
    exact = kernels.add_rms_norm(torch.randn(rows, dim), None, torch.rand(dim), 1e-6, False)
    assert padded_rows(exact) is exact and padded_rows(norm.clone()).shape[0] == rows
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        torch.ops.mkldnn,
        "_linear_pointwise",
        lambda x, *a: calls.append(len(x)) or pointwise(x, *a),
    )
    linear = Linear(dim, 96)
    linear.weight.data = torch.randn(96, dim) / 8
    linear.pack_for_cpu(bf16_prefill=True)
    with torch.inference_mode():
        over_padded, over_exact = linear(norm), linear(norm.clone())
    assert calls == [48, rows] and over_padded.shape == (rows, 96)
    assert torch.equal(over_padded, over_exact)


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rounded_rows_change_no_bit_of_a_prefill(tiny_checkpoint, arch, monkeypatch):
    """Whole prefills (norms, attention, MLP) over rows rounded to ROW_QUANTUM and over
    their exact rows give the same logits: nothing of the spare rows reaches a real one."""
    from ember.engine import padded_rows as padding

    llm = LLM(str(tiny_checkpoint(arch)), matmul_precision="bf16", enable_prefix_caching=False,
              **SMALL_KV)  # fmt: skip
    for prompt in (PROMPTS[0], PROMPTS[2]):  # 200 and 37 rows: 8 and 11 spare
        assert len(prompt) % padding.ROW_QUANTUM and len(prompt) >= BF16_MIN_ROWS
        rounded = prefill_logits(llm, prompt)
        monkeypatch.setattr(padding, "ROW_QUANTUM", 1)
        assert torch.equal(prefill_logits(llm, prompt), rounded)
        monkeypatch.undo()


def test_an_idle_engine_runs_its_matmuls_at_every_rounded_row_count(tiny_checkpoint, monkeypatch):
    """Once its KV pages and calibration are done, an idle bf16 engine runs each distinct
    matmul of its model once at every multiple of ROW_QUANTUM up to its token budget, so
    that its first step of each size finds oneDNN's primitive made; an exact engine has
    none to make."""
    from ember.engine.padded_rows import ROW_QUANTUM

    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = str(tiny_checkpoint("llama"))
    llm = LLM(path, matmul_precision="bf16", max_num_batched_tokens=64, **SMALL_KV)
    core = llm.engine.core
    calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        torch.ops.mkldnn,
        "_linear_pointwise",
        lambda x, w, *a: calls.append((len(x), x.shape[1])) or pointwise(x, w, *a),
    )
    while core.has_idle_work():
        core.idle_work()
    assert core.idle.warmer.done and core.idle.calibrator.done
    shapes = {(m.weight.shape[1], m.weight.shape[0]) for m in core.idle.warmer.linears}
    assert len(shapes) == len(core.idle.warmer.linears) >= 4  # qkv, o, gate_up, down (+ head)
    wanted = {(rows, k) for rows in range(ROW_QUANTUM, 65, ROW_QUANTUM) for k, _ in shapes}
    assert wanted <= set(calls)
    exact = LLM(path, matmul_precision="ieee", **SMALL_KV).engine.core
    assert exact.idle.warmer.done and not exact.idle.warmer.linears


def test_narrow_wide_bf16_matmuls_split_their_rows_on_amx(monkeypatch):
    """On a CPU with AMX (forced here) a bf16 matmul with out_features <= 1024 from
    in_features >= 1024 runs its rows split across the threads, ranges of 112+ rows (200
    rows: whole); others, and the same shape without AMX, run whole. Either way the
    result is the matmul's."""
    from ember.models import layers

    kernels, calls = cpu_kernels(), []
    for amx in (True, False):
        monkeypatch.setattr(layers, "cpu_has_amx", lambda amx=amx: amx)
        for out_features, in_features in ((96, 1024), (96, 512), (1100, 1024)):
            linear = Linear(in_features, out_features)
            linear.weight.data = torch.randn(out_features, in_features) / 32
            linear.pack_for_cpu(bf16_prefill=True)
            split = amx and out_features <= 1024 and in_features >= 1024 and kernels is not None
            assert linear.split_default == split  # the rule, before SplitTuner measures
            assert (linear.split_rows is not None) == (kernels is not None)
            if split:
                kernel = linear.split_rows
                linear.split_rows = lambda *a, k=kernel: calls.append(a[-1]) or k(*a)
            for rows in (16, 200, 350):
                x = torch.randn(rows, in_features)
                expected = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float())
                with torch.inference_mode():
                    y = linear(x)
                assert y.dtype == torch.bfloat16
                torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)
    threads = torch.get_num_threads()
    assert calls == ([threads] if threads == 2 else [])  # 350 rows: 2 ranges on 2 threads


@pytest.mark.parametrize("threads", [2, 4])
def test_the_row_split_runs_on_two_threads_and_never_on_more(monkeypatch, threads):
    """On more than two threads oneDNN threads the narrow-from-wide shape itself, and the
    split into ranges of a thread each loses at every row count (a 16-core AMX Xeon:
    docs/benchmarks.md): 512 rows go in 2 ranges on 2 threads, whole on 4."""
    from ember.models import layers

    if cpu_kernels() is None:
        pytest.skip("no ember CPU kernels on this machine")
    monkeypatch.setattr(layers, "cpu_has_amx", lambda: True)
    linear = Linear(1024, 96)
    linear.weight.data = torch.randn(96, 1024) / 32
    linear.pack_for_cpu(bf16_prefill=True)
    calls = []
    kernel = linear.split_rows
    linear.split_rows = lambda *a: calls.append(a[-1]) or kernel(*a)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(512, 1024)
        with torch.inference_mode():
            y = linear(x)
    finally:
        torch.set_num_threads(before)
    expected = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float())
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)
    assert calls == ([2] if threads == 2 else [])


def test_an_exact_engine_beside_a_bf16_one_stays_exact(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model, expected = hf_reference(path, "llama")
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPTS[0]])).logits[0]
    LLM(str(path), matmul_precision="auto", **SMALL_KV).generate(PROMPTS, GREEDY)
    exact = LLM(str(path), matmul_precision="ieee", **SMALL_KV)
    torch.testing.assert_close(prefill_logits(exact, PROMPTS[0]), theirs, atol=1e-4, rtol=0)
    assert token_ids(exact.generate(PROMPTS, GREEDY)) == [e[:NEW_TOKENS] for e in expected]
    with pytest.raises(ValueError, match="matmul_precision"):
        LLM(str(path), matmul_precision="tf32", **SMALL_KV)


def test_without_bf16_units_bf16_is_refused_and_auto_stays_exact(
    tiny_checkpoint, monkeypatch, caplog
):
    simulate_cpu(monkeypatch, bf16=False, amx=False, bf16_fast=False, int8_fast=False)
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="matmul_precision 'bf16' needs a CPU with AMX"):
        LLM(str(path), matmul_precision="bf16", **SMALL_KV)
    with caplog.at_level(logging.INFO, logger="ember.engine"):
        llm = LLM(str(path), matmul_precision="auto", **SMALL_KV)
    assert "no bf16 or int8 units that outrun fp32 here, prefill stays exact fp32" in caplog.text
    assert all(not m.bf16_prefill and m.packed.dtype == torch.float32 for m in _linears(llm))
    model, _ = hf_reference(path, "llama")
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(prefill_logits(llm, PROMPTS[0]), theirs, atol=1e-4, rtol=0)


def test_cpu_probe_agrees_with_cpuinfo():
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_bf16() == bool(flags & {"amx_bf16", "avx512_bf16"})


@pytest.mark.parametrize("has_bf16", [True, False])
def test_the_default_is_auto_unless_the_environment_names_one(
    tiny_checkpoint, monkeypatch, has_bf16
):
    """No precision given: bf16 where its units outrun fp32, exact fp32 elsewhere here;
    $EMBER_MATMUL_PRECISION (which child processes inherit) overrides it."""
    simulate_cpu(monkeypatch, bf16=has_bf16, amx=has_bf16, bf16_fast=has_bf16)
    monkeypatch.delenv("EMBER_MATMUL_PRECISION")
    assert EngineConfig().matmul_precision == "auto"
    assert build_parser().parse_args(["serve"]).matmul_precision == "auto"
    llm = LLM(str(tiny_checkpoint("llama")), **SMALL_KV)
    assert all(m.bf16_prefill == has_bf16 for m in _linears(llm))
    monkeypatch.setenv("EMBER_MATMUL_PRECISION", "ieee")
    assert EngineConfig().matmul_precision == "ieee"
    assert build_parser().parse_args(["serve"]).matmul_precision == "ieee"
    monkeypatch.setenv("EMBER_MATMUL_PRECISION", "bf17")
    with pytest.raises(ValueError, match="EMBER_MATMUL_PRECISION must be auto, ieee, bf16 or int8"):
        EngineConfig()
