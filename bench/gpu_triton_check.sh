#!/usr/bin/env bash
# The Triton kernels on a lent GPU, compiled (CI runs them interpreted): their tests on
# CUDA tensors; the device-side input preparation against the host builder and the
# piecewise CUDA graphs captured and replayed against eager; a decode step timed against
# torch SDPA at a 1B-like and an 8B-like attention shape; every model family through the
# Triton backend against transformers.
# $OUT (default /tmp/gpu_triton) gets summary.txt. Wheels the machine lacks go in .whl/
# (see bench/gpu_check.sh). NATIVE=1 also builds the CUDA C++ kernels and runs the test
# that compares the two kernel sets (about a minute more).
set -u
OUT=${OUT:-/tmp/gpu_triton}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16
export PAGEDSERVE_CACHE_DIR=/tmp/pagedserve_cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))' >>"$SUMMARY" 2>&1
SELECT="not cuda_kernels_agree"
[ "${NATIVE:-0}" = 1 ] && SELECT=""
echo "== kernel tests $(date +%T)" >>"$SUMMARY"
timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 100 -rfE \
  tests/cuda_ext/test_triton_kernels.py -k "$SELECT" >"$OUT/kernels.log" 2>&1
echo "kernel tests rc $?: $(tail -1 "$OUT/kernels.log")" >>"$SUMMARY"
grep -aE '^(FAILED|ERROR)' "$OUT/kernels.log" | head -20 >>"$SUMMARY"
echo "== device input preparation and piecewise CUDA graphs $(date +%T)" >>"$SUMMARY"
timeout "${GRAPH_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider --timeout 110 -rfE \
  tests/engine/test_device_inputs.py tests/engine/test_piecewise_graphs.py >"$OUT/graphs.log" 2>&1
echo "device inputs + graphs rc $?: $(tail -1 "$OUT/graphs.log")" >>"$SUMMARY"
grep -aE '^(FAILED|ERROR)' "$OUT/graphs.log" | head -20 >>"$SUMMARY"
echo "== decode step timings $(date +%T)" >>"$SUMMARY"
timeout 60 python3 - >>"$SUMMARY" 2>&1 <<'PY'
import torch
from engine.worker.attention.backend_race import AttentionShape, decode_ms
from engine.worker.attention.sdpa import SdpaBackend
from engine.worker.attention.triton_backend import TritonBackend
for name, shape in (("1B-like", AttentionShape(32, 8, 64)), ("8B-like", AttentionShape(32, 8, 128))):
    for dtype in (torch.bfloat16, torch.float16):
        ms = {b.name: decode_ms(b, shape, 16, dtype) for b in (TritonBackend(), SdpaBackend())}
        print(f"[gpu_triton] {name} {dtype}: decode step, 64 seqs x 1024 tokens:",
              ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
PY
# one at a time: each engine sizes its KV cache to 0.9 of the card
echo "== families through the Triton backend $(date +%T)" >>"$SUMMARY"
timeout "${FAMILY_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider --timeout 140 -rfE \
  tests/engine/test_hf_parity.py -k triton >"$OUT/families.log" 2>&1
echo "families rc $?: $(tail -1 "$OUT/families.log")" >>"$SUMMARY"
grep -aE '^(FAILED|ERROR)' "$OUT/families.log" | head -20 >>"$SUMMARY"
cp "$SUMMARY" "$OUT/summary.txt" 2>/dev/null; tail -c 3000 "$OUT/kernels.log" >"$OUT/kernels_tail.log"
