"""The serving MoE block's aux layout: chunk rows whose router logits make FusedMoE's own top-k_p routing (vLLM's CPU
router, run for real) give each aux row exactly the experts and weights of the model file's rule (`route_two_top_k`,
which transformers runs), with padding slots that weigh 0 and stream no expert the same token does not already use."""

import pytest
import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

from dualflow.serving.model import aux_chunk_logits
from modeling_dualflow.modeling_dualflow import route_two_top_k


NUM_EXPERTS, NUM_AUX = 8, 5


def model_file_routing(logits, is_aux_row: bool, k_p, k_a, norm_topk_prob):
    """The model file's two-top-k rule for rows of one flow: (weights, experts) in max(k_p, k_a) slots."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    return route_two_top_k(probs, torch.full((logits.shape[0],), is_aux_row), k_p, k_a, norm_topk_prob)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize(("k_p", "k_a"), [(2, 4), (2, 3), (3, 8), (3, 1), (4, 2)])
def test_chunk_rows_route_like_top_k_a(k_p, k_a, norm_topk_prob):
    generator = torch.Generator().manual_seed(k_p * 10 + k_a)
    aux_logits = torch.randn(NUM_AUX, NUM_EXPERTS, generator=generator)
    primary_logits = torch.randn(NUM_AUX, NUM_EXPERTS, generator=generator)
    chunk_logits, chunk_sums = aux_chunk_logits(aux_logits, k_p, k_a, norm_topk_prob, primary_logits)
    chunks = -(-k_a // k_p)
    assert chunk_logits.shape == (chunks * NUM_AUX, NUM_EXPERTS) and chunk_sums.shape == (chunks * NUM_AUX, 1)
    weights, ids = _softmax_topk(chunk_logits, k_p, norm_topk_prob)  # what FusedMoE's router does with them
    weights = (weights * chunk_sums).view(chunks, NUM_AUX, k_p).transpose(0, 1).reshape(NUM_AUX, -1)
    ids = ids.long().view(chunks, NUM_AUX, k_p).transpose(0, 1).reshape(NUM_AUX, -1)
    # per aux row: the expert mixture of its chunks = top-k_a of the aux router, the rest weighing 0
    served = torch.zeros(NUM_AUX, NUM_EXPERTS).scatter_add(1, ids, weights)
    expected_weights, expected_ids = model_file_routing(aux_logits, True, k_p, k_a, norm_topk_prob)
    expected = torch.zeros(NUM_AUX, NUM_EXPERTS).scatter_add(1, expected_ids, expected_weights)
    torch.testing.assert_close(served, expected, rtol=1e-6, atol=1e-7)
    # padding slots point at an expert the token streams anyway: its own k_a experts, or its primary row's k_p
    _, primary_ids = model_file_routing(primary_logits, False, k_p, k_a, norm_topk_prob)
    for row in range(NUM_AUX):
        streamed = set(expected_ids[row, :k_a].tolist()) | (
            set(primary_ids[row, :k_p].tolist()) if k_a < k_p else set()
        )
        assert set(ids[row].tolist()) <= streamed
        assert len(ids[row]) == chunks * k_p  # k_p slots per chunk row, distinct within each chunk row
        for chunk in ids[row].view(chunks, k_p):
            assert len(set(chunk.tolist())) == k_p
