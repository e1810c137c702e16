"""`dualflow compare` / `demo`: metric code on tiny models, report schemas, the CLI paths end to end."""

import json
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from conftest import tiny_model

from dualflow.cli import main
from dualflow.instruments.compare import (
    BASELINE,
    SCHEMA,
    CompareSettings,
    build_variants,
    compare_report,
    kv_cache_bytes,
    plot_report,
    primary_top_k,
)
from dualflow.instruments.data import decode_bytes, encode_bytes, split_files, stdlib_source_files
from dualflow.instruments.tiny_lm import mean_token_nll


STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL_TEXT_FILES = [STDLIB / name for name in ("textwrap.py", "string.py", "shlex.py", "colorsys.py", "bisect.py")]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def expected_kv_cache_bytes(config, batch_size: int, seq_len: int) -> int:
    """fp32 keys + values of every layer: 2 * layers * batch * kv_heads * seq * head_dim * 4 bytes."""
    return 2 * config.num_hidden_layers * batch_size * config.num_key_value_heads * seq_len * config.head_dim * 4


def _hand_nll(model, blocks, **kwargs) -> float:
    """Mean over every predicted token of -log p(next token), straight from log-softmax."""
    nlls = []
    for block in blocks:
        log_probs = torch.log_softmax(model(block[None], **kwargs).logits[0, :-1].float(), dim=-1)
        nlls.append(-log_probs.gather(-1, block[1:, None]).squeeze(-1))
    return torch.cat(nlls).mean().item()


def test_mean_token_nll_equals_hand_computation():
    model = tiny_model(aux_num_experts_per_tok=4)
    blocks = torch.randint(0, model.config.vocab_size, (5, 12))
    for use_aux_flow in (False, True):
        expected = _hand_nll(model, blocks, use_aux_flow=use_aux_flow)
        # batch_size=2 leaves a short last batch: the token mean must still weight every token once
        assert abs(mean_token_nll(model, blocks, batch_size=2, use_aux_flow=use_aux_flow) - expected) < 1e-5
    logits = model(blocks, use_aux_flow=False).logits
    cross_entropy = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    assert abs(mean_token_nll(model, blocks, batch_size=5, use_aux_flow=False) - cross_entropy.item()) < 1e-5


def test_variant_losses_reference_equals_grouped_and_top_k_override_matters():
    model = tiny_model(aux_num_experts_per_tok=4)
    with torch.no_grad():  # random experts at init barely move the output: make the routing visible in the loss
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(20)
            layer.mlp.experts.down_proj.mul_(20)
    blocks = torch.randint(0, model.config.vocab_size, (3, 10))
    variants = {variant.name: variant for variant in build_variants(model.config)}
    assert list(variants) == [BASELINE, "dual-flow", "two-pass reference", "single top-k=4"]
    losses = {name: variant.nll(model, blocks, batch_size=2) for name, variant in variants.items()}
    assert abs(losses["two-pass reference"] - losses["dual-flow"]) < 1e-5
    assert abs(losses["dual-flow"] - _hand_nll(model, blocks, use_aux_flow=True)) < 1e-5
    assert abs(losses["single top-k=4"] - losses[BASELINE]) > 1e-4  # routing to 4 experts changes the model
    with primary_top_k(model, 4):
        assert abs(losses["single top-k=4"] - _hand_nll(model, blocks, use_aux_flow=False)) < 1e-5
    assert all(layer.mlp.top_k == 2 for layer in model.model.layers)  # restored afterwards


def test_kv_cache_bytes_formula_and_dual_equals_primary_only():
    model = tiny_model(aux_num_experts_per_tok=4)
    config = model.config
    batch, seq = 3, 11
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    measured = {variant.name: kv_cache_bytes(model, variant, input_ids) for variant in build_variants(config)}
    # 2 (k and v) * 2 layers * 3 batch * 2 kv heads * 11 tokens * 8 head_dim * 4 bytes (fp32), for every variant
    assert set(measured.values()) == {2 * 2 * 3 * 2 * 11 * 8 * 4} == {expected_kv_cache_bytes(config, batch, seq)}


def test_compare_report_schema_table_and_plot(tmp_path):
    model = tiny_model(aux_num_experts_per_tok=3)
    tokens = torch.randint(0, model.config.vocab_size, (400,))
    settings = CompareSettings(
        prompt_lengths=(8, 16),
        batch_sizes=(1, 2),
        decode_tokens=2,
        decode_prompt_length=4,
        repeats=2,
        eval_block_size=16,
        eval_blocks=3,
    )
    report = compare_report(model, "tiny", ["random"], tokens, settings, show_progress=False)
    report = json.loads(json.dumps(report))  # JSON round trip: every value serialisable
    assert report["schema"] == SCHEMA
    assert report["variants"] == [BASELINE, "dual-flow", "two-pass reference", "single top-k=3"]
    assert report["settings"]["eval_tokens"] == 48 and report["settings"]["prompt_lengths"] == [8, 16]
    for name in report["variants"]:
        metrics = report["metrics"][name]
        assert set(metrics) == {
            "prefill_ms",
            "decode_tokens_per_s",
            "kv_cache_bytes",
            "peak_memory_bytes",
            "peak_memory_increase_bytes",
            "val_loss",
        }
        assert set(metrics["prefill_ms"]) == {"8", "16"} and set(metrics["decode_tokens_per_s"]) == {"1", "2"}
        assert all(value > 0 for value in metrics["prefill_ms"].values())
        assert metrics["kv_cache_bytes"] == expected_kv_cache_bytes(model.config, 1, 16)
        ratios = report["ratios_vs_primary_only"][name]
        assert (
            abs(ratios["prefill_ms"]["8"] - metrics["prefill_ms"]["8"] / report["metrics"][BASELINE]["prefill_ms"]["8"])
            < 1e-9
        )
    assert report["ratios_vs_primary_only"][BASELINE]["kv_cache_bytes"] == 1.0
    lines = report["table"].splitlines()
    assert lines[0].split()[1:] == ["primary-only", "dual-flow", "two-pass", "reference", "single", "top-k=3"]
    labels = [line[: lines[1].index(" ")].strip() for line in lines[2:]]
    assert labels == [
        "prefill ms, prompt 8",
        "prefill ms, prompt 16",
        "decode tok/s, batch 1",
        "decode tok/s, batch 2",
        "KV cache KiB",
        "peak memory MiB",
        "increase MiB",
        "val loss (nats/token)",
    ]
    assert "(1.00x)" in lines[6]  # KV cache: every variant holds exactly the primary cache
    plot_report(report, tmp_path / "compare.png")
    assert (tmp_path / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_compare_cli_on_a_checkpoint_folder_and_bad_input(tmp_path, capsys):
    folder = tmp_path / "byte-model"
    tiny_model(vocab_size=256, aux_num_experts_per_tok=4).save_pretrained(folder)  # no tokenizer: byte-level
    out = tmp_path / "report.json"
    argv = [
        "compare",
        str(folder),
        "--data",
        str(SMALL_TEXT_FILES[0]),
        "--prompt-lengths",
        "8,32",
        "--batch",
        "1,2",
        "--decode-tokens",
        "2",
        "--repeats",
        "1",
        "--eval-tokens",
        "64",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == str(folder) and report["settings"]["data"] == [str(SMALL_TEXT_FILES[0])]
    assert report["settings"]["eval_tokens"] == 64
    assert "single top-k=4" in capsys.readouterr().out

    small_vocab = tmp_path / "small-vocab"
    tiny_model().save_pretrained(small_vocab)  # vocab 97, no tokenizer
    assert main(["compare", str(small_vocab), "--repeats", "1"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    assert main(["compare", str(folder), "--prompt-lengths", "8,x"]) == 2
    assert main(["compare", str(folder), "--prompt-lengths", "4096"]) == 2
    assert main(["compare", str(tmp_path / "missing")]) == 2
    assert main(["compare", str(folder), "--data", str(tmp_path / "nope.txt")]) == 2
    assert "--data file not found" in capsys.readouterr().err


def test_byte_data_helpers():
    assert decode_bytes(encode_bytes("déf f(x): λ")) == "déf f(x): λ"
    files = stdlib_source_files()
    train, validation = split_files(files)
    assert validation and train and not set(train) & set(validation)
    assert split_files(files) == (train, validation)  # stable
    assert not any("test" in path.relative_to(STDLIB).parts[:-1] for path in files)


def test_demo_runs_end_to_end(capsys):
    assert main(["demo"]) == 0
    printed = capsys.readouterr().out
    assert "aux on with k_a = k_p reproduces the source model: yes" in printed
    assert "two-pass reference" in printed and "KV cache KiB" in printed
