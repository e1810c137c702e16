"""What vLLM's GPU runner does that its CPU runner does not, simulated in a CPU engine: with CUDA graphs the rows vLLM
samples from are padded to a graph size by repeating the last index, the attention output of the padded rows is never
written (`torch.empty`), and a compiled piece may replay a graph captured for more rows than it is called with (at
warm-up, with as many rows sampled as a step samples at most), reading its inputs from the captured addresses. The
served logits must be the unpadded run's exactly. Each compiled piece has one dynamic size, the one vLLM selects its
compile ranges by. Modes the model does not run are refused in one line before any engine process starts."""

import math

import pytest
import vllm
from vllm_reference import PREFIX_CACHING_AND_CHUNKED_PREFILL, random_prompts, running_engine, served_greedy

from dualflow.serving import vllm_internals
from dualflow.serving.engine_config import check_supported


MAX_NEW = 6
PROMPTS = random_prompts([3, 17, 40, 29], seed=5)  # 89 tokens over a 48-token budget: prefill, mixed and decode steps


def pad_sampled_rows_like_cuda_graphs(worker):
    """In the engine process: from now on, pad each step's sampled-row indices as the GPU runner does for a CUDA graph
    (`_prepare_kv_sharing_fast_prefill`: the last index repeated up to the padded size: the next power of 2, as
    vLLM's smallest capture sizes 1, 2, 4, 8, up to the most rows a step samples), and fill every attention
    output row that the kernel does not write (rows past the metadata's real token count) with NaN, as uninitialised
    GPU memory may hold. Counts the aux attention calls that saw padded rows in `runner.padded_attention_calls`."""
    from vllm.model_executor.layers.attention import Attention

    runner = worker.model_runner
    prepare = runner._prepare_kv_sharing_fast_prefill
    max_rows = runner.model.aux_row_inputs.rows.shape[0]

    def padded(logits_indices):
        prepare(logits_indices)
        size = min(2 ** math.ceil(math.log2(logits_indices.shape[0])), max_rows)
        indices = runner.kv_sharing_fast_prefill_logits_indices
        indices[logits_indices.shape[0] : size] = logits_indices[-1]
        return indices[:size]

    runner._prepare_kv_sharing_fast_prefill = padded
    runner.padded_attention_calls = 0
    for module in runner.model.modules():
        if isinstance(module, Attention):

            def unwritten_rows_nan(
                layer, query, key, value, kv_cache, metadata, *args, _kernel=module.impl.forward, **kw
            ):
                result = _kernel(layer, query, key, value, kv_cache, metadata, *args, **kw)
                if metadata is not None and query.shape[0] > metadata.num_actual_tokens:
                    kw["output"][metadata.num_actual_tokens :] = math.nan
                    runner.padded_attention_calls += 1
                return result

            module.impl.forward = unwritten_rows_nan


def padded_attention_calls(worker):
    return worker.model_runner.padded_attention_calls


def replay_aux_rows_like_cuda_graphs(worker):
    """
    In the engine process: from now on, run the aux rows piece as a CUDA graph captured for the most rows a step
    samples, M, replays it when a step calls it with P < M rows: on M rows read from the addresses its inputs had
    (the rows past P hold what earlier steps left there: NaN in the float ones here), its first P output rows used.
    Inputs that are not views of a buffer with room for M rows cannot be read that way (RuntimeError). Records each
    call's input addresses in `runner.aux_rows_addresses`, the forward context's batch descriptor size beside P in
    `runner.aux_rows_descriptors`, and counts the calls with P < M in `runner.replays_past_the_rows`.
    """
    from vllm.forward_context import get_forward_context

    runner = worker.model_runner
    model = runner.model
    piece = model.aux_rows_model
    max_rows = model.aux_row_inputs.rows.shape[0]
    # The sampled rows unpadded again (the padding above makes every step of this engine sample M): P < M rows.
    vars(runner).pop("_prepare_kv_sharing_fast_prefill", None)
    runner.aux_rows_addresses, runner.replays_past_the_rows, runner.aux_rows_descriptors = [], 0, []

    def replayed(*inputs):
        context = get_forward_context()
        runner.aux_rows_addresses.append(tuple(x.data_ptr() for x in inputs))
        # The descriptor a GPU's piecewise graph wrapper would pick this piece's graph by, beside the piece's rows.
        descriptor = context.batch_descriptor
        runner.aux_rows_descriptors.append((None if descriptor is None else descriptor.num_tokens, inputs[0].shape[0]))
        if inputs[0].shape[0] < max_rows:
            runner.replays_past_the_rows += 1
        captured = [x.as_strided((max_rows, *x.shape[1:]), x.stride(), x.storage_offset()) for x in inputs]
        for view, x in zip(captured, inputs):
            if view.is_floating_point():
                view[x.shape[0] :] = math.nan
        return piece(*captured)

    object.__setattr__(model, "aux_rows_model", replayed)  # an instance attribute, in front of the submodule


def replay_counts(worker):
    runner = worker.model_runner
    addresses = [len(set(call)) for call in zip(*runner.aux_rows_addresses)]
    return runner.replays_past_the_rows, addresses, runner.aux_rows_descriptors


def dynamic_sizes_of_compiled_pieces(worker):
    """
    In the engine process: each compiled piece traced again by torch.compile with the dimensions vLLM marks dynamic
    (the piece's own `dynamic_arg_dims`), on the inputs of a dummy step; the number of distinct symbolic sizes in
    each traced graph's inputs, by piece class name.
    """
    import torch
    from torch.fx.experimental.symbolic_shapes import free_symbols
    from vllm.forward_context import set_forward_context

    model = worker.model_runner.model
    num_tokens, layers = 7, len(model.model.layers)
    input_ids = torch.arange(num_tokens) + 6
    positions = torch.arange(num_tokens)
    entering = torch.zeros(num_tokens, layers, model.config.hidden_size)
    sizes = {}
    for piece in model.modules():
        if getattr(piece, "_dynamic_arg_dims", None) is None:  # not a compiled piece
            continue
        kwargs = dict(input_ids=input_ids.clone(), positions=positions.clone())
        if piece is model.model:  # the primary piece, gathering the entering states at a fixed number of rows
            kwargs["aux_rows"] = torch.zeros_like(model.aux_row_inputs.rows)
        if "entering" in piece._dynamic_arg_dims:
            kwargs["entering"] = entering.clone()
        for name, dim in piece._dynamic_arg_dims.items():
            if name in kwargs:
                torch._dynamo.mark_dynamic(kwargs[name], dim % kwargs[name].ndim)
        symbols = set()

        def record(graph, example_inputs, symbols=symbols):
            for example in example_inputs:
                symbols.update(free_symbols(example))
            return graph.forward

        torch._dynamo.reset()
        with set_forward_context(None, worker.vllm_config):
            torch.compile(piece.forward, backend=record)(**kwargs)
        sizes[type(piece).__name__] = len(symbols)
    return sizes


def sampled_rows_of_micro_batches(worker):
    """In the engine process: the model's reading of a forward context holding two micro-batches' metadata (vLLM's
    dual-batch overlap), or the error it raises."""
    from vllm.forward_context import set_forward_context

    with set_forward_context([{}, {}], worker.vllm_config):
        try:
            return worker.model_runner.model.model.sampled_rows(4)
        except ValueError as error:
            return str(error)


def served_from_an_empty_prefix_cache(llm):
    """PROMPTS served so that each serving prefills the same steps: no prompt block is found in the cache."""
    assert llm.reset_prefix_cache()
    return served_greedy(llm, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def served(engines, checkpoint):
    """The same prompts served three times by test_vllm_parity's engine (aux flow on, chunked prefill): unpadded, padded,
    replayed. The simulation stays in the engine's worker, so the engine is shut down after."""
    llm = engines.get(checkpoint, **PREFIX_CACHING_AND_CHUNKED_PREFILL)
    try:
        unpadded = served_from_an_empty_prefix_cache(llm)
        llm.collective_rpc(pad_sampled_rows_like_cuda_graphs)
        padded = served_from_an_empty_prefix_cache(llm)
        calls = llm.collective_rpc(padded_attention_calls)[0]
        llm.collective_rpc(replay_aux_rows_like_cuda_graphs)
        replayed = served_from_an_empty_prefix_cache(llm)
        replays = llm.collective_rpc(replay_counts)[0]
        micro_batches = llm.collective_rpc(sampled_rows_of_micro_batches)[0]
        dynamic_sizes = llm.collective_rpc(dynamic_sizes_of_compiled_pieces)[0]
        vllm_config = llm.llm_engine.vllm_config
    finally:
        engines.close()
    return unpadded, padded, calls, micro_batches, vllm_config, replayed, replays, dynamic_sizes


def test_padded_sampled_rows_give_the_unpadded_logits_exactly(served):
    unpadded, padded, calls = served[:3]
    assert calls > 0  # the padding reached the aux attention layers, with NaN in the rows it does not write
    assert [chosen_logprobs(output) for output in padded] == [chosen_logprobs(output) for output in unpadded]


def test_mixed_steps_replaying_a_graph_captured_for_every_row_give_the_unpadded_logits_exactly(served):
    unpadded, replayed, (replays_past_the_rows, addresses_per_input, descriptors) = served[0], served[5], served[6]
    assert replays_past_the_rows > 0  # steps with fewer sampled rows than a step samples at most
    # The batch descriptor, which picks the CUDA graph on a GPU, says the aux piece's own (padded) row count, not the
    # step's token count: each aux linear layer and expert replays on P rows.
    assert any(size is not None for size, _ in descriptors), descriptors
    assert all(size in (None, rows) for size, rows in descriptors), descriptors
    assert addresses_per_input == [1, 1, 1]  # token ids, positions, primary states: one address each, every step
    assert [chosen_logprobs(output) for output in replayed] == [chosen_logprobs(output) for output in unpadded]


def test_each_compiled_piece_has_one_dynamic_size(served):
    assert served[7] == {"DualFlowModel": 1, "DualFlowEveryRowModel": 1, "DualFlowAuxRowsModel": 1}


def chosen_logprobs(output) -> list[tuple[int, float]]:
    completion = output.outputs[0]
    return [(token, step[token].logprob) for step, token in zip(completion.logprobs, completion.token_ids)]


def test_micro_batches_are_refused_in_one_line(served):
    assert served[3] == (
        "Dual-Flow in vLLM does not run dual-batch overlap micro-batches: start the engine without enable_dbo"
    )


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        ({"enable_dbo": True}, "does not run dual-batch overlap"),
        ({"enable_lora": True}, "does not serve LoRA adapters"),
        ({"compilation_config": {"cudagraph_mode": "FULL"}}, r"full CUDA graphs \(cudagraph_mode=FULL\): use"),
        ({"enable_prompt_embeds": True}, r"prompt embeddings \(enable_prompt_embeds\) need use_aux_flow=False"),
        (
            {"enable_expert_parallel": True, "all2all_backend": "deepep_low_latency"},
            r"not been verified with expert parallelism \(enable_expert_parallel, all2all_backend='deepep_low_latency'\)",
        ),
    ],
)
def test_unsupported_modes_are_refused_before_the_engine_starts(checkpoint, engine_args, message):
    with pytest.raises(ValueError, match=message), running_engine(checkpoint, **engine_args):
        pass


def test_the_expert_parallel_load_balancer_is_refused(served, monkeypatch):
    # vLLM's CPU build refuses EPLB itself before the model's check runs: the check on an engine configuration with it
    vllm_config = served[4]
    check_supported(vllm_config.model_config.hf_config, vllm_config)
    monkeypatch.setattr(vllm_config.parallel_config, "enable_eplb", True)
    with pytest.raises(
        ValueError, match="does not support the expert-parallel load balancer: start without enable_eplb"
    ):
        check_supported(vllm_config.model_config.hf_config, vllm_config)


def test_an_untested_vllm_release_is_refused_before_the_engine_starts(checkpoint, monkeypatch):
    vllm_internals.check_vllm_version()  # the installed release is one of the tested ones
    monkeypatch.setattr(vllm, "__version__", "0.31.2+cpu")
    message = (
        r"Dual-Flow's vLLM model is built for vLLM 0\.32\.0 or 0\.33\.0 or 0\.34\.0, not 0\.31\.2\+cpu: install one of"
    )
    with pytest.raises(ValueError, match=message), running_engine(checkpoint):
        pass
