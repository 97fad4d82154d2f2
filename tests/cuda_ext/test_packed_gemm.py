"""oneDNN's prepacked GEMM (cuda_ext.packed_gemm) against torch's plain linear."""

from __future__ import annotations

import pytest
import torch

from cuda_ext.packed_gemm import PackedWeight, packed_gemm_support, reference_linear

FLOAT32_WHY_NOT = packed_gemm_support(torch.float32)
needs_onednn = pytest.mark.skipif(
    FLOAT32_WHY_NOT is not None, reason=f"no oneDNN float32 GEMM: {FLOAT32_WHY_NOT}"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matches_reference_at_any_row_count(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g)  # [out, in]
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 80, generator=g)
    packed = PackedWeight(weight)
    got = packed(x, bias)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference_linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_weight_is_a_copy():
    weight = torch.randn(16, 32)
    x = torch.randn(3, 32)
    packed = PackedWeight(weight)
    expected = reference_linear(x, weight, None)
    weight.zero_()  # the layer may drop or reuse its plain weight after packing
    torch.testing.assert_close(packed(x, None), expected, rtol=1e-5, atol=1e-5)
    assert packed.nbytes == 16 * 32 * 4


def test_support_names_the_reason_or_runs():
    for dtype in (torch.float32, torch.bfloat16):
        why = packed_gemm_support(dtype)
        if why is None:  # this CPU's oneDNN packs it: it must compute right
            weight = torch.randn(8, 16).to(dtype)
            x = torch.randn(2, 16).to(dtype)
            got = PackedWeight(weight)(x, None).float()
            torch.testing.assert_close(
                got, reference_linear(x, weight, None).float(), rtol=2e-2, atol=2e-2
            )
        else:
            assert str(dtype).split(".")[-1] in why or "oneDNN" in why


def test_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="2-D CPU weight"):
        PackedWeight(torch.randn(2, 3, 4))
