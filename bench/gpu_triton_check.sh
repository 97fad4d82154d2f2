#!/usr/bin/env bash
# The GPU-native path on a lent GPU, in one call, in priority order (each stage has its
# own time limit, so a slow one cannot starve the rest):
#   1. device input preparation against the host builder, and the piecewise CUDA graphs
#      of every model family captured and replayed against the same pieces run plain
#      (their tests, on CUDA tensors);
#   2. GPU idle time and step time of a 1.2B Llama at batch 64: eager with host inputs,
#      device inputs, + piecewise graphs, + the Triton attention kernels (bench/gpu_idle.py);
#   3. the engine end to end on CUDA with its defaults against the CPU and llama2.c;
#   4. the Triton and CUDA C++ attention kernels against each other and the reference,
#      and a decode step timed for Triton, CUDA C++ and torch SDPA;
#   5. model families against transformers through device inputs and the Triton backend;
#   6. compute-sanitizer memcheck over a sample of the Triton kernel tests.
# The CUDA C++ kernels build in the background during stage 1 (CPU work).
#
#   bash bench/gpu_triton_check.sh ASSETS   # ASSETS: stories260K/ and stories260K_greedy.json
#
# $OUT (default /tmp/gpu_triton) gets summary.txt (read it first), gpu_idle.json and the
# stages' logs. Wheels the machine lacks go in .whl/ (see bench/gpu_check.sh).
set -u
ASSETS=${1:?usage: gpu_triton_check.sh ASSETS_DIR}
OUT=${OUT:-/tmp/gpu_triton}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=14
export PAGEDSERVE_CACHE_DIR=/tmp/pagedserve_cache
stage() { echo "== $1 ($(date +%T))" >>"$SUMMARY"; }
# pytest_stage NAME LIMIT LOG ARGS...: a pytest run, its last line and its failures
pytest_stage() {
  local name=$1 limit=$2 log=$3
  shift 3
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE --durations=5 "$@" >"$log" 2>&1
  echo "$name rc $?: $(grep -aE '(passed|failed|error)' "$log" | tail -1)" >>"$SUMMARY"
  grep -aE '^(FAILED|ERROR)' "$log" | cut -c1-300 | head -20 >>"$SUMMARY"
}

stage env
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))' >>"$SUMMARY" 2>&1
timeout 240 python3 -c '
import time
from cuda_ext import native_cuda
t = time.perf_counter()
k = native_cuda.load_cuda_kernels()
print("[gpu_build]", "built" if k else "FAILED", round(time.perf_counter() - t, 1), "s", native_cuda.cuda_unavailable_reason() or "")
' >"$LOGS/build.log" 2>&1 &
build=$!

stage "1. device inputs and piecewise graphs on CUDA"
pytest_stage "device inputs + graphs" "${INPUTS_LIMIT:-200}" "$OUT/inputs_graphs.log" \
  --timeout 90 tests/engine/test_device_inputs.py tests/engine/test_piecewise_graphs.py

wait $build
cat "$LOGS/build.log" >>"$SUMMARY"
stage "2. idle and step time at batch 64 (1.2B Llama, bfloat16)"
timeout "${IDLE_LIMIT:-150}" python3 bench/gpu_idle.py --batch 64 \
  --modes ${IDLE_MODES:-eager device graphs triton} --depths 1 \
  --out "$OUT/gpu_idle.json" >/dev/null 2>"$LOGS/idle.log"
echo "idle rc $?" >>"$SUMMARY"
grep -a '^\[gpu_idle\]' "$LOGS/idle.log" | cut -c1-420 >>"$SUMMARY"
grep -aiE 'error|warning.*captur' "$LOGS/idle.log" | head -5 | cut -c1-300 >>"$SUMMARY"

# PAGEDSERVE_NATIVE=0: no CPU kernel build there; on CUDA the Triton kernels serve
stage "3. the engine on CUDA with its defaults: against the CPU and llama2.c"
PAGEDSERVE_NATIVE=0 timeout "${CHECKS_LIMIT:-90}" python3 bench/gpu_e2e.py --stories "$ASSETS/stories260K" \
  --reference "$ASSETS/stories260K_greedy.json" --parts checks \
  --out "$OUT/gpu_e2e_checks.json" >/dev/null 2>"$LOGS/checks.log"
echo "engine checks rc $?" >>"$SUMMARY"
grep -a '^\[gpu_' "$LOGS/checks.log" | cut -c1-300 >>"$SUMMARY"

stage "4. Triton against CUDA C++; decode step timings"
pytest_stage "kernels agree" 50 "$LOGS/agree.log" --timeout 45 \
  tests/cuda_ext/test_triton_kernels.py -k cuda_kernels_agree
timeout 50 python3 - >>"$SUMMARY" 2>&1 <<'PY'
import torch
from engine.worker.attention.backend_race import AttentionShape, decode_ms
from engine.worker.attention.sdpa import SdpaBackend
from engine.worker.attention.selector import select_backend
from engine.worker.attention.triton_backend import TritonBackend
for name, shape in (("1B-like", AttentionShape(32, 8, 64)), ("8B-like", AttentionShape(32, 8, 128))):
    for dtype in (torch.bfloat16, torch.float16):
        native = select_backend("native", "cuda", dtype, block_size=16).backend
        ms = {b.name: decode_ms(b, shape, 16, dtype) for b in (TritonBackend(), native, SdpaBackend())}
        print(f"[gpu_triton] {name} {dtype}: decode step, 64 seqs x 1024 tokens:",
              ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
PY

# one at a time: each engine sizes its KV cache to 0.9 of the card
stage "5. families through device inputs and the Triton backend"
pytest_stage "families" "${FAMILY_LIMIT:-90}" "$OUT/families.log" --timeout 80 \
  tests/engine/test_hf_parity.py -k "device-inputs or (triton and qwen)"

stage "6. compute-sanitizer memcheck over a sample of the Triton kernel tests"
python3 -m pytest tests/cuda_ext/test_triton_kernels.py --collect-only -q -p no:cacheprovider \
  -k "not cuda_kernels_agree" 2>/dev/null | grep '::' | awk 'NR % 8 == 1' >"$LOGS/ids.txt"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_LIMIT:-50}" compute-sanitizer --tool memcheck \
  --error-exitcode 9 --print-limit 20 python3 -m pytest -q -p no:cacheprovider --timeout 600 \
  $(cat "$LOGS/ids.txt") >"$LOGS/memcheck.log" 2>&1
echo "memcheck rc $? over $(wc -l <"$LOGS/ids.txt") tests:" \
  "$(grep -aE 'ERROR SUMMARY|passed|failed' "$LOGS/memcheck.log" | tail -2 | tr '\n' ' ')" >>"$SUMMARY"
tail -c 1500 "$LOGS/memcheck.log" >"$OUT/memcheck_tail.log"
stage done
cat "$SUMMARY"
