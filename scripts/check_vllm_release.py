"""
What can be checked of a vLLM release without running it: run in a venv holding that vLLM and this package
(`pip install --no-deps .`), on any machine. With a GPU build on a machine without a GPU, select vLLM's CPU platform
(`VLLM_TARGET_DEVICE=cpu`) so that the engine configuration and the model can be built.

    VLLM_TARGET_DEVICE=cpu python scripts/check_vllm_release.py

Checks, in order: the plugin registers through its entry point; the vLLM internals the served model calls exist with
the op schemas it passes; the engine configuration of a tiny converted checkpoint builds through this package's
checks (and refuses a bad aux top-k); the served model builds and loads every weight of that checkpoint.
"""

import tempfile
from pathlib import Path

import torch
import vllm
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention import attention as attention_layer  # noqa: F401  (registers the ops)
from vllm.plugins import load_general_plugins

from dualflow.convert import convert_checkpoint
from dualflow.serving import ARCHITECTURE


EXPECTED_OP_ARGUMENTS = {
    "unified_kv_cache_update": ["key", "value", "layer_name"],
    "unified_attention_with_output": ["query", "key", "value", "output", "layer_name", "kv_cache_dummy_dep"],
}


def check(label: str, condition: bool) -> None:
    print(f"{'ok  ' if condition else 'FAIL'} {label}")
    if not condition:
        raise SystemExit(1)


def tiny_checkpoint(root: Path) -> Path:
    source = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    Qwen3MoeForCausalLM(source).save_pretrained(root / "source")
    convert_checkpoint(root / "source", root / "dualflow", aux_top_k=4, show_progress=False)
    return root / "dualflow"


def main() -> None:
    print(f"vllm {vllm.__version__}, torch {torch.__version__}")
    load_general_plugins()
    check("the plugin registers the model", ARCHITECTURE in vllm.ModelRegistry.get_supported_archs())

    from dualflow.serving.vllm_internals import check_vllm_version

    check_vllm_version()
    from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata

    fields = KVSharingFastPrefillMetadata.__annotations__
    check("fast prefill metadata fields", {"logits_indices_padded", "num_logits_indices"} <= set(fields))
    for op, expected in EXPECTED_OP_ARGUMENTS.items():
        arguments = [argument.name for argument in getattr(torch.ops.vllm, op).default._schema.arguments]
        check(f"torch.ops.vllm.{op} takes {expected}", set(expected) <= set(arguments))

    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_checkpoint(Path(tmp))
        engine_args = dict(model=str(folder), dtype="float32", max_model_len=256)
        config = EngineArgs(**engine_args).create_engine_config()
        check("engine configuration builds with fast prefill", config.cache_config.kv_sharing_fast_prefill)
        try:
            EngineArgs(**engine_args, hf_overrides={"aux_num_experts_per_tok": 9}).create_engine_config()
            refused = False
        except ValueError as error:
            refused = "aux_num_experts_per_tok" in str(error)
        check("a bad aux top-k is refused", refused)

        init_distributed_environment(1, 0, "tcp://127.0.0.1:29561", 0, backend="gloo")
        with set_current_vllm_config(config):
            initialize_model_parallel(1, 1)
            from dualflow.serving.model import DualFlowForCausalLM

            model = DualFlowForCausalLM(vllm_config=config)
            loaded = model.load_weights(iter(load_file(folder / "model.safetensors").items()))
            check("the served model loads every weight", {name for name, _ in model.named_parameters()} <= set(loaded))


if __name__ == "__main__":
    main()
