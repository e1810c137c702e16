"""
Every field of vLLM's engine configuration (`VllmConfig` and its sub-configs, recursively), classified for a Dual-Flow
engine, so that the engine fails closed: a field is accepted at vLLM's default, at a value that ran (or was
simulated) in this package's vLLM tests, or because it cannot change what the model computes (inert) or is filled by
vLLM from other settings (derived). Anything else, a field vLLM adds in a later release included, is refused in one
line naming it; the test suite fails when vLLM has a field this table does not classify (test_vllm_config_allowlist).
"""

import dataclasses
from dataclasses import dataclass

import torch
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from vllm.config import CompilationMode, CUDAGraphMode


@dataclass(frozen=True)
class Inert:
    """Cannot change what the model computes (names, ports, logging, capacity, what happens after the logits)."""

    why: str


@dataclass(frozen=True)
class Derived:
    """Filled by vLLM (or this package's hook) from other settings or the platform."""

    source: str


@dataclass(frozen=True)
class Tested:
    """Accepted at the listed values (any value when `values` is None): the vLLM tests run them (`where`)."""

    values: tuple | None
    where: str
    advice: str = ""


@dataclass(frozen=True)
class AtDefault:
    """Accepted at vLLM's default only; `advice` says why and what to do when it is set."""

    advice: str = "it has never run with this model: start without it"


ANY = None  # Tested(ANY, ...): every value vLLM itself accepts
POOLING = (
    "the pooling runner would return the aux flow's hidden states, where transformers' DualFlowModel returns the "
    "primary flow's: serve it with the generate runner"
)
QUANTISED = (
    "the quantised checkpoints served are compressed-tensors W4A8 on the attention projections as "
    "`dualflow quantize` writes them (vLLM's CPU build has no kernel for quantised experts without AMX): "
    "serve the checkpoint unquantised or write it with `dualflow quantize`"
)
OFFLOAD = "CPU weight offload has never run with this model: start without offloading"
NOT_MULTIMODAL = "Dual-Flow checkpoints are text-only: start without it"
SCHEDULING = "decides which tokens a step runs; the model's results do not depend on it (test_vllm_parity.py)"
UNCLASSIFIED = (
    "this vLLM field is not classified for Dual-Flow (dualflow/serving/engine_allowlist.py): start without it"
)
HF_OVERRIDES_TESTED = {
    "use_aux_flow",
    "aux_num_experts_per_tok",
    "aux_at_every_prompt_position",
    "aux_num_rounds",  # checked against the checkpoint's round gates
    "aux_adapter_rank",  # checked against the checkpoint's adapters
}

# Dotted path (from `VllmConfig`) -> classification. A classification of a sub-config covers its fields; a field or
# sub-config vLLM defaults to `None` is accepted unset. Refusals that say more (engine_config.py) run first.
ENGINE_FIELDS = {
    # model_config
    "model_config.model": Tested(ANY, "the checkpoint served"),
    "model_config.revision": Tested(ANY, "the checkpoint's revision"),
    "model_config.code_revision": Inert("the checkpoint's code revision: the model class is this package's"),
    "model_config.tokenizer": Tested(ANY, "the tests' word-level tokenizer"),
    "model_config.tokenizer_revision": Inert("the tokenizer's revision"),
    "model_config.tokenizer_mode": AtDefault(),
    "model_config.model_weights": AtDefault(),
    "model_config.runner": Tested(("auto", "generate"), "every engine test", POOLING),
    "model_config.convert": Tested(("auto", "none"), "every engine test", POOLING),
    "model_config.trust_remote_code": Inert("permission to import a checkpoint's code; vLLM runs this package's model"),
    "model_config.dtype": Tested(
        (torch.float32, torch.bfloat16),
        "every engine test (float32); bfloat16 is what vLLM's CPU build loads a float32 checkpoint as by default",
    ),
    "model_config.seed": Tested(ANY, "every engine test (seed 0)"),
    "model_config.hf_config": Derived("config.json and hf_overrides, checked by check_supported"),
    "model_config.hf_text_config": Derived("hf_config"),
    "model_config.is_submodel_config": Derived("vLLM's sub-model views"),
    "model_config.word_embeddings_untied_by_checkpoint": Derived("the checkpoint's weights"),
    "model_config.hf_config_path": AtDefault(),
    "model_config.allowed_local_media_path": Inert("media inputs: Dual-Flow checkpoints are text-only"),
    "model_config.allowed_media_domains": Inert("media inputs: Dual-Flow checkpoints are text-only"),
    "model_config.max_model_len": Tested(ANY, "every engine test (256)"),
    "model_config.spec_target_max_model_len": Derived("speculative_config and max_model_len"),
    "model_config.quantization": Tested(
        (None, "compressed-tensors"), "test_vllm_quantised.py (`dualflow quantize`'s only)", QUANTISED
    ),
    "model_config.quantization_config": AtDefault(QUANTISED),
    "model_config.allow_deprecated_quantization": AtDefault(QUANTISED),
    "model_config.enforce_eager": Tested((False, True), "test_vllm_compile.py"),
    "model_config.return_sampling_mask": AtDefault(),
    "model_config.max_logprobs": Inert("how many logprobs a request may ask for"),
    "model_config.logprobs_mode": Inert("which logprobs are returned, computed from the model's logits"),
    "model_config.use_fp64_gumbel": Inert("the sampler's precision, after the logits"),
    "model_config.enable_trace_replay": AtDefault(),
    "model_config.disable_sliding_window": AtDefault("Dual-Flow checkpoints have no sliding window: start without it"),
    "model_config.disable_cascade_attn": AtDefault(),
    "model_config.skip_tokenizer_init": Inert("whether the engine detokenises"),
    "model_config.enable_prompt_embeds": AtDefault(
        "prompt embeddings have never run with this model: start without enable_prompt_embeds"
    ),
    "model_config.served_model_name": Inert("the name the server reports"),
    "model_config.config_format": AtDefault(),
    "model_config.hf_token": Inert("Hub credentials"),
    "model_config.hf_overrides": Tested(
        ANY, "test_vllm_primary_only.py, test_vllm_aux_top_k.py, test_vllm_prompt_logprobs.py, test_vllm_aux_rounds.py"
    ),
    "model_config.model_class_overrides": AtDefault("it would replace the Dual-Flow model class: start without it"),
    "model_config.generation_config": Inert("default sampling parameters"),
    "model_config.override_generation_config": Inert("default sampling parameters"),
    "model_config.enable_sleep_mode": AtDefault(),
    "model_config.sleep_preserve_parameter_names": AtDefault(),
    "model_config.sleep_mode_backend": AtDefault(),
    "model_config.sleep_mode_offload_cudagraph": AtDefault(),
    "model_config.enable_nccl_comm_suspend": AtDefault(),
    "model_config.enable_cumem_allocator": AtDefault(),
    "model_config.model_impl": AtDefault("it would serve another implementation than the Dual-Flow model"),
    "model_config.logits_processors": Inert("act on the logits after the model"),
    "model_config.io_processor_plugin": AtDefault(POOLING),
    "model_config.renderer_num_workers": Inert("prompt rendering processes"),
    "model_config.pooler_config": AtDefault(POOLING),
    "model_config.multimodal_config": AtDefault(NOT_MULTIMODAL),
    # cache_config
    "cache_config.block_size": Tested(ANY, "every engine test (32), test_vllm_cudagraph_dispatch.py"),
    "cache_config.user_specified_block_size": Derived("block_size"),
    "cache_config._block_size_resolved": Derived("block_size and the platform"),
    "cache_config.kv_cache_layout": Derived("the attention backend, when the engine starts"),
    "cache_config.prefix_match_unit": Derived("block_size"),
    "cache_config.gpu_memory_utilization": Inert("the memory budget of the KV cache"),
    "cache_config.cache_dtype": AtDefault("a quantised KV cache is refused: start with kv_cache_dtype='auto'"),
    "cache_config.is_attention_free": Derived("the model's layers"),
    "cache_config.num_gpu_blocks_override": Inert("the KV cache's capacity"),
    "cache_config.sliding_window": Derived("the checkpoint (none)"),
    "cache_config.enable_prefix_caching": Tested((True, False), "test_vllm_parity.py, test_vllm_aux_adapters.py"),
    "cache_config.prefix_caching_hash_algo": Inert("how cached blocks are keyed"),
    "cache_config.prefix_cache_retention_interval": Inert("how long cached blocks are kept"),
    "cache_config.kv_cache_dtype_skip_layers": AtDefault(),
    "cache_config.mamba_page_size_padded": Derived("the model's layers (no mamba layers)"),
    "cache_config.skip_page_size_padded": Derived("the model's layers"),
    "cache_config.mamba_block_size": Derived("block_size (no mamba layers)"),
    "cache_config.mamba_cache_dtype": AtDefault("Dual-Flow has no mamba layers: start without it"),
    "cache_config.mamba_ssm_cache_dtype": Tested(
        ("auto", "float32"),
        "vLLM's CPU platform sets float32 on CPUs with AVX512-BF16; Dual-Flow has no mamba layers, no state is stored",
        "Dual-Flow has no mamba layers: start without it",
    ),
    "cache_config.mamba_cache_mode": AtDefault("Dual-Flow has no mamba layers: start without it"),
    "cache_config.enable_mamba_shared_prefix_checkpoint": AtDefault("Dual-Flow has no mamba layers: start without it"),
    "cache_config.replayssm_buffer_len": AtDefault("Dual-Flow has no state-space layers: start without it"),
    "cache_config.use_replayssm": AtDefault("Dual-Flow has no state-space layers: start without it"),
    "cache_config.use_kda_recoverssm": AtDefault("Dual-Flow has no state-space layers: start without it"),
    "cache_config.num_gpu_blocks": Derived("memory profiling"),
    "cache_config.num_cpu_blocks": Derived("memory profiling"),
    "cache_config.effective_attention_block_size": Derived("block_size and the attention backend"),
    "cache_config.kv_cache_size_tokens": Derived("memory profiling"),
    "cache_config.kv_cache_max_concurrency": Derived("memory profiling"),
    "cache_config.hash_block_size": Derived("block_size"),
    "cache_config.cache_hit_alignment_tokens": Derived("block_size"),
    "cache_config.kv_sharing_fast_prefill": Derived("this package's hook: on with the aux flow at the sampled rows"),
    "cache_config.swa_bounded_replay": AtDefault(),
    "cache_config.kv_cache_memory_bytes": Inert("the KV cache's capacity"),
    "cache_config.kv_offloading_size": AtDefault("KV offloading has never run with this model: start without it"),
    "cache_config.kv_offloading_backend": AtDefault("KV offloading has never run with this model: start without it"),
    # parallel_config
    "parallel_config.pipeline_parallel_size": AtDefault(),
    "parallel_config.tensor_parallel_size": Tested((1, 2), "TP 2 over gloo: test_vllm_tensor_parallel.py"),
    "parallel_config.prefill_context_parallel_size": AtDefault(),
    "parallel_config.decode_context_parallel_size": AtDefault(),
    "parallel_config.dcp_kv_cache_interleave_size": AtDefault(),
    "parallel_config.dcp_comm_backend": Derived("decode_context_parallel_size (1)"),
    "parallel_config.dcp_q_replicate": Derived("decode_context_parallel_size (1)"),
    "parallel_config.cp_kv_cache_interleave_size": AtDefault(),
    "parallel_config._allow_auto_resolve_cp_interleave_size": Derived("cp_kv_cache_interleave_size"),
    "parallel_config.data_parallel_size": AtDefault(),
    "parallel_config.data_parallel_size_local": Derived("data_parallel_size (1)"),
    "parallel_config.data_parallel_rank": Derived("data_parallel_size (1)"),
    "parallel_config.data_parallel_rank_local": Derived("data_parallel_size (1)"),
    "parallel_config.data_parallel_index": Derived("data_parallel_rank"),
    "parallel_config.data_parallel_master_ip": Inert("an address"),
    "parallel_config.data_parallel_rpc_port": Inert("a port"),
    "parallel_config.data_parallel_master_port": Inert("a port"),
    "parallel_config._data_parallel_master_port_list": Derived("data_parallel_master_port"),
    "parallel_config._coord_store_port": Derived("free ports"),
    "parallel_config.dp_sync_interval": AtDefault(),
    "parallel_config.data_parallel_backend": AtDefault(),
    "parallel_config.data_parallel_external_lb": AtDefault(),
    "parallel_config.data_parallel_hybrid_lb": AtDefault(),
    "parallel_config.disable_nccl_for_dp_synchronization": Derived("data_parallel_size and the platform"),
    "parallel_config.is_moe_model": Derived("the checkpoint"),
    "parallel_config.enable_hc_sp": AtDefault(),
    "parallel_config.enable_expert_parallel": AtDefault(),
    "parallel_config.enable_batch_sharded_sampling": Derived("data_parallel_size and the platform"),
    "parallel_config.enable_ep_weight_filter": AtDefault(),
    "parallel_config.enable_eplb": AtDefault(),
    "parallel_config.eplb_config.num_redundant_experts": Tested(
        (None, 0), "vLLM 0.34 resolves it to 0 with the load balancer off (the load balancer is refused)"
    ),
    "parallel_config.eplb_config": AtDefault("the expert-parallel load balancer is refused: start without it"),
    "parallel_config.expert_placement_strategy": AtDefault(),
    "parallel_config.all2all_backend": Inert("read by expert parallelism only, which is refused"),
    "parallel_config.max_parallel_loading_workers": Inert("how weights are read"),
    "parallel_config.disable_custom_all_reduce": Tested(
        (False, True), "test_vllm_tensor_parallel.py (the CPU build: True)"
    ),
    "parallel_config.enable_shm_tensor_arena": AtDefault(),
    "parallel_config.enable_elastic_ep": AtDefault(),
    "parallel_config.elastic_ep_max_dp_size": Derived("data_parallel_size"),
    "parallel_config.enable_dbo": AtDefault(),
    "parallel_config.ubatch_size": AtDefault(),
    "parallel_config.dbo_decode_token_threshold": Inert("read by dual-batch overlap only, which is refused"),
    "parallel_config.dbo_prefill_token_threshold": Inert("read by dual-batch overlap only, which is refused"),
    "parallel_config.ray_workers_use_nsight": Inert("profiling"),
    "parallel_config.ray_runtime_env": Inert("the Ray workers' environment"),
    "parallel_config.placement_group": Inert("where Ray places the workers"),
    "parallel_config.distributed_executor_backend": Tested(
        (None, "uni", "mp"), "every engine test (uni), test_vllm_tensor_parallel.py (mp)"
    ),
    "parallel_config.worker_cls": Derived("the platform's worker ('auto')"),
    "parallel_config.worker_extension_cls": AtDefault(),
    "parallel_config.master_addr": Inert("an address"),
    "parallel_config.master_port": Inert("a port"),
    "parallel_config.node_rank": AtDefault("multi-node serving has never run with this model: start on one node"),
    "parallel_config.nnodes": AtDefault("multi-node serving has never run with this model: start on one node"),
    "parallel_config.numa_bind": Inert("which CPUs and NUMA nodes the workers run on"),
    "parallel_config.numa_bind_nodes": Inert("which CPUs and NUMA nodes the workers run on"),
    "parallel_config.numa_bind_cpus": Inert("which CPUs and NUMA nodes the workers run on"),
    "parallel_config.assigned_physical_gpu_ids": Inert("which devices the workers use"),
    "parallel_config.distributed_timeout_seconds": Inert("a timeout"),
    "parallel_config.cpu_distributed_timeout_seconds": Inert("a timeout"),
    "parallel_config.world_size": Derived("tensor_parallel_size x pipeline_parallel_size"),
    "parallel_config.rank": Derived("the worker process"),
    "parallel_config._api_process_count": Derived("the server's API processes"),
    "parallel_config._api_process_rank": Derived("the server's API processes"),
    "parallel_config.enable_fault_tolerance": AtDefault(),
    "parallel_config.fault_tolerance_config": Inert("read by fault tolerance only, which stays off"),
    # scheduler_config
    "scheduler_config.runner_type": Tested(("generate",), "every engine test", POOLING),
    "scheduler_config.max_num_batched_tokens": Tested(ANY, "every engine test (48, 64; chunked prefill)"),
    "scheduler_config.max_num_scheduled_tokens": Derived("max_num_batched_tokens"),
    "scheduler_config.max_num_seqs": Tested(ANY, "every engine test (4)"),
    "scheduler_config.max_num_active_seqs": Derived("max_num_seqs"),
    "scheduler_config.long_prefill_token_threshold": Inert(SCHEDULING),
    "scheduler_config.long_prefill_token_threshold_adaptive": Inert(SCHEDULING),
    "scheduler_config.max_num_queued_reqs": Inert("admission control"),
    "scheduler_config.max_num_queued_tokens": Inert("admission control"),
    "scheduler_config.enable_chunked_prefill": Tested((True, False), "test_vllm_parity.py, test_vllm_compile.py"),
    "scheduler_config.is_multimodal_model": Derived("the checkpoint (text-only)"),
    "scheduler_config.max_num_encoder_input_tokens": Derived("max_num_batched_tokens (no encoder)"),
    "scheduler_config.encoder_cache_size": Derived("max_num_batched_tokens (no encoder)"),
    "scheduler_config.policy": Inert("the order requests are scheduled in"),
    "scheduler_config.disable_chunked_mm_input": Inert("media inputs: Dual-Flow checkpoints are text-only"),
    "scheduler_config.scheduler_cls": AtDefault(),
    "scheduler_config.disable_hybrid_kv_cache_manager": Derived("the model's KV cache groups"),
    "scheduler_config.scheduler_reserve_full_isl": Inert(SCHEDULING),
    "scheduler_config.watermark": Inert("admission control"),
    "scheduler_config.prefill_schedule_interval": Inert(SCHEDULING),
    "scheduler_config.async_scheduling": Tested(
        (None, False, True), "every engine test in step; asynchronously on the V2 runner (test_vllm_v2_runner.py)"
    ),
    "scheduler_config.stream_interval": Inert("how often outputs are streamed"),
    # device_config, load_config, offload_config
    "device_config": Derived("the platform"),
    "load_config.load_format": AtDefault("it would load other weights than the checkpoint's: start without it"),
    "load_config.download_dir": Inert("where the checkpoint is cached"),
    "load_config.safetensors_load_strategy": Inert("how weights are read"),
    "load_config.safetensors_prefetch_num_threads": Inert("how weights are read"),
    "load_config.safetensors_prefetch_block_size": Inert("how weights are read"),
    "load_config.model_loader_extra_config": AtDefault(),
    "load_config.device": AtDefault(),
    "load_config.ignore_patterns": AtDefault(),
    "load_config.use_tqdm_on_load": Inert("a progress bar"),
    "load_config.pt_load_map_location": Inert("where .pt weights are staged"),
    "offload_config": AtDefault(OFFLOAD),
    # attention, kernels, layers Dual-Flow does not have
    "attention_config.sparse_mla_prefill_workspace_factor": Derived("the platform (read by sparse MLA only)"),
    "attention_config": AtDefault("the model runs the attention backend vLLM picks: start without it"),
    "aux_output_config.enable_return_routed_experts": AtDefault(
        "vLLM's routed-experts capturer asserts on the step's token count, which the aux flow's MoE calls exceed: "
        "start without enable_return_routed_experts"
    ),
    "aux_output_config.max_bytes": Inert("read by routed-experts capture only, which is refused"),
    "engram_config": AtDefault("Dual-Flow has no engram layers: start without it"),
    "mamba_config": AtDefault("Dual-Flow has no mamba layers: start without it"),
    "kernel_config.ir_op_priority": Derived("the platform's kernels"),
    "kernel_config.enable_flashinfer_autotune": Derived("the platform"),
    "kernel_config.enable_rocm_segmented_attn_autotune": AtDefault(),
    "kernel_config.enable_cutedsl_warmup": Inert("kernel warm-up at startup"),
    "kernel_config.enable_jit_warmup": Inert("kernel warm-up at startup"),
    "kernel_config.moe_backend": AtDefault(),
    "kernel_config.sparse_indexer_topk_backend": AtDefault(),
    "kernel_config.linear_backend": AtDefault(),
    "kernel_config.linear_backend_per_quant": AtDefault(),
    "lora_config": AtDefault(),
    # speculative_config: n-gram only (test_vllm_aux_top_k.py)
    "speculative_config.method": Tested(
        ("ngram",),
        "test_vllm_aux_top_k.py",
        "only n-gram speculation has run with this model: use method='ngram'",
    ),
    "speculative_config.num_speculative_tokens": Tested(ANY, "test_vllm_aux_top_k.py"),
    "speculative_config.prompt_lookup_max": Tested(ANY, "test_vllm_aux_top_k.py"),
    "speculative_config.prompt_lookup_min": Tested(ANY, "test_vllm_aux_top_k.py"),
    "speculative_config.model": Derived("method (n-gram drafts from the prompt)"),
    "speculative_config.max_model_len": Derived("max_model_len"),
    "speculative_config.draft_tensor_parallel_size": Derived("tensor_parallel_size (n-gram has no draft model)"),
    "speculative_config.target_model_config": Derived("model_config"),
    "speculative_config.target_parallel_config": Derived("parallel_config"),
    "speculative_config.draft_model_config": Derived("model_config (n-gram drafts from the prompt)"),
    "speculative_config.draft_parallel_config": Derived("parallel_config (n-gram drafts from the prompt)"),
    "speculative_config": AtDefault("only n-gram speculation has run with this model: use method='ngram'"),
    "watermark_config": AtDefault(),
    "diffusion_config": AtDefault(),
    "structured_outputs_config": Inert("masks the logits after the model"),
    "observability_config": Inert("metrics and traces"),
    "logging_config": Inert("logging"),
    "profiler_config": Inert("profiling"),
    "quant_config": Derived("model_config.quantization and the checkpoint's quantization_config"),
    # compilation_config
    "compilation_config.mode": Tested(
        (None, CompilationMode.NONE, CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.VLLM_COMPILE),
        "test_vllm_compile.py, test_vllm_cudagraph_dispatch.py",
    ),
    "compilation_config.backend": Tested(("", "eager", "inductor"), "every engine test, test_vllm_compile.py"),
    "compilation_config.debug_dump_path": Inert("debug output"),
    "compilation_config.cache_dir": Inert("where compiled code is cached"),
    "compilation_config.local_cache_dir": Derived("cache_dir"),
    "compilation_config.compile_cache_save_format": Inert("how compiled code is cached"),
    "compilation_config.custom_ops": Derived("mode, backend and the platform"),
    "compilation_config.ir_enable_torch_wrap": Derived("mode and the platform"),
    "compilation_config.splitting_ops": Derived("mode: vLLM's attention ops"),
    "compilation_config.compile_mm_encoder": AtDefault(NOT_MULTIMODAL),
    "compilation_config.cudagraph_mm_encoder": AtDefault(NOT_MULTIMODAL),
    "compilation_config.encoder_cudagraph_token_budgets": AtDefault(NOT_MULTIMODAL),
    "compilation_config.encoder_cudagraph_max_vision_items_per_batch": AtDefault(NOT_MULTIMODAL),
    "compilation_config.encoder_cudagraph_max_frames_per_batch": AtDefault(NOT_MULTIMODAL),
    "compilation_config.cudagraph_decoder_replay": AtDefault(),
    "compilation_config.decoder_replay_cudagraph_capture_sizes": AtDefault(),
    "compilation_config.decoder_replay_trim_threshold": AtDefault(),
    "compilation_config.compile_sizes": Tested(
        (None, []), "vLLM's default, resolved to [] under VLLM_COMPILE (test_vllm_cudagraph_dispatch.py)"
    ),
    "compilation_config.compile_ranges_endpoints": Derived("max_num_batched_tokens and the passes"),
    "compilation_config.inductor_compile_config": Derived("mode and the platform"),
    "compilation_config.inductor_passes": AtDefault(),
    "compilation_config.cudagraph_mode": Tested(
        (
            None,
            CUDAGraphMode.NONE,
            CUDAGraphMode.PIECEWISE,
            CUDAGraphMode.FULL_AND_PIECEWISE,
            CUDAGraphMode.FULL_DECODE_ONLY,
        ),
        "test_vllm_cudagraph_dispatch.py, test_vllm_gpu_runner.py (simulated; the CPU build runs full graphs piecewise)",
    ),
    "compilation_config.cudagraph_num_of_warmups": Inert("warm-up runs before capture"),
    "compilation_config.cudagraph_capture_sizes": Tested(ANY, "test_vllm_cudagraph_dispatch.py (simulated)"),
    "compilation_config.max_cudagraph_capture_size": Derived("cudagraph_capture_sizes and max_num_seqs"),
    "compilation_config.cudagraph_copy_inputs": AtDefault(),
    "compilation_config.cudagraph_specialize_lora": Inert("read with LoRA only, which is refused"),
    "compilation_config.use_inductor_graph_partition": Derived("mode and the platform"),
    "compilation_config.pass_config.fuse_allreduce_rms": Tested((None, False), "turned off by this package's hook"),
    "compilation_config.pass_config.fuse_rope_kvcache": Tested((None, False), "turned off by this package's hook"),
    "compilation_config.pass_config.fuse_qk_norm_rope_kvcache": Tested(
        (None, False), "turned off by this package's hook"
    ),
    # The other passes rewrite per-row ops (never sized by the token count) or act on quantised layers only.
    "compilation_config.pass_config": Derived("optimization_level, filled by vLLM after this check"),
    "compilation_config.dynamic_shapes_config": AtDefault(),
    "compilation_config.fast_moe_cold_start": Derived("mode and the platform"),
    "compilation_config.enabled_custom_ops": Derived("the model's layers (bookkeeping)"),
    "compilation_config.disabled_custom_ops": Derived("the model's layers (bookkeeping)"),
    "compilation_config.traced_files": Derived("compilation (bookkeeping)"),
    "compilation_config.compilation_time": Derived("compilation (bookkeeping)"),
    "compilation_config.encoder_compilation_time": Derived("compilation (bookkeeping)"),
    "compilation_config.static_forward_context": Derived("the model's layers (bookkeeping)"),
    "compilation_config.static_all_moe_layers": Derived("the model's layers (bookkeeping)"),
    # kv_transfer_config: the ExampleConnector and the NixlConnector only (kv_transfer.py refuses the other connectors
    # by name first, and the NixlConnector's untested roles)
    "kv_transfer_config.kv_connector": Tested(
        ANY, "test_vllm_kv_transfer.py (the ExampleConnector, the NixlConnector)"
    ),
    "kv_transfer_config.kv_connector_module_path": Derived("this package's hook (kv_transfer.py)"),
    "kv_transfer_config.kv_role": Tested(("kv_producer", "kv_consumer", "kv_both"), "test_vllm_kv_transfer.py"),
    "kv_transfer_config.kv_connector_extra_config": Tested(
        ANY, "test_vllm_kv_transfer.py (shared_storage_path; the NixlConnector's producer_model)"
    ),
    "kv_transfer_config.kv_load_failure_policy": Tested(("fail", "recompute"), "test_vllm_kv_transfer.py"),
    "kv_transfer_config.engine_id": Derived("a random id"),
    "kv_transfer_config.kv_buffer_device": Derived("the platform"),
    "kv_transfer_config.kv_port": Inert("a port"),
    "kv_transfer_config.enable_permute_local_kv": AtDefault(),
    "kv_events_config": Inert("publishes KV cache events"),
    "ec_transfer_config": AtDefault(NOT_MULTIMODAL),
    "ec_manager_config": AtDefault(NOT_MULTIMODAL),
    "reasoning_config": Inert("parses the generated text"),
    "additional_config": AtDefault(),
    "instance_id": Inert("a name for profiles"),
    "optimization_level": AtDefault(),
    "performance_mode": AtDefault(),
    "weight_transfer_config": AtDefault(
        "weight updates while serving have never run with this model: start without weight_transfer_config"
    ),
    "shutdown_timeout": Inert("a timeout"),
}


# Fields vLLM 0.34.0 added (classified on its configuration; scripts/vllm_034_on_cpu.sh runs it): absent from 0.32 and
# 0.33, so the test that every entry names an existing field leaves them out there.
FIELDS_ADDED_IN_VLLM_0_34 = {
    "model_config.checkpoint_prepare_on_startup": AtDefault(
        "process checkpoints (sleep mode) have never run with this model"
    ),
    "cache_config.simple_cpu_offload_num_blocks": Derived("the SimpleCPUOffloadConnector, which is refused"),
    "cache_config.enable_extensible_kv_cache": Inert("how the KV cache's memory is reserved (on by default on GPUs)"),
    "cache_config._extensible_kv_cache_resolved": Derived("enable_extensible_kv_cache (bookkeeping)"),
    "parallel_config.mori_ep_v2": Derived("the mori all-to-all backend (expert parallelism is refused)"),
    "parallel_config._numa_bind_auto": Inert("NUMA placement of the worker processes"),
    "scheduler_config.max_num_inflight_kv_loads": Inert(SCHEDULING),
    "scheduler_config.cache_aware_admission_window": Inert(SCHEDULING),
    "scheduler_config.cache_aware_admission_threshold": Inert(SCHEDULING),
    "load_config.shuffle_safetensors_files": Inert("the order the weight files are read in"),
    "kernel_config.enable_rocm_aiter_gemm_warmup": Inert("kernel warm-up at startup"),
    "kernel_config.monokernel": AtDefault(),
    "kernel_config.rdna_hybrid_w4a16_prefill_dequant": AtDefault(),
    "num_hash_lookahead_tokens": Derived("vLLM's prefix-cache hashing"),
    "compilation_config.encoder_cudagraph_max_token_budget": Inert("encoder graphs: the model has no encoder"),
    "compilation_config.use_breakable_cudagraph": Tested(
        (None, False), "vLLM's resolution for this model (it turns it on for a list of its own architectures)"
    ),
    "compilation_config.prefill_cudagraph_capture_token_sizes": Derived("cudagraph_capture_sizes and the platform"),
    "compilation_config.max_prefill_cudagraph_capture_tokens": Derived("cudagraph_capture_sizes and the platform"),
    "compilation_config.decode_cudagraph_capture_request_sizes": Derived("cudagraph_capture_sizes and max_num_seqs"),
    "compilation_config.max_decode_cudagraph_capture_requests": Derived("cudagraph_capture_sizes and max_num_seqs"),
    "compilation_config.max_decode_cudagraph_capture_tokens": Derived("cudagraph_capture_sizes and the platform"),
    "watchdog_config": Inert("a watchdog of the engine's steps"),
}
ENGINE_FIELDS.update(FIELDS_ADDED_IN_VLLM_0_34)


def classification(path: str):
    """The entry for a dotted path: its own, else its nearest classified sub-config's, else None (unclassified)."""
    while path:
        if path in ENGINE_FIELDS:
            return ENGINE_FIELDS[path]
        path = path.rpartition(".")[0]
    return None


def field_default(field: dataclasses.Field):
    """vLLM's default for a config field (pydantic's `Field(...)` included); `dataclasses.MISSING` when required."""
    default = field.default
    if isinstance(default, FieldInfo):
        if default.default_factory is not None:
            return default.default_factory()
        return dataclasses.MISSING if default.default is PydanticUndefined else default.default
    if default is not dataclasses.MISSING:
        return default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def may_be_set(path: str) -> bool:
    """Whether a sub-config vLLM leaves unset by default may be set: some field of it has tested values."""
    return any(isinstance(rule, Tested) and name.startswith(path + ".") for name, rule in ENGINE_FIELDS.items())


def refusal(config, prefix: str = "") -> str | None:
    """One line refusing the first field of `config` (a vLLM config dataclass) this table does not accept, or None."""
    for field in dataclasses.fields(config):
        path = prefix + field.name
        rule = classification(path)
        value = getattr(config, field.name)
        if isinstance(rule, (Inert, Derived)):
            continue
        if isinstance(rule, Tested):
            if rule.values is None or value in rule.values:
                continue
            accepted = ", ".join(repr(v) for v in rule.values)
            advice = rule.advice or f"use one of {accepted}, the values run with this model ({rule.where})"
            return f"Dual-Flow in vLLM does not serve {path}={value!r}: {advice}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if field_default(field) is None and not may_be_set(path):
                advice = rule.advice if rule else UNCLASSIFIED
                return f"Dual-Flow in vLLM does not serve {path} (set; vLLM's default: None): {advice}"
            refused = refusal(value, path + ".")
            if refused:
                return refused
            continue
        default = field_default(field)
        if default is dataclasses.MISSING or value == default:
            continue
        advice = rule.advice if rule else UNCLASSIFIED
        return f"Dual-Flow in vLLM does not serve {path}={value!r} (vLLM's default: {default!r}): {advice}"
    return None
