"""Prefill on the base model, decode with Dual-Flow (docs/inference.md): the primary flow is the base model, so a cache
its source family's own class filled is one a converted Dual-Flow model goes on from, with the same greedy tokens."""

import pytest
import torch
from helpers import left_padded_batch, make_source, save_source
from transformers import DynamicCache, StaticCache

from dualflow.convert import convert_checkpoint
from modeling_dualflow import DualFlowCache, DualFlowForCausalLM
from modeling_dualflow.modeling_dualflow import CACHE_FIELD


GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tests' tiny Qwen3-MoE (k_p = 2) and its conversion with k_a = 4 and random couplings."""
    folder = tmp_path_factory.mktemp("prefill")
    source = make_source("qwen3_moe")
    convert_checkpoint(save_source(source, folder / "src", "single"), folder / "out", aux_top_k=4, show_progress=False)
    dual = DualFlowForCausalLM.from_pretrained(folder / "out").eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in dual.model.layers:
            layer.aux_coupling.weight.normal_(std=0.5)
    assert dual.config.aux_num_experts_per_tok != dual.config.num_experts_per_tok
    return source, dual


@torch.no_grad()
def base_prefill(source, input_ids, attention_mask=None, cache=None):
    """The base model over all but the last prompt token; `generate` runs the last one with the aux flow."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask[:, :-1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions count the real tokens, as generate's
    kwargs = {CACHE_FIELD: cache} if cache is not None else {}
    outputs = source(input_ids[:, :-1], attention_mask=mask, position_ids=position_ids, use_cache=True, **kwargs)
    return getattr(outputs, CACHE_FIELD)


PROMPT = torch.randint(1, 101, (1, 11), generator=torch.Generator().manual_seed(3))


def test_generate_from_the_base_models_cache(models):
    source, dual = models
    alone = dual.generate(PROMPT, **GREEDY)
    # the aux flow changes the tokens here, so equal tokens below mean it ran on the base model's cache
    assert not torch.equal(alone, dual.generate(PROMPT, use_aux_flow=False, **GREEDY))
    cache = base_prefill(source, PROMPT)
    assert type(cache) is DynamicCache and cache.get_seq_length() == PROMPT.shape[1] - 1
    assert torch.equal(dual.generate(PROMPT, **{CACHE_FIELD: cache}, **GREEDY), alone)
    # a DualFlowCache built from it holds the same tokens, and `generate` goes on from it too
    copied = DualFlowCache.from_cache(base_prefill(source, PROMPT), dual.config)
    assert copied.get_seq_length() == PROMPT.shape[1] - 1
    assert torch.equal(dual.generate(PROMPT, **{CACHE_FIELD: copied}, **GREEDY), alone)


def test_left_padded_batch(models):
    source, dual = models
    input_ids, attention_mask = left_padded_batch([9, 13, 6], vocab_size=101)
    alone = dual.generate(input_ids, attention_mask=attention_mask, **GREEDY)
    cache = base_prefill(source, input_ids, attention_mask)
    resumed = dual.generate(input_ids, attention_mask=attention_mask, **{CACHE_FIELD: cache}, **GREEDY)
    assert torch.equal(resumed, alone)


def test_static_cache(models):
    source, dual = models
    alone = dual.generate(PROMPT, **GREEDY)
    max_cache_len = PROMPT.shape[1] + GREEDY["max_new_tokens"]
    static = base_prefill(source, PROMPT, cache=StaticCache(config=source.config, max_cache_len=max_cache_len))
    copied = DualFlowCache.from_cache(static, dual.config)
    assert copied.get_seq_length() == PROMPT.shape[1] - 1
    assert torch.equal(dual.generate(PROMPT, **{CACHE_FIELD: copied}, **GREEDY), alone)
    # the static cache itself, as transformers' own models go on from one
    assert torch.equal(dual.generate(PROMPT, **{CACHE_FIELD: static}, **GREEDY), alone)


@pytest.mark.parametrize("shape", [{"num_hidden_layers": 2}, {"num_key_value_heads": 1}, {"head_dim": 8}])
def test_a_cache_of_other_shapes_is_refused(models, shape):
    _, dual = models
    cache = base_prefill(make_source("qwen3_moe", **shape), PROMPT)
    with pytest.raises(ValueError, match="filled by a model of other shapes") as refused:
        dual.generate(PROMPT, **{CACHE_FIELD: cache}, **GREEDY)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="filled by a model of other shapes"):
        DualFlowCache.from_cache(cache, dual.config)
