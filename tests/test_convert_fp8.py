"""
`dualflow convert` from block-FP8 sources (the layout of Qwen3's and DeepSeek-V3's FP8 releases): weights dequantized
while streaming, parity with transformers' own class on the dequantized weights, and every other quantization refused.

The "releases" are made here: tiny transformers models whose linear weights are quantized to float8_e4m3fn with one
float32 `weight_scale_inv` per 128 x 128 block (partial at the edges), router, norms, embeddings and LM head left
unquantized. The oracle dequantizes them independently and loads the result with transformers' own class.
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import PROMPT, assert_parity, make_source, run_dualflow, save_source
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from dualflow.convert import convert_checkpoint
from modeling_dualflow import DualFlowForCausalLM


BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
# The linear layers the releases quantize: attention and MLP projections, per expert or fused.
QUANTIZED = re.compile(r"(_proj\.weight|mlp\.experts\.(gate_up_proj|down_proj))$")
# Sizes with a partial block after a whole one: 192 = 128 + 64 (hidden, q_proj rows), 160 = 128 + 32 (experts).
EDGE_BLOCKS = dict(hidden_size=192, head_dim=48, moe_intermediate_size=160, intermediate_size=200)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 of a (..., rows, columns) weight: per block, scale_inv = max |w| / 448 and w / scale_inv in e4m3."""
    rows, columns = weight.shape[-2:]
    padded = torch.nn.functional.pad(weight.float(), (0, -columns % BLOCK, 0, -rows % BLOCK))
    blocks = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # (..., R, BLOCK, C, BLOCK)
    scale_inv = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX
    scale_inv = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))
    quantized = (blocks / scale_inv[..., :, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.flatten(-4, -3).flatten(-2, -1)[..., :rows, :columns].contiguous(), scale_inv


def dequantize(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The oracle: every element times the scale of its block (scales expanded to the weight's shape)."""
    rows, columns = quantized.shape[-2:]
    scales = scale_inv.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :rows, :columns]
    return quantized.float() * scales


def _rewrite_shards(folder: Path, edit):
    """Apply `edit(tensors)` to every shard of a saved checkpoint; returns the keys it added, by shard name."""
    added = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        before = set(tensors)
        edit(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})
        added |= {key: shard.name for key in set(tensors) - before}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {**data["weight_map"], **added}
        index.write_text(json.dumps(data))


def save_fp8_source(model, folder: Path, layout: str) -> tuple[Path, Path]:
    """
    Save `model` as a block-FP8 release in `folder` (layout as `save_source`), and its independently dequantized
    weights as an unquantized checkpoint beside it. Returns (FP8 folder, dequantized folder).
    """
    save_source(model, folder, layout)
    dequantized = folder.with_name(folder.name + "-dequantized")
    shutil.copytree(folder, dequantized)

    def quantize_linear_weights(tensors):
        for key in [key for key in tensors if QUANTIZED.search(key)]:
            tensors[key], tensors[key + "_scale_inv"] = quantize(tensors[key])

    def dequantize_like_the_release(tensors):
        for key in [key for key in tensors if QUANTIZED.search(key)]:
            tensors[key] = dequantize(*quantize(tensors[key]))

    _rewrite_shards(folder, quantize_linear_weights)
    _rewrite_shards(dequantized, dequantize_like_the_release)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return folder, dequantized


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors |= load_file(shard)
    return tensors


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3"])
def test_fp8_source_with_partial_blocks_converts_to_the_dequantized_model(family, tmp_path):
    layouts = ["single", "sharded"] + (["fused"] if family == "qwen3_moe" else [])
    for layout in layouts:
        source = make_source(family, **EDGE_BLOCKS)
        fp8, dequantized = save_fp8_source(source, tmp_path / f"src-{layout}", layout)
        assert any(tensor.dtype == torch.float8_e4m3fn for tensor in _stored(fp8).values())
        out = tmp_path / f"out-{layout}"
        convert_checkpoint(fp8, out, max_shard_size="100KB", show_progress=False)
        written = _stored(out)
        assert not [key for key in written if key.endswith("_scale_inv")]
        assert {tensor.dtype for tensor in written.values()} == {torch.float32}  # the source's dtype
        # The dequantized weights are the oracle's, bit for bit, and the model is transformers' on them.
        reference = AutoModelForCausalLM.from_pretrained(dequantized).eval()
        expected = reference.state_dict()
        converted = DualFlowForCausalLM.from_pretrained(out).state_dict()
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"):
            if name in expected:
                assert torch.equal(converted[name], expected[name]), (layout, name)
        model, expected_logits, aux_logits = assert_parity(reference, out)
        with torch.no_grad():  # exact in fp32: the same weights, the same computation
            assert torch.equal(model(PROMPT, use_aux_flow=False).logits, expected_logits), layout
        # The aux flow's rows run stacked under the primary ones (twice the rows per matmul, which can change the
        # kernel's summation order): equal up to float32 rounding.
        torch.testing.assert_close(aux_logits, expected_logits, rtol=0, atol=1e-6, msg=layout)


def test_fp8_source_to_bfloat16(tmp_path):
    source = make_source("qwen3_moe", **EDGE_BLOCKS)
    fp8, dequantized = save_fp8_source(source, tmp_path / "src", "single")
    # The releases store their unquantized tensors in bf16: `auto` gives the dequantized weights the same dtype.
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    convert_checkpoint(fp8, tmp_path / "auto", show_progress=False)
    convert_checkpoint(fp8, tmp_path / "bf16", dtype="bfloat16", show_progress=False)
    key = "model.layers.1.mlp.experts.down_proj"
    with safe_open(tmp_path / "auto" / "model.safetensors", framework="pt") as handle:
        assert handle.get_slice(key).get_dtype() == "BF16"
        assert handle.get_slice("model.embed_tokens.weight").get_dtype() == "F32"  # unquantized: kept as stored
    expected = AutoModelForCausalLM.from_pretrained(dequantized).state_dict()[key]
    written = load_file(tmp_path / "bf16" / "model.safetensors")
    assert torch.equal(written[key], expected.to(torch.bfloat16))  # dequantized in fp32, rounded once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_take_the_dtype_of_the_other_tensors_when_config_names_none(dtype, tmp_path):
    # config.json without a dtype: the weights are dequantized to the dtype the unquantized tensors are stored in,
    # and the converted config says so; one dtype throughout, not bf16 weights in a float32 checkpoint.
    source = make_source("qwen3_moe", **EDGE_BLOCKS).to(dtype)
    fp8, dequantized = save_fp8_source(source, tmp_path / "src", "single")
    config = json.loads((fp8 / "config.json").read_text())
    del config["dtype"]
    (fp8 / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    convert_checkpoint(fp8, out, show_progress=False)
    assert {tensor.dtype for tensor in _stored(out).values()} == {dtype}
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    reference = AutoModelForCausalLM.from_pretrained(dequantized, dtype=dtype).eval()
    if dtype == torch.float32:  # exact: the oracle's weights and computation
        model, expected_logits, _ = assert_parity(reference, out)
        with torch.no_grad():
            assert torch.equal(model(PROMPT, use_aux_flow=False).logits, expected_logits)
    else:  # dequantized in float32, rounded once
        key = "model.layers.1.mlp.experts.down_proj"
        assert torch.equal(load_file(out / "model.safetensors")[key], reference.state_dict()[key])


def test_transformers_dequantization_agrees_and_verify_passes(tmp_path):
    # transformers' own dequantizing load (FineGrainedFP8Config(dequantize=True)) is a second oracle where every
    # weight is a whole number of blocks: 256 = 2 x 128 (hidden, q_proj rows), 128 (experts, k/v rows).
    whole_blocks = dict(hidden_size=256, head_dim=64, moe_intermediate_size=128, intermediate_size=256)
    fp8, dequantized = save_fp8_source(make_source("qwen3_moe", **whole_blocks), tmp_path / "src", "sharded")
    ours = AutoModelForCausalLM.from_pretrained(dequantized).eval()
    theirs = AutoModelForCausalLM.from_pretrained(fp8, quantization_config=FineGrainedFP8Config(dequantize=True))
    with torch.no_grad():
        assert torch.equal(theirs.eval()(PROMPT).logits, ours(PROMPT).logits)
    code, stderr = run_dualflow("convert", fp8, tmp_path / "out", "--verify")
    assert code == 0, stderr
    assert "greedy generations identical | True" in (tmp_path / "out" / "README.md").read_text()
    assert_parity(ours, tmp_path / "out")


# ---- refusals: one line naming the problem, exit status 2, no OUT


ADVICE = "convert the unquantized (bf16 or fp32) release of the model instead"


def _config_only(folder: Path, quantization_config: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "quantization_config": quantization_config})
    )
    return folder


def _bad_fp8_sources(tmp_path: Path) -> dict:
    """name -> (source folder, extra CLI args, the error line after `dualflow convert: error: `)."""
    cases = {}
    for method in ("bitsandbytes", "gptq", "awq", "compressed-tensors", "torchao"):
        cases[method] = (
            _config_only(tmp_path / method, {"quant_method": method}),
            [],
            f"{method} quantized checkpoints are not supported (only block FP8 is, dequantized): {ADVICE}",
        )
    per_tensor = {**FP8_CONFIG, "weight_block_size": None}
    cases["fp8 per tensor"] = (
        _config_only(tmp_path / "per-tensor", per_tensor),
        [],
        f"fp8 checkpoints without weight_block_size (per-tensor scales) are not supported: {ADVICE}",
    )
    for name, value, supported in [
        ("activation_scheme", "static", "dynamic"),
        ("scale_fmt", "ue8m0", "float"),
        ("expert_dtype", "fp4", "fp8"),
    ]:
        cases[f"fp8 {name}"] = (
            _config_only(tmp_path / name, {**FP8_CONFIG, name: value}),
            [],
            f"fp8 checkpoints with {name}={value!r} are not supported (only {supported!r}): {ADVICE}",
        )

    source = make_source("qwen3_moe", **EDGE_BLOCKS)
    weight = "model.layers.1.mlp.experts.1.up_proj.weight"
    no_scale, _ = save_fp8_source(source, tmp_path / "no-scale", "single")
    _rewrite_shards(no_scale, lambda tensors: tensors.pop(weight + "_scale_inv"))
    cases["missing scale"] = (no_scale, [], f"{weight} is float8 but the checkpoint has no {weight}_scale_inv")
    wrong_blocks, _ = save_fp8_source(source, tmp_path / "wrong-blocks", "single")
    query = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_shards(wrong_blocks, lambda tensors: tensors.update({query + "_scale_inv": torch.ones(1, 1)}))
    cases["scale of the wrong shape"] = (
        wrong_blocks,
        [],
        f"{query}_scale_inv has shape [1, 1], expected [2, 2] for {query} of shape [192, 192] in blocks of (128, 128)",
    )
    scaled_router, _ = save_fp8_source(source, tmp_path / "scaled-router", "single")
    router = "model.layers.1.mlp.gate.weight"
    _rewrite_shards(scaled_router, lambda tensors: tensors.update({router + "_scale_inv": torch.ones(1, 2)}))
    cases["scale of an unquantized weight"] = (
        scaled_router,
        [],
        f"{router}_scale_inv scales {router}, which is torch.float32 rather than float8",
    )
    undeclared, _ = save_fp8_source(source, tmp_path / "undeclared", "single")
    config = json.loads((undeclared / "config.json").read_text())
    del config["quantization_config"]
    (undeclared / "config.json").write_text(json.dumps(config))
    cases["float8 without quantization_config"] = (
        undeclared,
        [],
        "shard model.safetensors holds a tensor of unsupported dtype 'F8_E4M3'",
    )
    edges, _ = save_fp8_source(source, tmp_path / "edges", "single")
    cases["verify with partial blocks"] = (
        edges,
        ["--verify"],
        "--verify cannot check this FP8 source: model.layers.0.mlp.down_proj.weight of shape [192, 200] ends in "
        "partial (128, 128) blocks, which transformers dequantizes with other blocks; convert without --verify",
    )
    return cases


def test_bad_fp8_sources_give_one_line_errors_and_no_output(tmp_path):
    out_parent = tmp_path / "outputs"
    out_parent.mkdir()
    for name, (src, extra, message) in _bad_fp8_sources(tmp_path / "sources").items():
        out = out_parent / name.replace(" ", "-")
        code, stderr = run_dualflow("convert", src, out, *extra)
        assert (code, stderr) == (2, f"dualflow convert: error: {message}\n"), name
        assert not out.exists(), name
    assert os.listdir(out_parent) == []


def test_a_refused_fp8_source_leaves_the_model_it_would_overwrite(tmp_path):
    source = make_source("qwen3_moe", **EDGE_BLOCKS)
    fp8, _ = save_fp8_source(source, tmp_path / "src", "single")
    out = tmp_path / "out"
    convert_checkpoint(fp8, out, show_progress=False)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    weight = "model.layers.1.mlp.experts.3.down_proj.weight"
    _rewrite_shards(fp8, lambda tensors: tensors.pop(weight + "_scale_inv"))
    code, stderr = run_dualflow("convert", fp8, out, "--overwrite")
    assert code == 2 and stderr.count("\n") == 1 and f"{weight} is float8 but" in stderr, stderr
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
