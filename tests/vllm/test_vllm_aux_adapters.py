"""Aux adapters (`aux_adapter_rank`, issue 14) with `aux_num_rounds` = 2: the q, o and MLP-output deltas act on the
aux rows in every round, so greedy tokens and logprobs equal transformers'; a primary-only engine builds none of them."""

import pytest
import torch
from vllm_reference import (
    ADAPTER_RANK,
    AUX_ADAPTERS,
    PREFIX_CACHING_AND_CHUNKED_PREFILL,
    assert_matches_transformers,
    aux_parameter_names,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)


MAX_NEW = 8
PROMPTS = random_prompts([5, 27, 53], seed=5)  # 53 > the 48-token budget: prefilled in chunks


@pytest.fixture(scope="module")
def reference(adapter_checkpoint):
    return load_reference(adapter_checkpoint)


def test_aux_adapters_match_transformers(engines, adapter_checkpoint, reference):
    assert (reference.config.aux_adapter_rank, reference.config.aux_num_rounds) == (ADAPTER_RANK, 2)
    outputs = served_greedy(engines.get(adapter_checkpoint, **PREFIX_CACHING_AND_CHUNKED_PREFILL), PROMPTS, MAX_NEW)
    assert_matches_transformers(outputs, PROMPTS, reference, MAX_NEW)
    # Each kind of adapter matters: without it, transformers' output is outside the tolerance of the served one.
    for name in AUX_ADAPTERS:
        ablated = load_reference(adapter_checkpoint)
        with torch.no_grad():
            for layer in ablated.model.layers:
                layer.get_submodule(name).up.zero_()
        with pytest.raises(AssertionError):
            assert_matches_transformers(outputs, PROMPTS, ablated, MAX_NEW)


def test_primary_only_engine_skips_the_aux_weights(engines, adapter_checkpoint, reference):
    # Neither adapters, couplings nor round gates (of this two-round checkpoint) are built: their weights in the
    # checkpoint must not stop the engine loading. (test_vllm_primary_only.py serves more from this engine.)
    engine = engines.get(adapter_checkpoint, hf_overrides={"use_aux_flow": False})
    assert engine.apply_model(aux_parameter_names) == [[]]
    outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert_matches_transformers(outputs, PROMPTS, reference, MAX_NEW, use_aux_flow=False)


def test_another_adapter_rank_is_refused(adapter_checkpoint, checkpoint):
    # The adapters are weights of the checkpoint: an override can neither drop them nor add them.
    for folder, override, stored in [(adapter_checkpoint, 0, ADAPTER_RANK), (checkpoint, ADAPTER_RANK, 0)]:
        message = rf"aux_adapter_rank={override} does not match this checkpoint's aux adapters \(rank {stored}\)"
        with (
            pytest.raises(ValueError, match=message),
            running_engine(folder, hf_overrides={"aux_adapter_rank": override}),
        ):
            pass
