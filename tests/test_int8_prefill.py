"""matmul_precision "int8": a GGUF file's blocks that tile (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
multiply every row count on int8 activations, prefill chunks as decode steps do, with no
packed copy; and auto's choice of precision per CPU. (The default model's accuracy in it
is checked against transformers in test_smollm2.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_gguf_loader import BLOCK_CASES, VOCAB, write_tiny_model
from test_models import prefill_logits

from conftest import simulate_cpu
from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.engine.kernels import cpu_kernels, supported_isas
from ember.models.layers import BLOCK_GEMM_MAX_ROWS, EVERY_ROW, Linear, tiled

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="no C++ toolchain to build kernels")

SMALL = dict(kv_cache_memory=1 << 24)
# prompts past BLOCK_GEMM_MAX_ROWS tokens, so that their prefill leaves the decode path
PROMPTS = [[(7 * i + j) % (VOCAB - 3) + 3 for i in range(40 + 9 * j)] for j in range(3)]


def _linears(llm: LLM) -> list[Linear]:
    model = llm.engine.core.runner.model
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("int8")
    paths = {}
    for case in ("llama-Q4_1", "llama-k-quants"):
        paths[case] = directory / f"{case}.gguf"
        write_tiny_model(paths[case], **BLOCK_CASES[case])
    return paths


@pytest.mark.parametrize("case", ["llama-Q4_1", "llama-k-quants"])
def test_tiles_take_every_row_and_no_packed_copy(files, case):
    """Under int8 a matmul whose blocks tile multiplies every row count on them (its W
    neither read nor kept, no packed copy); one whose blocks do not (K-quants, this head
    of 300 rows) keeps the fp32 packed copy above BLOCK_GEMM_MAX_ROWS rows."""
    llm = LLM(str(files[case]), matmul_precision="int8", **SMALL)
    assert llm.engine.core.runner.prefill_precision == "int8"
    linears = _linears(llm)
    on_tiles = [m for m in linears if tiled(m)]
    others = [m for m in linears if not tiled(m)]
    assert on_tiles and others  # the head is not whole tiles in either file
    for m in on_tiles:
        assert m.packed is None and m.weight.is_meta
        assert m.block_max_rows == m.int8_max_rows == EVERY_ROW
    for m in others:
        assert m.packed is not None and m.packed.dtype == torch.float32
        assert m.block_max_rows == BLOCK_GEMM_MAX_ROWS
    assert (len(on_tiles) == 8) == (case == "llama-Q4_1")  # 2 layers x 4; k-quants: not down
    for layer in llm.engine.core.runner.model.model.fused_decode.layers:
        assert layer.packed[0] is None  # the fused decode layer takes every row on tiles too
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8] * len(PROMPTS)
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks


def test_a_prefill_row_is_what_the_same_row_gives_alone(files):
    """On tiles no float work is shared between rows: a matmul of 40 rows (a prefill
    chunk) gives each row to the bit what that row alone gives (a decode step), and
    differs from the fp32 product by the rounding of x to int8 only."""
    llm = LLM(str(files["llama-Q4_1"]), matmul_precision="int8", **SMALL)
    exact = LLM(
        str(files["llama-Q4_1"]), matmul_precision="ieee", decode_activations="fp32", **SMALL
    )
    ours = llm.engine.core.runner.model.model.layers[1].mlp.gate_up_proj
    theirs = exact.engine.core.runner.model.model.layers[1].mlp.gate_up_proj
    x = torch.randn(40, ours.weight.shape[1])
    with torch.inference_mode():
        together = ours(x)
        alone = torch.cat([ours(x[i : i + 1]) for i in range(len(x))])
        reference = theirs(x)
    assert torch.equal(together, alone)
    scale = reference.abs().max()
    assert 1e-4 < (together - reference).abs().max() / scale < 0.02


def test_int8_prefill_stays_near_exact_prefill(files):
    """The prompt's logits in int8 are those of exact prefill up to int8 rounding: near,
    never equal. These random models (unscaled normal weights) amplify it: measured, a
    mean error of 1.1-1.5% of the largest logit, the same top-1 token at 90-97% of
    positions, and the first greedy token that differs from exact prefill's (with decode
    on int8 in both, the default outside AMX) the fourth. The default model's error is
    bounded in test_smollm2.py."""
    path = str(files["llama-Q4_1"])
    int8 = LLM(path, matmul_precision="int8", **SMALL)
    fp32 = LLM(path, matmul_precision="ieee", decode_activations="int8", **SMALL)
    for prompt in PROMPTS:
        ours, theirs = prefill_logits(int8, prompt), prefill_logits(fp32, prompt)
        error = (ours - theirs).abs()
        assert 1e-4 < error.mean() < 0.02 * theirs.abs().max()
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.85
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in int8.generate(PROMPTS, params)]
    assert got == [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, params)]


def test_silu_takes_its_fast_exp_only_before_a_matmul_that_rounds_its_input(files, monkeypatch):
    """The MLP's silu takes e^-|g| on the polynomial (approx_exp) exactly when the down
    projection rounds its input to int8 for that many rows: every row count under int8,
    decode rows only under exact prefill with int8 decode, none under exact fp32."""
    import ember.models.llama as llama

    seen = []
    real = llama.silu_and_mul
    monkeypatch.setattr(
        llama,
        "silu_and_mul",
        lambda g, approx_exp=False: seen.append(approx_exp) or real(g, approx_exp),
    )
    path = str(files["llama-Q4_1"])
    cases = [("int8", "auto", [True, True]), ("ieee", "int8", [True, False]),
             ("ieee", "fp32", [False, False])]  # fmt: skip
    for precision, activations, expected in cases:
        llm = LLM(path, matmul_precision=precision, decode_activations=activations, **SMALL)
        mlp = llm.engine.core.runner.model.model.layers[1].mlp
        seen.clear()
        with torch.inference_mode():
            for rows in (1, 40):
                mlp(torch.randn(rows, mlp.gate_up_proj.weight.shape[1]))
        assert seen == expected, (precision, activations)


def test_fused_decode_layers_give_the_python_layers_bits(files):
    """The fused decode layer (C++) picks silu's exp as the Python MLP does: a decode
    step's log-probabilities are the same bits through either, under int8 and exact."""
    path = str(files["llama-Q4_1"])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    for precision, activations in (("int8", "auto"), ("ieee", "fp32")):
        runs = []
        for fused in (True, False):
            llm = LLM(path, matmul_precision=precision, decode_activations=activations, **SMALL)
            model = llm.engine.core.runner.model.model
            assert model.fused_decode is not None
            if not fused:
                model.fused_decode_max_rows = 0
            outputs = llm.generate(PROMPTS, params)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
        assert runs[0] == runs[1], (precision, activations)


@pytest.mark.parametrize(
    "amx, vnni, bf16_fast, expected",
    [
        (True, True, True, "bf16"),  # a Xeon with AMX
        (False, True, True, "int8"),  # an AMD EPYC with AVX512-VNNI and BF16
        (False, True, False, "int8"),  # a Xeon whose AMX is not offered
        (False, False, True, "bf16"),  # AMD's AVX512-BF16, tiles without VNNI
        (False, False, False, "fp32"),
    ],
)
def test_auto_takes_the_precision_measured_fastest_on_the_cpu(
    files, monkeypatch, caplog, amx, vnni, bf16_fast, expected
):
    """auto: bf16 on AMX, else int8 where the tiles run on AVX512-VNNI (its prompts
    attending in bf16 where bf16 outruns fp32, with a bf16 KV cache), else bf16 where it
    outruns fp32, else exact fp32 prefill (decode still int8)."""
    simulate_cpu(monkeypatch, bf16=True, amx=amx, bf16_fast=bf16_fast or amx, int8_fast=vnni)
    with caplog.at_level(logging.INFO, logger="ember.engine"):
        llm = LLM(str(files["llama-Q4_1"]), matmul_precision="auto", **SMALL)
    runner = llm.engine.core.runner
    assert runner.prefill_precision == expected
    assert runner.bf16_prefill == (expected == "bf16")
    assert any(m.block_max_rows == EVERY_ROW for m in _linears(llm)) == (expected == "int8")
    backend = runner.model.model.layers[0].self_attn.backend
    bf16_chunks = expected == "int8" and bf16_fast and backend.attends_bf16
    assert backend.bf16_chunks == bf16_chunks
    assert runner.bf16_attention == (bf16_chunks or expected == "bf16")
    assert runner.kv_caches[0].dtype == (torch.bfloat16 if runner.bf16_attention else torch.float32)
    assert runner.int8_decode  # decode steps round to int8 in every auto choice
    assert "matmul_precision auto: " in caplog.text
    # decode activations asked exact keep prefill off the int8 tiles
    exact_decode = LLM(
        str(files["llama-Q4_1"]), decode_activations="fp32", matmul_precision="auto", **SMALL
    )
    faster = "bf16" if bf16_fast or amx else "fp32"
    assert exact_decode.engine.core.runner.prefill_precision == faster


def test_auto_takes_int8_only_for_checkpoints_mostly_in_tiled_blocks(files, monkeypatch):
    """int8 leaves matmuls whose blocks do not tile (K-quants, fp16 or fp32 matrices) in
    fp32, so auto takes it only where at least half of the matrix weights are in blocks
    the tiles take (Checkpoint.tiled_share, from the file's index); elsewhere a CPU whose
    bf16 outruns fp32 keeps bf16."""
    from ember.engine import precision
    from ember.loader.checkpoint import open_checkpoint

    simulate_cpu(monkeypatch, amx=False, bf16_fast=True, int8_fast=True)
    share = open_checkpoint(files["llama-Q4_1"]).tiled_share()
    k_share = open_checkpoint(files["llama-k-quants"]).tiled_share()
    assert share == 1.0 and 0.5 < k_share < 0.9  # its two down projections: K-quants
    config = EngineConfig(matmul_precision="auto")
    assert precision.prefill_precision(config, share) == "int8"
    assert precision.prefill_precision(config, precision.TILED_SHARE_FOR_INT8) == "int8"
    assert precision.prefill_precision(config, 0.49) == "bf16"
    assert precision.prefill_precision(config, 0.0) == "bf16"  # safetensors, fp16 GGUF


def test_int8_is_refused_beside_fp32_decode_and_keys_its_own_kv(files, monkeypatch):
    """int8 rounds every row, which decode_activations fp32 forbids: refused, naming both;
    KV computed in int8 is not KV computed in fp32 (the stored blocks' key tells them
    apart); $EMBER_MATMUL_PRECISION names it too."""
    path = str(files["llama-Q4_1"])
    with pytest.raises(ValueError, match="matmul_precision 'int8'.*decode_activations 'fp32'"):
        LLM(path, matmul_precision="int8", decode_activations="fp32", **SMALL)
    identities = {
        precision: LLM(path, matmul_precision=precision, **SMALL).engine.core._kv_identity()
        for precision in ("int8", "ieee")
    }
    assert identities["int8"] != identities["ieee"] and "prefill int8" in identities["int8"]
    monkeypatch.setenv("EMBER_MATMUL_PRECISION", "int8")
    assert EngineConfig().matmul_precision == "int8"
    monkeypatch.setenv("EMBER_MATMUL_PRECISION", "int4")
    with pytest.raises(ValueError, match="EMBER_MATMUL_PRECISION must be auto, ieee, bf16 or int8"):
        EngineConfig()
    with pytest.raises(ValueError, match="matmul_precision must be auto, ieee, bf16 or int8"):
        EngineConfig(matmul_precision="int4")


def test_cpu_probes_agree_with_cpuinfo():
    """bf16 outruns fp32 on AMX, and on AMD's AVX-512 BF16; the tiles sum on VNNI where the
    CPU has it (AVX512-VNNI in the AVX-512 build, AVX-VNNI in the AVX2 one) and outrun
    fp32 at prefill sizes on AVX512-VNNI."""
    from ember.models.layers import cpu_bf16_outruns_fp32, cpu_int8_outruns_fp32

    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    flags = set(text.split())
    amd_bf16 = "AuthenticAMD" in flags and "avx512_bf16" in flags
    assert cpu_bf16_outruns_fp32() == ("amx_bf16" in flags or amd_bf16)
    for build in [cpu_kernels(isa) for isa in supported_isas()]:
        if build is None:
            continue
        # the AVX-512 build sums on AVX512-VNNI, the AVX2 one on AVX-VNNI, where present
        vnni = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}.get(build.isa)
        expected = "" if vnni is None or vnni not in flags else vnni.replace("_", "")
        assert build.tiles_vnni_name() == expected, build.isa
        # prefill on the tiles pays on AVX512-VNNI only (AVX-VNNI's 256 bits: decode rows)
        assert cpu_int8_outruns_fp32(build) == (expected == "avx512vnni")
    assert not cpu_int8_outruns_fp32(None)
