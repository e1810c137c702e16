"""Prefill on the base model, decode with Dual-Flow (docs/serving.md): vLLM's native Qwen3-MoE engine writes the
prompts' KV through the ExampleConnector, a Dual-Flow engine reads it and decodes the Dual-Flow engine's tokens. The
aux attention layers (KV-sharing, no pages of their own) are neither saved nor loaded."""

import pytest
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm_reference import assert_matches_transformers, load_reference, random_prompts, running_engine, served_greedy


# Not multiples of the block size (32): the connector injects the whole blocks, the engine computes the rest. The
# base model prefills the first prompts, a Dual-Flow engine (aux flow on: its aux layers run and must save nothing) the
# others.
BASE_PROMPTS = random_prompts([40, 71, 33], seed=5)
DUAL_FLOW_PROMPTS = random_prompts([45, 38], seed=6)
MAX_NEW_TOKENS = 8


def connector(role: str, storage) -> dict:
    config = {"kv_connector": "ExampleConnector", "kv_role": role}
    return {"kv_transfer_config": {**config, "kv_connector_extra_config": {"shared_storage_path": str(storage)}}}


def prefill(model, prompts, storage, **engine_args) -> None:
    # The ExampleConnector stores what a request's first step computes: the producer prefills each prompt in one step.
    whole_prompts = dict(max_num_batched_tokens=sum(map(len, prompts)))
    with running_engine(model, **whole_prompts, **engine_args, **connector("kv_producer", storage)) as producer:
        served_greedy(producer, prompts, max_new_tokens=1)


def test_base_model_prefill_then_dual_flow_decode(checkpoint, engines, tmp_path):
    engines.close()  # one CPU engine at a time (conftest.py)
    storage = tmp_path / "kv"
    prefill(checkpoint.parent / "source", BASE_PROMPTS, storage, tokenizer=str(checkpoint))
    prefill(checkpoint, DUAL_FLOW_PROMPTS, storage)
    saved = [path.name for path in storage.rglob("*.safetensors")]
    assert len(saved) == 2 * len(BASE_PROMPTS + DUAL_FLOW_PROMPTS) and not any("aux" in name for name in saved)

    prompts, reference = BASE_PROMPTS + DUAL_FLOW_PROMPTS, load_reference(checkpoint)
    # prefix caching off: each run loads the prompts' KV from the connector, not from the engine's own cache
    with running_engine(checkpoint, enable_prefix_caching=False, **connector("kv_consumer", storage)) as consumer:
        # the engine configuration swapped in the subclass that skips the aux (KV-sharing) layers
        assert type(get_kv_transfer_group()).__name__ == "DualFlowExampleConnector"
        outputs = served_greedy(consumer, prompts, MAX_NEW_TOKENS)
        assert_matches_transformers(outputs, prompts, reference, MAX_NEW_TOKENS)
        # the tokens come from the loaded KV: with the primary layer 0's keys and values scaled, they change
        for path in storage.rglob("*layers.0.self_attn.attn.safetensors"):
            save_file({"kv_cache": 3.0 * load_file(path)["kv_cache"]}, path)
        changed = served_greedy(consumer, prompts, MAX_NEW_TOKENS)
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    assert tokens != [list(output.outputs[0].token_ids) for output in changed]


@pytest.mark.parametrize("name", ["NixlConnector", "LMCacheConnectorV1", "OffloadingConnector"])
def test_untested_connectors_are_refused_in_one_line(name):
    from vllm.config.kv_transfer import KVTransferConfig

    from dualflow.serving.kv_transfer import use_connector_without_kv_sharing_layers

    with pytest.raises(ValueError, match=rf"runs the KV connector ExampleConnector only \(tested\), not '{name}'") as e:
        use_connector_without_kv_sharing_layers(KVTransferConfig(kv_connector=name, kv_role="kv_both"))
    assert "\n" not in str(e.value)
