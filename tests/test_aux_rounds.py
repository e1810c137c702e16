"""
`aux_num_rounds` (issue 13): the aux flow passes R times through the shared layers. The design invariants (grouped ==
reference, primary isolation, cached == uncached with left padding) run for R = 2 and 3 through test_modeling's
`rounds_*` variants; this file pins what is specific to rounds.
"""

import pytest
import torch
from helpers import (
    VARIANTS,
    assert_parity,
    left_padded_batch,
    make_source,
    run_dualflow,
    save_source,
    tiny_config,
    tiny_model,
)
from reference import two_pass_forward
from transformers import AutoConfig, DynamicCache

from dualflow.aux_training import freeze_for_aux_training
from dualflow.convert import init_aux_from_primary
from modeling_dualflow import DualFlowForCausalLM


def rounds_model(num_rounds=3, **overrides):
    """Tiny model built for up to `num_rounds` rounds, with random couplings and round gates."""
    return tiny_model(aux_num_rounds=num_rounds, **{**VARIANTS.get(overrides.pop("variant", "moe"), {}), **overrides})


class TestConfigAndArguments:
    def test_default_is_one_round_without_gates(self):
        model = tiny_model()
        assert model.config.aux_num_rounds == 1
        assert not [name for name, _ in model.named_parameters() if "aux_round_gate" in name]
        gated = rounds_model(2)
        gates = {name for name, _ in gated.named_parameters() if "aux_round_gate" in name}
        assert gates == {f"model.layers.{i}.aux_round_gate.weight" for i in range(2)}

    def test_bad_values_give_clear_errors(self):
        with pytest.raises(ValueError, match="aux_num_rounds must be >= 1, got 0"):
            tiny_config(aux_num_rounds=0)
        input_ids = torch.tensor([[1, 2, 3]])
        with pytest.raises(ValueError, match="aux_num_rounds must be >= 1"):
            rounds_model(2)(input_ids, aux_num_rounds=0)
        with pytest.raises(ValueError, match="needs a model built with aux_num_rounds > 1"):
            tiny_model()(input_ids, aux_num_rounds=2)

    def test_round_gates_start_at_aux_round_gate_init_and_checkpoints_keep_theirs(self, tmp_path):
        closed = DualFlowForCausalLM(tiny_config(aux_num_rounds=2, aux_round_gate_init=0.0))
        assert all((layer.aux_round_gate.weight == 0).all() for layer in closed.model.layers)
        opened = DualFlowForCausalLM(tiny_config(aux_num_rounds=2))  # default for a new model with rounds: open
        assert opened.config.aux_round_gate_init == 1.0 and tiny_config().aux_round_gate_init == 0.0
        assert all((layer.aux_round_gate.weight == 1).all() for layer in opened.model.layers)
        with torch.no_grad():
            opened.model.layers[0].aux_round_gate.weight.fill_(0.3)
        opened.save_pretrained(tmp_path / "opened")
        loaded = DualFlowForCausalLM.from_pretrained(tmp_path / "opened")
        assert loaded.config.aux_round_gate_init == 1.0
        assert torch.equal(loaded.model.layers[0].aux_round_gate.weight, torch.full((loaded.config.hidden_size,), 0.3))
        # a one-round checkpoint loaded with two rounds: the missing gates start at the default 0, the identity
        one_round = tiny_model()
        one_round.save_pretrained(tmp_path / "one-round")
        two_rounds = DualFlowForCausalLM.from_pretrained(tmp_path / "one-round", aux_num_rounds=2)
        input_ids = torch.randint(0, 97, (2, 7))
        assert torch.equal(two_rounds(input_ids).logits, one_round(input_ids).logits)

    def test_config_round_trip(self, tmp_path):
        tiny_config(aux_num_rounds=3).save_pretrained(tmp_path)
        assert AutoConfig.from_pretrained(tmp_path).aux_num_rounds == 3


class TestOneRoundIsToday:
    """R = 1 computes exactly what the model computed before rounds existed."""

    @pytest.mark.parametrize("variant", ["moe_ka_gt_kp", "sliding_window"])
    def test_one_round_is_bit_identical_to_a_model_without_gates(self, variant):
        plain = tiny_model(**VARIANTS[variant])
        gated = DualFlowForCausalLM(tiny_config(aux_num_rounds=3, **VARIANTS[variant])).eval()
        missing, unexpected = gated.load_state_dict(plain.state_dict(), strict=False)
        assert unexpected == [] and all("aux_round_gate" in name for name in missing)
        input_ids, attention_mask = left_padded_batch([6, 4])
        expected = plain(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        actual = gated(input_ids, attention_mask=attention_mask, aux_num_rounds=1, output_hidden_states=True)
        assert torch.equal(actual.logits, expected.logits)
        assert torch.equal(actual.primary_logits, expected.primary_logits)
        assert all(torch.equal(a, b) for a, b in zip(actual.aux_hidden_states, expected.aux_hidden_states))
        generate = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=attention_mask)
        assert torch.equal(
            gated.generate(input_ids, aux_num_rounds=1, **generate), plain.generate(input_ids, **generate)
        )

    def test_zero_gates_make_extra_rounds_the_identity(self):
        # the upcycling guarantee: a converted model (gates 0) predicts as its source for any R
        model = rounds_model(3)
        init_aux_from_primary(model)
        input_ids = torch.randint(0, 97, (2, 7))
        out = model(input_ids)
        torch.testing.assert_close(out.logits, out.primary_logits, atol=1e-5, rtol=0)
        assert torch.equal(out.logits, model(input_ids, aux_num_rounds=1).logits)


class TestGroupedEqualsReference:
    @pytest.mark.parametrize("logits_to_keep", [1, torch.tensor([0, 2, 5])])
    @pytest.mark.parametrize("variant", ["moe_ka_gt_kp", "sliding_window"])
    def test_selected_positions_and_per_call_rounds(self, variant, logits_to_keep):
        model = rounds_model(2, variant=variant)
        input_ids = torch.randint(0, 97, (2, 6))
        positions = logits_to_keep if isinstance(logits_to_keep, torch.Tensor) else torch.tensor([5])
        outputs = []
        for num_rounds in (1, 2, 4):  # a per-call R may exceed the config's: every extra round uses the same gates
            out = model(input_ids, logits_to_keep=logits_to_keep, aux_num_rounds=num_rounds)
            _, aux = two_pass_forward(model, input_ids, DynamicCache(), aux_positions=positions, num_rounds=num_rounds)
            torch.testing.assert_close(out.logits, aux, atol=1e-5, rtol=0)
            outputs.append(out.logits)
        assert all((a - b).abs().max() > 1e-3 for a, b in zip(outputs, outputs[1:]))  # each extra round does something


class TestCachedEqualsUncached:
    def test_per_call_rounds_reach_every_generate_step(self):
        model = rounds_model(3)
        prompt = torch.randint(0, 97, (1, 5))
        kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
        out = model.generate(prompt, aux_num_rounds=2, **kwargs)
        full = model(out.sequences, aux_num_rounds=2).logits[:, 4:-1]
        torch.testing.assert_close(torch.stack(out.logits, dim=1), full, atol=1e-5, rtol=0)


def test_kv_bytes_do_not_depend_on_rounds():
    model = rounds_model(3)
    input_ids = torch.randint(0, 97, (2, 9))
    sizes = {r: model(input_ids, use_cache=True, aux_num_rounds=r).past_key_values.nbytes() for r in (1, 2, 3)}
    config = model.config
    expected = 2 * 2 * config.num_hidden_layers * config.num_key_value_heads * 9 * config.head_dim * 4
    assert set(sizes.values()) == {expected}


def test_outputs_describe_the_first_round_and_the_head_reads_the_last():
    model = rounds_model(2, attn_implementation="eager")
    input_ids = torch.randint(0, 97, (2, 6))
    out = model(input_ids, logits_to_keep=2, output_hidden_states=True, output_attentions=True)
    one_round = model(input_ids, logits_to_keep=2, output_hidden_states=True, aux_num_rounds=1)
    assert len(out.hidden_states) == len(out.aux_hidden_states) == 3 and len(out.attentions) == 2
    for state, expected in zip(out.aux_hidden_states[:-1], one_round.aux_hidden_states[:-1]):
        torch.testing.assert_close(state, expected)
    torch.testing.assert_close(model.lm_head(out.aux_hidden_states[-1]), out.logits)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_same_gradients(use_reentrant):
    grads = []
    for checkpointing in (False, True):
        model = rounds_model(2, variant="moe_ka_gt_kp").train()
        if checkpointing:
            # transformers < 5.23 names it gradient_checkpointing_enable
            enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
            enable({"use_reentrant": use_reentrant})
        input_ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
        model(input_ids, labels=input_ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # the extra round's gradient reaches the gates and, through the reused keys/values, k_proj / v_proj
    assert grads[0].keys() == grads[1].keys() and "model.layers.0.aux_round_gate.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_freeze_for_aux_training_trains_the_gates():
    model = freeze_for_aux_training(rounds_model(2))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(model.aux_parameter_names())
    assert {f"model.layers.{i}.aux_round_gate.weight" for i in range(2)} <= trainable


def test_convert_aux_rounds_writes_the_field_and_keeps_parity(tmp_path):
    source = make_source("qwen3_moe")
    src = save_source(source, tmp_path / "src", "sharded")
    code, stderr = run_dualflow("convert", src, tmp_path / "out", "--aux-rounds", 2)
    assert code == 0, stderr
    converted, _, _ = assert_parity(source, tmp_path / "out")  # the aux flow (2 rounds) still reproduces the source
    assert converted.config.aux_num_rounds == 2
    # the upcycling init, whatever a new model's defaults: closed gates (the config says so too), copied embedding
    assert (converted.config.aux_round_gate_init, converted.config.aux_embed_init) == (0.0, "copy")
    assert all(torch.count_nonzero(layer.aux_round_gate.weight) == 0 for layer in converted.model.layers)
    assert "--aux-rounds 2" in (tmp_path / "out" / "README.md").read_text()
    code, stderr = run_dualflow("convert", src, tmp_path / "bad", "--aux-rounds", 0)
    assert code != 0 and "--aux-rounds must be >= 1, got 0" in stderr and not (tmp_path / "bad").exists()


def test_static_cache_generation_matches_dynamic():
    model = rounds_model(2, variant="moe_ka_gt_kp")
    input_ids, attention_mask = left_padded_batch([5, 3])
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    kwargs |= dict(output_logits=True, return_dict_in_generate=True)
    dynamic = model.generate(input_ids, **kwargs)
    static = model.generate(input_ids, cache_implementation="static", **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=0)
