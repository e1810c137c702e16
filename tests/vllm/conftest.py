"""
vLLM tests: they run only in .venv-vllm (`bash scripts/bootstrap_vllm.sh`, then `.venv-vllm/bin/python -m pytest
tests/vllm`). Where vLLM is not installed (the main .venv) pytest does not collect them at all, so they are never
counted as skipped or passed there.

One engine per test module: a vLLM engine takes tens of seconds to start on CPU.
"""

import os
from importlib.metadata import packages_distributions


# Installed distributions only: with tests/ on sys.path, this folder itself would look like an importable `vllm`.
if "vllm" not in packages_distributions():
    collect_ignore_glob = ["test_*.py"]

# The KV cache of a CPU engine, in GiB; the default would reserve a large share of this machine's memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# `LLM.apply_model` sends a test module's function to the engine process (pickled): tests read the served model.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from vllm_reference import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("vllm-checkpoint"))
