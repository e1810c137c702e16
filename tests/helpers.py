"""
Code the test modules share (test modules never import each other): tiny Dual-Flow models and their variants, tiny
source models of every supported family with the conversion parity check, byte-level data from the stdlib's own
sources, and in-process runners of the `dualflow` CLI.
"""

import contextlib
import inspect
import io
import re
import signal
import subprocess
import warnings
from pathlib import Path

import torch
from transformers import (
    ByT5Tokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dualflow.cli import main as dualflow_main
from dualflow.training_data import DataSource, pack_data
from modeling_dualflow import DualFlowConfig, DualFlowForCausalLM


# Tiny Dual-Flow models

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_intermediate_size=24,
    max_position_embeddings=128,
    # Tests compare the aux flow with the primary one: an aux embedding of its own keeps the flows apart from the start
    # (new models copy the primary embedding by default).
    aux_embed_init="independent",
)


def tiny_config(**overrides) -> DualFlowConfig:
    """A tiny MoE Dual-Flow config (4 experts, k_p=2); pass num_experts=0 for a dense one."""
    fields = dict(TINY, num_experts=4, num_experts_per_tok=2)
    fields.update(overrides)
    return DualFlowConfig(**fields)


def tiny_model(seed: int = 0, random_coupling: bool = True, attn_implementation: str = "sdpa", **overrides):
    """
    Random tiny model in eval mode; non-zero couplings (and round gates and adapter deltas, where the config has them)
    so the aux flow differs from the primary one.
    """
    torch.manual_seed(seed)
    model = DualFlowForCausalLM(tiny_config(**overrides)).eval()
    model.set_attn_implementation(attn_implementation)
    if random_coupling:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.aux_coupling.weight.normal_(std=0.5)
                if layer.aux_round_gate is not None:
                    layer.aux_round_gate.weight.normal_(mean=0.5, std=0.5)
            for name, parameter in model.named_parameters():
                if name.endswith("_adapter.up"):
                    parameter.normal_(std=0.2)
    return model


def enable_activation_checkpointing(model, checkpoint_kwargs: dict | None = None):
    """transformers 5.23 renamed `gradient_checkpointing_enable` (the old name warns there); 5.19-5.22 have only it."""
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)(checkpoint_kwargs)


VARIANTS = {
    "moe": {},
    "moe_ka_gt_kp": {"aux_num_experts_per_tok": 4},
    "moe_ka_lt_kp": {"num_experts_per_tok": 3, "aux_num_experts_per_tok": 1},
    "dense": {"num_experts": 0},
    "qwen2moe_shared_expert": {"shared_expert_intermediate_size": 16, "norm_topk_prob": False, "qkv_bias": True},
    "olmoe_full_qk_norm_clip": {"qk_norm": "full", "clip_qkv": 0.5, "norm_topk_prob": False},
    "qwen3_per_head_qk_norm": {"qk_norm": "per_head", "mlp_only_layers": [0]},
    "sliding_window": {"sliding_window": 3, "num_experts": 0},
    "tied_bias_sparse_step": {"tie_word_embeddings": True, "attention_bias": True, "decoder_sparse_step": 2},
    # the aux flow passes several times through the layers (round gates random in tiny_model)
    "rounds_3": {"aux_num_rounds": 3, "aux_num_experts_per_tok": 4},
    "rounds_2_sliding_window": {"aux_num_rounds": 2, "sliding_window": 3, "num_experts": 0},
    # aux adapters on q_proj / o_proj / the MLP output (their deltas random in tiny_model)
    "adapters": {"aux_adapter_rank": 4, "aux_num_experts_per_tok": 4, "qk_norm": "full", "clip_qkv": 0.5},
    "adapters_rounds_2_sliding_window": {"aux_adapter_rank": 3, "aux_num_rounds": 2, "sliding_window": 3},
}


def left_padded_batch(lengths, vocab_size=97, seed=1):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.randint(1, vocab_size, (len(lengths), width), generator=generator)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention_mask[row, width - length :] = 1
        input_ids[row, : width - length] = 0
    return input_ids, attention_mask


# Tiny source models of every family `dualflow convert` supports

SHAPE = dict(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
EXPERTS = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01)
# One tiny model per family, each switching on what its family can do that the others cannot.
FAMILIES = {
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, **EXPERTS, intermediate_size=24, num_local_experts=4)),
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(
            **SHAPE,
            **EXPERTS,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=4,
            shared_expert_intermediate_size=36,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **SHAPE,
            **EXPERTS,
            head_dim=12,
            intermediate_size=40,
            moe_intermediate_size=24,
            num_experts=4,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "olmoe": (
        OlmoeForCausalLM,
        OlmoeConfig(**SHAPE, **EXPERTS, intermediate_size=24, num_experts=4, clip_qkv=0.08, eos_token_id=2),
    ),
    "llama": (
        LlamaForCausalLM,
        LlamaConfig(**SHAPE, intermediate_size=40, attention_bias=True, tie_word_embeddings=True),
    ),
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, intermediate_size=40, sliding_window=5)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, intermediate_size=40, tie_word_embeddings=True)),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **SHAPE,
            head_dim=12,
            intermediate_size=40,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=0,
        ),
    ),
}
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
PROMPT = torch.randint(0, SHAPE["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(1))
TOLERANCE = 1e-4


def make_source(family: str, seed: int = 0, **overrides):
    """A random fp32 source model built with transformers' own class."""
    model_class, config = FAMILIES[family]
    config = type(config).from_dict({**config.to_dict(), **overrides})
    torch.manual_seed(seed)
    return model_class(config).eval()


def save_source(model, folder: Path, layout: str) -> Path:
    """Save as transformers does: one file, several shards (index), or the fused in-memory layout."""
    if layout == "single":
        model.save_pretrained(folder)
    elif layout == "sharded":
        model.save_pretrained(folder, max_shard_size="40KB")
    else:
        model.save_pretrained(folder, save_original_format=False, max_shard_size="40KB")
    return folder


@torch.no_grad()
def assert_parity(source, out_dir: Path, aux_matches: bool = True):
    """docs/design.md §7.2: logits at every position within 1e-4 (aux on and off), identical greedy generations."""
    converted = DualFlowForCausalLM.from_pretrained(out_dir).eval()
    reference = source(PROMPT).logits
    primary = converted(PROMPT, use_aux_flow=False).logits
    aux = converted(PROMPT, use_aux_flow=True).logits
    assert (primary - reference).abs().max() <= TOLERANCE
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = source.generate(PROMPT, **greedy)
    assert torch.equal(converted.generate(PROMPT, use_aux_flow=False, **greedy), expected)
    if aux_matches:
        assert (aux - reference).abs().max() <= TOLERANCE
        assert torch.equal(converted.generate(PROMPT, **greedy), expected)
    return converted, reference, aux


def run_dualflow(*args) -> tuple[int, str]:
    """Run `dualflow ...` in-process; returns (exit code, stderr)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = dualflow_main([str(arg) for arg in args])
    return code, stderr.getvalue()


# Byte-level data and models

# A byte-level tokenizer that needs no files: ids 3..258 are the bytes, 384 ids in all.
BYTE_VOCAB = 384
STDLIB = Path(inspect.__file__).parent


def stdlib_text(*names: str, chars: int = 40_000) -> str:
    return "".join((STDLIB / name).read_text(encoding="utf-8") for name in names)[:chars]


def stdlib_blocks(block_size: int, chars: int = 40_000) -> torch.Tensor:
    return pack_texts([stdlib_text("inspect.py", "textwrap.py", chars=chars)], ByT5Tokenizer(), block_size)


def pack_texts(texts: list[str], tokenizer, block_size: int) -> torch.Tensor:
    """`dualflow finetune`'s blocks of plain texts (every token trained on, so the labels are the input ids)."""
    return pack_data([DataSource.of_texts(texts)], tokenizer, block_size)[0]


def byte_model(seed: int = 0, **overrides):
    return tiny_model(seed=seed, random_coupling=False, vocab_size=BYTE_VOCAB, **overrides)


def hand_nll(model, blocks, **kwargs) -> float:
    """Mean over every predicted token of -log p(next token), straight from log-softmax."""
    nlls = []
    for block in blocks:
        log_probs = torch.log_softmax(model(block[None], **kwargs).logits[0, :-1].float(), dim=-1)
        nlls.append(-log_probs.gather(-1, block[1:, None]).squeeze(-1))
    return torch.cat(nlls).mean().item()


def run_finetune(*argv) -> int:
    """Run `dualflow finetune`; any warning (torch's pin_memory on CPU, deprecations) fails the test."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = dualflow_main(["finetune", *map(str, argv)])
    messages = [f"{warning.category.__name__}: {warning.message}" for warning in caught]
    assert not messages, messages
    return status


def signallable_process(command, **kwargs) -> subprocess.Popen:
    """
    A child that Ctrl-C (SIGINT) and a closed terminal (SIGHUP) reach as in a terminal, also when the test session runs
    as a background job (a non-interactive shell starts those with SIGINT ignored) or under nohup (SIGHUP ignored):
    children inherit ignored signals.
    """

    def restore():
        for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)

    return subprocess.Popen(list(map(str, command)), preexec_fn=restore, text=True, **kwargs)


# Documentation pages

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^(?:<!-- not run: (?P<reason>.+?) -->\n)?```(?P<language>\S*)\n(?P<code>.*?)^```$", re.M | re.S)


def code_blocks(page: Path) -> list[dict]:
    return [match.groupdict() for match in BLOCK.finditer(page.read_text())]


def runnable_blocks(page: Path) -> list[dict]:
    return [block for block in code_blocks(page) if block["reason"] is None]


def valid_rows(attention_mask):
    return attention_mask.bool()  # compare logits only at real (non-padding) positions
