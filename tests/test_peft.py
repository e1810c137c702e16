"""
PEFT LoRA on Dual-Flow models: what is trained, adapter save / reload on a fresh base, merge_and_unload, QLoRA
on a 4-bit base (`dualflow finetune --load-in-4bit`), and the experts reached as PEFT's "all-linear" reaches
Qwen3-MoE's.
"""

import copy
import logging
import sys
import warnings

import bitsandbytes.functional
import pytest
import torch
from bitsandbytes.functional import _convert_weight_packed_for_cpu
from bitsandbytes.nn import Linear4bit
from helpers import byte_model, make_source, pack_texts, run_finetune, stdlib_blocks, stdlib_text, tiny_model
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer, ParamWrapper
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from dualflow.convert import convert_checkpoint
from dualflow.finetune import flow_nll, make_trainer, split_blocks
from dualflow.lora import add_lora, qlora_quantization_config
from dualflow.quantisation_libraries import cpu_unpackable_4bit_layers, held_back_kernel_fetch_logs, kernel_fetch_note
from modeling_dualflow import DualFlowForCausalLM


# The 4-bit tests' model: projections bitsandbytes can repack for its CPU kernel on CPUs with AVX512-BF16 (out_features
# in multiples of 32, in_features in blocks of 64); the 32-wide tiny model's cannot be.
PACKABLE = dict(hidden_size=64, intermediate_size=64)


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


def test_qlora_trains_on_a_4bit_base_and_the_saved_adapter_gives_the_same_tokens(tmp_path):
    byte_model(**PACKABLE).save_pretrained(tmp_path / "base")
    load_in_4bit = lambda: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        tmp_path / "base", quantization_config=qlora_quantization_config()
    ).eval()
    blocks = stdlib_blocks(block_size=32, chars=6000)
    prompt = blocks[:2, :8]
    greedy = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)

    peft_model = add_lora(load_in_4bit(), r=4, lora_alpha=8)
    layer = peft_model.get_base_model().model.layers[0]
    assert isinstance(layer.self_attn.q_proj.base_layer, Linear4bit)  # LoRA on the 4-bit weights
    assert isinstance(layer.mlp.experts, ParamWrapper)  # the fused experts, unquantised, adapted too
    make_trainer(
        peft_model, blocks, None, tmp_path / "work", max_steps=4, learning_rate=1e-2, disable_tqdm=True
    ).train()
    peft_model.eval()
    with torch.no_grad():
        trained = peft_model(prompt).logits
        assert (trained - load_in_4bit()(prompt).logits).abs().max() > 1e-3
    tokens = peft_model.generate(prompt, **greedy)
    peft_model.save_pretrained(tmp_path / "adapter")

    reloaded = PeftModel.from_pretrained(load_in_4bit(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(prompt).logits, trained, rtol=0, atol=1e-5)
    assert torch.equal(reloaded.generate(prompt, **greedy), tokens)


def test_a_saved_qlora_adapter_loads_without_pattern_warnings_and_with_twice_the_rank_on_gate_up_proj(tmp_path):
    """
    PEFT checks rank and alpha pattern keys against the modules it adapted only: a key naming the gate_up_proj
    parameter was reported as ignored on every load, though applied.
    """
    byte_model(**PACKABLE).save_pretrained(tmp_path / "base")
    load_in_4bit = lambda: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        tmp_path / "base", quantization_config=qlora_quantization_config()
    )
    add_lora(load_in_4bit(), r=4, lora_alpha=8).save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = PeftModel.from_pretrained(load_in_4bit(), tmp_path / "adapter")
    assert not [warning for warning in caught if "_pattern keys" in str(warning.message)]

    ranks = {}  # (parameter or module name, rank, scaling) of every LoRA in layer 0
    for name, module in reloaded.get_base_model().model.layers[0].named_modules():
        if isinstance(module, LoraLayer):
            target = module.parameter_name if isinstance(module, ParamWrapper) else name.split(".")[-1]
            ranks[target] = (module.r["default"], module.scaling["default"])
    assert ranks.pop("gate_up_proj") == (8, 2.0)  # two projections, one rank-4 LoRA each
    assert ranks.keys() >= {"q_proj", "o_proj", "down_proj", "weight"}  # attention, experts' down_proj, router
    assert set(ranks.values()) == {(4, 2.0)}


def test_the_lora_recipe_adapts_what_all_linear_adapts_in_qwen3_moe_but_the_router(tmp_path):
    """
    PEFT's "all-linear" reaches Qwen3-MoE's fused experts and router through its table of transformers' model
    types, which a remote-code model type is not in; the recipe names the experts itself (the router: not yet, the
    model's MoE block reads an attribute of its router, which PEFT's wrapper hides).
    """
    source = make_source("qwen3_moe", decoder_sparse_step=1)  # every layer MoE, as in the Qwen3-MoE releases
    source.save_pretrained(tmp_path / "source")
    convert_checkpoint(tmp_path / "source", tmp_path / "dualflow", show_progress=False)
    dualflow = AutoModelForCausalLM.from_pretrained(tmp_path / "dualflow", trust_remote_code=True)
    assert get_peft_model(dualflow, LoraConfig(target_modules="all-linear")).targeted_parameter_names == []

    dualflow = AutoModelForCausalLM.from_pretrained(tmp_path / "dualflow", trust_remote_code=True)
    ours = add_lora(dualflow, r=4, lora_alpha=8, train_aux_modules=False)
    theirs = get_peft_model(source, LoraConfig(target_modules="all-linear", r=4, lora_alpha=8))

    def adapted(peft_model):  # trainable LoRA tensors by name: shape and scaling
        return {
            name: (tuple(parameter.shape), scaling)
            for name, parameter in peft_model.named_parameters()
            if parameter.requires_grad
            for scaling in [_scaling(peft_model, name)]
        }

    expected = adapted(theirs)
    assert adapted(ours) == expected
    assert any(".mlp.experts." in name for name in expected)


def _scaling(peft_model, parameter_name: str) -> float:
    module = peft_model.get_submodule(parameter_name.split(".lora_")[0])
    return module.scaling["default"]


def test_finetune_load_in_4bit_saves_the_adapter_it_trained(tmp_path, capsys):
    byte_model(**PACKABLE).save_pretrained(tmp_path / "model")
    ByT5Tokenizer().save_pretrained(tmp_path / "model")
    text = stdlib_text("textwrap.py", chars=6000)
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    argv = ("--data", tmp_path / "corpus.txt", "--output-dir", tmp_path / "adapter", "--block-size", 32)
    argv += ("--lora", "--load-in-4bit", "--lora-r", 4, "--batch-size", 4, "--max-steps", 4, "--lr", 1e-2)
    assert run_finetune(tmp_path / "model", *argv, "--eval-blocks", 2) == 0
    after = capsys.readouterr().out.split("eval NLL per token (nats) after:")[1].splitlines()[0]

    # The saved adapter on the 4-bit base measures what the run measured on the model it trained in memory.
    quantization_config = qlora_quantization_config()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", quantization_config=quantization_config)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    _, eval_blocks = split_blocks(pack_texts([text], ByT5Tokenizer(), 32), 0.1)
    nll = flow_nll(reloaded, eval_blocks[:2])
    assert after.strip() == ", ".join(f"{name} {value:.4f}" for name, value in nll.items())
    experts = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert set(reloaded.peft_config["default"].target_parameters) == experts | {"mlp.gate.weight"}
    assert "rank-4 adapters (alpha 32)" in (tmp_path / "adapter" / "README.md").read_text()  # as asked, per projection


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--load-in-4bit",), "--load-in-4bit needs --lora (QLoRA): a full or --aux-only run saves the whole"),
        (("--load-in-4bit", "--aux-only"), "--load-in-4bit needs --lora (QLoRA)"),
    ],
)
def test_load_in_4bit_without_lora_is_a_one_line_error(tmp_path, capsys, argv, message):
    (tmp_path / "corpus.txt").write_text("some text")
    assert run_finetune(tmp_path / "model", "--data", tmp_path / "corpus.txt", *argv) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("dualflow finetune: error: ") and message in error[0]


def test_load_in_4bit_without_bitsandbytes_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: imports of it fail
    (tmp_path / "corpus.txt").write_text("some text")
    argv = ("--data", tmp_path / "corpus.txt", "--lora", "--load-in-4bit")
    assert run_finetune(tmp_path / "model", *argv) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["dualflow finetune: error: --load-in-4bit needs bitsandbytes: pip install bitsandbytes"]


@pytest.mark.parametrize("shape", [{}, PACKABLE], ids=["tiny", "packable"])
def test_the_4bit_shape_rule_agrees_with_bitsandbytes_cpu_repacking(tmp_path, shape):
    """
    On a CPU with AVX512-BF16, bitsandbytes repacks each 4-bit weight for its CPU kernel at the layer's first forward
    outside training. The repacking itself is plain torch and runs on any CPU: it succeeds on exactly the layers the
    package's rule passes, and the 4-bit tests' model passes everywhere.
    """
    byte_model(**shape).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=qlora_quantization_config())
    layers = {name: module for name, module in model.named_modules() if isinstance(module, Linear4bit)}
    unpackable = cpu_unpackable_4bit_layers(model)
    assert layers and bool(unpackable) == (shape != PACKABLE)
    for name, layer in layers.items():
        state = copy.deepcopy(layer.weight.quant_state)
        try:
            _convert_weight_packed_for_cpu(layer.weight.data.clone(), state)
        except (AssertionError, RuntimeError):
            assert name in unpackable
        else:
            assert name not in unpackable and state.packing_format_for_cpu


def test_finetune_load_in_4bit_refuses_what_the_avx512_bf16_kernel_cannot_pack(tmp_path, capsys, monkeypatch):
    # bitsandbytes' answer for a CPU with AVX512-BF16 (this CPU's own answer decides which path it takes)
    monkeypatch.setattr(bitsandbytes.functional, "has_avx512bf16", lambda: True)
    byte_model().save_pretrained(tmp_path / "model")
    ByT5Tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "corpus.txt").write_text(stdlib_text("textwrap.py", chars=3000), encoding="utf-8")
    capsys.readouterr()
    argv = ("--data", tmp_path / "corpus.txt", "--output-dir", tmp_path / "adapter", "--block-size", 32)
    assert run_finetune(tmp_path / "model", *argv, "--lora", "--load-in-4bit", "--max-steps", 1) == 2
    *progress, error = capsys.readouterr().err.strip().splitlines()
    assert all("%|" in line or not line for line in progress)  # tokenizing and loading, then the refusal
    assert error == (
        "dualflow finetune: error: bitsandbytes' 4-bit kernel for this CPU (AVX512-BF16) needs out_features in "
        "multiples of 32 and in_features in multiples of 64; 8 layers are not (model.layers.0.self_attn.q_proj: "
        "32 -> 32): load this model without --load-in-4bit"
    )
    assert not (tmp_path / "adapter").exists()  # refused before the run wrote anything


def test_what_bitsandbytes_logs_while_loading_becomes_one_note(capfd, caplog):
    # On a CPU with AVX512-BF16, importing bitsandbytes fetches its 4-bit kernel from the Hub and logs when it cannot
    # (bitsandbytes 0.50.2's words, through its own logger); offline, `kernels` also logs that it skips a check.
    capfd.readouterr()
    with held_back_kernel_fetch_logs() as messages:
        logging.getLogger("kernels._internals.hf_hub").warning(
            "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face "
            "Hub is in offline mode."
        )
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip "
            "install kernels` and the kernels >= 0.11.1",
            "Cannot reach https://huggingface.co",
        )
    assert capfd.readouterr().err == "" and caplog.text == ""  # held back: neither printed nor passed on
    assert kernel_fetch_note(messages) == (
        "note: bitsandbytes could not fetch its CPU 4-bit kernel from the Hub "
        "(kernels-community/quantization-bitsandbytes; offline, or no `kernels` package): it computes with its "
        "built-in kernel instead"
    )
    assert kernel_fetch_note(messages[:1]) is None  # a kernel fetched before, loaded offline: nothing to say
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning("after the block")
    assert "after the block" in caplog.text  # the loggers speak again
