"""cubin -> cuda.bindings.driver library -> kernel, launched on torch's current stream.

Libraries (cuLibraryLoadData) are context-independent, so one load serves every device; the
dynamic-shared-memory limit is raised per device on first use there.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import time

from codegen.traits import KernelTraits

from . import cache
from .errors import FlashgenLaunchError


def _drv():
    from cuda.bindings import driver
    return driver


def _check(res, what: str):
    drv = _drv()
    err = res[0] if isinstance(res, tuple) else res
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)[1]
        raise FlashgenLaunchError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


class Kernel:
    def __init__(self, traits: KernelTraits, cubin: bytes, meta: dict):
        drv = _drv()
        self.traits, self.meta, self.name = traits, meta, traits.name
        t0 = time.perf_counter()
        self._cubin = cubin   # the driver may reference the image while loading
        self.library = _check(drv.cuLibraryLoadData(cubin, [], [], 0, [], [], 0), f"cuLibraryLoadData({self.name})")
        self.kernel = _check(drv.cuLibraryGetKernel(self.library, self.name.encode()), f"cuLibraryGetKernel({self.name})")
        self.load_seconds = time.perf_counter() - t0
        self.smem_bytes = traits.smem_bytes()
        self._entries = {None: self.kernel}   # extra entry points of the same cubin: "<name>_<suffix>"
        self._ready: set[tuple[int, str | None, int]] = set()
        self._resident: dict[int, int] = {}
        self._lock = threading.Lock()

    def _handle(self, entry: str | None):
        k = self._entries.get(entry)
        if k is None:
            name = f"{self.name}_{entry}"
            k = self._entries[entry] = _check(_drv().cuLibraryGetKernel(self.library, name.encode()),
                                              f"cuLibraryGetKernel({name})")
        return k

    def _prepare(self, device: int, entry: str | None, smem: int):
        if (device, entry, smem) in self._ready:
            return
        with self._lock:
            drv = _drv()
            dev = _check(drv.cuDeviceGet(device), "cuDeviceGet")
            if smem > 48 * 1024:
                _check(drv.cuKernelSetAttribute(
                    drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem, self._handle(entry), dev), f"cuKernelSetAttribute({self.name}, smem={smem})")
            self._ready.add((device, entry, smem))

    def resident_ctas(self, device: int) -> int:
        """CTAs of this kernel the whole GPU holds at once (occupancy x SMs): a persistent kernel's grid."""
        n = self._resident.get(device)
        if n is None:
            drv = _drv()
            self._prepare(device, None, self.smem_bytes)
            dev = _check(drv.cuDeviceGet(device), "cuDeviceGet")
            func = _check(drv.cuKernelGetFunction(self.kernel), f"cuKernelGetFunction({self.name})")
            per_sm = _check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, self.traits.num_threads,
                                                                              self.smem_bytes),
                            f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})")
            sms = _check(drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute")
            n = self._resident[device] = max(1, per_sm) * sms
        return n

    def launch(self, grid: tuple[int, int, int], params: bytes, device: int, stream: int,
               entry: str | None = None, smem: int | None = None) -> None:
        """Launch with the packed parameter struct on `stream` (a cudaStream_t handle) of `device`.
        `entry` picks another kernel of the same cubin (`<name>_<entry>`), with its own dynamic `smem`."""
        drv = _drv()
        smem = self.smem_bytes if smem is None else smem
        handle = self._entries.get(entry)
        if handle is None:
            with self._lock:
                handle = self._handle(entry)
        self._prepare(device, entry, smem)
        buf = ctypes.create_string_buffer(params, len(params))
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        _check(drv.cuLaunchKernel(handle, *grid, self.traits.num_threads, 1, 1, smem,
                                  stream, ctypes.addressof(argv), 0), f"cuLaunchKernel({self.name}{'_' + entry if entry else ''})")


_kernels: dict[str, Kernel] = {}
_kernels_lock = threading.Lock()


def get_kernel(traits: KernelTraits) -> Kernel:
    """Loaded kernel for traits: from memory, else the disk cache, else compiled now (JIT)."""
    k = _kernels.get(traits.name)
    if k is not None:
        return k
    _refuse_during_capture(traits)
    with _kernels_lock:
        k = _kernels.get(traits.name)
        if k is None:
            cubin, meta, _ = cache.get_or_compile(traits)
            k = _kernels[traits.name] = Kernel(traits, cubin, meta)
    return k


def _refuse_during_capture(traits: KernelTraits) -> None:
    """Loading a module (and compiling) cannot happen inside CUDA graph capture: say what to do instead."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise FlashgenLaunchError(
            f"flashgen: kernel {traits.name} is not loaded yet and the current stream is capturing a CUDA graph; "
            f"run the same call once before capture (warm-up) so the kernel compiles and loads outside the graph")


def loaded_kernels() -> dict[str, Kernel]:
    return dict(_kernels)
