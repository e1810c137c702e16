"""`dualflow experiment --regime upcycle`'s equal-compute, rounds-retrofit and depth up-scaling recipes, and the study
of the gain's trend with the base's pretraining length (`--base-steps`)."""

import copy
import json
import sysconfig
from pathlib import Path

import pytest
import torch

from dualflow.cli import main
from dualflow.instruments.arms import DEFAULT_SCALE, QUICK_SCALE, flow_forward_flops
from dualflow.instruments.tiny_lm import tiny_moe_config, torch_default_init, train_model
from dualflow.instruments.upcycle_models import depth_upscaled
from dualflow.instruments.upcycle_recipes import RECIPE_GROUPS, RECIPES_BY_NAME, recipe_steps
from dualflow.instruments.upcycle_summary import base_length_trend
from modeling_dualflow import DualFlowForCausalLM


STDLIB = Path(sysconfig.get_paths()["stdlib"])
DATA = ["--data"] + [str(STDLIB / name) for name in ("textwrap.py", "string.py", "shlex.py", "colorsys.py")]
QUICK_UPCYCLE = ["experiment", "--regime", "upcycle", "--quick", "--seeds", "2", "--jobs", "1"]


def test_equal_compute_steps_spend_the_reference_recipes_training_flops():
    scale, continue_steps = DEFAULT_SCALE, 450
    context = (scale.block_size + 1) / 2  # the formula's causal average over a training block

    def forward_flops(rounds=1, depth=1, aux_top_k=None):
        config = tiny_moe_config(scale, 2, aux_top_k, depth, aux_num_rounds=rounds)
        primary = flow_forward_flops(config, context, 2)
        return primary + (flow_forward_flops(config, context, aux_top_k, aux=True) if aux_top_k else 0)

    single = forward_flops()
    for reference, flops in (
        ("dual full ka=2kp", forward_flops(aux_top_k=4)),
        ("dual full ka=kp", forward_flops(aux_top_k=2)),
        ("dual full r3 ka=2kp gate lr x10", forward_flops(rounds=3, aux_top_k=4)),
        ("single depth 2x (layers repeated)", forward_flops(depth=2)),
    ):
        recipe = RECIPES_BY_NAME[f"single continued, compute of {reference}"]
        assert recipe_steps(recipe, scale, continue_steps) == round(continue_steps * flops / single)
        assert recipe_steps(RECIPES_BY_NAME[reference], scale, continue_steps) == continue_steps
    # k_a = 4 roughly doubles the layers' FLOPs on top of the primary flow's: more than 2x the steps
    assert 2 * continue_steps < recipe_steps(
        RECIPES_BY_NAME["single continued, compute of dual full ka=2kp"], scale, 450
    )


def test_depth_upscaling_repeats_each_layer_in_place():
    torch.manual_seed(0)
    source = DualFlowForCausalLM(tiny_moe_config(QUICK_SCALE, 2, qk_norm="per_head")).eval()
    torch_default_init(source)
    deep = depth_upscaled(source, 2).eval()
    layers = source.config.num_hidden_layers
    assert deep.config.num_hidden_layers == len(deep.model.layers) == 2 * layers
    assert source.config.num_hidden_layers == layers  # the source's config is left as it was
    layer_params = sum(p.numel() for p in source.model.layers.parameters())
    assert deep.num_parameters() == source.num_parameters() + layer_params
    for index in range(2 * layers):
        copied, original = deep.model.layers[index].state_dict(), source.model.layers[index // 2].state_dict()
        assert copied.keys() == original.keys()
        assert all(torch.equal(copied[name], original[name]) for name in copied)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(deep.state_dict()[name], source.state_dict()[name])
    # the copies are weights of their own: training one layer leaves its twin and the source alone
    first, twin = deep.model.layers[0].self_attn.q_proj.weight, deep.model.layers[1].self_attn.q_proj.weight
    assert first.data_ptr() != twin.data_ptr() != source.model.layers[0].self_attn.q_proj.weight.data_ptr()
    # each update applied twice is another function: up-scaling does not keep the source's logits
    input_ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert not torch.allclose(deep(input_ids).logits, source(input_ids).logits, atol=1e-3)


def test_gate_learning_rate_factor_opens_the_closed_round_gates_faster():
    torch.manual_seed(0)
    config = tiny_moe_config(QUICK_SCALE, 2, 4, aux_num_rounds=2, aux_round_gate_init=0.0)  # as conversion writes
    converted = DualFlowForCausalLM(config)
    torch_default_init(converted)
    tokens = torch.randint(0, 256, (4096,))

    def gates_after_training(factor):
        model = copy.deepcopy(converted)
        train_model(model, tokens, QUICK_SCALE, batch_seed=1, steps=4, show_progress=False, round_gate_lr_factor=factor)
        return torch.cat([layer.aux_round_gate.weight.detach() for layer in model.model.layers])

    assert all((layer.aux_round_gate.weight == 0).all() for layer in converted.model.layers)
    slow, fast = gates_after_training(1.0), gates_after_training(10.0)
    assert (slow != 0).all() and (fast != 0).all()  # closed gates get a gradient and move
    # AdamW moves each gate by about its rate per step: 10x the rate, about 10x as far
    assert fast.abs().mean() > 5 * slow.abs().mean()


def test_rounds_depth_and_equal_compute_recipes_run_and_report_both_deltas(tmp_path, capsys):
    out = tmp_path / "rounds"
    argv = QUICK_UPCYCLE + ["--steps", "4", "--arms", "rounds", "--out", str(out)] + DATA
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "upcycle.json").read_text())
    recipes = {recipe["name"]: recipe for recipe in report["recipes"]}
    assert set(recipes) == {"single continued", *RECIPE_GROUPS["rounds"]}
    assert "Δ vs single, equal compute" in printed and all(name in printed for name in recipes)
    base_losses = {run["seed"]: run["primary_val_loss"] for run in recipes["single continued"]["runs"]}
    partners = {
        "dual full ka=2kp": "single continued, compute of dual full ka=2kp",
        "dual full r2 ka=2kp": "single continued, compute of dual full r2 ka=2kp",
        "dual full r2 ka=2kp gate lr x10": "single continued, compute of dual full r2 ka=2kp",  # same FLOPs per token
        "dual full r3 ka=2kp gate lr x10": "single continued, compute of dual full r3 ka=2kp gate lr x10",
        "dual full r2 ka=2kp gates open": "single continued, compute of dual full r2 ka=2kp",
    }
    for name, partner in partners.items():
        runs, partner_runs = recipes[name]["runs"], recipes[partner]["runs"]
        equal_compute = recipes[name]["prediction_vs_single_equal_compute"]
        assert equal_compute["vs"] == partner
        deltas = [run["aux_val_loss"] - other["primary_val_loss"] for run, other in zip(runs, partner_runs)]
        assert equal_compute["mean"] == pytest.approx(sum(deltas) / 2)
        equal_tokens = [run["aux_val_loss"] - base_losses[run["seed"]] for run in runs]
        assert recipes[name]["prediction_vs_single_continued"]["mean"] == pytest.approx(sum(equal_tokens) / 2)
        assert (
            partner_runs[0]["steps"] == recipe_steps(RECIPES_BY_NAME[partner], QUICK_SCALE, 2) > 2 == runs[0]["steps"]
        )
    # single-flow recipes have no equal-compute partner; the depth up-scaled one is single-flow with 2x the layers
    depth = recipes["single depth 2x (layers repeated)"]
    assert depth["prediction_vs_single_equal_compute"] is None and depth["aux_val_loss"] is None
    depth_gain = depth["prediction_vs_single_continued"]["mean"]
    for name in partners:  # the yardstick: a conversion's gain as a share of depth up-scaling's
        gain = recipes[name]["prediction_vs_single_continued"]["mean"]
        assert recipes[name]["share_of_depth_upscaling_gain"]["ratio"] == pytest.approx(gain / depth_gain)
    assert depth["trainable_params"] > recipes["single continued"]["trainable_params"]
    # the gates left closed by conversion moved further at 10x their rate (same seed, same batches)
    for seed in (0, 1):
        x1, x10 = (recipes[name]["runs"][seed]["round_gate_mean_abs"] for name in list(partners)[1:3])
        assert x10 > x1 > 0
        # opened at the start: near 1 after a few steps at the common rate, where the closed ones stay near 0
        assert recipes["dual full r2 ka=2kp gates open"]["runs"][seed]["round_gate_mean"] > 0.9 > 0.1 > x1


def test_base_steps_study_fits_the_gains_trend_per_seed_and_resumes(tmp_path, capsys):
    out = tmp_path / "bases"
    argv = QUICK_UPCYCLE + ["--base-steps", "2", "4", "8", "--continue-steps", "2", "--arms", "compute"]
    argv += ["--out", str(out)] + DATA
    assert main(argv) == 0
    summary = json.loads((out / "base_length.json").read_text())
    assert summary["base_steps"] == [2, 4, 8] and summary["reports"] == [f"base-{n}/upcycle.json" for n in (2, 4, 8)]
    reports = [json.loads((out / path).read_text()) for path in summary["reports"]]
    assert [report["pretrain_steps"] for report in reports] == [2, 4, 8]
    assert {report["continue_steps"] for report in reports} == {2}
    rows = {(row["recipe"], row["comparison"]): row for row in summary["trend"]}
    assert set(rows) == {("dual full ka=2kp", "equal tokens"), ("dual full ka=2kp", "equal compute")}
    row = rows["dual full ka=2kp", "equal compute"]
    gains = []  # per base, per seed: the dual recipe's aux loss minus the equal-compute single's loss
    for report in reports:
        recipes = {recipe["name"]: recipe for recipe in report["recipes"]}
        dual_runs = recipes["dual full ka=2kp"]["runs"]
        singles = recipes["single continued, compute of dual full ka=2kp"]["runs"]
        gains.append([run["aux_val_loss"] - single["primary_val_loss"] for run, single in zip(dual_runs, singles)])
    assert [base["mean"] for base in row["by_base"]] == pytest.approx([sum(g) / 2 for g in gains])
    slopes = []  # least squares on x = log2 steps = 1, 2, 3 per seed: slope = (y3 - y1) / 2
    for seed in (0, 1):
        slopes.append((gains[2][seed] - gains[0][seed]) / 2)
    assert row["slope_per_doubling"]["mean"] == pytest.approx(sum(slopes) / 2)
    assert row["slope_per_doubling"]["se"] == pytest.approx(abs(slopes[0] - slopes[1]) / 2)
    assert "slope per doubling" in capsys.readouterr().out
    # --resume with nothing missing trains nothing and keeps every run
    assert main(argv + ["--resume"]) == 0
    for path, report in zip(summary["reports"], reports):
        again = json.loads((out / path).read_text())
        assert again["recipes"] == report["recipes"] and len(again["commands"]) == 2
    assert main(QUICK_UPCYCLE + ["--base-steps", "2", "--steps", "4", "--out", str(out)]) == 2
    assert main(["experiment", "--quick", "--base-steps", "2", "--out", str(out)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "in place of --steps" in errors[0] and "--base-steps applies to --regime upcycle only" in errors[1]


def test_base_length_trend_on_known_numbers():
    def report(steps, seed_gains):
        gain = {"mean": sum(seed_gains) / 2, "se": None, "n": 2, "by_seed": dict(enumerate(seed_gains))}
        recipes = [
            {"name": "single continued", "aux_factor": None, "prediction_vs_single_continued": gain},
            {"name": "dual", "aux_factor": 2, "prediction_vs_single_continued": gain},
        ]
        return {"pretrain_steps": steps, "recipes": recipes}

    reports = [report(900, [-0.006, -0.005]), report(1800, [-0.004, -0.004]), report(3600, [-0.002, -0.003])]
    (row,) = base_length_trend(reports)  # single-flow recipes and comparisons a report lacks are left out
    assert (row["recipe"], row["comparison"]) == ("dual", "equal tokens")
    assert row["slope_per_doubling"]["mean"] == pytest.approx(0.0015)  # seeds: +0.002 and +0.001 per doubling
    assert row["at_longest_base"]["mean"] == pytest.approx(-0.0025)
    # the mean line reaches 0 another 0.0025 / 0.0015 doublings past 3600 steps
    assert row["doublings_to_zero"] == pytest.approx(0.0025 / 0.0015)
    growing = [report(900, [-0.002, -0.002]), report(1800, [-0.004, -0.004])]
    assert base_length_trend(growing)[0]["doublings_to_zero"] is None  # a gain that grows never reaches 0
    flat = [
        report(900, [-0.003, -0.003]),
        report(1800, [-0.003, -0.003 + 1e-12]),
    ]  # far from 0 in doublings: no overflow
    assert base_length_trend(flat)[0]["doublings_to_zero"] > 1e6


def test_gentle_rate_dual_recipe_is_compared_with_the_single_flow_of_its_own_rate(tmp_path, capsys):
    out = tmp_path / "gentle"
    argv = QUICK_UPCYCLE + ["--steps", "4", "--arms", "dual full ka=2kp", "gentle", "--out", str(out)] + DATA
    assert main(argv) == 0
    printed = capsys.readouterr().out
    recipes = {recipe["name"]: recipe for recipe in json.loads((out / "upcycle.json").read_text())["recipes"]}
    assert set(recipes) == {"single continued", "dual full ka=2kp", *RECIPE_GROUPS["gentle"]}
    gentle_single, gentle_dual = RECIPE_GROUPS["gentle"]
    assert recipes[gentle_dual]["learning_rate_factor"] == pytest.approx(1 / 3)
    for dual, single in (("dual full ka=2kp", "single continued"), (gentle_dual, gentle_single)):
        assert recipes[dual]["single_continued"] == single
        singles = {run["seed"]: run["primary_val_loss"] for run in recipes[single]["runs"]}
        deltas = [run["aux_val_loss"] - singles[run["seed"]] for run in recipes[dual]["runs"]]
        assert recipes[dual]["prediction_vs_single_continued"]["mean"] == pytest.approx(sum(deltas) / 2)
    # the gentle single flow itself is measured against the common rate's, and trained differently from it
    assert recipes[gentle_single]["single_continued"] == "single continued"
    assert recipes[gentle_single]["prediction_vs_single_continued"]["mean"] != 0
    assert "(vs lr x0.33)" in printed
