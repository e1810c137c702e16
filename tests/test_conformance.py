"""
Outputs contract (docs/design.md §8): with the aux flow on, every output field transformers defines describes the
primary rows, exactly as a Qwen3-MoE of the same config returns it, through forward and every generation mode with
dict outputs.

transformers' wheel does not ship its ModelTesterMixin / GenerationTesterMixin, so the equivalent checks are written
here against transformers' own Qwen3MoeForCausalLM as the oracle. A Dual-Flow model built from the oracle's weights
has the oracle's primary flow; with the upcycling init and k_a == k_p its aux flow predicts the same tokens too, so
whole generate outputs can be compared value by value. With a trained-looking aux flow (random couplings, k_a != k_p)
the tokens differ: the outputs must then have the oracle's structure, and the primary rows must be what the oracle
computes for the same tokens.
"""

import copy

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dualflow.convert import init_aux_from_primary
from modeling_dualflow import DualFlowCache, DualFlowConfig, DualFlowForCausalLM
from modeling_dualflow.modeling_dualflow import CACHE_FIELD


SHARED = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    max_position_embeddings=128,
    eos_token_id=None,
    pad_token_id=0,
)
OUTPUT_FLAGS = dict(
    return_dict_in_generate=True,
    output_attentions=True,
    output_hidden_states=True,
    output_scores=True,
    output_logits=True,
)
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0),
    "beam": dict(do_sample=False, num_beams=2, num_return_sequences=2),
    "beam_sample": dict(do_sample=True, num_beams=2, top_k=0),
    "assisted": dict(do_sample=False),  # assistant_model added by the test
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=2),
}


def oracle_and_dualflow(aux_differs: bool, **dual_overrides):
    """A Qwen3-MoE and a Dual-Flow model with its weights (eager attention, so attentions are returned)."""
    torch.manual_seed(0)
    oracle = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHARED)).eval()
    dual = DualFlowForCausalLM(DualFlowConfig(**SHARED, qk_norm="per_head", **dual_overrides)).eval()
    missing, unexpected = dual.load_state_dict(oracle.state_dict(), strict=False)
    assert not unexpected and all("aux_" in name for name in missing)
    init_aux_from_primary(dual)
    if aux_differs:
        with torch.no_grad():
            for layer in dual.model.layers:
                layer.aux_coupling.weight.normal_(std=0.5)
    for model in (oracle, dual):
        model.set_attn_implementation("eager")
    return oracle, dual


def prompt():
    input_ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7], [0, 0, 9, 10, 11, 9, 10]])
    return input_ids, (input_ids != 0).long()


SINGLE_SEQUENCE_MODES = ("assisted", "prompt_lookup")  # transformers runs these for batch size 1 only


def run_generate(model, mode, seed=0, **extra):
    input_ids, attention_mask = prompt()
    if mode in SINGLE_SEQUENCE_MODES:
        input_ids, attention_mask = input_ids[:1], attention_mask[:1]
    options = dict(MODES[mode], max_new_tokens=4, **OUTPUT_FLAGS, **extra)
    if mode == "assisted":
        torch.manual_seed(3)
        options["assistant_model"] = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHARED)).eval()
        options["assistant_model"].set_attn_implementation("eager")
    torch.manual_seed(seed)
    return model.generate(input_ids, attention_mask=attention_mask, **options)


def assert_same_structure(actual, expected, path="output", values=False):
    """Same nesting, types, lengths, None positions and tensor shapes (and values when asked)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.shape == expected.shape, (path, actual, expected.shape)
        if values:
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0, msg=path)
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), (path, len(actual), len(expected))
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same_structure(a, e, f"{path}[{index}]", values)
    else:
        assert actual == expected, (path, actual, expected)


def cache_tensors(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


FIELDS = ("sequences", "scores", "logits", "attentions", "hidden_states")


@pytest.mark.parametrize("mode", MODES)
def test_generate_outputs_equal_qwen3_moe_at_upcycling(mode):
    oracle, dual = oracle_and_dualflow(aux_differs=False)
    expected, actual = run_generate(oracle, mode), run_generate(dual, mode)
    assert type(actual).__name__ == type(expected).__name__
    for field in FIELDS:
        assert_same_structure(getattr(actual, field), getattr(expected, field), field, values=True)
    # where the oracle gets a DynamicCache, Dual-Flow gets a DualFlowCache (a DynamicCache) holding the same K/V
    assert isinstance(actual.past_key_values, type(expected.past_key_values))
    assert_same_structure(cache_tensors(actual.past_key_values), cache_tensors(expected.past_key_values), values=True)
    if mode.startswith("beam"):
        torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, atol=1e-5, rtol=0)
        assert torch.equal(actual.beam_indices, expected.beam_indices)


@pytest.mark.parametrize("mode", MODES)
def test_generate_outputs_have_qwen3_moe_structure_with_the_aux_flow_on(mode):
    oracle, dual = oracle_and_dualflow(aux_differs=True, aux_num_experts_per_tok=3)
    expected, actual = run_generate(oracle, mode), run_generate(dual, mode)
    for field in FIELDS:
        assert_same_structure(getattr(actual, field), getattr(expected, field), field)
    assert_same_structure(cache_tensors(actual.past_key_values), cache_tensors(expected.past_key_values))
    assert (actual.logits[0] - expected.logits[0]).abs().max() > 1e-3  # the aux flow really predicts


@pytest.mark.parametrize("mode", ["greedy", "sample", "prompt_lookup"])
def test_generate_attentions_and_states_are_the_primary_rows(mode):
    """Each step's attentions / hidden states are what Qwen3-MoE computes for Dual-Flow's own tokens."""
    oracle, dual = oracle_and_dualflow(aux_differs=True, aux_num_experts_per_tok=3)
    out = run_generate(dual, mode)
    full_mask = (torch.arange(out.sequences.shape[1]) >= torch.tensor([[0], [2]])).long()[: len(out.sequences)]
    teacher = oracle(out.sequences, attention_mask=full_mask, output_attentions=True, output_hidden_states=True)
    start = 0
    for step_attentions, step_states in zip(out.attentions, out.hidden_states):
        stop = start + step_attentions[0].shape[2]
        keys = step_attentions[0].shape[3]
        real = full_mask[:, start:stop].bool()  # padding query rows are arbitrary in both models
        for layer, attention in enumerate(step_attentions):
            expected = teacher.attentions[layer][:, :, start:stop, :keys]
            torch.testing.assert_close(
                attention.transpose(1, 2)[real], expected.transpose(1, 2)[real], atol=1e-5, rtol=0
            )
        for layer, state in enumerate(step_states):
            torch.testing.assert_close(
                state[real], teacher.hidden_states[layer][:, start:stop][real], atol=1e-5, rtol=0
            )
        start = stop
    assert start == out.sequences.shape[1] - 1


def test_forward_outputs_are_qwen3_moe_outputs_plus_aux_fields():
    oracle, dual = oracle_and_dualflow(aux_differs=True, aux_num_experts_per_tok=3)
    input_ids, attention_mask = prompt()
    flags = dict(output_attentions=True, output_hidden_states=True, output_router_logits=True, use_cache=True)
    expected = oracle(input_ids, attention_mask=attention_mask, **flags)
    actual = dual(input_ids, attention_mask=attention_mask, logits_to_keep=3, **flags)
    for field in ("hidden_states", "attentions", "router_logits"):
        assert_same_structure(getattr(actual, field), getattr(expected, field), field, values=True)
    assert_same_structure(cache_tensors(actual.past_key_values), cache_tensors(expected.past_key_values), values=True)
    torch.testing.assert_close(actual.primary_logits, expected.logits[:, -3:], atol=1e-5, rtol=0)
    # the aux fields: one row per kept position
    assert [a.shape for a in actual.aux_attentions] == [(2, 4, 3, 7)] * 2
    assert [r.shape for r in actual.aux_router_logits] == [(2 * 3, 4)] * 2
    assert [h.shape for h in actual.aux_hidden_states] == [(2, 3, 32)] * 3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_primary_flow_is_qwen3_moe_bit_for_bit_with_the_aux_flow_off(attn):
    """What docs/training.md promises: the converted model, aux flow off, computes the source model's exact logits."""
    oracle, dual = oracle_and_dualflow(aux_differs=True, aux_num_experts_per_tok=3)
    for model in (oracle, dual):
        model.set_attn_implementation(attn)
    input_ids, attention_mask = prompt()
    with torch.no_grad():
        expected = oracle(input_ids, attention_mask=attention_mask).logits
        assert torch.equal(dual(input_ids, attention_mask=attention_mask, use_aux_flow=False).logits, expected)
        # aux flow on: the primary rows share their matmuls with the aux rows, equal up to float rounding
        both = dual(input_ids, attention_mask=attention_mask).primary_logits
    torch.testing.assert_close(both, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("selection", [[0, 2, -1], [1], -1])
def test_output_hidden_states_as_layer_indices(selection):
    """transformers 5 lets `output_hidden_states` select layers; the causal LM returns what Qwen3-MoE returns."""
    oracle, dual = oracle_and_dualflow(aux_differs=True)
    input_ids, attention_mask = prompt()
    expected = oracle(input_ids, attention_mask=attention_mask, output_hidden_states=selection).hidden_states
    actual = dual(input_ids, attention_mask=attention_mask, output_hidden_states=selection)
    assert_same_structure(actual.hidden_states, expected, values=True)
    assert_same_structure(actual.aux_hidden_states, expected)


def test_assistant_with_a_sliding_window_shorter_than_the_sequence():
    """As an assistant, the cache comes from transformers' own preparation (it records its past, so crop works)."""
    oracle, dual = oracle_and_dualflow(aux_differs=True, aux_num_experts_per_tok=3)
    input_ids = prompt()[0][:1]  # transformers' assisted decoding takes one sequence
    torch.manual_seed(5)
    assistant = DualFlowForCausalLM(DualFlowConfig(**SHARED, sliding_window=3)).eval()
    options = dict(max_new_tokens=8, do_sample=False)
    greedy = dual.generate(input_ids, **options)
    for target in (dual, oracle):
        expected = greedy if target is dual else oracle.generate(input_ids, **options)
        assert torch.equal(target.generate(input_ids, assistant_model=assistant, **options), expected)


@pytest.mark.parametrize("cache_implementation", [None, "dynamic", "static"])
def test_generate_prepares_a_dualflow_cache_where_transformers_prepares_a_dynamic_one(cache_implementation):
    oracle, dual = oracle_and_dualflow(aux_differs=False)
    input_ids, attention_mask = prompt()
    options = dict(attention_mask=attention_mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    options["cache_implementation"] = cache_implementation
    out, expected = dual.generate(input_ids, **options), oracle.generate(input_ids, **options)
    assert torch.equal(out.sequences, expected.sequences)  # upcycling init: the source model's tokens
    cache = out.past_key_values
    if cache_implementation == "static":
        assert type(cache).__name__ == "StaticCache"
    else:
        assert type(cache) is DualFlowCache and type(expected.past_key_values) is DynamicCache
    assert cache.get_seq_length() == input_ids.shape[1] + 3 - 1
    assert_same_structure(cache_tensors(cache), cache_tensors(expected.past_key_values), values=True)


def test_an_offloaded_cache_is_prepared_as_a_dualflow_cache():
    # offloading moves layers to a CUDA device and back, so generate cannot run it here: check the preparation
    _, dual = oracle_and_dualflow(aux_differs=False)
    for cache_implementation, offloading in (("offloaded", True), ("dynamic", False)):
        model_kwargs = {}
        generation_config = GenerationConfig(cache_implementation=cache_implementation)
        dual._prepare_cache_for_generation(generation_config, model_kwargs, None, 2, 16)
        [cache] = model_kwargs.values()
        assert type(cache) is DualFlowCache and cache.offloading is offloading


def test_generate_keeps_user_caches():
    _, dual = oracle_and_dualflow(aux_differs=True)
    input_ids, attention_mask = prompt()
    options = dict(attention_mask=attention_mask, max_new_tokens=2, return_dict_in_generate=True)
    for mine in (DualFlowCache(config=dual.config), DynamicCache(config=dual.config)):
        out = dual.generate(input_ids, **{CACHE_FIELD: mine}, **options)
        assert getattr(out, CACHE_FIELD) is mine


class TestInputsEmbeds:
    """The aux row of a position starts from aux_inputs_embeds, else the aux embedding of its id, else inputs_embeds."""

    @staticmethod
    def upcycled():
        _, dual = oracle_and_dualflow(aux_differs=True, aux_num_experts_per_tok=3)
        return dual  # E_aux == E, non-zero couplings, k_a != k_p: the aux flow differs from the primary one

    @staticmethod
    def trained():
        dual = TestInputsEmbeds.upcycled()
        with torch.no_grad():
            dual.model.aux_embed_tokens.weight.normal_()
        return dual

    def test_forward(self):
        input_ids, attention_mask = prompt()
        for dual in (self.upcycled(), self.trained()):
            by_ids = dual(input_ids, attention_mask=attention_mask)
            embeds, aux_embeds = dual.model.embed_tokens(input_ids), dual.model.aux_embed_tokens(input_ids)
            by_embeds = dual(inputs_embeds=embeds, aux_inputs_embeds=aux_embeds, attention_mask=attention_mask)
            torch.testing.assert_close(by_embeds.logits, by_ids.logits, atol=1e-5, rtol=0)
        upcycled = self.upcycled()
        embeds = upcycled.model.embed_tokens(input_ids)
        by_embeds = upcycled(inputs_embeds=embeds, attention_mask=attention_mask)
        by_ids = upcycled(input_ids, attention_mask=attention_mask)
        torch.testing.assert_close(by_embeds.logits, by_ids.logits, atol=1e-5, rtol=0)
        assert (by_ids.logits - by_ids.primary_logits).abs().max() > 1e-3

    @pytest.mark.parametrize("cache_implementation", [None, "static"])
    def test_generate(self, cache_implementation):
        input_ids, attention_mask = prompt()
        options = dict(
            attention_mask=attention_mask, max_new_tokens=5, do_sample=False, cache_implementation=cache_implementation
        )
        for dual in (self.upcycled(), self.trained()):
            expected = dual.generate(input_ids, **options)[:, input_ids.shape[1] :]
            embeds = dual.model.embed_tokens(input_ids)
            aux = dual.model.aux_embed_tokens(input_ids)
            assert torch.equal(dual.generate(inputs_embeds=embeds, aux_inputs_embeds=aux, **options), expected)
        upcycled = self.upcycled()
        expected = upcycled.generate(input_ids, **options)[:, input_ids.shape[1] :]
        assert torch.equal(upcycled.generate(inputs_embeds=upcycled.model.embed_tokens(input_ids), **options), expected)

    def test_generate_continues_from_inputs_embeds(self):
        dual = self.trained()
        input_ids, attention_mask = prompt()
        options = dict(do_sample=False, return_dict_in_generate=True)
        first = dual.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, **options)
        sequence = first.sequences
        full_mask = torch.cat([attention_mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
        expected = dual.generate(sequence, attention_mask=full_mask, max_new_tokens=3, **options).sequences
        continued = dual.generate(
            sequence,
            inputs_embeds=dual.model.embed_tokens(sequence),
            aux_inputs_embeds=dual.model.aux_embed_tokens(sequence),
            attention_mask=full_mask,
            past_key_values=copy.deepcopy(first.past_key_values),
            max_new_tokens=3,
            **options,
        ).sequences
        assert torch.equal(continued, expected)
