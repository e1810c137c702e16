"""
Beyond one device: accelerate placement with CPU/disk offload (in process), transformers' parallel plans, FSDP2
training and tensor / expert parallel inference under torchrun with gloo on CPU (marked `multiprocess`).
"""

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM
from modeling_dualflow.modeling_dualflow import CACHE_FIELD


SCRIPTS = Path(__file__).parent / "distributed"
# Each torchrun process gets one thread: the CI machine has 2 cores for 2 processes.
SUBPROCESS_ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def left_padded_prompts(vocab_size: int = 97):
    input_ids = torch.randint(1, vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    return input_ids, attention_mask


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def assert_same_predictions(reference, model, input_ids, attention_mask):
    """Same logits (both flows) on a padded batch, same greedy tokens with the aux flow on and off, same cache."""
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=attention_mask)
        actual = model(input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(actual.primary_logits, expected.primary_logits, rtol=0, atol=1e-5)
    for use_aux_flow in (True, False):
        options = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, use_aux_flow=use_aux_flow)
        expected_run = reference.generate(input_ids, return_dict_in_generate=True, **options)
        actual_run = model.generate(input_ids, return_dict_in_generate=True, **options)
        assert torch.equal(actual_run.sequences, expected_run.sequences), use_aux_flow
        actual_cache, expected_cache = getattr(actual_run, CACHE_FIELD), getattr(expected_run, CACHE_FIELD)
        # the same class; loaded as remote code it lives in the checkpoint's module, so it is another class object
        assert type(actual_cache).__qualname__ == type(expected_cache).__qualname__
        assert [layer.keys.shape for layer in actual_cache.layers] == [
            layer.keys.shape for layer in expected_cache.layers
        ]


# Explicit placement with the aux flow's own weights offloaded while the primary embedding stays in memory.
AUX_ON_DISK = {
    "model.embed_tokens": "cpu",
    "model.aux_embed_tokens": "disk",
    "model.rotary_emb": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "cpu",
    "model.norm": "cpu",
    "lm_head": "disk",
}


@pytest.mark.parametrize("placement", ["auto", "aux_on_disk"])
@pytest.mark.parametrize("remote_code", [False, True], ids=["package", "remote_code"])
def test_device_map_offload_matches_unsplit_model(tmp_path, placement, remote_code):
    reference = tiny_model(num_hidden_layers=4, qk_norm="per_head", aux_num_experts_per_tok=3)
    reference.save_pretrained(tmp_path / "ckpt")
    # The remote-code class is the one `AutoModelForCausalLM(..., trust_remote_code=True)` loads from the folder.
    cls = DualFlowForCausalLM
    if remote_code:
        cls = get_class_from_dynamic_module("modeling_dualflow.DualFlowForCausalLM", str(tmp_path / "ckpt"))
        assert cls.__module__.startswith("transformers_modules")
    if placement == "auto":
        # Room in memory for about 80% of the weights: the embeddings and the first layers stay, the rest go to disk.
        device_map, max_memory = "auto", {"cpu": int(0.8 * parameter_bytes(reference)), "disk": 10**9}
    else:
        device_map, max_memory = AUX_ON_DISK, None
    model = cls.from_pretrained(
        tmp_path / "ckpt", device_map=device_map, max_memory=max_memory, offload_folder=tmp_path / "offload"
    ).eval()

    layer_devices = {name: device for name, device in model.hf_device_map.items() if name.startswith("model.layers.")}
    assert set(layer_devices.values()) == {"cpu", "disk"}, model.hf_device_map  # split inside the decoder stack
    for name, device in model.hf_device_map.items():  # offloaded weights are not held in memory
        held = {parameter.device.type for parameter in model.get_submodule(name).parameters()}
        assert held <= ({"meta"} if device == "disk" else {"cpu"}), (name, held)
    assert_same_predictions(reference, model, *left_padded_prompts())


def test_parallel_plans_name_real_modules():
    """Every TP / EP / FSDP / PP rule names a module or parameter of a model that has every optional part."""
    model = tiny_model(qk_norm="per_head", shared_expert_intermediate_size=16, mlp_only_layers=[0], aux_adapter_rank=2)
    named = [*model.named_modules(), *model.named_parameters()]
    names = {re.sub(r"\.\d+\.", ".*.", name + ".")[:-1] for name, _ in named}  # layers.0.mlp -> layers.*.mlp
    config = model.config
    base_plans = (config.base_model_tp_plan, config.base_model_ep_plan, config.base_model_fsdp_plan)
    for plan in (*base_plans, config.base_model_pp_plan):
        assert {f"model.{key}" for key in plan} <= names, plan.keys() - {name[len("model.") :] for name in names}
    for plan in (model._tp_plan, model._fsdp_plan, model._pp_plan):
        assert plan.keys() <= names
    # the adapters split as the projections they adapt; the MLP output's stays whole
    adapters = {key: style for key, style in config.base_model_tp_plan.items() if "_adapter" in key}
    assert adapters == {"layers.*.self_attn.aux_q_adapter": "colwise", "layers.*.self_attn.aux_o_adapter": "rowwise"}
    # a model without adapters gets no adapter rules (transformers warns about rules that match nothing)
    assert not any("_adapter" in key for key in tiny_model(qk_norm="per_head").config.base_model_tp_plan)


def test_full_qk_norm_gathers_attention_projections():
    """
    OLMoE's norm spans the whole q / k projection: its plan must not leave a projection's output head-sharded, and
    the aux adapters of those whole-width projections stay whole.
    """
    plan = tiny_model(qk_norm="full", aux_adapter_rank=2).config.base_model_tp_plan
    attention = {key.rsplit(".", 1)[-1]: style for key, style in plan.items() if ".self_attn." in key}
    assert attention == {
        "q_proj": "colwise_gather_output",
        "k_proj": "colwise_gather_output",
        "v_proj": "colwise_gather_output",
        "o_proj": "rowwise_split_input",
    }
    assert tiny_model(qk_norm="per_head").config.base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"


def torchrun(script: Path, *args, tmp_dir: Path, nproc: int = 2, env=None, timeout: int = 300):
    """Run `script` under torchrun; its rendezvous and log folders (torchelastic_*) go into `tmp_dir`, not /tmp."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    env = dict(env or SUBPROCESS_ENV, TMPDIR=str(tmp_dir))
    result = subprocess.run([*command, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.multiprocess
def test_fsdp_training_matches_single_process(tmp_path):
    """
    2 processes with FSDP2 (half the weights each) compute the gradients and reach the losses of 1 process on the same
    global batches. (FSDP2 warns that the decoder layers and the model return views, which an in-place op would cut
    from its backward hook: the layers' primary keys / values and the model's logits, split from one stacked tensor,
    are never changed in place, and the gradients here show that every weight gets its true gradient.)
    """
    tiny_model(vocab_size=384, aux_num_experts_per_tok=3).save_pretrained(tmp_path / "ckpt")
    # ACCELERATE_USE_CPU: without it accelerate sees no CPU process group and every rank would read the same rows.
    env = dict(SUBPROCESS_ENV, ACCELERATE_USE_CPU="1")
    torchrun(
        SCRIPTS / "train_fsdp.py",
        tmp_path / "ckpt",
        tmp_path / "fsdp" / "result.json",
        "--fsdp",
        tmp_dir=tmp_path,
        env=env,
    )
    reference = subprocess.run(
        [sys.executable, str(SCRIPTS / "train_fsdp.py"), tmp_path / "ckpt", tmp_path / "single" / "result.json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr[-5000:]
    sharded = json.loads((tmp_path / "fsdp" / "result.json").read_text())
    single = json.loads((tmp_path / "single" / "result.json").read_text())

    assert (sharded["world_size"], single["world_size"]) == (2, 1)
    assert sharded["sharded"] == pytest.approx(0.5, abs=0.01) and single["sharded"] == 1.0
    assert {"model.aux_embed_tokens", "model.layers.0", "model.layers.1"} <= set(sharded["fsdp_units"])
    assert len(sharded["train_losses"]) == len(single["train_losses"]) == 3
    assert sharded["train_losses"][-1] < sharded["train_losses"][0]  # the steps did train
    assert sharded["train_losses"] == pytest.approx(single["train_losses"], rel=1e-5)
    assert sharded["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    sharded_gradients, single_gradients = (torch.load(tmp_path / run / "gradients.pt") for run in ("fsdp", "single"))
    assert sharded_gradients.keys() == single_gradients.keys()
    for name, gradient in single_gradients.items():
        assert gradient.abs().max() > 0, name  # the check below compares something
        torch.testing.assert_close(sharded_gradients[name], gradient, rtol=1e-4, atol=1e-7, msg=name)


TP_CHECKPOINTS = {
    "moe": dict(qk_norm="per_head", aux_num_experts_per_tok=3, shared_expert_intermediate_size=16),
    "olmoe": dict(qk_norm="full", clip_qkv=0.5, norm_topk_prob=False),
    "dense": dict(num_experts=0),
    # `tiny_model` draws the adapters' `up` away from 0: each adapter changes the aux flow's logits
    "adapters": dict(qk_norm="per_head", aux_adapter_rank=4),
}
TP_CASES = [
    dict(name="moe_tp", checkpoint="moe", parallel="tp", remote=False),
    dict(name="moe_tp_remote_code", checkpoint="moe", parallel="tp", remote=True),
    dict(name="moe_ep", checkpoint="moe", parallel="ep", remote=False),
    dict(name="moe_ep_eager_experts", checkpoint="moe", parallel="ep", remote=False, experts_implementation="eager"),
    dict(name="olmoe_tp", checkpoint="olmoe", parallel="tp", remote=False),
    dict(name="dense_tp", checkpoint="dense", parallel="tp", remote=False),
    dict(name="adapters_tp", checkpoint="adapters", parallel="tp", remote=False, gradients=True),
]
# The names the aux adapters have had in every checkpoint saved so far: TP loads them under these names.
ADAPTER_NAMES = [
    f"model.layers.{i}.{module}.{matrix}"
    for i in range(2)
    for module in ("self_attn.aux_q_adapter", "self_attn.aux_o_adapter", "aux_mlp_adapter")
    for matrix in ("down", "up")
]


def logits_without(model, suffix: str, input_ids, attention_mask) -> torch.Tensor:
    """The aux flow's logits with the parameters named `*suffix` set to 0, on a copy."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(suffix):
                parameter.zero_()
        return model(input_ids, attention_mask=attention_mask).logits


@pytest.mark.multiprocess
def test_tensor_and_expert_parallel_match_single_process(tmp_path):
    cases = []
    for name, overrides in TP_CHECKPOINTS.items():
        # an even vocabulary: transformers 5.19 shards the gathered LM head only when the TP size divides it
        tiny_model(vocab_size=98, **overrides).save_pretrained(tmp_path / name)
    adapters = DualFlowForCausalLM.from_pretrained(tmp_path / "adapters")
    input_ids, attention_mask = left_padded_prompts(98)
    with torch.no_grad():
        adapted = adapters(input_ids, attention_mask=attention_mask).logits
    for sharded_adapter in ("aux_q_adapter.up", "aux_o_adapter.up"):  # so the TP comparison below sees them
        assert (logits_without(adapters, sharded_adapter, input_ids, attention_mask) - adapted).abs().max() > 1e-3
    for case in TP_CASES:
        cases.append(dict(case, path=str(tmp_path / case["checkpoint"])))
    # Qwen3-MoE with the experts of the "moe" checkpoint: how this transformers shards them under its TP plan
    moe = DualFlowConfig.from_pretrained(tmp_path / "moe")
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    sizes += ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    qwen3_moe = Qwen3MoeConfig(**{name: getattr(moe, name) for name in sizes}, decoder_sparse_step=1)
    Qwen3MoeForCausalLM(qwen3_moe).save_pretrained(tmp_path / "qwen3_moe")
    cases.append(dict(name="qwen3_moe_tp", path=str(tmp_path / "qwen3_moe"), parallel="tp", qwen3_moe=True))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(SCRIPTS / "tp_logits.py", tmp_path / "cases.json", tmp_path / "result.json", tmp_dir=tmp_path)
    results = json.loads((tmp_path / "result.json").read_text())
    qwen3_moe_experts = results.pop("qwen3_moe_tp")["expert_shapes"]

    assert results.keys() == {case["name"] for case in TP_CASES}
    for name, result in results.items():
        # warnings as errors: a deprecated or dropped plan style shows here before it breaks
        assert result["sharding_warnings"] == [], (name, result["sharding_warnings"])
        assert result["logits_max_diff"] <= 1e-5 and result["primary_logits_max_diff"] <= 1e-5, (name, result)
        assert result["same_greedy_tokens"], name
        # attention heads split over the 2 ranks
        assert 2 * result["local_q_proj_rows"] == result["full_q_proj_rows"], name
        assert result["num_aux_parameters"] > 0
        # loaded under the checkpoint's names, each gathered tensor equal to the saved one
        assert result["checkpoint_mismatches"] == [], (name, result["checkpoint_mismatches"])
        if name == "adapters_tp":  # the q_proj and o_proj adapters split like their projections, the MLP's whole
            assert result["sharded_aux_parameters"] == [key for key in ADAPTER_NAMES if "self_attn" in key]
        elif name.endswith("_tp") or name == "moe_tp_remote_code":  # the aux flow's own weights replicated under TP
            assert result["sharded_aux_parameters"] == [], name
    assert results["moe_tp_remote_code"]["module"].startswith("transformers_modules")
    # What each rank holds of the last layer's 4 experts (hidden 32, expert width 24). TP: as Qwen3-MoE's plan of the
    # installed transformers, which splits every expert's width over the ranks up to 5.24 and keeps them whole from
    # 5.25 on. EP: 2 whole experts a rank.
    whole = {"gate_up_proj": [4, 48, 32], "down_proj": [4, 32, 24]}
    split = {"gate_up_proj": [4, 24, 32], "down_proj": [4, 32, 12]}
    splits_experts = "layers.*.mlp.experts.gate_up_proj" in Qwen3MoeConfig.base_model_tp_plan
    assert qwen3_moe_experts == [split if splits_experts else whole] * 2
    assert results["moe_tp"]["expert_shapes"] == results["moe_tp_remote_code"]["expert_shapes"] == qwen3_moe_experts
    ep = [{"gate_up_proj": [2, 48, 32], "down_proj": [2, 32, 24]}] * 2
    assert results["moe_ep"]["expert_shapes"] == results["moe_ep_eager_experts"]["expert_shapes"] == ep
    assert results["dense_tp"]["expert_shapes"] == [None, None]
    # training through the sharded adapters: every gradient as on one process
    gradients = results["adapters_tp"]["gradient_max_diffs"]
    assert set(ADAPTER_NAMES) <= gradients.keys()
    assert {name: diff for name, diff in gradients.items() if diff is None or diff > 1e-5} == {}
