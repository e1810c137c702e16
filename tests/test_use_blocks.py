"""
The "Use" code of the README and of every generated model card loads a converted folder without a question or a
warning: AutoTokenizer reads the model's config, which is remote code (its `auto_map`), so without
`trust_remote_code=True` transformers asks "Do you wish to run the custom code? [y/N]" (and stalls) and then warns
about a model of type ``.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from transformers import ByT5Tokenizer, MixtralConfig, MixtralForCausalLM

from dualflow.convert import convert_checkpoint


PYTHON_BLOCK = re.compile(r"^## Use\n.*?```python\n(?P<code>.*?)^```$", re.M | re.S)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding `tiny-ft`: a converted tiny Mixtral with a byte-level tokenizer, as the README makes it."""
    root = tmp_path_factory.mktemp("use")
    config = MixtralConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(root / "tiny-mixtral")
    ByT5Tokenizer().save_pretrained(root / "tiny-mixtral")
    convert_checkpoint(root / "tiny-mixtral", root / "tiny-ft", aux_top_k=4, show_progress=False)
    return root


def run_silently(code: str, cwd) -> str:
    """Run `code` with stdin closed (a question would read EOF); its stderr."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(cwd / "modules"))
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stderr


def from_torchao_on_cpu_torch(line: str) -> bool:
    """What importing torchao (in the test extra, for quantisation) prints on a CPU-only torch, with or without us."""
    return ("torchao" in line and "Failed to load" in line) or ("_pytree.py" in line and "Enum subclass" in line)


def assert_no_question_or_warning(stderr: str):
    assert "custom code" not in stderr and "trust_remote_code" not in stderr, stderr
    assert "model of type" not in stderr, stderr
    # what is left is the weight-loading progress bar
    lines = [line for line in stderr.splitlines() if line.strip() and not from_torchao_on_cpu_torch(line)]
    assert [line for line in lines if "Loading weights" not in line] == [], stderr


def test_readme_use_block_loads_without_a_question_or_warning(workdir):
    code = PYTHON_BLOCK.search((ROOT / "README.md").read_text())["code"]
    assert 'AutoTokenizer.from_pretrained("tiny-ft"' in code
    assert_no_question_or_warning(run_silently(code, workdir))


def test_model_card_use_block_loads_without_a_question_or_warning(workdir):
    card = (workdir / "tiny-ft" / "README.md").read_text()
    code = PYTHON_BLOCK.search(card)["code"]
    assert 'AutoTokenizer.from_pretrained("tiny-ft"' in code and str(workdir) not in code  # no local path published
    assert_no_question_or_warning(run_silently(code, workdir))
