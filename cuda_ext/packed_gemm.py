"""oneDNN's blocked CPU GEMM over a weight reordered once, through torch's mkldnn ops.

`torch.nn.functional.linear` on a CPU reads the weight in its plain `[out, in]` layout at
every call and goes through the BLAS torch was built with (MKL on x86, which picks slow
code paths on AMD CPUs). oneDNN instead reorders the weight once into the blocked layout
its JIT micro-kernels stream (the "prepacked" weight vLLM's CPU build uses through its own
oneDNN handle), and picks AVX2 / AVX-512 / AMX kernels by CPU feature, not vendor.
Measured on a 2-core AMD EPYC (`bench/gemm.py`; docs/performance.md, "Against vLLM's own
CPU build"): 1.4-2.9x faster on the LM heads, up to 1.9x on the layers' GEMMs.

The packed tensor is opaque (an mkldnn tensor): it can only be multiplied, so a layer
that packs its weight keeps the plain one only where something else reads it (a tied
embedding). The reference is `torch.nn.functional.linear`: results agree to float
rounding (oneDNN sums in another order), not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PROBE_SHAPE = (8, 16)  # [out, in]: a weight small enough to pack at every start


def packed_gemm_support(dtype: torch.dtype) -> str | None:
    """None when oneDNN can pack a weight of `dtype` on this CPU, else why not (torch
    built without mkldnn, or a dtype this CPU's oneDNN has no kernels for: bfloat16
    needs AVX512-BF16 or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    try:
        weight = torch.zeros(_PROBE_SHAPE, dtype=dtype)
        PackedWeight(weight)(torch.zeros(1, _PROBE_SHAPE[1], dtype=dtype), None)
    except (RuntimeError, NotImplementedError) as exc:
        return f"oneDNN cannot pack {dtype} weights here: {str(exc).splitlines()[0]}"
    return None


class PackedWeight:
    """A linear layer's weight `[out_features, in_features]` (float32 or bfloat16, CPU)
    reordered once for oneDNN; calling it computes `x @ weight.T + bias` for any number
    of rows. It holds its own copy: the caller may drop the plain weight."""

    def __init__(self, weight: torch.Tensor) -> None:  # [out_features, in_features]
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(
                f"packs a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())

    def __call__(
        self,
        x: torch.Tensor,  # [num_rows, in_features]
        bias: torch.Tensor | None,  # [out_features]
    ) -> torch.Tensor:  # [num_rows, out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:  # [num_rows, in] x [out, in] -> [num_rows, out]
    """What a PackedWeight computes, in torch's plain op (the test oracle)."""
    return F.linear(x, weight, bias)
