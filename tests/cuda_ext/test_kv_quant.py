"""The 8-bit KV cache row format (cuda_ext/kv_quant.py): where the codes and the scale
sit, each code's error bound, zero rows, and the torch backends (reference, SDPA)
reading an 8-bit cache as its decoded rows."""

from __future__ import annotations

import pytest
import torch

from cuda_ext.kv_quant import KVRowCode, dequantize_rows, quantize_rows, row_width
from cuda_ext.reference import paged_attention_reference, reshape_and_cache

pytestmark = pytest.mark.timeout(60)

# The largest error of a decoded value, relative to its row's largest magnitude: half an
# int8 step of amax / 127; fp8: half a step at the top binade (3 or 2 mantissa bits).
ROW_ERROR = {KVRowCode.INT8: 0.5 / 127, KVRowCode.FP8_E4M3: 2**-4, KVRowCode.FP8_E5M2: 2**-3}


@pytest.mark.parametrize("code", list(KVRowCode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_decode_within_their_codes_bound(code, dtype):
    torch.manual_seed(0)
    x = (torch.randn(7, 3, 64) * torch.logspace(-3, 3, 7).view(7, 1, 1)).to(dtype)
    rows = quantize_rows(x, code)
    assert rows.dtype == torch.uint8 and rows.shape == (7, 3, row_width(64)) == (7, 3, 68)
    err = (dequantize_rows(rows, code) - x.float()).abs().amax(-1)
    amax = x.float().abs().amax(-1)
    assert (err <= ROW_ERROR[code] * amax * (1 + 1e-6)).all()


@pytest.mark.parametrize("code", list(KVRowCode))
def test_the_scale_closes_the_row_and_the_top_value_gets_the_top_code(code):
    x = torch.tensor([[0.5, -2.0, 1.0, 0.0]])
    rows = quantize_rows(x, code)
    scale = rows[0, 4:].view(torch.float32).item()
    assert scale == pytest.approx(2.0 / code.qmax, rel=1e-7)
    codes = rows[0, :4].view(code.code_dtype).float()
    assert codes[1].item() == -code.qmax and codes[3].item() == 0.0
    assert dequantize_rows(rows, code)[0, 1].item() == pytest.approx(-2.0, rel=1e-6)


@pytest.mark.parametrize("code", list(KVRowCode))
def test_a_zero_row_codes_to_zero_with_a_zero_scale(code):
    """Also a row of denormals: its inverse scale would overflow."""
    rows = quantize_rows(torch.tensor([[0.0] * 16, [1e-39, -3e-40] * 8]), code)
    assert (rows[:, 16:] == 0).all()  # the scale (fp8 codes may be -0)
    assert (dequantize_rows(rows, code) == 0).all()


@pytest.mark.parametrize("code", list(KVRowCode))
def test_reference_and_sdpa_backends_attend_over_the_decoded_cache(code):
    """Writing through the 8-bit reference op then attending equals attending over a
    float cache holding the decoded rows; the SDPA backend gives the same."""
    from engine.worker.attention.metadata import AttentionMetadata
    from engine.worker.attention.sdpa import SdpaBackend
    from engine.worker.attention.spec import AttentionSpec

    torch.manual_seed(1)
    num_blocks, bs, kvh, heads, d = 12, 8, 2, 4, 32
    lens, q_lens = [19, 7, 30], [1, 7, 4]  # a decode, a whole prompt, a chunk after a prefix
    tables = torch.tensor([[3, 5, 9, 0], [1, 0, 0, 0], [2, 4, 6, 11]])
    slots = torch.cat(
        [tables[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs for i, n in enumerate(lens)]
    )
    k, v = torch.randn(len(slots), kvh, d), torch.randn(len(slots), kvh, d)
    house = (num_blocks, bs, kvh, row_width(d))
    k8, v8 = torch.zeros(house, dtype=torch.uint8), torch.zeros(house, dtype=torch.uint8)
    reshape_and_cache(k, v, k8, v8, slots, code)
    kf, vf = torch.zeros(num_blocks, bs, kvh, d), torch.zeros(num_blocks, bs, kvh, d)
    kf.view(-1, kvh, d)[slots] = dequantize_rows(quantize_rows(k, code), code)
    vf.view(-1, kvh, d)[slots] = dequantize_rows(quantize_rows(v, code), code)
    query = torch.randn(sum(q_lens), heads, d)
    args = (tables, q_lens, lens, d**-0.5)
    ours = paged_attention_reference(query, k8, v8, *args, kv_code=code)
    torch.testing.assert_close(ours, paged_attention_reference(query, kf, vf, *args))

    backend = SdpaBackend(code)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    metadata = AttentionMetadata(
        starts, torch.tensor(lens), tables, slots, tuple(q_lens), tuple(lens), num_decodes=1
    )
    sdpa = backend.attend(
        query,
        k8.permute(2, 0, 1, 3).contiguous(),  # SDPA's head-major layout
        v8.permute(2, 0, 1, 3).contiguous(),
        metadata,
        AttentionSpec(scale=d**-0.5),
    )
    torch.testing.assert_close(sdpa, ours, atol=2e-5, rtol=1e-4)
