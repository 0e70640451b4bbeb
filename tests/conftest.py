import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A private kernel cache for CPU tests, unless FLASHGEN_CACHE_DIR is set (the GPU box shares one)."""
    if os.environ.get("FLASHGEN_CACHE_DIR"):
        return Path(os.environ["FLASHGEN_CACHE_DIR"])
    d = tmp_path_factory.mktemp("flashgen-cache")
    os.environ["FLASHGEN_CACHE_DIR"] = str(d)
    return d
