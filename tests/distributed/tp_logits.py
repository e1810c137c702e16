"""
Load saved Dual-Flow checkpoints sharded with tensor / expert parallelism and compare them with the unsharded model.

Launched by tests/test_distributed.py as

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/tp_logits.py CASES.json OUT.json

CASES.json lists {"name", "path", "parallel": "tp" | "ep", "remote": bool, "experts_implementation": str | null,
"gradients": bool}. A case whose sharded forward raises a ValueError (a refusal) gets {"refused": message} instead.
Every rank loads each checkpoint twice: unsharded, and with `DistributedConfig` (`tp_plan="auto"`, or
`tp_size=2, ep_size=2`), through the package's class or the remote-code class saved next to the weights. Rank 0
writes, per case, the largest logit differences, whether greedy generations agree, what each rank holds locally,
the parameters whose gathered values differ from the checkpoint's, and (with "gradients") the largest difference of
each parameter's gradient of the training loss. A case with "qwen3_moe": true loads a saved Qwen3-MoE model sharded
only and gets its ranks' expert shapes alone, the reference for a Dual-Flow model's.
"""

import json
import logging
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import Qwen3MoeForCausalLM
from transformers.distributed import DistributedConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from modeling_dualflow import DualFlowForCausalLM


def model_class(path, remote: bool):
    if remote:
        return get_class_from_dynamic_module("modeling_dualflow.DualFlowForCausalLM", path)
    return DualFlowForCausalLM


def expert_shapes(model) -> list[dict[str, list[int]] | None]:
    """Per rank, the shapes of the last layer's expert weights as that rank holds them (None: a dense layer)."""
    experts = getattr(model.model.layers[-1].mlp, "experts", None)
    local = None
    if experts is not None:
        local = {name: list(local_tensor(getattr(experts, name)).shape) for name in ("gate_up_proj", "down_proj")}
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, local)
    return shapes


def local_tensor(parameter) -> torch.Tensor:
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one gathered from every rank (a collective: all ranks call it in one order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def checkpoint_mismatches(model, path: str) -> list[str]:
    """Names of the checkpoint or the loaded model that the other lacks, or whose gathered values differ."""
    saved = load_file(Path(path) / "model.safetensors")
    loaded = {name: full(tensor) for name, tensor in model.state_dict().items()}
    differing = [name for name in saved.keys() & loaded.keys() if not torch.equal(saved[name], loaded[name])]
    return sorted(saved.keys() ^ loaded.keys()) + sorted(differing)


def gradient_differences(reference, sharded, input_ids, attention_mask) -> dict[str, float]:
    """Per parameter, the largest difference between the two models' gradients of the training loss."""
    for model in (reference, sharded):
        model(input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
    expected = dict(reference.named_parameters())
    differences = {}
    for name, param in sharded.named_parameters():
        if expected[name].grad is None:  # a parameter this loss does not reach
            differences[name] = None
            continue
        differences[name] = (full(param.grad) - expected[name].grad).abs().max().item()
    return differences


@contextmanager
def recorded_warnings():
    """Python warnings and transformers' logged warnings raised inside the block, as messages."""
    messages = []

    class Recorder(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Recorder(level=logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    messages.extend(str(warning.message) for warning in caught)


def parallel_config(case: dict) -> DistributedConfig:
    if case["parallel"] == "tp":
        return DistributedConfig(tp_plan="auto")
    return DistributedConfig(tp_size=2, ep_size=2)


def compare(case: dict) -> dict:
    if case.get("qwen3_moe"):
        sharded = Qwen3MoeForCausalLM.from_pretrained(case["path"], distributed_config=parallel_config(case))
        return {"expert_shapes": expert_shapes(sharded)}
    cls = model_class(case["path"], case["remote"])
    extra = {"experts_implementation": case["experts_implementation"]} if case.get("experts_implementation") else {}
    reference = cls.from_pretrained(case["path"], **extra).eval()
    with recorded_warnings() as sharding_warnings:
        sharded = cls.from_pretrained(case["path"], distributed_config=parallel_config(case), **extra).eval()

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, reference.config.vocab_size, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=attention_mask)
        try:
            actual = sharded(input_ids, attention_mask=attention_mask)
        except ValueError as error:  # what the model refuses under this parallelism
            return {"refused": str(error)}
    generate = dict(attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    same_tokens = torch.equal(reference.generate(input_ids, **generate), sharded.generate(input_ids, **generate))
    layer = sharded.model.layers[-1]
    aux_names = set(sharded.aux_parameter_names())  # aux embedding and couplings: replicated, never sharded
    gradients = None
    if case.get("gradients"):
        gradients = gradient_differences(reference, sharded, input_ids, attention_mask)
    return {
        "module": type(sharded).__module__,
        "logits_max_diff": (expected.logits - actual.logits).abs().max().item(),
        "primary_logits_max_diff": (expected.primary_logits - actual.primary_logits).abs().max().item(),
        "same_greedy_tokens": same_tokens,
        "local_q_proj_rows": local_tensor(layer.self_attn.q_proj.weight).shape[0],
        "full_q_proj_rows": layer.self_attn.q_proj.weight.shape[0],
        "expert_shapes": expert_shapes(sharded),
        "sharded_aux_parameters": [
            name for name, param in sharded.named_parameters() if name in aux_names and isinstance(param, DTensor)
        ],
        "num_aux_parameters": len(aux_names),
        "sharding_warnings": sharding_warnings,
        "checkpoint_mismatches": checkpoint_mismatches(sharded, case["path"]),
        "gradient_max_diffs": gradients,
    }


def main():
    cases_json, output_json = sys.argv[1:]
    results = {case["name"]: compare(case) for case in json.loads(Path(cases_json).read_text())}
    if dist.get_rank() == 0:
        Path(output_json).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
