"""
`aux_adapter_rank` (issue 14): low-rank deltas on shared weights that act on aux rows only. Grouped == reference and
cached == uncached with left padding run through test_modeling's `adapters*` variants; this file pins the rest.
"""

import pytest
import torch
from helpers import (
    VARIANTS,
    assert_parity,
    byte_model,
    left_padded_batch,
    make_source,
    run_dualflow,
    run_finetune,
    save_source,
    stdlib_blocks,
    stdlib_text,
    tiny_config,
    tiny_model,
)
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from dualflow.convert import init_aux_from_primary
from modeling_dualflow import DualFlowCache, DualFlowForCausalLM


ADAPTER_VARIANTS = ["moe_ka_gt_kp", "dense", "olmoe_full_qk_norm_clip", "qwen3_per_head_qk_norm", "sliding_window"]


def adapter_names(num_layers=2):
    return {
        f"model.layers.{i}.{module}.{part}"
        for i in range(num_layers)
        for module in ("self_attn.aux_q_adapter", "self_attn.aux_o_adapter", "aux_mlp_adapter")
        for part in ("down", "up")
    }


def randomize_adapters(model, std=0.2):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("_adapter.up"):
                parameter.normal_(std=std)
    return model


def adapter_model(rank=4, variant="moe", **overrides):
    """Tiny model with aux adapters whose deltas are non-zero (tiny_model draws them, and the couplings)."""
    return tiny_model(aux_adapter_rank=rank, **{**VARIANTS[variant], **overrides})


class TestConfig:
    def test_default_builds_no_adapters_and_rank_builds_them(self):
        assert tiny_config().aux_adapter_rank == 0
        assert not [name for name, _ in tiny_model().named_parameters() if "_adapter" in name]
        model = tiny_model(aux_adapter_rank=3, random_coupling=False)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if "_adapter" in name}
        assert set(shapes) == adapter_names()
        assert shapes["model.layers.0.self_attn.aux_q_adapter.down"] == (3, 32)
        assert shapes["model.layers.0.self_attn.aux_o_adapter.up"] == (32, 3)
        # zero deltas at initialisation, but a random `down` so that training can move them
        for name, parameter in model.named_parameters():
            if name.endswith("_adapter.up"):
                assert torch.count_nonzero(parameter) == 0
            elif name.endswith("_adapter.down"):
                assert parameter.std() > 0.01

    def test_negative_rank_is_refused(self):
        with pytest.raises(ValueError, match="aux_adapter_rank must be >= 0"):
            tiny_config(aux_adapter_rank=-1)


@pytest.mark.parametrize("variant", ["moe_ka_gt_kp", "sliding_window"])
def test_zero_deltas_are_bit_identical_to_no_adapters(variant):
    # rank 0 is today's model; adapters at their initial zero delta change no bit of any output either
    plain = tiny_model(**VARIANTS[variant])
    adapted = DualFlowForCausalLM(tiny_config(aux_adapter_rank=4, **VARIANTS[variant])).eval()
    missing, unexpected = adapted.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and set(missing) == adapter_names()
    input_ids, attention_mask = left_padded_batch([6, 4])
    expected = plain(input_ids, attention_mask=attention_mask)
    actual = adapted(input_ids, attention_mask=attention_mask)
    assert torch.equal(actual.logits, expected.logits) and torch.equal(actual.primary_logits, expected.primary_logits)


@pytest.mark.parametrize("use_aux_flow", [False, True])
@pytest.mark.parametrize("logits_to_keep", [0, 1])
@pytest.mark.parametrize("variant", ["moe_ka_gt_kp", "dense", "qwen2moe_shared_expert"])
def test_primary_isolation_for_any_rank(variant, logits_to_keep, use_aux_flow):
    # Bit-exact wherever the primary rows go through the same kernels: serving the primary alone, and dense models.
    # With the aux flow on, a MoE layer's expert matmuls batch primary rows with the aux rows routed to the same expert,
    # and adapters change that routing: only float rounding may then differ (as with the couplings, DESIGN §7.1).
    input_ids, attention_mask = left_padded_batch([6, 4])

    def primary(model):
        cache = DualFlowCache(config=model.config)
        out = model(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            logits_to_keep=logits_to_keep,
            output_hidden_states=True,
            use_aux_flow=use_aux_flow,
        )
        return [out.primary_logits, *out.hidden_states, *(layer.keys for layer in cache.layers)]

    plain = tiny_model(**VARIANTS[variant])
    baseline = primary(plain)
    exact = not use_aux_flow or not plain.config.num_experts
    for rank in (1, 4, 16):
        model = DualFlowForCausalLM(tiny_config(aux_adapter_rank=rank, **VARIANTS[variant])).eval()
        model.load_state_dict(plain.state_dict(), strict=False)  # the same shared weights, plus adapters
        for std in (0.2, 5.0):
            for actual, expected in zip(primary(randomize_adapters(model, std)), baseline):
                if exact:
                    assert torch.equal(actual, expected)
                else:
                    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)


def test_kv_bytes_unchanged():
    input_ids = torch.randint(0, 97, (2, 9))
    plain = tiny_model()(input_ids, use_cache=True).past_key_values.nbytes()
    assert adapter_model(16)(input_ids, use_cache=True).past_key_values.nbytes() == plain


def test_gradient_checkpointing_gives_same_gradients():
    grads = []
    for checkpointing in (False, True):
        model = adapter_model(variant="moe_ka_gt_kp", aux_num_rounds=2).train()
        if checkpointing:
            # transformers < 5.23 names it gradient_checkpointing_enable
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        input_ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
        model(input_ids, labels=input_ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and adapter_names() <= grads[0].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_upcycling_init_zeroes_the_deltas():
    model = adapter_model(variant="moe")
    init_aux_from_primary(model)
    out = model(torch.randint(0, 97, (2, 7)))
    torch.testing.assert_close(out.logits, out.primary_logits, atol=1e-5, rtol=0)


def test_convert_aux_adapter_rank(tmp_path):
    source = make_source("mixtral")
    src = save_source(source, tmp_path / "src", "single")
    code, stderr = run_dualflow("convert", src, tmp_path / "out", "--aux-adapter-rank", 4)
    assert code == 0, stderr
    converted, _, _ = assert_parity(source, tmp_path / "out")
    assert converted.config.aux_adapter_rank == 4
    parameters = dict(converted.named_parameters())
    assert adapter_names(3) <= set(parameters)
    downs = [parameters[name] for name in sorted(adapter_names(3)) if name.endswith("down")]
    assert all(torch.count_nonzero(parameters[name]) == 0 for name in adapter_names(3) if name.endswith("up"))
    assert all(0.01 < down.std() < 0.03 for down in downs)  # N(0, initializer_range^2)
    assert not torch.equal(downs[0], downs[1])  # each tensor its own draw
    run_dualflow("convert", src, tmp_path / "again", "--aux-adapter-rank", 4)
    again = DualFlowForCausalLM.from_pretrained(tmp_path / "again")
    assert all(torch.equal(again.get_parameter(name), parameters[name]) for name in adapter_names(3))  # reproducible
    code, stderr = run_dualflow("convert", src, tmp_path / "bad", "--aux-adapter-rank", -2)
    assert code != 0 and "--aux-adapter-rank must be in [0, hidden_size=" in stderr


def test_finetune_aux_only_trains_the_adapters_and_keeps_primary(tmp_path):
    model_dir = tmp_path / "model"
    byte_model(aux_adapter_rank=4, aux_num_experts_per_tok=4).save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=6000), encoding="utf-8")
    common = ("--block-size", 32, "--batch-size", 4, "--max-steps", 4, "--lr", 1e-2)
    assert run_finetune(model_dir, "--data", data, "--output-dir", tmp_path / "aux", "--aux-only", *common) == 0
    source = AutoModelForCausalLM.from_pretrained(model_dir)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "aux")
    aux_names = set(source.aux_parameter_names())
    assert adapter_names() <= aux_names
    for name, parameter in source.named_parameters():
        assert torch.equal(trained.get_parameter(name), parameter) != (name in aux_names), name
    probe = stdlib_blocks(32, chars=2000)[:2]
    with torch.no_grad():
        assert torch.equal(trained(probe).primary_logits, source(probe).primary_logits)


def test_adding_adapters_to_a_saved_model_at_load(tmp_path):
    # `from_pretrained(folder, aux_adapter_rank=r)` on a checkpoint without adapters initialises them (zero deltas)
    model = tiny_model()
    model.save_pretrained(tmp_path)
    adapted = DualFlowForCausalLM.from_pretrained(tmp_path, aux_adapter_rank=4).eval()
    parameters = dict(adapted.named_parameters())
    assert all(torch.count_nonzero(parameters[name]) == 0 for name in adapter_names() if name.endswith("up"))
    assert all(parameters[name].std() > 0.01 for name in adapter_names() if name.endswith("down"))
    input_ids = torch.randint(0, 97, (2, 6))
    torch.testing.assert_close(adapted(input_ids).logits, model(input_ids).logits, atol=1e-6, rtol=0)
