"""`--verify`: the converted checkpoint must reproduce its source, run by transformers' own class, on a fixed prompt."""

import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config


TOLERANCE = 1e-4  # max abs logit difference, both models run in float32
PROMPT_SHAPE = (2, 16)
NEW_TOKENS = 8


def _fixed_prompt(vocab_size: int) -> torch.Tensor:
    return torch.randint(vocab_size, PROMPT_SHAPE, generator=torch.Generator().manual_seed(0))


def _greedy(model, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,  # compare the same number of tokens even if one side emits EOS
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )


@torch.no_grad()
def check_parity(source_dir, converted_dir, dtype: torch.dtype | None = None, dequantize_source: bool = False) -> dict:
    """
    Load the source with transformers' own class and the result with AutoModelForCausalLM(trust_remote_code=True),
    both in float32 (the source first rounded to the conversion dtype, so only the conversion itself is judged).
    dequantize_source: the source is a block-FP8 checkpoint, loaded dequantized (as the conversion is) on any device.
    Compares logits at every position of a fixed prompt with the aux flow on and off, and greedy generations.
    With k_a != k_p the aux flow is meant to differ: only the primary flow (aux off) must match then.
    """
    load_dtype = dtype or "auto"
    quantization = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if dequantize_source else {}
    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=load_dtype, **quantization).float().eval()
    converted = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=load_dtype, trust_remote_code=True)
    converted = converted.float().eval()
    config = converted.config
    exact_aux = not config.num_experts or config.aux_num_experts_per_tok == config.num_experts_per_tok

    input_ids = _fixed_prompt(config.vocab_size)
    reference = source(input_ids).logits
    diff_aux = (converted(input_ids, use_aux_flow=True).logits - reference).abs().max().item()
    diff_primary = (converted(input_ids, use_aux_flow=False).logits - reference).abs().max().item()
    greedy_identical = torch.equal(_greedy(source, input_ids), _greedy(converted, input_ids, use_aux_flow=exact_aux))

    passed = diff_primary <= TOLERANCE and greedy_identical and (diff_aux <= TOLERANCE or not exact_aux)
    summary = (
        f"max abs logit diff vs {type(source).__name__}: aux on {diff_aux:.3g}"
        f"{'' if exact_aux else ' (k_a != k_p, not compared)'}, aux off {diff_primary:.3g} "
        f"(tolerance {TOLERANCE:g}); greedy generations identical: {greedy_identical}"
    )
    return {
        "source_class": type(source).__name__,
        "max_abs_diff_aux": diff_aux,
        "max_abs_diff_primary": diff_primary,
        "aux_compared": exact_aux,
        "greedy_identical": greedy_identical,
        "tolerance": TOLERANCE,
        "passed": passed,
        "summary": summary,
    }
