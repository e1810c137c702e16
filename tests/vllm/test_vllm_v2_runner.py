"""
On vLLM's model runner V2 only (collected when VLLM_USE_V2_MODEL_RUNNER=1, conftest.py): asynchronous scheduling, the
GPU default that vLLM's CPU platform switches off, serves transformers' tokens with the aux flow on; V2's own graph
capture captures every piece that serving replays (graphs simulated as test_vllm_cudagraph_dispatch.py simulates
them for V1). The rest of what
V2 runs (armed fast prefill in mixed steps, pure decode, chunked prefill, prefix caching, n-gram speculation, rounds
and adapters) is the other modules' tests, run again on V2 by CI.
"""

import contextlib
from types import SimpleNamespace

import pytest
from test_vllm_cudagraph_dispatch import CAPTURE_SIZES, MAX_SAMPLED_ROWS, PIECES, simulated_graphs
from test_vllm_cudagraph_dispatch import PIECEWISE as DISPATCH_PIECEWISE
from test_vllm_cudagraph_dispatch import PROMPTS as DISPATCH_PROMPTS
from test_vllm_support_matrix import engine_config, raised_by_the_model
from vllm.platforms.cpu import CpuPlatform
from vllm_reference import (
    PREFIX_CACHING_AND_CHUNKED_PREFILL,
    assert_matches_transformers,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)

from dualflow.serving.vllm_internals import runs_model_runner_v2


MAX_NEW = 8
PROMPTS = random_prompts([3, 17, 40, 29], seed=3)


@pytest.fixture
def async_scheduling_kept(monkeypatch):
    """vLLM's CPU platform turns asynchronous scheduling off after the model's hook; keep what the engine asked for."""
    settle = CpuPlatform.check_and_update_config.__func__

    def settle_keeping_async(cls, vllm_config):
        asked = vllm_config.scheduler_config.async_scheduling
        settle(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(settle_keeping_async))


def test_async_scheduling_serves_transformers_tokens(checkpoint, engines, async_scheduling_kept):
    engines.close()  # one CPU engine in this process at a time (conftest.py)
    with running_engine(checkpoint, async_scheduling=True, **PREFIX_CACHING_AND_CHUNKED_PREFILL) as engine:
        config = engine.llm_engine.vllm_config
        assert runs_model_runner_v2(config) and config.scheduler_config.async_scheduling
        outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert_matches_transformers(outputs, PROMPTS, load_reference(checkpoint), MAX_NEW)


def capture_with_v2(worker) -> list[tuple[str, list[int]]]:
    """
    In the engine process: V2's own capture, `CudaGraphManager.capture` called as `GPUModelRunner.capture_model` calls
    it (without its memory accounting, and with its capture stream, a `torch.cuda.Stream`, left out). Returns the
    descriptors it captured: (mode, token counts).
    """
    import vllm.v1.worker.gpu.cudagraph_utils as cudagraph_utils

    runner = worker.model_runner
    with pytest.MonkeyPatch.context() as patch:
        no_stream = contextlib.nullcontext(SimpleNamespace(stream=None))  # vLLM 0.34 reads the context's stream
        patch.setattr(cudagraph_utils, "graph_capture", lambda *args, **kwargs: no_stream)
        runner.cudagraph_manager.capture(
            runner.model,
            runner.model_state,
            runner.input_buffers,
            runner.intermediate_tensors,
            runner.block_tables,
            runner.attn_groups,
            runner.kv_cache_config,
            pcp_manager=runner.pcp_manager,
        )
    descriptors = runner.cudagraph_manager._capture_descs
    return [(mode.name, sorted(d.num_tokens for d in descs)) for mode, descs in descriptors.items()]


def test_v2_captures_every_piece_at_startup_and_serving_only_replays(checkpoint, engines):
    """
    vLLM's piecewise graphs on V2, simulated as test_vllm_cudagraph_dispatch.py simulates them on V1 (vLLM's graph
    wrapper over an eager stand-in for the CUDA graph): V2's capture captures each of the three pieces at every size
    serving replays it at; serving then replays only (a piece captured while serving would be a capture outside
    vLLM's memory profile on a GPU), on the rows of the descriptor it replays, with transformers' tokens.
    """
    engines.close()  # one CPU engine in this process at a time (conftest.py)
    compilation = {**DISPATCH_PIECEWISE, "cudagraph_capture_sizes": CAPTURE_SIZES}
    with (
        simulated_graphs() as wrapper,
        running_engine(checkpoint, compilation_config=compilation, enable_chunked_prefill=True) as engine,
    ):
        assert runs_model_runner_v2(engine.llm_engine.vllm_config)
        wrapper.calls.clear()
        captured = engine.collective_rpc(capture_with_v2)[0]
        capture_calls = list(wrapper.calls)
        wrapper.calls.clear()
        outputs = served_greedy(engine, DISPATCH_PROMPTS, MAX_NEW)
        serving_calls = list(wrapper.calls)
    assert captured == [("PIECEWISE", CAPTURE_SIZES)]
    captures = {(tag, size) for tag, event, size, _ in capture_calls if event == "capture"}
    for tag in PIECES:
        sizes = [size for size in CAPTURE_SIZES if tag != "dualflow_aux_rows" or size <= MAX_SAMPLED_ROWS]
        assert sorted(size for tag_, size in captures if tag_ == tag) == sizes, PIECES[tag]
    assert serving_calls and {event for _, event, _, _ in serving_calls} == {"replay"}
    assert all(rows == size for _, _, size, rows in serving_calls), serving_calls
    assert wrapper.moved_inputs == []  # each replay's inputs at the captured addresses (a graph reads those)
    assert {tag for tag, _, _, _ in serving_calls} == set(PIECES)  # mixed steps and pure decode were served
    assert_matches_transformers(outputs, DISPATCH_PROMPTS, load_reference(checkpoint), MAX_NEW)


def test_recomputing_a_refused_kv_load_is_refused_in_one_line(checkpoint, tmp_path):
    # On V2, requests whose KV failed to load and were recomputed gave other tokens than transformers' (the consumer
    # tests of test_vllm_kv_transfer.py with kv_load_failure_policy "recompute"); "fail" passes them.
    connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}
    connector["kv_connector_extra_config"] = {"shared_storage_path": str(tmp_path)}
    with pytest.raises(ValueError) as refused:
        engine_config(checkpoint, kv_transfer_config={**connector, "kv_load_failure_policy": "recompute"})
    assert str(raised_by_the_model(refused.value)) == (
        "Dual-Flow in vLLM recomputes a refused KV load on the V1 runner only (on V2 the recomputed requests did not "
        "give transformers' tokens): start with kv_load_failure_policy='fail'"
    )
    engine_config(checkpoint, kv_transfer_config={**connector, "kv_load_failure_policy": "fail"})
