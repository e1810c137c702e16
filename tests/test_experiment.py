"""`dualflow experiment`: validation sampling, paired statistics, data-driven arms, costs, the --quick paths end to end."""

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from dualflow.cli import main
from dualflow.errors import DualFlowUserError
from dualflow.instruments.arms import (
    ARMS_BY_NAME,
    DEFAULT_ARMS,
    DEFAULT_SCALE,
    QUICK_SCALE,
    Arm,
    arm_costs,
    flow_forward_flops,
    select_arms,
)
from dualflow.instruments.aux_design import COUPLING_FORMS, apply_aux_design
from dualflow.instruments.data import read_byte_tokens, spread_blocks
from dualflow.instruments.report import format_table, size_study, summarize
from dualflow.instruments.stats import depth_gain_share, mean_and_error, paired_differences, ratio_and_error
from dualflow.instruments.tiny_lm import TinyScale, torch_default_init
from dualflow.scoring import mean_token_nll, mean_token_nlls
from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM


STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_TEXT_FILES = [STDLIB / name for name in ("textwrap.py", "string.py", "shlex.py", "colorsys.py", "bisect.py")]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_validation_blocks_span_every_file(tmp_path):
    files = []
    for index in range(10):  # ten files of 300 bytes, each filled with its own letter
        files.append(tmp_path / f"f{index}.txt")
        files[-1].write_text(chr(ord("a") + index) * 298)
    blocks, files_hit = spread_blocks(files, block_size=16, num_blocks=40)
    assert blocks.shape == (40, 16) and files_hit == 10
    stream = read_byte_tokens(files)
    assert blocks[0].tolist() == stream[:16].tolist() and blocks[-1].tolist() == stream[-16:].tolist()
    letters = {chr(token) for token in blocks.flatten().tolist()} - {"\n"}
    assert letters == set("abcdefghij")
    # Asking for more blocks than fit gives fewer, non-overlapping ones (still from first to last file).
    blocks, files_hit = spread_blocks(files, block_size=100, num_blocks=1000)
    assert blocks.shape == (30, 100) and files_hit == 10
    assert blocks.flatten().tolist() == stream[:3000].tolist()


def test_paired_standard_error_on_known_numbers():
    baseline = [{"seed": 0, "val_loss": 1.0}, {"seed": 1, "val_loss": 2.0}, {"seed": 2, "val_loss": 3.0}]
    arm = [{"seed": 2, "val_loss": 2.95}, {"seed": 0, "val_loss": 0.9}, {"seed": 1, "val_loss": 1.8}]
    arm.append({"seed": 7, "val_loss": 0.0})  # no baseline run at seed 7: not paired, left out
    deltas = paired_differences(arm, baseline)
    assert deltas == pytest.approx({0: -0.1, 1: -0.2, 2: -0.05})
    stats = mean_and_error(list(deltas.values()))
    # mean -0.35/3; deviations 1/60, -5/60, 4/60 -> variance (1 + 25 + 16) / 3600 / 2 = 42/7200
    assert stats["mean"] == pytest.approx(-0.35 / 3)
    assert stats["std"] == pytest.approx(math.sqrt(42 / 7200))
    assert stats["se"] == pytest.approx(math.sqrt(42 / 7200) / math.sqrt(3)) and stats["n"] == 3
    depth = [{"seed": s, "val_loss": base["val_loss"] - 0.2} for s, base in enumerate(baseline)]
    share = depth_gain_share(arm, baseline, depth)
    assert share["share"] == pytest.approx((-0.35 / 3) / -0.2)
    # per seed: delta - 0.6 * (-0.2) = 0.02, -0.08, 0.07: mean 0.00333, SE 0.0437 -> undecided
    assert share["arm_minus_target"]["mean"] == pytest.approx(0.01 / 3) and share["verdict"] == "undecided"
    strong = [{"seed": s, "val_loss": base["val_loss"] - 0.19 - 0.01 * s} for s, base in enumerate(baseline)]
    assert depth_gain_share(strong, baseline, depth)["verdict"] == "reached"


def test_arms_are_data_and_unknown_arms_are_refused():
    arm = ARMS_BY_NAME["dual kp1 ka3"]
    config = arm.model_config(DEFAULT_SCALE)
    assert arm.dual and config.use_aux_flow and (config.num_experts_per_tok, config.aux_num_experts_per_tok) == (1, 3)
    deep = ARMS_BY_NAME["single k2 2x depth"].model_config(DEFAULT_SCALE)
    assert deep.num_hidden_layers == 2 * DEFAULT_SCALE.num_hidden_layers and not deep.use_aux_flow
    assert ARMS_BY_NAME["single k2 2x tokens"].steps(DEFAULT_SCALE) == 2 * DEFAULT_SCALE.steps
    init_arm = ARMS_BY_NAME["dual kp2 ka4 init 0.02"]
    assert (
        init_arm.scale(DEFAULT_SCALE).init == "model" and init_arm.model_config(DEFAULT_SCALE).initializer_range == 0.02
    )
    assert ARMS_BY_NAME["dual kp2 ka4 plw 2"].model_config(DEFAULT_SCALE).primary_loss_weight == 2.0
    arms = select_arms(None)
    names = [arm.name for arm in arms]
    assert names[0] == "single k2" and set(names) == set(DEFAULT_ARMS)
    assert [arm.name for arm in select_arms(["single k4"])] == ["single k2", "single k4"]
    with pytest.raises(DualFlowUserError, match="unknown arm"):
        select_arms(["single k3"])
    assert isinstance(arms[0], Arm)


def test_flops_and_expert_counts():
    scale = TinyScale()
    config = ARMS_BY_NAME["single k2"].model_config(scale)
    d, q, kv, n_exp, inter, V = 64, 64, 32, 8, 64, 256
    per_layer = 2 * d * 2 * q + 2 * d * 2 * kv + 2 * 2 * 10 * q + 2 * d * n_exp + 2 * 2 * 3 * d * inter
    assert flow_forward_flops(config, context=10, top_k=2) == 2 * per_layer + 2 * d * V
    aux_layer = 2 * d * 2 * q + 2 * 2 * 10 * q + 2 * d * n_exp + 4 * 2 * 3 * d * inter
    assert flow_forward_flops(config, context=10, top_k=4, aux=True) == 2 * aux_layer + 2 * d * V
    costs = {name: arm_costs(arm, scale) for name, arm in ARMS_BY_NAME.items()}
    assert costs["dual kp2 ka4"]["prefill_experts_per_token"] == costs["single k2"]["prefill_experts_per_token"] == 4
    assert costs["dual kp2 ka4"]["decode_experts_per_token"] == 12  # (2 + 4) experts in each of 2 layers
    assert costs["dual kp2 ka4"]["prefill_flops_per_token"] == costs["single k2"]["prefill_flops_per_token"]
    assert costs["single k2 2x depth"]["prefill_experts_per_token"] == 8
    assert costs["single k2 2x tokens"]["train_flops_total"] == 2 * costs["single k2"]["train_flops_total"]
    assert costs["single k2 2x tokens"]["train_flops_per_token"] == costs["single k2"]["train_flops_per_token"]
    assert costs["dual kp1 ka3"]["decode_experts_per_token"] == costs["dual kp3 ka1"]["decode_experts_per_token"]


def test_experiment_quick_path_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "exp"
    argv = ["experiment", "--quick", "--steps", "2", "--seeds", "2", "--jobs", "2", "--out", str(out), "--data"]
    assert main(argv + [str(path) for path in SMALL_TEXT_FILES]) == 0
    printed = capsys.readouterr().out
    assert "too few steps to conclude anything" in printed
    report = json.loads((out / "experiment.json").read_text())
    assert report["schema"] == "dualflow-experiment/2" and report["quick"] is True and report["seeds"] == [0, 1]
    assert report["complete"] and report["data"]["val_tokens"] == report["data"]["val_blocks"] * 32
    names = [arm["name"] for arm in report["arms"]]
    assert names == [name for name in ARMS_BY_NAME if name in DEFAULT_ARMS]
    baseline_losses = [run["val_loss"] for run in report["arms"][0]["runs"]]
    for arm in report["arms"]:
        assert arm["name"] in printed and [run["seed"] for run in arm["runs"]] == [0, 1]
        losses = [run["val_loss"] for run in arm["runs"]]
        assert arm["val_loss"]["mean"] == pytest.approx(sum(losses) / 2)
        deltas = [loss - base for loss, base in zip(losses, baseline_losses)]
        assert arm["val_loss_delta"]["mean"] == pytest.approx(sum(deltas) / 2)
        assert arm["val_loss_delta"]["se"] == pytest.approx(abs(deltas[0] - deltas[1]) / 2)
        assert (arm["primary_val_loss"] is not None) == arm["dual"] and arm["tokens_per_s"] > 0 < arm[
            "tokens_per_cpu_s"
        ]
        assert len(arm["runs"][0]["train_curve"]) == 2 * arm["training"].get("token_factor", 1)
    for name in ("loss_curves.png", "frontier.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert main(["experiment", "--quick", "--seeds", "0", "--out", str(out)]) == 2


def test_upcycle_quick_path_pairs_recipes_with_the_converted_base(tmp_path, capsys):
    out = tmp_path / "up"
    argv = ["experiment", "--regime", "upcycle", "--quick", "--steps", "4", "--seeds", "2", "--jobs", "1"]
    assert main(argv + ["--out", str(out), "--data"] + [str(path) for path in SMALL_TEXT_FILES]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "upcycle.json").read_text())
    assert report["schema"] == "dualflow-upcycle/1" and report["continue_steps"] == 2
    recipes = {recipe["name"]: recipe for recipe in report["recipes"]}
    assert {"single continued", "dual full ka=2kp", "dual aux-only ka=2kp", "dual lora+aux ka=kp"} <= set(recipes)
    for base in report["base"]["runs"]:
        # convert's exact-parity guarantee: at k_a = k_p the untrained aux flow is the saved Qwen3-MoE model
        assert base["aux_val_loss_at_conversion_ka1x"] == pytest.approx(base["primary_val_loss"], abs=1e-5)
        assert base["aux_val_loss_at_conversion_ka2x"] != pytest.approx(base["primary_val_loss"], abs=1e-5)
    frozen_shared = ("dual aux-only ka=kp", "dual aux-only ka=2kp", "dual aux-only+adapters ka=2kp")
    for name in frozen_shared:  # frozen shared weights: the primary flow is the base
        primaries = [run["primary_val_loss"] for run in recipes[name]["runs"]]
        assert primaries == pytest.approx([run["primary_val_loss"] for run in report["base"]["runs"]], abs=1e-6)
    full, single, aux_only = (
        recipes[n]["trainable_params"] for n in ("dual full ka=kp", "single continued", "dual aux-only ka=kp")
    )
    assert full == single + aux_only and aux_only < recipes["dual lora+aux ka=kp"]["trainable_params"] != full
    # (at this size rank-16 LoRA on the fused experts and the router holds more parameters than the model itself)
    assert recipes["single continued"]["prediction_vs_single_continued"]["mean"] == 0
    # the same-budget LoRA: its rank spends about the adapter recipe's trainable parameters, on the single flow
    budget = recipes["dual aux-only+adapters ka=kp"]["trainable_params"]
    lora = recipes["single lora, adapter budget"]
    per_rank = lora["trainable_params"] / lora["runs"][0]["lora_rank"]
    assert abs(lora["trainable_params"] - budget) <= per_rank / 2 and lora["aux_val_loss"] is None
    assert all(name in printed for name in recipes)


def test_upcycle_recipes_by_name_and_resume_pairs_with_the_same_base(tmp_path, capsys):
    out, data = tmp_path / "up", ["--data"] + [str(path) for path in SMALL_TEXT_FILES]
    argv = ["experiment", "--regime", "upcycle", "--quick", "--steps", "4", "--jobs", "1", "--out", str(out)] + data
    swept = ["dual aux-only ka=2kp", "dual aux-only ka=2kp lr x3"]
    assert main(argv + ["--seeds", "1", "--arms", *swept]) == 0
    first = json.loads((out / "upcycle.json").read_text())
    assert [recipe["name"] for recipe in first["recipes"]] == ["single continued", *swept]
    aux_only, aux_only_x3 = first["recipes"][1]["runs"][0], first["recipes"][2]["runs"][0]
    assert aux_only_x3["learning_rate"] == pytest.approx(3 * aux_only["learning_rate"])
    assert aux_only_x3["aux_val_loss"] != aux_only["aux_val_loss"]  # the rate reached the optimizer
    # A second seed of one recipe more: seed 0's runs are kept as they were, its base retrained and found equal.
    assert main(argv + ["--resume", "--seeds", "2", "--arms", "dual full ka=2kp"]) == 0
    second = json.loads((out / "upcycle.json").read_text())
    recipes = {recipe["name"]: recipe for recipe in second["recipes"]}
    assert recipes["dual aux-only ka=2kp lr x3"]["runs"] == [aux_only_x3]
    assert [run["seed"] for run in recipes["single continued"]["runs"]] == [0, 1]
    new_runs = recipes["dual full ka=2kp"]["runs"]
    assert [run["seed"] for run in new_runs] == [0, 1] and second["seeds"] == [0, 1]
    assert second["base"]["runs"][0]["primary_val_loss"] == first["base"]["runs"][0]["primary_val_loss"]
    assert len(second["commands"]) == 2 and "--resume" in second["commands"][1]
    capsys.readouterr()
    # A base that no longer retrains to the one the runs continued is refused before any recipe trains.
    second["base"]["runs"][1]["primary_val_loss"] += 0.01
    (out / "upcycle.json").write_text(json.dumps(second))
    assert main(argv + ["--resume", "--seeds", "2", "--arms", "dual aux-only ka=2kp lr x0.33"]) == 2
    assert "seed 1's retrained base" in capsys.readouterr().err
    assert json.loads((out / "upcycle.json").read_text()) == second
    # Another continuation length cannot be paired with these runs; an unknown recipe is named.
    assert main(argv + ["--resume", "--continue-steps", "3"]) == 2
    assert main(argv + ["--arms", "dual full ka=3kp"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "another scale, data, steps" in errors[0] and "unknown upcycle recipe 'dual full ka=3kp'" in errors[1]
    assert main(["experiment", "--quick", "--continue-steps", "3"]) == 2


DESIGNS = [{"coupling_form": form} for form in COUPLING_FORMS] + [{"aux_final_norm": True}]


@pytest.mark.parametrize("design", DESIGNS)
def test_design_variants_start_as_today_and_train_their_own_parameters(design):
    torch.manual_seed(0)
    model = DualFlowForCausalLM(ARMS_BY_NAME["dual kp2 ka4"].model_config(QUICK_SCALE))
    input_ids = torch.randint(0, 256, (2, 12))
    today = model(input_ids).logits
    apply_aux_design(model, **design)
    torch.testing.assert_close(model(input_ids).logits, today)  # zero gains / a copied norm: nothing changes yet
    model(input_ids, labels=input_ids).loss.backward()
    changed = "aux_coupling" if "coupling_form" in design else "aux_norm"
    grads = {name: p.grad for name, p in model.named_parameters() if changed in name}
    assert grads and all(grad is not None for grad in grads.values())
    # a zero-initialised up-projection gives its down-projection no gradient at the first step, as in LoRA
    assert all(grad.abs().sum() > 0 for name, grad in grads.items() if not name.endswith("down"))


def test_torch_default_init_follows_pytorch_layer_defaults():
    torch.manual_seed(0)
    config = ARMS_BY_NAME["dual kp2 ka4"].model_config(DEFAULT_SCALE)
    model = DualFlowForCausalLM(config)
    torch_default_init(model)
    inner, layer = model.model, model.model.layers[0]
    assert (
        abs(inner.embed_tokens.weight.std().item() - 1) < 0.05
        and abs(inner.aux_embed_tokens.weight.std().item() - 1) < 0.05
    )
    bound = config.hidden_size**-0.5  # nn.Linear's default: uniform(+-1/sqrt(fan_in))
    for weight in (layer.self_attn.q_proj.weight, layer.mlp.gate.weight, model.lm_head.weight):
        assert weight.abs().max().item() <= bound and weight.abs().max().item() > 0.9 * bound
    experts = layer.mlp.experts
    assert abs(experts.gate_up_proj.std().item() * config.hidden_size**0.5 - 1) < 0.05
    assert abs(experts.down_proj.std().item() * config.moe_intermediate_size**0.5 - 1) < 0.05
    assert (layer.aux_coupling.weight == 0).all() and (layer.input_layernorm.weight == 1).all()


def test_design_arms_are_compared_with_todays_default_paired_by_seed():
    def runs(losses):
        return [
            {"seed": seed, "val_loss": loss, "primary_val_loss": loss, "tokens_per_s": 1.0}
            for seed, loss in enumerate(losses)
        ]

    arms = [ARMS_BY_NAME[name] for name in ("single k2", "dual kp2 ka4", "dual kp2 ka4 aux emb copied")]
    results = {
        "single k2": runs([2.0, 2.2]),
        "dual kp2 ka4": runs([1.9, 2.1]),
        "dual kp2 ka4 aux emb copied": runs([1.8, 2.08]),
    }
    summary = {arm["name"]: arm for arm in summarize(arms, QUICK_SCALE, results)}
    design = summary["dual kp2 ka4 aux emb copied"]["val_loss_delta_vs_design_reference"]
    assert design["vs"] == "dual kp2 ka4" and design["n"] == 2 and design["mean"] == pytest.approx(-0.06)
    assert summary["dual kp2 ka4"]["val_loss_delta_vs_design_reference"] is None  # not a design variant
    assert "-0.0600 ± 0.0400" in format_table(list(summary.values()))


def test_torch_default_init_keeps_a_copied_aux_embedding_a_copy():
    model = DualFlowForCausalLM(ARMS_BY_NAME["dual kp2 ka4 aux emb copied"].model_config(QUICK_SCALE))
    before = model.model.embed_tokens.weight.clone()
    torch_default_init(model)
    assert not torch.equal(model.model.embed_tokens.weight, before)  # a new draw ...
    assert torch.equal(model.model.aux_embed_tokens.weight, model.model.embed_tokens.weight)  # ... copied again


def test_one_pass_scores_prediction_and_primary_flow_like_two_passes():
    torch.manual_seed(0)
    model = DualFlowForCausalLM(ARMS_BY_NAME["dual kp2 ka4"].model_config(QUICK_SCALE)).eval()
    torch_default_init(model)
    blocks = torch.randint(0, 256, (5, 16))
    both = mean_token_nlls(model, blocks, ("logits", "primary_logits"), batch_size=2, use_aux_flow=True)
    assert both["logits"] == pytest.approx(mean_token_nll(model, blocks, 2, use_aux_flow=True), abs=1e-6)
    assert both["primary_logits"] == pytest.approx(mean_token_nll(model, blocks, 2, use_aux_flow=False), abs=1e-6)
    assert abs(both["logits"] - both["primary_logits"]) > 1e-3  # the two flows differ: the check above means something


def test_resume_keeps_earlier_runs_and_trains_only_missing_ones(tmp_path):
    out, data = tmp_path / "exp", ["--data"] + [str(path) for path in SMALL_TEXT_FILES]
    quick = ["experiment", "--quick", "--steps", "2", "--jobs", "1", "--out", str(out)]
    assert main(quick + ["--arms", "single k4", "--seeds", "1"] + data) == 0
    first = json.loads((out / "experiment.json").read_text())
    assert main(quick + ["--arms", "dual kp2 ka4", "--seeds", "2", "--resume"] + data) == 0
    report = json.loads((out / "experiment.json").read_text())
    arms = {arm["name"]: arm for arm in report["arms"]}
    assert list(arms) == ["single k2", "single k4", "dual kp2 ka4"] and report["seeds"] == [0, 1]
    assert arms["single k4"]["runs"] == first["arms"][1]["runs"]  # kept as it was, not retrained
    assert [run["seed"] for run in arms["single k2"]["runs"]] == [0, 1] and len(arms["dual kp2 ka4"]["runs"]) == 2
    assert arms["single k2"]["runs"][0] == first["arms"][0]["runs"][0]
    assert len(report["commands"]) == 2 and report["commands"][1].startswith("dualflow experiment --quick --resume")
    assert main(quick[:3] + ["3"] + quick[4:] + ["--resume"] + data) == 2  # other --steps: refused


def runs_of(losses, primary=None, tokens_per_cpu_s=1.0):
    return [
        {"seed": seed, "val_loss": loss, "primary_val_loss": loss if primary is None else primary[seed]}
        | {"tokens_per_s": 1.0, "tokens_per_cpu_s": tokens_per_cpu_s}
        for seed, loss in enumerate(losses)
    ]


def test_ratio_standard_error_by_the_delta_method_on_known_numbers():
    # ratio of means 0.3 / 0.6 = 0.5; residuals a - 0.5 b = 0.05, -0.05, 0 -> std 0.05, SE 0.05 / sqrt(3) / 0.6
    ratio = ratio_and_error({0: 0.3, 1: 0.2, 2: 0.4, 9: 1.0}, {0: 0.5, 1: 0.5, 2: 0.8})
    assert ratio["ratio"] == pytest.approx(0.5) and ratio["n"] == 3
    assert ratio["se"] == pytest.approx(0.05 / math.sqrt(3) / 0.6)
    assert ratio_and_error({0: 1.0}, {0: 2.0}) is None  # one seed has no spread


def test_arms_state_the_design_they_measured_whatever_the_new_defaults():
    plain = ARMS_BY_NAME["dual kp2 ka4"].model_config(DEFAULT_SCALE)
    assert (plain.aux_embed_init, plain.aux_round_gate_init) == ("independent", 0.0)  # the paper's design
    assert ARMS_BY_NAME["dual kp2 ka4 r2"].model_config(DEFAULT_SCALE).aux_round_gate_init == 0.0
    # the arm a new model's defaults give: the copied aux embedding
    copied = ARMS_BY_NAME["dual kp2 ka4 aux emb copied"].model_config(DEFAULT_SCALE)
    assert copied.aux_embed_init == DualFlowConfig().aux_embed_init == "copy"


def test_size_arms_pair_with_the_baseline_and_depth_of_their_own_size():
    names = ["single k2", "single k2 2x depth", "dual kp2 ka4", "dual kp2 ka4 r2 gate 1 aux emb copied plw 0.5"]
    results = {}
    for suffix, offset in (("", 0.0), (" h64", 0.5)):
        for name, losses in zip(names, ([2.0, 2.2], [1.8, 2.0], [1.95, 2.1], [1.9, 2.08])):
            results[name + suffix] = runs_of([loss + offset for loss in losses])
    arms = [ARMS_BY_NAME[name] for name in results]
    summary = summarize(arms, DEFAULT_SCALE, results)
    small = {entry["name"]: entry for entry in summary}["dual kp2 ka4 h64"]
    assert small["val_loss_delta"]["vs"] == "single k2 h64" and small["val_loss_delta"]["mean"] == pytest.approx(-0.075)
    assert small["depth_gain_share"]["share"] == pytest.approx(0.375)
    assert small["train_flops_per_token"] < summary[2]["train_flops_per_token"]  # a smaller model
    rows = size_study(summary, DEFAULT_SCALE)
    assert [row["hidden_size"] for row in rows] == [64, 96]
    assert rows[0]["best design"]["depth_gain_share"]["share"] == pytest.approx(0.55)


def test_token_study_pairs_each_budget_with_its_own_baseline_and_interpolates_iso_token_ratios(tmp_path):
    from dualflow.instruments.plots import plot_token_scaling
    from dualflow.instruments.report import format_token_table, token_study

    default, best = "dual kp2 ka4 aux emb copied", "dual kp2 ka4 r2 gate 1 aux emb copied plw 0.5"
    losses = {  # per budget: baseline, 2x depth, a new model's default, the best design (seeds 0 and 1)
        1: ([2.0, 2.2], [1.9, 2.1], [1.9, 2.1], [1.95, 2.15]),
        2: ([1.8, 2.0], [1.7, 1.9], [1.75, 1.95], [1.7, 1.9]),
        4: ([1.6, 1.8], [1.55, 1.75], [1.58, 1.79], [1.5, 1.7]),
    }
    results = {}
    for factor, arm_losses in losses.items():
        for name, values in zip(("single k2", "single k2 2x depth", default, best), arm_losses):
            results[name if factor == 1 else f"{name} {factor}x tokens"] = runs_of(values, tokens_per_cpu_s=100.0)
    summary = summarize([ARMS_BY_NAME[name] for name in results], DEFAULT_SCALE, results)
    by_name = {entry["name"]: entry for entry in summary}
    assert by_name["single k2 4x tokens"]["val_loss_delta"]["vs"] == "single k2"  # what 4x tokens buy
    assert by_name[f"{best} 4x tokens"]["val_loss_delta"]["vs"] == "single k2 4x tokens"
    rows = token_study(summary, results, DEFAULT_SCALE)
    assert [row["token_factor"] for row in rows] == [1, 2, 4]
    assert rows[2]["train_tokens"] == 4 * DEFAULT_SCALE.steps * DEFAULT_SCALE.batch_size * DEFAULT_SCALE.block_size
    one, four = rows[0]["new model default"], rows[2]["best design"]
    # 1.9 lies halfway between the baseline's 1x (2.0) and 2x (1.8) losses: 2^0.5 x the tokens
    assert one["iso_token_ratio"]["mean"] == pytest.approx(2**0.5) and not one["iso_token_ratio_extrapolated"]
    # 1.5 lies below the 4x loss (1.6): the 2x-4x segment extended, 2^2.5 tokens, over a budget of 4
    assert four["iso_token_ratio"]["mean"] == pytest.approx(2**2.5 / 4) and four["iso_token_ratio_extrapolated"]
    assert four["delta"]["mean"] == pytest.approx(-0.1)
    assert four["retention_vs_1x"]["ratio"] == pytest.approx(0.1 / 0.05)
    assert four["depth_gain_share"]["share"] == pytest.approx(0.1 / 0.05)
    assert "extrapolated" in format_token_table(rows)
    plot_token_scaling({"arms": summary, "token_study": rows}, tmp_path / "tokens.png")
    assert (tmp_path / "tokens.png").read_bytes().startswith(PNG_MAGIC)
    assert token_study(summary[:4], results, DEFAULT_SCALE) == []  # a single budget is no study


# A pool worker deadlocked in C code (a lock some other thread of the parent held at fork: the hazard of forking a
# process with threads), where no Python signal handler can run: the second pthread_mutex_lock of a plain mutex.
STUCK_WORKER_SCRIPT = """
import ctypes, signal
from dualflow.errors import terminating_signals_as_interrupt
from dualflow.instruments.runner import fork_pool

def deadlock():
    mutex, libc = ctypes.create_string_buffer(64), ctypes.CDLL(None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)

with terminating_signals_as_interrupt():  # the CLI's handlers, which the workers must not keep
    with fork_pool(2, deadlock) as pool:
        pass
    print(signal.getsignal(signal.SIGTERM).__name__)
"""


def test_a_pool_worker_stuck_in_c_code_still_ends_with_the_pool():
    completed = subprocess.run([sys.executable, "-c", STUCK_WORKER_SCRIPT], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "terminate"  # the parent's own handler is back after the fork
