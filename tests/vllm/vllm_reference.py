"""A converted Dual-Flow checkpoint whose aux flow really differs from its primary flow, and transformers references."""

import gc
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from v2_on_cpu import V2_ENGINE_ARGS

from dualflow.convert import convert_checkpoint
from modeling_dualflow import DualFlowForCausalLM


VOCAB = ["<unk>", "<s>", "</s>", "system", "user", "assistant"] + [f"w{i}" for i in range(6, 128)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
# Qwen3-MoE source: k_p = 2 of 8 experts, head_dim 32 (the CPU attention kernels' smallest head size).
SOURCE = dict(
    vocab_size=len(VOCAB),
    hidden_size=128,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
# OLMoE source of the same size: q/k normalised over the whole projection, then q/k/v clipped to +-CLIP_QKV (small
# enough that the clip acts on the normalised values).
CLIP_QKV = 0.5
OLMOE_SOURCE = {key: value for key, value in SOURCE.items() if key not in ("head_dim", "moe_intermediate_size")}
OLMOE_SOURCE.update(intermediate_size=64, clip_qkv=CLIP_QKV)
# Qwen2-MoE source of the same size: a gated shared expert beside the routed ones, top-k weights not renormalised.
QWEN2_MOE_SOURCE = {key: value for key, value in SOURCE.items() if key != "head_dim"}
QWEN2_MOE_SOURCE.update(shared_expert_intermediate_size=96, norm_topk_prob=False)
SOURCES = {
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, SOURCE),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, QWEN2_MOE_SOURCE),
    "olmoe": (OlmoeForCausalLM, OlmoeConfig, OLMOE_SOURCE),
}
AUX_TOP_K = 4
ADAPTER_RANK = 4  # conftest.py's adapter_checkpoint
AUX_ADAPTERS = ("self_attn.aux_q_adapter", "self_attn.aux_o_adapter", "aux_mlp_adapter")  # in each decoder layer
# fp32: vLLM 0.32 (CPU) and transformers differ by at most 6.5e-7 per token in these tests, Inductor's kernels included
LOGPROB_TOLERANCE = 1e-4
# Small enough for this machine; prompts over 48 tokens (or batches) are prefilled in chunks.
# The model is traced by torch.compile (vLLM's CPU mode) with eager kernels: Inductor's code generation takes minutes
# per engine on two cores, and test_vllm_compile.py runs it once against an eager engine.
TRACED_WITH_EAGER_KERNELS = {"mode": "DYNAMO_TRACE_ONCE", "backend": "eager"}
ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=4,
    max_num_batched_tokens=48,
    block_size=32,
    seed=0,
    compilation_config=TRACED_WITH_EAGER_KERNELS,
    **(V2_ENGINE_ARGS if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" else {}),
)
PREFIX_CACHING_AND_CHUNKED_PREFILL = dict(enable_prefix_caching=True, enable_chunked_prefill=True)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over VOCAB with a chat template, built offline."""
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>", chat_template=CHAT_TEMPLATE
    )


@torch.no_grad()
def build_checkpoint(root: Path, aux_rounds: int = 1, aux_adapter_rank: int = 0, family: str = "qwen3_moe") -> Path:
    """
    Source model of `family` (SOURCES) -> `dualflow convert` (k_a = 4 != k_p = 2, `aux_rounds` passes of the aux flow, aux adapters of
    rank `aux_adapter_rank`) -> aux embedding, couplings, round gates and adapters perturbed.
    """
    torch.manual_seed(0)
    model_class, config_class, fields = SOURCES[family]
    source = model_class(config_class(**fields)).eval()
    source.save_pretrained(root / "source")
    convert_checkpoint(
        root / "source",
        root / "converted",
        aux_top_k=AUX_TOP_K,
        aux_rounds=aux_rounds,
        aux_adapter_rank=aux_adapter_rank,
        show_progress=False,
    )
    model = DualFlowForCausalLM.from_pretrained(root / "converted").eval()
    generator = torch.Generator().manual_seed(1)
    aux_embed = model.model.aux_embed_tokens.weight
    aux_embed.add_(0.5 * aux_embed.std() * torch.randn(aux_embed.shape, generator=generator))
    for layer in model.model.layers:
        layer.aux_coupling.weight.copy_(0.3 * torch.randn(layer.aux_coupling.weight.shape, generator=generator))
        if aux_rounds > 1:
            layer.aux_round_gate.weight.copy_(
                0.5 + 0.3 * torch.randn(layer.aux_round_gate.weight.shape, generator=generator)
            )
        if aux_adapter_rank:
            for name in AUX_ADAPTERS:
                up = layer.get_submodule(name).up
                up.copy_(0.1 * torch.randn(up.shape, generator=generator))
    folder = root / "dualflow"
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def load_reference(folder: Path) -> DualFlowForCausalLM:
    return DualFlowForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each chosen token's log-probability (raw logits, as vLLM reports them)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].double(), -1)[token].item() for step, token in zip(out.logits, tokens)]
    return tokens, logprobs


def served_greedy(engine, prompts: list[list[int]], max_new_tokens: int):
    """vLLM's greedy completions (with the chosen tokens' log-probabilities) of token-id prompts."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=0, ignore_eos=True)
    return engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_matches_transformers(
    outputs, prompts, reference, max_new_tokens: int, tolerance: float = LOGPROB_TOLERANCE, **generate_kwargs
):
    """vLLM's greedy tokens are transformers' and each token's logprob agrees within `tolerance`."""
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = hf_greedy(reference, prompt, max_new_tokens, **generate_kwargs)
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens, f"prompt of length {len(prompt)}"
        served = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        assert_logprobs_close(served, logprobs, tolerance)


def assert_logprobs_close(served: list[float], expected: list[float], tolerance: float = LOGPROB_TOLERANCE):
    difference = max(abs(a - b) for a, b in zip(served, expected, strict=True))
    assert difference <= tolerance, f"log-probabilities differ by up to {difference:.1e} (tolerance {tolerance:.0e})"


def aux_parameter_names(model):
    """In the engine process: the served model's parameters that belong to the aux flow."""
    return [name for name, _ in model.named_parameters() if "aux" in name]


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # ids >= 6: plain words, so the same ids round-trip through the tokenizer in the server tests
    return [torch.randint(6, len(VOCAB), (n,), generator=generator).tolist() for n in lengths]


def start_engine(checkpoint: Path, **engine_args):
    """A vLLM engine on the checkpoint, with no model-specific flags (the plugin registers the model)."""
    from vllm import LLM

    # Engines shut down before ran in this process (conftest.py), and vLLM froze the garbage collector's heap after
    # starting each: collect them, KV caches included, before this one reserves its own.
    gc.unfreeze()
    gc.collect()
    return LLM(model=str(checkpoint), **{**ENGINE_ARGS, **engine_args})


def shut_down(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


@contextmanager
def running_engine(checkpoint: Path, **engine_args):
    """An engine of its own for one test (see conftest.py's `engines` for one that test modules share), shut down after."""
    llm = start_engine(checkpoint, **engine_args)
    try:
        yield llm
    finally:
        shut_down(llm)
