"""`aux_train_fraction`: a training forward runs the aux flow at a fraction of the positions; nothing else changes."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config, tiny_model


def fraction_model(fraction=0.25, positions="random", **overrides):
    model = tiny_model(aux_train_fraction=fraction, aux_train_positions=positions, **overrides)
    return model.train()  # dropout is 0: train mode changes nothing but which positions the aux flow runs at


def next_token_ce(logits, input_ids, positions):
    """Mean CE of the rows of `logits` at `positions` against the next token of each."""
    return F.cross_entropy(logits.flatten(0, 1).float(), input_ids[:, positions + 1].flatten())


@pytest.mark.parametrize("variant", [{}, {"aux_num_rounds": 2}, {"aux_num_experts_per_tok": 3}])
def test_training_forward_runs_the_aux_flow_at_the_drawn_positions_only(variant):
    model = fraction_model(**variant)
    input_ids = torch.randint(0, 97, (2, 17))
    torch.manual_seed(5)
    positions = model._aux_training_positions(17, input_ids.device)
    torch.manual_seed(5)
    out = model(input_ids, labels=input_ids)
    assert positions.numel() == 4 and int(positions.max()) < 16  # 25% of the 16 positions that have a next token
    assert out.logits.shape == (2, 4, 97) and out.primary_logits.shape == (2, 17, 97)
    # the same aux rows as a forward that asks for those positions (the prefill path)
    with torch.no_grad():
        asked = model.eval()(input_ids, logits_to_keep=positions)
    torch.testing.assert_close(out.logits, asked.logits, atol=1e-5, rtol=0)
    # the aux CE is the mean over the drawn positions; the primary CE covers every position
    primary_ce = F.cross_entropy(out.primary_logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
    expected = next_token_ce(out.logits, input_ids, positions) + model.config.primary_loss_weight * primary_ce
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=0)


def test_last_positions_mode_and_gradient_accumulation_normalisation():
    model = fraction_model(0.5, "last")
    input_ids = torch.randint(0, 97, (2, 9))
    out = model(input_ids, labels=input_ids)
    positions = torch.arange(4, 8)  # the last half of the 8 positions that have a next token
    with torch.no_grad():
        asked = model.eval()(input_ids, logits_to_keep=positions)
    torch.testing.assert_close(out.logits, asked.logits, atol=1e-5, rtol=0)
    # Trainer's gradient accumulation passes the batch's label count: the aux flow divides by its own share of it
    model.train()
    summed = model(input_ids, labels=input_ids, num_items_in_batch=torch.tensor(16))
    primary_sum = F.cross_entropy(
        summed.primary_logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), reduction="sum"
    )
    aux_sum = next_token_ce(summed.logits, input_ids, positions) * positions.numel() * 2
    torch.testing.assert_close(summed.loss, aux_sum / (16 * 4 / 9) + primary_sum / 16, atol=1e-4, rtol=0)


def test_evaluation_prefill_and_decode_keep_every_position():
    model = fraction_model(0.125)
    reference = tiny_model()  # same seed, same weights, aux flow trained at every position
    input_ids = torch.randint(0, 97, (2, 11))
    model.eval()
    with torch.no_grad():
        scored = model(input_ids, labels=input_ids)  # evaluation loss: every position, as before
        expected = reference(input_ids, labels=input_ids)
    assert scored.logits.shape == (2, 11, 97)
    torch.testing.assert_close(scored.loss, expected.loss)
    generated = model.generate(input_ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, reference.generate(input_ids, max_new_tokens=3, do_sample=False))


def test_bad_fraction_or_mode_gives_a_clear_error():
    with pytest.raises(ValueError, match=r"aux_train_fraction must be in \(0, 1\], got 0.0"):
        tiny_config(aux_train_fraction=0.0)
    with pytest.raises(ValueError, match="aux_train_positions must be one of"):
        tiny_config(aux_train_positions="first")
