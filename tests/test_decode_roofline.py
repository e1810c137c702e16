"""benchmarks/decode_roofline.py's byte / FLOP model on cases computable by hand (no vLLM, no timing)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("decode_roofline", ROOT / "benchmarks" / "decode_roofline.py")
roofline = importlib.util.module_from_spec(spec)
sys.modules["decode_roofline"] = roofline
spec.loader.exec_module(roofline)

# Small enough to count by hand: hidden 4, 2 layers, 2 q / 1 kv heads of 2, 8 experts of 3, top-2, vocab 10, 1 byte.
SHAPE = roofline.Shape(
    layers=2, hidden=4, heads=2, kv_heads=1, head_dim=2, experts=8, expert_size=3, vocab=10, top_k=2, bytes_per_param=1
)


def test_shape_counts_by_hand():
    assert SHAPE.expert_params == 3 * 4 * 3
    assert SHAPE.attention_params == 4 * 2 * (2 * 2 + 2 * 1)  # q, o: 4 x 4; k, v: 4 x 2
    assert SHAPE.layer_dense_params == 48 + 4 * 8 + 2 * 4 + 2 * 2  # + router + two RMSNorms + q / k norms
    assert SHAPE.kv_bytes_per_token_layer == 2 * 1 * 2
    # source: layers, final norm, embedding and LM head; the conversion adds the aux embedding and couplings
    source = 2 * (92 + 8 * 36) + 4 + 2 * 10 * 4
    assert SHAPE.checkpoint_params(aux=False) == source
    assert SHAPE.checkpoint_params(aux=True) == source + 10 * 4 + 2 * 4


def test_expected_distinct_experts():
    assert roofline.expected_distinct(8, [(1, 2)]) == pytest.approx(2)  # one row: its k experts
    assert roofline.expected_distinct(8, [(1, 8)]) == pytest.approx(8)
    assert roofline.expected_distinct(8, [(1000, 2)]) == pytest.approx(8)  # rows x k >> experts: all of them
    assert roofline.expected_distinct(8, [(2, 2)]) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert roofline.expected_distinct(8, [(1, 2), (1, 2)]) == pytest.approx(3.5)  # two flows: as two rows
    assert roofline.expected_distinct(128, [(64, 8), (64, 16)]) > 127.99


def test_step_bytes_and_flops_batch_one_by_hand():
    layers, p = 2, 1
    bytes_, flops = roofline.step_cost(SHAPE, distinct_experts=2 * layers, contexts=[5], aux=False)
    weights = layers * 92 + 2 * layers * 36 + 4 + 10 * 4 + 4  # dense, 2 experts a layer, final norm, LM head, 1 row
    kv = layers * 4 * (5 + 1)  # the 5-token context read, the new token's K/V written
    assert bytes_ == weights * p + kv
    attention = 4 * layers * 2 * 2 * 5  # QK^T and PV: 2 flops x 2 products x heads x head_dim x context per layer
    assert flops == 2 * layers * 92 + 2 * layers * 36 * 2 + attention + 2 * 10 * 4


def test_aux_on_adds_only_its_rows_when_both_flows_route_alike():
    # k_a == k_p and the aux rows route to the primary rows' experts: the same distinct experts, so the aux flow adds
    # the aux embedding rows and the couplings, nothing else; the K/V pages are read once
    contexts = [7, 9, 11]
    off, off_flops = roofline.step_cost(SHAPE, 10, contexts, aux=False)
    on, on_flops = roofline.step_cost(SHAPE, 10, contexts, aux=True, aux_top_k=SHAPE.top_k)
    assert on == off + len(contexts) * SHAPE.hidden + SHAPE.layers * SHAPE.hidden
    # FLOPs: the aux rows do the primary rows' work again, the LM head excepted (one row per request in both)
    batch = len(contexts)
    rows_work = 2 * batch * SHAPE.layers * (SHAPE.layer_dense_params + SHAPE.top_k * SHAPE.expert_params)
    rows_work += 4 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * sum(contexts)
    assert on_flops == off_flops + rows_work


def test_all_experts_when_the_rows_cover_them():
    # rows x k >> experts: every expert streamed in both arms, so aux on costs only its rows' small weights
    batch = 64
    experts = SHAPE.layers * roofline.expected_distinct(SHAPE.experts, [(batch, SHAPE.top_k)])
    assert experts == pytest.approx(SHAPE.layers * SHAPE.experts)
    off, _ = roofline.step_cost(SHAPE, experts, [4] * batch, aux=False)
    on, _ = roofline.step_cost(SHAPE, experts, [4] * batch, aux=True, aux_top_k=2 * SHAPE.top_k)
    assert on - off == pytest.approx(batch * SHAPE.hidden + SHAPE.layers * SHAPE.hidden)


def test_roofline_max_or_sum():
    assert roofline.roofline_seconds(100, 10, bandwidth=10, flop_rate=5) == 10
    assert roofline.roofline_seconds(100, 10, bandwidth=10, flop_rate=5, overlap=False) == 12


def test_gpu_prediction_batch_one_and_large_batch():
    rows = {(r["context"], r["batch"], r["arm"]): r for r in roofline.gpu_prediction(batches=(1, 4096))}
    shape = roofline.QWEN3_30B_A3B
    one = rows[512, 1, "k_a=k_p"]
    # batch 1: off streams k_p experts a layer; on with k_a = k_p, uniform routing: k + k (1 - k / E) expected
    assert one["experts_off"] == pytest.approx(shape.top_k)
    assert one["experts_on"] == pytest.approx(8 + 8 * (1 - 8 / 128))
    off, _ = roofline.step_cost(shape, shape.layers * 8, [512], aux=False)
    assert one["off_ms"] == pytest.approx(off / roofline.H100_BYTES_PER_SECOND * 1e3)
    assert 0 < rows[512, 1, "k_a=2k_p"]["ratio"] < one["ratio"] < 1
    # a batch that covers every expert in both arms: the aux flow costs only its rows' embedding and couplings
    assert rows[512, 4096, "k_a=2k_p"]["ratio"] > 0.999
    assert math.isclose(rows[512, 4096, "k_a=k_p"]["experts_off"], shape.experts)
