"""
The supported transformers range: what pyproject.toml declares is what CI tests at both ends, and what the model file
does to run across it.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import tiny_model
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

import modeling_dualflow
from dualflow.errors import DualFlowUserError
from dualflow.quantize_cli import COMPRESSED_TENSORS, check_compressed_tensors


if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def declared_dependencies() -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]


def transformers_requirement() -> Requirement:
    [requirement] = [r for r in declared_dependencies() if r.name == "transformers"]
    return requirement


def test_installed_transformers_is_in_the_supported_range():
    assert transformers_requirement().specifier.contains(transformers.__version__), transformers.__version__


def test_ci_tests_the_lowest_supported_transformers():
    lower_bounds = [Version(s.version) for s in transformers_requirement().specifier if s.operator == ">="]
    pinned = re.findall(r'TRANSFORMERS_SPEC="transformers==([\d.]+)"', (ROOT / ".ci" / "run").read_text())
    assert len(lower_bounds) == 1 and [Version(v) for v in pinned] == lower_bounds


def test_bootstrap_vllm_lists_the_dependencies_without_tomllib():
    # requires-python is >=3.10, which has no tomllib: the Python step of scripts/bootstrap_vllm.sh must not need it.
    script = (ROOT / "scripts" / "bootstrap_vllm.sh").read_text()
    steps = [block.split("\n", 1)[1].split("\nPY\n", 1)[0] for block in script.split("<<'PY'")[1:]]
    [step] = [step for step in steps if "requires(" in step]  # the step that lists the dependencies
    code = "import sys\nsys.modules['tomllib'] = None\n" + step
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    listed = {(canonicalize_name(r.name), r.specifier) for r in map(Requirement, completed.stdout.splitlines())}
    declared = declared_dependencies()
    expected = {(canonicalize_name(r.name), r.specifier) for r in declared if r.name not in ("torch", "transformers")}
    assert listed == expected and ("peft", SpecifierSet(">=0.21,<0.22")) in listed


def test_quantize_extra_is_the_compressed_tensors_range_quantize_checks():
    # 0.17.0 is what vLLM pins and 0.18.0 writes the same checkpoint; 0.19 and 0.20.1 (the newest) fail mid-conversion.
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [requirement] = map(Requirement, optional["quantize"])
    assert requirement.name == "compressed-tensors" and requirement.specifier == SpecifierSet(COMPRESSED_TENSORS)
    for installed in ("0.17.0", "0.17.1", "0.18.0"):
        check_compressed_tensors(installed)
    for installed in ("0.16.0", "0.19.0", "0.20.1"):
        with pytest.raises(DualFlowUserError) as refused:
            check_compressed_tensors(installed)
        assert str(refused.value) == (
            f"it works with compressed-tensors>=0.17,<0.19, not the installed {installed}: "
            "pip install 'compressed-tensors>=0.17,<0.19'"
        )


def test_model_file_speaks_the_cache_name_of_the_installed_transformers():
    """
    The model file's compatibility section: 5.19-5.23 pass and read the cache as `past_key_values`, 5.24 on as `cache`.
    Outputs carry it under the installed version's field; forward takes it under either keyword.
    """
    name = "cache" if Version(transformers.__version__) >= Version("5.24.0") else "past_key_values"
    assert modeling_dualflow.modeling_dualflow.CACHE_FIELD == name
    model = tiny_model()
    input_ids = torch.tensor([[5, 6, 7, 8, 9]])
    steps = {}
    for keyword in ("past_key_values", "cache"):
        prefill = model(input_ids[:, :3], use_cache=True)
        assert name in type(prefill).__dataclass_fields__ and prefill[name].get_seq_length() == 3
        steps[keyword] = model(input_ids[:, 3:], **{keyword: prefill[name]}).logits
    assert torch.equal(steps["past_key_values"], steps["cache"])
    torch.testing.assert_close(steps["cache"], model(input_ids).logits[:, 3:], rtol=0, atol=1e-5)
    generated = model.generate(input_ids, max_new_tokens=2, return_dict_in_generate=True)
    assert generated[name].get_seq_length() == input_ids.shape[1] + 1  # the last new token is not fed back


def test_remote_code_files_use_public_transformers_names_only():
    """
    The files frozen into every checkpoint import no private transformers name (no exception, the output collector
    included: each flow's hidden states and attentions are recorded by the model's own loop) and re-type no object.
    """
    for path in (ROOT / "modeling_dualflow").glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private and "._" not in node.module, (path.name, node.module, private)
            if isinstance(node, ast.Assign):
                targets = [t for t in node.targets if isinstance(t, ast.Attribute) and t.attr == "__class__"]
                assert not targets, (path.name, node.lineno)
        assert "_active_collector" not in path.read_text(), path.name


# transformers' private names the remote code still touches, each with why. Hooks in-tree models override or read:
PRIVATE_TRANSFORMERS_NAMES = {
    "_attn_implementation": "config field every in-tree attention reads to pick its backend",
    "_init_weights": "PreTrainedModel's weight-init hook every model overrides",
    "_prepare_cache_for_generation": "the hook in-tree models override to choose their cache (t5gemma)",
    "_get_resized_embeddings": "resizes an extra embedding table by transformers' rule (gemma3n, gemma4)",
    "_can_set_experts_implementation": "transformers' check that a model takes experts kernels (reads its file)",
}
# Other models' helpers the remote code imports (their classes are reused as-is; the helpers are still to write out).
OTHER_MODELS_HELPERS = {
    "LlamaRMSNorm",
    "LlamaRotaryEmbedding",
    "eager_attention_forward",
    "rotate_half",
    "load_balancing_loss_func",
    "Qwen2MoeMLP",
    "Qwen3MoeExperts",
    "Qwen3MoePreTrainedModel",
    "Qwen3MoeTopKRouter",
}


def test_remote_code_touches_only_the_listed_private_names_and_helpers():
    """Private attributes and methods (`x._name`, `super()._name`, overrides) beyond the code's own, and imports of
    other models' modules, are exactly the listed ones: a new one fails here until it is listed with its reason."""
    trees = [ast.parse(path.read_text()) for path in sorted((ROOT / "modeling_dualflow").glob("*.py"))]
    own, methods = set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                methods.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                own |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
                own |= {t.id for t in targets if isinstance(t, ast.Name)}  # class attributes the code declares
    touched, helpers = set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                touched.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers.models."):
                helpers |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                touched |= {alias.name for alias in node.names if alias.name.startswith("_")}
    overridden = {name for name in methods if name.startswith("_") and not name.startswith("__")}
    bases = (transformers.PreTrainedModel, transformers.GenerationMixin, transformers.PreTrainedConfig)
    transformers_names = {name for name in overridden if any(hasattr(base, name) for base in bases)}
    transformers_names |= {name for name in touched - own}
    assert transformers_names == set(PRIVATE_TRANSFORMERS_NAMES)
    assert helpers == OTHER_MODELS_HELPERS


@pytest.mark.parametrize("logits_to_keep", [0, 2])
def test_recorded_outputs_of_both_flows_get_gradients(logits_to_keep):
    """
    transformers' test_retain_grad_hidden_states_attentions for each flow: what forward returns as hidden states and
    attentions are tensors of the graph, with the aux rows as extra query heads (every position) or in a call of their
    own (`logits_to_keep`), recorded without transformers' private output collector.
    """
    model = tiny_model(attn_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.aux_coupling.weight.normal_()  # the aux rows read the primary states
    outputs = model(
        torch.tensor([[3, 4, 5, 6]]), logits_to_keep=logits_to_keep, output_hidden_states=True, output_attentions=True
    )
    recorded = [
        *outputs.hidden_states,
        *outputs.attentions,
        *outputs.aux_hidden_states,
        *outputs.aux_attentions,
    ]
    assert len(recorded) == 2 * (3 + 2)
    for tensor in recorded:
        tensor.retain_grad()
    # as the training loss does: the primary flow's final state reaches its own logits only
    (outputs.logits.sum() + outputs.primary_logits.sum()).backward()
    assert all(tensor.grad is not None for tensor in recorded)
    assert not hasattr(modeling_dualflow.modeling_dualflow, "recorded_outputs")
