"""The layout algebra of the kernel headers, checked on the host: tests/host/layout_check.cpp includes the real
headers (Hopper and SM80 forwards and backwards), g++ compiles it against CuTe and a CUDA toolkit's headers, and it walks every
thread's fragments and every shared-memory address it checks (see the .cpp). Skipped where g++ or the toolkit
headers (crt/host_config.h) are missing."""
import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from flashgen import compiler

HERE = Path(__file__).resolve().parent / "host"


def _cuda_include():
    roots = [os.environ.get("CUDA_HOME", ""), *sorted(glob.glob("/usr/local/cuda*"), reverse=True),
             *compiler.include_dirs()]
    for root in roots:
        for inc in (Path(root) / "include", Path(root)):
            if (inc / "crt" / "host_config.h").exists() and (inc / "cuda_runtime.h").exists():
                return inc
    return None


def test_kernel_layouts_on_the_host(tmp_path):
    gxx, cuda = shutil.which("g++"), _cuda_include()
    if gxx is None or cuda is None:
        pytest.skip("needs g++ and a CUDA toolkit's headers")
    includes = [d for d in compiler.include_dirs()] + [str(cuda), str(cuda / "cccl")]
    exe = tmp_path / "layout_check"
    cmd = [gxx, "-std=c++17", "-w", "-O1", "-fpermissive", "-include", str(HERE / "prelude.h"), "-D__device__=",
           "-D__forceinline__=inline", "-D__global__=", *(f"-I{d}" for d in includes), str(HERE / "layout_check.cpp"),
           "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "\n".join(ln for ln in r.stderr.splitlines() if "error" in ln)[:3000]
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "0 failures" in r.stdout, r.stdout[-3000:]
