"""measure: every metric for every variant, the report schema, and the table that prints it."""

import json

import pytest
import torch
from helpers import tiny_model

from dualflow.instruments.measure import (
    SCHEMA,
    CompareSettings,
    compare_report,
    decode_ms_per_aux_round,
    format_table,
    kv_cache_bytes,
    noisy_cells,
    ratios_vs_baseline,
)
from dualflow.instruments.variants import BASELINE, build_variants


def expected_kv_cache_bytes(config, batch_size: int, seq_len: int) -> int:
    """fp32 keys + values of every layer: 2 * layers * batch * kv_heads * seq * head_dim * 4 bytes."""
    return 2 * config.num_hidden_layers * batch_size * config.num_key_value_heads * seq_len * config.head_dim * 4


def test_kv_cache_bytes_formula_and_dual_equals_primary_only():
    model = tiny_model(aux_num_experts_per_tok=4)
    config = model.config
    batch, seq = 3, 11
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    measured = {variant.name: kv_cache_bytes(variant, input_ids) for variant in build_variants(model)}
    # 2 (k and v) * 2 layers * 3 batch * 2 kv heads * 11 tokens * 8 head_dim * 4 bytes (fp32), for every variant
    assert set(measured.values()) == {2 * 2 * 3 * 2 * 11 * 8 * 4} == {expected_kv_cache_bytes(config, batch, seq)}


SETTINGS = CompareSettings(
    prompt_lengths=(8, 16),
    batch_sizes=(1, 2),
    decode_tokens=2,
    decode_prompt_length=4,
    repeats=2,
    eval_block_size=16,
    eval_blocks=3,
)


def test_compare_report_schema_and_table():
    model = tiny_model(aux_num_experts_per_tok=3)
    tokens = torch.randint(0, model.config.vocab_size, (400,))
    report = json.loads(json.dumps(compare_report(model, "tiny", ["random"], tokens, SETTINGS, show_progress=False)))
    assert report["schema"] == SCHEMA
    assert (report["model"], report["device"], report["dtype"]) == ("tiny", "cpu", "float32")  # the plot's title
    assert report["variants"] == [BASELINE, "dual-flow", "two-pass", "single top-k=3"]
    assert report["settings"]["eval_tokens"] == 48 and report["settings"]["prompt_lengths"] == [8, 16]
    base = report["metrics"][BASELINE]
    for name in report["variants"]:
        metrics = report["metrics"][name]
        assert set(metrics) == {
            "prefill_ms",
            "decode_tokens_per_s",
            "prefill_ratio_range",
            "decode_ratio_range",
            "kv_cache_bytes",
            "peak_memory_bytes",
            "peak_memory_increase_bytes",
            "val_loss",
        }
        assert set(metrics["prefill_ms"]) == {"8", "16"} and set(metrics["decode_tokens_per_s"]) == {"1", "2"}
        assert all(value > 0 for value in metrics["prefill_ms"].values())
        assert metrics["kv_cache_bytes"] == expected_kv_cache_bytes(model.config, 1, 16)
        ratios = report["ratios_vs_primary_only"][name]
        assert abs(ratios["prefill_ms"]["8"] - metrics["prefill_ms"]["8"] / base["prefill_ms"]["8"]) < 1e-9
        low, high = metrics["decode_ratio_range"]["2"]
        assert 0 < low <= high
    assert report["ratios_vs_primary_only"][BASELINE]["kv_cache_bytes"] == 1.0
    assert abs(report["metrics"]["two-pass"]["val_loss"] - report["metrics"]["dual-flow"]["val_loss"]) < 1e-5
    lines = report["table"].splitlines()
    assert [cell.strip() for cell in lines[0].split("|")] == ["metric", *report["variants"]]
    assert [line.split("|")[0].strip() for line in lines[2:]] == [
        "prefill ms, prompt 8",
        "prefill ms, prompt 16",
        "decode tok/s, batch 1",
        "decode tok/s, batch 2",
        "KV cache KiB",
        "val loss (nats/token)",
    ]  # on CPU no peak memory rows: the process's peak RSS shows the same figure in every column
    assert "(1.00x)" in lines[6]  # KV cache: every variant holds exactly the primary cache


def synthetic_metrics(increases_mib: dict, decode_ranges: dict | None = None) -> dict:
    metrics = {}
    for name, increase in increases_mib.items():
        metrics[name] = {
            "prefill_ms": {"8": 2.0},
            "decode_tokens_per_s": {"1": 100.0},
            "prefill_ratio_range": {"8": [1.0, 1.0]},
            "decode_ratio_range": {"1": (decode_ranges or {}).get(name, [1.0, 1.0])},
            "kv_cache_bytes": 1024,
            "peak_memory_bytes": 2**30,
            "peak_memory_increase_bytes": int(increase * 2**20),
            "val_loss": 2.0,
        }
    return metrics


def test_decode_time_per_aux_round():
    metrics = synthetic_metrics({BASELINE: 0, "dual-flow": 0, "dual-flow r1": 0, "dual-flow r2": 0})
    speeds = {BASELINE: 100.0, "dual-flow r1": 80.0, "dual-flow r2": 50.0, "dual-flow": 40.0}  # batch 1, tokens/s
    for name, speed in speeds.items():
        metrics[name]["decode_tokens_per_s"] = {"1": speed, "4": 4 * speed}
    # 3 rounds: 25 ms per step, 1 round: 12.5 ms per step; two extra rounds add 12.5 ms, 6.25 ms each
    assert decode_ms_per_aux_round(metrics, 3) == pytest.approx({"1": 6.25, "4": 6.25})


def test_increase_row_is_the_same_for_the_same_situation():
    # No variant allocates more than primary-only: whether the baseline's increase is 0 or not, the row says +0.0.
    for base_increase in (0.0, 0.5):
        metrics = synthetic_metrics({BASELINE: base_increase, "dual-flow": base_increase})
        row = format_table(metrics, ratios_vs_baseline(metrics)).splitlines()[-2]
        assert [cell.strip() for cell in row.split("|")] == [
            "increase MiB",
            f"{base_increase:.1f}",
            f"{base_increase:.1f} (+0.0)",
        ]


def test_noisy_timings_are_flagged():
    quiet = synthetic_metrics({BASELINE: 0, "dual-flow": 0}, {"dual-flow": [0.7, 0.9]})
    noisy = synthetic_metrics({BASELINE: 0, "dual-flow": 0}, {"dual-flow": [0.19, 3.29]})
    assert noisy_cells(quiet) == []
    assert noisy_cells(noisy) == ["dual-flow, decode batch 1: 0.19x to 3.29x"]
    assert "0.19-3.29" in format_table(noisy, ratios_vs_baseline(noisy))
