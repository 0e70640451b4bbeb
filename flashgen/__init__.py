"""flashgen: FlashAttention kernels generated from Python traits, compiled with NVRTC, cached on disk.

Drop-in for flash-attn 2: `from flashgen import flash_attn_func, flash_attn_varlen_func`.
Importing flashgen is cheap: torch, NVRTC and the kernels load on first use.
"""
__version__ = "0.1.0"

_API = (
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
)
__all__ = list(_API) + ["FlashgenCompileError", "FlashgenError"]


def __getattr__(name):
    if name in _API:
        from . import interface
        return getattr(interface, name)
    if name in ("FlashgenCompileError", "FlashgenError", "FlashgenLaunchError"):
        from . import errors
        return getattr(errors, name)
    if name in ("bert_padding", "modules", "ops"):   # submodules that import torch: loaded on first access
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")
