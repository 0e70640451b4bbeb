"""NVRTC through cuda.bindings: rendered CUDA C++ -> cubin plus the ptxas resource report."""
from __future__ import annotations

import glob
import os
import re
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import FlashgenCompileError

# -default-device: CuTe/CUTLASS headers have unannotated host functions that NVRTC rejects otherwise.
BASE_OPTIONS = ("-std=c++17", "-default-device", "--use_fast_math", "-DNDEBUG", "--ptxas-options=--verbose")


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def _check(result, what: str):
    err = result[0]
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@lru_cache(maxsize=None)
def nvrtc_version() -> str:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


@lru_cache(maxsize=None)
def cutlass_version() -> str:
    for inc in include_dirs():
        hdr = Path(inc) / "cutlass" / "version.h"
        if hdr.exists():
            text = hdr.read_text()
            parts = [re.search(rf"#define CUTLASS_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
            return ".".join(m.group(1) if m else "?" for m in parts)
    return "unknown"


def include_dirs() -> tuple[str, ...]:
    """Header roots: flashgen's own templates/include, FLASHGEN_INCLUDE_DIRS (os.pathsep-separated), then
    CUTLASS/CuTe from nvidia-cutlass, CCCL from nvidia-cuda-cccl, and every nvidia/cu13/include on sys.path
    (a --target install splits the CUDA headers over several site dirs)."""
    from codegen.render import include_dir

    env = os.environ.get("FLASHGEN_INCLUDE_DIRS", "")
    return (str(include_dir()), *(d for d in env.split(os.pathsep) if d), *_package_include_dirs())


@lru_cache(maxsize=None)
def _package_include_dirs() -> tuple[str, ...]:
    dirs: list[str] = []
    for base in sys.path:
        if not base or not os.path.isdir(base):
            continue
        dirs += glob.glob(os.path.join(base, "cutlass_library", "source", "include"))
        for cu in ("cu13", "cu12"):
            inc = os.path.join(base, "nvidia", cu, "include")
            if os.path.isdir(inc):
                dirs += glob.glob(os.path.join(inc, "cccl"))
                dirs.append(inc)
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if real not in seen:
            seen.add(real)
            out.append(d)
    return tuple(out)


def compile_options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", *BASE_OPTIONS, *(f"-I{d}" for d in include_dirs())]


@dataclass
class CompileResult:
    cubin: bytes
    log: str
    seconds: float
    resources: dict
    ptx: str = ""   # compile_source(..., ptx=True): the PTX NVRTC made on the way to the cubin


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "smem_static": re.compile(r"(\d+) bytes smem"),
}


def parse_resources(log: str, kernel: str) -> dict:
    """ptxas --verbose lines for `kernel` -> registers, spills, stack frame, static smem."""
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Compiling entry function" in ln and f"'{kernel}'" in ln), None)
    chunk = "\n".join(lines[start:start + 6] if start is not None else lines)
    out = {}
    for key, rx in _PTXAS_RE.items():
        m = rx.search(chunk)
        out[key] = int(m.group(1)) if m else 0
    return out


def _compile(source: str, kernel: str, opts: list[str], source_path: str,
             outputs: tuple[str, ...]) -> tuple[list[bytes], str]:
    """Run NVRTC; return ([each requested output: 'CUBIN' and / or 'PTX'], log). Raises FlashgenCompileError."""
    nvrtc = _nvrtc()
    enc = [o.encode() for o in opts]
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{kernel}.cu".encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        log_size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * log_size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.decode(errors="replace").rstrip("\x00").strip()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise FlashgenCompileError(kernel, log, source_path)
        outs = []
        for output in outputs:
            size = _check(getattr(nvrtc, f"nvrtcGet{output}Size")(prog), f"nvrtcGet{output}Size")
            outs.append(b" " * size)
            _check(getattr(nvrtc, f"nvrtcGet{output}")(prog, outs[-1]), f"nvrtcGet{output}")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return outs, log


def _ptx_text(ptx: bytes) -> str:
    return ptx.decode(errors="replace").rstrip("\x00")


def compile_source(source: str, kernel: str, arch: str, source_path: str, ptx: bool = False) -> CompileResult:
    """Compile one rendered source to a cubin (and, with ptx, keep the PTX of the same compile). On failure the source
    is already saved at source_path, and the error names it."""
    t0 = time.perf_counter()
    outs, log = _compile(source, kernel, compile_options(arch), source_path, ("CUBIN", "PTX") if ptx else ("CUBIN",))
    return CompileResult(cubin=outs[0], log=log, seconds=time.perf_counter() - t0,
                         resources=parse_resources(log, kernel),
                         ptx=_ptx_text(outs[1]) if ptx else "")


def compile_ptx(source: str, kernel: str, arch: str) -> str:
    """PTX of a small self-contained source (no CuTe), e.g. the parameter-struct offset probe."""
    (ptx,), _ = _compile(source, kernel, [f"--gpu-architecture={arch}", "-std=c++17"], "<memory>", ("PTX",))
    return _ptx_text(ptx)
