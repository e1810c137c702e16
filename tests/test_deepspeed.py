"""
DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes (torchrun, gloo, DeepSpeed's CPU accelerator, a real engine): a plain
`Trainer` script and `dualflow finetune --deepspeed`. accelerate runs DeepSpeed only on an accelerator; the scripts in
tests/distributed let it take the CPU for one (deepspeed_on_cpu.py, test side only).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import byte_model, run_finetune, signallable_process, stdlib_blocks, stdlib_text
from safetensors.torch import load_file
from transformers import ByT5Tokenizer, Trainer, TrainingArguments, default_data_collator

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
# DeepSpeed's AdamW, its settings filled by Trainer from TrainingArguments
ADAMW_FIELDS = ("lr", "betas", "eps", "weight_decay")
# ZeRO-3 with the optimizer's states and the parameters offloaded to the CPU (on GPUs: out of GPU memory); without an
# "optimizer" section Trainer hands DeepSpeed its AdamW, which DeepSpeed refuses under offload, so Trainer builds
# DeepSpeed's CPU Adam (a compiled op) instead
ZERO_CONFIGS["zero3_offload"] = {
    **ZERO_CONFIGS["zero3"],
    "zero_optimization": {
        **ZERO_CONFIGS["zero3"]["zero_optimization"],
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
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
@pytest.mark.parametrize("zero", ["zero2", "zero3", "zero3_offload"])
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
    offload = zero == "zero3_offload"
    assert [(r["optimizer"], r["offloaded"]) for r in ranks] == [
        ("DeepSpeedCPUAdam" if offload else "AdamW", [offload, offload])
    ] * 2
    # ZeRO-3: partitioned from `from_pretrained` on (the TrainingArguments came first), and after training
    zero3 = zero.startswith("zero3")
    assert [r["zero3_at_load"] for r in ranks] == [zero3] * 2
    assert [r["local_fraction"] for r in ranks] == pytest.approx([0.5 if zero3 else 1.0] * 2, abs=0.01)
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


def finetune_phases(tmp_path: Path, phases: list[dict], shim: bool = True) -> tuple[list[dict], str]:
    """Run the phases of tests/distributed/finetune_deepspeed.py; each process's results (rank 0's first) and stdout."""
    (tmp_path / "phases.json").write_text(json.dumps(phases, default=str))
    flags = [] if shim else ["--no-shim"]
    completed = torchrun(
        SCRIPTS / "finetune_deepspeed.py", tmp_path / "phases.json", tmp_path / "result.json", *flags, tmp_dir=tmp_path
    )
    results = [json.loads((tmp_path / f"result-rank-{rank}.json").read_text()) for rank in (0, 1)]
    return results, completed.stdout


def finetune_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny Dual-Flow checkpoint with its tokenizer and a corpus in `tmp_path`: the model folder and the corpus."""
    model_dir = tmp_path / "tiny-dualflow"
    byte_model(aux_num_experts_per_tok=3).save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    (tmp_path / "corpus.txt").write_text(stdlib_text("textwrap.py", chars=6000))
    return model_dir, tmp_path / "corpus.txt"


def zero3_finetune_args(tmp_path: Path) -> list:
    """
    The inputs and the ZeRO-3 config in `tmp_path`, and the arguments of `dualflow finetune` that the tests of stopped
    and resumed ZeRO-3 runs share: a checkpoint every 2 steps and a constant learning rate, so that a run stopped
    after a checkpoint has the schedule of a run never stopped.
    """
    model_dir, _ = finetune_inputs(tmp_path)
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO_CONFIGS["zero3"]))
    common = [model_dir, "--data", tmp_path / "corpus.txt", "--deepspeed", tmp_path / "zero3.json"]
    common += ["--block-size", 32, "--batch-size", 2, "--save-steps", 2, "--lr", 3e-3, "--disable-tqdm", "true"]
    return [*common, "--lr-scheduler-type", "constant"]


def folder_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.rglob("*") if file.is_file())


@pytest.mark.multiprocess
def test_finetune_cli_under_zero3_saves_resumes_and_counts_deepspeed_checkpoints(tmp_path):
    common = zero3_finetune_args(tmp_path)
    model_dir = common[0]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    phases = [
        {"argv": [*common, "--max-steps", 4, "--output-dir", straight]},
        {"argv": [*common, "--max-steps", 2, "--output-dir", stopped]},
        # stopped after checkpoint-2, with a checkpoint-3 whose DeepSpeed part is missing: the same command with
        # --max-steps 4 goes on from checkpoint-2
        {
            "unfinish": stopped,
            "incomplete": [stopped / "checkpoint-2", stopped / "checkpoint-3"],
            "argv": [*common, "--max-steps", 4, "--output-dir", stopped],
        },
    ]
    phases = [dict(phase, argv=list(map(str, phase["argv"]))) for phase in phases]
    results, stdout = finetune_phases(tmp_path, phases)
    assert [[phase["status"] for phase in result] for result in results] == [[0, 0, 0]] * 2

    # only rank 0 spoke (once per run) and wrote the folder: the marker gone, no DeepSpeed files beside the model
    assert stdout.count("trainable parameters:") == 3
    assert f"resuming the unfinished run in {stopped} from its last checkpoint, checkpoint-2" in stdout
    for out in (straight, stopped):
        names = sorted(path.name for path in out.iterdir())
        assert "dualflow-unfinished.json" not in names and "latest" not in names, names
        assert [name for name in names if name.startswith("checkpoint-")] == ["checkpoint-2", "checkpoint-4"]
        state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
        assert state["global_step"] == 4
    # the resumed run went on from checkpoint-2's weights and optimizer: the straight run's result
    resumed, direct = (load_file(out / "model.safetensors") for out in (stopped, straight))
    source = DualFlowForCausalLM.from_pretrained(model_dir).state_dict()
    for name in AUX_NAMES:
        assert not torch.equal(direct[name], source[name]), name  # the aux modules trained
    for name, tensor in direct.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    # the result loads, and its inference settings are saved
    model = DualFlowForCausalLM.from_pretrained(straight)
    assert model.config.use_cache and not model.config.output_router_logits

    # the free-space check counted DeepSpeed's checkpoints: the final weights and two checkpoints, each its weights
    # and DeepSpeed's global_step folder (the optimizer partitions: 3 float32 copies of the weights; the estimate
    # leaves out each process's few KB of module states), at most its other files (tokenizer, code) more
    checkpoint = straight / "checkpoint-4"
    weights = (straight / "model.safetensors").stat().st_size
    deepspeed_part = folder_bytes(checkpoint / "global_step4")
    asked = results[0][0]["asked_bytes"]
    written = weights + 2 * ((checkpoint / "model.safetensors").stat().st_size + deepspeed_part)
    assert 0.95 * written <= asked <= weights + 2 * folder_bytes(checkpoint)
    # what the estimate without DeepSpeed (the weights and Adam's 2 moments: 3 x the weights a checkpoint) missed
    assert 0.95 * written > weights + 2 * 3 * weights


@pytest.mark.multiprocess
def test_ctrl_c_of_a_launched_deepspeed_run_keeps_its_checkpoints_and_the_same_command_goes_on(tmp_path):
    """Ctrl-C in the terminal of `torchrun ... dualflow finetune --deepspeed`: the signal reaches every process."""
    common = [*zero3_finetune_args(tmp_path), "--eval-blocks", 0]
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    (tmp_path / "long.json").write_text(
        json.dumps([{"argv": list(map(str, [*common, "--max-steps", 400, "--output-dir", stopped]))}])
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [SCRIPTS / "finetune_deepspeed.py", tmp_path / "long.json", tmp_path / "long-result.json"]
    # a terminal's Ctrl-C signals its foreground process group: torchrun and the processes it started
    run = signallable_process(
        command, env=dict(SUBPROCESS_ENV, TMPDIR=str(tmp_path)), start_new_session=True, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 240
    # trainer_state.json is a checkpoint's last file
    while not (stopped / "checkpoint-2" / "trainer_state.json").exists() and run.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    _, stderr = run.communicate(timeout=120)
    # Every process stops and the main one says so in one line; a process the signal reached while it waited for the
    # others in a collective can stay there until torchrun kills it (30 s later, SIGKILL; 3 of 7 tries): maybe no line
    lines = [line for line in stderr.splitlines() if line.startswith("dualflow finetune:")]
    killed = "forcefully exiting via 9" in stderr
    assert len(lines) == 1 or (killed and not lines), stderr[-3000:]
    expected = f"dualflow finetune: interrupted; checkpoints kept in {stopped} (last: checkpoint-"
    assert all(line.startswith(expected) for line in lines), lines
    names = sorted(path.name for path in stopped.iterdir())
    assert "dualflow-unfinished.json" in names and "model.safetensors" not in names, names

    # the same command (to 6 steps here) goes on from the last checkpoint, as the straight run of 6 steps does
    phases = [{"argv": list(map(str, [*common, "--max-steps", 6, "--output-dir", out]))} for out in (stopped, straight)]
    results, stdout = finetune_phases(tmp_path, phases)
    assert [[phase["status"] for phase in result] for result in results] == [[0, 0]] * 2
    assert f"resuming the unfinished run in {stopped} from its last checkpoint, checkpoint-" in stdout
    resumed, direct = (load_file(out / "model.safetensors") for out in (stopped, straight))
    for name, tensor in direct.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def logged_losses(checkpoint: Path) -> list[float]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


@pytest.mark.multiprocess
def test_finetune_cli_lora_aux_only_and_zero2_match_one_process(tmp_path):
    """
    `dualflow finetune --deepspeed` with LoRA and --aux-only under ZeRO-3 and a full run under ZeRO-2 with DeepSpeed's
    own AdamW (its compiled op) on 2 processes: the losses and results of the same runs in one process without
    DeepSpeed on the same micro-batches (2 rows, 2 accumulated per step). A batch of 4 in one is not the same run: the
    router balance loss of a micro-batch is not the mean of its halves' (its loss is; measured in docs/training.md).
    """
    model_dir, corpus = finetune_inputs(tmp_path)
    zero2_adamw = dict(
        ZERO_CONFIGS["zero2"], optimizer={"type": "AdamW", "params": dict.fromkeys(ADAMW_FIELDS, "auto")}
    )
    for name, config in {"zero3": ZERO_CONFIGS["zero3"], "zero2_adamw": zero2_adamw}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    common = [model_dir, "--data", corpus, "--block-size", 32, "--max-steps", 2, "--save-steps", 2]
    common += ["--lr", 3e-3, "--logging-steps", 1, "--eval-blocks", 0, "--disable-tqdm", "true"]
    runs = {"lora": ["--lora"], "aux": ["--aux-only"], "full": []}
    zero = {"lora": "zero3", "aux": "zero3", "full": "zero2_adamw"}
    launched_argv = {
        run: [*common, *flags, "--batch-size", 2, "--deepspeed", tmp_path / f"{zero[run]}.json"]
        for run, flags in runs.items()
    }
    phases = [
        {"argv": list(map(str, [*argv, "--output-dir", tmp_path / f"ds-{run}"]))} for run, argv in launched_argv.items()
    ]
    results, _ = finetune_phases(tmp_path, phases)
    assert [[phase["status"] for phase in result] for result in results] == [[0, 0, 0]] * 2
    for run, flags in runs.items():
        argv = [*common, *flags, "--batch-size", 2, "--grad-accum", 2, "--output-dir", tmp_path / f"one-{run}"]
        assert run_finetune(*argv) == 0

    source = DualFlowForCausalLM.from_pretrained(model_dir).state_dict()
    for run in runs:
        launched, single = tmp_path / f"ds-{run}", tmp_path / f"one-{run}"
        losses = logged_losses(launched / "checkpoint-2")
        assert len(losses) == 2 and losses == pytest.approx(logged_losses(single / "checkpoint-2"), rel=1e-4), run
        weights = "adapter_model.safetensors" if run == "lora" else "model.safetensors"
        result, expected = load_file(launched / weights), load_file(single / weights)
        assert result.keys() == expected.keys(), run
        for name, tensor in expected.items():
            torch.testing.assert_close(result[name], tensor, rtol=1e-4, atol=1e-6, msg=f"{run}: {name}")
    # LoRA under ZeRO-3 trained the adapters of every expert and attention projection (gathered whole), and the aux
    # modules in full
    adapter = load_file(tmp_path / "ds-lora" / "adapter_model.safetensors")
    assert any(
        ".mlp.experts." in name and "lora_B" in name and tensor.abs().sum() > 0 for name, tensor in adapter.items()
    )
    assert all(tensor.numel() > 0 for tensor in adapter.values())
    # --aux-only under ZeRO-3: the primary's weights untouched, the aux modules trained
    aux_only = load_file(tmp_path / "ds-aux" / "model.safetensors")
    for name, tensor in source.items():
        changed = not torch.equal(aux_only[name], tensor)
        assert changed == (name in AUX_NAMES), name


@pytest.mark.multiprocess
def test_finetune_cli_refuses_deepspeed_that_counts_one_process_of_two(tmp_path):
    # Without the test's shim, accelerate on a CPU runs DeepSpeed as one process per rank, each the "only" one.
    model_dir = tmp_path / "tiny-dualflow"
    byte_model().save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    (tmp_path / "corpus.txt").write_text(stdlib_text("textwrap.py", chars=3000))
    (tmp_path / "zero2.json").write_text(json.dumps(ZERO_CONFIGS["zero2"]))
    argv = [model_dir, "--data", tmp_path / "corpus.txt", "--deepspeed", tmp_path / "zero2.json"]
    argv += ["--max-steps", 1, "--output-dir", tmp_path / "out"]
    phases = [{"argv": list(map(str, argv))}]
    (tmp_path / "phases.json").write_text(json.dumps(phases))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [str(SCRIPTS / "finetune_deepspeed.py"), str(tmp_path / "phases.json"), str(tmp_path / "result.json")]
    env = dict(SUBPROCESS_ENV, TMPDIR=str(tmp_path))
    completed = subprocess.run([*command, "--no-shim"], env=env, capture_output=True, text=True, timeout=300)
    results = [json.loads((tmp_path / f"result-rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [result[0]["status"] for result in results] == [2, 2], completed.stderr[-3000:]
    assert (
        completed.stderr.count(
            "dualflow finetune: error: --deepspeed: the launcher started 2 processes but accelerate counts 1"
        )
        == 2
    )
    assert not (tmp_path / "out").exists()  # refused before the output folder was made


def launched_as_one_process(monkeypatch):
    """The environment torchrun --nproc_per_node 1 gives its process."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29511")


def with_optimizer(config: dict, name: str) -> dict:
    return dict(config, optimizer={"type": name, "params": {"lr": "auto"}})


@pytest.mark.parametrize(
    "config, flags, launched, message",
    [
        (
            ZERO_CONFIGS["zero2"],
            [],
            False,
            "--deepspeed needs a launcher: torchrun --nproc_per_node N, accelerate launch",
        ),
        (ZERO_CONFIGS["zero3"], ["--lora", "--load-in-4bit"], True, "--load-in-4bit cannot train under DeepSpeed"),
        ({"zero_optimization": {"stage": 3}}, [], True, '"stage3_gather_16bit_weights_on_model_save": true'),
        (None, [], True, "no such file"),
        (
            with_optimizer(ZERO_CONFIGS["zero2"], "AdamQ"),
            [],
            True,
            "--deepspeed: the \"optimizer\" section names 'AdamQ', neither one of DeepSpeed's (adagrad, adam, adamw",
        ),
        # DeepSpeed's Lamb is a fused CUDA op: nothing builds it on a CPU
        (
            with_optimizer(ZERO_CONFIGS["zero3"], "Lamb"),
            [],
            True,
            "names 'Lamb', whose DeepSpeed op (FusedLambBuilder) does not build on this machine's cpu accelerator",
        ),
        (
            ZERO_CONFIGS["zero3"],
            ["quantised"],
            True,
            "--deepspeed: the model is quantised (compressed-tensors) and ZeRO-3 partitions every weight",
        ),
    ],
    ids=["no-launcher", "qlora-zero3", "zero3-no-gather", "missing-config", "unknown-optimizer", "lamb", "quantised"],
)
def test_deepspeed_runs_finetune_cannot_finish_are_one_line_errors(
    tmp_path, capsys, monkeypatch, config, flags, launched, message
):
    if launched:
        launched_as_one_process(monkeypatch)
    for name in () if launched else ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    model_dir = tmp_path / "tiny-dualflow"
    model = byte_model()
    if "quantised" in flags:  # a `dualflow quantize` checkpoint's config (refused before its weights are read)
        flags = []
        model.config.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    model.save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    (tmp_path / "corpus.txt").write_text(stdlib_text("textwrap.py", chars=3000))
    if config is not None:
        (tmp_path / "ds.json").write_text(json.dumps(config))
    argv = [model_dir, "--data", tmp_path / "corpus.txt", "--deepspeed", tmp_path / "ds.json", *flags]
    capsys.readouterr()
    assert run_finetune(*argv, "--output-dir", tmp_path / "out") == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("dualflow finetune: error: ") and message in error, error
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_deepspeed_is_not_resumed_under_deepspeed(tmp_path, capsys, monkeypatch):
    model_dir = tmp_path / "tiny-dualflow"
    byte_model().save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    (tmp_path / "corpus.txt").write_text(stdlib_text("textwrap.py", chars=3000))
    argv = [model_dir, "--data", tmp_path / "corpus.txt", "--block-size", 32, "--batch-size", 4]
    argv += ["--max-steps", 1, "--save-steps", 1, "--disable-tqdm", "true", "--eval-blocks", 0]
    assert run_finetune(*argv, "--output-dir", tmp_path / "plain") == 0
    checkpoint = tmp_path / "plain" / "checkpoint-1"
    launched_as_one_process(monkeypatch)
    (tmp_path / "zero2.json").write_text(json.dumps(ZERO_CONFIGS["zero2"]))
    capsys.readouterr()
    deepspeed = ["--deepspeed", tmp_path / "zero2.json", "--resume-from-checkpoint", checkpoint]
    assert run_finetune(*argv, *deepspeed, "--output-dir", tmp_path / "out") == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"dualflow finetune: error: {checkpoint} was saved without DeepSpeed (no global_step folder): a --deepspeed "
        "run cannot resume its optimizer; start a new run from it as the model"
    )
    assert not (tmp_path / "out").exists()
