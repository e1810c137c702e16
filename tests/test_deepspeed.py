"""
DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes (torchrun, gloo, DeepSpeed's CPU accelerator, a real engine): a plain
`Trainer` script and `dualflow finetune --deepspeed`. accelerate runs DeepSpeed only on an accelerator; the scripts in
tests/distributed let it take the CPU for one (deepspeed_on_cpu.py, test side only).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import byte_model, stdlib_blocks
from safetensors.torch import load_file
from transformers import Trainer, TrainingArguments, default_data_collator

from dualflow.finetune import as_examples
from modeling_dualflow import DualFlowForCausalLM


SCRIPTS = Path(__file__).parent / "distributed"
# One thread per process: the CI machine has 2 cores for 2 processes.
SUBPROCESS_ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
AUX_NAMES = (
    "model.aux_embed_tokens.weight",
    "model.layers.0.aux_coupling.weight",
    "model.layers.1.aux_coupling.weight",
)
# "auto": Trainer fills them from TrainingArguments (batch sizes, accumulation, clipping); no "optimizer" section:
# Trainer's own AdamW, as in a run without DeepSpeed.
ZERO_CONFIGS = {
    "zero2": {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    },
    "zero3": {
        # a tiny model's parameters are all below DeepSpeed's persistence threshold (kept whole on every process): 0
        # partitions them as a large model's are
        "zero_optimization": {
            "stage": 3,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": 0,
        },
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    },
}


def torchrun(script: Path, *args, tmp_dir: Path, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """`script` under torchrun; its rendezvous and log folders go into `tmp_dir`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    env = dict(SUBPROCESS_ENV, TMPDIR=str(tmp_dir))
    result = subprocess.run([*command, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def single_process_losses(model_dir: Path, blocks: torch.Tensor, output_dir: Path) -> list[float]:
    """The losses of the same 4 steps in one process without DeepSpeed, the global batch (4 rows) in one."""
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        report_to="none",
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    model = DualFlowForCausalLM.from_pretrained(model_dir)
    trainer = Trainer(model=model, args=args, train_dataset=as_examples(blocks), data_collator=default_data_collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_plain_trainer_under_deepspeed_matches_one_process_and_saves_a_model_folder(tmp_path, zero):
    model_dir, out = tmp_path / "ckpt", tmp_path / "run"
    out.mkdir()
    byte_model(aux_num_experts_per_tok=3).save_pretrained(model_dir)
    blocks = stdlib_blocks(32, chars=8000)[:32]
    torch.save(blocks, out / "blocks.pt")
    (tmp_path / "ds.json").write_text(json.dumps(ZERO_CONFIGS[zero]))
    torchrun(SCRIPTS / "train_deepspeed.py", model_dir, tmp_path / "ds.json", out, tmp_dir=tmp_path)
    ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]

    # accelerate counted both processes: their own ranks, one main process, a DeepSpeed engine
    assert [(r["world_size"], r["process_index"], r["torch_world_size"]) for r in ranks] == [(2, 0, 2), (2, 1, 2)]
    assert [r["should_save"] for r in ranks] == [True, False]  # only rank 0 writes the checkpoints and final save
    assert {r["deepspeed_engine"] for r in ranks} == {"DeepSpeedEngine"}
    # ZeRO-3: partitioned from `from_pretrained` on (the TrainingArguments came first), and after training
    assert [r["zero3_at_load"] for r in ranks] == [zero == "zero3"] * 2
    assert [r["local_fraction"] for r in ranks] == pytest.approx([0.5 if zero == "zero3" else 1.0] * 2, abs=0.01)
    # each process read its own rows: step by step, the two halves of the global batch
    assert all(len(step) == 2 for r in ranks for step in r["rows"])
    assert all(a != b for a, b in zip(ranks[0]["rows"], ranks[1]["rows"]))
    # the losses of one process on the same global batches (float32; the ranks' mean loss, DeepSpeed's reductions)
    single = single_process_losses(model_dir, blocks, tmp_path / "single")
    assert ranks[0]["train_losses"] == ranks[1]["train_losses"]
    assert ranks[0]["train_losses"] == pytest.approx(single, rel=1e-4)
    assert ranks[0]["train_losses"][-1] < ranks[0]["train_losses"][0]

    # Trainer's checkpoints hold DeepSpeed's state; the final save is a model folder of the gathered weights
    checkpoint = out / "trainer" / "checkpoint-2"
    assert (checkpoint / "latest").read_text().strip() == "global_step2"
    assert len(list((checkpoint / "global_step2").glob("*optim_states.pt"))) == 2  # one partition per process
    assert not list((out / "final").glob("global_step*"))
    saved = load_file(out / "final" / "model.safetensors")
    source = DualFlowForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(AUX_NAMES) <= saved.keys()
    for name in AUX_NAMES:  # the aux modules trained (and were gathered whole)
        assert saved[name].shape == source[name].shape and not torch.equal(saved[name], source[name]), name
    loaded = DualFlowForCausalLM.from_pretrained(out / "final").eval()
    expected = torch.load(out / "logits.pt")
    with torch.no_grad():
        actual = loaded(blocks[:2])
    torch.testing.assert_close(actual.logits, expected["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(actual.primary_logits, expected["primary_logits"], rtol=0, atol=1e-5)
