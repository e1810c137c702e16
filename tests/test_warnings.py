"""
A user's first run shows no warning that comes from us: the demo's and compare's code paths, LoRA with PEFT and the
docs' Trainer example trigger no deprecation warning of transformers (nor torch's pin_memory warning on CPU). Each
runs in a fresh process: transformers logs its deprecations once per process.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from helpers import ROOT, runnable_blocks


TINY_QWEN3_MOE = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    num_experts=2,
    num_experts_per_tok=1,
)


# Records Python warnings and transformers' / PEFT's log records of the code that follows, printed as JSON at the end.
RECORDING = """
import json, logging, warnings
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(f"{record.name}: {record.getMessage()}")
logging.getLogger("transformers").addHandler(handler)
logging.getLogger("peft").addHandler(handler)
recording = warnings.catch_warnings(record=True)
caught = recording.__enter__()
warnings.simplefilter("always")
"""
REPORT = """
print(json.dumps({"warnings": [f"{w.category.__name__}: {w.message}" for w in caught], "logs": records}))
"""
# The demo's steps (build, convert, load as remote code, generate) and compare's measurement on a tiny model, then LoRA
# (add, save, load with PEFT).
PATHS = """
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from dualflow.convert import convert_checkpoint
from dualflow.instruments import demo
from dualflow.instruments.inputs import data_tokens, load_checkpoint
from dualflow.instruments.measure import CompareSettings, compare_report
from dualflow.lora import add_lora

tmp = Path.cwd()  # the test's tmp_path (a folder of mkdtemp's would stay behind)
convert_checkpoint(demo.tiny_qwen3_moe(tmp / "source"), tmp / "dualflow", aux_top_k=4, verify=True, show_progress=False)
model = AutoModelForCausalLM.from_pretrained(tmp / "dualflow", trust_remote_code=True).eval()
for kwargs in ({"use_aux_flow": False}, {"aux_num_experts_per_tok": 2}, {}):
    demo._generate(model, torch.tensor([[100, 101, 102]]), **kwargs)
measured, tokenizer = load_checkpoint(tmp / "dualflow")
tokens, names = data_tokens(None, tokenizer)
settings = CompareSettings(
    prompt_lengths=(8,), batch_sizes=(1, 2), decode_tokens=2, repeats=1, eval_block_size=16, eval_blocks=2
)
report = compare_report(measured, "tiny", names, tokens, settings)
assert "two-pass" in report["variants"], report["variants"]
add_lora(measured, r=2, lora_alpha=4).save_pretrained(tmp / "adapter")
base = AutoModelForCausalLM.from_pretrained(tmp / "dualflow", trust_remote_code=True)
PeftModel.from_pretrained(base, tmp / "adapter").merge_and_unload()
"""


def run_recording(code: str, cwd: Path) -> list[str]:
    """Run `code` in a fresh process; the warnings and log records it produced."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-c", RECORDING + code + REPORT], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    recorded = json.loads(completed.stdout.strip().splitlines()[-1])
    return recorded["warnings"] + recorded["logs"]


# Not ours: PEFT reads `is_gradient_checkpointing`, which transformers 5.23 made a deprecated alias; PEFT on any
# transformers model warns so (the test below shows it on transformers' own Qwen3-MoE).
PEFT_ON_ANY_MODEL = "`is_gradient_checkpointing` is deprecated"
# Not ours either: importing bitsandbytes (PEFT does when it is installed) compiles its kernels, and torch's compiler
# imports torch.utils.mkldnn, whose classes use the deprecated `torch.jit.script_method` (the test below shows it).
TORCH_ON_BITSANDBYTES_IMPORT = "`torch.jit.script_method` is deprecated"


def deprecations(messages: list[str]) -> list[str]:
    flagged = [m for m in messages if "deprecat" in m.lower() or "FutureWarning" in m or "pin_memory" in m]
    return [m for m in flagged if PEFT_ON_ANY_MODEL not in m and TORCH_ON_BITSANDBYTES_IMPORT not in m]


def test_the_peft_warning_left_out_above_comes_with_transformers_own_models():
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_QWEN3_MOE))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(model, LoraConfig(target_modules=["q_proj"]))
    warned = any(PEFT_ON_ANY_MODEL in str(w.message) for w in caught)
    # transformers 5.23 renamed the property (the old name warns from then on)
    assert warned == hasattr(PreTrainedModel, "is_activation_checkpointing")


def test_the_torch_warning_left_out_above_comes_with_importing_bitsandbytes(tmp_path):
    code = "import bitsandbytes\n"
    assert any(TORCH_ON_BITSANDBYTES_IMPORT in message for message in run_recording(code, tmp_path))


def test_demo_compare_and_lora_paths_trigger_no_deprecation(tmp_path):
    messages = run_recording(PATHS, tmp_path)
    assert deprecations(messages) == [], messages


def test_docs_trainer_example_triggers_no_deprecation(tmp_path):
    # docs/training.md: "your own Trainer" and the block before it, which makes the tiny checkpoint it reads
    blocks = runnable_blocks(ROOT / "docs" / "training.md")
    index = next(i for i, block in enumerate(blocks) if "Trainer(" in block["code"])
    setup, trainer_example = blocks[index - 1 : index + 1]
    assert "my-model-dualflow" in setup["code"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # `python`: ours
    subprocess.run(["bash", "-e", "-c", setup["code"]], cwd=tmp_path, env=env, check=True, timeout=600)
    messages = run_recording(trainer_example["code"], tmp_path)
    assert deprecations(messages) == [], messages
