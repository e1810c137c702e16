"""
benchmarks/kv_transfer.py gives every engine the same OpenMP cores (issue 63.4): vLLM's CPU thread binding, computed
as vLLM computes it for an engine with a KV connector and for one without. No engine starts, nothing is timed.
"""

import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark imports its neighbour vllm_throughput.py
    try:
        spec = importlib.util.spec_from_file_location("kv_transfer_benchmark", ROOT / "benchmarks" / "kv_transfer.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture
def fresh_vllm_env(monkeypatch):
    """vLLM reads its environment variables once an engine has started in this process; read them afresh here."""
    from vllm import envs

    cached = envs._is_envs_cache_enabled()
    envs.disable_envs_cache()
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    if cached:
        envs.enable_envs_cache()


def omp_cores(connector: bool) -> list[list[int]]:
    """The cores vLLM binds the OpenMP threads of a one-worker CPU engine to, with or without a KV connector."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None, _api_process_count=1)
    kv_transfer = SimpleNamespace(kv_connector="ExampleConnector") if connector else None
    return OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=kv_transfer)).cpu_lists


def test_vllm_binds_an_engine_with_a_connector_to_other_cores(fresh_vllm_env):
    """The cause: vLLM's automatic binding reserves a core more for an engine with a connector (or, on too few cores,
    none), so the two engines the benchmark compares got different thread counts."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: vLLM binds every engine to it")
    assert omp_cores(connector=True) != omp_cores(connector=False)


def test_the_benchmark_binds_every_engine_alike(benchmark, fresh_vllm_env):
    environ = {}
    binding = benchmark.equal_cpu_binding(environ)
    assert binding == "VLLM_CPU_OMP_THREADS_BIND=auto, VLLM_CPU_NUM_OF_RESERVED_CPU=1"
    for name, value in environ.items():
        fresh_vllm_env.setenv(name, value)
    assert omp_cores(connector=True) == omp_cores(connector=False)


def test_a_chosen_binding_is_kept(benchmark, fresh_vllm_env):
    environ = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    binding = benchmark.equal_cpu_binding(environ)
    assert environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert binding == "VLLM_CPU_OMP_THREADS_BIND=0, VLLM_CPU_NUM_OF_RESERVED_CPU=0"


def test_the_consumer_finds_what_the_producer_stored_for_the_default_prompt(benchmark, monkeypatch):
    """The ExampleConnector stores the whole blocks before a prompt's last token and looks up those before its last
    two: the old default, 257 tokens (two 128-token blocks and 1), stored two blocks that the consumer never found."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import align_to_block_size

    monkeypatch.setattr(sys, "argv", ["kv_transfer.py"])
    prompt = benchmark.parse_args().prompt
    block = 128  # vLLM's CPU KV block size (the benchmark prints the one it ran with)
    # what the producer stores (the connector's request metadata), what the consumer looks for (its match)
    assert align_to_block_size(prompt, block) == align_to_block_size(prompt - 1, block) > 0
    assert align_to_block_size(257, block) != align_to_block_size(257 - 1, block)
