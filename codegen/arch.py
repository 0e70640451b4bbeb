"""One table of GPU architecture facts: the only place codegen learns what a target can do.

Numbers are per thread block / per SM from the CUDA programming guide's compute-capability tables.
`mma` lists the tensor-core instruction families the templates may use on the arch; a template family
declares which one it needs and is only enumerated where that family exists.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str                 # NVRTC --gpu-architecture value, e.g. "sm_90a"
    cc: tuple[int, int]       # compute capability this target runs on
    smem_per_block: int       # max dynamic shared memory a block may opt into (bytes)
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    mma: frozenset[str]       # "sm80_mma" (mma.sync m16n8k16), "sm90_wgmma", ...
    description: str

    @property
    def number(self) -> int:
        return int(self.name[3:].rstrip("a"))


KB = 1024

ARCHS: dict[str, Arch] = {a.name: a for a in [
    Arch("sm_80", (8, 0), 163 * KB, 164 * KB, 65536, 2048, frozenset({"sm80_mma"}), "A100, A30"),
    Arch("sm_86", (8, 6), 99 * KB, 100 * KB, 65536, 1536, frozenset({"sm80_mma"}), "RTX 30xx, A10, A40"),
    Arch("sm_89", (8, 9), 99 * KB, 100 * KB, 65536, 1536, frozenset({"sm80_mma"}), "RTX 40xx, L4, L40"),
    Arch("sm_90a", (9, 0), 227 * KB, 228 * KB, 65536, 2048, frozenset({"sm80_mma", "sm90_wgmma"}),
         "H100, H200, GH200"),
    Arch("sm_100a", (10, 0), 227 * KB, 228 * KB, 65536, 2048, frozenset({"sm80_mma"}), "B200, GB200"),
    Arch("sm_120", (12, 0), 99 * KB, 100 * KB, 65536, 1536, frozenset({"sm80_mma"}),
         "RTX 50xx, RTX PRO 6000 Blackwell"),
]}

DEFAULT_ARCH = "sm_90a"


def get_arch(name: str) -> Arch:
    key = name.strip().lower()
    if not key.startswith("sm_"):
        key = "sm_" + key.replace(".", "")
    if key in ARCHS:
        return ARCHS[key]
    raise ValueError(f"unknown arch {name!r}; known: {', '.join(ARCHS)}")


def arch_for_capability(major: int, minor: int) -> Arch:
    """The best compile target for a device of compute capability (major, minor)."""
    exact = [a for a in ARCHS.values() if a.cc == (major, minor)]
    if exact:
        return exact[0]
    # Same major, highest minor not above the device: SASS is binary compatible within a major version.
    same_major = [a for a in ARCHS.values() if a.cc[0] == major and a.cc[1] <= minor and not a.name.endswith("a")]
    if same_major:
        return max(same_major, key=lambda a: a.cc)
    raise ValueError(f"no flashgen target for compute capability {major}.{minor}; known: {', '.join(ARCHS)}")


def blocks_per_sm(arch: Arch, threads: int, registers: int, smem_bytes: int) -> int:
    """Resident blocks per SM for a kernel: the tightest of the register file (allocated per warp in units of
    256 registers), shared memory (plus the 1 KB the runtime reserves per block) and the thread limit."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = arch.regs_per_sm // (regs_per_warp * warps)
    by_smem = arch.smem_per_sm // (smem_bytes + 1024) if smem_bytes else by_regs
    by_threads = arch.max_threads_per_sm // threads
    return max(0, min(by_regs, by_smem, by_threads))
