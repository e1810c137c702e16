"""
transformers' own entry points into the model, at both ends of the supported range: continuous batching
(`generate_batch`, `transformers serve`), the cache `generate` builds, the experts kernels, fullgraph compilation with a
tensor `logits_to_keep`, and activation checkpointing with a user cache.
"""

import pytest
import torch
from helpers import tiny_model
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import continuous_api


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
