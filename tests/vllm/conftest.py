"""
vLLM tests: they run only in .venv-vllm (`bash scripts/bootstrap_vllm.sh`, then `.venv-vllm/bin/python -m pytest
tests/vllm`). Where vLLM is not installed (the main .venv) pytest does not collect them at all, so they are never
counted as skipped or passed there.

A vLLM engine takes tens of seconds to start on CPU: the engines run in the test process, and the test modules that
serve the same checkpoint with the same engine arguments share one (`engines`), one after another.
"""

import os
from importlib.metadata import packages_distributions
from pathlib import Path


# Installed distributions only: with tests/ on sys.path, this folder itself would look like an importable `vllm`.
if "vllm" not in packages_distributions():
    collect_ignore_glob = ["test_*.py"]

# The KV cache of a CPU engine, in GiB; the default would reserve a large share of this machine's memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engines run in this process: by default each engine starts an engine-core process and a worker process, each
# importing vLLM and torch again (tens of seconds of CPU per engine). The vLLM server test runs the default.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# One OpenMP thread per engine, as for an engine alone on this 2-core machine: vLLM's binding gives an engine with a KV
# connector every core when it has too few to keep one back, and two such engines (the NIXL producer and consumer)
# then spin on the same two cores as the other CI jobs.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
# `LLM.apply_model` runs a test module's function on the served model; in an engine process of its own, pickled.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


# VLLM_USE_V2_MODEL_RUNNER=1: the tests run on vLLM's model runner V2, the GPU default since vLLM 0.33 and the only
# runner from 0.34 on. V2 prepares inputs and samples with Triton kernels, which Triton's interpreter runs on CPU tensors;
# vLLM's CPU build takes Triton as present only with a "cpu" backend registered (v2_on_cpu.py).
if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
    from v2_on_cpu import run_v2_kernels_on_cpu

    run_v2_kernels_on_cpu()
else:  # what runs on V2 only
    collect_ignore_glob = [*globals().get("collect_ignore_glob", []), "test_vllm_v2_runner.py"]


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from vllm_reference import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("vllm-checkpoint"))


@pytest.fixture(scope="session")
def adapter_checkpoint(tmp_path_factory):
    """Two aux rounds and aux adapters: every aux-flow part a checkpoint can carry."""
    from vllm_reference import ADAPTER_RANK, build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("vllm-adapters"), aux_rounds=2, aux_adapter_rank=ADAPTER_RANK)


@pytest.fixture(scope="session")
def shared_expert_checkpoint(tmp_path_factory):
    """A Qwen2-MoE conversion: a gated shared expert beside the routed experts."""
    from vllm_reference import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("vllm-qwen2-moe"), family="qwen2_moe")


@pytest.fixture(scope="session")
def quantised_checkpoint(adapter_checkpoint, tmp_path_factory):
    """The adapter checkpoint (rounds and aux adapters) written by `dualflow quantize`: W4A8 attention."""
    from dualflow.quantize import quantize_checkpoint

    return quantize_checkpoint(adapter_checkpoint, tmp_path_factory.mktemp("vllm-w4a8") / "w4a8")["out"]


class SharedEngines:
    """
    The engine last asked for, by (checkpoint, engine arguments), kept for the next test that asks for the same one.
    A CPU engine holds its own KV cache (VLLM_CPU_KVCACHE_SPACE), so one is alive at a time: asking for another shuts
    it down. `MODULES_BY_ENGINE` puts the modules that share an engine next to each other.
    """

    def __init__(self):
        self.key, self.llm = None, None

    def get(self, checkpoint, **engine_args):
        from vllm_reference import start_engine

        key = (str(checkpoint), repr(sorted(engine_args.items())))
        if key != self.key:
            self.close()
            self.llm, self.key = start_engine(checkpoint, **engine_args), key
        return self.llm

    def close(self):
        """Shut the engine down (also for a test that changed it in a way the next user must not see)."""
        from vllm_reference import shut_down

        if self.llm is not None:
            llm, self.llm, self.key = self.llm, None, None
            shut_down(llm)


@pytest.fixture(scope="session")
def engines():
    shared = SharedEngines()
    yield shared
    shared.close()


# The modules that share an engine, next to each other (in the order their engines need: test_vllm_gpu_runner changes
# its engine's worker, so it runs last on it); modules not named run after these, in pytest's order.
MODULES_BY_ENGINE = [
    "test_vllm_parity.py",  # the checkpoint, with prefix caching and chunked prefill
    "test_vllm_gpu_runner.py",
    "test_vllm_aux_rounds.py",  # the adapter checkpoint: aux flow on, then off
    "test_vllm_aux_adapters.py",
    "test_vllm_primary_only.py",
]


# Its n-gram speculation imports numba, and at every later engine start in this process vLLM 0.32's scan of sys.modules
# for kernels fails on llvmlite's objects ("'_lib_fn_wrapper' object has no attribute 'get'").
RUNS_LAST = "test_vllm_aux_top_k.py"


def pytest_collection_modifyitems(items):
    def position(item):
        name = item.path.name
        if item.path.parent != Path(__file__).parent:
            return len(MODULES_BY_ENGINE)
        if name == RUNS_LAST:
            return len(MODULES_BY_ENGINE) + 1
        return MODULES_BY_ENGINE.index(name) if name in MODULES_BY_ENGINE else len(MODULES_BY_ENGINE)

    items.sort(key=position)
