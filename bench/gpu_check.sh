#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call, in priority order: build the CUDA
# kernels, run the gpu-marked tests, check the engine end to end against the CPU and
# llama2.c, then time the kernels and the engine. Each stage has its own time limit, so a
# slow one cannot starve the rest. $OUT (default /tmp/gpu_check) gets at most 8 files:
# summary.txt (read it first), pytest.log, and each bench's JSON (and PNG).
#
#   bash bench/gpu_check.sh ASSETS   # ASSETS: stories260K/ and stories260K_greedy.json
#
# Wheels the machine lacks (xgrammar and its pydantic, jsonschema for the structured-output
# checks; the transformers the tests pin, for the model families' references) go in .whl/
# at the repository root; they are installed to /tmp/site first. QUICK=1 times fewer kernel
# points and skips the engine throughput stage; CHECKS_ONLY=1 stops after the checks
# (build, tests, engine, families), runs compute-sanitizer and skips the timings; SKIP_KERNELS=1
# leaves out the kernel timings; NO_SANITIZE=1 leaves out compute-sanitizer.
set -u
ASSETS=${1:?usage: gpu_check.sh ASSETS_DIR}
OUT=${OUT:-/tmp/gpu_check}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export PAGEDSERVE_CACHE_DIR=/tmp/pagedserve_cache
SUMMARY="$OUT/summary.txt"
stage() { echo "== $1 ($(date +%T))" >>"$SUMMARY"; }
# report NAME RC LOG: the rc, the log's tagged lines, and its tail when it failed
report() {
  echo "$1 rc $2" >>"$SUMMARY"
  grep -a '^\[gpu_' "$3" | cut -c1-500 >>"$SUMMARY"
  [ "$2" = 0 ] || tail -c 2500 "$3" >>"$SUMMARY"
}

# compute-sanitizer over a sample of the kernel tests: memcheck on every 25th (each kernel,
# dtype and shape family appears), racecheck on every 100th; allocations uncached so an
# out-of-bounds access leaves its own buffer. Runs last: it is the slowest stage.
sanitize() {  # TOOL EVERY
  awk -v n="$2" 'NR % n == 1' "$LOGS/ids.txt" >"$LOGS/$1.ids"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_LIMIT:-150}" compute-sanitizer \
    --tool "$1" --error-exitcode 9 --print-limit 20 python3 -m pytest -q -p no:cacheprovider \
    --timeout 600 $(cat "$LOGS/$1.ids") >"$LOGS/$1.log" 2>&1
  echo "[gpu_sanitize] $1: rc $? over $(wc -l <"$LOGS/$1.ids") tests:" \
    "$(grep -aE 'ERROR SUMMARY|passed|failed' "$LOGS/$1.log" | tail -2 | tr '\n' ' ')" >>"$SUMMARY"
  tail -c 1500 "$LOGS/$1.log" >"$OUT/$1_tail.log"
}
sanitizer() {
  [ "${NO_SANITIZE:-0}" = 1 ] && return
  stage "compute-sanitizer: memcheck and racecheck over samples of the kernel tests"
  python3 -m pytest -m gpu tests/cuda_ext/test_native_cuda.py \
    tests/cuda_ext/test_native_cuda_features.py --collect-only -q -p no:cacheprovider \
    2>/dev/null | grep '::' >"$LOGS/ids.txt"
  sanitize memcheck 25
  sanitize racecheck 100
}

stage env
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$SUMMARY" 2>&1 && export PYTHONPATH=/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "transformers", transformers.__version__)'
  nvcc --version | tail -1
} >>"$SUMMARY" 2>&1

stage build
timeout 200 python3 -c '
import time
from cuda_ext import native_cuda
t = time.perf_counter()
k = native_cuda.load_cuda_kernels()
print("[gpu_build]", "built" if k else "FAILED", round(time.perf_counter() - t, 1), "s", native_cuda.cuda_unavailable_reason() or "")
' >"$LOGS/build.log" 2>&1
report build $? "$LOGS/build.log"

stage "gpu tests + engine checks + model families, concurrently"
timeout 200 python3 -m pytest -m gpu tests/cuda_ext/test_native_cuda.py \
  tests/cuda_ext/test_native_cuda_features.py tests/engine/test_cuda_swap_space.py -q -n 6 --timeout 120 \
  -p no:cacheprovider -rfE >"$OUT/pytest.log" 2>&1 &
tests=$!
PAGEDSERVE_NATIVE=0 timeout 280 python3 bench/gpu_e2e.py --stories "$ASSETS/stories260K" \
  --reference "$ASSETS/stories260K_greedy.json" --parts families \
  --out "$OUT/gpu_e2e_families.json" >/dev/null 2>"$LOGS/families.log" &
families=$!
PAGEDSERVE_NATIVE=0 timeout 200 python3 bench/gpu_e2e.py --stories "$ASSETS/stories260K" \
  --reference "$ASSETS/stories260K_greedy.json" --parts checks structured \
  --out "$OUT/gpu_e2e_checks.json" >/dev/null 2>"$LOGS/checks.log"
report "engine checks" $? "$LOGS/checks.log"
wait $families
report "model families" $? "$LOGS/families.log"
wait $tests
echo "gpu tests rc $?" >>"$SUMMARY"
tail -n 25 "$OUT/pytest.log" >>"$SUMMARY"

[ "${CHECKS_ONLY:-0}" = 1 ] && { sanitizer; stage done; cat "$SUMMARY"; exit 0; }
[ "${SKIP_KERNELS:-0}" = 1 ] || {
stage "kernel timings: GQA 32/8 heads, a sliding window, then MHA 32/32"
if [ "${QUICK:-0}" = 1 ]; then points="--batch 1 32 256 --context 1024 16384"; else points=""; fi
timeout 90 python3 bench/gpu_kernels.py $points --out "$OUT/gpu_kernels.json" >/dev/null \
  2>"$LOGS/kernels.log"
report kernels $? "$LOGS/kernels.log"
timeout 60 python3 bench/gpu_kernels.py --window 4096 --batch 1 32 128 --context 8192 32768 \
  --no-prefill --out "$OUT/gpu_kernels_window.json" >/dev/null 2>"$LOGS/kernels_window.log"
report "kernels window" $? "$LOGS/kernels_window.log"
[ "${QUICK:-0}" = 1 ] || {
  timeout 60 python3 bench/gpu_kernels.py --kv-heads 32 --batch 1 32 256 --context 1024 16384 \
    --no-prefill --out "$OUT/gpu_kernels_mha.json" >/dev/null 2>"$LOGS/kernels_mha.log"
  report "kernels MHA" $? "$LOGS/kernels_mha.log"
}

}
[ "${QUICK:-0}" = 1 ] && { sanitizer; stage done; cat "$SUMMARY"; exit 0; }
stage "engine throughput beside transformers, KV sizing, decode steps against the floor"
for shape in 1b 8b; do
  timeout 200 python3 bench/gpu_throughput.py --shapes $shape \
    --out "$OUT/gpu_throughput_$shape.json" >/dev/null 2>"$LOGS/throughput_$shape.log"
  report "throughput $shape" $? "$LOGS/throughput_$shape.log"
done
stage "GPU idle time at batch 64, in step and one step ahead"
timeout 120 python3 bench/gpu_idle.py --out "$OUT/gpu_idle.json" >/dev/null 2>"$LOGS/idle.log"
report idle $? "$LOGS/idle.log"
sanitizer
stage done
cat "$SUMMARY"
