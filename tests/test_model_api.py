"""The model as transformers' own tests and a careful user call it: class-level hooks, outputs in the graph, argument
types, and loading a checkpoint of another architecture."""

import inspect

import pytest
import torch
from helpers import tiny_model
from transformers import MixtralConfig, MixtralForCausalLM

from dualflow.convert import convert_checkpoint
from dualflow.errors import DualFlowUserError
from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM, DualFlowModel, DualFlowPreTrainedModel


def test_can_set_experts_implementation_is_a_classmethod_as_transformers_declares_it():
    # transformers' common tests call it on the class: an instance method there is a TypeError
    assert isinstance(inspect.getattr_static(DualFlowPreTrainedModel, "_can_set_experts_implementation"), classmethod)
    assert DualFlowForCausalLM._can_set_experts_implementation() and DualFlowModel._can_set_experts_implementation()
    # an MoE model gets transformers' default kernel (a dense one has no experts for it to run on)
    assert tiny_model().config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("use_aux_flow", [True, False])
@pytest.mark.parametrize("model_class", [DualFlowModel, DualFlowForCausalLM])
def test_returned_hidden_states_and_attentions_get_gradients(model_class, use_aux_flow):
    # transformers' test_retain_grad_hidden_states_attentions: what forward returns must be tensors of the graph
    torch.manual_seed(0)
    model = model_class(DualFlowConfig(**tiny_model().config.to_dict())).train()
    model.set_attn_implementation("eager")  # the backend that returns attention weights
    with torch.no_grad():
        for layer in model.layers if model_class is DualFlowModel else model.model.layers:
            layer.aux_coupling.weight.normal_()  # the aux rows read the primary states
    input_ids = torch.randint(0, model.config.vocab_size, (2, 7))
    kwargs = dict(output_hidden_states=True, output_attentions=True)
    if model_class is DualFlowModel:
        kwargs["aux_positions"] = torch.arange(7) if use_aux_flow else None
    else:
        kwargs["use_aux_flow"] = use_aux_flow
    outputs = model(input_ids, **kwargs)
    hidden_states, attentions = outputs.hidden_states[0], outputs.attentions[0]
    assert hidden_states.shape == (2, 7, 32) and attentions.shape == (2, 4, 7, 7)
    hidden_states.retain_grad()
    attentions.retain_grad()
    outputs[0].flatten()[0].backward(retain_graph=True)
    assert hidden_states.grad is not None and attentions.grad is not None
    if use_aux_flow and model_class is DualFlowForCausalLM:
        # aux logits at position 0 read the primary state entering layer 0 (coupling) and the primary keys/values
        assert hidden_states.grad[0, 0].abs().sum() > 0 and attentions.grad[0, :, 0].abs().sum() > 0
        aux_states, aux_attentions = outputs.aux_hidden_states[0], outputs.aux_attentions[0]
        assert aux_states.grad_fn is not None and aux_attentions.shape == (2, 4, 7, 7)


def test_recorded_outputs_equal_the_stacked_computation():
    # recording each flow's rows apart changes nothing in the result
    model = tiny_model(attn_implementation="eager")
    input_ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        plain = model(input_ids, logits_to_keep=2)
        recorded = model(input_ids, logits_to_keep=2, output_hidden_states=True, output_attentions=True)
    torch.testing.assert_close(recorded.logits, plain.logits, rtol=0, atol=0)
    assert [tuple(x.shape) for x in recorded.aux_hidden_states] == [(2, 2, 32)] * 3
    assert [tuple(x.shape) for x in recorded.aux_attentions] == [(2, 4, 2, 6)] * 2
    torch.testing.assert_close(recorded.aux_attentions[0].sum(-1), torch.ones(2, 4, 2))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(aux_num_experts_per_tok="4"), "aux_num_experts_per_tok must be an int, got '4'"),
        (dict(aux_num_experts_per_tok=2.0), "aux_num_experts_per_tok must be an int, got 2.0"),
        (dict(aux_num_rounds=True), "aux_num_rounds must be an int, got True"),
        (dict(use_aux_flow="no"), "use_aux_flow must be True or False, got 'no'"),
        (dict(use_aux_flow=1), "use_aux_flow must be True or False, got 1"),
    ],
)
def test_generate_refuses_wrongly_typed_arguments_in_one_line(kwargs, message):
    model = tiny_model()
    with pytest.raises(TypeError) as error:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, **kwargs)
    assert str(error.value) == message


def test_generate_accepts_the_natural_types():
    model = tiny_model()
    prompt = torch.tensor([[1, 2, 3]])
    for kwargs in (dict(aux_num_experts_per_tok=3), dict(use_aux_flow=False), dict(use_aux_flow=True)):
        assert model.generate(prompt, max_new_tokens=2, do_sample=False, **kwargs).shape == (1, 5)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    config = MixtralConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def test_convert_checkpoint_takes_a_dtype_name_or_a_torch_dtype(tiny_mixtral, tmp_path):
    by_name = convert_checkpoint(tiny_mixtral, tmp_path / "by-name", dtype="bfloat16", show_progress=False)
    by_dtype = convert_checkpoint(tiny_mixtral, tmp_path / "by-dtype", dtype=torch.bfloat16, show_progress=False)
    assert by_name["parity"] is None and by_dtype["aux_top_k"] == by_name["aux_top_k"]
    loaded = DualFlowForCausalLM.from_pretrained(tmp_path / "by-dtype")
    assert loaded.dtype == torch.bfloat16
    assert "--dtype bfloat16" in (tmp_path / "by-dtype" / "README.md").read_text()
    for bad in (torch.int8, 16, ["bfloat16"]):
        with pytest.raises(DualFlowUserError, match=r"^dtype must be one of auto, float32, bfloat16, float16"):
            convert_checkpoint(tiny_mixtral, tmp_path / "bad", dtype=bad, show_progress=False)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("load", [DualFlowForCausalLM.from_pretrained, DualFlowModel.from_pretrained])
def test_from_pretrained_of_another_architecture_says_to_convert(tiny_mixtral, load):
    # transformers itself would only warn and return a randomly initialised model
    with pytest.raises(ValueError) as error:
        load(tiny_mixtral)
    message = str(error.value)
    assert message == (
        f"{tiny_mixtral} holds a 'mixtral' checkpoint, not a Dual-Flow one: convert it first "
        f"(pip install dualflow-transformers; dualflow convert {tiny_mixtral} OUT)"
    )
    with pytest.raises(ValueError, match="not a Dual-Flow one"):
        DualFlowConfig.from_pretrained(tiny_mixtral)


def lm_head_rows_per_call(model, run) -> list[int]:
    """The number of rows the LM head computes in each forward call that `run()` makes."""
    rows = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: rows.append(args[0][..., 0].numel()))
    try:
        run()
    finally:
        handle.remove()
    return rows


def test_generate_computes_logits_for_the_predicted_rows_only():
    model = tiny_model()
    input_ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = []
        # one aux row per sequence and step: the primary rows' LM head is skipped
        assert lm_head_rows_per_call(model, lambda: tokens.append(model.generate(input_ids, **greedy))) == [3] * 4
        # asked for, the primary logits are computed as forward computes them by default (a call per flow)
        asked = lm_head_rows_per_call(
            model, lambda: tokens.append(model.generate(input_ids, return_primary_logits=True, **greedy))
        )
        assert asked == [3, 3] * 4 and torch.equal(tokens[0], tokens[1])
        # forward keeps its contract: both flows' logits, the same predicted logits either way
        both, predicted = model(input_ids), model(input_ids, return_primary_logits=False)
    assert both.primary_logits.shape == both.logits.shape and predicted.primary_logits is None
    assert torch.equal(predicted.logits, both.logits)
