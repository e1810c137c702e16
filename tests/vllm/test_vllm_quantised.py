"""A Dual-Flow checkpoint quantised by `dualflow quantize` (compressed-tensors W4A8 on the attention
projections) served by vLLM with the aux flow on (k_a = 4 > k_p = 2, two aux rounds, aux adapters): greedy
tokens equal to transformers' on the dequantised weights, logprobs within QUANTISED_LOGPROB_TOLERANCE;
everything but the attention projections stored and served as it was."""

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from safetensors.torch import load_file
from transformers import ByT5Tokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
from vllm_reference import assert_matches_transformers, load_reference, random_prompts, served_greedy

from dualflow.cli import main
from dualflow.convert import convert_checkpoint as convert_to_dualflow
from dualflow.quantize import quantize_checkpoint
from dualflow.quantize_cli import check_compressed_tensors


MAX_NEW = 8
PROMPTS = random_prompts([5, 30, 70], seed=11)  # 70 > the 48-token budget: prefilled in chunks
# vLLM's W4A8 kernel also quantises each row of activations to int8 at run time; transformers computes on
# the dequantised weights with unquantised activations. The largest difference measured: docs/quantisation.md.
QUANTISED_LOGPROB_TOLERANCE = 0.05
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def dequantised(quantised_checkpoint, tmp_path_factory):
    """The quantised checkpoint dequantised to float32 by compressed-tensors' converter, in transformers."""
    folder = tmp_path_factory.mktemp("dequantised")
    convert_checkpoint(
        quantised_checkpoint,
        folder,
        CompressedTensorsDequantizer(quantised_checkpoint, dtype=torch.float32),
    )
    return load_reference(folder)


def served_quantisation(model) -> dict[str, str]:
    """In the engine process: the served model's linear layers that run a quantisation scheme, and theirs."""
    modules = model.named_modules()
    return {name: type(module.scheme).__name__ for name, module in modules if hasattr(module, "scheme")}


def test_only_the_attention_projections_are_quantised(adapter_checkpoint, quantised_checkpoint):
    source = load_file(adapter_checkpoint / "model.safetensors")
    quantised = load_file(quantised_checkpoint / "model.safetensors")
    projections = {name.removesuffix(".weight_scale") for name in quantised if name.endswith(".weight_scale")}
    assert projections == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ATTENTION}
    for name in projections:
        weight = quantised[f"{name}.weight"]
        assert weight.dtype == torch.int8 and -8 <= weight.min() and weight.max() <= 7  # int4 values
        assert quantised[f"{name}.weight_scale"].shape == (weight.shape[0], weight.shape[1] // 128)
    unchanged = [name for name in source if name.rpartition(".")[0] not in projections]
    assert any("aux_" in name for name in unchanged) and any("experts" in name for name in unchanged)
    for name in unchanged:  # the aux flow's modules, experts, router, norms, embeddings, lm_head: bit for bit
        assert torch.equal(quantised[name], source[name]), name
    config = json.loads((quantised_checkpoint / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"


def test_served_with_the_aux_flow_matches_transformers_on_the_dequantised_weights(
    engines, quantised_checkpoint, dequantised
):
    engine = engines.get(quantised_checkpoint)
    served = engine.apply_model(served_quantisation)[0]
    assert served == {
        f"model.layers.{i}.self_attn.{name}": "CompressedTensorsW4A8Int"
        for i in range(2)
        for name in ("qkv_proj", "o_proj")
    }
    assert dequantised.config.aux_num_experts_per_tok > dequantised.config.num_experts_per_tok
    outputs = served_greedy(engine, PROMPTS, MAX_NEW)
    assert_matches_transformers(outputs, PROMPTS, dequantised, MAX_NEW, tolerance=QUANTISED_LOGPROB_TOLERANCE)


def test_the_command_line_writes_it_and_refuses_what_it_cannot(
    adapter_checkpoint, quantised_checkpoint, tmp_path, capsys
):
    out = tmp_path / "again"
    assert main(["quantize", str(adapter_checkpoint), str(out)]) == 0
    written = f"wrote {out}: W4A8 (compressed-tensors) on 8 attention projections of 2 layers"
    assert capsys.readouterr().out.startswith(written)
    refusals = {
        (quantised_checkpoint, tmp_path / "twice"): f"{quantised_checkpoint} is already quantised "
        "(compressed-tensors): give the unquantised checkpoint",
        (adapter_checkpoint, out): f"output folder {out} holds a finished run (a saved Dual-Flow model); "
        "pass --overwrite to replace it",
    }
    for (src, folder), message in refusals.items():
        assert main(["quantize", str(src), str(folder)]) == 2
        assert capsys.readouterr().err == f"dualflow quantize: error: {message}\n"
    assert not (tmp_path / "twice").exists()
    assert main(["quantize", str(adapter_checkpoint), str(out), "--overwrite"]) == 0


def test_the_command_keeps_the_source_layout_quietly_and_push_takes_it(adapter_checkpoint, tmp_path, capsys):
    # compressed-tensors indexed a single file too (and push refused the pair), and logged each file it copied.
    check_compressed_tensors(version("compressed-tensors"))  # the release vLLM installed is in the declared range
    out = tmp_path / "w4a8"
    command = [sys.executable, "-m", "dualflow.cli", "quantize", str(adapter_checkpoint), str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    loguru_line = r"\| (TRACE|DEBUG|INFO|SUCCESS|WARNING|ERROR|CRITICAL) +\| "
    assert not re.search(loguru_line, completed.stderr) and "compressed_tensors" not in completed.stderr
    assert sorted(path.name for path in out.glob("model.safetensors*")) == ["model.safetensors"]
    assert main(["push", str(out), "someone/tiny-w4a8", "--dry-run"]) == 0, capsys.readouterr().err
    assert re.search(r"^ +[\d,]+  model\.safetensors$", capsys.readouterr().out, re.MULTILINE)
    # A sharded source stays sharded: the index and exactly the shards it names, the same tensors as one file.
    sharded = tmp_path / "sharded"
    load_reference(adapter_checkpoint).save_pretrained(sharded, max_shard_size="500KB")
    quantised = quantize_checkpoint(sharded, tmp_path / "sharded-w4a8")["out"]
    weight_map = json.loads((quantised / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1 and sorted(path.name for path in quantised.glob("*.safetensors")) == shards
    assert main(["push", str(quantised), "someone/tiny-w4a8", "--dry-run"]) == 0, capsys.readouterr().err
    single = load_file(out / "model.safetensors")
    tensors = {name: tensor for shard in shards for name, tensor in load_file(quantised / shard).items()}
    assert weight_map.keys() == tensors.keys() == single.keys()
    assert all(torch.equal(tensors[name], single[name]) for name in single)


def test_the_quantisation_pages_vllm_block_runs_as_written(tmp_path):
    """docs/quantisation.md's block, as a user runs it on a CPU, with `my-dualflow` a converted tiny Qwen3-MoE."""
    page = (Path(__file__).parents[2] / "docs" / "quantisation.md").read_text()
    marker = "<!-- not run: tests/vllm/test_vllm_quantised.py runs this block as written"
    block = re.search(re.escape(marker) + r"[^\n]*\n```bash\n(.*?)```", page, re.DOTALL).group(1)
    tokenizer = ByT5Tokenizer()  # knows any text: the block's prompt is "Hello"
    source = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,  # one quantisation group of the W4A8 preset
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(source).save_pretrained(tmp_path / "source")
    tokenizer.save_pretrained(tmp_path / "source")
    convert_to_dualflow(tmp_path / "source", tmp_path / "my-dualflow", aux_top_k=4, show_progress=False)
    (tmp_path / ".venv-vllm").symlink_to(Path(sys.executable).parents[1])  # the page's `.venv-vllm`
    # as a user's shell has it: vLLM's own engine processes (conftest.py keeps this session's engines in-process)
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["HF_HUB_OFFLINE"] = "1"
    command = ["bash", "-e", "-c", block]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (tmp_path / "my-dualflow-w4a8" / "model.safetensors").is_file()
    assert "quantization=compressed-tensors" in completed.stdout + completed.stderr  # vLLM's engine config line
