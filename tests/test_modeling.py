"""Tiny-config tester for DualFlowConfig / DualFlowForCausalLM / DualFlowCache (docs/design.md §7 invariants 1, 3, 4, 5)."""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import VARIANTS, enable_activation_checkpointing, left_padded_batch, tiny_config, tiny_model, valid_rows
from reference import two_pass_forward
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    PreTrainedModel,
    Qwen3MoeForCausalLM,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
from transformers.testing_utils import CaptureLogger

import modeling_dualflow
from dualflow.aux_training import freeze_aux_flow, freeze_for_aux_training
from dualflow.convert import init_aux_from_primary
from dualflow.instruments.upcycle_models import qwen3_moe_config_of
from modeling_dualflow import DualFlowCache, DualFlowConfig, DualFlowForCausalLM, configuration_dualflow
from modeling_dualflow.modeling_dualflow import CACHE_FIELD, DualFlowExperts, route_two_top_k


class TestConfig:
    def test_defaults_follow_primary_fields(self):
        config = tiny_config(num_experts_per_tok=3)
        assert config.aux_num_experts_per_tok == 3
        assert config.head_dim == 8 and config.qkv_bias is False and config.moe_intermediate_size == 24
        assert config.use_aux_flow is True and config.primary_loss_weight == 1.0

    @pytest.mark.parametrize(
        "overrides, field",
        [
            ({"aux_num_experts_per_tok": 5}, "aux_num_experts_per_tok"),
            ({"aux_num_experts_per_tok": 0}, "aux_num_experts_per_tok"),
            ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
            ({"num_key_value_heads": 3}, "num_key_value_heads"),
            ({"qk_norm": "rms"}, "qk_norm"),
            ({"primary_loss_weight": -1.0}, "primary_loss_weight"),
            ({"num_experts": -2}, "num_experts"),
            ({"mlp_only_layers": [5]}, "mlp_only_layers"),
            ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
            ({"sliding_window": 0}, "sliding_window"),
            ({"hidden_size": 30, "head_dim": None}, "hidden_size"),
            ({"head_dim": 0}, "head_dim"),
            ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
            ({"intermediate_size": 0, "num_experts": 0}, "intermediate_size"),
            ({"clip_qkv": -1.0}, "clip_qkv"),
            ({"hidden_act": "nope"}, "hidden_act"),
            ({"aux_embed_init": "zeros"}, "aux_embed_init"),
            ({"max_position_embeddings": 0}, "max_position_embeddings must be >= 1, got 0"),
            ({"max_position_embeddings": -5}, "max_position_embeddings must be >= 1, got -5"),
            ({"rms_norm_eps": -1}, "rms_norm_eps must be > 0, got -1"),
            ({"primary_loss_weight": float("nan")}, "primary_loss_weight must be a finite number >= 0, got nan"),
            ({"primary_loss_weight": float("inf")}, "primary_loss_weight must be a finite number >= 0, got inf"),
            ({"router_aux_loss_coef": -1}, "router_aux_loss_coef must be a finite number >= 0, got -1"),
            ({"aux_num_rounds": 2, "aux_round_gate_init": float("nan")}, "aux_round_gate_init must be a finite"),
            ({"num_experts": 0, "aux_num_experts_per_tok": 99}, "aux_num_experts_per_tok=99 needs a MoE model"),
        ],
    )
    def test_inconsistent_values_name_the_field(self, overrides, field):
        with pytest.raises(ValueError, match=re.escape(field)) as error:
            tiny_config(**overrides)
        assert "\n" not in str(error.value)

    def test_retired_training_fields_load_with_one_warning(self, tmp_path):
        # checkpoints saved while the config had aux_train_fraction / aux_train_positions still load, the fields unused
        tiny_model().save_pretrained(tmp_path)
        config_file = tmp_path / "config.json"
        config_file.write_text(
            json.dumps(
                json.loads(config_file.read_text()) | {"aux_train_fraction": 0.25, "aux_train_positions": "last"}
            )
        )
        with CaptureLogger(configuration_dualflow.logger) as captured:
            loaded = DualFlowForCausalLM.from_pretrained(tmp_path)
        assert captured.out == "aux_train_fraction, aux_train_positions: no longer a Dual-Flow config field, ignored\n"
        assert not hasattr(loaded.config, "aux_train_fraction") and "aux_train_fraction" not in loaded.config.to_dict()

    def test_dense_ignores_top_k_fields(self):
        assert tiny_config(num_experts=0, num_experts_per_tok=99).num_experts == 0

    @pytest.mark.parametrize(
        "overrides", [{}, {"num_experts": 0}, {"mlp_only_layers": [0]}, {"qk_norm": "per_head"}, {"qk_norm": "full"}]
    )
    def test_parallel_plan_names_only_existing_modules(self, overrides):
        model = tiny_model(**overrides)
        names = [name for name, _ in model.model.named_modules()] + [name for name, _ in model.model.named_parameters()]
        for pattern in model.config.base_model_tp_plan:
            regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
            assert any(regex.fullmatch(name) for name in names), pattern

    def test_dense_model_declares_no_router_logits(self):
        dense, moe = tiny_model(num_experts=0), tiny_model()
        out = dense(torch.tensor([[1, 2, 3]]), output_router_logits=True)
        assert out.router_logits is None and out.aux_router_logits is None and out.aux_loss is None
        # the MoE model keeps transformers' default kernel (found through the decorator in modeling_dualflow.py)
        assert moe.config._experts_implementation == "grouped_mm"
        assert moe.model.layers[0].mlp.experts.config._experts_implementation == "grouped_mm"

    def test_experts_are_transformers_qwen3_moe_experts_and_offered_its_kernels(self):
        """
        DualFlowExperts is transformers' Qwen3-MoE experts class, decorated there with `@use_experts_implementation`
        and not again here (its forward is wrapped once). transformers offers experts kernels to a model whose file
        names the decorator; the model says it can take them (`_can_set_experts_implementation`) instead, so the
        test above would see "eager" without it. Every kernel computes what Qwen3-MoE's experts compute under it.
        """
        source = Path(modeling_dualflow.modeling_dualflow.__file__).read_text()
        assert "use_experts_implementation" not in source
        assert DualFlowForCausalLM._can_set_experts_implementation()
        assert DualFlowExperts.__bases__ == (Qwen3MoeExperts,) and DualFlowExperts.forward is Qwen3MoeExperts.forward
        config = tiny_config()
        rows, indices = torch.randn(6, config.hidden_size), torch.randint(0, config.num_experts, (6, 2))
        weights = torch.rand(6, 2)
        for implementation in ("eager", "batched_mm", "grouped_mm"):
            config._experts_implementation = implementation
            ours, theirs = DualFlowExperts(config), Qwen3MoeExperts(config)
            torch.nn.init.normal_(ours.gate_up_proj)
            torch.nn.init.normal_(ours.down_proj)
            theirs.load_state_dict(ours.state_dict())
            assert torch.equal(ours(rows, indices, weights), theirs(rows, indices, weights)), implementation

    def test_aux_embed_init_copies_the_primary_embedding_of_a_new_model_only(self, tmp_path):
        independent = DualFlowForCausalLM(tiny_config(aux_embed_init="independent"))
        assert not torch.equal(independent.model.aux_embed_tokens.weight, independent.model.embed_tokens.weight)
        assert DualFlowConfig().aux_embed_init == "copy"  # the default of a new model: what measured best
        copied = DualFlowForCausalLM(tiny_config(aux_embed_init="copy"))
        assert torch.equal(copied.model.aux_embed_tokens.weight, copied.model.embed_tokens.weight)
        with torch.no_grad():  # trained: the two tables part
            copied.model.aux_embed_tokens.weight.add_(1.0)
        copied.save_pretrained(tmp_path)
        loaded = DualFlowForCausalLM.from_pretrained(tmp_path)  # loaded weights are never re-initialised
        assert torch.equal(loaded.model.aux_embed_tokens.weight, copied.model.aux_embed_tokens.weight)

    def test_new_defaults_leave_an_older_checkpoint_as_saved(self, tmp_path):
        # a checkpoint saved before the defaults changed: independent aux embedding, closed round gates, and a
        # config.json that names neither init field
        old = tiny_model(aux_num_rounds=2, aux_embed_init="independent", aux_round_gate_init=0.0)
        old.save_pretrained(tmp_path)
        config_file = tmp_path / "config.json"
        fields = json.loads(config_file.read_text())
        del fields["aux_embed_init"], fields["aux_round_gate_init"]
        config_file.write_text(json.dumps(fields))
        loaded = DualFlowForCausalLM.from_pretrained(tmp_path)
        for name, tensor in old.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name

    def test_save_load_round_trip(self, tmp_path):
        config = tiny_config(aux_num_experts_per_tok=3, qk_norm="per_head", sliding_window=4)
        config.save_pretrained(tmp_path)
        loaded = AutoConfig.from_pretrained(tmp_path)
        assert isinstance(loaded, DualFlowConfig)
        assert {**loaded.to_dict(), "_name_or_path": ""} == config.to_dict()


class TestGroupedEqualsReference:
    """docs/design.md §7.4: grouped execution == the slow two-pass reference."""

    @pytest.mark.parametrize("variant", VARIANTS)
    @pytest.mark.parametrize("attn", ["sdpa", "eager"])
    def test_all_positions_left_padded(self, variant, attn):
        model = tiny_model(attn_implementation=attn, **VARIANTS[variant])
        input_ids, attention_mask = left_padded_batch([7, 4])
        out = model(input_ids, attention_mask=attention_mask)
        primary, aux = two_pass_forward(model, input_ids, DynamicCache(), attention_mask=attention_mask)
        rows = valid_rows(attention_mask)
        torch.testing.assert_close(out.primary_logits[rows], primary[rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.logits[rows], aux[rows], atol=1e-5, rtol=0)
        assert not torch.allclose(out.logits[rows], out.primary_logits[rows], atol=1e-3)

    @pytest.mark.parametrize("variant", ["moe_ka_gt_kp", "dense", "sliding_window", "rounds_3", "adapters"])
    @pytest.mark.parametrize("logits_to_keep", [1, 3, torch.tensor([0, 2, 5])])
    def test_selected_positions(self, variant, logits_to_keep):
        model = tiny_model(**VARIANTS[variant])
        input_ids = torch.randint(0, 97, (2, 6))
        out = model(input_ids, logits_to_keep=logits_to_keep)
        positions = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else torch.arange(6 - logits_to_keep, 6)
        _, aux = two_pass_forward(model, input_ids, DynamicCache(), aux_positions=positions)
        torch.testing.assert_close(out.logits, aux, atol=1e-5, rtol=0)
        assert out.logits.shape == (2, len(positions), 97) == out.primary_logits.shape

    @pytest.mark.parametrize(
        "variant", ["moe_ka_gt_kp", "sliding_window", "rounds_2_sliding_window", "adapters_rounds_2_sliding_window"]
    )
    def test_decode_step_with_cache(self, variant):
        model = tiny_model(**VARIANTS[variant])
        input_ids, attention_mask = left_padded_batch([6, 3])
        cache = DualFlowCache(config=model.config)
        model(input_ids[:, :5], attention_mask=attention_mask[:, :5], past_key_values=cache, use_cache=True)
        reference_cache = DynamicCache()
        two_pass_forward(model, input_ids[:, :5], reference_cache, attention_mask=attention_mask[:, :5])
        step = model(input_ids[:, 5:], attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        _, aux = two_pass_forward(
            model, input_ids[:, 5:], reference_cache, attention_mask=attention_mask, position_ids=torch.tensor([[5]])
        )
        torch.testing.assert_close(step.logits, aux, atol=1e-5, rtol=0)

    @pytest.mark.parametrize(
        "variant", ["moe_ka_gt_kp", "sliding_window", "rounds_3", "rounds_2_sliding_window", "adapters"]
    )
    def test_chunked_prefill_with_padding(self, variant):
        model = tiny_model(**VARIANTS[variant])
        input_ids, attention_mask = left_padded_batch([7, 5])
        cache, reference_cache = DualFlowCache(config=model.config), DynamicCache()
        for chunk in (slice(0, 3), slice(3, 7)):
            out = model(
                input_ids[:, chunk],
                attention_mask=attention_mask[:, : chunk.stop],
                past_key_values=cache,
                use_cache=True,
            )
            _, aux = two_pass_forward(
                model,
                input_ids[:, chunk],
                reference_cache,
                attention_mask=attention_mask[:, : chunk.stop],
                position_ids=torch.arange(chunk.start, chunk.stop).unsqueeze(0),
            )
            rows = valid_rows(attention_mask[:, chunk])
            torch.testing.assert_close(out.logits[rows], aux[rows], atol=1e-5, rtol=0)

    def test_per_call_aux_top_k(self):
        model = tiny_model()
        input_ids = torch.randint(0, 97, (2, 6))
        wide = model(input_ids, aux_num_experts_per_tok=4)
        _, aux = two_pass_forward(model, input_ids, DynamicCache(), aux_top_k=4)
        torch.testing.assert_close(wide.logits, aux, atol=1e-5, rtol=0)
        assert (wide.logits - model(input_ids).logits).abs().max() > 1e-3
        torch.testing.assert_close(wide.primary_logits, model(input_ids).primary_logits, atol=1e-5, rtol=0)

    @pytest.mark.parametrize("aux_top_k", [1, 3, 4])  # 1 and 3 pad k_p-sized chunks with weight-0 slots
    @pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
    def test_experts_kernels_with_two_fanouts(self, implementation, aux_top_k):
        model = tiny_model(aux_num_experts_per_tok=aux_top_k)
        model.set_experts_implementation(implementation)
        input_ids = torch.randint(0, 97, (2, 5))
        out = model(input_ids)
        primary, aux = two_pass_forward(model, input_ids, DynamicCache())
        torch.testing.assert_close(out.logits, aux, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.primary_logits, primary, atol=1e-5, rtol=0)


class TestRouteTwoTopK:
    """The one two-top-k rule (`route_two_top_k`) both engines route with; tests/vllm checks the vLLM model uses it."""

    @pytest.mark.parametrize("aux_top_k", [1, 2, 3, 4])
    @pytest.mark.parametrize("norm_topk_prob", [True, False])
    def test_each_row_gets_its_own_flows_top_k(self, aux_top_k, norm_topk_prob):
        top_k, generator = 2, torch.Generator().manual_seed(0)
        probs = torch.randn(12, 6, generator=generator).softmax(-1)
        is_aux_row = torch.arange(12) % 3 == 0
        weights, indices = route_two_top_k(probs, is_aux_row, top_k, aux_top_k, norm_topk_prob)
        assert weights.shape == indices.shape == (12, max(top_k, aux_top_k))
        for row, aux in enumerate(is_aux_row.tolist()):
            k = aux_top_k if aux else top_k
            expected_weights, expected_indices = torch.topk(probs[row], k)
            if norm_topk_prob:
                expected_weights = expected_weights / expected_weights.sum()
            torch.testing.assert_close(weights[row, :k], expected_weights)
            assert indices[row, :k].tolist() == expected_indices.tolist()
            # padding slots: weight 0, the row's own first expert (streams no expert the row does not read anyway)
            assert weights[row, k:].abs().sum() == 0
            assert set(indices[row, k:].tolist()) <= {expected_indices[0].item()}

    @pytest.mark.parametrize("aux_top_k", [1, 3, 4])
    def test_moe_block_computes_the_rule(self, aux_top_k):
        block = tiny_model(aux_num_experts_per_tok=aux_top_k).model.layers[0].mlp
        experts, num_primary = block.experts, 5
        hidden = torch.randn(2, 7, block.gate.weight.shape[1])  # 5 primary + 2 aux rows per sequence

        def expert(index, x):
            gate, up = F.linear(x, experts.gate_up_proj[index]).chunk(2)
            return F.linear(experts.act_fn(gate) * up, experts.down_proj[index])

        with torch.no_grad():
            out = block(hidden, num_primary, aux_top_k).reshape(14, -1)
            flat = hidden.reshape(14, -1)
            is_aux_row = (torch.arange(7) >= num_primary).repeat(2)
            probs = F.softmax(flat @ block.gate.weight.T, dim=-1)
            weights, indices = route_two_top_k(probs, is_aux_row, 2, aux_top_k, norm_topk_prob=True)
            expected = torch.stack(
                [sum(w * expert(i, x) for w, i in zip(*slots)) for x, *slots in zip(flat, weights, indices.tolist())]
            )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


class TestPrimaryIsolation:
    """docs/design.md §7.1: primary states, logits and cache ignore everything about the aux flow."""

    def _primary_run(self, model, input_ids, attention_mask, **kwargs):
        cache = DualFlowCache(config=model.config)
        out = model(
            input_ids, attention_mask=attention_mask, past_key_values=cache, output_hidden_states=True, **kwargs
        )
        keys = [layer.keys.clone() for layer in cache.layers] + [layer.values.clone() for layer in cache.layers]
        return out.primary_logits, out.hidden_states, keys

    @pytest.mark.parametrize("attn", ["sdpa", "eager"])
    @pytest.mark.parametrize("logits_to_keep", [0, 1])
    @pytest.mark.parametrize(
        "variant",
        ["moe", "moe_ka_lt_kp", "dense", "qwen2moe_shared_expert", "sliding_window", "rounds_3", "adapters"],
    )
    def test_aux_parameters_top_k_and_switch_do_not_touch_primary(self, variant, logits_to_keep, attn):
        model = tiny_model(attn_implementation=attn, **VARIANTS[variant])
        input_ids, attention_mask = left_padded_batch([6, 4])

        def run(**kwargs):
            return self._primary_run(model, input_ids, attention_mask, logits_to_keep=logits_to_keep, **kwargs)

        baseline = run(use_aux_flow=False)
        runs = [run(use_aux_flow=True)]
        if model.config.num_experts:
            runs.append(run(aux_num_experts_per_tok=4))
        if model.config.aux_num_rounds > 1:
            runs.append(run(aux_num_rounds=1))
        with torch.no_grad():
            for name in model.aux_parameter_names():  # embedding, couplings, and whatever else the config builds
                model.get_parameter(name).normal_(std=3.0)
        runs.append(run())
        rows = valid_rows(attention_mask)
        logit_rows = rows if logits_to_keep == 0 else rows[:, -1:]
        for logits, hidden_states, cache_tensors in runs:
            torch.testing.assert_close(logits[logit_rows], baseline[0][logit_rows], atol=1e-5, rtol=0)
            for state, expected in zip(hidden_states, baseline[1]):
                torch.testing.assert_close(state[rows], expected[rows], atol=1e-5, rtol=0)
            for tensor, expected in zip(cache_tensors, baseline[2]):
                torch.testing.assert_close(tensor, expected, atol=1e-5, rtol=0)


class TestCachedEqualsUncached:
    """docs/design.md §7.3: step-by-step decoding == one forward over the whole sequence."""

    @pytest.mark.parametrize("attn", ["sdpa", "eager"])
    @pytest.mark.parametrize("use_aux_flow", [True, False])
    @pytest.mark.parametrize(
        "variant",
        [
            "moe_ka_gt_kp",
            "moe_ka_lt_kp",
            "dense",
            "sliding_window",
            "olmoe_full_qk_norm_clip",
            "rounds_3",
            "rounds_2_sliding_window",
            "adapters",
            "adapters_rounds_2_sliding_window",
        ],
    )
    def test_generate_scores_match_full_forward(self, use_aux_flow, variant, attn):
        model = tiny_model(attn_implementation=attn, **VARIANTS[variant])
        input_ids, attention_mask = left_padded_batch([5, 3])
        generated = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=6,
            do_sample=False,
            use_aux_flow=use_aux_flow,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        full_mask = torch.cat([attention_mask, torch.ones(2, 6, dtype=torch.long)], dim=1)
        full = model(generated.sequences, attention_mask=full_mask, use_aux_flow=use_aux_flow)
        step_logits = torch.stack(generated.logits, dim=1)  # (batch, new tokens, vocab)
        torch.testing.assert_close(step_logits, full.logits[:, 4:-1], atol=1e-5, rtol=0)

    def test_batched_left_padding_equals_single_prompts(self):
        model = tiny_model(aux_num_experts_per_tok=3)
        input_ids, attention_mask = left_padded_batch([6, 3])
        batched = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
        for row, length in enumerate([6, 3]):
            single = model.generate(input_ids[row : row + 1, 6 - length :], max_new_tokens=5, do_sample=False)
            assert batched[row, -5:].tolist() == single[0, -5:].tolist()


class TestGenerate:
    def test_greedy_follows_aux_argmax_and_switch_changes_prediction(self):
        model = tiny_model(aux_num_experts_per_tok=3)
        prompt = torch.randint(0, 97, (1, 4))
        sequence = prompt
        for _ in range(5):  # no cache at all: the slowest possible greedy loop
            next_token = model(sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
        assert model.generate(prompt, max_new_tokens=5, do_sample=False).tolist() == sequence.tolist()
        primary_only = model.generate(prompt, max_new_tokens=5, do_sample=False, use_aux_flow=False)
        expected = prompt
        for _ in range(5):
            next_token = model(expected, use_aux_flow=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
        assert primary_only.tolist() == expected.tolist()

    def test_sampling_is_seeded_and_uses_aux_distribution(self):
        model = tiny_model()
        prompt = torch.randint(0, 97, (2, 4))
        torch.manual_seed(3)
        first = model.generate(prompt, max_new_tokens=4, do_sample=True, top_k=0, temperature=1.0)
        torch.manual_seed(3)
        second = model.generate(prompt, max_new_tokens=4, do_sample=True, top_k=0, temperature=1.0)
        assert first.tolist() == second.tolist()
        torch.manual_seed(3)
        expected = torch.multinomial(F.softmax(model(prompt).logits[:, -1], dim=-1), 1)
        assert first[:, 4:5].tolist() == expected.tolist()

    def test_per_call_aux_top_k_reaches_every_step(self):
        model = tiny_model()
        prompt = torch.randint(0, 97, (1, 5))
        kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        per_call = model.generate(prompt, aux_num_experts_per_tok=4, **kwargs)
        full = model(per_call.sequences, aux_num_experts_per_tok=4).logits[:, 4:-1]
        torch.testing.assert_close(torch.stack(per_call.logits, dim=1), full, atol=1e-5, rtol=0)
        default = model.generate(prompt, **kwargs)
        assert (torch.stack(per_call.logits, 1) - torch.stack(default.logits, 1)).abs().max() > 1e-3

    @pytest.mark.parametrize("use_aux_flow", [True, False])
    def test_beam_search_scores_match_full_forward(self, use_aux_flow):
        # a wrong reorder_cache would score the beams with another beam's keys/values
        model = tiny_model(aux_num_experts_per_tok=3)
        input_ids, attention_mask = left_padded_batch([5, 3])
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=4,
            num_beams=3,
            num_return_sequences=3,
            length_penalty=0.0,
            do_sample=False,
            use_aux_flow=use_aux_flow,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        mask = torch.cat([attention_mask.repeat_interleave(3, dim=0), torch.ones(6, 4, dtype=torch.long)], dim=1)
        logits = model(out.sequences, attention_mask=mask, use_aux_flow=use_aux_flow).logits[:, 4:-1]
        new_tokens = out.sequences[:, 5:]
        expected = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).sum(dim=(1, 2))
        torch.testing.assert_close(out.sequences_scores, expected, atol=1e-4, rtol=0)

    def test_speculative_decoding_matches_greedy(self):
        # candidates are verified with the aux flow on every candidate token, then the cache is cropped
        model = tiny_model(aux_num_experts_per_tok=3)
        prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False)
        lookup = model.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
        assistant = tiny_model(seed=3, random_coupling=False)
        assisted = model.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=assistant)
        assert greedy.tolist() == lookup.tolist() == assisted.tolist()

    def test_generate_runs_on_a_dualflow_cache_and_beam_search_runs(self):
        model = tiny_model()
        prompt = torch.randint(0, 97, (2, 4))
        out = model.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        cache = getattr(out, CACHE_FIELD)
        assert type(cache) is DualFlowCache and cache.get_seq_length() == 4 + 3 - 1
        assert cache.nbytes() == 2 * 2 * (2 * 2 * 6 * 8) * 4  # layers x (K, V) x (batch, kv heads, tokens, d) x fp32
        beams = model.generate(prompt, max_new_tokens=3, num_beams=3, do_sample=False, return_dict_in_generate=True)
        assert beams.sequences.shape == (2, 7) and type(getattr(beams, CACHE_FIELD)) is DualFlowCache


class TestKvBytes:
    """docs/design.md §7.5: the cache is the base model's cache."""

    def test_dualflow_cache_bytes_equal_base_model_cache(self):
        model = tiny_model(qk_norm="per_head", aux_num_experts_per_tok=4)
        config = model.config
        base = Qwen3MoeForCausalLM(qwen3_moe_config_of(config)).eval()
        input_ids = torch.randint(0, 97, (2, 9))
        base_cache = base(input_ids, use_cache=True).past_key_values
        base_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in base_cache.layers)
        dual_cache = model(input_ids, use_cache=True).past_key_values
        primary_cache = model(input_ids, use_cache=True, use_aux_flow=False).past_key_values
        assert dual_cache.nbytes() == primary_cache.nbytes() == base_bytes
        assert base_bytes == 2 * 2 * config.num_hidden_layers * config.num_key_value_heads * 9 * config.head_dim * 4


class TestOutputsAndLoss:
    def test_loss_is_aux_ce_plus_weighted_primary_ce_plus_balance(self):
        model = tiny_model(primary_loss_weight=0.5)
        input_ids = torch.randint(0, 97, (2, 6))
        out = model(input_ids, labels=input_ids, output_router_logits=True)

        def causal_ce(logits):
            return F.cross_entropy(logits[:, :-1].reshape(-1, 97), input_ids[:, 1:].reshape(-1))

        expected = causal_ce(out.logits) + 0.5 * causal_ce(out.primary_logits)
        torch.testing.assert_close(out.loss, expected + model.config.router_aux_loss_coef * out.aux_loss)
        off = model(input_ids, labels=input_ids, use_aux_flow=False)
        torch.testing.assert_close(off.loss, causal_ce(off.logits))
        assert len(out.router_logits) == 2 and out.router_logits[0].shape == (2 * 6, 4)
        assert len(out.aux_router_logits) == 2 and out.aux_router_logits[0].shape == (2 * 6, 4)

    def test_balance_loss_is_per_flow(self):
        model = tiny_model(aux_num_experts_per_tok=3)
        input_ids, attention_mask = left_padded_batch([6, 4])
        out = model(input_ids, attention_mask=attention_mask, logits_to_keep=2, output_router_logits=True)
        primary, aux = out.router_logits, out.aux_router_logits  # (batch * T, experts), (batch * P, experts)
        assert primary[0].shape == (2 * 6, 4) and aux[0].shape == (2 * 2, 4)
        expected = load_balancing_loss_func(primary, 4, 2, attention_mask) + load_balancing_loss_func(
            aux, 4, 3, attention_mask[:, 4:]
        )
        torch.testing.assert_close(out.aux_loss, expected)
        off = model(input_ids, attention_mask=attention_mask, output_router_logits=True, use_aux_flow=False)
        torch.testing.assert_close(off.aux_loss, load_balancing_loss_func(primary, 4, 2, attention_mask))
        assert off.aux_router_logits is None

    @pytest.mark.parametrize("logits_to_keep", [0, 2])
    def test_balance_loss_is_invariant_to_left_padding(self, logits_to_keep):
        model = tiny_model(aux_num_experts_per_tok=3)
        input_ids = torch.randint(1, 97, (1, 6))
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), input_ids], dim=1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
        kwargs = dict(logits_to_keep=logits_to_keep, output_router_logits=True)
        plain = model(input_ids, **kwargs).aux_loss
        torch.testing.assert_close(model(padded, attention_mask=mask, **kwargs).aux_loss, plain, atol=1e-5, rtol=0)

    def test_hidden_states_and_attentions_split_by_flow(self):
        model = tiny_model(attn_implementation="eager")
        input_ids = torch.randint(0, 97, (2, 6))
        out = model(input_ids, logits_to_keep=2, output_hidden_states=True, output_attentions=True)
        assert len(out.hidden_states) == 3 and out.hidden_states[0].shape == (2, 6, 32)
        assert out.aux_hidden_states[0].shape == (2, 2, 32)
        torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(input_ids))
        torch.testing.assert_close(out.aux_hidden_states[0], model.model.aux_embed_tokens(input_ids[:, 4:]))
        assert out.attentions[0].shape == (2, 4, 6, 6) and out.aux_attentions[0].shape == (2, 4, 2, 6)
        # the last entry is what the LM head reads, as in transformers' causal LMs
        torch.testing.assert_close(model.lm_head(out.hidden_states[-1][:, 4:]), out.primary_logits)
        torch.testing.assert_close(model.lm_head(out.aux_hidden_states[-1]), out.logits)

    def test_logits_to_keep_tensor_may_reorder_and_return_dict_false(self):
        model = tiny_model()
        input_ids = torch.randint(0, 97, (1, 4))
        full = model(input_ids)
        order = torch.tensor([3, 2, 1, 0])
        reordered = model(input_ids, logits_to_keep=order)
        torch.testing.assert_close(reordered.logits, full.logits[:, order])
        torch.testing.assert_close(reordered.primary_logits, full.primary_logits[:, order])
        with pytest.raises(ValueError, match="labels need logits at every position"):
            model(input_ids, labels=input_ids, logits_to_keep=order)
        as_tuple = model(input_ids, return_dict=False)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], full.logits)

    def test_gradient_checkpointing_gives_same_gradients(self):
        grads = []
        for checkpointing in (False, True):
            model = tiny_model().train()
            if checkpointing:
                enable_activation_checkpointing(model)
            input_ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
            model(input_ids, labels=input_ids).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and "model.aux_embed_tokens.weight" in grads[0]
        for name in grads[0]:
            torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


class TestInitAndResize:
    def test_from_scratch_init(self):
        model = tiny_model(random_coupling=False)
        assert all(torch.count_nonzero(layer.aux_coupling.weight) == 0 for layer in model.model.layers)
        assert not torch.equal(model.model.aux_embed_tokens.weight, model.model.embed_tokens.weight)
        assert model.model.aux_embed_tokens.weight.std() > 0.01

    @pytest.mark.parametrize("variant", ["moe", "dense", "olmoe_full_qk_norm_clip"])
    def test_upcycling_init_reproduces_primary(self, variant):
        model = tiny_model(**VARIANTS[variant])
        init_aux_from_primary(model)
        input_ids = torch.randint(0, 97, (2, 7))
        out = model(input_ids)
        torch.testing.assert_close(out.logits, out.primary_logits, atol=1e-5, rtol=0)

    def test_resize_token_embeddings_resizes_aux_embedding(self):
        model = tiny_model()
        old_aux = model.model.aux_embed_tokens.weight.detach().clone()
        model.resize_token_embeddings(120)
        assert model.model.aux_embed_tokens.weight.shape == (120, 32) == model.model.embed_tokens.weight.shape
        torch.testing.assert_close(model.model.aux_embed_tokens.weight[:97], old_aux)
        assert model(torch.tensor([[119, 3, 100]])).logits.shape == (1, 3, 120)
        # transformers' mean-resizing rule: added rows drawn around the old rows' mean with 1e-9 of their covariance
        torch.testing.assert_close(
            model.model.aux_embed_tokens.weight[97:], old_aux.mean(0).expand(23, -1), atol=1e-5, rtol=0
        )
        model.resize_token_embeddings(150, mean_resizing=False)  # else drawn like a new embedding
        assert 0.01 < model.model.aux_embed_tokens.weight[120:].std() < 0.04  # initializer_range 0.02
        old_rows = model.model.aux_embed_tokens.weight.detach().clone()
        model.resize_token_embeddings(90)
        assert torch.equal(model.model.aux_embed_tokens.weight, old_rows[:90])

    def test_freeze_for_aux_training(self):
        model = tiny_model()
        freeze_for_aux_training(model)
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        assert trainable == {"model.aux_embed_tokens.weight"} | {
            f"model.layers.{i}.aux_coupling.weight" for i in range(2)
        }

    def test_freeze_aux_flow_is_the_inverse_of_freeze_for_aux_training(self):
        model = tiny_model(aux_adapter_rank=2, aux_num_rounds=2)
        aux = {name for name, p in freeze_for_aux_training(model).named_parameters() if p.requires_grad}
        shared = {name for name, p in freeze_aux_flow(model).named_parameters() if p.requires_grad}
        assert aux == set(model.aux_parameter_names()) and "model.layers.1.aux_round_gate.weight" in aux
        assert shared == {name for name, _ in model.named_parameters()} - aux and "lm_head.weight" in shared


class TestBadInputs:
    def test_token_id_out_of_range(self):
        with pytest.raises(ValueError, match="token id 97 outside the vocabulary"):
            tiny_model()(torch.tensor([[1, 97]]))
        with pytest.raises(ValueError, match="token id -1"):
            tiny_model()(torch.tensor([[1, -1]]))

    def test_token_id_check_reads_cpu_tensors_only(self):
        # On an accelerator the check would stall every decode step on a device-to-host copy; a meta tensor (which
        # cannot be read back at all) stands in for one here.
        model = tiny_model()
        model.model._check_inputs(torch.tensor([[1, 500]], device="meta"), None, None, None, past_length=0)
        with pytest.raises(ValueError, match="token id 500"):
            model.model._check_inputs(torch.tensor([[1, 500]]), None, None, None, past_length=0)

    def test_one_dimensional_input_ids(self):
        with pytest.raises(ValueError, match="input_ids must have shape"):
            tiny_model()(torch.tensor([1, 2, 3]))

    def test_attention_mask_shape_mismatch(self):
        with pytest.raises(ValueError, match="attention_mask has shape"):
            tiny_model()(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 4, dtype=torch.long))

    def test_aux_inputs_embeds_shape(self):
        model = tiny_model()
        embeds = model.model.embed_tokens(torch.tensor([[1, 2]]))
        with pytest.raises(ValueError, match="aux_inputs_embeds has shape"):
            model(inputs_embeds=embeds, aux_inputs_embeds=embeds[:, :1])

    def test_aux_top_k_on_a_dense_model(self):
        model = tiny_model(num_experts=0)
        with pytest.raises(ValueError, match="aux_num_experts_per_tok=4 needs a MoE model"):
            model(torch.tensor([[1, 2]]), aux_num_experts_per_tok=4)
        with pytest.raises(ValueError, match="aux_num_experts_per_tok=4 needs a MoE model"):
            model.generate(torch.tensor([[1, 2]]), max_new_tokens=2, aux_num_experts_per_tok=4)

    def test_bad_aux_top_k_and_logits_to_keep(self):
        model = tiny_model()
        with pytest.raises(ValueError, match="aux_num_experts_per_tok"):
            model(torch.tensor([[1, 2]]), aux_num_experts_per_tok=5)
        with pytest.raises(ValueError, match="aux_num_experts_per_tok"):
            model(torch.tensor([[1, 2]]), aux_num_experts_per_tok=0)
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(torch.tensor([[1, 2]]), logits_to_keep=torch.tensor([2]))


def test_remote_code_round_trip_in_fresh_process(tmp_path):
    model = tiny_model(aux_num_experts_per_tok=3, qk_norm="per_head")
    model.save_pretrained(tmp_path / "ckpt")
    saved = set(os.listdir(tmp_path / "ckpt"))
    # every file the model file imports (`from .x import`, and what those import) is listed and travels with it
    folder, listed, pending = Path(modeling_dualflow.__file__).parent, set(), ["modeling_dualflow.py"]
    while pending:
        listed.add(name := pending.pop())
        tree = ast.parse((folder / name).read_text())
        pending += [f"{n.module}.py" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1]
    assert listed == set(modeling_dualflow.REMOTE_CODE_FILES) and len(listed) == 5
    assert {*listed, "config.json"} <= saved
    auto_map = json.loads((tmp_path / "ckpt" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_dualflow.DualFlowForCausalLM"
    assert auto_map["AutoModel"] == "modeling_dualflow.DualFlowModel"
    input_ids = torch.randint(0, 97, (1, 6))
    expected = model.generate(input_ids, max_new_tokens=4, do_sample=False)
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["modeling_dualflow"] = None  # the package must not be importable here
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        from transformers import AutoModel
        base = AutoModel.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True)
        assert type(base).__name__ == "DualFlowModel", type(base)
        print(model.generate(torch.tensor({input_ids.tolist()}), max_new_tokens=4, do_sample=False).tolist())
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(expected.tolist())


def test_native_auto_registration():
    config = tiny_config()
    assert type(AutoModelForCausalLM.from_config(config)) is DualFlowForCausalLM


def test_remote_code_files_import_only_libraries_and_each_other():
    """The files copied into every checkpoint import nothing of this project outside modeling_dualflow/."""
    folder = os.path.dirname(modeling_dualflow.__file__)
    for name in (*modeling_dualflow.REMOTE_CODE_FILES, "__init__.py"):
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert not set(roots) & {"dualflow", "convert", "model_cards", "modeling_dualflow"}, (name, roots)
    assert DualFlowForCausalLM.push_to_hub is PreTrainedModel.push_to_hub


def test_each_layer_says_what_it_holds():
    """Optional modules are None when the config has none of them (no hasattr probing), present otherwise."""
    plain = tiny_model(num_experts=0)
    layer = plain.model.layers[0]
    assert layer.self_attn.q_norm is None and layer.self_attn.k_norm is None
    assert layer.self_attn.aux_q_adapter is None and layer.aux_mlp_adapter is None and layer.aux_round_gate is None
    assert tiny_model().model.layers[0].mlp.shared_expert is None
    full = tiny_model(
        qk_norm="full", aux_adapter_rank=2, aux_num_rounds=2, shared_expert_intermediate_size=8, norm_topk_prob=False
    )
    layer = full.model.layers[0]
    assert isinstance(layer.self_attn.q_norm, torch.nn.Module) and isinstance(layer.aux_round_gate, torch.nn.Module)
    assert isinstance(layer.aux_mlp_adapter, torch.nn.Module) and isinstance(layer.mlp.shared_expert, torch.nn.Module)
    # the coupling and the round gate are one class with their own init values (0 and aux_round_gate_init)
    assert type(layer.aux_coupling) is type(layer.aux_round_gate)
    assert (layer.aux_coupling.init_value, layer.aux_round_gate.init_value) == (0.0, full.config.aux_round_gate_init)
