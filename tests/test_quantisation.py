"""
Quantised loading of a converted Dual-Flow side by side with its Qwen3-MoE source (transformers'
class): bitsandbytes 4-bit and 8-bit and torchao int8 weight-only quantise the same weights in both, the aux
flow's own modules stay full precision, and with the aux flow off the Dual-Flow model gives the source's greedy
tokens under the same quantisation.
"""

import pytest
import torch
from helpers import PROMPT, make_source, save_source
from torchao.quantization import FqnToConfig, Int8WeightOnlyConfig
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, FineGrainedFP8Config, TorchAoConfig
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

from dualflow.convert import convert_checkpoint
from dualflow.instruments.probes import stored_bytes
from dualflow.quantisation_libraries import cpu_unpackable_4bit_layers


QUANTISATIONS = {
    "bnb-4bit": lambda: BitsAndBytesConfig(load_in_4bit=True),
    "bnb-8bit": lambda: BitsAndBytesConfig(load_in_8bit=True),
    "torchao-int8": lambda: TorchAoConfig(Int8WeightOnlyConfig()),
}
GREEDY = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
# Qwen3-MoE's fused expert tensors, which torchao quantises when a config names them (`FqnToConfig`).
EXPERT_WEIGHTS = r"re:.*\.mlp\.experts\.(gate_up_proj|down_proj)"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """
    The tiny Qwen3-MoE source, its conversion, and a conversion with two aux rounds and aux adapters whose
    couplings, round gates and adapters look trained (non-zero).
    """
    root = tmp_path_factory.mktemp("quantisation")
    # projections bitsandbytes' 4-bit CPU kernel can repack on CPUs with AVX512-BF16 (test_peft.py checks the rule)
    packable = dict(hidden_size=64, head_dim=16, intermediate_size=64)
    source = save_source(make_source("qwen3_moe", **packable), root / "source", "single")
    convert_checkpoint(source, root / "dualflow", show_progress=False)
    convert_checkpoint(source, root / "adapted", aux_rounds=2, aux_adapter_rank=4, show_progress=False)
    coupled = AutoModelForCausalLM.from_pretrained(root / "adapted", trust_remote_code=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for name in coupled.aux_parameter_names():
            if "coupling" in name or "round_gate" in name or name.endswith("_adapter.up"):
                coupled.get_parameter(name).normal_(std=0.5)
    coupled.save_pretrained(root / "coupled")
    return {"source": source, "dualflow": root / "dualflow", "coupled": root / "coupled"}


def load(folder, quantization_config=None, **kwargs):
    kwargs.setdefault("dtype", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quantization_config, trust_remote_code=True, **kwargs
    )
    return model.eval()


def quantised_weights(model) -> set[str]:
    """Names of the parameters stored quantised (bitsandbytes' and torchao's types, not a plain Parameter)."""
    return {name for name, parameter in model.named_parameters() if type(parameter) is not torch.nn.Parameter}


def aux_bytes(model) -> int:
    return sum(model.get_parameter(name).nbytes for name in model.aux_parameter_names())


@pytest.mark.parametrize("method", list(QUANTISATIONS))
def test_same_weights_quantised_and_source_tokens_with_the_aux_flow_off(folders, method):
    source = load(folders["source"], QUANTISATIONS[method]())
    dualflow = load(folders["dualflow"], QUANTISATIONS[method]())
    quantised = quantised_weights(source)
    # Attention and the dense MLPs' projections; the fused experts, router and lm_head stay full precision.
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= quantised
    assert not any(".experts." in name or ".gate." in name or "lm_head" in name for name in quantised)
    assert quantised_weights(dualflow) == quantised  # the aux embedding and couplings left unquantised
    if method == "bnb-4bit":  # what runs here runs on CPUs with AVX512-BF16 too
        assert cpu_unpackable_4bit_layers(dualflow) == []

    expected = source.generate(PROMPT, **GREEDY)
    assert torch.equal(dualflow.generate(PROMPT, use_aux_flow=False, **GREEDY), expected)
    # Right after conversion the aux flow is the primary one (aux embedding a copy, couplings zero).
    assert torch.equal(dualflow.generate(PROMPT, **GREEDY), expected)

    # The Dual-Flow model's extra bytes are its aux modules, unquantised; both shrink by the same bytes.
    assert stored_bytes(dualflow) - stored_bytes(source) == aux_bytes(dualflow)
    saved = stored_bytes(load(folders["source"])) - stored_bytes(source)
    assert saved > 0 and stored_bytes(load(folders["dualflow"])) - stored_bytes(dualflow) == saved


@pytest.mark.parametrize("method", list(QUANTISATIONS))
def test_aux_flow_on_a_quantised_model_with_couplings(folders, method):
    source = load(folders["source"], QUANTISATIONS[method]())
    coupled = load(folders["coupled"], QUANTISATIONS[method]())
    assert not any("aux_" in name for name in quantised_weights(coupled))
    expected = source.generate(PROMPT, **GREEDY)
    assert torch.equal(coupled.generate(PROMPT, use_aux_flow=False, **GREEDY), expected)
    with torch.no_grad():
        output = coupled(PROMPT)
    # Couplings, round gates and adapters change the aux flow's predictions, not the primary flow's.
    assert (output.logits - output.primary_logits).abs().max() > 1e-2
    with torch.no_grad():
        torch.testing.assert_close(output.primary_logits, source(PROMPT).logits, rtol=0, atol=1e-5)
    generated = coupled.generate(PROMPT, **GREEDY)
    assert generated.shape == (PROMPT.shape[0], PROMPT.shape[1] + GREEDY["max_new_tokens"])


def test_torchao_quantises_the_fused_experts_of_both_when_told_to(folders):
    config = TorchAoConfig(FqnToConfig({EXPERT_WEIGHTS: Int8WeightOnlyConfig()}))
    # torchao's int8 tensors have no transpose, which the default (grouped_mm) experts kernel needs.
    source = load(folders["source"], config, experts_implementation="eager")
    dualflow = load(folders["dualflow"], config, experts_implementation="eager")
    experts = {f"model.layers.1.mlp.experts.{name}" for name in ("gate_up_proj", "down_proj")}
    assert quantised_weights(source) == experts == quantised_weights(dualflow)
    expected = source.generate(PROMPT, **GREEDY)
    assert torch.equal(dualflow.generate(PROMPT, use_aux_flow=False, **GREEDY), expected)
    assert torch.equal(dualflow.generate(PROMPT, **GREEDY), expected)


def test_fp8_swaps_the_same_modules_experts_included(folders):
    """
    transformers' block-FP8 quantizer (a GPU's, on the fly) swaps each `.experts` module for its FP8 experts
    and each nn.Linear but lm_head for an FP8 linear: run on both models' skeletons, it swaps the same modules.
    """
    swapped = {}
    for name in ("source", "dualflow"):
        config = AutoConfig.from_pretrained(folders[name], trust_remote_code=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
        FineGrainedFP8HfQuantizer(FineGrainedFP8Config())._process_model_before_weight_loading(model)
        kinds = {module_name: type(module).__name__ for module_name, module in model.named_modules()}
        swapped[name] = {module_name: kind for module_name, kind in kinds.items() if kind.startswith("FP8")}
    assert swapped["source"]["model.layers.1.mlp.experts"].startswith("FP8Experts")
    assert "model.layers.0.self_attn.q_proj" in swapped["source"] and "lm_head" not in swapped["source"]
    assert swapped["dualflow"] == swapped["source"]
