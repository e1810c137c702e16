"""
Every attention backend runs both flows in plain causal calls (docs/design.md §5): aux rows at the primary positions
as extra query heads, other aux rows in a call of their own. eager, sdpa, flex_attention and flash attention (a CPU
stand-in for its kernel behind transformers' own flash path) give the slow two-pass reference's logits, and no call
sees a (T + P) x T mask.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
import transformers
import transformers.modeling_flash_attention_utils as flash_utils
from helpers import left_padded_batch, tiny_model, valid_rows
from reference import two_pass_forward
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.integrations.flex_attention import WrappedFlexAttention
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from modeling_dualflow import DualFlowForCausalLM
from modeling_dualflow.attention_dualflow import DualFlowQueryHeadGroups


FLASH = "dualflow_test_flash_attention"  # "flash" in the name: transformers treats it as a flash implementation
VARIANTS = {
    "moe": {"aux_num_experts_per_tok": 3},
    "window_rounds_adapters": {"sliding_window": 3, "aux_num_rounds": 2, "aux_adapter_rank": 3},
}
FLASH_CALLS = []  # (query heads, key heads, query rows, key rows, attention mask dims) per flash call


def flash_kernel_one_sequence(query, key, value, causal, softmax_scale, window_size):
    """flash-attn semantics for one sequence: query (Sq, H, d), key/value (Sk, Hkv, d); causal aligned bottom-right."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    query_pos = torch.arange(query.shape[0])[:, None] + key.shape[0] - query.shape[0]
    key_pos = torch.arange(key.shape[0])[None, :]
    allowed = key_pos <= query_pos if causal else torch.ones_like(key_pos <= query_pos)
    if window_size[0] >= 0:
        allowed &= key_pos >= query_pos - window_size[0]
    output = F.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=allowed, scale=softmax_scale
    )
    return output.transpose(0, 1)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False
):
    kernel = functools.partial(flash_kernel_one_sequence, causal=causal, softmax_scale=softmax_scale)
    return torch.stack([kernel(q[b], k[b], v[b], window_size=window_size) for b in range(q.shape[0])])


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    deterministic=False,
):
    kernel = functools.partial(flash_kernel_one_sequence, causal=causal, softmax_scale=softmax_scale)
    q_bounds, k_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return torch.cat(
        [
            kernel(q[q0:q1], k[k0:k1], v[k0:k1], window_size=window_size)
            for q0, q1, k0, k1 in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:])
        ]
    )


def checking_flash_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' flash path, after checking what the model hands it: padding mask at most, causal, GQA heads."""
    assert attention_mask is None or attention_mask.dim() == 2, "flash kernels take no dense mask"
    assert kwargs.get("is_causal") is not False and module.is_causal
    assert query.shape[1] % key.shape[1] == 0
    FLASH_CALLS.append((query.shape[1], key.shape[1], query.shape[2], key.shape[2]))
    return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture(params=["eager", "sdpa", "flex_attention", FLASH])
def backend(request, monkeypatch):
    if request.param == "flex_attention":
        # transformers compiles flex attention with inductor, which takes minutes per shape on this CPU; dynamo's eager
        # backend runs the same flex_attention graph (BlockMask, GQA) without code generation.
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
        monkeypatch.setattr(WrappedFlexAttention, "_instance", None)
    if request.param == FLASH:
        # The flash-attn kernels need a GPU: transformers' flash path (unpadding, causal flag, window) runs for real,
        # only the kernel functions it loads are the CPU stand-ins above.
        AttentionInterface.register(FLASH, checking_flash_attention)
        AttentionMaskInterface.register(FLASH, flash_attention_mask)
        kernels = (flash_attn_func, flash_attn_varlen_func, None, flash_utils._pad_input, flash_utils._unpad_input)
        monkeypatch.setattr(flash_utils, "_lazy_imports", lambda *args, **kwargs: kernels)
        monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
        FLASH_CALLS.clear()
    return request.param


def test_capability_flags():
    assert DualFlowForCausalLM._supports_sdpa
    assert DualFlowForCausalLM._supports_flash_attn
    assert DualFlowForCausalLM._supports_flex_attn


def test_one_call_per_layer_given_a_module_that_says_its_head_groups(backend, monkeypatch):
    """Both flows at every position: one attention call per layer, handed a real module whose group is the call's."""
    model = tiny_model(attn_implementation=backend)
    calls = []
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager_attention_forward)

    def recording(module, query, key, value, *args, **kwargs):
        calls.append((type(module).__name__, query.shape[1], key.shape[1]))
        assert isinstance(module, torch.nn.Module) and type(module).__getattr__ is torch.nn.Module.__getattr__
        if backend != FLASH:  # flash takes the group from the shapes (and gets the layer's attention)
            assert module.num_key_value_groups == query.shape[1] // key.shape[1], "repeat_kv would mismatch the heads"
        return attend(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, backend, recording)
    input_ids, attention_mask = left_padded_batch([7, 4])
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    heads = "DualFlowAttention" if backend == FLASH else "DualFlowQueryHeadGroups"
    assert calls == [(heads, 8, 2)] * model.config.num_hidden_layers  # 4 primary + 4 aux query heads, 2 kv heads


def test_the_head_groups_module_holds_every_attribute_a_backend_reads(backend, monkeypatch):
    """
    The contract of the both-flows call's module: eager, sdpa and flex read nothing from it but the attributes it
    holds (an attribute it lacked, inherited from nn.Module or not, would be read as the layer's), and eager and sdpa
    read the group from it. Flash gets the layer's attention, whose attributes hold for the shapes it is given.
    """
    model = tiny_model(attn_implementation=backend)
    read = set()

    def recording(module, name):
        if not name.startswith("_") and not callable(getattr(torch.nn.Module, name, None)):  # data, not methods
            read.add(name)
        return object.__getattribute__(module, name)

    monkeypatch.setattr(DualFlowQueryHeadGroups, "__getattribute__", recording)
    input_ids, attention_mask = left_padded_batch([7, 4])
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
    held = set(vars(model.model.layers[0].self_attn.both_flows_heads)) | {"training"}
    if backend == FLASH:
        assert read == set()
        return
    assert read and read <= held, read - held
    if backend in ("eager", "sdpa"):
        assert "num_key_value_groups" in read


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_position_left_padded(backend, variant):
    model = tiny_model(attn_implementation=backend, **VARIANTS[variant])
    input_ids, attention_mask = left_padded_batch([7, 4])
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask)
    if backend == FLASH:  # one call per layer: the aux rows are 4 more query heads over the 2 key/value heads
        num_layers, extra_rounds = model.config.num_hidden_layers, model.config.aux_num_rounds - 1
        assert FLASH_CALLS == [(8, 2, 7, 7)] * num_layers + [(4, 2, 7, 7)] * num_layers * extra_rounds
    primary, aux = two_pass_forward(model, input_ids, DynamicCache(), attention_mask=attention_mask)
    rows = valid_rows(attention_mask)
    torch.testing.assert_close(out.primary_logits[rows], primary[rows], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[rows], aux[rows], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_last_positions_left_padded(backend, variant):
    """Prefill with logits_to_keep=k: the aux rows attend in a second call, bottom-right causal."""
    model = tiny_model(attn_implementation=backend, **VARIANTS[variant])
    input_ids, attention_mask = left_padded_batch([7, 4])
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, logits_to_keep=2)
    _, aux = two_pass_forward(
        model, input_ids, DynamicCache(), attention_mask=attention_mask, aux_positions=torch.tensor([5, 6])
    )
    torch.testing.assert_close(out.logits, aux, atol=1e-5, rtol=0)


def test_tensor_of_positions(backend):
    model = tiny_model(attn_implementation=backend, **VARIANTS["window_rounds_adapters"])
    input_ids, attention_mask = left_padded_batch([7, 5])
    positions = torch.tensor([6, 3, 3])
    if backend == FLASH:
        with pytest.raises(ValueError, match="flash attention runs the aux flow at the last k positions"):
            model(input_ids, attention_mask=attention_mask, logits_to_keep=positions)
        return
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, logits_to_keep=positions)
    _, aux = two_pass_forward(model, input_ids, DynamicCache(), attention_mask=attention_mask, aux_positions=positions)
    torch.testing.assert_close(out.logits, aux, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_generate_matches_uncached_forward(backend, variant, cache_implementation):
    """Cached == uncached with left padding: prefill (aux row at the last position) then decode steps."""
    model = tiny_model(attn_implementation=backend, **VARIANTS[variant])
    input_ids, attention_mask = left_padded_batch([6, 4])
    options = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    try:
        generated = model.generate(
            input_ids, attention_mask=attention_mask, cache_implementation=cache_implementation, **options
        )
    except AttributeError as error:  # inside transformers' generate, before the model runs
        if "'BlockMask' object has no attribute 'contiguous'" not in str(error):
            raise
        pytest.xfail(f"transformers {transformers.__version__}: generate calls .contiguous() on flex's BlockMask")
    full_mask = torch.cat([attention_mask, torch.ones(2, 3, dtype=attention_mask.dtype)], dim=1)
    with torch.no_grad():
        full = model(generated.sequences, attention_mask=full_mask)
    for step, logits in enumerate(generated.logits):
        torch.testing.assert_close(logits, full.logits[:, 5 + step], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", FLASH], indirect=True)  # FlexAttention has no backward on CPU
def test_training_gradients_match_eager(backend):
    """Forward + backward with the aux flow at every position: the extra query heads route gradients like eager."""
    gradients = {}
    for attn in ("eager", backend):
        model = tiny_model(attn_implementation=attn, **VARIANTS["window_rounds_adapters"]).train()
        input_ids, attention_mask = left_padded_batch([7, 5])
        # no loss on predictions made at padding positions (their rows attend to nothing: backends differ there)
        predicted_from_padding = F.pad(attention_mask[:, :-1] == 0, (1, 0), value=True)
        labels = input_ids.masked_fill(predicted_from_padding, -100)
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        gradients[attn] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert gradients[backend].keys() == gradients["eager"].keys()
    for name, gradient in gradients[backend].items():
        torch.testing.assert_close(gradient, gradients["eager"][name], atol=1e-5, rtol=0, msg=name)
