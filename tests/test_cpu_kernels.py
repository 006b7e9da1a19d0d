"""ember's C++ CPU kernels against the torch ops they stand in for, on every instruction
set build this CPU can run (an AVX-512 machine runs the AVX2 and generic builds too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.engine.kernels import cpu_kernels, supported_isas


@pytest.fixture(scope="module", params=supported_isas())
def kernels(request):
    module = cpu_kernels(request.param)
    if module is None:
        pytest.skip("no C++ toolchain to build kernels")
    assert module.isa == request.param
    return module


@pytest.mark.parametrize("rows", range(1, 9))
def test_small_gemm_matches_linear(rows, kernels):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 576), torch.randn(960, 576), torch.randn(960)
    torch.testing.assert_close(kernels.small_gemm(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(kernels.small_gemm(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_gemm_widens_bf16_weights(rows, kernels):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 576), torch.randn(960, 576).bfloat16(), torch.randn(960)
    expected = F.linear(x, w.float(), b)  # x stays fp32: only W was rounded
    torch.testing.assert_close(kernels.small_gemm(x, w, b), expected, atol=1e-4, rtol=1e-5)


def test_small_gemm_declines_shapes_it_does_not_handle(kernels):
    assert kernels.small_gemm_supported(8, 576, 960)
    assert not kernels.small_gemm_supported(9, 576, 960)  # larger batches: oneDNN / MKL
    assert not kernels.small_gemm_supported(4, 570, 960)  # in_features not a multiple of 16
    assert not kernels.small_gemm_supported(4, 576, 962)  # out_features not a multiple of 4
    with pytest.raises(RuntimeError, match="small_gemm"):
        kernels.small_gemm(torch.randn(9, 64), torch.randn(8, 64), None)


# Offsets of each block format's fp16 fields (scale d, minimum m or dmin): every other
# byte is a quantized code or a packed sub-block scale, random in the tests below.
HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def block_shape(name: str) -> tuple[int, int]:
    """(weights, bytes) per block, as gguf lists them: 32-weight blocks, 256-weight K-quants."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


def random_blocks(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """[rows, blocks per row, bytes per block]: every byte random (all codes, all packed
    sub-block scales and minimums) but the fp16 fields, which are finite, of either sign,
    over a wide range, subnormals included."""
    block_weights, block_bytes = block_shape(name)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(
        0, 256, (rows * cols // block_weights, block_bytes), dtype=torch.uint8, generator=gen
    )
    for offset in HALF_FIELDS[name]:
        exponent = torch.randint(-26, 4, (blocks.shape[0],), generator=gen).float()
        sign = torch.randint(0, 2, (blocks.shape[0],), generator=gen).float() * 2 - 1
        halves = (sign * torch.rand(blocks.shape[0], generator=gen) * 2**exponent).half()
        blocks[:, offset : offset + 2] = halves.view(torch.uint8).view(-1, 2)
    return blocks.view(rows, cols // block_weights, block_bytes)


def dequantized(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """The fp32 weights ember's loader makes of these blocks."""
    import gguf

    from ember.loader.dequant import dequantize

    qtype = gguf.GGMLQuantizationType[name]
    weights = dequantize(blocks.flatten(1).numpy(), qtype)
    return torch.from_numpy(weights.reshape(blocks.shape[0], -1))


def sub_block_scale_codes(blocks: torch.Tensor, name: str) -> list[set[int]]:
    """The distinct sub-block scale (and minimum) codes of K-quant blocks."""
    import gguf

    flat = blocks.flatten(0, 1).numpy()
    if name == "Q6_K":
        return [set(flat[:, 192:208].view("int8").flatten().tolist())]
    scales, minimums = gguf.quants.Q4_K.get_scale_min(flat[:, 4:16])
    return [set(scales.flatten().tolist()), set(minimums.flatten().tolist())]


# out_features 964: a multiple of 4 (the kernel's row groups), not of 8 or 16 (vectors)
BLOCK_GEMM_SHAPES = {32: (964, 576), 256: (964, 768)}  # by weights per block


@pytest.mark.parametrize("name", HALF_FIELDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 11, 16])
def test_block_gemm_equals_small_gemm_on_the_dequantized_weights(name, rows, kernels):
    """Bit for bit: the blocks decode to exactly the loaded fp32 W, summed in the same order."""
    out_features, in_features = BLOCK_GEMM_SHAPES[block_shape(name)[0]]
    blocks = random_blocks(name, out_features, in_features, seed=rows)
    if name.endswith("_K"):  # every packed 6-bit (Q6_K: 8-bit) sub-block code occurs
        for codes in sub_block_scale_codes(blocks, name):
            assert codes == set(range(-128, 128) if name == "Q6_K" else range(64))
    w = dequantized(blocks, name)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    torch.manual_seed(rows)
    x, b = torch.randn(rows, in_features), torch.randn(out_features)
    for bias in (None, b):
        # more than 8 rows: one pass over W per 8 rows of x, each the small GEMM's sums
        parts = [kernels.small_gemm(part.contiguous(), w, bias) for part in x.split(8)]
        assert torch.equal(kernels.block_gemm(x, blocks, bias), torch.cat(parts))
    # and within fp32 rounding of MKL's product (bounded by the sum of |terms|)
    error = (kernels.block_gemm(x, blocks, b) - F.linear(x, w, b)).abs()
    assert (error <= 1e-5 * (x.abs() @ w.abs().T + b.abs())).all()


@pytest.mark.parametrize("name", HALF_FIELDS)
def test_dequantize_blocks_is_gguf_py_bit_for_bit(name, kernels):
    """The loader's fast path (every code, every packed sub-block scale) against gguf-py's
    reference dequantizer; in bf16 (the packed copy's source), those values rounded as
    torch rounds them."""
    import gguf

    out_features, in_features = BLOCK_GEMM_SHAPES[block_shape(name)[0]]
    blocks = random_blocks(name, out_features, in_features, seed=7)
    reference = gguf.quants.dequantize(blocks.flatten(1).numpy(), gguf.GGMLQuantizationType[name])
    weights = kernels.dequantize_blocks(blocks)
    assert weights.shape == (out_features, in_features)
    assert torch.equal(weights, torch.from_numpy(reference))
    # any number of rows, one block each (the loader hands over a tensor's blocks flat)
    flat = blocks.flatten(0, 1).unsqueeze(1)
    assert torch.equal(kernels.dequantize_blocks(flat).flatten(), weights.flatten())
    low = kernels.dequantize_blocks(blocks, bf16=True)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low.view(torch.int16), weights.bfloat16().view(torch.int16))


def test_dequantize_blocks_refuses_what_it_cannot_decode(kernels):
    with pytest.raises(RuntimeError, match="none of Q4_0"):
        kernels.dequantize_blocks(torch.zeros(4, 2, 19, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="3-D uint8"):
        kernels.dequantize_blocks(torch.zeros(4, 18, dtype=torch.uint8))


def quantized_int8(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 path sees it: each 32 values rounded (ties to even) to dx * q, dx = max
    |x| / 127, q = x * (127 / max |x|) in fp32; the values dx * q themselves, in float64."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(groups * inverse)
    assert q.abs().max() <= 127
    return ((amax / 127).double() * q.double()).view_as(x)


TILED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # formats tile_blocks regroups


def int8_case(name: str, rows: int, out_features: int, in_features: int, seed: int):
    """Random blocks (every code), their fp32 W, and x with a group of zeros and one large
    value (the rest of its group rounds to 0), and a bias."""
    blocks = random_blocks(name, out_features, in_features, seed=seed)
    torch.manual_seed(seed)
    x, b = torch.randn(rows, in_features) * torch.rand(rows, 1) * 4, torch.randn(out_features)
    x[0, :32] = 0  # a group of zeros: dx = 0
    x[-1, 40] = 1e4  # one large value: the rest of its group rounds to 0
    return blocks, dequantized(blocks, name), x, b


def assert_int8_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    """y is x W^T + b with x rounded to int8 per 32 values: within fp32 rounding of that
    product in float64 (the integer sums are exact), and within x's rounding of the fp32
    product. Returns the size of the terms that bounds y's rounding, per output."""
    rows, out_features = y.shape
    xq = quantized_int8(x)
    exact = xq @ w.double().T + b.double()
    # the kernel sums scale * code * x and min * x apart: their size, not the products',
    # bounds its rounding; |min| is within a group's largest |w| (random codes span it)
    spread = w.double().abs().view(out_features, -1, 32).amax(-1, keepdim=True)
    sizes = (w.double().abs().view(out_features, -1, 32) + 2 * spread).view_as(w)
    magnitude = xq.abs() @ sizes.T + b.double().abs()
    assert ((y.double() - exact).abs() <= 2e-6 * magnitude).all()
    # against exact fp32 activations: off by at most W times x's rounding (dx / 2 a value)
    half_steps = (x.view(rows, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
    bound = half_steps.reshape(rows, -1).double() @ w.double().abs().T
    assert (
        (y.double() - F.linear(x, w, b).double()).abs() <= bound * 1.001 + 2e-6 * magnitude
    ).all()
    return magnitude


@pytest.mark.parametrize("name", HALF_FIELDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_block_gemm_int8_is_exact_on_int8_rounded_activations(name, rows, kernels):
    """The int8 path multiplies the loaded fp32 W by x rounded to int8 per 32 values: within
    fp32 rounding of that product in float64 (its integer sums are exact), on every code of
    every format, and within x's rounding of the fp32 product."""
    blocks, w, x, b = int8_case(name, rows, *BLOCK_GEMM_SHAPES[block_shape(name)[0]], 100 + rows)
    y = kernels.block_gemm_int8(x, blocks, b)
    magnitude = assert_int8_product(y, x, w, b)
    # rows are independent: one row alone gives its result (up to the rounding above)
    alone = kernels.block_gemm_int8(x[-1:], blocks, b).double()
    assert ((alone - y[-1:].double()).abs() <= 4e-6 * magnitude[-1:]).all()


@pytest.mark.parametrize("name", TILED)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
def test_tiled_int8_gemm_is_exact_on_int8_rounded_activations(name, rows, kernels):
    """Blocks in tiles of 16 features (the same bytes regrouped; Q5's fifth bits regrouped
    within their words) give the int8 product as the blocks do, each row the same bits alone as among others, and (where the CPU has
    AVX512-VNNI) the same bits with and without its instruction."""
    from ember.models.tiles import tile_blocks

    blocks, w, x, b = int8_case(name, rows, 960, 576, seed=200 + rows)
    tiles = tile_blocks(blocks)
    assert tiles.shape == (60, 18, 16, blocks.shape[2])
    if not name.startswith("Q5"):  # the same bytes, regrouped
        assert torch.equal(tiles.flatten().sort().values, blocks.flatten().sort().values)
    bits = torch.tensor([bin(v).count("1") for v in range(256)])  # Q5: fifth bits regrouped too
    assert bits[tiles.flatten().long()].sum() == bits[blocks.flatten().long()].sum()
    y = kernels.block_gemm_int8(x, tiles, b)
    assert_int8_product(y, x, w, b)
    for i in range(rows):
        assert torch.equal(kernels.block_gemm_int8(x[i : i + 1], tiles, b), y[i : i + 1])
    if kernels.tiles_use_vnni():
        assert torch.equal(kernels.tiled_gemm_int8(x, tiles, b, allow_vnni=False), y)


@pytest.mark.parametrize("size", [18, 20, 22, 24, 34])
def test_tiles_from_the_kernels_are_the_bytes_torch_regroups(size, kernels):
    """tile_blocks_into (one pass, in C++) gives the tiles torch's permuted copies make,
    every byte value in every field (the fifth bits' words too), for several tiles and
    block columns; shapes it cannot tile are refused by name."""
    from ember.models.tiles import tile_blocks, tile_blocks_torch

    generator = torch.Generator().manual_seed(size)
    blocks = torch.randint(0, 256, (48, 7, size), dtype=torch.uint8, generator=generator)
    tiles = tile_blocks(blocks, kernels)
    assert torch.equal(tiles, tile_blocks_torch(blocks))
    with pytest.raises(RuntimeError, match="20 features, not a multiple of 16"):
        tile_blocks(blocks[:20], kernels)
    with pytest.raises(RuntimeError, match="19-byte blocks"):
        tile_blocks(torch.zeros(16, 2, 19, dtype=torch.uint8), kernels)


def test_tiled_int8_gemm_gives_the_same_bits_on_every_build():
    """The same integer sums and the same float operations per lane on every build."""
    from ember.models.tiles import tile_blocks

    builds = [cpu_kernels(isa) for isa in supported_isas()]
    if any(build is None for build in builds):
        pytest.skip("no C++ toolchain to build kernels")
    for name in TILED:
        blocks, _, x, b = int8_case(name, 11, 320, 1024, seed=9)
        tiles = tile_blocks(blocks)
        results = [build.block_gemm_int8(x, tiles, b) for build in builds]
        assert all(torch.equal(result, results[0]) for result in results[1:]), name


def test_tiled_int8_gemm_refuses_what_it_cannot_take(kernels):
    x = torch.randn(2, 64)
    with pytest.raises(
        RuntimeError, match="19-byte blocks are none of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0"
    ):
        kernels.block_gemm_int8(x, torch.zeros(1, 2, 16, 19, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="3 blocks of 32 weights per row, for 64"):
        kernels.block_gemm_int8(x, torch.zeros(1, 3, 16, 18, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match=r"tiles \[out / 16, blocks, 16, bytes\]"):
        kernels.block_gemm_int8(x, torch.zeros(2, 2, 8, 18, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="contiguous uint8 tiles"):
        kernels.block_gemm_int8(
            x, torch.zeros(2, 16, 2, 18, dtype=torch.uint8).transpose(1, 2), None
        )
    with pytest.raises(RuntimeError, match="2-D float32 x"):
        kernels.block_gemm_int8(x.double(), torch.zeros(1, 2, 16, 18, dtype=torch.uint8), None)


def test_block_gemm_refuses_what_it_cannot_decode(kernels):
    assert kernels.block_gemm_supported(576, 960, 18)  # Q4_0
    assert not kernels.block_gemm_supported(560, 960, 18)  # in_features not whole blocks
    assert not kernels.block_gemm_supported(576, 962, 18)  # out_features not a multiple of 4
    assert kernels.block_gemm_supported(1536, 576, 144)  # Q4_K: 256 weights per super-block
    assert not kernels.block_gemm_supported(576, 1536, 144)
    assert not kernels.block_gemm_supported(576, 960, 19)  # no such format
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="19-byte blocks are none of Q4_0"):
        kernels.block_gemm(x, torch.zeros(8, 2, 19, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="in_features % 256 == 0"):
        kernels.block_gemm(x, torch.zeros(8, 1, 144, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="3 blocks of 32 weights per row, for 64"):
        kernels.block_gemm(x, torch.zeros(8, 3, 18, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="3-D blocks"):
        kernels.block_gemm(x, torch.zeros(8, 36, dtype=torch.uint8), None)
    with pytest.raises(RuntimeError, match="uint8 blocks"):
        kernels.block_gemm(x, torch.zeros(8, 2, 18), None)


def test_add_rms_norm_adds_in_place_and_normalizes(kernels):
    residual, delta, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    expected_residual = residual + delta
    out = kernels.add_rms_norm(residual, delta, w, 1e-5)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(out, F.rms_norm(expected_residual, (64,), w, 1e-5))
    untouched = residual.clone()
    torch.testing.assert_close(
        kernels.add_rms_norm(residual, None, w, 1e-5), F.rms_norm(untouched, (64,), w, 1e-5)
    )
    torch.testing.assert_close(residual, untouched)


@pytest.mark.parametrize("width", [576, 37])
def test_add_rms_norm_widens_a_bf16_delta_and_rounds_a_bf16_norm_once(kernels, width):
    """A bf16 step's norm: a bf16 delta (a bf16 matmul's output) is added exactly as its
    float32 widening would be, and `bf16_out` gives the float32 norm rounded to bf16 as
    torch rounds it, bit for bit (widths that are not whole vectors included)."""
    torch.manual_seed(width)
    residual, w = torch.randn(7, width), torch.randn(width)
    delta = torch.randn(7, 2 * width).bfloat16()[:, :width]  # strided rows
    widened, fused = residual.clone(), residual.clone()
    expected = kernels.add_rms_norm(widened, delta.float(), w, 1e-5)
    out = kernels.add_rms_norm(fused, delta, w, 1e-5, True)
    assert out.dtype == torch.bfloat16 and torch.equal(fused, widened)
    assert torch.equal(out, expected.bfloat16())
    assert torch.equal(kernels.add_rms_norm(residual.clone(), delta, w, 1e-5), expected)
    with pytest.raises(RuntimeError, match="float32 or bf16 delta"):
        kernels.add_rms_norm(residual, delta.half(), w, 1e-5)
    with pytest.raises(RuntimeError, match="delta rows"):
        kernels.add_rms_norm(residual, delta[:3], w, 1e-5)


def test_rotary_split_bf16_is_widening_rotating_and_rounding_q(kernels):
    """A bf16 qkv split in one pass: q, k and v exactly as widening the whole qkv to
    float32, rotary_ on q and k, and rounding q back to bf16 give them (odd widths and
    strided rows included); bad shapes are refused."""
    heads, kv_heads = 3, 1
    for dim in (64, 10):
        tokens = 5
        wide = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 6).bfloat16()
        qkv = wide[:, : (heads + 2 * kv_heads) * dim]
        cos, sin = torch.randn(tokens, dim), torch.randn(tokens, dim)
        q, k, v = kernels.rotary_split_bf16(qkv, cos, sin, heads, kv_heads)
        widened = qkv.float().view(tokens, heads + 2 * kv_heads, dim)
        kernels.rotary_(widened[:, : heads + kv_heads], cos, sin)
        assert q.dtype == torch.bfloat16 and k.dtype == v.dtype == torch.float32
        assert torch.equal(q, widened[:, :heads].bfloat16())
        assert torch.equal(k, widened[:, heads : heads + kv_heads])
        assert torch.equal(v, widened[:, heads + kv_heads :])
    with pytest.raises(RuntimeError, match="head counts"):
        kernels.rotary_split_bf16(qkv, cos, sin, 4, 1)
    with pytest.raises(RuntimeError, match="cos, sin"):
        kernels.rotary_split_bf16(qkv, cos[:2], sin[:2], heads, kv_heads)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.rotary_split_bf16(qkv.float(), cos, sin, heads, kv_heads)


@pytest.mark.parametrize("rows, parts", [(233, 2), (64, 3), (5, 8)])
def test_linear_split_rows_is_the_matmul_of_each_row_range(kernels, rows, parts):
    """oneDNN's packed bf16 matmul run on row ranges at once, a thread each: each range
    exactly what the matmul gives for those rows alone, in order, bias included (more
    parts than rows: a row each)."""
    torch.manual_seed(rows)
    w, bias = torch.randn(40, 96).bfloat16(), torch.randn(40).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    x = torch.randn(rows, 96).bfloat16()
    out = kernels.linear_split_rows(x, packed, bias, parts)
    parts = min(parts, rows)
    bounds = [rows * i // parts for i in range(parts + 1)]
    expected = torch.cat(
        [
            torch.ops.mkldnn._linear_pointwise(x[a:b], packed, bias, "none", [], "")
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )
    assert torch.equal(out, expected)
    torch.testing.assert_close(
        out.float(), F.linear(x.float(), w.float(), bias.float()), atol=0.1, rtol=0.02
    )
    with pytest.raises(RuntimeError, match="parts >= 1"):
        kernels.linear_split_rows(x, packed, None, 0)


def test_rotary_rotates_strided_heads_in_place(kernels):
    qkv = torch.randn(7, 10, 32)  # q and k heads are the first 8 of every token's 10
    cos, sin = torch.randn(7, 32), torch.randn(7, 32)
    qk = qkv[:, :8]
    rotated = torch.cat([-qk[..., 16:], qk[..., :16]], -1)
    expected = qk * cos[:, None] + rotated * sin[:, None]
    untouched = qkv[:, 8:].clone()
    kernels.rotary_(qk, cos, sin)
    torch.testing.assert_close(qkv[:, :8], expected)
    torch.testing.assert_close(qkv[:, 8:], untouched)


@pytest.mark.parametrize("width", [128, 1536, 37])  # 37: not a whole vector
def test_silu_and_mul(kernels, width):
    gate_up = torch.randn(3, 2 * width)
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("width", [1536, 37])
def test_silu_and_mul_with_approx_exp_stays_within_its_bound(kernels, width):
    """float32 with approx_exp (a product the next matmul rounds to int8 or bf16): within
    1e-5 of the exact product, gates whose e^-|g| is subnormal or 0 included; on the x86
    builds it is the polynomial's (not the exact pass's bits), the generic build's is exact."""
    torch.manual_seed(width)
    gate_up = torch.randn(5, 2 * width) * 6
    gate_up[0, :6] = torch.tensor([-90.0, -100.0, -120.0, 90.0, 150.0, -150.0])
    gate, up = gate_up.double().split(width, dim=1)
    expected = gate * torch.sigmoid(gate) * up
    out = kernels.silu_and_mul(gate_up, approx_exp=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-30)
    exact = kernels.silu_and_mul(gate_up)
    assert torch.equal(out, exact) == (kernels.isa == "generic")


@pytest.mark.parametrize("width", [1536, 37])
def test_silu_and_mul_in_bf16_rounds_the_float32_product_once(kernels, width):
    """bf16 in, bf16 out (a bf16 step's MLP): within a bf16 rounding of the product
    computed in float64 on the bf16 inputs, gates large enough to saturate the sigmoid
    included; rows may be strided (a view of a wider tensor)."""
    torch.manual_seed(width)
    wide = (torch.randn(5, 2 * width + 8) * 6).bfloat16()
    # gates whose e^-|g| is a subnormal float, or rounds to 0
    wide[0, :6] = torch.tensor([-90.0, -100.0, -120.0, 90.0, 150.0, -150.0])
    gate_up = wide[:, : 2 * width]
    gate, up = gate_up.double().split(width, dim=1)
    expected = gate * torch.sigmoid(gate) * up
    out = kernels.silu_and_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == (5, width)
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-30)


def test_write_kv_stores_rows_at_their_slots(kernels):
    cache_k, cache_v = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    kv = torch.randn(3, 6, 8)  # k heads 2..3 and v heads 4..5 of a fused qkv
    slots = torch.tensor([5, 17, 63])
    kernels.write_kv(kv[:, 2:4], kv[:, 4:6], cache_k, cache_v, slots)
    torch.testing.assert_close(cache_k.view(-1, 2, 8)[slots], kv[:, 2:4])
    torch.testing.assert_close(cache_v.view(-1, 2, 8)[slots], kv[:, 4:6])
    assert cache_k.view(-1, 2, 8).abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 17, 63]


def masked_prefill_reference(q, keys, values, context_len, scale):
    """torch's SDPA over a gathered context with the causal mask of a chunk whose queries
    are the last len(q) positions: q [T, H, D], keys/values [context_len, Hkv, D]."""
    query_pos = torch.arange(context_len - q.shape[0], context_len)
    mask = torch.arange(context_len)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def paged_chunk(tokens, context, block_size, group, num_kv_heads, head_dim):
    """A chunk's q and a shuffled paged cache holding its context: (q, key_cache,
    value_cache, block table, the context's keys, its values)."""
    num_blocks = -(-context // block_size)
    key_cache = torch.randn(num_blocks + 3, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn_like(key_cache)
    table = torch.randperm(num_blocks + 3)[:num_blocks]
    keys = key_cache[table].reshape(-1, num_kv_heads, head_dim)[:context]
    values = value_cache[table].reshape(-1, num_kv_heads, head_dim)[:context]
    q = torch.randn(tokens, num_kv_heads * group, head_dim)
    return q, key_cache, value_cache, table, keys, values


# the tile holds 24 query rows (AVX-512) or 12 (8-lane builds): chunks of 1 row, of less
# than a tile, of several tiles with a partial last one; contexts that end mid-vector,
# blocks smaller and larger than a vector of keys, every group size up to 8
@pytest.mark.parametrize(
    "tokens, context, block_size, group",
    [(1, 1, 16, 3), (5, 5, 16, 1), (37, 37, 16, 3), (100, 301, 16, 3), (31, 200, 5, 2),
     (64, 64, 32, 4), (19, 90, 16, 7), (50, 130, 16, 8)],
)  # fmt: skip
def test_prefill_attention_reads_the_blocks_in_place_and_matches_sdpa(
    tokens, context, block_size, group, kernels
):
    torch.manual_seed(tokens + context)
    num_kv_heads = 2
    for head_dim in kernels.prefill_head_dims:
        q, key_cache, value_cache, table, keys, values = paged_chunk(
            tokens, context, block_size, group, num_kv_heads, head_dim
        )
        scale = head_dim**-0.5
        out = kernels.paged_prefill_attention(q, key_cache, value_cache, table, context, scale)
        expected = masked_prefill_reference(q, keys, values, context, scale)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def bf16_operand_reference(q, keys, values, context_len, scale):
    """Causal attention in float64 on bf16-rounded q, keys and values (no further rounding)."""
    q, keys, values = (x.bfloat16().double() for x in (q, keys, values))
    return masked_prefill_reference(q, keys, values, context_len, scale)


@pytest.mark.parametrize(
    "tokens, context, block_size, group",
    [(1, 1, 16, 3), (37, 37, 16, 3), (100, 301, 16, 3), (31, 200, 5, 2), (19, 90, 16, 7),
     (50, 131, 16, 8)],
)  # fmt: skip
def test_bf16_prefill_attention_is_attention_on_bf16_operands(
    tokens, context, block_size, group, kernels
):
    """The bf16 kernel (bf16 q, float32 cache rounded to bf16 as it is read): within the
    rounding of the softmax weights and of the bf16 output (2^-8 of the largest value,
    with room) of attention computed in float64 on the rounded operands. Where this build
    and CPU have the bf16 dot product it gives exactly what the float multiply-adds give;
    every build runs the latter. Where they have AMX tiles, the AMX kernel is held to the
    same bound, and to the float multiply-adds' result within a bf16 rounding (its sums
    run in another order: a score's float32 rounding can tip a weight's or an output's
    bf16 rounding)."""
    torch.manual_seed(tokens + context)
    num_kv_heads = 2
    for head_dim in kernels.prefill_head_dims:
        q, key_cache, value_cache, table, keys, values = paged_chunk(
            tokens, context, block_size, group, num_kv_heads, head_dim
        )
        q = q.bfloat16()
        scale = head_dim**-0.5
        args = (q, key_cache, value_cache, table, context, scale)
        out = kernels.paged_prefill_attention_bf16(*args, False)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        expected = bf16_operand_reference(q.float(), keys, values, context, scale)
        bound = values.abs().max().item() * 2**-8
        assert (out.double() - expected).abs().max().item() < bound
        if kernels.bf16_dot_supported():
            assert torch.equal(kernels.paged_prefill_attention_bf16(*args, True), out)
        if kernels.amx_supported():
            tiles = kernels.paged_prefill_attention_amx(*args)
            assert tiles.dtype == torch.bfloat16 and tiles.shape == q.shape
            assert (tiles.double() - expected).abs().max().item() < bound
            torch.testing.assert_close(tiles, out, atol=bound / 2, rtol=2**-7)


@pytest.mark.parametrize("tokens, context", [(40, 600), (200, 700), (7, 390), (130, 130)])
@pytest.mark.parametrize("fall", [False, True])
def test_amx_prefill_attention_follows_scores_that_climb_and_fall(tokens, context, fall, kernels):
    """The AMX kernel moves a row's running maximum only where a score passes it by more
    than 2^8 in weight. Keys that climb along the context (positive queries, so every
    block of 128 keys outscores the last: rescaled sums, and climbs within that slack)
    while the keys after each row's position score highest of all (they must weigh
    nothing), or climb and then fall far below (weights under 2^-126): within the bf16
    bound of attention on the rounded operands, as on plain random data."""
    if not kernels.amx_supported():
        pytest.skip("this CPU or build has no AMX tiles")
    torch.manual_seed(context + fall)
    block_size, num_kv_heads = 16, 2
    for head_dim in kernels.prefill_head_dims:
        q, key_cache, value_cache, table, keys, values = paged_chunk(
            tokens, context, block_size, 3, num_kv_heads, head_dim
        )
        q = q.abs().mul(0.5).bfloat16()
        ramp = torch.linspace(0, 8, context)
        if fall:
            ramp[int(context * 0.7) :] = -30.0
        keys = keys + ramp[:, None, None]
        slots = table[torch.arange(context) // block_size] * block_size
        slots = slots + torch.arange(context) % block_size
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = keys
        scale = head_dim**-0.5
        tiles = kernels.paged_prefill_attention_amx(
            q, key_cache, value_cache, table, context, scale
        )
        expected = bf16_operand_reference(q.float(), keys, values, context, scale)
        bound = values.abs().max().item() * 2**-8
        assert (tiles.double() - expected).abs().max().item() < bound


def test_bf16_prefill_attention_refuses_a_dot_product_it_lacks_and_float32_q(kernels):
    key_cache = torch.zeros(4, 16, 1, kernels.prefill_head_dims[0])
    q = torch.zeros(3, 1, kernels.prefill_head_dims[0], dtype=torch.bfloat16)
    if not kernels.bf16_dot_supported():
        with pytest.raises(RuntimeError, match="no bf16 dot product"):
            kernels.paged_prefill_attention_bf16(
                q, key_cache, key_cache, torch.arange(4), 3, 1.0, True
            )
    with pytest.raises(RuntimeError, match="q in BFloat16"):
        kernels.paged_prefill_attention_bf16(
            q.float(), key_cache, key_cache, torch.arange(4), 3, 1.0, False
        )
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_prefill_attention_bf16(
            q, key_cache, key_cache, torch.tensor([7]), 3, 1.0, False
        )


def test_prefill_attention_refuses_what_it_has_no_build_for(kernels):
    key_cache = torch.zeros(4, 16, 1, 24)
    with pytest.raises(RuntimeError, match="head_dim 24"):
        kernels.paged_prefill_attention(
            torch.zeros(3, 1, 24), key_cache, key_cache, torch.arange(4), 3, 1.0
        )
    key_cache = torch.zeros(4, 16, 1, kernels.prefill_head_dims[0])
    q = torch.zeros(3, 1, kernels.prefill_head_dims[0])
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_prefill_attention(q, key_cache, key_cache, torch.tensor([7]), 3, 1.0)
    with pytest.raises(RuntimeError, match="context_len"):  # more tokens than the blocks hold
        kernels.paged_prefill_attention(q, key_cache, key_cache, torch.tensor([0]), 17, 1.0)


def test_a_build_killed_mid_way_does_not_block_the_next_one():
    """torch's lock file, left behind by a build that was killed, is cleared (a fresh
    process would otherwise wait on it for ever); the kernels still load."""
    import subprocess
    import sys

    from ember.engine.kernels import _STAMP, _build_directory

    directory = _build_directory("generic")
    cpu_kernels("generic")  # built, then: the stamp lost (the build did not finish)
    (directory / _STAMP).unlink()
    stale = directory / "lock"
    stale.touch()
    load = "from ember.engine.kernels import cpu_kernels; assert cpu_kernels('generic') is not None"
    subprocess.run([sys.executable, "-c", load], check=True, timeout=600)
    assert not stale.exists()
    assert (directory / _STAMP).exists()


def test_built_cpu_kernels_never_compiles(tmp_path, monkeypatch):
    """The GGUF loader's accessor: a finished build loads, a missing one gives None at once
    (no compiler run: the build directory stays empty)."""
    from ember import envs
    from ember.engine import kernels as module

    monkeypatch.setattr(module, "_asked", set())
    assert module.built_cpu_kernels() is cpu_kernels()  # this checkout's build is there
    monkeypatch.setattr(module, "_asked", set())
    monkeypatch.setattr(envs, "cache_dir", lambda: tmp_path)
    assert module.built_cpu_kernels() is None
    (directory,) = (tmp_path / "kernels").iterdir()
    assert directory.name.startswith(module.selected_isa()) and not any(directory.iterdir())


AMD_AVX2 = frozenset("fpu sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split())
XEON_AVX512 = AMD_AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "amx_bf16"}


def test_the_build_is_picked_from_the_cpus_flags_at_run_time(monkeypatch):
    from ember.engine import kernels as module

    monkeypatch.setattr(module, "_is_x86", lambda: True)
    assert module.supported_isas(XEON_AVX512) == ["avx512", "avx2", "generic"]
    assert module.supported_isas(AMD_AVX2) == ["avx2", "generic"]
    assert module.supported_isas(AMD_AVX2 - {"fma"}) == ["generic"]  # AVX2 without FMA
    assert module.supported_isas(frozenset()) == ["generic"]
    monkeypatch.setattr(module, "_is_x86", lambda: False)  # ARM: the portable build
    assert module.supported_isas(XEON_AVX512) == ["generic"]


def test_ember_cpu_isa_forces_a_build_and_refuses_one_the_cpu_cannot_run(monkeypatch, cpu_isa):
    from ember.engine import kernels as module

    cpu_isa("generic")
    assert module.selected_isa() == "generic"
    cpu_isa("AVX9")
    with pytest.raises(ValueError, match="EMBER_CPU_ISA must be one of avx512, avx2, generic"):
        module.selected_isa()
    cpu_isa("avx512")
    monkeypatch.setattr(module, "cpu_flags", lambda: AMD_AVX2)
    monkeypatch.setattr(module, "_is_x86", lambda: True)
    with pytest.raises(
        ValueError, match=r"EMBER_CPU_ISA=avx512: .*lacks avx512bw, .*runs avx2, generic"
    ):
        module.selected_isa()


@pytest.mark.parametrize("width", [1, 7, 16, 40, 49152])
def test_argmax_rows_is_torchs_argmax_with_ties_nans_and_infinities(width, kernels):
    """Each row's first maximum (the first NaN where a row has one), as torch's argmax
    gives it, on rows of every width (a vector's and past it), ties everywhere, infinities,
    rows of -inf alone, NaNs anywhere, strided rows."""
    generator = torch.Generator().manual_seed(width)
    for _ in range(10):
        rows = torch.randint(0, 3, (9, width), generator=generator).float()
        rows[1] = -float("inf")
        rows[2, torch.randint(0, width, (2,), generator=generator)] = float("inf")
        rows[3, torch.randint(0, width, (3,), generator=generator)] = float("nan")
        rows[4, -1] = float("nan")
        rows[5] = torch.randn(width, generator=generator)
        assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1))
        wide = torch.randn(4, width + 5, generator=generator)[:, 2 : 2 + width]  # strided
        assert torch.equal(kernels.argmax_rows(wide), wide.argmax(dim=-1))
    assert kernels.argmax_rows(torch.zeros(0, width)).shape == (0,)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(torch.zeros(2, width, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.zeros(width, 2).t())


@pytest.mark.parametrize("target", ["host", "aarch64"])
def test_generic_vector_helpers_on_each_target(target, tmp_path):
    """The generic build's widening, broadcasts, fp16 and int8-tile helpers give what
    scalar arithmetic gives, compiled for this machine and (where aarch64-linux-gnu-g++
    and qemu-aarch64 are installed: `apt-get install g++-aarch64-linux-gnu qemu-user`)
    for ARM, whose NEON lowering of the same code differs."""
    import shutil
    import subprocess

    from torch.utils.cpp_extension import include_paths

    compiler, runner = (
        ("g++", []) if target == "host" else ("aarch64-linux-gnu-g++", ["qemu-aarch64"])
    )
    if shutil.which(compiler) is None or (runner and shutil.which(runner[0]) is None):
        pytest.skip(f"no {compiler} / {' '.join(runner)} here")
    source = Path(__file__).parent / "native" / "simd_generic_check.cpp"
    kernels_dir = Path(__file__).parents[1] / "ember" / "engine" / "kernels"
    binary = tmp_path / "check"
    flags = ["-static"] if runner else []  # qemu runs it without an ARM sysroot
    includes = [f"-I{kernels_dir}"] + [f"-I{path}" for path in include_paths()]
    subprocess.run(
        [compiler, "-O3", "-std=c++17", *flags, *includes, str(source), "-o", str(binary)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    result = subprocess.run([*runner, str(binary)], capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("isa generic"), result.stdout
    assert result.returncode == 0 and "0 failures" in result.stdout, result.stdout
