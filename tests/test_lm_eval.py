"""
lm-eval's HF backend on a converted Dual-Flow checkpoint (docs/evaluation.md): its log-likelihoods are what the model
predicts when it generates (token by token through the cache), aux flow on and off, and `model_args` reach the model.
Offline: a local YAML task over a local jsonl file of real text (a Python stdlib source), no Hub. The page's command
lines, the vLLM backend's included (tests/vllm runs that backend), parse into the arguments the tests pass.
"""

import json
import os
import shlex
import sys
import sysconfig
import tempfile
from pathlib import Path


# datasets reads these at import: no Hub, and its cache (of the local jsonl) in a private folder, removed when the test
# process exits (TemporaryDirectory's finalizer)
os.environ["HF_DATASETS_OFFLINE"] = "1"
if "HF_DATASETS_CACHE" not in os.environ:
    _datasets_cache = tempfile.TemporaryDirectory(prefix="dualflow-datasets-")
    os.environ["HF_DATASETS_CACHE"] = _datasets_cache.name

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import ROOT, code_blocks  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval._cli.harness import HarnessCLI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import ByT5Tokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from dualflow.convert import convert_checkpoint  # noqa: E402
from modeling_dualflow import DualFlowForCausalLM  # noqa: E402
from modeling_dualflow.modeling_dualflow import CACHE_FIELD  # noqa: E402


TASK = "dualflow_stdlib_choice"
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def stdlib_docs(count: int = 4) -> list[dict]:
    """
    Multiple-choice items from real text: a line's start, its next 8 characters among those of other lines (short
    continuations: lm-eval sums their log-probabilities in float32).
    """
    lines = [line.strip() for line in (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text().splitlines()]
    lines = [line for line in lines if len(line) > 40][: count + 3]
    docs = []
    for index in range(count):
        context, end = lines[index][:20].rstrip(), lines[index][20:28].strip()
        others = [lines[(index + shift) % len(lines)][20:28].strip() for shift in (1, 2, 3)]
        docs.append({"context": context, "choices": [end, *others], "answer": 0})
    return docs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A converted tiny Qwen3-MoE (k_p 2, k_a 4) with a byte-level tokenizer, its aux flow perturbed so it differs."""
    root = tmp_path_factory.mktemp("lm-eval")
    config = Qwen3MoeConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(root / "source")
    ByT5Tokenizer().save_pretrained(root / "source")
    convert_checkpoint(root / "source", root / "converted", aux_top_k=4, show_progress=False)
    model = DualFlowForCausalLM.from_pretrained(root / "converted")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.aux_coupling.weight.normal_(std=0.5)
        model.model.aux_embed_tokens.weight.add_(torch.randn_like(model.model.aux_embed_tokens.weight), alpha=0.5)
    model.save_pretrained(root / "perturbed")
    ByT5Tokenizer().save_pretrained(root / "perturbed")
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "stdlib.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in stdlib_docs()))
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return root / "perturbed", tasks


def lm_eval_loglikelihoods(folder: Path, tasks: Path, **model_args) -> list[tuple[str, str, float]]:
    results = simple_evaluate(
        model="hf",
        # the byte-level tokenizer appends </s> to every encoding: add_bos_token=False keeps it off the scored text
        model_args={"pretrained": str(folder), "trust_remote_code": True, "add_bos_token": False, **model_args},
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=4,
        device="cpu",
        log_samples=True,
    )
    return [
        (*arguments, response[0])
        for sample in results["samples"][TASK]
        for arguments, response in zip(sample["arguments"], sample["filtered_resps"])
    ]


@torch.no_grad()
def step_by_step_loglikelihood(model, tokenizer, context: str, continuation: str, **kwargs) -> float:
    """Sum of log p(continuation) as generation computes it: prefill the context, then one token at a time."""
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    continuation_ids = tokenizer.encode(continuation, add_special_tokens=False)
    output = model(torch.tensor([context_ids]), use_cache=True, logits_to_keep=1, **kwargs)
    total = 0.0
    for token in continuation_ids:
        total += output.logits[0, -1].float().log_softmax(-1)[token].item()
        cache = getattr(output, CACHE_FIELD)
        output = model(torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1, **kwargs)
    return total


def test_lm_eval_loglikelihoods_equal_step_by_step_predictions(checkpoint):
    folder, tasks = checkpoint
    model = DualFlowForCausalLM.from_pretrained(folder).eval()
    tokenizer = ByT5Tokenizer.from_pretrained(folder)
    # aux flow on with the checkpoint's k_a, then config fields through model_args: aux flow off, another k_a
    runs = {"aux on": {}, "aux off": {"use_aux_flow": False}, "k_a = 2": {"aux_num_experts_per_tok": 2}}
    scores = {}
    for name, model_args in runs.items():
        scores[name] = lm_eval_loglikelihoods(folder, tasks, **model_args)
        assert len(scores[name]) == 4 * 4, name
        for context, continuation, loglikelihood in scores[name]:
            expected = step_by_step_loglikelihood(model, tokenizer, context, continuation, **model_args)
            assert abs(loglikelihood - expected) < 1e-5, (name, context, continuation, loglikelihood, expected)
    # the perturbed aux flow scores differently from the primary flow, and k_a changes it
    assert all(abs(a[2] - b[2]) > 1e-4 for a, b in zip(scores["aux on"], scores["aux off"]))
    assert any(abs(a[2] - b[2]) > 1e-4 for a, b in zip(scores["aux on"], scores["k_a = 2"]))


def documented_commands() -> dict[str, list[str]]:
    """docs/evaluation.md's `lm_eval` command lines by backend, split as a shell would."""
    commands = {}
    for block in code_blocks(ROOT / "docs" / "evaluation.md"):
        argv = shlex.split(block["code"].replace("\\\n", " "))
        if Path(argv[0]).name == "lm_eval":
            commands.setdefault(argv[argv.index("--model") + 1], []).append(argv)
    return commands


def test_documented_commands_give_the_backends_these_arguments(monkeypatch):
    """lm-eval's own command-line parser reads docs/evaluation.md's commands into the arguments the tests pass."""
    parsed = {}
    for backend, commands in documented_commands().items():
        for argv in commands:
            monkeypatch.setattr(sys, "argv", ["lm_eval", *argv[1:]])
            parsed.setdefault(backend, []).append(HarnessCLI().parse_args().model_args)
    assert parsed["hf"] == [
        {"pretrained": "./qwen-moe-dualflow", "trust_remote_code": True},
        {"pretrained": "tiny-ft", "trust_remote_code": True, "add_bos_token": False},  # as lm_eval_loglikelihoods
    ]
    # the recipe tests/vllm/test_vllm_lm_eval.py runs: an engine whose aux flow predicts at every prompt position
    assert parsed["vllm"] == [
        {
            "pretrained": "./qwen-moe-dualflow",
            "dtype": "float32",
            "hf_overrides": {"aux_at_every_prompt_position": True},
        }
    ]
