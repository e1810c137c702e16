"""Training with transformers.Trainer: loss goes down, gradient accumulation, checkpointing, aux-only, the CLI."""

import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    byte_model,
    enable_activation_checkpointing,
    run_finetune,
    signallable_process,
    stdlib_blocks,
    stdlib_text,
    tiny_model,
)
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, ByT5Tokenizer, TrainingArguments

from dualflow.aux_training import freeze_for_aux_training
from dualflow.checkpoint import load_dualflow_model
from dualflow.finetune import complete_checkpoints, finetune, make_trainer, split_blocks
from dualflow.output_folder import UNFINISHED_MARKER


def sgd_update(model, blocks, output_dir, labels=None, **trainer_options) -> tuple[dict, float]:
    """One plain-SGD step (lr 1, no clipping) over `blocks`: returns the parameter change (= -gradient) and the loss."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = make_trainer(
        model,
        blocks,
        None,
        output_dir,
        max_steps=1,
        learning_rate=1.0,
        optim="sgd",
        max_grad_norm=0.0,
        disable_tqdm=True,
        **trainer_options,
    )
    if labels is not None:
        trainer.train_dataset = [{"input_ids": ids, "labels": lab} for ids, lab in zip(blocks, labels)]
    loss = trainer.train().training_loss
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}, loss


def assert_same_update(update_a, update_b, atol=1e-6):
    for name in update_a:
        torch.testing.assert_close(update_a[name], update_b[name], rtol=1e-4, atol=atol, msg=name)


def test_trainer_lowers_eval_loss(tmp_path):
    train_blocks, eval_blocks = split_blocks(stdlib_blocks(block_size=32), eval_fraction=0.1)
    trainer = make_trainer(
        byte_model(output_router_logits=True),
        train_blocks,
        eval_blocks,
        tmp_path,
        max_steps=30,
        learning_rate=3e-3,
        batch_size=8,
        disable_tqdm=True,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    # Two cross-entropies over 384 ids start near 2 * ln(384) = 11.9; bytes of Python source are far from uniform.
    assert before > 11.0
    assert after < before - 2.0


def test_gradient_accumulation_matches_double_batch(tmp_path):
    blocks = stdlib_blocks(block_size=16, chars=2000)[:4]
    # Masked labels give the two micro-batches different token counts: only num_items_in_batch weighs them right.
    labels = blocks.clone()
    labels[0, 4:] = -100
    update_one, loss_one = sgd_update(byte_model(), blocks, tmp_path / "a", labels, batch_size=4)
    update_acc, loss_acc = sgd_update(
        byte_model(), blocks, tmp_path / "b", labels, batch_size=2, gradient_accumulation_steps=2
    )
    assert loss_acc == pytest.approx(loss_one, rel=1e-5)
    assert_same_update(update_one, update_acc)


def test_router_balance_loss_not_scaled_by_gradient_accumulation(tmp_path):
    # With num_items_in_batch Trainer does not divide by the accumulation steps; the per-micro-batch balance loss
    # must then be weighted by the model, so the step equals Trainer's classic "mean loss / steps" accumulation.
    blocks = stdlib_blocks(block_size=16, chars=2000)[:4]
    overrides = dict(output_router_logits=True, router_aux_loss_coef=1.0)
    with_items = byte_model(**overrides)
    classic = byte_model(**overrides)
    classic.accepts_loss_kwargs = False  # Trainer then neither passes num_items_in_batch nor trusts its scaling
    update_items, loss_items = sgd_update(
        with_items, blocks, tmp_path / "a", batch_size=2, gradient_accumulation_steps=2
    )
    update_classic, loss_classic = sgd_update(
        classic, blocks, tmp_path / "b", batch_size=2, gradient_accumulation_steps=2
    )
    assert loss_items == pytest.approx(loss_classic, rel=1e-5)
    assert_same_update(update_items, update_classic)


@pytest.mark.parametrize("num_experts", [4, 0], ids=["moe", "dense"])
def test_gradient_checkpointing_matches_plain_gradients(num_experts):
    blocks = stdlib_blocks(block_size=24, chars=3000)[:3]
    grads = []
    for checkpointing in (False, True):
        model = byte_model(num_experts=num_experts, output_router_logits=True).train()
        if checkpointing:
            enable_activation_checkpointing(model)
        model(blocks, labels=blocks).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert all(grad is not None for grad in grads[1].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_aux_only_trains_only_aux_params_and_keeps_primary_logits(tmp_path):
    model = byte_model(aux_num_experts_per_tok=4, output_router_logits=True)
    blocks = stdlib_blocks(block_size=32, chars=8000)
    probe = blocks[:2]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        primary_before = model(probe).primary_logits

    freeze_for_aux_training(model)
    make_trainer(model, blocks, None, tmp_path, max_steps=5, learning_rate=1e-2, disable_tqdm=True).train()

    aux_names = set(model.aux_parameter_names())
    assert aux_names == {"model.aux_embed_tokens.weight"} | {f"model.layers.{i}.aux_coupling.weight" for i in range(2)}
    for name, parameter in model.named_parameters():
        changed = not torch.equal(parameter, before[name])
        assert changed == (name in aux_names), name
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(probe).primary_logits, primary_before)


def test_finetuned_model_saves_and_reloads_identical_logits(tmp_path):
    model = byte_model()
    blocks = stdlib_blocks(32, chars=4000)
    make_trainer(model, blocks, None, tmp_path / "work", max_steps=3, learning_rate=1e-2, disable_tqdm=True).train()
    model.eval().save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    trained_state = model.state_dict()
    assert all(torch.equal(tensor, trained_state[name]) for name, tensor in reloaded.state_dict().items())
    with torch.no_grad():
        expected, actual = model(blocks[:2]), reloaded(blocks[:2])
    # Same bits in the weights; CPU kernels may still round differently for differently aligned (mmapped) buffers.
    torch.testing.assert_close(actual.logits, expected.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(actual.primary_logits, expected.primary_logits, rtol=0, atol=1e-6)


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny-dualflow"
    byte_model().save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    return path


def printed_nll(output: str, when: str) -> dict[str, float]:
    """{"aux flow": ..., "primary flow": ...} from the line `eval NLL per token (nats) <when>: aux flow x, primary flow y`."""
    line = next(line for line in output.splitlines() if line.startswith(f"eval NLL per token (nats) {when}:"))
    pairs = [item.strip().rsplit(" ", 1) for item in line.split(":", 1)[1].split(",")]
    return {name: float(value) for name, value in pairs}


def test_finetune_cli_txt_full_and_aux_only(model_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=6000), encoding="utf-8")
    common = ("--block-size", 32, "--batch-size", 4, "--max-steps", 4, "--lr", 1e-2)

    # Trainer's own flags (HfArgumentParser), in both spellings; transformers 5.23 renamed gradient_checkpointing.
    checkpointing = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
    trainer_flags = (f"--{checkpointing}-checkpointing", "--lr_scheduler_type", "constant", "--weight-decay", 0.01)
    assert run_finetune(model_dir, "--data", data, "--output-dir", tmp_path / "full", *trainer_flags, *common) == 0
    output = capsys.readouterr().out
    # Trainer's train_loss sums both flows (about twice the per-flow eval NLL): the output says so.
    assert "train_loss (Trainer's) = aux-flow CE + primary-flow CE + 0.001 x router balance loss" in output
    before, after = printed_nll(output, "before"), printed_nll(output, "after")
    # Per token and per flow: near ln(384) = 5.95 for a random byte-level model, not the sum of two flows' losses.
    assert set(before) == {"aux flow", "primary flow"} and all(5.0 < value < 7.0 for value in before.values())
    assert after["aux flow"] < before["aux flow"] and after["primary flow"] < before["primary flow"]
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    assert (tmp_path / "full" / "README.md").is_file() and (tmp_path / "full" / "tokenizer_config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "full").stat().st_mode) == 0o777 & ~umask  # like mkdir, not mkdtemp's 0700

    # --eval-blocks 0: no NLL before / after (a user with a big held-out set skips it), none claimed on the card.
    aux_argv = ("--data", data, "--output-dir", tmp_path / "aux", "--aux-only", "--eval-blocks", 0)
    aux_argv += ("--data-name", "some-org/python-sources")
    assert run_finetune(model_dir, *aux_argv, *common) == 0
    output = capsys.readouterr().out
    assert "eval NLL before / after: not measured (--eval-blocks 0)" in output and "(nats) before" not in output
    # The card names the data by what the user passes, never by a local file name.
    assert (
        "Fine-tuned (full) with `dualflow finetune` on local text data:"
        in (tmp_path / "full" / "README.md").read_text()
    )
    assert "corpus" not in (tmp_path / "full" / "README.md").read_text()
    assert (
        "Fine-tuned (aux-only) with `dualflow finetune` on some-org/python-sources."
        in (tmp_path / "aux" / "README.md").read_text()
    )
    aux_only = AutoModelForCausalLM.from_pretrained(tmp_path / "aux")
    source = AutoModelForCausalLM.from_pretrained(model_dir)
    shared = [name for name, _ in source.named_parameters() if name not in source.aux_parameter_names()]
    assert all(torch.equal(aux_only.get_parameter(n), source.get_parameter(n)) for n in shared)
    assert not all(torch.equal(full.get_parameter(n), source.get_parameter(n)) for n in shared)


def test_finetune_cli_jsonl_lora_bf16(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(model_dir.parent)  # the model given as a relative path, as a user types it
    # Several data paths, one a folder; the text of .jsonl lines in a field of the user's choice.
    (tmp_path / "corpus").mkdir()
    data = tmp_path / "corpus" / "part.jsonl"
    lines = stdlib_text("textwrap.py", chars=6000).split("\n\n")
    data.write_text("\n".join(json.dumps({"body": chunk, "id": i}) for i, chunk in enumerate(lines)) + "\n")
    (tmp_path / "more.jsonl").write_text(json.dumps({"body": stdlib_text("inspect.py", chars=2000)}) + "\n")
    out = tmp_path / "adapter"
    argv = (
        "--data",
        tmp_path / "corpus",
        tmp_path / "more.jsonl",
        "--text-field",
        "body",
        "--lora-dropout",
        0.1,
        "--target-modules",
        "q_proj",
        "v_proj",
        "--output-dir",
        out,
        "--lora",
        "--bf16",
        "--block-size",
        32,
        "--batch-size",
        4,
        "--max-steps",
        2,
        "--eval-blocks",
        1,
    )
    assert run_finetune(model_dir.name, *argv) == 0
    output = capsys.readouterr().out
    assert "eval NLL before / after measured on 1 of the " in output
    assert set(printed_nll(output, "after")) == {"aux flow", "primary flow"}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    # The adapter names its base model by a path that loads from any directory, and has a card of its own.
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(model_dir)
    assert set(adapter_config["target_modules"]) == {"q_proj", "v_proj"} and adapter_config["lora_dropout"] == 0.1
    assert adapter_config["target_parameters"] is None  # "experts" not asked for
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    adapter = AutoPeftModelForCausalLM.from_pretrained(out)
    assert type(adapter.get_base_model()).__name__ == "DualFlowForCausalLM"
    card = (out / "README.md").read_text()
    assert "More Information Needed" not in card and "LoRA adapter" in card and f"`{model_dir.name}`" in card
    assert str(tmp_path) not in card  # the card is published: local folders by their names only
    assert "dual-flow" in yaml.safe_load(card.split("---\n")[1])["tags"]


def test_aux_only_bf16_measures_before_and_after_alike(model_dir, tmp_path):
    # --bf16 autocasts training; the primary flow's weights stay bit-identical under --aux-only, so must its NLL.
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=6000))
    result = finetune(
        model_dir, data, tmp_path / "out", aux_only=True, block_size=32, bf16=True, max_steps=2, disable_tqdm=True
    )
    assert result.eval_nll_after["primary flow"] == result.eval_nll_before["primary flow"]
    assert result.eval_nll_after["aux flow"] != result.eval_nll_before["aux flow"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"text": "fine"}\n{"body": "no text field"}\n', 'bad.jsonl, row 1: no "text" field'),
        ("broken.jsonl", '{"text": "fine"}\n{"text": \n', "broken.jsonl: JSON parse error"),
        ("data.csv", "body\nhello\n", 'data.csv, row 0: no "text" field'),
        ("short.txt", "too short", "at least 2 blocks"),
    ],
)
def test_finetune_cli_bad_data_is_one_line_error(model_dir, tmp_path, capsys, name, content, message):
    data = tmp_path / name
    data.write_text(content)
    out = tmp_path / "out"
    assert run_finetune(model_dir, "--data", data, "--output-dir", out, "--block-size", 64) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("dualflow finetune: error: ") and message in error
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--lr", -1), "--learning-rate must be > 0, got -1.0"),
        (("--batch-size", 0), "--per-device-train-batch-size must be >= 1, got 0"),
        (("--lora", "--lora-r", 0), "--lora-r must be >= 1, got 0"),
        (("--eval-blocks", -1), "--eval-blocks must be >= 0 (0: no NLL before / after), got -1"),
        (("--epochs", -1), "--num-train-epochs must be > 0 (or --max-steps given), got -1.0"),  # trained nothing
        (("--warmup-steps", -5), "--warmup-steps must be >= 0, got -5.0"),
    ],
)
def test_finetune_cli_bad_numbers_are_one_line_errors(model_dir, tmp_path, capsys, argv, message):
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=3000))
    out = tmp_path / "out"
    assert run_finetune(model_dir, "--data", data, "--output-dir", out, *argv) == 2
    assert capsys.readouterr().err == f"dualflow finetune: error: {message}\n"
    assert not out.exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_experts", "4", "config.json: TypeError: Field 'num_experts' expected int, got str (value: '4')"),
        ("num_hidden_layers", None, "config.json: TypeError: Field 'num_hidden_layers' expected int, got NoneType"),
        ("vocab_size", 300, "do not match its config.json: tensor shapes differ from the config's sizes"),
        # Letters are byte ids above 100: the byte tokenizer does not belong to a model of 100 tokens (weights match).
        ("vocab_size", 100, "outside the model's vocabulary (vocab_size 100): the tokenizer in"),
    ],
)
def test_a_wrong_config_is_a_one_line_error_before_training(model_dir, tmp_path, capsys, field, value, message):
    if field == "vocab_size" and value == 100:
        tiny_model(random_coupling=False, vocab_size=100).save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {field: value}))
    out = tmp_path / "out"
    argv = small_run(tmp_path, "--output-dir", out, "--max-steps", 1)
    assert run_finetune(model_dir, *argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("dualflow finetune: error: ") and message in error and "Traceback" not in error
    assert not out.exists()


def test_resuming_from_a_folder_that_is_no_checkpoint_is_a_one_line_error(model_dir, tmp_path, capsys):
    fake = tmp_path / "checkpoint-3"
    fake.mkdir()
    (fake / "trainer_state.json").write_text("{}")
    out = tmp_path / "deeper" / "out"
    argv = small_run(tmp_path, "--output-dir", out, "--max-steps", 1, "--resume-from-checkpoint", fake)
    assert run_finetune(model_dir, *argv) == 2
    assert capsys.readouterr().err == (
        f"dualflow finetune: error: --resume-from-checkpoint {fake} is not a complete Trainer checkpoint folder "
        "(trainer_state.json and the weights)\n"
    )
    assert not (tmp_path / "deeper").exists()  # nor the parent folders the run made


def test_finetune_cli_truncated_weights_and_empty_data_folder_are_one_line_errors(model_dir, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=3000))
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "out"
    assert run_finetune(model_dir, "--data", data, "--output-dir", out, "--block-size", 32) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dualflow finetune: error: the weights in {model_dir} do not load: "
        "Error while deserializing header: incomplete metadata, file not fully covered"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt", "tiny-dualflow"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a data file")
    assert run_finetune(model_dir, "--data", tmp_path / "empty", "--output-dir", out) == 2
    assert (
        capsys.readouterr().err
        == f"dualflow finetune: error: data folder {tmp_path / 'empty'} holds no data file (.txt, .jsonl, .json, .parquet, .csv, .tsv, .arrow)\n"
    )


def test_finetune_cli_needs_tokenizer_and_empty_output(tmp_path, model_dir, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=3000))
    no_tokenizer = tmp_path / "no-tokenizer"
    byte_model().save_pretrained(no_tokenizer)
    capsys.readouterr()
    assert run_finetune(no_tokenizer, "--data", data, "--output-dir", tmp_path / "out") == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"dualflow finetune: error: {no_tokenizer} has no tokenizer: add the source model's, e.g. "
        f"AutoTokenizer.from_pretrained(SOURCE).save_pretrained({str(no_tokenizer)!r}) "
        "(`dualflow convert` copies it when the source folder has one)"
    )
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert run_finetune(model_dir, "--data", data, "--output-dir", tmp_path / "taken") == 2
    assert "already exists and is not empty (keep.txt); choose another --output-dir" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


def wait_for(pattern: str, folder: Path, process: subprocess.Popen, timeout: float = 600) -> None:
    """Poll until `folder.glob(pattern)` finds something (the process must still be running)."""
    deadline = time.monotonic() + timeout
    while not any(folder.glob(pattern)):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)


def finetune_command(model_dir, tmp_path, *extra) -> tuple[list, Path]:
    """`dualflow finetune` as a command line saving a checkpoint every step, and its output folder."""
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=6000))
    out = tmp_path / "out"
    argv = ["--data", data, "--output-dir", out, "--block-size", 32, "--batch-size", 4, "--disable-tqdm", "true"]
    argv += ["--save-strategy", "steps", "--save-steps", 1, *extra]
    return [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, *argv], out


def stop_once_written(command, tmp_path, pattern, signum) -> tuple[subprocess.Popen, str]:
    """Run `command` and send it `signum` once `tmp_path.glob(pattern)` finds something; returns it and its stderr."""
    process = signallable_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(pattern, tmp_path, process)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=300)
    except BaseException:  # a failed test must not leave a long run training beside the next tests
        process.kill()
        process.communicate()
        raise
    return process, stderr


def stop_finetune_after_a_checkpoint(model_dir, tmp_path, signum) -> tuple[subprocess.Popen, str, list, Path]:
    """Run `dualflow finetune` saving every step and send it `signum` once a checkpoint is saved."""
    command, out = finetune_command(model_dir, tmp_path)
    process, stderr = stop_once_written([*command, "--max-steps", 100_000], tmp_path, CHECKPOINT_SAVED, signum)
    return process, stderr, command, out


CHECKPOINT_SAVED = "out/checkpoint-*/trainer_state.json"


def last_checkpoint(folder: Path) -> Path:
    return complete_checkpoints(folder)[-1]


@pytest.mark.parametrize(
    "signum, status, how",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")]
    + [(signal.SIGHUP, 129, "terminated (SIGHUP)")],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_a_stopped_run_keeps_its_checkpoints_and_the_same_command_resumes_it(model_dir, tmp_path, signum, status, how):
    # `kill`, `timeout` and job schedulers send SIGTERM; closing the terminal or the SSH session sends SIGHUP.
    process, stderr, command, out = stop_finetune_after_a_checkpoint(model_dir, tmp_path, signum)
    assert process.returncode == status
    last = last_checkpoint(out)
    # One line and no traceback after transformers' own progress bars (loading, saving).
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == (
        f"dualflow finetune: {how}; checkpoints kept in {out} (last: {last.name}); rerun the same command to go on "
        "from the last one"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt", "out", "tiny-dualflow"]
    assert all((path / "trainer_state.json").is_file() for path in out.glob("checkpoint-*"))
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith("checkpoint-")) == [UNFINISHED_MARKER]
    if signum != signal.SIGINT:
        return
    step = int(last.name.split("-")[1])
    completed = subprocess.run(list(map(str, [*command, "--max-steps", step + 1])), capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"resuming the unfinished run in {out} from its last checkpoint, {last.name}" in completed.stdout
    state = json.loads((out / f"checkpoint-{step + 1}" / "trainer_state.json").read_text())
    assert state["global_step"] == step + 1  # went on from the kept checkpoint, not from step 0
    assert not (out / UNFINISHED_MARKER).exists() and (out / "model.safetensors").is_file()
    # A finished run is not started over, nor resumed, by the same command.
    completed = subprocess.run(list(map(str, [*command, "--max-steps", step + 2])), capture_output=True, text=True)
    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        f"dualflow finetune: error: output folder {out} holds a finished run (a saved Dual-Flow model); choose another "
        "--output-dir"
    )


def test_sigkill_leaves_a_visible_unfinished_run_that_the_next_run_resumes(model_dir, tmp_path):
    process, _, command, out = stop_finetune_after_a_checkpoint(model_dir, tmp_path, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    marker = json.loads((out / UNFINISHED_MARKER).read_text())
    assert marker["command"] == "finetune" and marker["pid"] == process.pid
    last = last_checkpoint(out)
    # Another run's checkpoint is not resumed into this run's folder: checkpoints of two runs never mix.
    other = tmp_path / "other"
    shutil.copytree(last, other / last.name)
    completed = subprocess.run(
        list(map(str, [*command, "--max-steps", 1, "--resume-from-checkpoint", other / last.name])),
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1
    assert "there would mix the checkpoints of two runs; choose another --output-dir" in completed.stderr
    assert last_checkpoint(out) == last and (out / UNFINISHED_MARKER).is_file()


@pytest.mark.parametrize("where", ["sys", "file"])
def test_unwritable_output_folder_is_one_line_error(model_dir, tmp_path, capsys, where):
    # Tests run as root, which writes through chmod 0o555: /sys refuses new folders to root too, and so does a file.
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=3000))
    (tmp_path / "a-file").write_text("not a folder")
    out = Path("/sys/dualflow-test-out") if where == "sys" else tmp_path / "a-file" / "out"
    capsys.readouterr()
    assert run_finetune(model_dir, "--data", data, "--output-dir", out, "--block-size", 32) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith(f"dualflow finetune: error: cannot write the output folder {out}: ")
    assert not out.exists()


def finetune_on_a_mount(tmp_path: Path, options: str, model_dir: Path, *argv, out_name="out") -> tuple[int, str, Path]:
    """
    `dualflow finetune MODEL ... --output-dir DISK/OUT_NAME` where DISK is a tmpfs mounted with `options` in a mount
    namespace of its own (a real full disk, a read-only disk, a mount point as OUT). Returns the exit status, stderr and
    a copy of what the disk held when the command ended.
    """
    disk, after = tmp_path / "disk", tmp_path / "disk-after"
    disk.mkdir()
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" || exit 99; "${@:4}"; status=$?; cp -a "$2" "$3"; exit $status'
    out = disk / out_name if out_name else disk
    finetune = [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, *argv, "--output-dir", out]
    command = ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script, "bash"]
    command += [options, disk, after, *finetune]
    completed = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=600)
    assert completed.returncode != 99, completed.stderr
    return completed.returncode, completed.stderr, after


def small_run(tmp_path, *extra) -> list:
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=6000))
    return ["--data", data, "--block-size", 32, "--batch-size", 4, "--disable-tqdm", "true", *extra]


def test_a_disk_too_small_for_the_model_is_refused_before_training(model_dir, tmp_path):
    # The config and code files fit, the weights (250 KiB) do not: said before the first step, not after training.
    status, stderr, disk = finetune_on_a_mount(tmp_path, "size=150k", model_dir, *small_run(tmp_path, "--max-steps", 1))
    assert status == 2 and "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"dualflow finetune: error: the output folder {tmp_path / 'disk' / 'out'} has ")
    assert "this run needs about" in last
    assert list(disk.iterdir()) == []


def test_a_read_only_disk_is_refused_in_one_line_before_any_work(model_dir, tmp_path):
    status, stderr, disk = finetune_on_a_mount(tmp_path, "ro", model_dir, *small_run(tmp_path, "--max-steps", 1))
    assert status == 2 and stderr.strip() == (
        f"dualflow finetune: error: cannot write the output folder {tmp_path / 'disk' / 'out'}: Read-only file system"
    )


@pytest.mark.parametrize("where", ["mount point", "current folder", "symbolic link"])
def test_the_output_folder_may_be_a_mount_point_the_current_folder_or_a_link(model_dir, tmp_path, where):
    # Written in place, as Trainer writes its output_dir: nothing has to be renamed into OUT at the end.
    argv = small_run(tmp_path, "--max-steps", 2, "--save-strategy", "steps", "--save-steps", 1)
    if where == "mount point":
        status, stderr, out = finetune_on_a_mount(tmp_path, "size=8m", model_dir, *argv, out_name=None)
        assert status == 0, stderr[-3000:]
    else:
        out = tmp_path / "run"
        out.mkdir()
        if where == "current folder":
            command = [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, *argv, "--output-dir", "."]
            completed = subprocess.run(list(map(str, command)), cwd=out, capture_output=True, text=True)
        else:
            (tmp_path / "link").symlink_to(out)
            command = [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, *argv, "--output-dir"]
            completed = subprocess.run(list(map(str, [*command, tmp_path / "link"])), capture_output=True, text=True)
            assert (tmp_path / "link").is_symlink()
        assert completed.returncode == 0, completed.stderr[-3000:]
    assert {"model.safetensors", "config.json", "checkpoint-1", "checkpoint-2"} <= {path.name for path in out.iterdir()}
    assert not (out / UNFINISHED_MARKER).exists()
    assert json.loads((out / "config.json").read_text())["use_cache"] is True  # as loaded, not Trainer's False
    # The weights get the mode every other new file gets (safetensors writes them private first), as convert's do.
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode
    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)


def test_diverged_run_stops_keeps_finite_checkpoints_and_fails(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = small_run(tmp_path, "--output-dir", out, "--lr", 1e6, "--max-steps", 50)
    assert run_finetune(model_dir, *argv, "--save-strategy", "steps", "--save-steps", 1) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    steps = sorted(int(path.name.split("-")[1]) for path in out.glob("checkpoint-*"))
    diverged_at = steps[-1] + 1  # stopped at the first non-finite loss, before checkpointing that step
    assert diverged_at < 50 and steps == list(range(1, diverged_at))[-2:]  # the newest two are kept
    assert error.startswith(
        f"dualflow finetune: error: training diverged: the loss or its gradients were NaN or inf at step {diverged_at}; "
        f"the model was not saved; checkpoints kept in {out} (last: checkpoint-{steps[-1]})"
    )
    # The weights of checkpoint N - 1 gave the loss or gradients: the advice goes on from the one before, if any.
    assert f"(those from checkpoint-{diverged_at - 1} on hold the weights that diverged)" in error
    if diverged_at > 2:
        assert error.endswith(
            f"rerun the same command with {out / f'checkpoint-{diverged_at - 2}'} as the model, a lower "
            "--learning-rate and another --output-dir"
        )
    assert not (out / "model.safetensors").exists() and (out / UNFINISHED_MARKER).is_file()
    for step in steps:
        model = AutoModelForCausalLM.from_pretrained(out / f"checkpoint-{step}")
        assert all(parameter.isfinite().all() for parameter in model.parameters())


def test_non_finite_weights_after_the_last_step_are_not_saved_as_a_model(model_dir, tmp_path, capsys):
    # A finite loss at every step, and weights that an enormous step made infinite.
    out = tmp_path / "out"
    argv = small_run(tmp_path, "--output-dir", out, "--lr", 1e39, "--max-steps", 1, "--eval-blocks", 0)
    assert run_finetune(model_dir, *argv, "--save-strategy", "steps", "--save-steps", 1) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(
        "dualflow finetune: error: training diverged: the weights after the last step were NaN or inf at step 1; "
        f"the model was not saved; checkpoints kept in {out} (last: checkpoint-1)"
    )
    assert sorted(path.name for path in out.iterdir()) == ["checkpoint-1", UNFINISHED_MARKER]


def test_a_hub_id_that_cannot_be_fetched_is_one_line_without_retries(tmp_path):
    # With the Hub allowed but out of reach (or the repo absent), one request decides: no retry warnings before it.
    env = {name: value for name, value in os.environ.items() if name != "HF_HUB_OFFLINE"}
    (tmp_path / "notes.txt").write_text(stdlib_text("textwrap.py", chars=3000))
    command = [sys.executable, "-m", "dualflow.cli", "finetune", "some-org/not-a-model", "--data", "notes.txt"]
    completed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 2 and completed.stderr.count("\n") == 1, completed.stderr
    assert completed.stderr.startswith("dualflow finetune: error: some-org/not-a-model is ")
    assert "the Hub is unreachable" in completed.stderr or "nor a Hub repo you can access" in completed.stderr


def test_a_file_size_limit_at_the_final_save_is_one_line(model_dir, tmp_path):
    # safetensors reports the failed write in a message of its own ("... (os error 27)"), with no errno to read,
    # while the disk has room: the probe write alone would not see it.
    limit = 100 * 1024  # below the weights' size (250 KiB)

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out"
    command = [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, *small_run(tmp_path, "--max-steps", 1)]
    completed = subprocess.run(
        list(map(str, [*command, "--output-dir", out])), preexec_fn=limit_file_size, capture_output=True, text=True
    )
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    assert completed.stderr.strip().splitlines()[-1] == (
        f"dualflow finetune: error: cannot write the output folder {out}: File too large"
    )
    assert not out.exists()


def test_resuming_and_failing_leave_the_users_files_in_the_output_folder(model_dir, tmp_path):
    # Notes and plots made from the kept checkpoints of a stopped run are the user's: no run removes them.
    process, _, command, out = stop_finetune_after_a_checkpoint(model_dir, tmp_path, signal.SIGINT)
    assert process.returncode == 130
    (out / "plots").mkdir()
    user_files = {"my_eval_notes.md": b"checkpoint-1 looks fine", "plots/loss.png": b"\x89PNG not really"}
    for name, content in user_files.items():
        (out / name).write_bytes(content)
    step = int(last_checkpoint(out).name.split("-")[1])
    # A run that fails on resuming (a bad flag found after OUT was taken) removes what it wrote, nothing else.
    failed = subprocess.run(
        list(map(str, [*command, "--max-steps", step + 1, "--lora", "--target-modules", "no_such_module"])),
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 2 and "--target-modules" in failed.stderr, failed.stderr[-3000:]
    assert {name: (out / name).read_bytes() for name in user_files} == user_files
    completed = subprocess.run(list(map(str, [*command, "--max-steps", step + 1])), capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"left as they are in {out}: my_eval_notes.md, plots" in completed.stdout
    assert {name: (out / name).read_bytes() for name in user_files} == user_files
    assert (out / "model.safetensors").is_file() and not (out / UNFINISHED_MARKER).exists()


def test_the_default_saving_keeps_checkpoints_of_a_stopped_run(model_dir, tmp_path):
    # No --save-strategy given: Trainer's saving, every tenth of the run (here every 10 steps), the newest two kept.
    data = tmp_path / "corpus.txt"
    data.write_text(stdlib_text("textwrap.py", chars=6000))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, "--data", data, "--output-dir", out]
    command += ["--block-size", 32, "--batch-size", 4, "--disable-tqdm", "true", "--max-steps", 100]
    process, stderr = stop_once_written(command, tmp_path, CHECKPOINT_SAVED, signal.SIGINT)
    assert process.returncode == 130 and "rerun the same command to go on from the last one" in stderr
    checkpoints = complete_checkpoints(out)
    assert 1 <= len(checkpoints) <= 2 and all(int(path.name.split("-")[1]) % 10 == 0 for path in checkpoints)
    # The checkpoint carries the tokenizer: it is a model folder `dualflow finetune` can start from.
    assert (checkpoints[-1] / "tokenizer_config.json").is_file()


def test_an_interrupted_run_that_saves_no_checkpoint_says_so(model_dir, tmp_path):
    out = tmp_path / "out"
    argv = small_run(tmp_path, "--max-steps", 100_000, "--save-strategy", "no", "--output-dir", out)
    command = [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, *argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # its lines as they are printed
    process = signallable_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        # stopped once training runs: the line printed just before Trainer starts
        while not process.stdout.readline().startswith("train_loss (Trainer's)"):
            assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=300)
    except BaseException:
        process.kill()
        process.communicate()
        raise
    assert process.returncode == 130
    assert stderr.strip().splitlines()[-1] == (
        "dualflow finetune: interrupted; no checkpoint was kept (--save-strategy no): pass --save-strategy steps "
        "--save-steps N to keep one every N steps"
    )
    assert not out.exists()


def test_the_weights_load_in_the_main_thread(tmp_path):
    """
    transformers reads the weights on worker threads; a Ctrl-C can leave the main thread holding a lock of a worker's
    result, and the process then never exits (it joins its workers): the package reads them in the main thread.
    """
    byte_model().save_pretrained(tmp_path / "model", max_shard_size="20KB")
    ran = set()
    threading.settrace(lambda frame, event, arg: ran.add(threading.current_thread().name))
    try:
        model = load_dualflow_model(tmp_path / "model")
    finally:
        threading.settrace(None)
    assert ran == set() and len(list((tmp_path / "model").glob("*.safetensors"))) > 1
    assert torch.equal(model.model.embed_tokens.weight, byte_model().model.embed_tokens.weight)  # loaded in full


def test_ctrl_c_while_the_model_loads_ends_the_run_at_once(tmp_path):
    model = tmp_path / "model"
    byte_model(num_hidden_layers=16).save_pretrained(model, max_shard_size="4KB")  # a hundred shards: a longer load
    ByT5Tokenizer().save_pretrained(model)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "dualflow.cli", "finetune", model, *small_run(tmp_path, "--output-dir", out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the progress bar as it is drawn
    process = signallable_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        progress = b""
        while b"Loading weights" not in progress:  # transformers' progress bar: the weights are being read
            assert process.poll() is None, process.communicate()
            progress += os.read(process.stderr.fileno(), 4096)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    except BaseException:
        process.kill()
        process.communicate()
        raise
    assert process.returncode == 130 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "dualflow finetune: interrupted"  # no checkpoint yet: nothing to say
    assert "trainable parameters" not in stdout  # stopped while loading
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.txt", "model"]  # OUT, made at the start, gone


def test_the_advice_after_a_divergence_works_as_written(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    # A learning rate that diverges after a checkpoint or two (1e6 now diverges at step 2: no earlier checkpoint).
    argv = small_run(tmp_path, "--lr", 30, "--max-steps", 50, "--save-steps", 1, "--eval-blocks", 0)
    assert run_finetune(model_dir, *argv, "--output-dir", out) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    advice = error.split("; to go on, ")[1]
    checkpoint = complete_checkpoints(out)[0]  # the newest two are kept: the older one holds finite weights
    assert advice == (
        f"rerun the same command with {checkpoint} as the model, a lower --learning-rate and another --output-dir"
    )
    # Followed: the checkpoint's weights, a lower learning rate (resuming would restore the one that diverged).
    again = tmp_path / "again"
    argv[argv.index("--lr") + 1] = 1e-4
    assert run_finetune(checkpoint, *argv, "--output-dir", again) == 0, capsys.readouterr().err
    model = AutoModelForCausalLM.from_pretrained(again)
    source = AutoModelForCausalLM.from_pretrained(model_dir)
    assert all(parameter.isfinite().all() for parameter in model.parameters())
    # It went on from the checkpoint's weights (those the learning rate of 1e6 made), not from the source model's.
    assert not torch.equal(model.model.norm.weight, source.model.norm.weight)


def test_a_run_from_a_trainer_checkpoint_saves_the_inference_settings(model_dir, tmp_path):
    # A checkpoint's config holds the training settings (router logits on, Trainer's cache off); a run started from
    # it, as the divergence advice says, saves a model with the inference ones, like a run from the model itself.
    argv = small_run(tmp_path, "--max-steps", 1, "--save-steps", 1, "--eval-blocks", 0)
    first, again = tmp_path / "first", tmp_path / "again"
    assert run_finetune(model_dir, *argv, "--output-dir", first) == 0

    def settings(folder: Path) -> dict:
        config = json.loads((folder / "config.json").read_text())
        return {name: config[name] for name in ("use_cache", "output_router_logits")}

    assert settings(first / "checkpoint-1") == {"use_cache": False, "output_router_logits": True}
    assert run_finetune(first / "checkpoint-1", *argv, "--output-dir", again) == 0
    inference = {"use_cache": True, "output_router_logits": False}
    assert settings(again) == settings(first) == settings(model_dir) == inference
    assert json.loads((again / "generation_config.json").read_text())["use_cache"] is True


def test_the_advice_after_a_full_disk_works_as_written(model_dir, tmp_path):
    # The free-space check passes (it cannot know Trainer's extra files before the first checkpoint); the third
    # checkpoint does not fit. Freeing what the message asks for, on the same disk, lets the same command finish.
    argv = small_run(tmp_path, "--max-steps", 6, "--save-steps", 1, "--eval-blocks", 0)
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "out"
    finetune = [sys.executable, "-m", "dualflow.cli", "finetune", model_dir, *argv, "--output-dir", out]
    script = (
        'mount -t tmpfs -o size=2600k tmpfs "$1" || exit 99; "${@:2}" 2>"$1.err"; cat "$1.err" >&2; '
        'ls -A "$1/out" >"$1.ls"; '
        'mib=$(sed -n "s/.*free at least \\([0-9.]*\\) MiB.*/\\1/p" "$1.err"); [ -n "$mib" ] || exit 98; '
        'mount -o remount,size=$((2600 + $(python3 -c "import math; print(math.ceil($mib * 1024))")))k "$1"; "${@:2}"'
    )
    command = ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script, "bash", disk, *finetune]
    completed = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"cannot write the output folder {out}: No space left on device; checkpoints kept in {out}" in (
        completed.stderr
    )
    # The first run kept its complete checkpoints and nothing half-written, and the marker said it did not end.
    assert (tmp_path / "disk.ls").read_text().split() == ["checkpoint-1", "checkpoint-2", UNFINISHED_MARKER]
    assert "resuming the unfinished run" in completed.stdout and "from its last checkpoint, checkpoint-2" in (
        completed.stdout
    )


def test_resuming_a_run_stopped_after_its_last_step_trains_no_step_more(model_dir, tmp_path):
    # Killed while saving the final model: the last checkpoint is the run's last step.
    command, out = finetune_command(model_dir, tmp_path, "--max-steps", 3, "--eval-blocks", 0)
    assert subprocess.run(list(map(str, command)), capture_output=True).returncode == 0
    for name in ("model.safetensors", "config.json", "README.md"):
        (out / name).unlink()
    (out / UNFINISHED_MARKER).write_text(json.dumps({"command": "finetune"}))
    completed = subprocess.run(list(map(str, command)), capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "checkpoint-3 is the run's last step (3): its weights are the result" in completed.stdout
    assert sorted(path.name for path in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    result = AutoModelForCausalLM.from_pretrained(out)
    last = AutoModelForCausalLM.from_pretrained(out / "checkpoint-3")
    assert all(torch.equal(parameter, last.get_parameter(name)) for name, parameter in result.named_parameters())


def test_finetune_reads_chat_rows_from_parquet_streamed(model_dir, tmp_path, capsys):
    # A chat data set as users bring it: parquet rows with a `messages` list, read with `datasets` as a stream.
    import pyarrow
    import pyarrow.parquet

    model = tmp_path / "chat-model"
    shutil.copytree(model_dir, model)
    tokenizer = ByT5Tokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    )
    tokenizer.save_pretrained(model)
    text = stdlib_text("textwrap.py", chars=6000)
    rows = [
        {
            "messages": [
                {"role": "user", "content": text[i : i + 40]},
                {"role": "assistant", "content": text[i + 40 : i + 100]},
            ]
        }
        for i in range(0, 5900, 100)
    ]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "chats.parquet")
    out = tmp_path / "out"
    argv = ["--data", tmp_path / "chats.parquet", "--streaming", "--output-dir", out, "--block-size", 64]
    assert run_finetune(model, *argv, "--batch-size", 4, "--max-steps", 2, "--disable-tqdm", "true") == 0
    assert "data: " in capsys.readouterr().out
    AutoModelForCausalLM.from_pretrained(out)


def test_the_stop_message_is_the_last_thing_printed_with_progress_bars_on(model_dir, tmp_path):
    # Trainer's progress bar, left open by the stop, used to be redrawn after the message when the program exited.
    command, out = finetune_command(model_dir, tmp_path)
    command.remove("--disable-tqdm")
    command.remove("true")
    process, stderr = stop_once_written([*command, "--max-steps", 100_000], tmp_path, CHECKPOINT_SAVED, signal.SIGTERM)
    assert process.returncode == 143
    assert re.search(r"dualflow finetune: terminated \(SIGTERM\); checkpoints kept in .*\n\Z", stderr), stderr[-500:]
