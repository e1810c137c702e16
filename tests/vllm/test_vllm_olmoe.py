"""An OLMoE-converted checkpoint in vLLM: q/k normalised over the whole projection, then clipped (OLMoE's clip_qkv),
in transformers' order."""

import pytest
from vllm_reference import (
    CLIP_QKV,
    assert_matches_transformers,
    build_checkpoint,
    hf_greedy,
    load_reference,
    random_prompts,
    running_engine,
    served_greedy,
)

from modeling_dualflow import DualFlowForCausalLM


MAX_NEW = 6
PROMPTS = random_prompts([5, 30], seed=3)


@pytest.fixture(scope="module")
def olmoe_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("vllm-olmoe"), family="olmoe")


def test_olmoe_checkpoint_with_clipped_qkv_matches_transformers(olmoe_checkpoint):
    reference = load_reference(olmoe_checkpoint)
    assert reference.config.qk_norm == "full" and reference.config.clip_qkv == CLIP_QKV
    # the clip acts on this model: without it transformers decodes something else
    unclipped = DualFlowForCausalLM.from_pretrained(olmoe_checkpoint, clip_qkv=None).eval()
    assert [hf_greedy(unclipped, p, MAX_NEW) for p in PROMPTS] != [hf_greedy(reference, p, MAX_NEW) for p in PROMPTS]
    with running_engine(olmoe_checkpoint) as engine:
        assert_matches_transformers(served_greedy(engine, PROMPTS, MAX_NEW), PROMPTS, reference, MAX_NEW)
