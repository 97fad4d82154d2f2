"""The CUDA sources compile where nvcc is installed, no GPU needed.

Every kernel file (`cuda_ext/csrc/cuda/*.cu`, CUDA headers only) compiles with `nvcc -c`
to sm_80 (A100) PTX and sm_90 (H100) machine code (ptxas, register allocation and all,
for one target: it is the slow half); the torch bindings parse against torch's headers.
A GPU machine builds and runs them for real: tests/cuda_ext/test_native_cuda.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cuda_ext import native_cuda

ARCH_FLAGS = [
    "-gencode",
    "arch=compute_80,code=compute_80",
    "-gencode",
    "arch=compute_90,code=sm_90",
]
# What torch.utils.cpp_extension adds to every .cu it builds: the kernels must not rely on
# implicit half/bfloat16 conversions or operators.
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]
COMPILE_TIMEOUT_S = 480  # per file: two targets of every decode instantiation


def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc not found: CUDA sources not compiled")
    return path


def cuda_include_dir(nvcc_path: str) -> Path | None:
    """The toolkit's include directory, as nvcc itself reports it (nvcc may be a wrapper
    script outside the toolkit)."""
    dryrun = subprocess.run(
        [nvcc_path, "--dryrun", "-c", "-x", "cu", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    for line in dryrun.stderr.splitlines():
        if "INCLUDES=" in line:
            for flag in line.split("INCLUDES=", 1)[1].strip().strip('"').split():
                path = Path(flag.removeprefix("-I").strip('"'))
                if (path / "cuda_runtime_api.h").is_file():
                    return path
    return None


def test_every_kernel_file_compiles_for_sm80_and_sm90(tmp_path):
    compiler = nvcc()
    sources = sorted(native_cuda.CSRC.glob("*.cu"))
    assert {s.name for s in sources} == {s for s in native_cuda.SOURCES if s.endswith(".cu")}

    def compile_one(source: Path) -> subprocess.CompletedProcess:
        command = [
            compiler,
            "-c",
            "-std=c++17",
            *ARCH_FLAGS,
            *TORCH_NVCC_DEFINES,
            "--Werror",
            "all-warnings",
            "-I",
            str(native_cuda.CSRC),
            str(source),
            "-o",
            str(tmp_path / f"{source.stem}.o"),
        ]
        return subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)

    with ThreadPoolExecutor(max_workers=2) as pool:  # CI has 2 cores
        results = list(pool.map(compile_one, sources))

    failures = [
        f"{source.name} (exit {result.returncode}):\n{result.stderr}{result.stdout}"
        for source, result in zip(sources, results, strict=True)
        if result.returncode != 0
    ]
    assert not failures, "nvcc failed:\n\n" + "\n\n".join(failures)
    assert all((tmp_path / f"{s.stem}.o").stat().st_size > 0 for s in sources)


def test_bindings_parse_against_torch_headers(tmp_path):
    """bindings.cpp is only built on a GPU machine; here g++ at least parses it (C++20,
    as torch builds extensions) against the installed torch's headers."""
    cuda_include = cuda_include_dir(nvcc())
    compiler = shutil.which("g++") or shutil.which("c++")
    if cuda_include is None or compiler is None:
        pytest.skip("no CUDA include directory or no C++ compiler: bindings not parsed")
    from torch.utils.cpp_extension import include_paths

    torch_includes = include_paths()
    shim = tmp_path / "shim"
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in torch_includes):
        # A CPU build of torch ships c10/cuda without this generated one-liner.
        macros = shim / "c10/cuda/impl/cuda_cmake_macros.h"
        macros.parent.mkdir(parents=True)
        macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    command = [
        compiler,
        "-fsyntax-only",
        "-std=c++20",
        "-Wall",
        "-Wextra",
        "-Werror",
        *(f"-isystem{p}" for p in torch_includes),
        f"-isystem{sysconfig.get_paths()['include']}",
        f"-isystem{cuda_include}",
        f"-isystem{shim}",
        "-DTORCH_EXTENSION_NAME=pagedserve_cuda",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-I{native_cuda.CSRC}",
        str(native_cuda.CSRC / "bindings.cpp"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert result.returncode == 0, f"g++ failed on bindings.cpp:\n{result.stderr}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_loader_says_why():
    assert native_cuda.load_cuda_kernels() is None
    assert "torch.cuda.is_available() is False" in native_cuda.cuda_unavailable_reason()
