"""PEFT LoRA on Dual-Flow models: what is trained, adapter save / reload on a fresh base, merge_and_unload."""

import pytest
import torch
from helpers import byte_model, stdlib_blocks, tiny_model
from peft import PeftModel
from peft.tuners.lora import LoraLayer, ParamWrapper
from transformers import AutoModelForCausalLM

from dualflow.finetune import make_trainer
from dualflow.lora import add_lora
from modeling_dualflow import DualFlowForCausalLM


def test_lora_adapts_attention_and_fused_experts_and_trains_aux_in_full():
    peft_model = add_lora(tiny_model(), r=4, lora_alpha=8)
    base = peft_model.get_base_model()
    for layer in base.model.layers:
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(layer.self_attn, projection), LoraLayer)
        # Both fused expert tensors are adapted: PEFT nests one ParamWrapper per target parameter.
        experts = layer.mlp.experts
        assert isinstance(experts, ParamWrapper) and isinstance(experts.base_layer, ParamWrapper)
        assert {experts.parameter_name, experts.base_layer.parameter_name} == {"gate_up_proj", "down_proj"}
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert "base_model.model.model.aux_embed_tokens.modules_to_save.default.weight" in trainable
    assert {
        f"base_model.model.model.layers.{i}.aux_coupling.modules_to_save.default.weight" for i in range(2)
    } <= trainable
    others = trainable - {name for name in trainable if "lora_" in name or "aux_" in name}
    assert not others


def test_lora_on_dense_model_adapts_mlp_linears():
    peft_model = add_lora(tiny_model(num_experts=0), r=4)
    mlp = peft_model.get_base_model().model.layers[0].mlp
    assert all(isinstance(getattr(mlp, name), LoraLayer) for name in ("gate_proj", "up_proj", "down_proj"))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_experts": 0}, {"aux_num_rounds": 2, "aux_adapter_rank": 4}],
    ids=["moe", "dense", "round_gates_and_aux_adapters"],
)
def test_lora_adapter_round_trip_and_merge(tmp_path, overrides):
    byte_model(**overrides).save_pretrained(tmp_path / "base")
    fresh_base = lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()  # noqa: E731
    blocks = stdlib_blocks(block_size=32, chars=6000)
    probe = blocks[:2]

    peft_model = add_lora(fresh_base(), r=4, lora_alpha=8)
    make_trainer(
        peft_model, blocks, None, tmp_path / "work", max_steps=4, learning_rate=1e-2, disable_tqdm=True
    ).train()
    peft_model.eval()
    with torch.no_grad():
        trained = peft_model(probe)
        untouched = fresh_base()(probe)
    # Training moved every kind of adapted weight: LoRA, aux embedding and couplings all change the predictions.
    assert (trained.logits - untouched.logits).abs().max() > 1e-3
    assert (trained.primary_logits - untouched.primary_logits).abs().max() > 1e-3
    # Every aux parameter (embedding, couplings, and round gates / aux adapters where built) has a trained copy.
    untrained = fresh_base()
    original = dict(untrained.named_parameters())
    copies = {
        name.removeprefix("base_model.model.").replace(".modules_to_save.default", ""): parameter
        for name, parameter in peft_model.named_parameters()
        if ".modules_to_save.default." in name
    }
    assert copies.keys() == set(untrained.aux_parameter_names())
    assert all(not torch.equal(copy, original[name]) for name, copy in copies.items())
    peft_model.save_pretrained(tmp_path / "adapter")  # plain PEFT: the aux modules travel in modules_to_save

    reloaded = PeftModel.from_pretrained(fresh_base(), tmp_path / "adapter").eval()
    assert isinstance(reloaded, PeftModel)
    with torch.no_grad():
        reloaded_out = reloaded(probe)
    torch.testing.assert_close(reloaded_out.logits, trained.logits, rtol=0, atol=1e-5)

    merged = reloaded.merge_and_unload()
    assert type(merged) is DualFlowForCausalLM
    assert not any("lora_" in name or "modules_to_save" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        merged_out = merged(probe)
    torch.testing.assert_close(merged_out.logits, trained.logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(merged_out.primary_logits, trained.primary_logits, rtol=0, atol=1e-4)

    # The merged model is a plain checkpoint again.
    merged.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        saved_out = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(probe)
    torch.testing.assert_close(saved_out.logits, trained.logits, rtol=0, atol=1e-4)
