"""
pytest setup only: a hermetic remote-code cache and datasets cache and an offline Hub per test session, a fixed seed per test. The code
the test modules share lives in helpers.py.
"""

import os
import tempfile


# transformers reads HF_MODULES_CACHE at import: point it at a private folder before anything imports it. The folder
# is removed when the test process exits (TemporaryDirectory's finalizer).
if "HF_MODULES_CACHE" not in os.environ:
    _modules_cache = tempfile.TemporaryDirectory(prefix="dualflow-hf-modules-")
    os.environ["HF_MODULES_CACHE"] = _modules_cache.name
# `datasets` converts local data files into Arrow tables in its cache: a private one too, removed the same way.
if "HF_DATASETS_CACHE" not in os.environ:
    _datasets_cache = tempfile.TemporaryDirectory(prefix="dualflow-hf-datasets-")
    os.environ["HF_DATASETS_CACHE"] = _datasets_cache.name
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
