"""ember's C++ CPU kernels against the torch ops they stand in for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.engine.kernels import cpu_kernels

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C++ toolchain to build kernels")


@pytest.mark.parametrize("rows", range(1, 9))
def test_small_gemm_matches_linear(rows):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 576), torch.randn(960, 576), torch.randn(960)
    torch.testing.assert_close(kernels.small_gemm(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(kernels.small_gemm(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_gemm_widens_bf16_weights(rows):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 576), torch.randn(960, 576).bfloat16(), torch.randn(960)
    expected = F.linear(x, w.float(), b)  # x stays fp32: only W was rounded
    torch.testing.assert_close(kernels.small_gemm(x, w, b), expected, atol=1e-4, rtol=1e-5)


def test_small_gemm_declines_shapes_it_does_not_handle():
    assert kernels.small_gemm_supported(8, 576, 960)
    assert not kernels.small_gemm_supported(9, 576, 960)  # larger batches: oneDNN / MKL
    assert not kernels.small_gemm_supported(4, 570, 960)  # in_features not a multiple of 16
    assert not kernels.small_gemm_supported(4, 576, 962)  # out_features not a multiple of 4
    with pytest.raises(RuntimeError, match="small_gemm"):
        kernels.small_gemm(torch.randn(9, 64), torch.randn(8, 64), None)


def test_add_rms_norm_adds_in_place_and_normalizes():
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


def test_rotary_rotates_strided_heads_in_place():
    qkv = torch.randn(7, 10, 32)  # q and k heads are the first 8 of every token's 10
    cos, sin = torch.randn(7, 32), torch.randn(7, 32)
    qk = qkv[:, :8]
    rotated = torch.cat([-qk[..., 16:], qk[..., :16]], -1)
    expected = qk * cos[:, None] + rotated * sin[:, None]
    untouched = qkv[:, 8:].clone()
    kernels.rotary_(qk, cos, sin)
    torch.testing.assert_close(qkv[:, :8], expected)
    torch.testing.assert_close(qkv[:, 8:], untouched)


def test_silu_and_mul():
    gate_up = torch.randn(3, 256)
    expected = F.silu(gate_up[:, :128]) * gate_up[:, 128:]
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), expected)


def test_write_kv_stores_rows_at_their_slots():
    cache_k, cache_v = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    kv = torch.randn(3, 6, 8)  # k heads 2..3 and v heads 4..5 of a fused qkv
    slots = torch.tensor([5, 17, 63])
    kernels.write_kv(kv[:, 2:4], kv[:, 4:6], cache_k, cache_v, slots)
    torch.testing.assert_close(cache_k.view(-1, 2, 8)[slots], kv[:, 2:4])
    torch.testing.assert_close(cache_v.view(-1, 2, 8)[slots], kv[:, 4:6])
    assert cache_k.view(-1, 2, 8).abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 17, 63]
