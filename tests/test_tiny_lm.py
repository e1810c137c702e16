"""tiny_lm: the token-mean NLL the instruments report."""

import torch
import torch.nn.functional as F
from helpers import hand_nll, tiny_model

from dualflow.scoring import mean_token_nll


def test_mean_token_nll_equals_hand_computation():
    model = tiny_model(aux_num_experts_per_tok=4)
    blocks = torch.randint(0, model.config.vocab_size, (5, 12))
    for use_aux_flow in (False, True):
        expected = hand_nll(model, blocks, use_aux_flow=use_aux_flow)
        # batch_size=2 leaves a short last batch: the token mean must still weight every token once
        assert abs(mean_token_nll(model, blocks, batch_size=2, use_aux_flow=use_aux_flow) - expected) < 1e-5
    logits = model(blocks, use_aux_flow=False).logits
    cross_entropy = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    assert abs(mean_token_nll(model, blocks, batch_size=5, use_aux_flow=False) - cross_entropy.item()) < 1e-5
