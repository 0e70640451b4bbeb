"""Does the fused backward's fp32 dQ accumulator gain from compressible memory (Compute Data Compression)?

The accumulator is zeroed before every backward (134 MB at 16k tokens, model dim 2048: ~33 us on the H200, ~45 us on
the H100; 2-5% of a 2k backward). On GPUs with generic compression, lines of zeros written to compressible memory
reach DRAM compressed, so the fill and the main kernel's first read of each line may move fewer DRAM bytes. torch's
allocator cannot ask for such memory: this script maps it with cuMemCreate (CU_MEM_ALLOCATION_COMP_GENERIC) and hands
it to the backward through `interface._dq_accum_zeros`.

    python benchmarks/dq_accum_memory.py [--hdim 64 128 256] [--seqlen 2048 8192] [--causal 0 1] [--rounds 7]

Prints the compression support, the fill's time on each kind of memory, then per shape the backward's TFLOP/s with the
accumulator in torch memory ("torch") and in compressible memory ("comp"), SDPA CUDNN's, and the ratios.
"""
import argparse
import os
import sys

import torch
from cuda.bindings import driver as cu
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba   # noqa: E402
from flashgen import interface   # noqa: E402
from flashgen.loader import _check   # noqa: E402


class _Cai:
    """A raw device range as a __cuda_array_interface__ object, for torch.as_tensor."""

    def __init__(self, ptr: int, numel: int):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": "<f4", "data": (ptr, False), "version": 3,
                                         "strides": None}


def compressible_f32(numel: int, device: int) -> tuple[torch.Tensor, int]:
    """numel fp32 elements of compressible device memory (mapped for the life of the process) and the compression
    type the driver granted (0: none)."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.allocFlags.compressionType = cu.CUmemAllocationCompType.CU_MEM_ALLOCATION_COMP_GENERIC
    recommended = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    gran = _check(cu.cuMemGetAllocationGranularity(prop, recommended), "cuMemGetAllocationGranularity")
    size = (numel * 4 + gran - 1) // gran * gran
    handle = _check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
    granted = _check(cu.cuMemGetAllocationPropertiesFromHandle(handle),
                     "cuMemGetAllocationPropertiesFromHandle").allocFlags.compressionType
    ptr = _check(cu.cuMemAddressReserve(size, gran, 0, 0), "cuMemAddressReserve")
    _check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _check(cu.cuMemSetAccess(ptr, size, [access], 1), "cuMemSetAccess")
    t = torch.as_tensor(_Cai(int(ptr), numel), device=f"cuda:{device}")
    return t, int(granted)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hdim", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    ba.ROUNDS = args.rounds
    dev = torch.cuda.current_device()
    _check(cu.cuInit(0), "cuInit")
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED
    supported = _check(cu.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute")
    print(f"{torch.cuda.get_device_name(dev)}: generic compression supported = {supported}")
    numel = 64 << 20   # 256 MB: the largest accumulator below (16k tokens x 2048 x fp32 + padding) fits
    comp, granted = compressible_f32(numel, dev)
    print(f"compressible allocation: compressionType granted = {granted}")

    fill_n = 16384 * 2048

    def memset(buf):
        stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        _check(cu.cuMemsetD32Async(buf.data_ptr(), 0, fill_n, stream), "cuMemsetD32Async")

    plain = torch.empty(numel, dtype=torch.float32, device="cuda")
    fills = {"torch.zeros": lambda: torch.zeros(fill_n, dtype=torch.float32, device="cuda"),
             "plain.zero_": lambda: plain[:fill_n].zero_(),
             "comp.zero_": lambda: comp[:fill_n].zero_(),
             "plain.memset": lambda: memset(plain),
             "comp.memset": lambda: memset(comp)}
    ms = ba.time_all(fills)
    print("fill of 128 MB: " + ", ".join(f"{n} {t * 1e3:.1f} us ({fill_n * 4 / t / 1e9:.2f} TB/s)"
                                         for n, t in ms.items()))

    def comp_zeros(n, device):
        if n > numel:
            raise ValueError(f"accumulator of {n} elements exceeds the compressible buffer's {numel}")
        return comp[:n].zero_()

    torch_zeros = interface._dq_accum_zeros
    print("| hdim | causal | seqlen | torch | comp | cudnn | torch / cudnn | comp / cudnn | comp / torch |")
    print("|---:|:---:|---:|---:|---:|---:|---:|---:|---:|")
    for hdim in args.hdim:
        for causal in map(bool, args.causal):
            for s in args.seqlen:
                b, h = 16384 // s, 2048 // hdim
                q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn_like(q)
                scale = hdim ** -0.5
                out, lse = interface._flash_attn_forward(q, k, v, scale, causal)

                def ours(alloc):
                    def run():
                        interface._dq_accum_zeros = alloc
                        try:
                            return interface._flash_attn_backward(dout, q, k, v, out, lse, scale, causal)
                        finally:
                            interface._dq_accum_zeros = torch_zeros
                    return run
                ref = ours(torch_zeros)()
                got = ours(comp_zeros)()
                for a, g, n in zip(ref, got, "qkv"):   # equal up to the order of the dQ adds
                    err = (a.float() - g.float()).abs().max().item()
                    if err > 1e-2 * a.float().abs().max().item():
                        print(f"  d{n} differs: max |torch - comp| = {err:.3g}")
                cudnn = ba.sdpa_bwd_fn(q, k, v, dout, causal, SDPBackend.CUDNN_ATTENTION)
                res = ba.time_all({"torch": ours(torch_zeros), "comp": ours(comp_zeros), "cudnn": cudnn})
                flops = 2.5 * ba.fwd_flops(b, h, s, s, hdim, causal)
                tf = {n: flops / (t * 1e-3) / 1e12 for n, t in res.items()}
                print(f"| {hdim} | {'yes' if causal else 'no'} | {s} | {tf['torch']:.0f} | {tf['comp']:.0f} | "
                      f"{tf['cudnn']:.0f} | {tf['torch'] / tf['cudnn']:.3f} | {tf['comp'] / tf['cudnn']:.3f} | "
                      f"{tf['comp'] / tf['torch']:.3f} |", flush=True)
                del cudnn
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
