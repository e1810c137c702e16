"""What the Dual-Flow vLLM model needs from the engine configuration, and what it refuses."""

from transformers import PreTrainedConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from .engine_allowlist import HF_OVERRIDES_TESTED, QUANTISED, refusal
from .kv_transfer import (
    NOT_WITH_TENSOR_PARALLELISM,
    PREFIX,
    use_connector_without_kv_sharing_layers,
    uses_kv_connector,
)
from .vllm_internals import check_vllm_version, runs_model_runner_v2


def checkpoint_field(vllm_config, name: str, default):
    """A field of the checkpoint's own config.json, before `hf_overrides`."""
    model_config = vllm_config.model_config
    config_dict, _ = PreTrainedConfig.get_config_dict(model_config.model, revision=model_config.revision)
    return config_dict.get(name, default)


def check_attention_head_size(head_dim: int) -> None:
    """vLLM picks its CPU attention kernels without checking the head size: the first request would kill the engine."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    # Imported once the platform is known: the backend module loads vLLM's kernels for the detected instruction set.
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if not CPUAttentionBackend.supports_head_size(head_dim):
        supported = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
        raise ValueError(
            f"vLLM's CPU attention cannot run head_dim={head_dim} (supported: {supported}); serve this checkpoint on a GPU"
        )


# The one quantisation served (test_vllm_quantised): a checkpoint written by `dualflow quantize`.
SERVED_QUANTISATION = "compressed-tensors"


def check_quantisation(vllm_config) -> None:
    """Admit an unquantised checkpoint, or compressed-tensors exactly as `dualflow quantize` writes it."""
    method = vllm_config.model_config.quantization
    if method is None:
        return
    refused = "Dual-Flow in vLLM does not serve"
    if method != SERVED_QUANTISATION:
        raise ValueError(f"{refused} model_config.quantization={method!r}: {QUANTISED}")
    from dualflow.quantize import unserved_field

    # As in config.json: vLLM adds fields of its own to the config it holds
    unserved = unserved_field(checkpoint_field(vllm_config, "quantization_config", None))
    if unserved is not None:
        field, value = unserved
        raise ValueError(f"{refused} {field}={value!r} (the checkpoint's): {QUANTISED}")


# Compilation passes that vLLM switches on per compile range of the step's token count T (a range ending under the
# fused kernel's size limit), while the every-row piece of the aux flow carries 2T rows (the aux rows stacked under the
# primary ones): the fused kernel would get up to twice the rows it was chosen for. vLLM fills the ones left unset
# (None) from its optimisation level after the model's config hook, so the hook's False turns them off.
TOKEN_SIZED_PASSES = ("fuse_allreduce_rms", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")


def check_supported(config, vllm_config) -> None:
    """One-line errors for checkpoints and engine settings this model class does not serve."""
    check_vllm_version()
    if config.hidden_act != "silu":
        raise ValueError(f"Dual-Flow in vLLM supports hidden_act='silu' only, got {config.hidden_act!r}")
    if config.qk_norm == "full" and vllm_config.parallel_config.tensor_parallel_size > 1:
        raise ValueError(
            "Dual-Flow in vLLM: qk_norm='full' (OLMoE) needs the whole projection, use tensor_parallel_size=1"
        )
    check_attention_head_size(config.head_dim)
    parallel = vllm_config.parallel_config
    # Modes the model does not implement: refused here, in one line, rather than failing inside an engine process.
    if parallel.pipeline_parallel_size > 1:
        raise ValueError("Dual-Flow in vLLM does not support pipeline parallelism")
    if parallel.enable_dbo or parallel.ubatch_size > 1:
        raise ValueError("Dual-Flow in vLLM does not run dual-batch overlap (micro-batches): start without enable_dbo")
    if parallel.enable_eplb:
        raise ValueError(
            "Dual-Flow in vLLM does not support the expert-parallel load balancer: start without enable_eplb"
        )
    # vLLM dispatches each MoE call across data-parallel ranks with sizes taken from the step's token count, which the
    # aux rows exceed (vLLM asserts on it), and all-to-all backends need the same number of MoE calls on every rank.
    if parallel.data_parallel_size > 1:
        raise ValueError(
            f"Dual-Flow in vLLM does not support data parallelism (data_parallel_size={parallel.data_parallel_size}): "
            "the aux rows make MoE calls longer than the token counts vLLM dispatches by; use tensor_parallel_size"
        )
    # Without data parallelism, expert parallelism splits the experts over the tensor-parallel ranks: never run here.
    if parallel.enable_expert_parallel:
        raise ValueError(
            "Dual-Flow in vLLM has not been verified with expert parallelism (enable_expert_parallel, "
            f"all2all_backend={parallel.all2all_backend!r}): start without enable_expert_parallel"
        )
    if parallel.prefill_context_parallel_size > 1 or parallel.decode_context_parallel_size > 1:
        raise ValueError(
            "Dual-Flow in vLLM has not been verified with context parallelism: start with "
            "prefill_context_parallel_size=1 and decode_context_parallel_size=1"
        )
    cudagraph_mode = vllm_config.compilation_config.cudagraph_mode
    if config.use_aux_flow and cudagraph_mode is not None and cudagraph_mode.mixed_mode() == cudagraph_mode.FULL:
        # A full graph would freeze the per-step choice of pieces and the sampled-row count of the step it was
        # captured in; piecewise graphs (the GPU default for such steps) leave both outside the graphs.
        raise ValueError(
            f"Dual-Flow in vLLM with the aux flow cannot run steps that mix prefill and decode in full CUDA graphs "
            f"(cudagraph_mode={cudagraph_mode.name}): use FULL_AND_PIECEWISE, FULL_DECODE_ONLY or PIECEWISE"
        )
    if config.use_aux_flow:
        pass_config = vllm_config.compilation_config.pass_config
        for name in TOKEN_SIZED_PASSES:
            if getattr(pass_config, name):
                raise ValueError(
                    f"Dual-Flow in vLLM with the aux flow cannot run the compilation pass {name} (it sizes by the "
                    "step's token count, the aux rows add more): start without it in compilation_config.pass_config"
                )
    # The aux attention layers would read pages quantised with the primary layers' scales using their own (1.0).
    if vllm_config.cache_config.cache_dtype != "auto":
        raise ValueError(
            "Dual-Flow in vLLM does not serve a quantised KV cache (kv_cache_dtype="
            f"{vllm_config.cache_config.cache_dtype!r}; the aux attention layers do not share the primary layers' "
            "KV scales): start with kv_cache_dtype='auto'"
        )
    # vLLM's KV connectors save and load KV for every attention layer, the aux ones included, which own none: the
    # tested ones run as subclasses that skip them (kv_transfer.py), the others are refused.
    if uses_kv_connector(vllm_config):
        use_connector_without_kv_sharing_layers(vllm_config.kv_transfer_config)
        if parallel.tensor_parallel_size > 1:
            name = vllm_config.kv_transfer_config.kv_connector.removeprefix(PREFIX)
            raise ValueError(
                f"Dual-Flow in vLLM does not run the {name} with tensor_parallel_size="
                f"{parallel.tensor_parallel_size} ({NOT_WITH_TENSOR_PARALLELISM[name]}): use tensor_parallel_size=1"
            )
    check_quantisation(vllm_config)
    if vllm_config.lora_config is not None:
        raise ValueError("Dual-Flow in vLLM does not serve LoRA adapters: start without enable_lora")
    if config.use_aux_flow and vllm_config.model_config.enable_prompt_embeds:
        raise ValueError(
            "Dual-Flow in vLLM: the aux flow embeds token ids with its own table, so prompt embeddings "
            "(enable_prompt_embeds) need use_aux_flow=False"
        )
    # A round count above the checkpoint's (hf_overrides) would run gates the checkpoint does not have.
    if config.aux_num_rounds > 1 and checkpoint_field(vllm_config, "aux_num_rounds", 1) == 1:
        raise ValueError(
            f"aux_num_rounds={config.aux_num_rounds} needs round gates: this checkpoint has none "
            "(convert with `dualflow convert --aux-rounds`)"
        )
    # The aux adapters are weights of the checkpoint: another rank (hf_overrides) would find none, or drop them.
    checkpoint_rank = checkpoint_field(vllm_config, "aux_adapter_rank", 0)
    if config.aux_adapter_rank != checkpoint_rank:
        raise ValueError(
            f"aux_adapter_rank={config.aux_adapter_rank} does not match this checkpoint's aux adapters "
            f"(rank {checkpoint_rank}); the rank is set at conversion (`dualflow convert --aux-adapter-rank`)"
        )
    config.check_aux_settings(config.aux_num_experts_per_tok, config.aux_num_rounds)
    hf_overrides = vllm_config.model_config.hf_overrides
    if callable(hf_overrides) or not set(hf_overrides) <= HF_OVERRIDES_TESTED:
        overridden = (
            "a function" if callable(hf_overrides) else ", ".join(sorted(set(hf_overrides) - HF_OVERRIDES_TESTED))
        )
        raise ValueError(
            f"Dual-Flow in vLLM does not serve hf_overrides of {overridden}: the overrides run with this model are "
            f"{', '.join(sorted(HF_OVERRIDES_TESTED))}; change other fields by converting the checkpoint"
        )
    # GPU engines schedule asynchronously by default (vLLM resolves None to True after this hook); it has run with this
    # model on vLLM's model runner V2, the GPU default, only.
    if vllm_config.scheduler_config.async_scheduling and not runs_model_runner_v2(vllm_config):
        raise ValueError(
            "Dual-Flow in vLLM schedules asynchronously on vLLM's model runner V2 only (tested there): start with "
            "--no-async-scheduling (async_scheduling=False) or on V2"
        )
    # On V2 the requests whose refused KV was recomputed did not give transformers' tokens (test_vllm_v2_runner.py).
    kv_transfer = vllm_config.kv_transfer_config
    if (
        kv_transfer is not None
        and kv_transfer.kv_load_failure_policy == "recompute"
        and runs_model_runner_v2(vllm_config)
    ):
        raise ValueError(
            "Dual-Flow in vLLM recomputes a refused KV load on the V1 runner only (on V2 the recomputed requests did "
            "not give transformers' tokens): start with kv_load_failure_policy='fail'"
        )
    # Everything else in the engine configuration: vLLM's default, a tested value, inert or derived (fail closed).
    refused = refusal(vllm_config)
    if refused:
        raise ValueError(refused)


# Engine option (`hf_overrides`, not a checkpoint field): run the aux flow at every scheduled token, not only at the
# rows vLLM samples from, so that prompt logprobs are the aux flow's predictions (transformers' forward logits), as
# loglikelihood evaluation (`lm_eval --model vllm`) needs. Prefill then costs about twice the base model's.
AUX_AT_EVERY_PROMPT_POSITION = "aux_at_every_prompt_position"


class DualFlowEngineConfig(VerifyAndUpdateConfig):
    """
    vLLM calls this while it builds the engine configuration (in the calling process, after `hf_overrides`): refuse
    what the model cannot serve before any engine process starts, and turn on vLLM's KV-sharing fast prefill when the
    aux flow runs. The aux attention layers (KV-sharing layers built after all primary ones) then get attention
    metadata for the sampled rows only, so prefill costs the base model plus one aux row per request. With
    `aux_at_every_prompt_position` fast prefill stays off: the aux layers get every row's metadata, and the model
    runs the aux flow at every row.
    """

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        config = vllm_config.model_config.hf_config
        check_supported(config, vllm_config)
        if not config.use_aux_flow:
            return
        for name in TOKEN_SIZED_PASSES:
            setattr(vllm_config.compilation_config.pass_config, name, False)
        if not getattr(config, AUX_AT_EVERY_PROMPT_POSITION, False):
            vllm_config.cache_config.kv_sharing_fast_prefill = True
