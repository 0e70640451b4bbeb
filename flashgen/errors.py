"""Exceptions raised by flashgen."""


class FlashgenError(RuntimeError):
    pass


class FlashgenCompileError(FlashgenError):
    """NVRTC rejected a rendered kernel: names the kernel, the first compiler errors and the saved source."""

    def __init__(self, kernel: str, log: str, source_path: str):
        self.kernel, self.log, self.source_path = kernel, log, source_path
        errors = [ln for ln in log.splitlines() if "error" in ln.lower()][:8] or log.splitlines()[:8]
        super().__init__(f"NVRTC failed to compile kernel {kernel}\n  first errors:\n    "
                         + "\n    ".join(errors) + f"\n  rendered source saved at: {source_path}")

    def __reduce__(self):   # crosses process-pool boundaries (parallel builds) intact
        return type(self), (self.kernel, self.log, self.source_path)


class FlashgenLaunchError(FlashgenError):
    pass
