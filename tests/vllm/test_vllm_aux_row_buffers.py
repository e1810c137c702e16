"""The aux rows piece's persistent buffers hold the most rows a step samples (P), not the step's token budget (T):
their bytes for engine configurations vLLM builds (no engine starts). The primary piece gathers its entering states
at as many rows. The served engines' buffers and graphs: test_vllm_cudagraph_dispatch.py."""

import pytest
import torch
from test_vllm_support_matrix import engine_config

from dualflow.serving.model import AuxRowInputs, max_sampled_rows


SEQS, BUDGET = 256, 8192
LAYERS, HIDDEN = 2, 128  # the test checkpoint's
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# engine options -> the most rows a step samples
CASES = {
    "one sampled row per request": ({}, SEQS),
    "n-gram speculation: 1 + 3 rows per request": ({"speculative_config": NGRAM}, SEQS * 4),
    "aux flow at every prompt position": ({"hf_overrides": {"aux_at_every_prompt_position": True}}, BUDGET),
}


@pytest.mark.parametrize(("options", "rows"), CASES.values(), ids=CASES)
def test_the_buffers_hold_the_sampled_rows(checkpoint, options, rows):
    config = engine_config(checkpoint, max_num_seqs=SEQS, max_num_batched_tokens=BUDGET, dtype="bfloat16", **options)
    assert max_sampled_rows(config) == rows
    buffers = AuxRowInputs(max_sampled_rows(config), LAYERS, HIDDEN, config.model_config.dtype, torch.device("cpu"))
    # The entering states: rows x layers x hidden in bfloat16 (2 bytes): 128 KiB for 256 rows, where the token budget
    # made 4 MiB. The indices: 8 bytes per row each.
    assert buffers.entering.nbytes == rows * LAYERS * HIDDEN * 2
    assert [buffers.rows.nbytes, buffers.input_ids.nbytes, buffers.positions.nbytes] == [8 * rows] * 3
