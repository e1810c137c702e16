"""
Serving Dual-Flow checkpoints with vLLM. `register()` is vLLM's plugin hook (entry point group
`vllm.general_plugins`): vLLM calls it in each of its processes, so `vllm.LLM(model=DIR)` and `vllm serve DIR` load a
checkpoint written by `dualflow convert` or `save_pretrained` without extra flags. Nothing here imports vLLM until
vLLM calls it.
"""

ARCHITECTURE = "DualFlowForCausalLM"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import modeling_dualflow  # noqa: F401  (registers DualFlowConfig with transformers' AutoConfig)

    from .engine_config import DualFlowEngineConfig
    from .vllm_internals import refuse_prompt_logprobs_with_fast_prefill

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "dualflow.serving.model:DualFlowForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = DualFlowEngineConfig
    refuse_prompt_logprobs_with_fast_prefill()
