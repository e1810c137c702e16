"""vLLM's own CUDA-graph dispatch and padding, run in a CPU engine with the piecewise split on. The engine is built as
on a GPU (`VLLM_COMPILE`: `@support_torch_compile` pieces split at the attention ops, `cudagraph_mode=PIECEWISE`,
capture sizes), its runner's `CudagraphDispatcher` pads each step's token count and the fast-prefill logits indices
to capture sizes, vLLM's `_capture_cudagraphs` captures every batch descriptor, and vLLM's `CUDAGraphWrapper` replays
them by the forward context's batch descriptor. Only the CUDA graph itself is replaced: capture runs the piece
eagerly and keeps its inputs and outputs, replay calls the piece again on the tensors it was captured with and writes
into the captured outputs (what a graph's kernels read and write). Served tokens and logprobs must equal the same
engine's run with the dispatcher off (no padding, no graphs) exactly: prefill, a mixed step, pure decode, and the
verification steps of n-gram speculation.

What the CPU build forces, and what is overridden here (in this process, where the engine runs): the CPU platform
reports no static-graph support (so vLLM sets `cudagraph_mode=NONE`), turns `VLLM_COMPILE` into
`DYNAMO_TRACE_ONCE` with Inductor, empties the capture sizes and has no graph wrapper class. The overrides keep the
requested mode, backend (eager kernels: Inductor takes minutes on two cores) and capture sizes, report static-graph
support, and name the wrapper below; the rest of the CPU platform's settings stay.
"""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_reference import (
    assert_logprobs_close,
    hf_greedy,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 6
# 80 tokens over a 48-token budget: a prefill step of 48 (3 sampled rows, padded to 4), a mixed step of 2 decode
# tokens and the long prompt's last 32 (34 tokens, padded to 40), then pure decode of 3 (padded to 4).
PROMPTS = random_prompts([3, 17, 60], seed=7)
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48]
# The quantisation fusion passes (on by default under VLLM_COMPILE) have their pattern modules only on CUDA and XPU
# builds; they act only on quantised checkpoints.
NO_QUANT_FUSION = {"fuse_norm_quant": False, "fuse_act_quant": False}
PIECEWISE = {"mode": "VLLM_COMPILE", "backend": "eager", "cudagraph_mode": "PIECEWISE", "pass_config": NO_QUANT_FUSION}
# Repetitive prompts, so that n-gram speculation proposes drafts (test_vllm_aux_top_k.py's).
SPECULATION_PROMPTS = [[7, 8, 9, 10] * 5, [20, 21, 22] * 9 + [20, 21]]
SPECULATION_MAX_NEW = 12  # the greedy continuations repeat a token: drafts to verify after a few
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
PIECES = {"backbone": "DualFlowModel", "dualflow_every_row_sampled": "DualFlowEveryRowModel"}
PIECES["dualflow_aux_rows"] = "DualFlowAuxRowsModel"
# The most rows a step samples: max_num_seqs (4) padded to a capture size; 4 requests of 1 + 3 tokens under n-gram
# speculation.
MAX_SAMPLED_ROWS = 4
MAX_SAMPLED_ROWS_SPECULATING = 16


class EagerGraph:
    """Stands in for `torch.cuda.CUDAGraph`: the capture context records the call being captured and its output;
    `replay()` calls the piece again on the captured tensors and copies the result into the captured output."""

    capturing = []  # the (runnable, args, kwargs) of the wrapper call under way

    def __init__(self, *args, **kwargs):
        self.call, self.output = None, None

    def replay(self):
        runnable, args, kwargs = self.call
        copy_into(self.output, runnable(*args, **kwargs))


@contextlib.contextmanager
def eager_capture(graph, pool=None, stream=None):
    graph.call = EagerGraph.capturing[-1]
    yield


def copy_into(destination, source):
    if isinstance(destination, torch.Tensor):
        destination.copy_(source)
    elif isinstance(destination, list | tuple):
        for d, s in zip(destination, source, strict=True):
            copy_into(d, s)


def tensor_args(args):
    return [x for x in args if isinstance(x, torch.Tensor)]


def wrapper_class():
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.forward_context import get_forward_context

    class ReplayedGraphWrapper(CUDAGraphWrapper):
        """vLLM's `CUDAGraphWrapper` over an `EagerGraph`. Each call is logged in `calls` as (piece tag, what the
        wrapper did: eager / capture / replay, the descriptor's token count, the rows of the piece's first input),
        and each replay whose tensor inputs are not at the captured addresses in `moved_inputs` (a graph would read
        the captured ones)."""

        calls, moved_inputs = [], []

        def __call__(self, *args, **kwargs):
            context = get_forward_context()
            descriptor = context.batch_descriptor
            entry = self.concrete_cudagraph_entries.get(descriptor)
            if context.cudagraph_runtime_mode != self.runtime_mode:
                event = "eager"
            elif entry is None:
                event = "capture"
            else:
                event = "replay"
                addresses = [x.data_ptr() for x in tensor_args(args)]
                if addresses != [x.data_ptr() for x in tensor_args(entry.cudagraph.call[1])]:
                    ReplayedGraphWrapper.moved_inputs.append((self.runnable.vllm_backend.prefix, descriptor.num_tokens))
            rows = tensor_args(args)[0].shape[0]
            tag = self.runnable.vllm_backend.prefix
            ReplayedGraphWrapper.calls.append((tag, event, None if descriptor is None else descriptor.num_tokens, rows))
            EagerGraph.capturing.append((self.runnable, args, kwargs))
            try:
                output = super().__call__(*args, **kwargs)
            finally:
                EagerGraph.capturing.pop()
            if event == "capture":
                self.concrete_cudagraph_entries[descriptor].cudagraph.output = output
            return output

    return ReplayedGraphWrapper


@contextlib.contextmanager
def simulated_graphs():
    """The CPU platform's overrides (module docstring) and the eager graph, while the engines inside run. Yields the
    wrapper class."""
    import vllm.compilation.cuda_graph as cuda_graph
    from vllm.platforms.cpu import CpuPlatform

    wrapper = wrapper_class()
    original_check = CpuPlatform.check_and_update_config.__func__

    def keep_graph_settings(cls, vllm_config):
        compilation = vllm_config.compilation_config
        kept = compilation.mode, compilation.backend, compilation.cudagraph_capture_sizes
        original_check(cls, vllm_config)
        compilation.mode, compilation.backend, compilation.cudagraph_capture_sizes = kept

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_graph_settings))
        patch.setattr(CpuPlatform, "support_static_graph_mode", classmethod(lambda cls: True))
        patch.setattr(CpuPlatform, "get_static_graph_wrapper_cls", classmethod(lambda cls: f"{__name__}.WRAPPER"))
        patch.setattr(CpuPlatform, "get_global_graph_pool", lambda self: None)
        # The CUDA parts of a capture: the graph, its memory pool and stream, the weak references to its outputs
        # (which the graph pool keeps alive on a GPU; here the EagerGraph holds them).
        patch.setattr(torch.cuda, "CUDAGraph", EagerGraph)
        patch.setattr(torch.cuda, "graph", eager_capture)
        patch.setattr(cuda_graph, "capture_pool", lambda pool, config: contextlib.nullcontext(pool))
        patch.setattr(cuda_graph, "current_stream", lambda: None)
        patch.setattr(cuda_graph, "weak_ref_tensors", lambda tensors: tensors)
        patch.setitem(globals(), "WRAPPER", wrapper)
        yield wrapper


def capture_graphs(worker):
    """In the engine process: `GPUModelRunner.capture_model` without its CUDA parts (the capture stream, memory
    accounting): vLLM's `_capture_cudagraphs` for every batch descriptor the dispatcher holds, capture allowed only
    meanwhile. Counts the dispatcher's decisions from now on in `runner.dispatched` (tokens asked, mode, tokens
    padded to)."""
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    runner = worker.model_runner
    descriptors = runner.cudagraph_dispatcher.get_capture_descs()
    set_cudagraph_capturing_enabled(True)
    try:
        for mode, batch_descriptors in descriptors:
            runner._capture_cudagraphs(batch_descriptors, cudagraph_runtime_mode=mode)
    finally:
        set_cudagraph_capturing_enabled(False)
    dispatch = runner.cudagraph_dispatcher.dispatch
    runner.dispatched = []

    def logged(num_tokens, *args, **kwargs):
        mode, descriptor = dispatch(num_tokens, *args, **kwargs)
        runner.dispatched.append((num_tokens, mode.name, descriptor.num_tokens))
        return mode, descriptor

    runner.cudagraph_dispatcher.dispatch = logged
    return [(mode.name, sorted(d.num_tokens for d in batch)) for mode, batch in descriptors]


def graphs_on(worker, on: bool):
    """In the engine process: the dispatcher off (every step eager, unpadded: vLLM's own path without graphs) or
    back on."""
    from vllm.config import CUDAGraphMode

    dispatcher = worker.model_runner.cudagraph_dispatcher
    dispatcher.cudagraph_mode = CUDAGraphMode.PIECEWISE if on else CUDAGraphMode.NONE
    worker.model_runner.dispatched.clear()


def dispatched(worker):
    return list(worker.model_runner.dispatched)


def served_and_logged(llm, wrapper, prompts, max_new):
    assert llm.reset_prefix_cache()
    wrapper.calls.clear()
    outputs = served_greedy(llm, prompts, max_new)
    return [chosen_logprobs(output) for output in outputs], list(wrapper.calls), llm.collective_rpc(dispatched)[0]


def serve_with_simulated_graphs(checkpoint, prompts, max_new: int, **engine_args) -> dict:
    """An engine with the piecewise split and simulated graphs: its configuration, the graphs captured, then the
    prompts served with the dispatcher off ("eager") and on ("replayed"), each as (tokens and logprobs, the wrappers'
    calls, the dispatcher's decisions)."""
    compilation = {**PIECEWISE, "cudagraph_capture_sizes": CAPTURE_SIZES}
    with (
        simulated_graphs() as wrapper,
        running_engine(checkpoint, compilation_config=compilation, **engine_args) as llm,
    ):
        config = llm.llm_engine.vllm_config.compilation_config
        buffers = llm.apply_model(aux_row_buffer_shapes)[0]
        wrapper.calls.clear()
        captured = llm.collective_rpc(capture_graphs)[0]
        capture_calls = list(wrapper.calls)
        llm.collective_rpc(graphs_on, args=(False,))
        eager = served_and_logged(llm, wrapper, prompts, max_new)
        llm.collective_rpc(graphs_on, args=(True,))
        replayed = served_and_logged(llm, wrapper, prompts, max_new)
        metrics = llm.get_metrics() if engine_args.get("disable_log_stats") is False else []
        accepted = [m.value for m in metrics if m.name == "vllm:spec_decode_num_accepted_tokens"]
    return dict(
        config=(config.mode.name, config.backend, config.cudagraph_mode.name, config.cudagraph_capture_sizes),
        buffers=buffers,
        captured=captured,
        capture_calls=capture_calls,
        eager=eager,
        replayed=replayed,
        moved_inputs=list(wrapper.moved_inputs),
        accepted=accepted,
    )


def aux_row_buffer_shapes(model) -> dict[str, list[int]]:
    """In the engine process: the shapes of the aux rows piece's persistent buffers."""
    buffers = model.aux_row_inputs
    return {name: list(getattr(buffers, name).shape) for name in ("rows", "input_ids", "positions", "entering")}


@pytest.fixture(scope="module")
def served(checkpoint):
    # Through JSON, as the speculating engine's result: tuples become lists.
    return json.loads(
        json.dumps(serve_with_simulated_graphs(checkpoint, PROMPTS, MAX_NEW, enable_chunked_prefill=True))
    )


def serve_speculating(checkpoint: str, result_file: str) -> None:
    """`serve_with_simulated_graphs` with n-gram speculation, run in a process of its own (`speculating`)."""
    result = serve_with_simulated_graphs(
        checkpoint,
        SPECULATION_PROMPTS,
        SPECULATION_MAX_NEW,
        speculative_config=NGRAM,
        enable_chunked_prefill=True,
        disable_log_stats=False,
    )
    Path(result_file).write_text(json.dumps(result))


@pytest.fixture(scope="module")
def speculating(checkpoint, tmp_path_factory):
    """The n-gram engine in a child process: n-gram speculation imports numba, after which vLLM 0.32 cannot start
    another engine in the same process (conftest.py), and this module's engines run before other modules' engines."""
    result_file = tmp_path_factory.mktemp("speculation") / "result.json"
    code = f"from {__name__} import serve_speculating; serve_speculating({str(checkpoint)!r}, {str(result_file)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, check=True, timeout=600)
    return json.loads(result_file.read_text())


def chosen_logprobs(output) -> list[tuple[int, float]]:
    completion = output.outputs[0]
    return [(token, step[token].logprob) for step, token in zip(completion.logprobs, completion.token_ids)]


def test_the_engine_runs_piecewise_graphs_with_the_capture_sizes(served):
    assert served["config"] == ["VLLM_COMPILE", "eager", "PIECEWISE", CAPTURE_SIZES]
    assert served["captured"] == [["PIECEWISE", CAPTURE_SIZES]]  # vLLM's capture descriptors, one per size


def test_every_piece_is_split_and_captured_at_every_size_it_runs_at(served):
    captures = [(tag, size) for tag, event, size, _ in served["capture_calls"] if event == "capture"]
    for tag in PIECES:
        graphs_per_size = {size: captures.count((tag, size)) for tag_, size in set(captures) if tag_ == tag}
        # The aux rows piece runs on the sampled rows: at the capture sizes up to the most a step samples.
        sizes = [size for size in CAPTURE_SIZES if tag != "dualflow_aux_rows" or size <= MAX_SAMPLED_ROWS]
        assert sorted(graphs_per_size) == sizes, (PIECES[tag], graphs_per_size)
        # Split at the attention ops: several graphs per size, as many at every size.
        assert len(set(graphs_per_size.values())) == 1 and graphs_per_size[1] > 1, (PIECES[tag], graphs_per_size)


def test_the_aux_rows_buffers_hold_the_most_rows_a_step_samples(served, speculating):
    # 2 layers x hidden 128 per row; not the 48-token budget
    for result, rows in ((served, MAX_SAMPLED_ROWS), (speculating, MAX_SAMPLED_ROWS_SPECULATING)):
        assert result["buffers"] == {
            "rows": [rows],
            "input_ids": [rows],
            "positions": [rows],
            "entering": [rows, 2, 128],
        }


def test_the_eager_run_is_unpadded(served):
    _, calls, decisions = served["eager"]
    assert calls and {event for _, event, _, _ in calls} == {"eager"}
    assert all(mode == "NONE" and padded == asked for asked, mode, padded in decisions), decisions


def assert_replayed_at_the_dispatched_sizes(result):
    """Every wrapper call after capture replayed a captured graph, on exactly the rows of the batch descriptor it
    replayed by, and that size is one the dispatcher padded a step or its sampled rows to. Returns the sizes each
    piece replayed and the dispatcher's decisions."""
    _, calls, decisions = result["replayed"]
    assert {event for _, event, _, _ in calls} == {"replay"}  # nothing captured after capture, nothing eager
    assert all(rows == size for _, _, size, rows in calls), calls
    sizes = {tag: {size for t, _, size, _ in calls if t == tag} for tag in PIECES}
    assert set().union(*sizes.values()) <= {to for _, mode, to in decisions if mode == "PIECEWISE"}, decisions
    assert result["moved_inputs"] == []  # each replay's inputs at the captured addresses (a graph reads those)
    return sizes, [[asked, to] for asked, mode, to in decisions if mode == "PIECEWISE"]


def test_pieces_replay_at_the_sizes_the_dispatcher_picked(served):
    sizes, dispatched = assert_replayed_at_the_dispatched_sizes(served)
    # The prefill step (48 tokens, 3 sampled rows padded to 4), the mixed step (34 tokens padded to 40, 3 sampled
    # rows padded to 4), pure decode of 3 requests (padded to 4), then of the long prompt's request alone.
    assert dispatched[:4] == [[48, 48], [3, 4], [34, 40], [3, 4]] and [3, 4] in dispatched[4:], dispatched
    assert sizes["backbone"] == {40, 48}
    # The aux rows piece replays the graph of its padded sampled rows, not the step's padded token count.
    assert sizes["dualflow_aux_rows"] == {4}
    assert sizes["dualflow_every_row_sampled"] == {1, 4}


def test_replayed_graphs_give_the_unpadded_runs_tokens_and_logprobs_exactly(served):
    assert served["replayed"][0] == served["eager"][0]


def test_replayed_graphs_match_transformers(served, checkpoint):
    reference = load_reference(checkpoint)
    for prompt, served_tokens in zip(PROMPTS, served["replayed"][0], strict=True):
        tokens, logprobs = hf_greedy(reference, prompt, MAX_NEW)
        assert [token for token, _ in served_tokens] == tokens
        assert_logprobs_close([logprob for _, logprob in served_tokens], logprobs)


def test_speculative_verification_replays_padded_graphs_and_gives_the_unpadded_runs_tokens(speculating):
    assert speculating["config"][:3] == ["VLLM_COMPILE", "eager", "PIECEWISE"]
    assert speculating["accepted"] and speculating["accepted"][0] > 0  # drafts verified: several sampled rows each
    sizes, dispatched = assert_replayed_at_the_dispatched_sizes(speculating)
    # Verification steps (more tokens than requests, every row sampled) padded to a capture size, and the every-row
    # piece replayed there.
    verified = [to for asked, to in dispatched[1:] if len(SPECULATION_PROMPTS) < asked < to]
    assert verified and set(verified) <= sizes["dualflow_every_row_sampled"], dispatched
    assert speculating["replayed"][0] == speculating["eager"][0]
