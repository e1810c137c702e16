"""
transformers' own entry points into the model, at both ends of the supported range: continuous batching
(`generate_batch`, `transformers serve`), the cache `generate` builds, the experts kernels, fullgraph compilation with a
tensor `logits_to_keep`, and activation checkpointing with a user cache.
"""

import pytest
import torch
import torch._dynamo
from helpers import enable_activation_checkpointing, tiny_model
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig, StaticCache
from transformers.generation import GenerationMixin
from transformers.generation.continuous_batching import continuous_api
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from modeling_dualflow import DualFlowCache
from modeling_dualflow.modeling_dualflow import CACHE_FIELD, DualFlowExperts, positions_to_keep


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
# A small paged cache (the default one is sized from the machine's memory); 8 tokens a step: the longest prompt is
# prefilled over two steps, beside the other requests' decode steps.
SMALL_BATCHES = ContinuousBatchingConfig(num_blocks=32, page_size=4, max_batch_tokens=8)


def generate_one_by_one(model, prompts):
    return [model.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p) :].tolist() for p in prompts]


class TestContinuousBatching:
    @pytest.mark.parametrize("attn", ["sdpa", "eager"])
    def test_generate_batch_gives_the_tokens_of_generate(self, attn):
        """The aux flow runs at each request's sampled row in the packed batch, reading the paged cache it leaves
        alone; with k_a > k_p and a second aux round, aux flow on and off."""
        model = tiny_model(attn_implementation=attn, aux_num_experts_per_tok=3, aux_num_rounds=2)
        for use_aux_flow in (True, False):
            model.config.use_aux_flow = use_aux_flow
            expected = generate_one_by_one(model, PROMPTS)
            results = model.generate_batch(PROMPTS, GREEDY, SMALL_BATCHES, progress_bar=False)
            assert [result.error for result in results.values()] == [None] * len(PROMPTS)
            assert [result.generated_tokens for result in results.values()] == expected, use_aux_flow
        assert model.config._attn_implementation == attn  # the manager gave `paged|eager` back

    def test_a_sliding_window_model_batches_too(self):
        model = tiny_model(sliding_window=3, num_experts=0)
        results = model.generate_batch(PROMPTS, GREEDY, SMALL_BATCHES, progress_bar=False)
        assert [result.generated_tokens for result in results.values()] == generate_one_by_one(model, PROMPTS)

    def test_flash_attention_is_refused_before_any_request_runs(self, monkeypatch):
        """Flash takes no mask for the aux rows: a model on flash, or one the manager switches to it (half precision
        with flash installed), gets a one-line error at the call, not failed requests; the attention is left as it
        was. (The flash kernels are not installed here: the config names them, as the manager's switch does.)"""
        model = tiny_model()

        def switch_to_flash(manager, model, auto_switch_to_flash=True):
            model.config._attn_implementation = "flash_attention_2"

        manager_class = continuous_api.ContinuousBatchingManager
        monkeypatch.setattr(manager_class, "switch_to_cb_friendly_attn", switch_to_flash)
        with pytest.raises(ValueError, match="not flash attention") as error:
            model.generate_batch(PROMPTS, GREEDY, SMALL_BATCHES, progress_bar=False)
        assert "\n" not in str(error.value) and model.config._attn_implementation == "sdpa"
        model.config._attn_implementation = "flash_attention_2"  # loaded with flash
        with pytest.raises(ValueError, match="not flash attention"):
            model.init_continuous_batching(GREEDY, SMALL_BATCHES)
        assert model.config._attn_implementation == "flash_attention_2"


def described(value):
    """A cache's state as plain values: attributes and layers compared by value, streams by type."""
    if isinstance(value, (list, tuple)):
        return [described(item) for item in value]
    if isinstance(value, torch.Stream) or isinstance(value, type):
        return type(value).__name__ if isinstance(value, torch.Stream) else value.__name__
    if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
        return type(value).__name__, {name: described(item) for name, item in vars(value).items()}
    return value


@pytest.fixture
def dualflow_cache_inits(monkeypatch):
    """The DualFlowCache objects whose `__init__` ran."""
    inits, init = [], DualFlowCache.__init__

    def recorded_init(self, *args, **kwargs):
        inits.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(DualFlowCache, "__init__", recorded_init)
    return inits


class TestGenerateCache:
    @pytest.mark.parametrize(
        "options",
        [{}, {"cache_implementation": "dynamic"}, {"cache_implementation": "offloaded"}, {"is_assistant": True}],
    )
    def test_the_cache_is_built_like_transformers_dynamic_cache(self, options, dualflow_cache_inits):
        """Where transformers builds a DynamicCache, the model's hook builds a DualFlowCache through its constructor,
        in the state transformers' cache has (offloading, an assistant's past recording on its sliding layers)."""
        model = tiny_model(sliding_window=3)
        generation_config = GenerationConfig(**options)
        ours, theirs = {}, {}
        model._prepare_cache_for_generation(generation_config, ours, None, 2, 16)
        GenerationMixin._prepare_cache_for_generation(model, generation_config, theirs, None, 2, 16)
        assert list(ours) == list(theirs) == [CACHE_FIELD] and type(theirs[CACHE_FIELD]) is DynamicCache
        cache = ours[CACHE_FIELD]
        assert type(cache) is DualFlowCache and dualflow_cache_inits == [cache]
        assert described(cache)[1] == described(theirs[CACHE_FIELD])[1]

    def test_generate_runs_on_a_constructed_dualflow_cache_or_a_static_one(self, dualflow_cache_inits):
        model = tiny_model(aux_num_experts_per_tok=3)
        input_ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(2))
        options = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
        for use_aux_flow in (True, False):
            default = model.generate(input_ids, use_aux_flow=use_aux_flow, **options)
            cache = default[CACHE_FIELD]
            assert type(cache) is DualFlowCache and any(built is cache for built in dualflow_cache_inits)
            static = model.generate(input_ids, use_aux_flow=use_aux_flow, cache_implementation="static", **options)
            assert type(static[CACHE_FIELD]) is StaticCache
            given = model.generate(input_ids, use_aux_flow=use_aux_flow, **{CACHE_FIELD: DynamicCache()}, **options)
            assert torch.equal(default.sequences, static.sequences) and torch.equal(default.sequences, given.sequences)

    def test_assisted_decoding_with_a_dualflow_assistant(self):
        """The assistant's cache records its past (sliding window) so that `crop` can roll rejected tokens back."""
        model, assistant = tiny_model(sliding_window=3), tiny_model(seed=1, sliding_window=3)
        input_ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(3))
        expected = model.generate(input_ids, max_new_tokens=8, do_sample=False)
        assisted = model.generate(input_ids, max_new_tokens=8, do_sample=False, assistant_model=assistant)
        assert torch.equal(assisted, expected)


class TestExpertsKernels:
    def test_the_experts_forward_is_wrapped_once(self):
        """Decorated once, by transformers on Qwen3-MoE's class: one dispatch, one `__init__` wrapper."""
        for method in (DualFlowExperts.forward, DualFlowExperts.__init__):
            depth = 0
            while hasattr(method, "__wrapped__"):
                method, depth = method.__wrapped__, depth + 1
            assert depth == 1

    def test_each_kernel_is_selected(self, monkeypatch):
        """grouped_mm by default; eager, batched_mm and grouped_mm by `set_experts_implementation`, for both fan-outs
        (k_a > k_p); a kernel registered with transformers is the one called."""
        model = tiny_model(aux_num_experts_per_tok=3)
        input_ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(4))
        assert model.config._experts_implementation == "grouped_mm"
        outputs = {}
        for implementation in ("eager", "batched_mm", "grouped_mm"):
            model.set_experts_implementation(implementation)
            experts = [module for module in model.modules() if isinstance(module, DualFlowExperts)]
            assert {module.config._experts_implementation for module in experts} == {implementation}
            outputs[implementation] = model(input_ids)
        for implementation in ("batched_mm", "grouped_mm"):
            for field in ("logits", "primary_logits"):
                actual, expected = outputs[implementation][field], outputs["eager"][field]
                torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        calls = []

        def recording_kernel(module, *args, **kwargs):
            calls.append(module)
            return ALL_EXPERTS_FUNCTIONS["grouped_mm"](module, *args, **kwargs)

        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "dualflow_test_experts", recording_kernel)
        model.set_experts_implementation("dualflow_test_experts")
        torch.testing.assert_close(model(input_ids).logits, outputs["grouped_mm"].logits, rtol=0, atol=0)
        assert len(calls) == model.config.num_hidden_layers  # one call per MoE layer: both flows together


class TestTensorLogitsToKeep:
    """A tensor `logits_to_keep` (continuous batching passes one every step) is used as it is: no host read."""

    @pytest.mark.parametrize("attn", ["sdpa", "eager"])
    def test_a_forward_compiles_to_one_graph(self, attn):
        model = tiny_model(attn_implementation=attn, aux_num_experts_per_tok=3)
        input_ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(5))
        logits_to_keep = torch.tensor([1, 3, -1])

        def forward(input_ids, logits_to_keep):
            outputs = model(input_ids, logits_to_keep=logits_to_keep)
            return outputs.logits, outputs.primary_logits

        with torch.no_grad():
            explanation = torch._dynamo.explain(forward)(input_ids, logits_to_keep)
            assert explanation.graph_break_count == 0, [str(reason.reason) for reason in explanation.break_reasons]
            compiled = torch.compile(forward, fullgraph=True, backend="eager")(input_ids, logits_to_keep)
            expected = forward(input_ids, logits_to_keep)
        assert expected[0].shape == (2, 3, 97)
        for actual, wanted in zip(compiled, expected):
            torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-6)

    def test_the_indices_are_checked_only_where_reading_them_is_free(self):
        with pytest.raises(ValueError, match="logits_to_keep holds indices outside"):
            positions_to_keep(torch.tensor([1, 9]), 4, torch.device("cpu"))
        # a meta tensor has no values to read: reading them would raise
        positions, every_position = positions_to_keep(torch.tensor([1, -1, 9]), 4, torch.device("meta"))
        assert positions.device.type == "meta" and positions.shape == (3,) and not every_position


class TestActivationCheckpointingWithACache:
    @pytest.mark.parametrize("use_reentrant", [True, False])
    def test_a_given_cache_is_left_alone_and_gradients_hold(self, use_reentrant):
        """A checkpointed layer recomputes its forward in the backward pass: transformers takes the cache from it (the
        keyword it clears is `past_key_values` before 5.24, `cache` from 5.24), so the cache is not written twice (on
        5.19 the reentrant backward failed on the doubled keys) and the gradients are those without checkpointing."""
        input_ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(6))
        gradients = []
        for checkpointing in (False, True):
            model = tiny_model(aux_num_experts_per_tok=3, aux_num_rounds=2).train()
            if checkpointing:
                enable_activation_checkpointing(model, {"use_reentrant": use_reentrant})
            cache = DualFlowCache(config=model.config)
            model(input_ids, labels=input_ids, **{CACHE_FIELD: cache}).loss.backward()
            gradients.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
            assert cache.get_seq_length() == (0 if checkpointing else 6)
        assert gradients[0].keys() == gradients[1].keys()
        for name, gradient in gradients[0].items():
            torch.testing.assert_close(gradients[1][name], gradient, rtol=1e-5, atol=1e-7, msg=name)
