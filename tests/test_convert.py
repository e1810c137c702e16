"""`dualflow convert`: every supported family, both Hub layouts, bad inputs, and the streaming memory bound."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    FAMILIES,
    MOE_FAMILIES,
    PROMPT,
    TOLERANCE,
    assert_parity,
    make_source,
    run_dualflow,
    save_source,
    signallable_process,
)
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dualflow.convert import SUPPORTED_MODEL_TYPES, convert_checkpoint
from dualflow.convert.verify import check_parity
from dualflow.hub import split_folder
from dualflow.output_folder import UNFINISHED_MARKER, output_folder
from modeling_dualflow import DualFlowForCausalLM


def test_every_supported_family_is_covered():
    assert set(SUPPORTED_MODEL_TYPES) == set(FAMILIES)


def test_the_converter_does_not_import_its_command_line():
    code = "import sys, dualflow.convert.converter\nprint('dualflow.convert.cli' in sys.modules)"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert completed.stdout.strip().splitlines()[-1] == "False", completed.stderr[-2000:]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_conversion_parity(family, tmp_path):
    source = make_source(family)
    layouts = ["single", "sharded"] + (["fused"] if family in MOE_FAMILIES else [])
    for layout in layouts:
        src = save_source(source, tmp_path / f"src-{layout}", layout)
        out = tmp_path / f"out-{layout}"
        # Sharded input also gets sharded output; the single file stays a single file.
        summary = convert_checkpoint(
            src, out, max_shard_size="30KB" if layout != "single" else "5GB", show_progress=False
        )
        assert (summary["num_shards"] > 1) == (layout != "single")
        assert (out / "model.safetensors.index.json").is_file() == (layout != "single")
        converted, _, _ = assert_parity(source, out)
        config = converted.config
        assert config.architectures == ["DualFlowForCausalLM"]
        assert config.aux_num_experts_per_tok == config.num_experts_per_tok
        # upcycling init: aux embedding = copy of the token embedding, no coupling
        assert torch.equal(converted.model.aux_embed_tokens.weight, source.model.embed_tokens.weight)
        assert all(not layer.aux_coupling.weight.any() for layer in converted.model.layers)


def test_converted_layout_and_config(tmp_path):
    source = make_source("qwen2_moe")
    src = save_source(source, tmp_path / "src", "single")
    (src / "tokenizer.json").write_text("{}")
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# source\n")
    convert_checkpoint(src, tmp_path / "out", show_progress=False)
    out = tmp_path / "out"
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 48, 32)  # (E, 2I, H)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 32, 24)  # (E, H, I)
    assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 32)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (40, 32)  # mlp_only_layers=[1] stays dense
    assert shapes["model.layers.2.aux_coupling.weight"] == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes and "model.layers.0.self_attn.q_proj.bias" in shapes
    # gate rows first, then up rows, per expert
    gate_up = DualFlowForCausalLM.from_pretrained(out).model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(gate_up[2, :24], source.model.layers[0].mlp.experts.gate_up_proj[2, :24])
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dualflow.DualFlowConfig",
        "AutoModel": "modeling_dualflow.DualFlowModel",
        "AutoModelForCausalLM": "modeling_dualflow.DualFlowForCausalLM",
    }
    assert (config["qkv_bias"], config["attention_bias"], config["mlp_only_layers"]) == (True, False, [1])
    files = set(os.listdir(out))
    assert {"configuration_dualflow.py", "modeling_dualflow.py", "cache_dualflow.py"} <= files
    assert {"tokenizer.json", "generation_config.json", "README.md"} <= files
    card = (out / "README.md").read_text()
    assert "license: apache-2.0" in card and "dual-flow" in card and "dualflow convert src out\n" in card
    assert 'from_pretrained("out", trust_remote_code=True)' in card
    assert str(tmp_path) not in card  # a card is published with the model: no local path
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # no temporary leftovers


def test_the_code_of_a_custom_tokenizer_is_copied_and_pushed(tmp_path):
    # A tokenizer whose tokenizer_config.json auto_map names its own module, which imports another relatively.
    src = save_source(make_source("qwen3"), tmp_path / "src", "single")
    ByT5Tokenizer().save_pretrained(src)
    (src / "toy_shift.py").write_text("SHIFT = 1\n")
    (src / "tokenization_toy.py").write_text(
        textwrap.dedent(
            """
            from transformers import ByT5Tokenizer

            from .toy_shift import SHIFT


            class ToyTokenizer(ByT5Tokenizer):
                def _convert_token_to_id(self, token):
                    return super()._convert_token_to_id(token) + SHIFT
            """
        )
    )
    (src / "train.py").write_text("print('not the tokenizer')\n")
    tokenizer_config = json.loads((src / "tokenizer_config.json").read_text())
    tokenizer_config |= {
        "tokenizer_class": "ToyTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_toy.ToyTokenizer", None]},
    }
    (src / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    out = tmp_path / "out"
    summary = convert_checkpoint(src, out, show_progress=False)
    assert {"tokenization_toy.py", "toy_shift.py"} <= set(summary["copied_files"])
    assert not (out / "train.py").exists()
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert type(tokenizer).__name__ == "ToyTokenizer" and type(tokenizer).__module__.startswith("transformers_modules")
    assert tokenizer("a").input_ids == [ord("a") + 3 + 1, 1]  # ByT5's byte id, shifted, then </s>
    published, _ = split_folder(out, "model")  # what `dualflow push` uploads
    assert {"tokenization_toy.py", "toy_shift.py", "tokenizer_config.json"} <= set(published)


def test_hub_cache_folder_names_the_base_model(tmp_path):
    snapshot = tmp_path / "hub" / "models--some-org--tiny-qwen" / "snapshots" / "0123abcd"
    save_source(make_source("qwen2"), snapshot, "single")
    convert_checkpoint(snapshot, tmp_path / "out", show_progress=False)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: some-org/tiny-qwen" in card and "dualflow convert some-org/tiny-qwen out\n" in card


def test_offline_hub_id_is_a_short_line_saying_what_to_do(tmp_path):
    # conftest sets HF_HUB_OFFLINE=1: no network, huggingface_hub raises its long LocalEntryNotFoundError
    code, stderr = run_dualflow("convert", "some-org/not-downloaded-model", tmp_path / "out")
    line = stderr.strip().splitlines()[-1]
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert line == (
        "dualflow convert: error: some-org/not-downloaded-model is not a local folder and Hub downloads are off "
        "(HF_HUB_OFFLINE): pass a local folder"
    )
    assert len(line) - len("some-org/not-downloaded-model") < 120


def test_larger_aux_top_k_loads_and_runs(tmp_path):
    source = make_source("mixtral")
    src = save_source(source, tmp_path / "src", "sharded")
    convert_checkpoint(src, tmp_path / "out", aux_top_k=4, show_progress=False)
    converted, reference, aux = assert_parity(source, tmp_path / "out", aux_matches=False)
    assert converted.config.aux_num_experts_per_tok == 4
    assert (aux - reference).abs().max() > 1e-3  # the aux flow really uses 4 experts, the primary still 2


def test_verify_flag_and_remote_code_load_in_fresh_process(tmp_path):
    source = make_source("olmoe")
    src = save_source(source, tmp_path / "src", "sharded")
    out = tmp_path / "out"
    code, stderr = run_dualflow("convert", src, out, "--verify", "--dtype", "float32")
    assert code == 0, stderr
    card = (out / "README.md").read_text()
    assert "OlmoeForCausalLM" in card and "greedy generations identical | True" in card
    expected = source(PROMPT).logits
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["modeling_dualflow"] = None  # the package must not be importable here
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        logits = model(torch.tensor({PROMPT.tolist()})).logits
        print((logits - torch.load({str(tmp_path / "expected.pt")!r})).abs().max().item())
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) <= TOLERANCE


def test_verify_detects_a_mismatch(tmp_path):
    src = save_source(make_source("qwen3", seed=0), tmp_path / "src", "single")
    other = save_source(make_source("qwen3", seed=1), tmp_path / "other", "single")
    convert_checkpoint(other, tmp_path / "converted-other", show_progress=False)
    parity = check_parity(src, tmp_path / "converted-other")
    assert not parity["passed"] and parity["max_abs_diff_primary"] > TOLERANCE


# ---- bad inputs: one-line error, exit status 2, no OUT and no temporary folder left behind


def _write_config(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(text)
    return folder


def _edit_json(path: Path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _bad_sources(tmp_path: Path) -> dict:
    """name -> (source folder, extra CLI args, text the error must contain)."""
    cases = {}
    empty = tmp_path / "empty"
    empty.mkdir(parents=True)
    cases["missing config"] = (empty, [], "has no config.json")
    cases["invalid json"] = (_write_config(tmp_path / "badjson", "{not json"), [], "not valid JSON")
    cases["invalid config"] = (
        _write_config(tmp_path / "badconfig", json.dumps({"model_type": "llama", "hidden_size": "big"})),
        [],
        "Field 'hidden_size' expected int, got str",
    )
    deepseek = _write_config(tmp_path / "dsv3", '{"model_type": "deepseek_v3"}')
    cases["deepseek"] = (deepseek, [], "'deepseek_v3' is not supported")
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    cases["gpt2"] = (tmp_path / "gpt2", [], "'gpt2' is not supported; supported: mixtral, qwen2_moe")

    mixtral = make_source("mixtral")
    missing_shard = save_source(mixtral, tmp_path / "missing_shard", "sharded")
    second_shard = sorted(missing_shard.glob("model-*.safetensors"))[1]
    second_shard.unlink()
    cases["missing shard"] = (missing_shard, [], f"missing shard {second_shard.name}")
    truncated = save_source(mixtral, tmp_path / "truncated", "sharded")
    shard = truncated / second_shard.name
    shard.write_bytes(shard.read_bytes()[:-100])
    cases["truncated shard"] = (truncated, [], "unreadable or truncated")
    unindexed = save_source(mixtral, tmp_path / "unindexed", "sharded")
    dropped = "model.layers.2.self_attn.k_proj.weight"
    _edit_json(unindexed / "model.safetensors.index.json", lambda d: d["weight_map"].pop(dropped))
    cases["key missing from index"] = (unindexed, [], f"{dropped} is missing from model.safetensors.index.json")

    moe = save_source(mixtral, tmp_path / "moe", "single")
    cases["aux top-k 0"] = (moe, ["--aux-top-k", "0"], "--aux-top-k must be in [1, num_experts=4], got 0")
    cases["aux top-k 5"] = (moe, ["--aux-top-k", "5"], "got 5")
    dense = save_source(make_source("llama"), tmp_path / "dense", "single")
    cases["aux top-k dense"] = (dense, ["--aux-top-k", "2"], "llama is dense")
    retied = save_source(make_source("mistral"), tmp_path / "retied", "single")
    _edit_json(retied / "config.json", lambda d: d.update(tie_word_embeddings=True))
    cases["tie mismatch"] = (retied, [], "lm_head.weight differs from model.embed_tokens.weight")
    untied = save_source(make_source("llama"), tmp_path / "untied", "single")
    _edit_json(untied / "config.json", lambda d: d.update(tie_word_embeddings=False))
    cases["lm_head missing"] = (untied, [], "no lm_head.weight")
    cases["bad shard size"] = (moe, ["--max-shard-size", "lots"], "--max-shard-size")
    hidden = mixtral.config.hidden_size
    cases["adapter rank above the width"] = (
        moe,
        ["--aux-adapter-rank", hidden + 1],
        f"--aux-adapter-rank must be in [0, hidden_size={hidden}] (0 = no adapters), got {hidden + 1}",
    )
    no_experts = save_source(mixtral, tmp_path / "no-experts", "single")
    _edit_json(no_experts / "config.json", lambda d: d.update(num_local_experts=0))
    cases["no experts"] = (no_experts, [], "mixtral config has 0 experts: a MoE checkpoint needs at least 1")
    no_width = save_source(mixtral, tmp_path / "no-width", "single")
    _edit_json(no_width / "config.json", lambda d: d.pop("hidden_size"))
    cases["size field missing"] = (no_width, [], "from config.json, which has no hidden_size (transformers' defaults")
    cases["revision of a folder"] = (moe, ["--revision", "v2"], f"--revision applies to Hub sources; {moe} is a local")
    return cases


def test_bad_inputs_give_one_line_errors_and_no_output(tmp_path):
    out_parent = tmp_path / "outputs"
    out_parent.mkdir()
    for name, (src, extra, message) in _bad_sources(tmp_path / "sources").items():
        out = out_parent / name.replace(" ", "-")
        code, stderr = run_dualflow("convert", src, out, *extra)
        assert code == 2, (name, stderr)
        assert message in stderr, (name, stderr)
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, (name, stderr)
        assert not out.exists(), name
    assert os.listdir(out_parent) == []  # no temporary sibling left behind either


def test_overwrite_replaces_only_a_dualflow_model_or_an_unfinished_conversion(tmp_path):
    src = save_source(make_source("qwen2"), tmp_path / "src", "single")
    out = tmp_path / "out"
    (out / "src").mkdir(parents=True)
    user_files = {"notes.md": "my notes", ".env": "HF_TOKEN=secret", "src/train.py": "print('mine')"}
    for name, text in user_files.items():
        (out / name).write_text(text)
    code, stderr = run_dualflow("convert", src, out)
    assert code == 2 and stderr.strip() == (
        f"dualflow convert: error: output folder {out} already exists and is not empty (.env, notes.md, src/); "
        "choose another output folder"
    )
    code, stderr = run_dualflow("convert", src, out, "--overwrite")
    assert code == 2 and stderr.strip() == (
        f"dualflow convert: error: output folder {out} holds files that are not a Dual-Flow model's (.env, notes.md, "
        "src/): --overwrite replaces only a Dual-Flow model or an unfinished conversion; choose another output folder"
    )
    assert {name: (out / name).read_text() for name in user_files} == user_files
    assert sorted(os.listdir(out)) == [".env", "notes.md", "src"]

    # A finished conversion: the error's advice, followed, replaces it.
    model = tmp_path / "model"
    assert run_dualflow("convert", src, model)[0] == 0
    code, stderr = run_dualflow("convert", src, model, "--dtype", "bfloat16")
    assert code == 2 and stderr.strip() == (
        f"dualflow convert: error: output folder {model} holds a finished run (a saved Dual-Flow model); pass "
        "--overwrite to replace it"
    )
    code, stderr = run_dualflow("convert", src, model, "--dtype", "bfloat16", "--overwrite")
    assert code == 0, stderr
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"
    # The same model with a file of the user's beside it is not replaced.
    (model / "eval-notes.md").write_text("mine")
    code, stderr = run_dualflow("convert", src, model, "--overwrite")
    assert code == 2 and "holds files that are not a Dual-Flow model's (eval-notes.md)" in stderr
    assert (model / "eval-notes.md").read_text() == "mine" and (model / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["model", "out", "src"]


def test_out_inside_the_source_and_source_inside_out_are_refused(tmp_path):
    src = save_source(make_source("qwen2"), tmp_path / "mix", "single")
    files = sorted(os.listdir(src))
    for out, extra, message in [
        (src / "sub", [], f"OUT {src / 'sub'} is inside the source folder {src}"),
        # --overwrite replaces no folder but a Dual-Flow model: not the source, nor a folder holding it
        (src, ["--overwrite"], f"output folder {src} holds no Dual-Flow model: --overwrite replaces only"),
        (tmp_path, ["--overwrite"], "holds files that are not a Dual-Flow model's (mix/): --overwrite replaces only"),
    ]:
        code, stderr = run_dualflow("convert", src, out, *extra)
        assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr
        assert sorted(os.listdir(src)) == files and os.listdir(tmp_path) == ["mix"]


def test_an_empty_existing_out_is_written_like_a_new_one(tmp_path):
    # One rule for convert and finetune: an existing empty folder (made by `mkdir`, a mount point) is written into.
    src = save_source(make_source("qwen2"), tmp_path / "src", "single")
    (tmp_path / "out").mkdir()
    code, stderr = run_dualflow("convert", src, tmp_path / "out")
    assert code == 0, stderr
    modes = {(tmp_path / "out" / name).stat().st_mode for name in ("model.safetensors", "config.json")}
    assert len(modes) == 1
    assert not (tmp_path / "out" / UNFINISHED_MARKER).exists()


def test_a_second_run_writing_the_same_out_fails_in_one_line(tmp_path):
    src = save_source(make_source("qwen2"), tmp_path / "src", "single")
    out = tmp_path / "out"
    with output_folder(out, "finetune") as first:  # another run (convert or finetune) is writing `out`
        (first.path / "theirs.txt").write_text("the first run's output")
        code, stderr = run_dualflow("convert", src, out)
        assert code == 2 and stderr.count("\n") == 1, stderr
        assert stderr.startswith(f"dualflow convert: error: another run is writing {out};")
    assert sorted(os.listdir(out)) == ["theirs.txt"]


def test_a_killed_conversion_is_reported_by_the_next_run(tmp_path):
    src = save_source(make_source("mixtral"), tmp_path / "src", "single")
    command = [sys.executable, "-m", "dualflow.cli", "convert", str(src), str(tmp_path / "out"), "--verify"]
    process = signallable_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not (tmp_path / "out" / "config.json").exists():
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.kill()
    process.communicate(timeout=60)
    code, stderr = run_dualflow("convert", src, tmp_path / "out")
    assert code == 2 and stderr.strip() == (
        f"dualflow convert: error: output folder {tmp_path / 'out'} holds an unfinished `dualflow convert` run "
        f"(stopped before it ended: see its {UNFINISHED_MARKER}); pass --overwrite to replace it"
    )
    code, stderr = run_dualflow("convert", src, tmp_path / "out", "--overwrite")
    assert code == 0, stderr
    assert not (tmp_path / "out" / UNFINISHED_MARKER).exists()


# ---- memory: conversion streams, so peak RSS tracks the largest source tensor, not the checkpoint

# Peak RSS is read from /proc/self/status (VmHWM) rather than getrusage: Linux carries ru_maxrss across fork and
# exec, so a child spawned by this (large) pytest process would report the parent's peak, not its own.
PEAK_RSS_SCRIPT = """
import re, sys
from dualflow.convert import convert_checkpoint
if len(sys.argv) > 1:
    convert_checkpoint(sys.argv[1], sys.argv[2], max_shard_size="40MB", show_progress=False)
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
"""


def _peak_rss_bytes(*args) -> int:
    result = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.strip().splitlines()[-1])


def test_peak_memory_stays_near_largest_tensor(tmp_path):
    config = MixtralConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
    )
    MixtralForCausalLM(config).save_pretrained(tmp_path / "src", max_shard_size="20MB")
    checkpoint_bytes = sum(path.stat().st_size for path in (tmp_path / "src").glob("*.safetensors"))
    largest_tensor_bytes = config.vocab_size * config.hidden_size * 4  # the embedding / LM head
    # Claimed bound (docs/convert.md): above the bare interpreter, 2 x the largest source tensor + 32 MB.
    bound = 2 * largest_tensor_bytes + 32 * 2**20
    assert checkpoint_bytes > 4 * bound

    baseline = _peak_rss_bytes()
    peak = _peak_rss_bytes(tmp_path / "src", tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    assert baseline > 100 * 2**20  # torch + transformers are imported: the measure is the child's own
    assert peak - baseline < bound, f"conversion used {(peak - baseline) / 2**20:.0f} MiB over the interpreter"


def test_peak_memory_with_fp8_weights_stays_near_largest_tensor(tmp_path):
    # A block-FP8 source whose largest tensors are quantized MLP weights (16 MiB as float8, 32 MiB written in bf16):
    # each is dequantized one block of rows at a time. Whole, its float32 dequantization alone would take 64 MiB.
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=16384,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        shapes = {key: tensor.shape for key, tensor in Qwen3ForCausalLM(config).state_dict().items()}
    tensors = {}
    for key, shape in shapes.items():
        if not key.endswith("_proj.weight"):
            tensors[key] = torch.randn(shape, dtype=torch.bfloat16)
            continue
        tensors[key] = torch.randn(shape).to(torch.float8_e4m3fn)
        tensors[key + "_scale_inv"] = torch.full((-(-shape[0] // 128), -(-shape[1] // 128)), 0.01)
    config.quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    config.save_pretrained(tmp_path / "src")
    save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    largest_tensor_bytes = config.intermediate_size * config.hidden_size * 2  # as written, in bf16
    bound = 2 * largest_tensor_bytes + 32 * 2**20  # as for unquantized sources (docs/convert.md)

    baseline = _peak_rss_bytes()
    peak = _peak_rss_bytes(tmp_path / "src", tmp_path / "out")
    key = "model.layers.0.mlp.down_proj.weight"
    shard = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(tmp_path / "out" / shard, framework="pt") as handle:
        assert handle.get_slice(key).get_dtype() == "BF16"  # config.json's dtype
    assert peak - baseline < bound, f"conversion used {(peak - baseline) / 2**20:.0f} MiB over the interpreter"


@pytest.mark.parametrize("where", ["sys", "file"])
def test_unwritable_output_folder_is_one_line_error(tmp_path, where):
    # Tests run as root, which writes through chmod 0o555: /sys refuses new folders to root too, and so does a file.
    src = save_source(make_source("mixtral"), tmp_path / "src", "single")
    (tmp_path / "a-file").write_text("not a folder")
    out = Path("/sys/dualflow-test-out") if where == "sys" else tmp_path / "a-file" / "out"
    code, stderr = run_dualflow("convert", src, out)
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith(
        f"dualflow convert: error: cannot write the output folder {out}: "
    )
    assert not out.exists()


CONVERT_IN_PYTHON = (
    "import sys\nfrom dualflow.convert import convert_checkpoint\nconvert_checkpoint(*sys.argv[1:], verify=True)"
)


@pytest.mark.parametrize(
    "signum, entry",
    [(signal.SIGINT, "cli"), (signal.SIGTERM, "cli"), (signal.SIGTERM, "python")],
    ids=["ctrl-c", "sigterm", "sigterm-python"],
)
def test_interrupted_convert_is_one_line_and_leaves_nothing(tmp_path, signum, entry):
    src = save_source(make_source("mixtral"), tmp_path / "src", "single")
    if entry == "cli":
        command = [sys.executable, "-m", "dualflow.cli", "convert", str(src), str(tmp_path / "out"), "--verify"]
    else:  # convert_checkpoint called by a program of the user's: what it wrote is removed too
        command = [sys.executable, "-c", CONVERT_IN_PYTHON, str(src), str(tmp_path / "out")]
    process = signallable_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # --verify loads and runs both models after the folder is written: seconds in which to press Ctrl-C / kill it.
    while not (tmp_path / "out" / "config.json").exists():
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=300)
    assert [path.name for path in tmp_path.iterdir()] == ["src"]
    if entry == "cli":
        expected = (130, "interrupted") if signum == signal.SIGINT else (143, "terminated (SIGTERM)")
        assert (process.returncode, stderr.strip().splitlines()[-1]) == (
            expected[0],
            f"dualflow convert: {expected[1]}",
        )
        assert "Traceback" not in stderr
    else:
        assert "DualFlowTerminated" in stderr
