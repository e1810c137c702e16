"""The `dualflow` command line: the commands it lists, and a --help that imports neither torch nor transformers."""

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from helpers import signallable_process

from dualflow.cli import COMMANDS, main


HEAVY = ("torch", "transformers", "huggingface_hub")


QUANTISATION = ("bitsandbytes", "torchao")


def run_cli(*argv, watch=HEAVY, label="heavy imports", cwd=None) -> subprocess.CompletedProcess:
    """Run `dualflow ARGV` in a new interpreter; its stderr ends with `label: ` and the modules of `watch` it loaded."""
    code = (
        "import sys\nfrom dualflow.cli import main\n"
        "try:\n    status = main(sys.argv[1:])\nexcept SystemExit as exit:\n    status = exit.code\n"
        f"print({label + ':'!r}, [name for name in {watch!r} if sys.modules.get(name)], file=sys.stderr)\n"
        "sys.exit(status)"
    )
    command = [sys.executable, "-c", code, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_help_lists_every_command_without_heavy_imports():
    completed = run_cli("--help")
    assert completed.returncode == 0
    assert completed.stderr.strip() == "heavy imports: []"
    assert set(COMMANDS) == {"demo", "convert", "quantize", "finetune", "push", "compare", "experiment"}
    for name, (_, help_text) in COMMANDS.items():
        assert f"    {name}" in completed.stdout and help_text.split()[0] in completed.stdout


def test_unknown_command_and_missing_command_are_usage_errors_without_heavy_imports():
    for argv in (("frobnicate",), ()):
        completed = run_cli(*argv)
        assert completed.returncode == 2
        assert "usage: dualflow" in completed.stderr and "heavy imports: []" in completed.stderr


def test_each_command_has_its_own_help():
    for name, (module, _) in COMMANDS.items():
        assert (
            f"usage: dualflow {name}" in importlib.import_module(module).build_parser(f"dualflow {name}").format_help()
        )


def test_each_option_states_its_default_at_most_once_and_never_none():
    # argparse's ArgumentDefaultsHelpFormatter appended "(default: None)" after a help text that already gave one.
    for name, (module, _) in COMMANDS.items():
        help_text = importlib.import_module(module).build_parser(f"dualflow {name}").format_help()
        for entry in re.split(r"\n(?=  -)", help_text):
            entry = " ".join(entry.split())  # a wrapped "(default:\n  None)" too
            assert "(default: None)" not in entry and entry.count("(default:") <= 1, (name, entry)


def test_core_tools_work_without_the_instruments_extra():
    # As after `pip install -e .` without extras: matplotlib missing; the tools import and write a model card.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import dualflow.convert.cli, dualflow.finetune, dualflow.hub\n"
        "from helpers import tiny_config\n"
        "from dualflow.model_card import render_model_card\n"
        "assert 'dual-flow' in str(render_model_card(tiny_config(), repo_id='someone/tiny'))\n"
    )
    tests_dir = str(Path(__file__).parent)
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": tests_dir},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]


def test_quantize_without_compressed_tensors_is_one_line(tmp_path):
    # compressed-tensors comes with vLLM, not with this package: without it, one line says what to install.
    code = (
        "import sys; sys.modules['compressed_tensors'] = None\n"
        "from dualflow.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    argv = ["quantize", str(tmp_path / "model"), str(tmp_path / "out")]
    command = [sys.executable, "-c", code, *argv]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2
    assert completed.stderr == (
        "dualflow quantize: error: it needs compressed-tensors (vLLM brings it), not installed: "
        "pip install 'compressed-tensors>=0.17,<0.19'\n"
    )
    assert not (tmp_path / "out").exists()


def test_quantize_refuses_a_compressed_tensors_outside_its_range_before_any_work(tmp_path):
    # `pip install compressed-tensors` gave 0.20.1, which died in the middle of the conversion: the installed version
    # (here its metadata, first on the path) is checked first, before SRC, which does not exist.
    site = tmp_path / "site" / "compressed_tensors-0.20.1.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: compressed-tensors\nVersion: 0.20.1\n")
    command = [sys.executable, "-m", "dualflow.cli", "quantize", str(tmp_path / "model"), str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site.parent), os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 2
    assert completed.stderr == (
        "dualflow quantize: error: it works with compressed-tensors>=0.17,<0.19, not the installed 0.20.1: "
        "pip install 'compressed-tensors>=0.17,<0.19'\n"
    )
    assert not (tmp_path / "out").exists()


def test_version():
    completed = run_cli("--version")
    assert completed.returncode == 0 and completed.stdout.strip() == f"dualflow {version('dualflow-transformers')}"


def test_tests_remove_their_remote_code_module_folder():
    # conftest points HF_MODULES_CACHE at a temporary folder; a test process must not leave it behind.
    code = "import os, conftest\nprint(os.environ['HF_MODULES_CACHE'])"
    env = {key: value for key, value in os.environ.items() if key != "HF_MODULES_CACHE"}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-2000:]
    folder = Path(completed.stdout.strip().splitlines()[-1])
    assert folder.name.startswith("dualflow-hf-modules-") and not folder.exists()


LIGHT_COMMANDS = ("convert", "quantize", "finetune", "push", "demo", "compare", "experiment")


def test_subcommand_help_and_argument_errors_without_heavy_imports():
    for name in LIGHT_COMMANDS:
        completed = run_cli(name, "--help")
        assert completed.returncode == 0 and f"usage: dualflow {name}" in completed.stdout
        assert completed.stderr.strip() == "heavy imports: []", name
        completed = run_cli(name, "--no-such-flag", "x")
        assert completed.returncode == 2 and "heavy imports: []" in completed.stderr, name


def test_help_trainer_lists_trainer_flags_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = run_cli("finetune", "--help-trainer")
    assert first.returncode == 0 and "--max_steps" in first.stdout and "--resume_from_checkpoint" in first.stdout
    assert "torch" in first.stderr  # rendering TrainingArguments' flags imports the trainer
    assert len(list((tmp_path / "dualflow").iterdir())) == 1
    second = run_cli("finetune", "--help-trainer")
    assert second.stdout == first.stdout and second.stderr.strip() == "heavy imports: []"


def test_finetune_help_and_errors_are_short():
    completed = run_cli("finetune", "--help")
    # our own flags only (a screenful): Trainer's hundred-odd are behind --help-trainer
    assert len(completed.stdout.splitlines()) < 70 and "--help-trainer" in completed.stdout
    assert completed.stdout.index("--data") < completed.stdout.index("--help-trainer")
    completed = run_cli("finetune")  # no model, no --data: the short usage and one error line
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        "usage: dualflow finetune MODEL --data FILE [--output-dir DIR] [options] [TrainingArguments flags]",
        "dualflow finetune: error: the following arguments are required: model, --data",
        "heavy imports: []",
    ]
    notes = Path(os.__file__)  # a data file that exists
    completed = run_cli("finetune", "some/model", "--data", notes, "--max-steps", "many", watch=QUANTISATION)
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        "dualflow finetune: error: argument --max_steps/--max-steps: invalid int value: 'many'",
        "heavy imports: []",  # of bitsandbytes and torchao: a run that quantises nothing leaves them out
    ]


def test_only_a_qlora_run_loads_bitsandbytes_and_no_command_loads_torchao():
    """
    Loaded, both speak before a command's own output (bitsandbytes fetches its CPU kernel from the Hub on CPUs with
    AVX512-BF16 and logs when it cannot; torchao logs that its CUDA kernels do not load on a CPU-only torch).
    """
    assert all(importlib.util.find_spec(name) for name in QUANTISATION)  # installed: the test extra has both
    notes = str(Path(os.__file__))
    argv = ("finetune", "some/model", "--data", notes, "--lora", "--load-in-4bit", "--max-steps", "many")
    completed = run_cli(*argv, watch=QUANTISATION, label="loaded")
    assert completed.returncode == 2
    assert completed.stderr.splitlines()[-2:] == [
        "dualflow finetune: error: argument --max_steps/--max-steps: invalid int value: 'many'",
        "loaded: ['bitsandbytes']",
    ]
    completed = run_cli("convert", notes, "out", "--aux-top-k", "0", watch=QUANTISATION, label="loaded")
    assert completed.returncode == 2 and completed.stderr.splitlines()[-1] == "loaded: []"


@pytest.mark.parametrize("entry", ["data/notes.parqet", "notes.jsnol", "data/notes.txt"])
def test_a_missing_local_data_path_is_refused_before_torch_loads(tmp_path, entry):
    (tmp_path / "data").mkdir()  # `data/...` is a local path, not the Hub dataset "notes.parqet" of user "data"
    completed = run_cli("finetune", "some/model", "--data", entry, cwd=tmp_path)
    assert completed.returncode == 2
    assert completed.stderr.splitlines() == [
        f"dualflow finetune: error: data file {entry} does not exist",
        "heavy imports: []",
    ]


def test_only_user_errors_are_one_line_exits(tmp_path, monkeypatch, capsys):
    # A DualFlowUserError is the user's mistake: one line, exit 2.
    assert main(["push", str(tmp_path / "missing"), "someone/model"]) == 2
    assert capsys.readouterr().err == f"dualflow push: error: {tmp_path / 'missing'} is not a folder\n"
    # Any other exception is a bug in our code: it reaches the caller with its traceback, even a ValueError.
    import dualflow.hub

    def buggy_check(folder):
        raise ValueError("a bug")

    monkeypatch.setattr(dualflow.hub, "check_upload_folder", buggy_check)
    with pytest.raises(ValueError, match="a bug"):
        main(["push", str(tmp_path), "someone/model"])


def test_experiment_checks_matplotlib_before_training(tmp_path):
    code = "import sys; sys.modules['matplotlib'] = None\nfrom dualflow.cli import main\nsys.exit(main(sys.argv[1:]))"
    out = tmp_path / "runs"
    command = [sys.executable, "-c", code, "experiment", "--quick", "--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [
        "dualflow experiment: error: plots need matplotlib: pip install 'dualflow-transformers[instruments]' "
        "(or pip install matplotlib)"
    ]
    assert not out.exists()  # nothing trained, nothing written


def test_ctrl_c_of_a_parallel_experiment_is_one_line(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the workers stay quiet, the command ends in one line."""
    command = [sys.executable, "-m", "dualflow.cli", "experiment", "--quick", "--seeds", "1", "--jobs", "2"]
    # Steps enough that the runs are still training when the signal comes (quick runs end in under a second).
    command += ["--arms", "single k2", "dual kp2 ka4", "--steps", "100000", "--out", str(tmp_path / "runs")]
    process = signallable_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    try:
        deadline = time.monotonic() + 300
        while len(children.read_text().split()) < 2:  # both workers of the pool are up
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        time.sleep(1)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:  # a failed test must not leave 100000-step runs training in the background
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130
    assert "Traceback" not in stderr and "ForkPoolWorker" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "dualflow experiment: interrupted"


# Notes about the machine something was measured on, or paths of this repository a user of the package does not have.
MACHINE_OR_REPOSITORY_NOTE = re.compile(
    r"\d-core|\bcores\b|busy|load average|\bVM\b|docs/|tests/|benchmarks/|DESIGN §|design\.md"
)


def test_shipped_code_speaks_to_users():
    root = Path(__file__).parent.parent
    shipped = sorted((root / "dualflow").rglob("*.py")) + sorted((root / "modeling_dualflow").glob("*.py"))
    shipped += sorted((root / "convert").glob("*.py")) + sorted((root / "model_cards").glob("*.md"))
    notes = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in shipped
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if MACHINE_OR_REPOSITORY_NOTE.search(line)
    ]
    assert notes == []
