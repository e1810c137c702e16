"""What the Dual-Flow vLLM model needs from the engine configuration, and what it refuses."""

from transformers import PreTrainedConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig


def checkpoint_field(vllm_config, name: str, default):
    """A field of the checkpoint's own config.json, before `hf_overrides`."""
    model_config = vllm_config.model_config
    config_dict, _ = PreTrainedConfig.get_config_dict(model_config.model, revision=model_config.revision)
    return config_dict.get(name, default)


def check_supported(config, vllm_config) -> None:
    """One-line errors for checkpoints and engine settings this model class does not serve."""
    if config.hidden_act != "silu":
        raise ValueError(f"Dual-Flow in vLLM supports hidden_act='silu' only, got {config.hidden_act!r}")
    if config.qk_norm == "full" and vllm_config.parallel_config.tensor_parallel_size > 1:
        raise ValueError(
            "Dual-Flow in vLLM: qk_norm='full' (OLMoE) needs the whole projection, use tensor_parallel_size=1"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("Dual-Flow in vLLM does not support pipeline parallelism")
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
    if config.num_experts and not 1 <= config.aux_num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"aux_num_experts_per_tok must be in [1, num_experts={config.num_experts}], "
            f"got {config.aux_num_experts_per_tok}"
        )


class DualFlowEngineConfig(VerifyAndUpdateConfig):
    """
    vLLM calls this while it builds the engine configuration (in the calling process, after `hf_overrides`): refuse
    what the model cannot serve before any engine process starts, and turn on vLLM's KV-sharing fast prefill when the
    aux flow runs. The aux attention layers (KV-sharing layers built after all primary ones) then get attention
    metadata for the sampled rows only, so prefill costs the base model plus one aux row per request.
    """

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        config = vllm_config.model_config.hf_config
        check_supported(config, vllm_config)
        if config.use_aux_flow:
            vllm_config.cache_config.kv_sharing_fast_prefill = True
